//! One client connection: its socket, input buffer, output buffer (written without blocking as
//! the socket allows), where it is in the request/response cycle, and its read deadline. Over
//! TLS the socket's bytes pass through a rustls session: reads feed it records and take its
//! plaintext, writes hand it plaintext and send its records, the handshake advancing on both
//! as the non-blocking socket allows.

use std::io::{self, Read, Write};
use std::time::Instant;

use mio::net::TcpStream;

use super::request::Head;
use super::{EventWriter, RequestTiming};
use crate::engine::RequestId;

/// Where a connection is in its request/response cycle.
pub(crate) enum ConnState {
    /// Waiting for (the rest of) a request head.
    Head,
    /// Head parsed; waiting for `head.content_length` body bytes.
    Body(Head),
    /// A generation is running; its events go to the writer. `ids[i]` is the engine request of
    /// choice `i` (one, unless the request asked for several choices).
    Generating {
        ids: Vec<RequestId>,
        writer: Box<dyn EventWriter>,
        streaming: bool,
        timing: RequestTiming,
    },
    /// The response is queued in the output buffer; once written, the connection is reused
    /// (keep-alive) or closed.
    Responding,
}

/// What a read pass found.
pub(crate) struct ReadOutcome {
    /// The peer closed its side (read returned 0).
    pub eof: bool,
    /// The socket failed (reset, ...).
    pub failed: bool,
    /// Stopped because the input buffer hit its cap; there may be more to read.
    pub capped: bool,
}

pub(crate) struct Conn {
    pub stream: TcpStream,
    pub inbuf: Vec<u8>,
    /// Bytes to send (from `out_pos` on).
    pub out: Vec<u8>,
    out_pos: usize,
    pub state: ConnState,
    /// Whether the connection stays open after the current response.
    pub keep_alive: bool,
    /// When the current request head started arriving (or the connection/idle period began).
    pub head_started: Instant,
    /// Read deadline in the Head/Body states.
    pub deadline: Option<Instant>,
    /// Requests completed on this connection.
    pub served: u64,
    pub peer_closed: bool,
    /// The TLS session (None: plain HTTP).
    pub tls: Option<Box<rustls::ServerConnection>>,
}

impl Conn {
    pub fn new(stream: TcpStream, now: Instant, deadline: Instant) -> Self {
        Self {
            stream,
            inbuf: Vec::new(),
            out: Vec::new(),
            out_pos: 0,
            state: ConnState::Head,
            keep_alive: true,
            head_started: now,
            deadline: Some(deadline),
            served: 0,
            peer_closed: false,
            tls: None,
        }
    }

    /// Reads everything available (up to `cap` buffered bytes).
    pub fn read_available(&mut self, cap: usize) -> ReadOutcome {
        let mut out = ReadOutcome {
            eof: false,
            failed: false,
            capped: false,
        };
        if self.tls.is_some() {
            return self.read_tls(cap, out);
        }
        let mut tmp = [0u8; 16 * 1024];
        loop {
            if self.inbuf.len() >= cap {
                out.capped = true;
                return out;
            }
            match self.stream.read(&mut tmp) {
                Ok(0) => {
                    out.eof = true;
                    self.peer_closed = true;
                    return out;
                }
                Ok(n) => self.inbuf.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return out,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    out.failed = true;
                    return out;
                }
            }
        }
    }

    /// Appends bytes to send.
    pub fn queue(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    /// Unsent bytes; over TLS, records the session still holds count as one more.
    pub fn pending_output(&self) -> usize {
        let records = self.tls.as_ref().is_some_and(|t| t.wants_write());
        self.out.len() - self.out_pos + usize::from(records)
    }

    /// Writes as much queued output as the socket takes. Err = the connection is dead.
    pub fn flush(&mut self) -> io::Result<()> {
        if self.tls.is_some() {
            self.flush_tls()?;
            self.compact();
            return Ok(());
        }
        while self.out_pos < self.out.len() {
            match self.stream.write(&self.out[self.out_pos..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        self.compact();
        Ok(())
    }

    /// Drops the bytes already sent from the output buffer.
    fn compact(&mut self) {
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
        } else if self.out_pos > 64 * 1024 && self.out_pos * 2 > self.out.len() {
            self.out.drain(..self.out_pos);
            self.out_pos = 0;
        }
    }

    /// The engine requests of the generation under way (empty when none is).
    pub fn request_ids(&self) -> &[RequestId] {
        match &self.state {
            ConnState::Generating { ids, .. } => ids,
            _ => &[],
        }
    }
}

/// TLS: the session between the socket and the buffers.
impl Conn {
    /// `read_available` over TLS: records from the socket into the session, its plaintext
    /// into `inbuf`, and its handshake replies (or alerts) back out at once.
    fn read_tls(&mut self, cap: usize, mut out: ReadOutcome) -> ReadOutcome {
        let mut tmp = [0u8; 16 * 1024];
        loop {
            let Some(tls) = self.tls.as_mut() else {
                return out;
            };
            // Plaintext the session already holds comes first.
            loop {
                if self.inbuf.len() >= cap {
                    out.capped = true;
                    return out;
                }
                match tls.reader().read(&mut tmp) {
                    Ok(n) if n > 0 => self.inbuf.extend_from_slice(&tmp[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    // 0: the peer's close_notify; an error: it closed without one.
                    _ => {
                        out.eof = true;
                        self.peer_closed = true;
                        return out;
                    }
                }
            }
            match tls.read_tls(&mut self.stream) {
                Ok(0) => {
                    out.eof = true;
                    self.peer_closed = true;
                    return out;
                }
                Ok(_) => {
                    if let Err(e) = tls.process_new_packets() {
                        // Not TLS (say, plain HTTP on the TLS port) or a broken handshake: the
                        // alert rustls queued goes out, then the connection is closed.
                        tracing::debug!("TLS connection refused: {e}");
                        let _ = write_records(tls, &mut self.stream);
                        out.failed = true;
                        return out;
                    }
                    if self.flush_tls().is_err() {
                        out.failed = true;
                        return out;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return out,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    out.failed = true;
                    return out;
                }
            }
        }
    }

    /// `flush` over TLS: queued plaintext into the session, its records onto the socket, until
    /// the socket would block or everything is sent.
    fn flush_tls(&mut self) -> io::Result<()> {
        let Some(tls) = self.tls.as_mut() else {
            return Ok(());
        };
        loop {
            let mut moved = 0;
            if self.out_pos < self.out.len() {
                moved = tls.writer().write(&self.out[self.out_pos..])?;
                self.out_pos += moved;
            }
            let blocked = write_records(tls, &mut self.stream)?;
            // `moved == 0`: the session takes no more before its handshake is done; the rest
            // follows when the handshake completes (read_tls flushes then).
            if blocked || moved == 0 || self.out_pos == self.out.len() {
                return Ok(());
            }
        }
    }
}

/// Sends the session's pending records; Ok(true) when the socket would block.
fn write_records(tls: &mut rustls::ServerConnection, stream: &mut TcpStream) -> io::Result<bool> {
    while tls.wants_write() {
        match tls.write_tls(stream) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

impl Drop for Conn {
    /// A TLS connection says close_notify before its socket closes (best effort: what the
    /// socket does not take at once is dropped).
    fn drop(&mut self) {
        if let Some(tls) = self.tls.as_mut() {
            tls.send_close_notify();
            let _ = write_records(tls, &mut self.stream);
        }
    }
}

//! One client connection: its socket, input buffer, output buffer (written without blocking as
//! the socket allows), where it is in the request/response cycle, and its read deadline.

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
        }
    }

    /// Reads everything available (up to `cap` buffered bytes).
    pub fn read_available(&mut self, cap: usize) -> ReadOutcome {
        let mut out = ReadOutcome {
            eof: false,
            failed: false,
            capped: false,
        };
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

    pub fn pending_output(&self) -> usize {
        self.out.len() - self.out_pos
    }

    /// Writes as much queued output as the socket takes. Err = the connection is dead.
    pub fn flush(&mut self) -> io::Result<()> {
        while self.out_pos < self.out.len() {
            match self.stream.write(&self.out[self.out_pos..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
        } else if self.out_pos > 64 * 1024 && self.out_pos * 2 > self.out.len() {
            self.out.drain(..self.out_pos);
            self.out_pos = 0;
        }
        Ok(())
    }

    /// The engine requests of the generation under way (empty when none is).
    pub fn request_ids(&self) -> &[RequestId] {
        match &self.state {
            ConnState::Generating { ids, .. } => ids,
            _ => &[],
        }
    }
}

//! A small blocking HTTP/1.1 client over std `TcpStream`: one request per connection
//! (`Connection: close`), response bodies framed by Content-Length, chunked transfer encoding or
//! connection close, handed out as decoded pieces stamped with the `Instant` they arrived.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Most response header lines we accept.
const MAX_HEADERS: usize = 64;
/// Largest response head we accept before giving up.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Socket read size.
const READ_CHUNK: usize = 16 * 1024;

/// Why an HTTP exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot resolve {0}")]
    Resolve(String),
    #[error("connect to {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("timed out {0}")]
    Timeout(&'static str),
    #[error("i/o while {action}: {source}")]
    Io {
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed response: {0}")]
    Malformed(String),
    #[error("connection closed {0}")]
    Closed(&'static str),
}

/// Where requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpTarget {
    pub host: String,
    pub port: u16,
}

impl HttpTarget {
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        HttpTarget {
            host: host.into(),
            port,
        }
    }

    /// `host:port`, with IPv6 literals bracketed, as used in the Host header.
    pub fn authority(&self) -> String {
        if self.host.contains(':') && !self.host.starts_with('[') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Time limits of one exchange.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Limit on establishing the TCP connection.
    pub connect: Duration,
    /// Limit on the whole exchange, from connect to the last body byte.
    pub total: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(10),
            total: Duration::from_secs(600),
        }
    }
}

/// Status line and headers of a response.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    pub status: u16,
    pub reason: String,
    pub headers: Vec<(String, String)>,
}

impl ResponseHead {
    /// First header with this name (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// How the end of the body is found.
#[derive(Debug)]
enum Framing {
    /// Content-Length: this many bytes are still to come.
    Length(u64),
    /// Transfer-Encoding: chunked, in this decoder state.
    Chunked(ChunkState),
    /// No length: the body ends when the server closes.
    UntilClose,
    /// The body is complete.
    Done,
}

#[derive(Debug, Clone, Copy)]
enum ChunkState {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk's data with this many bytes left.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last (zero) chunk: trailer lines up to an empty line.
    Trailers,
}

/// A response body being received; `next_piece` hands out decoded bytes as they arrive.
pub struct ResponseBody {
    stream: TcpStream,
    /// Raw bytes received and not yet decoded.
    raw: Vec<u8>,
    /// When the last socket read returned.
    raw_at: Instant,
    framing: Framing,
    deadline: Instant,
}

/// One request to send.
#[derive(Debug, Clone, Copy)]
pub struct HttpRequest<'a> {
    pub method: &'a str,
    pub path: &'a str,
    /// Extra headers; Host, Content-Length and Connection are added.
    pub headers: &'a [(&'a str, &'a str)],
    pub body: &'a [u8],
}

/// Connects, sends `req`, and reads the response head. The body is left to the caller.
pub fn send(
    target: &HttpTarget,
    req: &HttpRequest<'_>,
    timeouts: Timeouts,
) -> Result<(ResponseHead, ResponseBody), HttpError> {
    let deadline = Instant::now() + timeouts.total;
    let mut stream = connect(target, timeouts.connect)?;
    stream.set_nodelay(true).ok();
    let mut head = format!(
        "{} {} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
        req.method,
        req.path,
        target.authority()
    );
    for (name, value) in req.headers {
        head.push_str(name);
        head.push_str(": ");
        head.push_str(value);
        head.push_str("\r\n");
    }
    if !req.body.is_empty() || req.method.eq_ignore_ascii_case("POST") {
        head.push_str(&format!("Content-Length: {}\r\n", req.body.len()));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(req.body);
    set_timeouts(&stream, deadline)?;
    stream
        .write_all(&out)
        .map_err(|e| io_error("sending the request", e))?;

    let mut raw = Vec::with_capacity(READ_CHUNK);
    let mut raw_at = Instant::now();
    loop {
        let parsed = parse_head(&raw)?;
        if let Some((head, used)) = parsed {
            raw.drain(..used);
            if (100..200).contains(&head.status) {
                // Interim response (e.g. 100 Continue): the real one follows.
                continue;
            }
            let framing = framing_for(&head, req.method)?;
            let body = ResponseBody {
                stream,
                raw,
                raw_at,
                framing,
                deadline,
            };
            return Ok((head, body));
        }
        if raw.len() > MAX_HEAD_BYTES {
            return Err(HttpError::Malformed(format!(
                "response head longer than {MAX_HEAD_BYTES} bytes"
            )));
        }
        if read_more(&mut stream, &mut raw, deadline, "reading the response head")? == 0 {
            return Err(HttpError::Closed("before the response head was complete"));
        }
        raw_at = Instant::now();
    }
}

/// Sends a request and reads the whole body as text (for health checks and model lists).
pub fn fetch_text(
    target: &HttpTarget,
    req: &HttpRequest<'_>,
    timeouts: Timeouts,
) -> Result<(u16, String), HttpError> {
    let (head, mut body) = send(target, req, timeouts)?;
    let mut bytes = Vec::new();
    while let Some((piece, _)) = body.next_piece()? {
        bytes.extend_from_slice(&piece);
    }
    Ok((head.status, String::from_utf8_lossy(&bytes).into_owned()))
}

/// Whether a TCP connection to `target` can be opened within `timeout` (it is closed again at
/// once); Err says why not in a few words ("connection refused", "timed out after 2s", ...).
pub fn check_reachable(target: &HttpTarget, timeout: Duration) -> Result<(), String> {
    match connect(target, timeout) {
        Ok(_) => Ok(()),
        Err(HttpError::Resolve(addr)) => Err(format!("cannot resolve {addr}")),
        Err(HttpError::Connect { source, .. }) => Err(match source.kind() {
            std::io::ErrorKind::ConnectionRefused => "connection refused".to_string(),
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
                format!("timed out after {}s", timeout.as_secs_f64())
            }
            _ => source.to_string(),
        }),
        Err(e) => Err(e.to_string()),
    }
}

fn connect(target: &HttpTarget, timeout: Duration) -> Result<TcpStream, HttpError> {
    let addrs: Vec<_> = (target.host.as_str(), target.port)
        .to_socket_addrs()
        .map_err(|_| HttpError::Resolve(target.authority()))?
        .collect();
    if addrs.is_empty() {
        return Err(HttpError::Resolve(target.authority()));
    }
    let mut last = None;
    for addr in &addrs {
        match TcpStream::connect_timeout(addr, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(HttpError::Connect {
        addr: target.authority(),
        source: last.unwrap_or_else(|| std::io::Error::other("no address")),
    })
}

fn io_error(action: &'static str, e: std::io::Error) -> HttpError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            HttpError::Timeout("waiting for the server")
        }
        _ => HttpError::Io { action, source: e },
    }
}

fn set_timeouts(stream: &TcpStream, deadline: Instant) -> Result<(), HttpError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(HttpError::Timeout("waiting for the server"));
    }
    stream
        .set_read_timeout(Some(left))
        .and_then(|_| stream.set_write_timeout(Some(left)))
        .map_err(|e| io_error("setting socket timeouts", e))
}

/// Reads once from the socket into `raw`; returns the number of bytes (0 = closed).
fn read_more(
    stream: &mut TcpStream,
    raw: &mut Vec<u8>,
    deadline: Instant,
    action: &'static str,
) -> Result<usize, HttpError> {
    set_timeouts(stream, deadline)?;
    let mut buf = [0u8; READ_CHUNK];
    loop {
        match stream.read(&mut buf) {
            Ok(n) => {
                raw.extend_from_slice(&buf[..n]);
                return Ok(n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error(action, e)),
        }
    }
}

fn parse_head(raw: &[u8]) -> Result<Option<(ResponseHead, usize)>, HttpError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    match resp.parse(raw) {
        Ok(httparse::Status::Complete(used)) => {
            let head = ResponseHead {
                status: resp.code.unwrap_or(0),
                reason: resp.reason.unwrap_or("").to_string(),
                headers: resp
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_string(),
                            String::from_utf8_lossy(h.value).trim().to_string(),
                        )
                    })
                    .collect(),
            };
            Ok(Some((head, used)))
        }
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(HttpError::Malformed(format!("response head: {e}"))),
    }
}

fn framing_for(head: &ResponseHead, method: &str) -> Result<Framing, HttpError> {
    if method.eq_ignore_ascii_case("HEAD") || head.status == 204 || head.status == 304 {
        return Ok(Framing::Done);
    }
    if let Some(te) = head.header("transfer-encoding") {
        if te
            .rsplit(',')
            .next()
            .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"))
        {
            return Ok(Framing::Chunked(ChunkState::Size));
        }
        return Ok(Framing::UntilClose);
    }
    if let Some(len) = head.header("content-length") {
        let n: u64 = len
            .parse()
            .map_err(|_| HttpError::Malformed(format!("Content-Length {len:?}")))?;
        return Ok(if n == 0 {
            Framing::Done
        } else {
            Framing::Length(n)
        });
    }
    Ok(Framing::UntilClose)
}

impl ResponseBody {
    /// The next piece of decoded body bytes with the instant the socket read that delivered its
    /// last byte returned; `None` once the body is complete.
    pub fn next_piece(&mut self) -> Result<Option<(Vec<u8>, Instant)>, HttpError> {
        loop {
            if let Some(piece) = self.decode_buffered()? {
                return Ok(Some((piece, self.raw_at)));
            }
            if matches!(self.framing, Framing::Done) {
                return Ok(None);
            }
            let n = read_more(
                &mut self.stream,
                &mut self.raw,
                self.deadline,
                "reading the response body",
            )?;
            if n == 0 {
                return match self.framing {
                    Framing::UntilClose => {
                        self.framing = Framing::Done;
                        Ok(None)
                    }
                    Framing::Length(_) => {
                        Err(HttpError::Closed("before Content-Length bytes arrived"))
                    }
                    _ => Err(HttpError::Closed("before the last chunk")),
                };
            }
            self.raw_at = Instant::now();
        }
    }

    /// Decodes what is buffered; `Some` when it produced body bytes, `None` when it needs more
    /// input (or the body is done).
    fn decode_buffered(&mut self) -> Result<Option<Vec<u8>>, HttpError> {
        let mut out = Vec::new();
        loop {
            match self.framing {
                Framing::Done => break,
                Framing::UntilClose => {
                    out.append(&mut self.raw);
                    break;
                }
                Framing::Length(left) => {
                    let take = (left.min(self.raw.len() as u64)) as usize;
                    out.extend(self.raw.drain(..take));
                    let left = left - take as u64;
                    self.framing = if left == 0 {
                        Framing::Done
                    } else {
                        Framing::Length(left)
                    };
                    break;
                }
                Framing::Chunked(state) => {
                    if !self.step_chunked(state, &mut out)? {
                        break;
                    }
                }
            }
        }
        Ok(if out.is_empty() { None } else { Some(out) })
    }

    /// One step of the chunked decoder; false when more input is needed.
    fn step_chunked(&mut self, state: ChunkState, out: &mut Vec<u8>) -> Result<bool, HttpError> {
        match state {
            ChunkState::Size => {
                let Some(line) = take_line(&mut self.raw)? else {
                    return Ok(false);
                };
                let size_text = line.split(';').next().unwrap_or("").trim();
                let size = u64::from_str_radix(size_text, 16)
                    .map_err(|_| HttpError::Malformed(format!("chunk size {size_text:?}")))?;
                self.framing = Framing::Chunked(if size == 0 {
                    ChunkState::Trailers
                } else {
                    ChunkState::Data(size)
                });
            }
            ChunkState::Data(left) => {
                if self.raw.is_empty() {
                    return Ok(false);
                }
                let take = (left.min(self.raw.len() as u64)) as usize;
                out.extend(self.raw.drain(..take));
                let left = left - take as u64;
                self.framing = Framing::Chunked(if left == 0 {
                    ChunkState::DataEnd
                } else {
                    ChunkState::Data(left)
                });
            }
            ChunkState::DataEnd => {
                let Some(line) = take_line(&mut self.raw)? else {
                    return Ok(false);
                };
                if !line.is_empty() {
                    return Err(HttpError::Malformed(
                        "chunk data not followed by CRLF".to_string(),
                    ));
                }
                self.framing = Framing::Chunked(ChunkState::Size);
            }
            ChunkState::Trailers => {
                let Some(line) = take_line(&mut self.raw)? else {
                    return Ok(false);
                };
                if line.is_empty() {
                    self.framing = Framing::Done;
                }
            }
        }
        Ok(true)
    }
}

/// Removes one CRLF- (or LF-) terminated line from the front of `raw`.
fn take_line(raw: &mut Vec<u8>) -> Result<Option<String>, HttpError> {
    let Some(pos) = raw.iter().position(|&b| b == b'\n') else {
        if raw.len() > MAX_HEAD_BYTES {
            return Err(HttpError::Malformed("chunk framing line too long".into()));
        }
        return Ok(None);
    };
    let mut line: Vec<u8> = raw.drain(..=pos).collect();
    line.pop();
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    Ok(Some(String::from_utf8_lossy(&line).into_owned()))
}

/// Splits a byte stream into text lines at `\n` (a trailing `\r` is removed), keeping a partial
/// last line until it is completed or the stream ends.
#[derive(Debug, Default)]
pub struct LineSplitter {
    pending: Vec<u8>,
}

impl LineSplitter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds bytes and returns every line they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut lines = Vec::new();
        for &b in bytes {
            if b == b'\n' {
                let mut line = std::mem::take(&mut self.pending);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                lines.push(String::from_utf8_lossy(&line).into_owned());
            } else {
                self.pending.push(b);
            }
        }
        lines
    }

    /// The unterminated last line, if any.
    pub fn finish(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let mut line = std::mem::take(&mut self.pending);
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        Some(String::from_utf8_lossy(&line).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_splitter_keeps_partial_lines_and_strips_cr() {
        let mut s = LineSplitter::new();
        assert_eq!(s.push(b"ab"), Vec::<String>::new());
        assert_eq!(s.push(b"c\r\nde\n\nf"), vec!["abc", "de", ""]);
        assert_eq!(s.finish().as_deref(), Some("f"));
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn take_line_handles_lf_and_crlf() {
        let mut raw = b"1a;ext=1\r\nrest".to_vec();
        assert_eq!(take_line(&mut raw).unwrap().as_deref(), Some("1a;ext=1"));
        assert_eq!(raw, b"rest");
        assert_eq!(take_line(&mut raw).unwrap(), None);
    }

    #[test]
    fn head_parsing_and_framing() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX: y\r\n\r\n5\r\nhello";
        let (head, used) = parse_head(raw).unwrap().unwrap();
        assert_eq!(head.status, 200);
        assert_eq!(head.header("x"), Some("y"));
        assert_eq!(&raw[used..], b"5\r\nhello");
        assert!(matches!(
            framing_for(&head, "POST").unwrap(),
            Framing::Chunked(ChunkState::Size)
        ));
        let partial = b"HTTP/1.1 200 OK\r\nContent-Le";
        assert!(parse_head(partial).unwrap().is_none());
        let bad = ResponseHead {
            status: 200,
            reason: String::new(),
            headers: vec![("Content-Length".into(), "x1".into())],
        };
        assert!(framing_for(&bad, "POST").is_err());
    }

    #[test]
    fn authority_brackets_ipv6() {
        assert_eq!(HttpTarget::new("::1", 80).authority(), "[::1]:80");
        assert_eq!(HttpTarget::new("localhost", 8).authority(), "localhost:8");
    }
}

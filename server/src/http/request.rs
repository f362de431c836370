//! Request heads: parsing with httparse, the framing rules this server accepts (Content-Length
//! bodies only, HTTP/1.0 and 1.1, keep-alive), and the `Request` handed to the API layer.

use std::time::Instant;

/// Most header lines a request may have.
const MAX_HEADERS: usize = 64;

/// A complete request as the API layer sees it.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    /// Percent-decoded path without the query.
    pub path: String,
    pub query: Option<String>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// When its first byte arrived.
    pub arrived: Instant,
}

impl Request {
    /// The first header of that name (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A parsed head, before its body is read.
#[derive(Debug)]
pub(crate) struct Head {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    pub headers: Vec<(String, String)>,
    pub content_length: u64,
    pub keep_alive: bool,
    pub expect_continue: bool,
}

/// A request the server refuses before the API sees it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Refusal {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    /// The path, when the head got far enough to have one.
    pub path: Option<String>,
}

impl Refusal {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            path: None,
        }
    }
}

pub(crate) enum HeadParse {
    /// Need more bytes.
    Partial,
    /// The head and the number of bytes it took.
    Complete(Head, usize),
    Refused(Refusal),
}

/// Parses a request head from the start of `buf`.
pub(crate) fn parse_head(buf: &[u8], max_body_bytes: u64) -> HeadParse {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let consumed = match req.parse(buf) {
        Ok(httparse::Status::Partial) => return HeadParse::Partial,
        Ok(httparse::Status::Complete(n)) => n,
        Err(httparse::Error::TooManyHeaders) => {
            return HeadParse::Refused(Refusal::new(
                431,
                "request_header_fields_too_large",
                format!("more than {MAX_HEADERS} header lines"),
            ))
        }
        Err(e) => {
            return HeadParse::Refused(Refusal::new(
                400,
                "bad_request",
                format!("malformed HTTP request head: {e}"),
            ))
        }
    };
    let method = req.method.unwrap_or("").to_string();
    let target = req.path.unwrap_or("/");
    let version = req.version.unwrap_or(1);
    let (raw_path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q.to_string())),
        None => (target, None),
    };
    let path = percent_decode(raw_path);
    let refuse = |status, kind, message: String| {
        let mut r = Refusal::new(status, kind, message);
        r.path = Some(path.clone());
        HeadParse::Refused(r)
    };
    if version > 1 {
        return refuse(
            505,
            "http_version_not_supported",
            "only HTTP/1.0 and HTTP/1.1".into(),
        );
    }

    let mut out_headers = Vec::with_capacity(req.headers.len());
    let mut content_length: Option<u64> = None;
    let mut connection_close = false;
    let mut connection_keep_alive = false;
    let mut expect_continue = false;
    for h in req.headers.iter() {
        let Ok(value) = std::str::from_utf8(h.value) else {
            return refuse(
                400,
                "bad_request",
                format!("header {} is not UTF-8", h.name),
            );
        };
        let value = value.trim();
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            // Digits only (RFC 9110 8.6): "+5", "5 ", "0x5" or "5, 5" could be read differently
            // by a proxy in front, and two readings of one body are a smuggling risk.
            let digits = !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit());
            let Some(n) = digits.then(|| value.parse::<u64>().ok()).flatten() else {
                return refuse(
                    400,
                    "bad_request",
                    format!("Content-Length {value:?} is not a length in digits only (0..=2^64-1)"),
                );
            };
            if content_length.is_some_and(|old| old != n) {
                return refuse(
                    400,
                    "bad_request",
                    "conflicting Content-Length headers".into(),
                );
            }
            content_length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            if value.to_ascii_lowercase().contains("chunked") {
                return refuse(
                    411,
                    "length_required",
                    "chunked request bodies are not supported: send the body with Content-Length"
                        .into(),
                );
            }
            return refuse(
                501,
                "not_implemented",
                format!("Transfer-Encoding {value:?} is not supported"),
            );
        } else if name.eq_ignore_ascii_case("connection") {
            for token in value.split(',') {
                let t = token.trim();
                connection_close |= t.eq_ignore_ascii_case("close");
                connection_keep_alive |= t.eq_ignore_ascii_case("keep-alive");
            }
        } else if name.eq_ignore_ascii_case("expect") {
            if value.eq_ignore_ascii_case("100-continue") {
                expect_continue = true;
            } else {
                return refuse(
                    417,
                    "expectation_failed",
                    format!("Expect {value:?} is not supported"),
                );
            }
        }
        out_headers.push((name.to_string(), value.to_string()));
    }
    let content_length = content_length.unwrap_or(0);
    if content_length > max_body_bytes {
        return refuse(
            413,
            "payload_too_large",
            format!("request body of {content_length} bytes is over the limit of {max_body_bytes} bytes"),
        );
    }
    let keep_alive = if version == 1 {
        !connection_close
    } else {
        connection_keep_alive && !connection_close
    };
    HeadParse::Complete(
        Head {
            method,
            path,
            query,
            headers: out_headers,
            content_length,
            keep_alive,
            expect_continue,
        },
        consumed,
    )
}

/// The head at the front of a connection's input under the server's limits: `parse_head`, plus
/// the head-size limit (a head still incomplete past it, or complete but longer, is a 431).
pub(crate) fn frame_head(inbuf: &[u8], limits: &super::HttpLimits) -> HeadParse {
    let too_large = |message: String, path: Option<String>| {
        HeadParse::Refused(Refusal {
            status: 431,
            kind: "request_header_fields_too_large",
            message,
            path,
        })
    };
    match parse_head(inbuf, limits.max_body_bytes) {
        HeadParse::Partial if inbuf.len() > limits.max_header_bytes => too_large(
            format!(
                "request head is over the limit of {} bytes",
                limits.max_header_bytes
            ),
            None,
        ),
        HeadParse::Complete(head, n) if n > limits.max_header_bytes => too_large(
            format!(
                "request head of {n} bytes is over the limit of {} bytes",
                limits.max_header_bytes
            ),
            Some(head.path),
        ),
        other => other,
    }
}

/// What one connection's input makes, read as the server reads it: pipelined requests one after
/// another, each a head (`frame_head`) and a Content-Length body, until the input ends inside
/// a request (`incomplete`) or a head is refused (the server answers that and closes).
#[derive(Debug, Default)]
pub struct FramedInput {
    pub requests: Vec<Request>,
    /// (status, message) of the refusal that ended the connection.
    pub refused: Option<(u16, String)>,
    /// Bytes left over inside an unfinished head or body.
    pub incomplete: usize,
    /// `100 Continue` interim answers the server would send.
    pub continues: usize,
}

/// Frames `input` as one connection's bytes (see [`FramedInput`]).
pub fn frame_input(input: &[u8], limits: &super::HttpLimits) -> FramedInput {
    let mut out = FramedInput::default();
    let mut rest = input;
    let now = Instant::now();
    while !rest.is_empty() {
        match frame_head(rest, limits) {
            HeadParse::Partial => break,
            HeadParse::Refused(r) => {
                out.refused = Some((r.status, r.message));
                return out;
            }
            HeadParse::Complete(head, n) => {
                let after = &rest[n..];
                if head.expect_continue && (after.len() as u64) < head.content_length {
                    out.continues += 1;
                }
                // `content_length <= max_body_bytes` was checked by the head's parse.
                let need = head.content_length as usize;
                if after.len() < need {
                    break;
                }
                out.requests.push(Request {
                    method: head.method,
                    path: head.path,
                    query: head.query,
                    headers: head.headers,
                    body: after[..need].to_vec(),
                    arrived: now,
                });
                rest = &after[need..];
                if !head.keep_alive {
                    // The server closes after answering: later bytes are never read.
                    return out;
                }
            }
        }
    }
    out.incomplete = rest.len();
    out
}

/// Decodes %XX escapes (invalid escapes are kept as written).
fn percent_decode(s: &str) -> String {
    if !s.contains('%') {
        return s.to_string();
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(buf: &[u8]) -> Refusal {
        match parse_head(buf, 1000) {
            HeadParse::Refused(r) => r,
            HeadParse::Partial => panic!("partial"),
            HeadParse::Complete(..) => panic!("complete"),
        }
    }

    #[test]
    fn complete_head_with_body_length_and_keep_alive_rules() {
        let buf = b"POST /models/llama2/generate?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\n\r\n{\"inputs\":1}";
        let HeadParse::Complete(head, n) = parse_head(buf, 1000) else {
            panic!()
        };
        assert_eq!(head.method, "POST");
        assert_eq!(head.path, "/models/llama2/generate");
        assert_eq!(head.query.as_deref(), Some("x=1"));
        assert_eq!(head.content_length, 12);
        assert!(head.keep_alive);
        assert_eq!(&buf[n..], b"{\"inputs\":1}");

        let HeadParse::Complete(head, _) = parse_head(b"GET / HTTP/1.0\r\n\r\n", 10) else {
            panic!()
        };
        assert!(!head.keep_alive);
        let HeadParse::Complete(head, _) =
            parse_head(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", 10)
        else {
            panic!()
        };
        assert!(!head.keep_alive);
        assert!(matches!(
            parse_head(b"GET / HTTP/1.1\r\nHost:", 10),
            HeadParse::Partial
        ));
    }

    #[test]
    fn refusals_name_the_problem() {
        let r = refused(b"POST /x HTTP/1.1\r\nContent-Length: 5000\r\n\r\n");
        assert_eq!(r.status, 413);
        assert!(
            r.message.contains("5000") && r.message.contains("1000"),
            "{}",
            r.message
        );
        assert_eq!(r.path.as_deref(), Some("/x"));
        let r = refused(b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(r.status, 411);
        assert!(r.message.contains("Content-Length"));
        let r = refused(b"POST /x HTTP/1.1\r\nContent-Length: abc\r\n\r\n");
        assert_eq!(r.status, 400);
        assert!(r.message.contains("Content-Length"));
        for bad in [
            "+5",
            "-5",
            "5.0",
            "0x5",
            "5, 5",
            "5 5",
            "",
            "99999999999999999999999",
        ] {
            let head = format!("POST /x HTTP/1.1\r\nContent-Length: {bad}\r\n\r\nhello");
            let r = refused(head.as_bytes());
            assert_eq!(r.status, 400, "Content-Length {bad:?}");
            assert!(r.message.contains("digits only"), "{}", r.message);
        }
        let r = refused(b"POST /x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n");
        assert_eq!(r.status, 400);
        assert_eq!(refused(b"GARBAGE\r\n\r\n").status, 400);
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..100 {
            many.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(refused(&many).status, 431);
    }

    #[test]
    fn percent_decoding_of_paths() {
        assert_eq!(percent_decode("/models/llama%202"), "/models/llama 2");
        assert_eq!(percent_decode("/a%2"), "/a%2");
        assert_eq!(percent_decode("/a%zz"), "/a%zz");
    }
}

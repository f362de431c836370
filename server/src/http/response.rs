//! Responses: status line and headers, whole bodies with Content-Length, streamed bodies with
//! chunked transfer encoding, and the plain JSON error body `{"error": ..., "type": ...}`.

use std::io::Write as _;

/// A response's status, headers and (for a whole response) body.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    pub status: u16,
    pub content_type: String,
    /// Extra headers (Content-Type, Content-Length, Connection are written by the server).
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn new(status: u16, content_type: &str, body: Vec<u8>) -> Self {
        Self {
            status,
            content_type: content_type.to_string(),
            headers: Vec::new(),
            body,
        }
    }

    pub fn json(status: u16, value: &serde_json::Value) -> Self {
        Self::new(status, "application/json", value.to_string().into_bytes())
    }

    /// The plain error shape: `{"error": message, "type": kind}`.
    pub fn error(status: u16, kind: &str, message: &str) -> Self {
        Self::json(
            status,
            &serde_json::json!({ "error": message, "type": kind }),
        )
    }

    pub fn with_header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_string(), value.into()));
        self
    }

    fn write_head(&self, out: &mut Vec<u8>, keep_alive: bool) {
        let _ = write!(
            out,
            "HTTP/1.1 {} {}\r\nServer: npu-serving\r\nContent-Type: {}\r\n",
            self.status,
            reason(self.status),
            self.content_type
        );
        for (k, v) in &self.headers {
            let _ = write!(out, "{k}: {v}\r\n");
        }
        if !keep_alive {
            out.extend_from_slice(b"Connection: close\r\n");
        }
    }

    /// The whole response with Content-Length.
    pub(crate) fn write_full(&self, out: &mut Vec<u8>, keep_alive: bool) {
        self.write_head(out, keep_alive);
        let _ = write!(out, "Content-Length: {}\r\n\r\n", self.body.len());
        out.extend_from_slice(&self.body);
    }

    /// Status and headers of a chunked stream; the body follows with `write_chunk`.
    pub(crate) fn write_stream_head(&self, out: &mut Vec<u8>, keep_alive: bool) {
        self.write_head(out, keep_alive);
        out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
        if !self.body.is_empty() {
            write_chunk(out, &self.body);
        }
    }
}

/// Appends one chunk of a chunked body (nothing for empty data: an empty chunk ends the body).
pub fn write_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    let _ = write!(out, "{:x}\r\n", data.len());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// Ends a chunked body.
pub(crate) fn write_last_chunk(out: &mut Vec<u8>) {
    out.extend_from_slice(b"0\r\n\r\n");
}

pub(crate) fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Payload Too Large",
        417 => "Expectation Failed",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        529 => "Overloaded",
        _ => "Unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_response_has_length_and_close() {
        let mut out = Vec::new();
        Response::error(404, "not_found", "no route for GET /x").write_full(&mut out, false);
        let text = String::from_utf8(out).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 404 Not Found\r\n"));
        assert!(head.contains("Connection: close"));
        assert!(head.contains(&format!("Content-Length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["type"], "not_found");
        assert_eq!(v["error"], "no route for GET /x");
    }

    #[test]
    fn chunk_framing() {
        let mut out = Vec::new();
        Response::new(200, "text/event-stream", Vec::new()).write_stream_head(&mut out, true);
        write_chunk(&mut out, b"data: x\n\n");
        write_chunk(&mut out, b"");
        write_last_chunk(&mut out);
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("Transfer-Encoding: chunked\r\n\r\n9\r\ndata: x\n\n\r\n0\r\n\r\n"));
        assert!(!text.contains("Content-Length"));
    }
}

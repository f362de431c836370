//! HTTP/1.1 as one connection's bytes: the server's own framing (heads through httparse and its
//! rules, Content-Length bodies, pipelining, keep-alive and `Expect: 100-continue`, the head and
//! body limits), then every complete request through the API layer's routing and validation.

use npu_server::http::{frame_input, HttpLimits};

use super::api::answer;

/// Limits small enough that a fuzzer reaches them.
fn limits() -> HttpLimits {
    HttpLimits {
        max_body_bytes: 64 * 1024,
        max_header_bytes: 4 * 1024,
        ..HttpLimits::default()
    }
}

pub fn run(data: &[u8]) {
    let framed = frame_input(data, &limits());
    if let Some((status, message)) = &framed.refused {
        assert!(
            (400..=599).contains(status) && *status != 500 && !message.is_empty(),
            "refusal {status} {message:?}"
        );
    }
    let mut framed_bytes = framed.incomplete;
    for (i, req) in framed.requests.iter().enumerate() {
        framed_bytes += req.body.len();
        answer(req, i as u64 + 1, "");
    }
    assert!(framed_bytes <= data.len(), "framing made up bytes");
}

//! vLLM's `POST /tokenize` and `POST /detokenize` bodies through the API layer (prompt or chat
//! messages through the chat template and the tokenizer; token ids back to text), with no
//! engine: the input is a route selector byte (bit 0: tokenize or detokenize; bit 1: with or
//! without the `/v1` prefix) and the body.

use npu_server::http::Request;

pub fn run(data: &[u8]) {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let route = if selector & 1 == 0 {
        "/tokenize"
    } else {
        "/detokenize"
    };
    let prefix = if selector & 2 == 0 { "" } else { "/v1" };
    let req = Request {
        method: "POST".into(),
        path: format!("{prefix}{route}"),
        query: None,
        headers: vec![("Content-Type".into(), "application/json".into())],
        body: body.to_vec(),
        arrived: std::time::Instant::now(),
    };
    super::api::answer(&req, 1, "");
}

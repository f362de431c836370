//! Anthropic Messages bodies (`POST /v1/messages` and `/v1/messages/count_tokens`) through the
//! API layer's parsing of content blocks, tools, tool_choice and thinking, the chat template and
//! the tool grammar, with no engine: the input is a route selector byte (bit 0: count_tokens),
//! the body, and after a NUL the text a model "generates", fed back through the Messages
//! writer (thinking split, tool_use blocks, streamed events or the whole message).

use npu_server::http::Request;

pub fn run(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let (body, generated) = crate::split_once(rest, 0);
    let path = if selector & 1 == 0 {
        "/v1/messages"
    } else {
        "/v1/messages/count_tokens"
    };
    let req = Request {
        method: "POST".into(),
        path: path.into(),
        query: None,
        headers: vec![
            ("Content-Type".into(), "application/json".into()),
            ("anthropic-version".into(), "2023-06-01".into()),
        ],
        body: body.to_vec(),
        arrived: std::time::Instant::now(),
    };
    super::api::answer(&req, 1, &String::from_utf8_lossy(generated));
}

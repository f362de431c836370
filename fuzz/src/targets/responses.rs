//! OpenAI Responses bodies (`POST /v1/responses`) through the API layer's parsing of input
//! items, function tools and tool_choice, text.format, reasoning and the store, the chat
//! template and the tool / schema grammars, with no engine: the input is a route selector byte,
//! the body, and after a NUL the text a model "generates", fed back through the Responses
//! writer (reasoning, message and function_call items, streamed events or the whole response).
//! Selector bits 0-1 pick the route: POST /v1/responses, or GET / DELETE
//! /v1/responses/{body} and GET /v1/responses/{body}/input_items (the body as the id).

use npu_server::http::Request;

pub fn run(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let (body, generated) = crate::split_once(rest, 0);
    let id = String::from_utf8_lossy(body);
    let (method, path, body) = match selector & 3 {
        0 => ("POST", "/v1/responses".to_string(), body.to_vec()),
        1 => ("GET", format!("/v1/responses/{id}"), Vec::new()),
        2 => ("DELETE", format!("/v1/responses/{id}"), Vec::new()),
        _ => ("GET", format!("/v1/responses/{id}/input_items"), Vec::new()),
    };
    let req = Request {
        method: method.into(),
        path,
        query: None,
        headers: vec![("Content-Type".into(), "application/json".into())],
        body,
        arrived: std::time::Instant::now(),
    };
    super::api::answer(&req, 1, &String::from_utf8_lossy(generated));
}

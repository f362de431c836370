//! What clients of other servers call (real mio server, real API layer, echo engine): a tool
//! call cut by `max_tokens` comes back as content with `finish_reason: "length"` (as vLLM's
//! Hermes parser returns it, and what openai-python reads without parsing arguments).

mod http_support;

use http_support::*;
use npu_server::api::ApiSettings;
use npu_server::http::HttpLimits;
use serde_json::{json, Value};

fn post(server: &TestServer, path: &str, body: Value) -> HttpResponse {
    let (_, r) = raw_exchange(server, &post_json(path, &body, "Connection: close\r\n"));
    r
}

/// The echo engine sends the user message back as the reply; no tool text in the prompt.
const ECHO_TEMPLATE: &str =
    "{% if tools %}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}";

fn sse_data(r: &HttpResponse) -> Vec<Value> {
    r.text()
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[test]
fn a_tool_call_cut_by_max_tokens_comes_back_as_content_with_length() {
    let server = TestServer::start_with_template(
        HttpLimits::default(),
        ApiSettings::default(),
        std::time::Duration::ZERO,
        Some(ECHO_TEMPLATE),
    );
    let reply = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo, Norway\"}}\n</tool_call>";
    let ids = tokenizer().encode_with(reply, false, true).unwrap();
    let cut = ids.len() - 6;
    let partial = tokenizer().decode(&ids[..cut], false);
    assert!(partial.contains("\"arguments\""), "{partial}");
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let body = |stream: bool| {
        json!({"messages": [{"role": "user", "content": reply}], "tools": tools,
               "max_tokens": cut, "stream": stream})
    };
    let r = post(&server, "/v1/chat/completions", body(false));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{v}");
    assert_eq!(choice["message"]["content"], partial.as_str(), "{v}");
    assert!(choice["message"].get("tool_calls").is_none(), "{v}");

    let r = post(&server, "/v1/chat/completions", body(true));
    let chunks = sse_data(&r);
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, partial, "{}", r.text());
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length",
        "{}",
        r.text()
    );
}

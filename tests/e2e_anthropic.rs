//! Anthropic's Messages API on the real server with the default model: through Anthropic's
//! Python SDK (tests/anthropic_client.py: create, stream assembled by the SDK, stop sequences,
//! tool_use named and `any` with a tool_result round trip, count_tokens equal to the prompt's
//! usage, an image refused), and over plain HTTP the shapes other clients and llama.cpp's
//! compatibility tests send: any model name, an empty message list, tool results in user
//! turns, thinking, malformed bodies refused with Anthropic's error naming the field.
//! Needs python3 with anthropic and jsonschema (scripts/test.sh installs them).

mod e2e_support;

use std::process::Command;

use e2e_support::*;
use serde_json::{json, Value};

fn sdk(server: &Server) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/anthropic_client.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(format!("http://127.0.0.1:{}", server.port))
        .output()
        .expect("python3 runs (scripts/test.sh installs anthropic and jsonschema)");
    assert!(
        out.status.success(),
        "the anthropic SDK run failed (pip install anthropic jsonschema if they are \
         missing):\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log_tail()
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn error_of(v: &Value) -> (&str, &str) {
    assert_eq!(v["type"], "error", "{v}");
    (
        v["error"]["type"].as_str().unwrap_or_default(),
        v["error"]["message"].as_str().unwrap_or_default(),
    )
}

#[test]
fn messages_through_the_anthropic_sdk_and_plain_http() {
    let _g = serial();
    let server = Server::start("anthropic", &ServerOpts::default());
    let out = sdk(&server);
    assert!(!out["text"].as_str().unwrap().is_empty(), "{out}");
    assert_eq!(out["tool_uses_checked"], 2, "{out}");

    // What llama.cpp's compatibility tests send.
    let user = json!([{"role": "user", "content": "Hello"}]);
    let (s, v) = server.post_json(
        "/v1/messages",
        &json!({"model": "test", "max_tokens": 8, "messages": []}),
    );
    assert_eq!((s, &v["type"]), (200, &json!("message")), "{v}");
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["content"][0]["type"], "text", "{v}");
    let history = json!([
        {"role": "user", "content": "What's the weather?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"location": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Here are the results:"},
            {"type": "tool_result", "tool_use_id": "t1", "is_error": true, "content": "City not found"}]},
    ]);
    let (s, v) = server.post_json(
        "/v1/messages",
        &json!({"model": "test", "max_tokens": 8, "messages": history, "temperature": 0,
                "thinking": {"type": "enabled", "budget_tokens": 4}, "top_k": 40, "top_p": 0.9,
                "metadata": {"user_id": "u"}}),
    );
    assert_eq!((s, &v["content"][0]["type"]), (200, &json!("text")), "{v}");
    assert!(v["usage"]["output_tokens"].as_u64().unwrap() > 0, "{v}");
    let (s, v) = server.post_json(
        "/v1/messages/count_tokens",
        &json!({"model": "test", "messages": user}),
    );
    assert_eq!(s, 200, "{v}");
    assert!(v["input_tokens"].as_u64().unwrap() > 0 && v.get("output_tokens").is_none());

    // A stream over plain HTTP: event lines, indices in order, the stop.
    let (s, text) = server.request(
        "POST",
        "/v1/messages",
        json!({"max_tokens": 6, "stream": true, "messages": user})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(s, 200, "{text}");
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"), "{text}");
    assert_eq!(names.last(), Some(&"message_stop"), "{text}");
    assert!(names.contains(&"content_block_delta"), "{text}");

    // Malformed bodies: 400 invalid_request_error naming the field.
    for (body, field) in [
        (json!({"messages": user}), "max_tokens"),
        (json!({"max_tokens": 8}), "messages"),
        (
            json!({"max_tokens": 8, "messages": user, "tools": [{"name": "f"}]}),
            "tools[0].input_schema",
        ),
        (
            json!({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "document"}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "tools": [{"type": "bash_20250124", "name": "bash"}]}),
            "tools[0].type",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "tool_choice": {"type": "tool", "name": "x"}}),
            "tool_choice",
        ),
    ] {
        let (s, v) = server.post_json("/v1/messages", &body);
        let (ty, msg) = error_of(&v);
        assert_eq!((s, ty), (400, "invalid_request_error"), "{body}: {v}");
        assert!(msg.contains(field), "{body}: {msg}");
    }
    let (s, text) = server.request("POST", "/v1/messages", b"{not json");
    assert_eq!(s, 400, "{text}");
    // A prompt beyond the context: 400 in Anthropic's shape.
    let long = "word ".repeat(5000);
    let (s, v) = server.post_json(
        "/v1/messages",
        &json!({"max_tokens": 8, "messages": [{"role": "user", "content": long}]}),
    );
    assert_eq!((s, error_of(&v).0), (400, "invalid_request_error"), "{v}");
    let (s, v) = server.post_json("/v1/messages/batches", &json!({}));
    assert_eq!((s, error_of(&v).0), (404, "not_found_error"), "{v}");
    let (s, text) = server.get("/v1/messages");
    assert_eq!(s, 405, "{text}");
}

//! What clients of other servers call (real mio server, real API layer, echo engine): a tool
//! call cut by `max_tokens` comes back as content with `finish_reason: "length"` (as vLLM's
//! Hermes parser returns it, and what openai-python reads without parsing arguments); vLLM's
//! `/tokenize` and `/detokenize`; the OpenAI routes without `/v1` (as llama-server answers
//! them); a prompt over the context as OpenAI's `context_length_exceeded`; vLLM-named metrics.

mod http_support;

use std::sync::Arc;
use std::time::Instant;

use http_support::*;
use npu_server::api::{ApiContext, ApiSettings};
use npu_server::engine::EngineStats;
use npu_server::http::{Handler, HttpLimits, Reply, Request};
use npu_server::metrics::Metrics;
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

fn ctx_with(settings: ApiSettings) -> ApiContext {
    ApiContext::new(
        settings,
        tokenizer(),
        Arc::new(EngineStats::default()),
        Arc::new(Metrics::default()),
    )
}

/// The status and JSON body of a request answered without generating.
fn answer(ctx: &ApiContext, method: &str, path: &str, body: &[u8]) -> (u16, Value) {
    let req = Request {
        method: method.into(),
        path: path.into(),
        query: None,
        headers: Vec::new(),
        body: body.to_vec(),
        arrived: Instant::now(),
    };
    match ctx.handle(&req, 7) {
        Reply::Full(r) => (
            r.status,
            serde_json::from_slice(&r.body).unwrap_or(Value::Null),
        ),
        Reply::Generate(_) | Reply::Control(_) => (0, Value::Null),
    }
}

#[test]
fn tokenize_and_detokenize_in_vllm_shape() {
    let ctx = ctx_with(ApiSettings::default());
    let want = tokenizer().encode_with("Hello world", true, true).unwrap();
    for path in ["/tokenize", "/v1/tokenize"] {
        let (s, v) = answer(
            &ctx,
            "POST",
            path,
            br#"{"model": "SmolLM2-135M-Instruct", "prompt": "Hello world"}"#,
        );
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["tokens"], json!(want), "{v}");
        assert_eq!(v["count"], want.len(), "{v}");
        assert_eq!(v["max_model_len"], 2048, "{v}");
    }
    let (s, v) = answer(
        &ctx,
        "POST",
        "/tokenize",
        br#"{"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": true}"#,
    );
    assert_eq!(s, 200, "{v}");
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    let text = tokenizer().decode(&ids, false);
    assert!(text.contains("Hi") && text.len() > 2, "{text}");
    let body = json!({"tokens": want}).to_string();
    let (s, v) = answer(&ctx, "POST", "/detokenize", body.as_bytes());
    assert_eq!((s, v["prompt"].as_str()), (200, Some("Hello world")), "{v}");
    // Malformed bodies: 400 naming the field.
    for (path, body, field) in [
        ("/tokenize", "{}", "prompt"),
        ("/tokenize", r#"{"prompt": 5}"#, "prompt"),
        ("/tokenize", r#"{"messages": 5}"#, "messages"),
        ("/tokenize", r#"{"prompt": "x", "model": "gpt-4"}"#, "model"),
        ("/detokenize", "{}", "tokens"),
        ("/detokenize", r#"{"tokens": [1, -2]}"#, "tokens[1]"),
        ("/detokenize", r#"{"tokens": [999999999]}"#, "tokens"),
        ("/detokenize", "not json", ""),
    ] {
        let (s, v) = answer(&ctx, "POST", path, body.as_bytes());
        assert!((400..500).contains(&s), "{path} {body}: {s} {v}");
        if !field.is_empty() {
            assert_eq!(v["error"]["param"], field, "{path} {body}: {v}");
        }
    }
    let (s, _) = answer(&ctx, "GET", "/tokenize", b"");
    assert_eq!(s, 405);
}

#[test]
fn openai_routes_answer_without_the_v1_prefix() {
    let ctx = ctx_with(ApiSettings::default());
    let (s, v) = answer(&ctx, "GET", "/models", b"");
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "list", "{v}");
    for path in ["/chat/completions", "/completions", "/responses"] {
        let (s, v) = answer(&ctx, "POST", path, b"{}");
        assert_eq!(s, 400, "{path}: {v}");
        assert!(v["error"]["message"].is_string(), "OpenAI's shape: {v}");
    }
    let chat = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}"#;
    let (s, _) = answer(&ctx, "POST", "/chat/completions", chat);
    assert_eq!(s, 0, "submitted for generation");
}

#[test]
fn a_prompt_over_the_context_is_context_length_exceeded() {
    let ctx = ctx_with(ApiSettings {
        max_model_len: 16,
        ..ApiSettings::default()
    });
    let long = "word ".repeat(100);
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": long}]}),
        ),
        ("/v1/completions", json!({"prompt": long})),
    ] {
        let (s, v) = answer(&ctx, "POST", path, body.to_string().as_bytes());
        assert_eq!(s, 400, "{v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("maximum context length is 16 tokens"),
            "{v}"
        );
    }
}

#[test]
fn metrics_carry_vllm_named_aliases() {
    let ctx = ctx_with(ApiSettings::default());
    let req = Request {
        method: "GET".into(),
        path: "/metrics".into(),
        query: None,
        headers: Vec::new(),
        body: Vec::new(),
        arrived: Instant::now(),
    };
    let Reply::Full(r) = ctx.handle(&req, 1) else {
        panic!("metrics generate?")
    };
    let text = String::from_utf8(r.body).unwrap();
    for name in [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ] {
        let line = format!("{name}{{model_name=\"SmolLM2-135M-Instruct\"}} 0.0\n");
        assert!(text.contains(&line), "{line} in {text}");
    }
    assert!(text.contains("npu_serving_requests_waiting"), "ours stay");
}

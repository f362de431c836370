//! OpenAI's Responses API (`/v1/responses`) on a real server with the default model: through
//! openai-python (tests/responses_client.py: create streamed and not, the SDK's stream helper,
//! function tools with a named and a required choice, function_call_output after
//! previous_response_id, text.format json_schema and json_object, retrieve / input_items /
//! delete, refusals naming the field), and over plain HTTP the wire shapes the SDK does not
//! show: `event:` lines, 404 and 405 bodies, and the store's bound (oldest evicted first).
//! Needs python3 with openai, pydantic and jsonschema (scripts/test.sh installs them).

mod e2e_support;

use std::process::Command;

use e2e_support::*;
use serde_json::{json, Value};

/// Responses the server keeps in this test.
const STORE: usize = 8;

fn client(server: &Server, mode: &str) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/responses_client.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(format!("http://127.0.0.1:{}/v1", server.port))
        .arg(mode)
        .output()
        .expect("python3 runs (scripts/test.sh installs openai and jsonschema)");
    assert!(
        out.status.success(),
        "openai-python responses {mode} failed:\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log_tail()
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn responses_api_through_openai_python_and_on_the_wire() {
    let _g = serial();
    let opts = ServerOpts {
        npu_serving_extra: format!("  responses_store_size: {STORE}\n  responses_ttl_s: 600\n"),
        ..ServerOpts::default()
    };
    let server = Server::start("responses", &opts);

    let text = client(&server, "text");
    assert!(text["stream_events"].as_u64().unwrap() >= 9, "{text}");
    let tools = client(&server, "tools");
    assert!(
        tools["tool_calls_checked"].as_u64().unwrap() >= 3,
        "{tools}"
    );
    let schema = client(&server, "schema");
    assert_eq!(schema["validated"], 3, "{schema}");
    let errors = client(&server, "errors");
    assert_eq!(errors["refused"], 6, "{errors}");

    // The stream on the wire: `event:` then `data:` with the same type, numbered in order.
    let body = json!({"input": "Hi", "stream": true, "max_output_tokens": 8, "temperature": 0});
    let (status, sse) = server.request("POST", "/v1/responses", body.to_string().as_bytes());
    assert_eq!(status, 200, "{sse}");
    let mut last = Value::Null;
    for (seq, block) in sse
        .split("\n\n")
        .filter(|b| !b.trim().is_empty())
        .enumerate()
    {
        let (event, data) = block.split_once('\n').expect("event and data lines");
        let event = event.strip_prefix("event: ").expect("an event line");
        let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(data["type"], event, "{block}");
        assert_eq!(data["sequence_number"], seq, "{block}");
        last = data;
    }
    assert!(
        ["response.completed", "response.incomplete"].contains(&last["type"].as_str().unwrap()),
        "{last}"
    );
    let id = last["response"]["id"].as_str().unwrap().to_string();
    let (status, got) = server.get(&format!("/v1/responses/{id}"));
    assert_eq!(status, 200);
    let got: Value = serde_json::from_str(&got).unwrap();
    assert_eq!(
        got, last["response"],
        "the stored response is the streamed one"
    );

    // Missing ids: 404 in OpenAI's error shape; methods outside the route's: 405 with Allow.
    let (status, text) = server.get("/v1/responses/resp_missing");
    assert_eq!(status, 404);
    let e: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    assert_eq!(e["error"]["code"], "response_not_found", "{e}");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("resp_missing"));
    let (status, _) = server.request("PUT", &format!("/v1/responses/{id}"), b"");
    assert_eq!(status, 405);
    let (status, text) = server.request("GET", "/v1/responses", b"");
    assert_eq!(status, 405, "{text}");
    // Agent tools send their own model names: answered by the served model, named in the reply.
    let (status, r) = server.post_json(
        "/v1/responses",
        &json!({"model": "gpt-4.1", "input": "Hi", "max_output_tokens": 2}),
    );
    assert_eq!((status, r["model"].as_str()), (200, Some(MODEL)), "{r}");
    let (status, text) = server.post_json("/v1/responses", &json!({"input": [{"type": "nope"}]}));
    assert_eq!(status, 400);
    assert_eq!(text["error"]["param"], "input[0].type", "{text}");

    // The store keeps the newest STORE responses: the oldest goes first.
    let (status, first) = server.post_json(
        "/v1/responses",
        &json!({"input": "a", "max_output_tokens": 1}),
    );
    assert_eq!(status, 200, "{first}");
    let first = first["id"].as_str().unwrap().to_string();
    for _ in 0..STORE - 1 {
        server.post_json(
            "/v1/responses",
            &json!({"input": "b", "max_output_tokens": 1}),
        );
    }
    assert_eq!(server.get(&format!("/v1/responses/{first}")).0, 200);
    server.post_json(
        "/v1/responses",
        &json!({"input": "c", "max_output_tokens": 1}),
    );
    assert_eq!(server.get(&format!("/v1/responses/{first}")).0, 404);
    let (status, text) = server.request("DELETE", &format!("/v1/responses/{first}"), b"");
    assert_eq!(status, 404, "{text}");
}

#[test]
fn bad_store_settings_are_refused_at_start_naming_the_key() {
    let _g = serial();
    for (extra, key) in [
        (
            "  responses_store_size: 0\n",
            "npu_serving.responses_store_size",
        ),
        ("  responses_ttl_s: -5\n", "npu_serving.responses_ttl_s"),
    ] {
        let opts = ServerOpts {
            npu_serving_extra: extra.into(),
            ..ServerOpts::default()
        };
        let (status, log) = serve_refused("responses-bad", &opts.yaml(), &[]);
        assert!(!status.success(), "{extra}: started");
        assert!(log.contains(key), "{extra}: {log}");
    }
}

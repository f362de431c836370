//! Anthropic's Messages API over the wire (real mio server, real API layer, echo engine): the
//! SSE event framing a client reads, `anthropic-version` / `anthropic-beta` headers accepted,
//! and the HTTP layer's own refusals in Anthropic's error shape: a full queue as 529
//! `overloaded_error`, an oversized body as 413 `request_too_large`, unknown paths and methods.

mod http_support;

use std::io::{Read, Write};
use std::time::Duration;

use http_support::*;
use npu_server::api::ApiSettings;
use npu_server::http::HttpLimits;
use serde_json::{json, Value};

const HEADERS: &str = "anthropic-version: 2023-06-01\r\nanthropic-beta: tools-2024-04-04\r\n";

fn error_type(r: &HttpResponse) -> String {
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    v["error"]["type"].as_str().unwrap_or_default().to_string()
}

#[test]
fn streamed_messages_are_anthropic_events() {
    let server = TestServer::quick();
    let body = json!({"model": "any", "max_tokens": 5, "stream": true,
                      "messages": [{"role": "user", "content": "Hello there friend"}]});
    let (_, r) = raw_exchange(
        &server,
        &post_json(
            "/v1/messages",
            &body,
            &format!("{HEADERS}Connection: close\r\n"),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("Content-Type")
        .unwrap()
        .starts_with("text/event-stream"));
    let text = r.text();
    let mut names = Vec::new();
    let mut streamed = String::new();
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let (name, data) = event.split_once('\n').expect("event and data lines");
        let name = name.strip_prefix("event: ").expect("an event line");
        let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(data["type"], name, "{event}");
        if name == "content_block_delta" {
            streamed.push_str(data["delta"]["text"].as_str().unwrap());
        }
        if name == "message_delta" {
            assert_eq!(data["delta"]["stop_reason"], "max_tokens");
            assert_eq!(data["usage"]["output_tokens"], 5);
        }
        names.push(name.to_string());
    }
    // Tokens with no text (the echoed special tokens) send no delta.
    names.dedup();
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
        .map(String::from),
        "{text}"
    );
    let submitted = &server.log.lock().unwrap().submitted;
    assert_eq!(streamed, echo_text(&submitted[0].prompt_ids, 5));
    assert_eq!(submitted[0].max_new_tokens, 5);
}

#[test]
fn the_http_layers_refusals_take_anthropics_shape() {
    let limits = HttpLimits {
        max_queue: 1,
        max_body_bytes: 4000,
        ..HttpLimits::default()
    };
    let server = TestServer::start(limits, ApiSettings::default(), Duration::from_millis(50));
    let long = json!({"max_tokens": 100, "stream": true,
                      "messages": [{"role": "user", "content": "Tell me a long story"}]});
    let mut first = server.connect();
    first
        .write_all(&post_json("/v1/messages", &long, HEADERS))
        .unwrap();
    let mut b = [0u8; 64];
    assert!(first.read(&mut b).unwrap() > 0); // it is in flight
    let short = json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let (_, r) = raw_exchange(&server, &post_json("/v1/messages", &short, HEADERS));
    assert_eq!(r.status, 529, "{}", r.text());
    assert_eq!(error_type(&r), "overloaded_error");
    assert_eq!(r.header("Retry-After"), Some("1"));
    // count_tokens runs no generation: it is answered while the queue is full.
    let (_, r) = raw_exchange(&server, &post_json("/v1/messages/count_tokens", &short, ""));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["input_tokens"].as_u64().unwrap() > 0);

    let (_, r) = raw_exchange(
        &server,
        b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nContent-Length: 10000000\r\n\r\n",
    );
    assert_eq!(
        (r.status, error_type(&r)),
        (413, "request_too_large".into())
    );
    let (_, r) = raw_exchange(&server, &post_json("/v1/messages/nope", &short, ""));
    assert_eq!((r.status, error_type(&r)), (404, "not_found_error".into()));
    let (_, r) = raw_exchange(&server, &get("/v1/messages/count_tokens"));
    assert_eq!(
        (r.status, error_type(&r)),
        (405, "invalid_request_error".into())
    );
    let (_, r) = raw_exchange(
        &server,
        &post_json("/v1/messages", &json!({"messages": []}), ""),
    );
    assert_eq!(
        (r.status, error_type(&r)),
        (400, "invalid_request_error".into())
    );
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_tokens"));
}

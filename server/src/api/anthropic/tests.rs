//! Unit tests of the Anthropic front end: request parsing into chat messages and tools (and
//! the 400s naming the field), prompts rendered with the default model's template, the block
//! events of replies with thinking, text and tool calls, whole messages folded from the same
//! events, stop reasons, and errors in Anthropic's shape.

use std::sync::{Arc, OnceLock};

use npu_protocol::TokenLogprob;
use serde_json::{json, Value};

use super::parse::{conversation, generation};
use super::stream::{finished, fold, AnthropicWriter, Blocks, Event};
use super::*;
use crate::api::ApiSettings;
use crate::engine::{EngineStats, FinishReason, GenEvent};
use crate::http::{EventWriter, Progress};
use crate::metrics::Metrics;

fn ctx() -> &'static ApiContext {
    static CTX: OnceLock<ApiContext> = OnceLock::new();
    CTX.get_or_init(|| {
        let path = npu_gguf::store::resolve_model(None).expect("the default model is available");
        let gguf = npu_gguf::GgufFile::open(&path).expect("the default model opens");
        let tok = npu_tokenizer::Tokenizer::from_gguf(&gguf).expect("a tokenizer");
        ApiContext::new(
            ApiSettings::default(),
            tok,
            Arc::new(EngineStats::default()),
            Arc::new(Metrics::default()),
        )
    })
}

fn conv(body: Value) -> Result<Conversation, ApiError> {
    let m = body.as_object().unwrap().clone();
    conversation(ctx(), &Fields::new(&m, ""))
}

fn gen_err(body: Value) -> ApiError {
    let m = body.as_object().unwrap().clone();
    generation(ctx(), &Fields::new(&m, ""), 1).unwrap_err()
}

fn param(e: &ApiError) -> &str {
    e.param.as_deref().unwrap_or("")
}

#[test]
fn blocks_become_chat_messages_with_tool_calls_and_results() {
    let c = conv(json!({
        "model": "claude-anything",
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "4 C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom", "is_error": true},
                {"type": "text", "text": "Thanks"}
            ]}
        ],
        "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "thinking": {"type": "enabled", "budget_tokens": 10}
    }))
    .unwrap();
    assert_eq!(c.model, "SmolLM2-135M-Instruct");
    let roles: Vec<&str> = c.chat.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "tool", "tool", "user"]
    );
    assert_eq!(c.chat[2].content, "Checking.");
    let calls = c.chat[2].tool_calls.as_ref().unwrap();
    assert_eq!(calls[0]["function"]["arguments"]["city"], "Oslo");
    assert_eq!(c.chat[3].content, "4 C");
    assert_eq!(c.chat[3].name.as_deref(), Some("get_weather"));
    assert_eq!(c.chat[4].content, "Error: boom");
    assert_eq!(
        (c.choice.clone(), c.parallel, c.thinking),
        (Choice::Required, false, true)
    );
    assert_eq!(
        c.tools[0].raw["function"]["parameters"],
        json!({"type": "object"})
    );
    // A last assistant turn of text is a prefill the reply continues.
    let c = conv(json!({"messages": [
        {"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, "}]}))
    .unwrap();
    assert_eq!(c.prefill.as_deref(), Some("1, 2,"));
    let (text, _) = render(ctx(), &c).unwrap();
    assert!(text.ends_with("assistant\n1, 2,"), "{text:?}");
}

#[test]
fn malformed_requests_name_their_field() {
    let user = json!([{"role": "user", "content": "hi"}]);
    for (body, field) in [
        (json!({}), "messages"),
        (json!({"messages": "hi"}), "messages"),
        (
            json!({"messages": [{"role": "system", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": [{"role": "user"}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": 3}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "document"}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"text": "x"}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "messages[0].content[0].text",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]}),
            "messages[0].content[0].input",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}),
            "messages[0].content[0].tool_use_id",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}]}]}),
            "messages[0].content[0].content[0].type",
        ),
        (json!({"messages": user, "system": 5}), "system"),
        (
            json!({"messages": user, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"messages": user, "tools": [{"name": "f"}]}),
            "tools[0].input_schema",
        ),
        (
            json!({"messages": user, "tools": [{"input_schema": {}}]}),
            "tools[0].name",
        ),
        (
            json!({"messages": user, "tool_choice": "auto"}),
            "tool_choice",
        ),
        (
            json!({"messages": user, "tool_choice": {"type": "any"}}),
            "tool_choice",
        ),
        (
            json!({"messages": user, "tool_choice": {"type": "sometimes"}}),
            "tool_choice.type",
        ),
        (
            json!({"messages": user, "tools": [{"name": "f", "input_schema": {}}],
                "tool_choice": {"type": "tool", "name": "g"}}),
            "tool_choice.name",
        ),
        (
            json!({"messages": user, "thinking": {"type": "enabled"}}),
            "thinking.budget_tokens",
        ),
        (
            json!({"messages": user, "thinking": {"type": "on"}}),
            "thinking.type",
        ),
        (json!({"messages": user, "thinking": true}), "thinking"),
    ] {
        let e = conv(body.clone()).expect_err(&body.to_string());
        assert_eq!((e.status, param(&e)), (400, field), "{body}: {}", e.message);
    }
    let e =
        conv(json!({"messages": [{"role": "user", "content": [{"type": "image"}]}]})).unwrap_err();
    assert!(
        e.message.contains("image input is not supported"),
        "{}",
        e.message
    );
    for (body, field) in [
        (json!({"messages": user}), "max_tokens"),
        (
            json!({"messages": user, "max_tokens": "many"}),
            "max_tokens",
        ),
        (json!({"messages": user, "max_tokens": 0}), "max_tokens"),
        (
            json!({"messages": user, "max_tokens": 10, "stop_sequences": [""]}),
            "stop_sequences[0]",
        ),
        (
            json!({"messages": user, "max_tokens": 10, "stop_sequences": [1]}),
            "stop_sequences[0]",
        ),
        (
            json!({"messages": user, "max_tokens": 10, "temperature": -1}),
            "temperature",
        ),
        (
            json!({"messages": user, "max_tokens": 10, "top_k": -1}),
            "top_k",
        ),
        (
            json!({"messages": user, "max_tokens": 10, "metadata": {"user_id": 3}}),
            "metadata.user_id",
        ),
        (
            json!({"messages": user, "max_tokens": 10, "stream": "yes"}),
            "stream",
        ),
        (
            json!({"messages": user, "max_tokens": 10, "thinking": {"type": "enabled", "budget_tokens": 10}}),
            "thinking.budget_tokens",
        ),
    ] {
        let e = gen_err(body.clone());
        assert_eq!((e.status, param(&e)), (400, field), "{body}: {}", e.message);
    }
}

#[test]
fn errors_take_anthropics_shape_and_statuses() {
    let (s, b) = error_body(429, "queue_full", "busy");
    assert_eq!(
        (s, b["error"]["type"].as_str()),
        (529, Some("overloaded_error"))
    );
    assert_eq!(b["type"], "error");
    for (status, ty) in [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
    ] {
        let (s, b) = error_body(status, "x", "m");
        assert_eq!((s, b["error"]["type"].as_str()), (status, Some(ty)));
    }
    assert!(owns("/v1/messages") && owns("/v1/messages/count_tokens"));
    assert!(!owns("/v1/messagesx") && !owns("/v1/chat/completions"));
}

/// Events folded into content, and whether every started block was stopped once.
fn assemble(events: &[Event]) -> Vec<Value> {
    let (mut content, mut partial) = (Vec::new(), Vec::new());
    let mut open = Vec::new();
    for e in events {
        match e.0 {
            "content_block_start" => {
                assert_eq!(e.1["index"], content.len());
                open.push(e.1["index"].as_u64().unwrap());
            }
            "content_block_stop" => assert_eq!(open.pop(), e.1["index"].as_u64()),
            _ => assert_eq!(open.len(), 1, "a delta outside a block: {e:?}"),
        }
        fold(&mut content, &mut partial, e);
    }
    assert!(open.is_empty());
    content
}

#[test]
fn blocks_number_and_close_in_order() {
    let mut b = Blocks::new("1");
    let mut ev = Vec::new();
    b.thinking("Let me", &mut ev);
    b.thinking(" think", &mut ev);
    b.text("\n", &mut ev);
    b.text("Sure.", &mut ev);
    let call = |a: &str| tool_calls::Call {
        name: "f".into(),
        arguments: a.into(),
    };
    b.tool_use(&call("{\"a\":1}"), &mut ev);
    b.text("\n", &mut ev);
    b.tool_use(&call("{}"), &mut ev);
    b.tool_use(&call("[1]"), &mut ev);
    b.finish(&mut ev);
    let content = assemble(&ev);
    assert_eq!(
        Value::Array(content),
        json!([
            {"type": "thinking", "thinking": "Let me think", "signature": "npu-serving-1"},
            {"type": "text", "text": "\nSure."},
            {"type": "tool_use", "id": "toolu_1_0", "name": "f", "input": {"a": 1}},
            {"type": "tool_use", "id": "toolu_1_1", "name": "f", "input": {}},
            {"type": "text", "text": "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>"},
        ])
    );
    assert_eq!(b.tool_uses(), 2);
    // Nothing at all: one empty text block.
    let mut b = Blocks::new("2");
    let mut ev = Vec::new();
    b.text(" ", &mut ev);
    b.finish(&mut ev);
    assert_eq!(assemble(&ev), [json!({"type": "text", "text": " "})]);
}

fn tok_event(ctx: &ApiContext, text: &str) -> Vec<GenEvent> {
    let ids = ctx.tokenizer.encode(text).unwrap();
    ids.iter()
        .map(|&id| GenEvent::Token {
            token: TokenLogprob {
                token: id,
                logprob: -0.1,
            },
            top: Vec::new(),
            text: ctx.tokenizer.decode_continuation(&[id], false),
        })
        .collect()
}

/// Runs a writer over a reply; the whole response's JSON, or the stream's events.
fn run(
    mut w: AnthropicWriter,
    reply: &str,
    end: GenEvent,
) -> (Option<Value>, Vec<(String, Value)>) {
    let head = w.stream_start();
    let mut body = head.map(|r| r.body).unwrap_or_default();
    let mut events = tok_event(ctx(), reply);
    events.push(end);
    for e in &events {
        match w.on_event(e, &mut body) {
            Progress::Complete(r) => {
                let mut v: Value = serde_json::from_slice(&r.body).unwrap();
                v["status"] = r.status.into();
                return (Some(v), Vec::new());
            }
            Progress::StreamDone => break,
            Progress::More => {}
        }
    }
    let text = String::from_utf8(body).unwrap();
    let sse = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap();
            let name = name.strip_prefix("event: ").unwrap().to_string();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name.as_str());
            (name, data)
        })
        .collect();
    (None, sse)
}

fn static_name(n: &str) -> &'static str {
    match n {
        "content_block_start" => "content_block_start",
        "content_block_delta" => "content_block_delta",
        _ => "content_block_stop",
    }
}

fn writer(stream: bool, stop: &[&str]) -> AnthropicWriter {
    let stop = stop.iter().map(|s| s.to_string()).collect();
    AnthropicWriter::new(7, "m".into(), ctx().tokenizer.clone(), stream, 12, stop)
}

#[test]
fn streamed_and_whole_replies_agree() {
    let reply = "<think>\nplan\n</think>\n\nHello.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 2}}\n</tool_call>";
    let make = |stream| {
        writer(stream, &[])
            .with_thinking(Some(false), true)
            .with_tools(vec!["f".into()])
    };
    let (whole, _) = run(make(false), reply, finished(FinishReason::Eos, 12, 30));
    let whole = whole.unwrap();
    assert_eq!(whole["stop_reason"], "tool_use");
    assert_eq!(whole["usage"]["input_tokens"], 12);
    assert_eq!(whole["usage"]["output_tokens"], 30);
    assert_eq!(whole["id"], "msg_0000000000000007");
    let types: Vec<&str> = whole["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["thinking", "text", "tool_use"]);
    assert_eq!(whole["content"][0]["thinking"], "plan");
    assert_eq!(whole["content"][1]["text"], "Hello.\n");
    assert_eq!(whole["content"][2]["input"], json!({"x": 2}));
    let (_, events) = run(make(true), reply, finished(FinishReason::Eos, 12, 30));
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..2], ["message_start", "ping"]);
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
    assert_eq!(events[0].1["message"]["content"], json!([]));
    let blocks: Vec<Event> = events
        .iter()
        .filter(|(n, _)| n.starts_with("content_block"))
        .map(|(n, d)| (static_name(n), d.clone()))
        .collect();
    assert_eq!(Value::Array(assemble(&blocks)), whole["content"]);
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert_eq!(delta["usage"]["output_tokens"], 30);
    // Thinking not asked for: dropped.
    let (whole, _) = run(
        writer(false, &[]).with_thinking(Some(false), false),
        "<think>x</think>Hi",
        finished(FinishReason::Eos, 1, 2),
    );
    assert_eq!(
        whole.unwrap()["content"],
        json!([{"type": "text", "text": "Hi"}])
    );
}

#[test]
fn stop_reasons_and_failures() {
    // The engine cut the text at the stop string; which one matched is read from the tokens.
    let (w, _) = run(
        writer(false, &["END", "\n\n"]),
        "one two END three",
        finished(FinishReason::Stop, 1, 3),
    );
    let w = w.unwrap();
    assert_eq!(
        (w["stop_reason"].as_str(), w["stop_sequence"].as_str()),
        (Some("stop_sequence"), Some("END"))
    );
    let (w, _) = run(
        writer(false, &[]),
        "a b",
        finished(FinishReason::Length, 1, 2),
    );
    assert_eq!(w.unwrap()["stop_reason"], "max_tokens");
    let (w, _) = run(writer(false, &[]), "a b", finished(FinishReason::Eos, 1, 2));
    let w = w.unwrap();
    assert_eq!(
        (w["stop_reason"].as_str(), &w["stop_sequence"]),
        (Some("end_turn"), &Value::Null)
    );
    let fail = GenEvent::Finished {
        reason: FinishReason::Rejected,
        usage: Default::default(),
        message: Some("too long".into()),
    };
    let (w, _) = run(writer(false, &[]), "", fail.clone());
    let w = w.unwrap();
    assert_eq!(
        (w["status"].as_u64(), w["error"]["type"].as_str()),
        (Some(400), Some("invalid_request_error"))
    );
    let (_, events) = run(writer(true, &[]), "a", fail);
    let last = events.last().unwrap();
    assert_eq!(
        (last.0.as_str(), last.1["error"]["message"].as_str()),
        ("error", Some("too long"))
    );
}

#[test]
fn count_tokens_counts_the_rendered_prompt_with_tools() {
    let plain = conv(json!({"messages": [{"role": "user", "content": "Hello world"}]})).unwrap();
    let (_, a) = render(ctx(), &plain).unwrap();
    let with_tools = conv(
        json!({"messages": [{"role": "user", "content": "Hello world"}],
        "system": "Be brief.",
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
    )
    .unwrap();
    let (text, b) = render(ctx(), &with_tools).unwrap();
    assert!(b.len() > a.len() + 20, "{} vs {}", b.len(), a.len());
    assert!(
        text.contains("<tools>") && text.contains("Be brief."),
        "{text}"
    );
    // tool_choice none: the tools are not offered.
    let none = conv(json!({"messages": [{"role": "user", "content": "Hello world"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "none"}}))
    .unwrap();
    assert_eq!(render(ctx(), &none).unwrap().1, a);
}

//! Unit tests of the Responses writer (stream.rs): items, events and their order.

use super::*;
use npu_protocol::TokenLogprob;

fn writer(stream: bool, think: Option<bool>, tools: Option<&[String]>) -> ResponsesWriter {
    let mut resp = Map::new();
    resp.insert("id".into(), "resp_abc".into());
    resp.insert("model".into(), "m".into());
    ResponsesWriter::new(resp, stream, think, tools, None)
}

fn tok(text: &str) -> GenEvent {
    GenEvent::Token {
        token: TokenLogprob {
            token: 1,
            logprob: 0.0,
        },
        top: Vec::new(),
        text: text.into(),
    }
}

fn end(reason: FinishReason) -> GenEvent {
    GenEvent::Finished {
        reason,
        usage: Usage {
            prompt_tokens: 7,
            completion_tokens: 5,
        },
        message: None,
    }
}

/// The whole non-streamed response of `pieces`.
fn whole(mut w: ResponsesWriter, pieces: &[&str], reason: FinishReason) -> Value {
    assert!(w.stream_start().is_none());
    let mut body = Vec::new();
    for p in pieces {
        assert!(matches!(w.on_event(&tok(p), &mut body), Progress::More));
    }
    match w.on_event(&end(reason), &mut body) {
        Progress::Complete(r) => {
            assert_eq!(r.status, 200);
            serde_json::from_slice(&r.body).unwrap()
        }
        _ => panic!("not complete"),
    }
}

/// The streamed events of `pieces`: (event name, data).
fn events(mut w: ResponsesWriter, pieces: &[&str], reason: FinishReason) -> Vec<(String, Value)> {
    let mut body = w.stream_start().unwrap().body;
    for p in pieces {
        w.on_event(&tok(p), &mut body);
    }
    assert!(matches!(
        w.on_event(&end(reason), &mut body),
        Progress::StreamDone
    ));
    let text = String::from_utf8(body).unwrap();
    text.split("\n\n")
        .filter(|b| !b.is_empty())
        .map(|b| {
            let (ev, data) = b.split_once('\n').unwrap();
            let ev = ev.strip_prefix("event: ").unwrap().to_string();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], ev.as_str());
            (ev, data)
        })
        .collect()
}

#[test]
fn a_text_reply_is_one_message_item_with_usage() {
    let r = whole(
        writer(false, None, None),
        &["Hello", " there"],
        FinishReason::Eos,
    );
    assert_eq!(r["object"], "response");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["output"].as_array().unwrap().len(), 1);
    let m = &r["output"][0];
    assert_eq!(
        (m["type"].as_str(), m["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert_eq!(m["content"][0]["type"], "output_text");
    assert_eq!(m["content"][0]["text"], "Hello there");
    assert_eq!(m["content"][0]["annotations"], json!([]));
    assert_eq!(r["usage"]["input_tokens"], 7);
    assert_eq!(r["usage"]["output_tokens"], 5);
    assert_eq!(r["usage"]["total_tokens"], 12);
    assert_eq!(r["usage"]["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(r["usage"]["output_tokens_details"]["reasoning_tokens"], 0);
}

#[test]
fn a_reply_cut_by_max_output_tokens_is_incomplete() {
    let r = whole(writer(false, None, None), &["Hel"], FinishReason::Length);
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(r["output"][0]["status"], "incomplete");
    let ev = events(writer(true, None, None), &["Hel"], FinishReason::Length);
    assert_eq!(ev.last().unwrap().0, "response.incomplete");
}

#[test]
fn thinking_and_tool_calls_become_their_own_items() {
    let names = vec!["get_weather".to_string()];
    let pieces = [
        "<think>\nCold?",
        "\n</think>\n\nChecking.",
        "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n",
    ];
    let r = whole(
        writer(false, Some(false), Some(&names)),
        &pieces,
        FinishReason::Eos,
    );
    let out = r["output"].as_array().unwrap();
    let kinds: Vec<&str> = out.iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["reasoning", "message", "function_call"]);
    assert_eq!(out[0]["content"][0]["text"], "Cold?");
    assert_eq!(out[1]["content"][0]["text"], "Checking.\n");
    assert_eq!(out[2]["name"], "get_weather");
    assert_eq!(out[2]["arguments"], "{\"city\":\"Oslo\"}");
    assert!(out[2]["call_id"].as_str().unwrap().starts_with("call_"));
    assert!(out[2]["id"].as_str().unwrap().starts_with("fc_"));
    assert_eq!(r["usage"]["output_tokens_details"]["reasoning_tokens"], 1);
}

#[test]
fn streamed_events_come_in_the_order_the_sdk_reads() {
    let names = vec!["f".to_string()];
    let pieces = [
        "<think>hm</think>",
        "Hi",
        "!",
        "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
    ];
    let ev = events(
        writer(true, Some(false), Some(&names)),
        &pieces,
        FinishReason::Eos,
    );
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (k, (_, d)) in ev.iter().enumerate() {
        assert_eq!(d["sequence_number"], k as u64);
    }
    assert_eq!(ev[0].1["response"]["status"], "in_progress");
    assert_eq!(ev[12].1["text"], "Hi!");
    assert_eq!(ev[12].1["output_index"], 1);
    assert_eq!(ev[15].1["output_index"], 2);
    let done = &ev.last().unwrap().1["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(done["output"].as_array().unwrap().len(), 3);
}

#[test]
fn an_empty_reply_is_an_empty_message_and_whitespace_alone_opens_none() {
    let r = whole(writer(false, None, None), &[], FinishReason::Eos);
    assert_eq!(r["output"][0]["content"][0]["text"], "");
    let names = vec!["f".to_string()];
    let r = whole(
        writer(false, None, Some(&names)),
        &[
            "\n",
            "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
            "\n",
        ],
        FinishReason::Eos,
    );
    let out = r["output"].as_array().unwrap();
    assert_eq!(out.len(), 1, "{r}");
    assert_eq!(out[0]["type"], "function_call");
}

#[test]
fn a_failed_generation_is_an_error_or_a_failed_event() {
    let mut w = writer(false, None, None);
    let mut body = Vec::new();
    match w.on_event(&end(FinishReason::Error), &mut body) {
        Progress::Complete(r) => assert_eq!(r.status, 500),
        _ => panic!(),
    }
    let ev = events(writer(true, None, None), &["x"], FinishReason::Error);
    let (name, data) = ev.last().unwrap();
    assert_eq!(name, "response.failed");
    assert_eq!(data["response"]["status"], "failed");
}

#[test]
fn finished_responses_are_stored_with_their_conversation() {
    let store = Arc::new(Store::new(4, std::time::Duration::from_secs(60)));
    let mut resp = Map::new();
    resp.insert("id".into(), "resp_s1".into());
    let input = vec![json!({"type": "message", "role": "user", "content": []})];
    let keep = Keep {
        store: store.clone(),
        history: input.clone(),
        input: input.clone(),
    };
    let w = ResponsesWriter::new(resp, false, None, None, Some(keep));
    let r = whole(w, &["ok"], FinishReason::Eos);
    let e = store.get("resp_s1").unwrap();
    assert_eq!(e.response, r);
    assert_eq!(e.input, input);
    assert_eq!(e.history.len(), 2);
    assert_eq!(e.history[1]["type"], "message");
}

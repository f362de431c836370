//! Several choices of one OpenAI request (`n` > 1) over the wire (real mio server, real API
//! layer, echo engine): one engine request per choice with its own seed, whole responses with
//! every choice at its index and the usage summed, streams whose chunks carry each choice's
//! index with one finish chunk per choice, one usage chunk and one `[DONE]`, a failing choice
//! ending the response with its error and stopping the others, and a client that goes away
//! aborting every choice.

mod http_support;

use std::io::Write;
use std::time::Duration;

use http_support::*;
use npu_server::api::ApiSettings;
use npu_server::http::HttpLimits;
use serde_json::{json, Value};

fn exchange(server: &TestServer, path: &str, body: Value) -> HttpResponse {
    let (_, r) = raw_exchange(server, &post_json(path, &body, "Connection: close\r\n"));
    r
}

/// The JSON values of an SSE body's data events, and whether it ended with one `[DONE]`.
fn sse_json(body: &str) -> (Vec<Value>, usize) {
    assert!(body.ends_with("\n\n"), "{body:?}");
    let mut done = 0;
    let mut out = Vec::new();
    for e in body.trim_end_matches("\n\n").split("\n\n") {
        let data = e
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not a data event: {e:?}"));
        if data == "[DONE]" {
            done += 1;
            continue;
        }
        assert_eq!(done, 0, "an event after [DONE]: {data}");
        out.push(serde_json::from_str(data).unwrap());
    }
    (out, done)
}

#[test]
fn whole_completion_with_three_choices_has_each_at_its_index_and_the_usage_summed() {
    let server = TestServer::quick();
    let prompt = "Once upon a time";
    let ids = tokenizer().encode(prompt).unwrap();
    let r = exchange(
        &server,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 3, "n": 3, "temperature": 1.0, "seed": 40}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        assert_eq!(c["text"], echo_text(&ids, 3), "{v}");
        assert_eq!(c["finish_reason"], "length");
    }
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    assert_eq!(v["usage"]["completion_tokens"], 9);
    assert_eq!(v["usage"]["total_tokens"], ids.len() + 9);
    // One engine request per choice, each with its own seed.
    let log = server.log.lock().unwrap();
    let mut seeds: Vec<u64> = log.submitted.iter().map(|r| r.params.seed).collect();
    seeds.sort();
    assert_eq!(seeds, vec![40, 41, 42]);
    let mut rids: Vec<u64> = log.submitted.iter().map(|r| r.id).collect();
    rids.dedup();
    assert_eq!(rids.len(), 3, "each choice has its own request id");
}

#[test]
fn streamed_chat_with_two_choices_interleaves_them_by_index_and_ends_once() {
    let server = TestServer::start(
        HttpLimits::default(),
        ApiSettings::default(),
        Duration::from_millis(2),
    );
    let messages = json!([{"role": "user", "content": "Say hi"}]);
    let r = exchange(
        &server,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 4, "n": 2, "stream": true,
               "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200);
    let (chunks, done) = sse_json(&r.text());
    assert_eq!(done, 1, "one [DONE] for the whole stream");
    let mut text = [String::new(), String::new()];
    let mut roles = [0, 0];
    let mut finishes = [0, 0];
    let id = chunks[0]["id"].as_str().unwrap().to_string();
    let (usage_chunk, choice_chunks) = chunks.split_last().unwrap();
    for c in choice_chunks {
        assert_eq!(c["id"], id.as_str(), "one id across the stream");
        assert_eq!(c["object"], "chat.completion.chunk");
        let choices = c["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 1, "{c}");
        let i = choices[0]["index"].as_u64().unwrap() as usize;
        assert!(i < 2, "{c}");
        let delta = &choices[0]["delta"];
        if delta["role"] == "assistant" {
            roles[i] += 1;
        }
        if let Some(t) = delta["content"].as_str() {
            text[i].push_str(t);
        }
        if !choices[0]["finish_reason"].is_null() {
            assert_eq!(choices[0]["finish_reason"], "length");
            finishes[i] += 1;
        }
    }
    assert_eq!(roles, [1, 1], "each choice opens with its role");
    assert_eq!(finishes, [1, 1], "each choice finishes once");
    assert_eq!(
        text[0], text[1],
        "the echo engine gives each choice the same text"
    );
    assert!(!text[0].is_empty());
    assert_eq!(usage_chunk["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage_chunk["id"], id.as_str());
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 8);
    let p = usage_chunk["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(usage_chunk["usage"]["total_tokens"], p + 8);
}

#[test]
fn without_include_usage_a_stream_of_choices_has_no_usage_chunk() {
    let server = TestServer::quick();
    let r = exchange(
        &server,
        "/v1/completions",
        json!({"prompt": "Hello there", "max_tokens": 2, "n": 2, "stream": true}),
    );
    assert_eq!(r.status, 200);
    let (chunks, done) = sse_json(&r.text());
    assert_eq!(done, 1);
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "{chunks:?}"
    );
    // 2 tokens and a finish chunk per choice.
    assert_eq!(chunks.len(), 6, "{chunks:?}");
    for i in 0..2 {
        let of_i = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == i)
            .count();
        assert_eq!(of_i, 3, "choice {i}: {chunks:?}");
    }
}

#[test]
fn a_failing_choice_ends_the_response_with_its_error() {
    let server = TestServer::quick();
    // The echo engine fails prompts containing FAIL: every choice fails; the first failure is
    // the response.
    let r = exchange(
        &server,
        "/v1/completions",
        json!({"prompt": "FAIL now", "max_tokens": 3, "n": 2}),
    );
    assert_eq!(r.status, 500, "{}", r.text());
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("crashed"),
        "{}",
        r.text()
    );
    let r = exchange(
        &server,
        "/v1/completions",
        json!({"prompt": "FAIL now", "max_tokens": 3, "n": 2, "stream": true}),
    );
    assert_eq!(r.status, 200);
    let (chunks, done) = sse_json(&r.text());
    assert_eq!(done, 1);
    assert_eq!(chunks.len(), 1, "just the error: {chunks:?}");
    assert!(chunks[0]["error"].is_object(), "{chunks:?}");
}

#[test]
fn a_client_that_goes_away_aborts_every_choice() {
    let server = TestServer::start(
        HttpLimits::default(),
        ApiSettings::default(),
        Duration::from_millis(50),
    );
    let mut s = server.connect();
    s.write_all(&post_json(
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 200, "n": 3, "stream": true}),
        "",
    ))
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    drop(s);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let aborted = server.log.lock().unwrap().aborted.len();
        if aborted == 3 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{aborted} of 3 choices aborted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = server.log.lock().unwrap();
    let mut submitted: Vec<u64> = log.submitted.iter().map(|r| r.id).collect();
    let mut aborted = log.aborted.clone();
    submitted.sort();
    aborted.sort();
    assert_eq!(submitted, aborted);
}

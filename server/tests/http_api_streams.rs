//! Response formats over the wire (real mio server, real API layer, echo engine): llm-serving's
//! stream lines exactly, read the way its load tester reads them (in Rust, and with the Python
//! `requests` client, which must be installed), whole responses with details, OpenAI SSE framing with
//! usage and log-probabilities, and how a failed generation is reported.

mod http_support;

use std::io::Write;

use http_support::*;
use npu_server::api::ApiSettings;
use npu_server::http::HttpLimits;
use serde_json::{json, Value};

/// Python's `str.splitlines()`, which `requests`' `iter_lines(decode_unicode=True)` uses.
fn python_splitlines(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\r' => {
                if chars.peek() == Some(&'\n') {
                    chars.next();
                }
                out.push(std::mem::take(&mut cur));
            }
            '\n' | '\u{0b}' | '\u{0c}' | '\u{1c}' | '\u{1d}' | '\u{1e}' | '\u{85}' | '\u{2028}'
            | '\u{2029}' => out.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The load tester: `json.loads(line)["data"][0]["generated_text"]` of each non-empty line.
fn load_tester_texts(body: &str) -> Vec<String> {
    python_splitlines(body)
        .into_iter()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(&l)
                .unwrap_or_else(|e| panic!("line is not JSON ({e}): {l:?}"));
            v["data"][0]["generated_text"]
                .as_str()
                .unwrap_or_else(|| panic!("no data[0].generated_text: {l}"))
                .to_string()
        })
        .collect()
}

fn stream(server: &TestServer, path: &str, body: Value) -> HttpResponse {
    let (_, r) = raw_exchange(server, &post_json(path, &body, "Connection: close\r\n"));
    r
}

#[test]
fn llm_serving_stream_lines_match_its_format_exactly() {
    let server = TestServer::quick();
    let prompt = "Hello, world! How are you?";
    let ids = tokenizer().encode(prompt).unwrap();
    let r = stream(
        &server,
        "/models/llama2/generate_stream",
        json!({"inputs": prompt, "parameters": {"max_new_tokens": 4, "do_sample": "False", "return_full_text": "True"}}),
    );
    assert_eq!(r.status, 200);
    assert!(r.chunked, "streams use chunked transfer encoding");
    assert!(r
        .header("Content-Type")
        .unwrap()
        .starts_with("text/event-stream"));
    let body = r.text();
    let lines: Vec<&str> = body.split('\n').collect();
    assert_eq!(
        lines.len(),
        6,
        "4 token lines, the full-text line, and the trailing newline: {body}"
    );
    assert_eq!(lines[5], "");
    let t0 = tokenizer().decode_continuation(&ids[..1], true);
    let tok = format!(
        "{{\"id\": {}, \"logprob\": -0.25, \"special\": false, \"text\": {}}}",
        ids[0],
        serde_json::to_string(&t0).unwrap()
    );
    let expected = format!(
        "{{\"event\": \"message\", \"retry\": 30000, \"data\": [{{\"details\": null, \"generated_text\": {}, \"tokens\": {tok}, \"top_tokens\": [{tok}]}}]}}",
        serde_json::to_string(&t0).unwrap()
    );
    assert_eq!(lines[0], expected);
    let full: Value = serde_json::from_str(lines[4]).unwrap();
    let d = &full["data"][0];
    assert_eq!(
        d["generated_text"],
        format!("{prompt}{}", echo_text(&ids, 4)),
        "return_full_text: the prompt, then the generated text"
    );
    assert_eq!(d["finish_reason"], "length");
    assert_eq!(d["generated_tokens"], 4);
    assert_eq!(d["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(d["prefill"][0]["id"], ids[0]);
    assert!(lines[4].starts_with("{\"event\": \"message\", \"retry\": 30000, \"data\": [{\"details\": null, \"generated_text\": "));
}

#[test]
fn load_tester_reading_works_unmodified_even_with_unicode_line_separators() {
    let server = TestServer::quick();
    let prompt = "Line one\nLine\u{2028}two\u{85} and\r\nthree\u{0b}four 汉字 🙂";
    let ids = tokenizer().encode(prompt).unwrap();
    let n = ids.len() + 3;
    let body = json!({"inputs": prompt, "parameters": {"max_new_tokens": n, "do_sample": "False", "return_full_text": "True"}});
    let r = stream(&server, "/models/llama2/generate_stream", body);
    let texts = load_tester_texts(&r.text());
    assert_eq!(texts.len(), n + 1);
    let expected = echo_text(&ids, n);
    assert_eq!(
        texts.last().unwrap(),
        &format!("{prompt}{expected}"),
        "return_full_text: the last line is the prompt and the whole generated text"
    );
    assert_eq!(texts[..n].concat(), expected, "the deltas add up to it");
    // Without return_full_text the deltas alone make the text.
    let body = json!({"inputs": prompt, "parameters": {"max_new_tokens": n}});
    let r = stream(&server, "/models/llama2/generate_stream", body);
    let texts = load_tester_texts(&r.text());
    assert_eq!(texts.len(), n);
    assert_eq!(texts.concat(), expected);
}

#[test]
fn the_python_load_tester_client_reads_the_stream() {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import requests"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "python3 with the `requests` module is needed: this test reads the stream with the \
         client performance_serving uses (scripts/test.sh installs it: \
         python3 -m pip install requests)"
    );
    let server = TestServer::quick();
    let prompt = "Give three tips for staying healthy.\u{2028}Be brief: 汉字";
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/http_load_tester_compat.py"
    );
    let out = std::process::Command::new("python3")
        .args([script, &server.addr.port().to_string(), prompt, "24"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let expected = echo_text(&tokenizer().encode(prompt).unwrap(), 24);
    assert_eq!(v["status"], 200);
    assert_eq!(v["chunked"], "chunked");
    assert_eq!(v["texts"].as_array().unwrap().len(), 25);
    // return_full_text (which the load tester always sends): the last line and the whole
    // response start with the prompt, as TGI's do; the deltas are the generated text.
    assert_eq!(v["resp_text"], format!("{prompt}{expected}"));
    assert_eq!(v["joined"], expected);
    assert_eq!(v["all_status"], 200);
    assert_eq!(v["all_text"], format!("{prompt}{expected}"));
}

#[test]
fn other_return_protocol_gives_data_prefixed_lines() {
    let server = TestServer::quick();
    let body = json!({"inputs": "Hello there", "parameters": {"max_new_tokens": 2, "return_protocol": "plain", "return_full_text": true}});
    let r = stream(&server, "/models/llama2/generate_stream", body);
    let body = r.text();
    let lines: Vec<&str> = body.lines().collect();
    assert_eq!(lines.len(), 3);
    for l in &lines {
        let json = l.strip_prefix("data:").unwrap_or_else(|| panic!("{l}"));
        let v: Value = serde_json::from_str(json).unwrap();
        assert!(v["generated_text"].is_string());
    }
}

#[test]
fn whole_generate_response_with_and_without_details() {
    let server = TestServer::quick();
    let prompt = "The capital of France is";
    let ids = tokenizer().encode(prompt).unwrap();
    let r = stream(
        &server,
        "/models/llama2/generate",
        json!({"inputs": prompt, "parameters": {"max_new_tokens": 5}}),
    );
    assert_eq!(r.status, 200);
    assert!(!r.chunked);
    let v = r.json();
    assert_eq!(v["generated_text"], echo_text(&ids, 5));
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["generated_tokens"], 5);
    assert!(v["details"].is_null());
    let r = stream(
        &server,
        "/models/llama2",
        json!({"inputs": prompt, "stream": false, "parameters": {"max_new_tokens": 3, "details": "True", "top_n_tokens": 2, "seed": 5}}),
    );
    let v = r.json();
    let d = &v["details"];
    assert_eq!(d["finish_reason"], "length");
    assert_eq!(d["generated_tokens"], 3);
    assert_eq!(d["seed"], 5);
    assert_eq!(d["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(d["tokens"][1]["id"], ids[1]);
    assert_eq!(d["tokens"][1]["logprob"], -0.25);
    assert_eq!(d["top_tokens"][0].as_array().unwrap().len(), 2);
    assert_eq!(d["top_tokens"][0][1]["logprob"], -0.5);
}

#[test]
fn return_full_text_puts_the_prompt_before_the_generated_text_as_tgi_does() {
    let server = TestServer::quick();
    let prompt = "The capital of France is";
    let ids = tokenizer().encode(prompt).unwrap();
    let generated = echo_text(&ids, 5);
    for (flag, want) in [
        (json!(true), format!("{prompt}{generated}")),
        (json!("True"), format!("{prompt}{generated}")),
        (json!(false), generated.clone()),
        (Value::Null, generated.clone()),
    ] {
        // Whole response: generated_text.
        let r = stream(
            &server,
            "/models/llama2/generate",
            json!({"inputs": prompt, "parameters": {"max_new_tokens": 5, "return_full_text": flag}}),
        );
        assert_eq!(r.status, 200);
        let v = r.json();
        assert_eq!(v["generated_text"], json!(want), "return_full_text {flag}");
        assert_eq!(v["generated_tokens"], 5);
        // Stream: only the final response's generated_text carries the prompt (as TGI's last
        // stream response does); the token lines carry their own text.
        let r = stream(
            &server,
            "/models/llama2/generate_stream",
            json!({"inputs": prompt, "parameters": {"max_new_tokens": 5, "return_full_text": flag}}),
        );
        let texts = load_tester_texts(&r.text());
        let full = flag == json!(true) || flag == json!("True");
        assert_eq!(texts.len(), if full { 6 } else { 5 }, "{flag}: {texts:?}");
        assert_eq!(texts[..5].concat(), generated, "{flag}");
        if full {
            assert_eq!(texts[5], want, "{flag}");
        }
    }
}

/// Splits an SSE body into its events' data, checking the framing.
fn sse_events(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "{body:?}");
    body.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {e:?}"))
                .to_string()
        })
        .collect()
}

#[test]
fn openai_completion_stream_framing_usage_and_logprobs() {
    let server = TestServer::quick();
    let prompt = "Once upon a time";
    let ids = tokenizer().encode(prompt).unwrap();
    let body = json!({"prompt": prompt, "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}, "logprobs": 2});
    let r = stream(&server, "/v1/completions", body);
    assert_eq!(r.status, 200);
    assert!(r.chunked);
    let events = sse_events(&r.text());
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(
        chunks.len(),
        5,
        "3 tokens, the finish chunk, the usage chunk"
    );
    let mut text = String::new();
    for c in &chunks[..3] {
        assert_eq!(c["object"], "text_completion");
        assert!(c["id"].as_str().unwrap().starts_with("cmpl-"));
        assert!(c["choices"][0]["finish_reason"].is_null());
        let lp = &c["choices"][0]["logprobs"];
        assert_eq!(lp["token_logprobs"][0], -0.25);
        assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
        assert_eq!(lp["text_offset"][0], text.len());
        text.push_str(c["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(text, echo_text(&ids, 3));
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    let usage = &chunks[4]["usage"];
    assert_eq!(chunks[4]["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["prompt_tokens"], ids.len());
    assert_eq!(usage["completion_tokens"], 3);
    assert_eq!(usage["total_tokens"], ids.len() + 3);
}

#[test]
fn openai_chat_stream_and_whole_response() {
    let server = TestServer::quick();
    let messages = json!([{"role": "user", "content": "Say hi"}]);
    let r = stream(
        &server,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 4, "stream": true}),
    );
    let events = sse_events(&r.text());
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["choices"][0]["delta"], json!({}));

    let r = stream(
        &server,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 4, "logprobs": true, "top_logprobs": 2}),
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], streamed);
    // The default model does not think: no reasoning_content at all.
    assert!(
        v["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert!(content[0]["bytes"].is_array());
    // The prompt the engine got is the chat template's rendering.
    let submitted = server
        .log
        .lock()
        .unwrap()
        .submitted
        .last()
        .unwrap()
        .prompt_ids
        .clone();
    assert!(tokenizer()
        .decode(&submitted, false)
        .ends_with("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"));
}

/// A template in Qwen3's manner: the conversation's text, and with `enable_thinking: false` an
/// empty think block where the reply begins (so the model answers without thinking). The echo
/// engine sends the prompt back as the reply, so a user message written like a Qwen3 reply
/// comes back as one.
const THINKING_TEMPLATE: &str = "{% for m in messages %}{{ m.content }}{% endfor %}\
{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}\
<think>\n\n</think>\n\n{% endif %}";

fn chat_chunks(r: &HttpResponse) -> Vec<Value> {
    let events = sse_events(&r.text());
    assert_eq!(events.last().unwrap(), "[DONE]");
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

#[test]
fn chat_replies_that_think_carry_reasoning_content_apart_from_content() {
    let server = TestServer::start_with_template(
        HttpLimits::default(),
        ApiSettings::default(),
        std::time::Duration::ZERO,
        Some(THINKING_TEMPLATE),
    );
    let reply = "<think>\nTwo and two make four.\n</think>\n\nThe answer is 4.";
    // The chat route encodes the rendered prompt without BOS, control tokens recognised.
    let n = tokenizer().encode_with(reply, false, true).unwrap().len();
    let messages = json!([{"role": "user", "content": reply}]);

    // Whole response: message.reasoning_content and message.content.
    let r = stream(
        &server,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": n}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "Two and two make four.", "{v}");
    assert_eq!(m["content"], "The answer is 4.", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], n);

    // Stream: reasoning_content deltas while inside the block, then content deltas; this
    // tokenizer has no think tokens, so "<think>" and "</think>" arrive in several pieces.
    let r = stream(
        &server,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": n, "stream": true, "logprobs": true}),
    );
    let chunks = chat_chunks(&r);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let deltas: Vec<&Value> = chunks[1..chunks.len() - 1]
        .iter()
        .map(|c| &c["choices"][0]["delta"])
        .collect();
    let joined = |key: &str| -> String {
        deltas
            .iter()
            .filter_map(|d| d[key].as_str())
            .collect::<String>()
    };
    assert_eq!(joined("reasoning_content"), "Two and two make four.");
    assert_eq!(joined("content"), "The answer is 4.");
    let first_content = deltas
        .iter()
        .position(|d| d["content"].is_string())
        .unwrap();
    let last_reasoning = deltas
        .iter()
        .rposition(|d| d["reasoning_content"].is_string())
        .unwrap();
    assert!(last_reasoning < first_content, "{deltas:?}");
    assert!(
        deltas.iter().all(|d| !d.to_string().contains("think>")),
        "no tag text in any delta: {deltas:?}"
    );
    // With logprobs asked, every token has its chunk (those of the tags with an empty delta).
    let lp_tokens: usize = chunks[1..chunks.len() - 1]
        .iter()
        .map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .len()
        })
        .sum();
    assert_eq!(lp_tokens, n);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );

    // A reply without a think block is all content; reasoning_content is null.
    let plain = "Just the answer.";
    let n = tokenizer().encode_with(plain, false, true).unwrap().len();
    let r = stream(
        &server,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": plain}], "max_tokens": n}),
    );
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], plain);
    assert!(
        v["choices"][0]["message"]["reasoning_content"].is_null(),
        "{v}"
    );
    // The completions route is not split.
    let r = stream(
        &server,
        "/v1/completions",
        json!({"prompt": reply, "max_tokens": 200}),
    );
    assert!(r.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .starts_with("<think>\nTwo"));
}

/// Qwen3's manner with tools: the thinking template, taking `tools` itself (so no tool
/// description is added to the prompt); the echo engine sends the user message back as the
/// reply.
const THINKING_TOOLS_TEMPLATE: &str = "{% if tools %}{% endif %}\
{% for m in messages %}{{ m.content }}{% endfor %}\
{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}\
<think>\n\n</think>\n\n{% endif %}";

#[test]
fn a_reply_that_thinks_then_calls_a_tool_keeps_reasoning_and_calls_apart() {
    let server = TestServer::start_with_template(
        HttpLimits::default(),
        ApiSettings::default(),
        std::time::Duration::ZERO,
        Some(THINKING_TOOLS_TEMPLATE),
    );
    let reply = "<think>\nOslo's weather needs the tool.\n</think>\n\n<tool_call>\n\
                 {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
    let n = tokenizer().encode_with(reply, false, true).unwrap().len();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let body = |stream: bool| {
        json!({"messages": [{"role": "user", "content": reply}], "tools": tools,
               "max_tokens": n, "stream": stream})
    };

    let r = stream(&server, "/v1/chat/completions", body(false));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let m = &v["choices"][0]["message"];
    assert_eq!(
        m["reasoning_content"], "Oslo's weather needs the tool.",
        "{v}"
    );
    assert!(
        m["content"].is_null(),
        "no text outside the think block and the call: {v}"
    );
    let calls = m["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Oslo"}));

    // Streamed: reasoning deltas first, then the call as a tool_calls delta; no tag text and
    // no call text leaks into reasoning_content or content.
    let r = stream(&server, "/v1/chat/completions", body(true));
    let chunks = chat_chunks(&r);
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    let reasoning: String = deltas
        .iter()
        .filter_map(|d| d["reasoning_content"].as_str())
        .collect();
    assert_eq!(reasoning, "Oslo's weather needs the tool.");
    let content: String = deltas
        .iter()
        .filter_map(|d| d["content"].as_str())
        .collect();
    assert_eq!(content, "", "{deltas:?}");
    let call_at = deltas
        .iter()
        .position(|d| d["tool_calls"].is_array())
        .expect("a tool_calls delta");
    let last_reasoning = deltas
        .iter()
        .rposition(|d| d["reasoning_content"].is_string())
        .unwrap();
    assert!(last_reasoning < call_at, "{deltas:?}");
    let call = &deltas[call_at]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather", "{call}");
    assert_eq!(call["index"], 0);
}

#[test]
fn a_reply_in_llama_3_bare_json_comes_back_as_tool_calls() {
    let server = TestServer::start_with_template(
        HttpLimits::default(),
        ApiSettings::default(),
        std::time::Duration::ZERO,
        Some(THINKING_TOOLS_TEMPLATE),
    );
    let reply = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}";
    let n = tokenizer().encode_with(reply, false, true).unwrap().len();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let body = |stream: bool| {
        json!({"messages": [{"role": "user", "content": reply}], "tools": tools,
               "max_tokens": n, "stream": stream})
    };
    let v = stream(&server, "/v1/chat/completions", body(false)).json();
    let m = &v["choices"][0]["message"];
    assert!(m["content"].is_null(), "{v}");
    assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather", "{v}");
    assert_eq!(
        m["tool_calls"][0]["function"]["arguments"],
        "{\"city\":\"Oslo\"}"
    );
    let chunks = chat_chunks(&stream(&server, "/v1/chat/completions", body(true)));
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    assert!(
        deltas
            .iter()
            .all(|d| d["content"].as_str().unwrap_or("").is_empty()),
        "{deltas:?}"
    );
    let calls: Vec<&Value> = deltas
        .iter()
        .copied()
        .filter(|d| d["tool_calls"].is_array())
        .collect();
    assert_eq!(calls.len(), 1, "{deltas:?}");
    assert_eq!(calls[0]["tool_calls"][0]["function"]["name"], "get_weather");
    // Without tools the same reply is content.
    let v = stream(
        &server,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": reply}], "max_tokens": n}),
    )
    .json();
    assert_eq!(v["choices"][0]["message"]["content"], reply, "{v}");
}

#[test]
fn chat_template_kwargs_reach_the_template() {
    let server = TestServer::start_with_template(
        HttpLimits::default(),
        ApiSettings::default(),
        std::time::Duration::ZERO,
        Some(THINKING_TEMPLATE),
    );
    let messages = json!([{"role": "user", "content": "What is 2+2?"}]);
    let prompt_of = |body: Value| -> String {
        let r = stream(&server, "/v1/chat/completions", body);
        assert_eq!(r.status, 200, "{}", r.text());
        let log = server.log.lock().unwrap();
        tokenizer().decode(&log.submitted.last().unwrap().prompt_ids, false)
    };
    assert_eq!(
        prompt_of(json!({"messages": messages, "max_tokens": 1})),
        "What is 2+2?"
    );
    assert_eq!(
        prompt_of(json!({"messages": messages, "max_tokens": 1,
                         "chat_template_kwargs": {"enable_thinking": false}})),
        "What is 2+2?<think>\n\n</think>\n\n"
    );
    assert_eq!(
        prompt_of(json!({"messages": messages, "max_tokens": 1,
                         "chat_template_kwargs": {"enable_thinking": true}})),
        "What is 2+2?"
    );
    // The standard variables keep their values.
    assert_eq!(
        prompt_of(json!({"messages": messages, "max_tokens": 1,
                         "chat_template_kwargs": {"messages": [], "add_generation_prompt": false}})),
        "What is 2+2?"
    );
    // Not an object: 400 naming the field.
    let r = stream(
        &server,
        "/v1/chat/completions",
        json!({"messages": messages, "chat_template_kwargs": true}),
    );
    assert_eq!(r.status, 400);
    assert!(r.text().contains("chat_template_kwargs"), "{}", r.text());
}

#[test]
fn failed_generation_is_reported_in_each_shape() {
    let server = TestServer::quick();
    let r = stream(
        &server,
        "/models/llama2/generate",
        json!({"inputs": "FAIL now"}),
    );
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"], "agent 0 crashed");
    let r = stream(
        &server,
        "/models/llama2/generate_stream",
        json!({"inputs": "FAIL now"}),
    );
    let line: Value = serde_json::from_str(r.text().trim_end()).unwrap();
    assert_eq!(line["event"], "error");
    assert_eq!(line["data"][0]["error"], "agent 0 crashed");
    let r = stream(
        &server,
        "/v1/completions",
        json!({"prompt": "FAIL now", "stream": true}),
    );
    let events = sse_events(&r.text());
    assert_eq!(events.len(), 2);
    let err: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(err["error"]["message"], "agent 0 crashed");
    assert_eq!(events[1], "[DONE]");
    let r = stream(
        &server,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "FAIL"}]}),
    );
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["type"], "server_error");
}

#[test]
fn responses_to_keep_alive_clients_and_connection_close() {
    let server = TestServer::quick();
    let mut s = server.connect();
    s.write_all(&post_json(
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 2}),
        "Connection: close\r\n",
    ))
    .unwrap();
    let r = read_response(&mut s);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("Connection"), Some("close"));
    assert!(is_closed(&mut s));
}

//! End to end: `npu-serving serve` on port 0 with real agent processes and the real model.
//! Greedy outputs under 32 concurrent streams equal the single-request outputs on both APIs
//! (also under preemption and with static batching); every KV block is free again after
//! finished and aborted requests; finish reasons; bad inputs get their 4xx; the llm-serving
//! stream read exactly as its load tester reads it.

mod e2e_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use e2e_support::*;
use serde_json::{json, Value};

/// The single-request greedy text of each prompt (llm-serving stream, read by the load
/// tester's client), checked against the reference where there is one.
fn singles(server: &Server, prompts: &[(String, usize)]) -> Vec<String> {
    let refs = reference_prompts();
    prompts
        .iter()
        .map(|(p, n)| {
            let r = server.stream(Api::LlmServing, p, *n);
            assert!(r.success, "{p:?}: {:?}", r.error);
            if let Some((_, expected)) = refs.iter().find(|(rp, _)| rp == p) {
                let k = expected.len().min(r.resp_text.len());
                assert!(
                    r.resp_text.starts_with(expected.as_str()),
                    "{p:?}: {:?} does not start with the reference {:?}",
                    r.resp_text,
                    &expected[..k]
                );
            }
            r.resp_text
        })
        .collect()
}

fn with_lengths(prompts: &[String]) -> Vec<(String, usize)> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| (p.clone(), 24 + (i % 3) * 8))
        .collect()
}

fn assert_all_equal(
    label: &str,
    records: &[client_bench::metrics::RequestRecord],
    want: &[String],
) {
    for (i, r) in records.iter().enumerate() {
        assert!(r.success, "{label} client {i}: {:?}", r.error);
        assert_eq!(
            r.resp_text,
            want[i % want.len()],
            "{label} client {i}: concurrent output differs from the single request's"
        );
    }
}

/// Every block is free and nothing runs or waits.
fn assert_idle_and_blocks_free(server: &Server) {
    let used = server.wait_metric("npu_serving_kv_blocks_used", Duration::from_secs(30), |v| {
        v == 0.0
    });
    assert_eq!(used, 0.0, "KV blocks still used after every request ended");
    assert_eq!(server.metric("npu_serving_requests_running"), 0.0);
    assert_eq!(server.metric("npu_serving_requests_waiting"), 0.0);
    let inflight = server.wait_metric(
        "npu_serving_requests_inflight",
        Duration::from_secs(10),
        |v| v == 0.0,
    );
    assert_eq!(inflight, 0.0);
}

#[test]
fn greedy_outputs_of_32_concurrent_streams_equal_single_requests_on_both_apis() {
    let _serial = serial();
    let server = Server::start("greedy", &ServerOpts::default());
    let mut all = prompts();
    for (p, _) in reference_prompts() {
        if !all.contains(&p) {
            all.push(p);
        }
    }
    let prompts = with_lengths(&all[..16]);
    let want = singles(&server, &prompts);

    let records = server.stream_concurrently(Api::LlmServing, &prompts, 32);
    assert_all_equal("llm-serving", &records, &want);
    assert_idle_and_blocks_free(&server);

    let records = server.stream_concurrently(Api::Completions, &prompts, 32);
    assert_all_equal("completions", &records, &want);
    for (i, r) in records.iter().enumerate() {
        let n = r.server_completion_tokens.expect("usage in the stream");
        assert!(n >= 1 && n as usize <= prompts[i % 16].1, "{n} tokens");
    }
    assert_idle_and_blocks_free(&server);

    let chat = &prompts[..8];
    let chat_want: Vec<String> = chat
        .iter()
        .map(|(p, n)| {
            let r = server.stream(Api::Chat, p, *n);
            assert!(r.success, "{:?}", r.error);
            r.resp_text
        })
        .collect();
    let records = server.stream_concurrently(Api::Chat, chat, 32);
    assert_all_equal("chat", &records, &chat_want);
    assert_idle_and_blocks_free(&server);
    assert_eq!(server.metric("npu_serving_http_responses_5xx_total"), 0.0);
}

#[test]
fn preemption_and_static_batching_keep_greedy_outputs() {
    let _serial = serial();
    // 40 blocks of 16 tokens: 24 requests of up to ~60 tokens need ~96 blocks, so sequences
    // are preempted and recomputed. (The pool still holds one sequence of the context limit.)
    let small = ServerOpts {
        num_blocks: 40,
        seq_length: 512,
        prefix_cache: false,
        ..ServerOpts::default()
    };
    let prompts: Vec<(String, usize)> = prompts()[..12].iter().map(|p| (p.clone(), 40)).collect();
    let want = {
        let server = Server::start("preempt", &small);
        let want = singles(&server, &prompts);
        let records = server.stream_concurrently(Api::LlmServing, &prompts, 24);
        assert_all_equal("small pool", &records, &want);
        assert!(
            server.metric("npu_serving_preemptions_total") > 0.0,
            "the small pool should have forced preemptions"
        );
        assert_idle_and_blocks_free(&server);
        want
    };
    let server = Server::start(
        "static",
        &ServerOpts {
            batching_strategy: "static",
            decode_batch_size: 8,
            ..ServerOpts::default()
        },
    );
    let records = server.stream_concurrently(Api::LlmServing, &prompts, 24);
    assert_all_equal("static batching", &records, &want);
    assert_idle_and_blocks_free(&server);
}

/// Sends a request on a raw connection and returns it (the caller reads or drops it).
fn send_raw(server: &Server, path: &str, body: &Value) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    s
}

/// Reads until `n` newlines of body have arrived (stream lines or SSE lines).
fn read_lines(s: &mut TcpStream, n: usize) {
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.iter().filter(|&&b| b == b'\n').count() < n + 8 {
        let k = s.read(&mut buf).expect("stream data");
        assert!(
            k > 0,
            "stream closed early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..k]);
    }
}

#[test]
fn clients_that_disconnect_free_their_blocks() {
    let _serial = serial();
    let server = Server::start("abort", &ServerOpts::default());
    let prompt = "Once upon a time, in a small village by the sea,";
    let before = server.stream(Api::LlmServing, prompt, 24).resp_text;
    let long = |i: usize| {
        json!({"inputs": format!("{prompt} story {i}"),
               "parameters": {"max_new_tokens": 400, "ignore_eos": true}})
    };
    // Streams dropped after a few tokens, OpenAI streams too.
    let mut streams: Vec<TcpStream> = (0..12)
        .map(|i| {
            send_raw(
                &server,
                &format!("/models/{MODEL}/generate_stream"),
                &long(i),
            )
        })
        .collect();
    for i in 0..4 {
        let body = json!({"prompt": format!("{prompt} tale {i}"), "max_tokens": 400,
                          "stream": true, "ignore_eos": true});
        streams.push(send_raw(&server, "/v1/completions", &body));
    }
    for s in &mut streams {
        read_lines(s, 3);
    }
    // Whole (non-streamed) responses whose clients leave while they are generated.
    let whole: Vec<TcpStream> = (12..16)
        .map(|i| send_raw(&server, &format!("/models/{MODEL}/generate"), &long(i)))
        .collect();
    let running = server.wait_metric(
        "npu_serving_requests_running",
        Duration::from_secs(60),
        |v| v >= 16.0,
    );
    assert!(running >= 16.0, "{running} running");
    assert!(server.metric("npu_serving_kv_blocks_used") > 0.0);
    drop(streams);
    drop(whole);
    assert_idle_and_blocks_free(&server);
    assert!(server.metric("npu_serving_requests_finished_total") >= 21.0);
    // The server goes on serving, with the same greedy output as before.
    let after = server.stream(Api::LlmServing, prompt, 24);
    assert!(after.success, "{:?}", after.error);
    assert_eq!(after.resp_text, before);
    assert_idle_and_blocks_free(&server);
}

#[test]
fn finish_reasons_stop_strings_eos_and_context_length() {
    let _serial = serial();
    let opts = ServerOpts {
        seq_length: 512,
        ..ServerOpts::default()
    };
    let server = Server::start("finish", &opts);
    let gen = format!("/models/{MODEL}/generate");
    let ask = |params: Value| {
        let (status, v) = server.post_json(
            &gen,
            &json!({"inputs": "The capital of France is", "parameters": params}),
        );
        assert_eq!(status, 200, "{v}");
        v
    };
    let plain = ask(json!({"max_new_tokens": 12}));
    let text = plain["generated_text"].as_str().unwrap().to_string();
    assert_eq!(plain["finish_reason"], "length");
    assert_eq!(plain["generated_tokens"], 12);
    assert!(text.starts_with(" Paris.\n\n"), "{text:?}");

    // A stop string ends the request and is not part of the text.
    let v = ask(json!({"max_new_tokens": 12, "stop": ["\n"]}));
    assert_eq!(v["generated_text"], " Paris.");
    assert_eq!(v["finish_reason"], "stop_sequence");
    // One spanning several tokens, found in the stream too.
    let cut = text.find("United").expect("the reference continuation");
    let v = ask(json!({"max_new_tokens": 12, "stop": ["ted Sta", "zzz"]}));
    assert_eq!(v["generated_text"], format!("{}Uni", &text[..cut]));
    assert_eq!(v["finish_reason"], "stop_sequence");
    let (status, v) = server.post_json(
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                "stop": "\n"}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], " Paris.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Several choices of one prompt: greedy, each is the single request's text; sampled with a
    // seed, the same request gives the same choices again (each choice its own seed).
    let (status, v) = server.post_json(
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                "n": 3}),
    );
    assert_eq!(status, 200, "{v}");
    for i in 0..3 {
        assert_eq!(v["choices"][i]["index"], i, "{v}");
        assert_eq!(v["choices"][i]["text"], text.as_str(), "{v}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 36, "{v}");
    let sampled = json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0,
                         "seed": 7, "n": 4, "ignore_eos": true});
    let (status, a) = server.post_json("/v1/completions", &sampled);
    assert_eq!(status, 200, "{a}");
    let (_, b) = server.post_json("/v1/completions", &sampled);
    let texts = |v: &Value| -> Vec<String> {
        (0..4)
            .map(|i| v["choices"][i]["text"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(texts(&a), texts(&b), "seeded choices repeat");
    let distinct: std::collections::HashSet<String> = texts(&a).into_iter().collect();
    assert!(distinct.len() > 1, "choices of different seeds differ: {a}");
    // logit_bias: -100 on the greedy first token (" Paris") moves the pick; +100 on a token
    // makes greedy decoding repeat it.
    let file = npu_gguf::GgufFile::open(token_counter().model_path()).unwrap();
    let tok = npu_tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let ids = tok.encode_with(" Paris", false, false).unwrap();
    let paris = ids[0];
    let ask_biased = |bias: Value| {
        let (status, v) = server.post_json(
            "/v1/completions",
            &json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
                    "logit_bias": bias}),
        );
        assert_eq!(status, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    assert!(ask_biased(json!({})).starts_with(" Paris"));
    let banned = ask_biased(json!({ paris.to_string(): -100 }));
    assert!(!banned.starts_with(" Paris"), "{banned:?}");
    let forced = ask_biased(json!({ paris.to_string(): 100 }));
    assert_eq!(forced, tok.decode(&[paris; 4], false), "{forced:?}");

    // The model's end-of-sequence token ends a chat answer.
    let (status, v) = server.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 200,
                "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 200);

    // max_new_tokens beyond what the context leaves: it ends at the context limit.
    let counter = token_counter();
    let mut long = String::new();
    while counter.prompt_tokens(&long).unwrap() < 490 {
        long.push_str("the cat sat on the mat and ");
    }
    let n_prompt = counter.prompt_tokens(&long).unwrap();
    let (status, v) = server.post_json(
        &gen,
        &json!({"inputs": long, "parameters": {"max_new_tokens": 100, "ignore_eos": true}}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["generated_tokens"], json!(512 - n_prompt));
    assert_idle_and_blocks_free(&server);
}

#[test]
fn bad_inputs_get_their_4xx_with_a_json_body_naming_the_problem() {
    let _serial = serial();
    let opts = ServerOpts {
        seq_length: 512,
        ..ServerOpts::default()
    };
    let server = Server::start("bad", &opts);
    let gen = format!("/models/{MODEL}/generate");
    let stream = format!("/models/{MODEL}/generate_stream");
    let long = "word ".repeat(600);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (&gen, b"{not json".to_vec(), 400, "JSON"),
        (&gen, b"".to_vec(), 400, "JSON"),
        (&gen, json!({}).to_string().into_bytes(), 400, "inputs"),
        (
            &gen,
            json!({"inputs": ""}).to_string().into_bytes(),
            400,
            "inputs",
        ),
        (
            &stream,
            json!({"inputs": 7}).to_string().into_bytes(),
            400,
            "inputs",
        ),
        (
            &gen,
            json!({"inputs": long}).to_string().into_bytes(),
            400,
            "inputs",
        ),
    ];
    let params: Vec<(Value, &str)> = vec![
        (json!({"temperature": -1}), "parameters.temperature"),
        (json!({"top_p": 1.5}), "parameters.top_p"),
        (json!({"top_k": -1}), "parameters.top_k"),
        (json!({"max_new_tokens": 0}), "parameters.max_new_tokens"),
        (json!({"max_new_tokens": 512}), "parameters.max_new_tokens"),
        (
            json!({"max_new_tokens": "many"}),
            "parameters.max_new_tokens",
        ),
        (json!({"do_sample": "maybe"}), "parameters.do_sample"),
        (
            json!({"repetition_penalty": 0}),
            "parameters.repetition_penalty",
        ),
        (json!({"stop": [""]}), "parameters.stop[0]"),
        (json!({"top_n_tokens": 100}), "parameters.top_n_tokens"),
        (json!({"seed": -1}), "parameters.seed"),
    ];
    let openai: Vec<(&str, Value, &str)> = vec![
        ("/v1/completions", json!({}), "prompt"),
        ("/v1/completions", json!({"prompt": "hi", "n": 17}), "n"),
        ("/v1/completions", json!({"prompt": "hi", "n": 0}), "n"),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 0}),
            "max_tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "temperature": -0.5}),
            "temperature",
        ),
        ("/v1/completions", json!({"prompt": long}), "prompt"),
        ("/v1/chat/completions", json!({}), "messages"),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            "messages[0].role",
        ),
    ];
    let mut all: Vec<(String, Vec<u8>, u16, String)> = cases
        .into_iter()
        .map(|(p, b, s, f)| (p.to_string(), b, s, f.to_string()))
        .collect();
    for (p, field) in params {
        let body = json!({"inputs": "hi", "parameters": p});
        all.push((
            stream.clone(),
            body.to_string().into_bytes(),
            400,
            field.into(),
        ));
    }
    for (path, body, field) in openai {
        all.push((
            path.into(),
            body.to_string().into_bytes(),
            400,
            field.into(),
        ));
    }
    for (path, body, status, field) in all {
        let (got, text) = server.request("POST", &path, &body);
        let shown = String::from_utf8_lossy(&body[..body.len().min(80)]).into_owned();
        assert_eq!(got, status, "{path} {shown}: {text}");
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{path} {shown}: body is not JSON ({e}): {text}"));
        let msg = match &v["error"] {
            Value::String(s) => s.clone(),
            Value::Object(o) => o["message"].as_str().unwrap_or_default().to_string(),
            other => panic!("{path} {shown}: no error message in {other}"),
        };
        assert!(
            msg.contains(&field),
            "{path} {shown}: {msg:?} does not name {field}"
        );
    }
    // Routes, methods and sizes.
    let (s, text) = server.get("/no/such/route");
    assert_eq!(s, 404, "{text}");
    assert!(serde_json::from_str::<Value>(&text).is_ok(), "{text}");
    let (s, text) = server.get("/v1/completions");
    assert_eq!(s, 405, "{text}");
    assert!(text.contains("POST"), "{text}");
    // A body over the limit is refused from its head alone (the body is never sent here).
    let mut c = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    write!(
        c,
        "POST {gen} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        2 << 20
    )
    .unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut answer = String::new();
    let _ = c.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    let body = &answer[answer.find("\r\n\r\n").unwrap() + 4..];
    assert!(serde_json::from_str::<Value>(body).is_ok(), "{answer}");
    // None of these reached the engine; the server still serves.
    assert_eq!(server.metric("npu_serving_requests_finished_total"), 0.0);
    let r = server.stream(Api::LlmServing, "The capital of France is", 4);
    assert!(r.success, "{:?}", r.error);
    assert_idle_and_blocks_free(&server);
}

/// Python's `str.splitlines()` (what `requests`' `iter_lines(decode_unicode=True)` uses).
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

#[test]
fn llm_serving_stream_is_read_exactly_as_the_load_tester_reads_it() {
    let _serial = serial();
    let server = Server::start("stream", &ServerOpts::default());
    let prompt = "Write a short poem about the sea.\u{2028}Use some emoji 🌊 and 汉字:";
    let n = 40;
    let want = server.stream(Api::LlmServing, prompt, n);
    assert!(want.success, "{:?}", want.error);

    // performance_serving: json.loads(line)["data"][0]["generated_text"] of each line of
    // iter_lines(decode_unicode=True); with return_full_text the last line is the prompt and the
    // whole generated text (as TGI's last stream response).
    let body = json!({"inputs": prompt, "parameters": {"max_new_tokens": n, "do_sample": "False",
                      "return_full_text": "True"}});
    let mut s = send_raw(&server, &format!("/models/{MODEL}/generate_stream"), &body);
    let _ = s.write_all(b"");
    let mut raw = Vec::new();
    let head_end = loop {
        let mut buf = [0u8; 4096];
        let k = s.read(&mut buf).unwrap();
        assert!(k > 0);
        raw.extend_from_slice(&buf[..k]);
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&raw[..head_end]).to_string();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    // Read the chunked body to its end (keep-alive: stop at the last chunk).
    let mut body_bytes = raw[head_end..].to_vec();
    while !body_bytes.ends_with(b"0\r\n\r\n") {
        let mut buf = [0u8; 4096];
        let k = s.read(&mut buf).unwrap();
        assert!(k > 0, "connection closed before the last chunk");
        body_bytes.extend_from_slice(&buf[..k]);
    }
    let mut text = Vec::new();
    let mut rest = &body_bytes[..];
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n").unwrap();
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap(), 16).unwrap();
        if size == 0 {
            break;
        }
        text.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
        rest = &rest[eol + 2 + size + 2..];
    }
    let text = String::from_utf8(text).expect("the stream is UTF-8");
    let texts: Vec<String> = python_splitlines(&text)
        .into_iter()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l:?}"));
            assert_eq!(v["event"], "message");
            assert_eq!(v["retry"], 30000);
            v["data"][0]["generated_text"].as_str().unwrap().to_string()
        })
        .collect();
    let (full, deltas) = texts.split_last().unwrap();
    assert_eq!(
        full,
        &format!("{prompt}{}", want.resp_text),
        "the last line carries the prompt and the whole text"
    );
    assert_eq!(
        deltas.concat(),
        want.resp_text,
        "the deltas add up to the whole text"
    );
    assert!(deltas.len() <= n);

    // The Python client itself (performance_serving's way of reading the stream). Like the other
    // Python-client tests it needs its module and fails without it, rather than passing unchecked.
    let has_requests = std::process::Command::new("python3")
        .args(["-c", "import requests"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_requests,
        "python3 with the `requests` module is needed to run performance_serving's client \
         (scripts/test.sh installs it; or `python3 -m pip install requests`)"
    );
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/server/tests/http_load_tester_compat.py"
    );
    let out = std::process::Command::new("python3")
        .args([script, &server.port.to_string(), prompt, &n.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], 200);
    assert_eq!(v["chunked"], "chunked");
    let full = format!("{prompt}{}", want.resp_text);
    assert_eq!(v["resp_text"], json!(full));
    assert_eq!(v["joined"], json!(want.resp_text));
    assert_eq!(v["all_status"], 200);
    assert_eq!(v["all_text"], json!(full));
    assert_idle_and_blocks_free(&server);
}

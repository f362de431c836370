//! End to end: structured output on the real server and agent. JSON-schema chat completions
//! sampled at temperature 1, sixteen at a time, all validate against their schema (checked by
//! Python's `jsonschema`), including while the agent is killed with SIGKILL and its requests are
//! recomputed; regex, choice and Lark grammars on the OpenAI routes and TGI's `grammar` on
//! llm-serving's route hold; bad grammars are 400s naming the field.

mod e2e_support;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use e2e_support::*;
use serde_json::{json, Value};

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "Lima", "Oslo", "Kyoto"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
        },
        "required": ["name", "age", "city", "tags"],
        "additionalProperties": false
    })
}

/// Validates each instance (JSON text) against `schema` with Python's jsonschema; returns the
/// failures (index and message).
fn validate(schema: &Value, instances: &[String]) -> Vec<String> {
    let script = r#"
import json, sys, jsonschema
d = json.load(sys.stdin)
v = jsonschema.Draft202012Validator(d["schema"])
for i, text in enumerate(d["instances"]):
    try:
        v.validate(json.loads(text))
    except Exception as e:
        print(f"{i}: {text!r}: {str(e).splitlines()[0]}")
"#;
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 (scripts/test.sh installs jsonschema)");
    let input = json!({"schema": schema, "instances": instances}).to_string();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the validator failed to run");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

fn chat_body(i: usize) -> Value {
    json!({
        "messages": [{"role": "user", "content": format!("Describe person number {i} as JSON.")}],
        "temperature": 1.0,
        "seed": 1000 + i,
        "max_tokens": 160,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "strict": true, "schema": person_schema()}
        }
    })
}

/// Runs `n` constrained chat completions, `concurrency` at a time; returns each reply's content
/// and finish reason.
fn run_constrained(server: &Server, n: usize, concurrency: usize) -> Vec<(String, String)> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..concurrency {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= n {
                    break;
                }
                let (status, v) = server.post_json("/v1/chat/completions", &chat_body(i));
                assert_eq!(status, 200, "{v}");
                let choice = &v["choices"][0];
                out.lock().unwrap().push((
                    choice["message"]["content"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                    choice["finish_reason"].as_str().unwrap_or("").to_string(),
                ));
            });
        }
    });
    out.into_inner().unwrap()
}

fn check_all(replies: &[(String, String)]) {
    let texts: Vec<String> = replies.iter().map(|(t, _)| t.clone()).collect();
    for (t, reason) in replies {
        assert_eq!(
            reason, "stop",
            "a constrained reply ended by {reason}: {t:?}"
        );
    }
    let bad = validate(&person_schema(), &texts);
    assert!(
        bad.is_empty(),
        "replies that fail the schema:\n{}",
        bad.join("\n")
    );
}

#[test]
fn json_schema_replies_at_temperature_1_all_validate_even_across_an_agent_kill() {
    let _g = serial();
    let server = Server::start("structured", &ServerOpts::default());
    let replies = run_constrained(&server, 48, 16);
    assert_eq!(replies.len(), 48);
    check_all(&replies);
    // Sampled, not one fixed answer: the seeds differ and so do the replies.
    let distinct: std::collections::HashSet<&String> = replies.iter().map(|(t, _)| t).collect();
    assert!(distinct.len() > 8, "{distinct:?}");

    // The same load with the agent killed once replies have started: its requests are
    // recomputed on the restarted agent, their grammars where the client's text stopped.
    let victim = server.agent_pids()[0];
    let (replies, ()) = std::thread::scope(|s| {
        let load = s.spawn(|| run_constrained(&server, 32, 16));
        let t0 = Instant::now();
        while server.metric("npu_serving_generation_tokens_total") < 200.0
            && t0.elapsed() < Duration::from_secs(60)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: kill(2) on the server's agent process.
        assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
        (load.join().unwrap(), ())
    });
    assert_eq!(replies.len(), 32);
    check_all(&replies);
    assert_ne!(server.agent_pids(), vec![victim], "the agent was restarted");
}

#[test]
fn regex_choice_lark_and_tgi_grammars_hold_and_bad_ones_are_refused() {
    let _g = serial();
    let server = Server::start("structured2", &ServerOpts::default());
    for i in 0..4 {
        let (s, v) = server.post_json(
            "/v1/completions",
            &json!({"prompt": "The code is", "temperature": 1.0, "seed": i, "max_tokens": 20,
                    "structured_outputs": {"regex": "[0-9]{3}-[A-Z]{2}"}}),
        );
        assert_eq!(s, 200, "{v}");
        let t = v["choices"][0]["text"].as_str().unwrap();
        let b = t.as_bytes();
        assert!(
            b.len() == 6
                && b[..3].iter().all(u8::is_ascii_digit)
                && b[3] == b'-'
                && b[4..].iter().all(u8::is_ascii_uppercase),
            "{t:?}"
        );
        let (s, v) = server.post_json(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Pick one."}], "temperature": 1.0,
                    "seed": i, "max_tokens": 10, "guided_choice": ["red", "green", "blue sky"]}),
        );
        assert_eq!(s, 200, "{v}");
        let t = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(["red", "green", "blue sky"].contains(&t), "{t:?}");
        let (s, v) = server.post_json(
            "/v1/completions",
            &json!({"prompt": "Say yes or no:", "temperature": 1.0, "seed": i, "max_tokens": 10,
                    "structured_outputs": {"grammar": "start: (\"yes\" | \"no\") \"!\""}}),
        );
        assert_eq!(s, 200, "{v}");
        let t = v["choices"][0]["text"].as_str().unwrap();
        assert!(t == "yes!" || t == "no!", "{t:?}");
    }
    // TGI's grammar on llm-serving's route.
    let (s, v) = server.post_json(
        "/models/m/generate",
        &json!({"inputs": "A number:", "parameters": {"do_sample": true, "seed": 3,
                "max_new_tokens": 12, "grammar": {"type": "regex", "value": "[1-9][0-9]{2}"}}}),
    );
    assert_eq!(s, 200, "{v}");
    let t = v["generated_text"].as_str().unwrap();
    assert!(
        t.len() == 3 && t.bytes().all(|c| c.is_ascii_digit()),
        "{t:?}"
    );
    // n choices each under their own grammar.
    let (s, v) = server.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "JSON please"}], "temperature": 1.0,
                "n": 3, "max_tokens": 160, "response_format": {"type": "json_schema",
                "json_schema": {"name": "p", "schema": person_schema()}}}),
    );
    assert_eq!(s, 200, "{v}");
    let texts: Vec<String> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["message"]["content"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(texts.len(), 3);
    let bad = validate(&person_schema(), &texts);
    assert!(bad.is_empty(), "{bad:?}");

    // Refused, naming the field.
    for (path, body, field) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}],
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                   "schema": {"type": "no-such-type"}}}}),
            "response_format.json_schema",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}],
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format.json_schema.schema",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "structured_outputs": {"regex": "([a-z"}}),
            "structured_outputs.regex",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}}),
            "guided_regex",
        ),
        (
            "/models/m/generate",
            json!({"inputs": "x", "parameters": {"grammar": {"type": "xml", "value": "a"}}}),
            "parameters.grammar.type",
        ),
    ] {
        let (s, v) = server.post_json(path, &body);
        assert_eq!(s, 400, "{body}: {v}");
        let text = v.to_string();
        assert!(text.contains(field), "{body}: {text} does not name {field}");
    }
    // Still serving.
    let (s, _) = server.post_json("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}));
    assert_eq!(s, 200);
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
         "parameters": {"type": "object", "properties": {
             "city": {"enum": ["Paris", "Oslo", "Lima"]},
             "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
             "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
         "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}}}
    ])
}

/// Checks one call (OpenAI's shape) against the two tools' schemas; `get_time` leaves
/// `additionalProperties` unset, and its arguments still name nothing but `zone` (strict).
fn check_call(call: &Value) {
    assert_eq!(call["type"], "function", "{call}");
    assert!(call["id"].as_str().is_some_and(|s| !s.is_empty()), "{call}");
    let name = call["function"]["name"].as_str().unwrap();
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("arguments of {call} are not JSON: {e}"));
    match name {
        "get_weather" => {
            assert!(
                ["Paris", "Oslo", "Lima"].contains(&args["city"].as_str().unwrap()),
                "{args}"
            );
            assert!(
                ["c", "f"].contains(&args["unit"].as_str().unwrap()),
                "{args}"
            );
        }
        "get_time" => {
            assert!(
                args["zone"].as_str().unwrap().chars().count() <= 12,
                "{args}"
            );
            assert_eq!(args.as_object().unwrap().len(), 1, "{args}");
        }
        other => panic!("a call of {other:?}, not an offered tool"),
    }
}

#[test]
fn tool_calls_named_and_required_streamed_and_not_with_tool_history() {
    let _g = serial();
    let server = Server::start("tools", &ServerOpts::default());
    let question = json!([{"role": "user", "content": "What is the weather in Oslo?"}]);
    for seed in 0..3 {
        // A named function: exactly one call of it, arguments per its schema.
        let (s, v) = server.post_json(
            "/v1/chat/completions",
            &json!({"messages": question, "tools": weather_tools(), "temperature": 1.0,
                    "seed": seed, "max_tokens": 80,
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        );
        assert_eq!(s, 200, "{v}");
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
        assert!(choice["message"]["content"].is_null(), "{v}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{v}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        check_call(&calls[0]);

        // required, streamed: the calls arrive as tool_calls deltas.
        let body = json!({"messages": question, "tools": weather_tools(), "temperature": 1.0,
                          "seed": seed, "max_tokens": 120, "stream": true,
                          "tool_choice": "required", "parallel_tool_calls": seed == 0});
        let (s, text) = server.request("POST", "/v1/chat/completions", body.to_string().as_bytes());
        assert_eq!(s, 200, "{text}");
        let mut calls = Vec::new();
        let mut finish = None;
        for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if line == "[DONE]" {
                break;
            }
            let chunk: Value = serde_json::from_str(line).unwrap();
            let c = &chunk["choices"][0];
            if let Some(list) = c["delta"]["tool_calls"].as_array() {
                for call in list {
                    assert_eq!(call["index"].as_u64(), Some(calls.len() as u64), "{call}");
                    calls.push(call.clone());
                }
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
        assert!(!calls.is_empty(), "{text}");
        calls.iter().for_each(check_call);
        if seed == 0 {
            // Parallel calls allowed: a sampled small model may go on calling until max_tokens.
            assert!(
                matches!(finish.as_deref(), Some("tool_calls" | "length")),
                "{text}"
            );
        } else {
            assert_eq!(calls.len(), 1, "{text}");
            assert_eq!(finish.as_deref(), Some("tool_calls"), "{text}");
        }
    }

    // A conversation that already holds a call and its result renders and answers.
    let history = json!([
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"c\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": -3}"}
    ]);
    let (s, v) = server.post_json(
        "/v1/chat/completions",
        &json!({"messages": history, "tools": weather_tools(), "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(s, 200, "{v}");

    // Malformed tool fields are 400s naming the field.
    for (body, field) in [
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}],
                   "tools": weather_tools()}),
            "messages[1].tool_call_id",
        ),
        (
            json!({"messages": question, "tools": weather_tools(),
                   "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice.function.name",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
                   "function": {"name": "get_time", "arguments": "{not json"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!({"messages": question, "tools": [{"type": "function", "function": {"name": ""}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"messages": question, "tool_choice": "required"}),
            "tool_choice",
        ),
    ] {
        let (s, v) = server.post_json("/v1/chat/completions", &body);
        assert_eq!(s, 400, "{body}: {v}");
        assert!(v.to_string().contains(field), "{v} does not name {field}");
    }
}

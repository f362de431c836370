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

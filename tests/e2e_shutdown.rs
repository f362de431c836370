//! End to end: SIGTERM drains. Requests that can finish within the grace time finish; the
//! others end with a clear reason (an error line on the llm-serving stream, finish_reason
//! "abort" on OpenAI); new connections are refused; the process exits cleanly; the agents are
//! gone and so are the shared-memory segments.

mod e2e_support;

use std::time::{Duration, Instant};

use e2e_support::*;
use serde_json::{json, Value};

/// Streams one request on a raw connection and returns the whole body text once the server
/// ends it (the connection is closed after the response during a drain).
fn stream_body(port: u16, path: &str, body: Value) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn sigterm_drains_running_requests_then_exits_and_removes_the_segments() {
    let _serial = serial();
    let opts = ServerOpts {
        shutdown_grace_ms: 4000,
        seq_length: 2048,
        ..ServerOpts::default()
    };
    let mut server = Server::start("sigterm", &opts);
    let agents = server.agent_pids();
    assert_eq!(agents.len(), 1);
    assert_eq!(server.segments().len(), 1);
    let port = server.port;
    let tgi = format!("/models/{MODEL}/generate_stream");
    let short = server.stream(Api::LlmServing, "The capital of France is", 48);
    assert!(short.success);

    let (short_body, long_body, openai_body, status) = std::thread::scope(|s| {
        let long = s.spawn(|| {
            stream_body(
                port,
                &tgi,
                json!({"inputs": "Once upon a time",
                       "parameters": {"max_new_tokens": 2000, "ignore_eos": true}}),
            )
        });
        let openai = s.spawn(|| {
            stream_body(
                port,
                "/v1/completions",
                json!({"prompt": "Once upon a time", "max_tokens": 2000, "stream": true,
                       "ignore_eos": true, "temperature": 0}),
            )
        });
        let running = |n: f64| {
            server.wait_metric(
                "npu_serving_requests_running",
                Duration::from_secs(60),
                |v| v >= n,
            )
        };
        assert_eq!(running(2.0), 2.0);
        // A short request joins; all three run when the signal comes.
        let short = s.spawn(|| {
            stream_body(
                port,
                &tgi,
                json!({"inputs": "The capital of France is",
                       "parameters": {"max_new_tokens": 48, "return_full_text": true}}),
            )
        });
        assert_eq!(running(3.0), 3.0);
        let signalled = Instant::now();
        server.signal(libc::SIGTERM);
        // The listener closes at once: new clients are refused.
        let until = Instant::now() + Duration::from_secs(5);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            assert!(Instant::now() < until, "still accepting after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
        let status = server.wait_exit(Duration::from_secs(30));
        let took = signalled.elapsed();
        assert!(took < Duration::from_secs(20), "drain took {took:?}");
        (
            short.join().unwrap(),
            long.join().unwrap(),
            openai.join().unwrap(),
            status,
        )
    });
    assert!(status.success(), "exit status {status}");

    // The short request finished normally: its last line has the whole text (after the prompt:
    // return_full_text).
    let last = short_body
        .lines()
        .rfind(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no stream lines: {short_body}"));
    let v: Value = serde_json::from_str(last).unwrap();
    assert_eq!(
        v["data"][0]["generated_text"],
        json!(format!("The capital of France is{}", short.resp_text))
    );
    assert_eq!(v["data"][0]["finish_reason"], "length");

    // The long one was cut: its stream ends with an error event saying why.
    let last = long_body
        .lines()
        .rfind(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no stream lines: {long_body}"));
    let v: Value = serde_json::from_str(last).unwrap();
    assert_eq!(v["event"], "error", "{last}");
    assert_eq!(v["data"][0]["error_type"], "shutdown", "{last}");
    assert!(
        v["data"][0]["error"].as_str().unwrap().contains("shut"),
        "{last}"
    );
    assert!(
        long_body.matches("generated_text").count() > 1,
        "it streamed before"
    );

    // OpenAI: the last chunk's finish_reason says it was aborted, then [DONE].
    let events: Vec<&str> = openai_body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{openai_body}");
    let reasons: Vec<Value> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["choices"][0].get("finish_reason").cloned())
        .filter(|r| !r.is_null())
        .collect();
    assert_eq!(reasons, vec![json!("abort")], "{openai_body}");

    // Agents and segments are gone.
    for pid in agents {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "agent {pid} outlived the server"
        );
    }
    assert!(
        server.segments().is_empty(),
        "segments left: {:?}",
        server.segments()
    );
}

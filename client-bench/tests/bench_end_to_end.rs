//! End-to-end runs of the bench (dataset → arrivals → HTTP streaming → metrics → files) against
//! a small HTTP peer written in this test. The peer is not the thing under test: it only speaks
//! the two wire formats (llm-serving NDJSON over chunked encoding, OpenAI SSE over a
//! close-delimited body) and misbehaves on request, so the bench's parsing, timing, failure
//! recording, concurrency cap and output files can be checked. The real server is exercised by
//! live_server.rs.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use client_bench::driver::execute;
use client_bench::tokens::TokenCounter;
use client_bench::BenchArgs;
use serde_json::{json, Value};

#[derive(Default)]
struct PeerState {
    /// (path, JSON body) of every POST received.
    posts: Mutex<Vec<(String, Value)>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

struct Peer {
    port: u16,
    state: Arc<PeerState>,
}

fn start_peer() -> Peer {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let state = Arc::new(PeerState::default());
    let st = Arc::clone(&state);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let st = Arc::clone(&st);
            std::thread::spawn(move || serve_one(conn, &st));
        }
    });
    Peer { port, state }
}

fn read_request(s: &mut TcpStream) -> Option<(String, String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        let n = s.read(&mut tmp).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.lines();
    let mut first = lines.next()?.split_whitespace();
    let (method, path) = (first.next()?.to_string(), first.next()?.to_string());
    let len: usize = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .map(|(_, v)| v.trim().parse().unwrap())
        .unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < len {
        let n = s.read(&mut tmp).ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&tmp[..n]);
    }
    Some((method, path, body))
}

fn chunk(s: &mut TcpStream, data: &str) {
    let _ = write!(s, "{:x}\r\n{data}\r\n", data.len());
    let _ = s.flush();
}

/// Generated words for a request: "w0 w1 ...", one per requested token.
fn words(n: usize) -> Vec<String> {
    (0..n).map(|i| format!(" w{i}")).collect()
}

fn serve_one(mut s: TcpStream, st: &PeerState) {
    let Some((method, path, body)) = read_request(&mut s) else {
        return;
    };
    let now = st.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    st.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let pause = || std::thread::sleep(Duration::from_millis(4));
    if method == "GET" {
        let body = match path.as_str() {
            "/v1/models" => json!({"object": "list", "data": [{"id": "fake-model"}]}).to_string(),
            _ => json!({"status": "ok"}).to_string(),
        };
        let _ = write!(
            s,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
    } else {
        let v: Value = serde_json::from_slice(&body).unwrap();
        st.posts.lock().unwrap().push((path.clone(), v.clone()));
        if path.starts_with("/models/") {
            let prompt = v["inputs"].as_str().unwrap_or("");
            let n = v["parameters"]["max_new_tokens"].as_u64().unwrap_or(1) as usize;
            if prompt.contains("FAIL500") {
                let e = json!({"error": "injected failure", "type": "test"}).to_string();
                let _ = write!(
                    s,
                    "HTTP/1.1 500 Internal Server Error\r\nContent-Length: {}\r\n\r\n{e}",
                    e.len()
                );
            } else {
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
                     Transfer-Encoding: chunked\r\n\r\n"
                );
                let ws = words(n);
                for (i, w) in ws.iter().enumerate() {
                    if prompt.contains("CUT") && i == 2 {
                        // Drop the connection mid-stream, without the last chunk.
                        let _ = s.shutdown(std::net::Shutdown::Both);
                        st.in_flight.fetch_sub(1, Ordering::SeqCst);
                        return;
                    }
                    pause();
                    let line = json!({"event": "message", "retry": 30000,
                        "data": [{"details": null, "generated_text": w,
                                  "tokens": {"id": i, "text": w}}]});
                    chunk(&mut s, &format!("{line}\n"));
                }
                let full = json!({"event": "message", "retry": 30000,
                    "data": [{"details": null, "generated_text": ws.concat(),
                              "finish_reason": "length", "generated_tokens": n}]});
                chunk(&mut s, &format!("{full}\n"));
                chunk(&mut s, "");
            }
        } else {
            // OpenAI SSE, body delimited by closing the connection.
            let n = v["max_tokens"].as_u64().unwrap_or(1) as usize;
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
            );
            for w in words(n) {
                pause();
                let ev = json!({"object": "text_completion",
                    "choices": [{"index": 0, "text": w, "finish_reason": null}]});
                let _ = write!(s, "data: {ev}\n\n");
                let _ = s.flush();
            }
            let usage =
                json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}});
            let _ = write!(s, ": keep-alive\n\ndata: {usage}\n\ndata: [DONE]\n\n");
        }
    }
    let _ = s.flush();
    st.in_flight.fetch_sub(1, Ordering::SeqCst);
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("bench-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

fn args(list: &[&str]) -> BenchArgs {
    let mut v = vec!["bench", "--no-progress"];
    v.extend_from_slice(list);
    Cli::try_parse_from(v).unwrap().bench
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .unwrap()
}

fn counter() -> TokenCounter {
    TokenCounter::load(None).expect("the default model is needed to count tokens")
}

#[test]
fn llm_serving_run_records_successes_and_failures() {
    let peer = start_peer();
    let dir = temp_dir("llm");
    let dataset = dir.join("alpaca.json");
    std::fs::write(
        &dataset,
        json!([
            {"instruction": "Say hello", "input": "", "output": "Hello there, friend."},
            {"instruction": "FAIL500 please", "input": "now", "output": "x"},
            {"instruction": "CUT me", "input": "", "output": "one two three four five"}
        ])
        .to_string(),
    )
    .unwrap();
    let out = dir.join("out");
    let port = peer.port.to_string();
    let a = args(&[
        "-X",
        "20",
        "-P",
        &port,
        "-O",
        out.to_str().unwrap(),
        "-T",
        "0.3",
        "--dataset",
        dataset.to_str().unwrap(),
        "--arrival",
        "constant",
    ]);
    let report = execute(&a).unwrap();
    assert_eq!(report.summaries.len(), 1);
    let s = &report.summaries[0];
    // X·T = 6 requests, cycling over the 3 entries.
    assert_eq!((s.num_requests, s.completed, s.failed), (6, 2, 4));
    assert!(s.failure_reasons.keys().any(|r| r.starts_with("HTTP 500")));
    assert!(s.failure_reasons.keys().any(|r| r.contains("closed")));

    // Request bodies exactly as performance_serving sends them, with token-counted outputs.
    let c = counter();
    let posts = peer.state.posts.lock().unwrap().clone();
    assert_eq!(posts.len(), 6);
    for (path, body) in &posts {
        assert_eq!(path, "/models/llama2/generate_stream");
        assert_eq!(body["parameters"]["do_sample"], "False");
        assert_eq!(body["parameters"]["return_full_text"], "True");
    }
    let hello = posts
        .iter()
        .find(|(_, b)| b["inputs"] == "Say hello")
        .unwrap();
    assert_eq!(
        hello.1["parameters"]["max_new_tokens"].as_u64().unwrap() as usize,
        c.output_tokens("Hello there, friend.").unwrap()
    );
    assert!(posts
        .iter()
        .any(|(_, b)| b["inputs"] == "FAIL500 please:now"));

    // result_{X}_x.json: one object per request, failures included with their reason.
    let results = read_json(&out.join("result_20.0_x.json"));
    let arr = results.as_array().unwrap();
    assert_eq!(arr.len(), 6);
    for r in arr {
        for k in ["input", "resp_text", "res_time", "first_token_time"] {
            assert!(r.get(k).is_some(), "{k} missing in {r}");
        }
        if r["input"] == "Say hello" {
            let n = r["max_new_tokens"].as_u64().unwrap() as usize;
            let want: String = words(n).concat();
            assert_eq!(r["resp_text"], want.as_str());
            assert_eq!(r["output_tokens"], c.output_tokens(&want).unwrap());
            assert!(r["first_token_time"].as_f64().unwrap() <= r["res_time"].as_f64().unwrap());
        } else {
            assert_eq!(r["success"], false);
            assert!(r["error"].as_str().unwrap().len() > 3);
        }
    }
    // ITL gaps: n chunks per successful request give n-1 gaps each.
    let n_ok = arr
        .iter()
        .filter(|r| r["success"] == true)
        .map(|r| r["max_new_tokens"].as_u64().unwrap() as usize - 1)
        .sum::<usize>();
    assert_eq!(s.itl_ms.as_ref().unwrap().count, n_ok);
    assert_eq!(s.tpot_ms.as_ref().map_or(0, |t| t.count), 2);

    let log = std::fs::read_to_string(out.join("test_performance_20.0.log")).unwrap();
    assert!(log.contains("All Tasks Done; Exec Time is "), "{log}");
    assert!(log.contains("Test Progress --> 6/6"), "{log}");
    let summary = read_json(&out.join("summary_20.0.json"));
    assert_eq!(summary["completed"], 2);
    assert_eq!(summary["failed"], 4);
    let csv = std::fs::read_to_string(out.join("summary_20.0.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2);
    for plot in [
        "latency_cdf_20.0.svg",
        "throughput_20.0.svg",
        "ttft_vs_arrival_20.0.svg",
    ] {
        assert!(out.join(plot).is_file(), "{plot} missing");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn openai_run_with_synthetic_prompts_and_concurrency_cap() {
    let peer = start_peer();
    let dir = temp_dir("openai");
    let out = dir.join("out");
    let port = peer.port.to_string();
    let a = args(&[
        "--api",
        "openai",
        "-X",
        "50",
        "-P",
        &port,
        "-O",
        out.to_str().unwrap(),
        "--num-requests",
        "5",
        "--arrival",
        "burst",
        "--burst-size",
        "5",
        "--max-concurrency",
        "1",
        "--input-len",
        "fixed:12",
        "--output-len",
        "fixed:4",
        "--slo-ttft-ms",
        "60000",
        "--no-plots",
    ]);
    let report = execute(&a).unwrap();
    let s = &report.summaries[0];
    assert_eq!((s.num_requests, s.completed, s.failed), (5, 5, 0));
    assert_eq!(s.good_requests, 5);
    assert_eq!(peer.state.max_in_flight.load(Ordering::SeqCst), 1);
    let c = counter();
    let posts = peer.state.posts.lock().unwrap().clone();
    for (path, body) in &posts {
        assert_eq!(path, "/v1/completions");
        assert_eq!(body["model"], "fake-model");
        assert_eq!(body["max_tokens"], 4);
        assert_eq!(body["stream"], true);
        // Synthetic prompts have exactly the requested token length.
        assert_eq!(
            c.prompt_tokens(body["prompt"].as_str().unwrap()).unwrap(),
            12
        );
    }
    let want_tokens = c.output_tokens(&words(4).concat()).unwrap();
    assert_eq!(s.total_output_tokens, 5 * want_tokens);
    assert_eq!(s.total_input_tokens, 5 * 12);
    assert_eq!(s.itl_ms.as_ref().unwrap().count, 5 * 3);
    assert!(!out.join("latency_cdf_50.0.svg").exists());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn qps_sweep_writes_a_table_and_a_curve() {
    let peer = start_peer();
    let dir = temp_dir("sweep");
    let out = dir.join("out");
    let port = peer.port.to_string();
    let a = args(&[
        "--sweep-qps",
        "10,40",
        "-P",
        &port,
        "-O",
        out.to_str().unwrap(),
        "--num-requests",
        "3",
        "--output-len",
        "fixed:3",
        "--input-len",
        "fixed:5",
    ]);
    let report = execute(&a).unwrap();
    assert_eq!(report.summaries.len(), 2);
    let csv = std::fs::read_to_string(out.join("sweep_qps.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 3);
    assert!(lines[1].starts_with("10,3,3,0,"), "{}", lines[1]);
    assert!(lines[2].starts_with("40,3,3,0,"), "{}", lines[2]);
    assert_eq!(
        read_json(&out.join("sweep_qps.json"))
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert!(out.join("sweep_throughput_latency.svg").is_file());
    assert!(out.join("result_10.0_x.json").is_file());
    assert!(out.join("result_40.0_x.json").is_file());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn unreachable_server_fails_fast_naming_the_address() {
    // Bind then drop a listener to get a port nobody listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = temp_dir("down");
    let out = dir.join("out");
    let p = port.to_string();
    let a = args(&[
        "-X",
        "100",
        "-P",
        &p,
        "-O",
        out.to_str().unwrap(),
        "-T",
        "30",
        "--input-len",
        "fixed:4",
        "--output-len",
        "fixed:2",
        "--no-plots",
    ]);
    // Checked once before the timed run (30 s here): an error at once, no run, no files.
    let started = std::time::Instant::now();
    let err = client_bench::run(a).unwrap_err().to_string();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "took {took:?}");
    assert!(
        err.contains(&format!("127.0.0.1:{port}")) && err.contains("connection refused"),
        "{err}"
    );
    assert!(!out.join("result_100.0_x.json").exists());
    std::fs::remove_dir_all(&dir).ok();
}

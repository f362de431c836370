//! The HTTP layer against the real mio server on 127.0.0.1:0 with raw TcpStream clients:
//! limits (413/408/431/411), routing errors (404/405), keep-alive, many concurrent streams, slow
//! readers, client disconnects (-> Abort to the engine), the queue limit (429) and the graceful
//! drain on shutdown. The engine on the other end is the echo thread of http_support.

mod http_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use http_support::*;
use npu_server::api::ApiSettings;
use npu_server::engine::EngineStats;
use npu_server::http::HttpLimits;
use serde_json::json;

#[test]
fn unknown_path_is_404_and_wrong_method_is_405_with_allow() {
    let server = TestServer::quick();
    let (_, r) = raw_exchange(&server, &get("/nope"));
    assert_eq!(r.status, 404);
    let v = r.json();
    assert_eq!(v["type"], "not_found");
    assert!(v["error"].as_str().unwrap().contains("/nope"));

    let (_, r) = raw_exchange(&server, &get("/models/llama2/generate"));
    assert_eq!(r.status, 405);
    assert_eq!(r.header("Allow"), Some("POST"));
    assert!(r.json()["error"].as_str().unwrap().contains("GET"));

    let (_, r) = raw_exchange(&server, &post_json("/health", &json!({}), ""));
    assert_eq!(r.status, 405);
    assert_eq!(r.header("Allow"), Some("GET"));

    // OpenAI routes answer in OpenAI's error shape.
    let (_, r) = raw_exchange(&server, &get("/v1/completions"));
    assert_eq!(r.status, 405);
    assert_eq!(r.json()["error"]["type"], "method_not_allowed");
}

#[test]
fn body_over_the_limit_is_413_without_reading_it() {
    let limits = HttpLimits {
        max_body_bytes: 1000,
        ..HttpLimits::default()
    };
    let server = TestServer::start(limits, ApiSettings::default(), Duration::ZERO);
    // Announce 10 MB and send none of it: the answer must come anyway.
    let (mut s, r) = raw_exchange(
        &server,
        b"POST /models/llama2/generate HTTP/1.1\r\nHost: t\r\nContent-Length: 10000000\r\n\r\n",
    );
    assert_eq!(r.status, 413);
    let msg = r.json()["error"].as_str().unwrap().to_string();
    assert!(msg.contains("10000000") && msg.contains("1000"), "{msg}");
    assert_eq!(r.header("Connection"), Some("close"));
    assert!(is_closed(&mut s));
}

#[test]
fn slow_head_is_408_and_closed() {
    let limits = HttpLimits {
        header_timeout: Duration::from_millis(200),
        ..HttpLimits::default()
    };
    let server = TestServer::start(limits, ApiSettings::default(), Duration::ZERO);
    let mut s = server.connect();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: t\r\n").unwrap(); // never finished
    let r = read_response(&mut s);
    assert_eq!(r.status, 408);
    assert!(r.json()["error"].as_str().unwrap().contains("200 ms"));
    assert!(is_closed(&mut s));

    // A slow body too.
    let mut s = server.connect();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 50\r\n\r\n{\"pro")
        .unwrap();
    let r = read_response(&mut s);
    assert_eq!(r.status, 408);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("body"));
    assert!(is_closed(&mut s));
}

#[test]
fn oversized_head_is_431() {
    let limits = HttpLimits {
        max_header_bytes: 2048,
        ..HttpLimits::default()
    };
    let server = TestServer::start(limits, ApiSettings::default(), Duration::ZERO);
    let big = format!(
        "GET /health HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n",
        "a".repeat(4000)
    );
    let (mut s, r) = raw_exchange(&server, big.as_bytes());
    assert_eq!(r.status, 431);
    assert!(r.json()["error"].as_str().unwrap().contains("2048"));
    assert!(is_closed(&mut s));
    // Without the end of the head in sight either.
    let big = format!("GET /health HTTP/1.1\r\nX-Big: {}", "a".repeat(4000));
    let (_, r) = raw_exchange(&server, big.as_bytes());
    assert_eq!(r.status, 431);
}

#[test]
fn chunked_request_body_is_411_and_bad_head_is_400() {
    let server = TestServer::quick();
    let (_, r) = raw_exchange(
        &server,
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    );
    assert_eq!(r.status, 411);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("Content-Length"));
    let (_, r) = raw_exchange(&server, b"NOT HTTP AT ALL\r\n\r\n");
    assert_eq!(r.status, 400);
}

#[test]
fn keep_alive_serves_several_requests_on_one_connection() {
    let server = TestServer::quick();
    let mut s = server.connect();
    for i in 0..3 {
        s.write_all(&get("/health")).unwrap();
        let r = read_response(&mut s);
        assert_eq!(r.status, 200, "request {i}");
        assert_eq!(r.json()["status"], "ok");
        assert_eq!(r.header("Connection"), None);
    }
    let body = json!({"inputs": "Hello there", "parameters": {"max_new_tokens": 3}});
    s.write_all(&post_json("/models/llama2/generate", &body, ""))
        .unwrap();
    let r = read_response(&mut s);
    assert_eq!(r.status, 200);
    s.write_all(&post_json("/models/llama2/generate_stream", &body, ""))
        .unwrap();
    let r = read_response(&mut s);
    assert!(r.chunked);
    assert_eq!(r.text().lines().count(), 3);
    // Two requests written at once are both answered, in order.
    let mut two = get("/health");
    two.extend_from_slice(&get("/v1/models"));
    s.write_all(&two).unwrap();
    assert_eq!(read_response(&mut s).json()["status"], "ok");
    assert_eq!(read_response(&mut s).json()["object"], "list");
    // HTTP/1.0 without keep-alive closes after the response.
    s.write_all(b"GET /health HTTP/1.0\r\n\r\n").unwrap();
    let r = read_response(&mut s);
    assert_eq!(r.status, 200);
    assert!(is_closed(&mut s));
}

#[test]
fn expect_100_continue_is_answered() {
    let server = TestServer::quick();
    let mut s = server.connect();
    let body = json!({"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).to_string();
    write!(
        s,
        "POST /models/x/generate HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    let r = read_response(&mut s);
    assert_eq!(r.status, 100);
    s.write_all(body.as_bytes()).unwrap();
    let r = read_response(&mut s);
    assert_eq!(r.status, 200);
}

#[test]
fn many_concurrent_streams_all_complete() {
    let server = TestServer::start(
        HttpLimits::default(),
        ApiSettings::default(),
        Duration::from_millis(5),
    );
    let addr = server.addr;
    let clients: Vec<_> = (0..48)
        .map(|i| {
            std::thread::spawn(move || {
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let prompt = format!("Request number {i} says hello to the server");
                let body =
                    json!({"inputs": prompt, "parameters": {"max_new_tokens": 12}, "stream": true});
                s.write_all(&post_json("/models/llama2", &body, ""))
                    .unwrap();
                let r = read_response(&mut s);
                assert_eq!(r.status, 200);
                let joined: String = r
                    .text()
                    .lines()
                    .map(|l| {
                        serde_json::from_str::<serde_json::Value>(l).unwrap()["data"][0]
                            ["generated_text"]
                            .as_str()
                            .unwrap()
                            .to_string()
                    })
                    .collect();
                let ids = tokenizer().encode(&prompt).unwrap();
                assert_eq!(joined, echo_text(&ids, 12), "client {i}");
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    assert_eq!(server.metrics.time_to_first_token.count(), 48);
    assert_eq!(server.metrics.e2e_latency.count(), 48);
}

#[test]
fn a_client_that_does_not_read_does_not_block_others() {
    let limits = HttpLimits {
        max_output_bytes: 64 << 20,
        ..HttpLimits::default()
    };
    let settings = ApiSettings {
        max_model_len: 100_000,
        ..ApiSettings::default()
    };
    let server = TestServer::start(limits, settings, Duration::ZERO);
    // A long prompt and many tokens with top-20 alternatives: megabytes of stream lines that
    // this client never reads.
    let prompt = "word ".repeat(2000);
    let body = json!({"inputs": prompt, "parameters": {"max_new_tokens": 10000, "top_n_tokens": 20}, "stream": true});
    let mut stuck = server.connect();
    stuck
        .write_all(&post_json("/models/llama2", &body, ""))
        .unwrap();
    // Wait until the engine has produced everything (the loop must have buffered it).
    for _ in 0..600 {
        if server.log.lock().unwrap().submitted.len() == 1
            && EngineStats::get(&server.stats.running) == 0
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Others are served meanwhile.
    for _ in 0..5 {
        let (_, r) = raw_exchange(&server, &get("/health"));
        assert_eq!(r.status, 200);
        let b = json!({"inputs": "quick one", "parameters": {"max_new_tokens": 2}});
        let (_, r) = raw_exchange(&server, &post_json("/models/x/generate", &b, ""));
        assert_eq!(r.status, 200);
    }
    // And the stuck client still gets its whole stream when it finally reads.
    let r = read_response(&mut stuck);
    assert_eq!(r.text().lines().count(), 10000);
}

#[test]
fn a_client_reading_too_slowly_past_the_output_cap_is_cut_and_aborted() {
    let limits = HttpLimits {
        max_output_bytes: 256 * 1024,
        ..HttpLimits::default()
    };
    let settings = ApiSettings {
        max_model_len: 100_000,
        ..ApiSettings::default()
    };
    let server = TestServer::start(limits, settings, Duration::from_millis(1));
    let body = json!({"inputs": "word ".repeat(100), "parameters": {"max_new_tokens": 90000, "top_n_tokens": 20}, "stream": true});
    let mut stuck = server.connect();
    stuck
        .write_all(&post_json("/models/llama2", &body, ""))
        .unwrap();
    let mut aborted = false;
    for _ in 0..3000 {
        if !server.log.lock().unwrap().aborted.is_empty() {
            aborted = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(aborted, "the engine was told to abort the request");
    // The connection is closed: reading drains what was sent, then ends.
    let mut sink = Vec::new();
    stuck
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let _ = stuck.read_to_end(&mut sink); // EOF or a reset: either way it ends
    assert!(
        !sink.ends_with(b"\r\n0\r\n\r\n"),
        "the stream was not completed"
    );
}

#[test]
fn client_disconnect_mid_stream_aborts_the_request() {
    let server = TestServer::start(
        HttpLimits::default(),
        ApiSettings::default(),
        Duration::from_millis(20),
    );
    let mut s = server.connect();
    let body = json!({"inputs": "Tell me a long story", "parameters": {"max_new_tokens": 1000}, "stream": true});
    s.write_all(&post_json("/models/llama2", &body, ""))
        .unwrap();
    // Read the head and a line or two, then hang up.
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).unwrap();
    assert!(n > 0);
    drop(s);
    let mut aborted = Vec::new();
    for _ in 0..500 {
        aborted = server.log.lock().unwrap().aborted.clone();
        if !aborted.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let submitted = server.log.lock().unwrap().submitted[0].id;
    assert_eq!(aborted, vec![submitted]);
    assert_eq!(
        server
            .metrics
            .client_aborts_total
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

/// Closes `s` with a TCP reset (SO_LINGER on, zero timeout) instead of a clean FIN.
fn reset(s: TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt reads one `linger` struct from a valid pointer on an open socket.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
    drop(s);
}

#[test]
fn a_client_that_resets_mid_stream_is_counted_as_a_client_abort() {
    let server = TestServer::start(
        HttpLimits::default(),
        ApiSettings::default(),
        Duration::from_millis(20),
    );
    let body = json!({"inputs": "Tell me a long story", "parameters": {"max_new_tokens": 1000}, "stream": true});
    for round in 1..=3u64 {
        let mut s = server.connect();
        s.write_all(&post_json("/models/llama2", &body, ""))
            .unwrap();
        let mut buf = [0u8; 512];
        assert!(s.read(&mut buf).unwrap() > 0);
        reset(s);
        // The counter, and the engine's Abort (which arrives a little later).
        let (mut aborts, mut engine_aborts) = (0, 0);
        for _ in 0..500 {
            aborts = server
                .metrics
                .client_aborts_total
                .load(std::sync::atomic::Ordering::Relaxed);
            engine_aborts = server.log.lock().unwrap().aborted.len() as u64;
            if aborts == round && engine_aborts == round {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(aborts, round, "reset number {round} was not counted");
        assert_eq!(engine_aborts, round, "reset number {round} was not aborted");
    }
}

#[test]
fn content_length_must_be_digits_only() {
    let server = TestServer::quick();
    for bad in ["+5", "-5", " 5x", "5,5", "0x5", "5e0"] {
        let raw = format!(
            "POST /models/m/generate HTTP/1.1\r\nHost: t\r\nContent-Length: {bad}\r\n\r\n{{\"a\":1}}"
        );
        let (mut s, r) = raw_exchange(&server, raw.as_bytes());
        assert_eq!(r.status, 400, "Content-Length {bad:?}");
        assert!(r.text().contains("digits only"), "{}", r.text());
        assert!(
            is_closed(&mut s),
            "the connection must not be reused after {bad:?}"
        );
    }
    assert!(server.log.lock().unwrap().submitted.is_empty());
}

#[test]
fn full_queue_gets_429_with_retry_after() {
    let limits = HttpLimits {
        max_queue: 1,
        ..HttpLimits::default()
    };
    let server = TestServer::start(limits, ApiSettings::default(), Duration::from_millis(50));
    let body = json!({"inputs": "Tell me a long story", "parameters": {"max_new_tokens": 100}, "stream": true});
    let mut first = server.connect();
    first
        .write_all(&post_json("/models/llama2", &body, ""))
        .unwrap();
    let mut b = [0u8; 64];
    assert!(first.read(&mut b).unwrap() > 0); // it is in flight
    let (_, r) = raw_exchange(
        &server,
        &post_json("/v1/completions", &json!({"prompt": "hi"}), ""),
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.header("Retry-After"), Some("1"));
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("limit 1"));
    // Other routes still answer.
    let (_, r) = raw_exchange(&server, &get("/health"));
    assert_eq!(r.status, 200);
}

#[test]
fn health_is_503_naming_what_is_down_until_ready() {
    let server = TestServer::quick();
    server
        .stats
        .ready
        .store(false, std::sync::atomic::Ordering::Relaxed);
    EngineStats::set(&server.stats.agents_up, 0);
    let (_, r) = raw_exchange(&server, &get("/health"));
    assert_eq!(r.status, 503);
    assert!(r.json()["error"]
        .as_str()
        .unwrap()
        .contains("0 of 1 agents"));
    server
        .stats
        .ready
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let (_, r) = raw_exchange(&server, &get("/health"));
    assert_eq!(r.status, 200);
}

#[test]
fn metrics_expose_counters_and_latency_histograms() {
    let server = TestServer::quick();
    EngineStats::set(&server.stats.kv_blocks_total, 2048);
    let b = json!({"inputs": "Hello", "parameters": {"max_new_tokens": 4}});
    let (_, r) = raw_exchange(&server, &post_json("/models/x/generate", &b, ""));
    assert_eq!(r.status, 200);
    let (_, r) = raw_exchange(&server, &get("/metrics"));
    assert_eq!(r.status, 200);
    assert!(r.header("Content-Type").unwrap().starts_with("text/plain"));
    let text = r.text();
    assert!(
        text.contains("npu_serving_kv_blocks_total 2048\n"),
        "{text}"
    );
    assert!(
        text.contains("npu_serving_time_to_first_token_seconds_count 1\n"),
        "{text}"
    );
    assert!(
        text.contains("npu_serving_inter_token_latency_seconds_count 3\n"),
        "{text}"
    );
    assert!(
        text.contains("npu_serving_e2e_request_latency_seconds_count 1\n"),
        "{text}"
    );
    assert!(text.contains("# TYPE npu_serving_step_time_seconds histogram"));
}

#[test]
fn shutdown_stops_accepting_and_lets_running_streams_finish() {
    let mut server = TestServer::start(
        HttpLimits::default(),
        ApiSettings::default(),
        Duration::from_millis(10),
    );
    let prompt = "Stream this to the end please";
    let body = json!({"inputs": prompt, "parameters": {"max_new_tokens": 40}, "stream": true});
    let mut s = server.connect();
    s.write_all(&post_json("/models/llama2", &body, ""))
        .unwrap();
    let mut b = [0u8; 16];
    let mut first = Vec::new();
    let n = s.read(&mut b).unwrap();
    first.extend_from_slice(&b[..n]);
    let idle = server.connect();
    server.shutdown.trigger();
    let addr = server.addr;
    // The server thread returns only after the stream has finished.
    let stop = std::thread::spawn(move || server.stop());
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    first.extend_from_slice(&rest);
    let text = String::from_utf8(first).unwrap();
    assert!(text.ends_with("\r\n0\r\n\r\n"), "the stream ended properly");
    let lines = text.matches("\"event\": \"message\"").count();
    assert_eq!(lines, 40);
    stop.join().unwrap().unwrap();
    // Idle connections were closed and nobody listens any more.
    let mut idle = idle;
    assert!(is_closed(&mut idle));
    assert!(std::net::TcpStream::connect(addr).is_err());
}

#[test]
fn sigterm_triggers_the_graceful_shutdown() {
    let mut server = TestServer::quick();
    server.shutdown.trigger_on_termination_signals().unwrap();
    // signal-hook has replaced the default action (which would end the test process): the
    // signal only triggers the shutdown, which wakes the server loop and makes it return.
    // SAFETY: raise() has no preconditions.
    assert_eq!(unsafe { libc::raise(libc::SIGTERM) }, 0);
    let join = server.server.take().unwrap();
    join.join().unwrap().unwrap();
    assert!(server.shutdown.is_triggered());
}

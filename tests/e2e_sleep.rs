//! End to end: sleep and wake (vLLM's `POST /sleep`, `POST /wake_up`, `GET /is_sleeping`) on the
//! real server with its agent and the default model. At level 1 the agent frees its KV pool and
//! keeps its weights; at level 2 it drops the model and loads it again from the checkpoint on
//! wake. A completion sent while the server sleeps is answered (it wakes the agent), with the
//! same greedy tokens as before sleeping; the idle timeout (`npu_serving.sleep_idle_seconds`)
//! puts the server to sleep by itself. Wake times are compared with the cold load (the agents'
//! start, which the server reports as `npu_serving_cold_start_seconds`): level 1 within half of
//! it, level 2 within twice it (plus 1 s, loosely, for a loaded 2-core machine). The figures are
//! printed.

mod e2e_support;

use std::time::{Duration, Instant};

use e2e_support::*;
use serde_json::{json, Value};

const PROMPT: &str = "The capital of France is";

/// A greedy completion of 12 tokens: its tokens and how long the request took.
fn greedy(server: &Server) -> (Vec<String>, Duration) {
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
        "logprobs": 0, "ignore_eos": true});
    let started = Instant::now();
    let (status, answer) = server.post_json("/v1/completions", &body);
    let took = started.elapsed();
    assert_eq!(status, 200, "{answer}; log:\n{}", server.log_tail());
    let tokens = answer["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs.tokens: {answer}"))
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    (tokens, took)
}

fn is_sleeping(server: &Server) -> (bool, u64) {
    let (status, text) = server.get("/is_sleeping");
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    (
        v["is_sleeping"].as_bool().unwrap(),
        v["level"].as_u64().unwrap(),
    )
}

fn sleep(server: &Server, level: u8) -> Value {
    let (status, v) = server.post_json("/sleep", &json!({ "level": level }));
    assert_eq!(status, 200, "{v}; log:\n{}", server.log_tail());
    assert_eq!(v["is_sleeping"], true, "{v}");
    assert_eq!(v["level"], level, "{v}");
    v
}

fn agent_rss(server: &Server) -> u64 {
    server.agent_pids().into_iter().map(rss_bytes).sum()
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

#[test]
fn sleep_at_both_levels_wakes_on_request_with_the_same_tokens() {
    let _serial = serial();
    let started = Instant::now();
    let server = Server::start("sleep-levels", &ServerOpts::default());
    let to_healthy = started.elapsed();
    let cold = server.metric("npu_serving_cold_start_seconds");
    assert!(cold > 0.0, "the cold start is reported");
    assert_eq!(is_sleeping(&server), (false, 0));
    let (before, _) = greedy(&server);
    let (again, awake) = greedy(&server);
    assert_eq!(before, again);
    let rss_awake = agent_rss(&server);

    // Bad values are refused naming the field; nothing sleeps.
    for (path, body, field) in [
        ("/sleep", json!({"level": 3}), "level"),
        ("/sleep?level=0", json!({}), "level"),
        ("/sleep", json!({"level": "deep"}), "level"),
        ("/sleep", json!({"lvl": 1}), "lvl"),
    ] {
        let (status, v) = server.post_json(path, &body);
        assert_eq!(status, 400, "{path} {body}: {v}");
        assert!(v.to_string().contains(field), "{path} {body}: {v}");
    }
    assert_eq!(is_sleeping(&server), (false, 0));
    let (status, v) = server.post_json("/wake_up", &json!({}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["already_awake"], true, "{v}");

    // Level 1: the KV pool goes, the weights stay; /wake_up brings the pool back.
    let s1 = sleep(&server, 1);
    assert_eq!(is_sleeping(&server), (true, 1));
    assert_eq!(server.metric("npu_serving_sleeping"), 1.0);
    assert_eq!(server.metric("npu_serving_sleep_level"), 1.0);
    let rss_l1 = agent_rss(&server);
    let (status, w1) = server.post_json("/wake_up", &json!({}));
    assert_eq!(status, 200, "{w1}");
    assert_eq!(w1["is_sleeping"], false, "{w1}");
    assert_eq!(w1["woke_from_level"], 1, "{w1}");
    let wake_l1 = w1["wake_seconds"].as_f64().unwrap();
    assert_eq!(is_sleeping(&server), (false, 0));
    assert_eq!(greedy(&server).0, before);

    // Level 1 again; a completion while asleep wakes the agent and is answered.
    sleep(&server, 1);
    let (tokens, asleep_l1) = greedy(&server);
    assert_eq!(
        tokens, before,
        "level 1: the same greedy tokens after waking"
    );
    assert_eq!(is_sleeping(&server), (false, 0));
    let first_l1 = server.metric("npu_serving_last_wake_seconds");

    // Level 2: the model is dropped; /wake_up loads it again from the checkpoint.
    let s2 = sleep(&server, 2);
    assert_eq!(is_sleeping(&server), (true, 2));
    let rss_l2 = agent_rss(&server);
    let (status, w2) = server.post_json("/wake_up", &json!({}));
    assert_eq!(status, 200, "{w2}");
    assert_eq!(w2["woke_from_level"], 2, "{w2}");
    let wake_l2 = w2["wake_seconds"].as_f64().unwrap();
    assert_eq!(greedy(&server).0, before);

    // Level 2 again; a completion while asleep reloads the model and is answered.
    sleep(&server, 2);
    let (tokens, asleep_l2) = greedy(&server);
    assert_eq!(
        tokens, before,
        "level 2: the same greedy tokens after reloading"
    );
    assert_eq!(is_sleeping(&server), (false, 0));
    let first_l2 = server.metric("npu_serving_last_wake_seconds");

    assert_eq!(server.metric("npu_serving_sleeps_total"), 4.0);
    assert_eq!(server.metric("npu_serving_wakes_total"), 4.0);
    assert_eq!(
        server.metric("npu_serving_wake_duration_seconds_count"),
        4.0
    );
    assert_eq!(server.metric("npu_serving_sleeping"), 0.0);
    assert_eq!(server.metric("npu_serving_http_responses_5xx_total"), 0.0);

    let s = |d: Duration| d.as_secs_f64();
    println!(
        "cold load (agent start, server-measured) {cold:.3} s; server start to healthy {:.3} s; \
         greedy completion awake {:.3} s\n\
         level 1: sleep {:.3} s (released {:.1} MiB), /wake_up {wake_l1:.3} s, wake by request \
         {first_l1:.3} s, request while asleep {:.3} s\n\
         level 2: sleep {:.3} s (released {:.1} MiB), /wake_up {wake_l2:.3} s, wake by request \
         {first_l2:.3} s, request while asleep {:.3} s\n\
         agent RSS: awake {:.1} MiB, asleep level 1 {:.1} MiB, asleep level 2 {:.1} MiB",
        s(to_healthy),
        s(awake),
        s1["sleep_seconds"].as_f64().unwrap(),
        mib(s1["released_bytes"].as_u64().unwrap()),
        s(asleep_l1),
        s2["sleep_seconds"].as_f64().unwrap(),
        mib(s2["released_bytes"].as_u64().unwrap()),
        s(asleep_l2),
        mib(rss_awake),
        mib(rss_l1),
        mib(rss_l2),
    );
    // Level 2 drops the weights: the agent holds much less.
    assert!(
        rss_l2 < rss_awake,
        "level 2 releases memory: {rss_l2} vs {rss_awake}"
    );
    // The judged bounds: level 1 within half the cold load, level 2 within twice it (+1 s of
    // slack for a loaded machine); the request's own compute (as awake) comes on top.
    for (what, wake) in [
        ("level 1 /wake_up", wake_l1),
        ("level 1 by request", first_l1),
    ] {
        assert!(
            wake <= 0.5 * cold,
            "{what}: {wake:.3} s > 0.5 x {cold:.3} s"
        );
    }
    for (what, wake) in [
        ("level 2 /wake_up", wake_l2),
        ("level 2 by request", first_l2),
    ] {
        assert!(
            wake <= 2.0 * cold + 1.0,
            "{what}: {wake:.3} s > 2 x {cold:.3} s + 1 s"
        );
    }
    assert!(
        s(asleep_l1) <= 0.5 * cold + s(awake) + 1.0,
        "level 1: the first request took {:.3} s (cold {cold:.3} s, awake {:.3} s)",
        s(asleep_l1),
        s(awake)
    );
    assert!(
        s(asleep_l2) <= 2.0 * cold + s(awake) + 1.0,
        "level 2: the first request took {:.3} s (cold {cold:.3} s, awake {:.3} s)",
        s(asleep_l2),
        s(awake)
    );
}

#[test]
fn the_idle_timeout_puts_the_server_to_sleep() {
    let _serial = serial();
    let opts = ServerOpts {
        npu_serving_extra: "  sleep_idle_seconds: 1\n  sleep_idle_level: 2\n".into(),
        ..ServerOpts::default()
    };
    let server = Server::start("sleep-idle", &opts);
    let (before, _) = greedy(&server);
    let until = Instant::now() + Duration::from_secs(30);
    while !is_sleeping(&server).0 {
        assert!(
            Instant::now() < until,
            "not asleep 30 s after the last request; log:\n{}",
            server.log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(is_sleeping(&server), (true, 2));
    assert!(server.metric("npu_serving_idle_sleeps_total") >= 1.0);
    let (tokens, took) = greedy(&server);
    assert_eq!(
        tokens, before,
        "the same greedy tokens after the idle sleep"
    );
    println!(
        "idle sleep at level 2 after 1 s; the next request took {:.3} s (cold load {:.3} s)",
        took.as_secs_f64(),
        server.metric("npu_serving_cold_start_seconds")
    );
}

#[test]
fn bad_idle_sleep_settings_are_refused_at_start_naming_the_key() {
    let _serial = serial();
    for (extra, key) in [
        ("  sleep_idle_level: 3\n", "npu_serving.sleep_idle_level"),
        (
            "  sleep_idle_seconds: -5\n",
            "npu_serving.sleep_idle_seconds",
        ),
    ] {
        let yaml = ServerOpts {
            npu_serving_extra: extra.into(),
            ..ServerOpts::default()
        }
        .yaml();
        let (status, stderr) = serve_refused("sleep-bad", &yaml, &[]);
        assert!(!status.success());
        assert!(stderr.contains(key), "{extra}: {stderr}");
    }
}

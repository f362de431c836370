//! End to end, prefill/decode disaggregation through the real server, two real agent processes
//! and the real model: with one prefill and one decode agent, greedy outputs are those of the
//! colocated server (two agents doing both) on the llm-serving and OpenAI completions APIs,
//! streaming and not; the metrics show KV blocks handed over and no prefill token computed on
//! the decode agent; a killed decode agent costs no request.

mod e2e_support;

use std::time::Duration;

use e2e_support::*;
use serde_json::json;

const MAX_NEW: usize = 24;

fn opts(roles: Option<&'static str>) -> ServerOpts {
    ServerOpts {
        agents: 2,
        seq_length: 512,
        agent_roles: roles,
        ..ServerOpts::default()
    }
}

/// Every prompt through both APIs, streamed by concurrent clients and then asked without
/// streaming one at a time: the texts in that order.
fn outputs(server: &Server) -> Vec<String> {
    let prompts: Vec<(String, usize)> = prompts().into_iter().map(|p| (p, MAX_NEW)).collect();
    let mut texts = Vec::new();
    for api in [Api::LlmServing, Api::Completions] {
        for (i, r) in server
            .stream_concurrently(api, &prompts, prompts.len())
            .into_iter()
            .enumerate()
        {
            assert!(r.success, "{api:?} client {i}: {:?}", r.error);
            texts.push(r.resp_text);
        }
    }
    for (p, n) in prompts.iter().take(6) {
        let (status, v) = server.post_json(
            &format!("/models/{MODEL}/generate"),
            &json!({"inputs": p, "parameters": {"max_new_tokens": n, "do_sample": false}}),
        );
        assert_eq!(status, 200, "{v}");
        texts.push(v["generated_text"].as_str().unwrap().to_string());
        let (status, v) = server.post_json(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": p, "max_tokens": n, "temperature": 0}),
        );
        assert_eq!(status, 200, "{v}");
        texts.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    texts
}

#[test]
fn one_prefill_and_one_decode_agent_give_the_colocated_outputs_with_kv_handed_over() {
    let _serial = serial();
    let colocated = {
        let server = Server::start("pd-colocated", &opts(None));
        let texts = outputs(&server);
        assert_eq!(
            server.metric("npu_serving_kv_handoff_requests_total{side=\"out\"}"),
            0.0
        );
        assert!(server.metric("npu_serving_prefill_tokens_total{role=\"both\"}") > 0.0);
        texts
    };
    let server = Server::start("pd-split", &opts(Some("[prefill, decode]")));
    assert!(server.metric("npu_serving_kv_handoff_region_blocks{state=\"total\"}") > 0.0);
    let split = outputs(&server);
    assert_eq!(split.len(), colocated.len());
    for (i, (s, c)) in split.iter().zip(&colocated).enumerate() {
        assert_eq!(
            s, c,
            "output {i}: the split server differs from the colocated one"
        );
    }
    let m = |name: &str| server.metric(name);
    let (req_out, req_in) = (
        m("npu_serving_kv_handoff_requests_total{side=\"out\"}"),
        m("npu_serving_kv_handoff_requests_total{side=\"in\"}"),
    );
    let (blocks_out, blocks_in) = (
        m("npu_serving_kv_handoff_blocks_total{side=\"out\"}"),
        m("npu_serving_kv_handoff_blocks_total{side=\"in\"}"),
    );
    let bytes = m("npu_serving_kv_handoff_bytes_total{side=\"out\"}");
    let prefill_on_decode = m("npu_serving_prefill_tokens_total{role=\"decode\"}");
    let prefill_on_prefill = m("npu_serving_prefill_tokens_total{role=\"prefill\"}");
    eprintln!(
        "handoff: {req_out} requests, {blocks_out} blocks ({bytes} B) out, {req_in} requests, \
         {blocks_in} blocks in; prefill tokens: {prefill_on_prefill} on the prefill agent, \
         {prefill_on_decode} on the decode agent"
    );
    // 44 requests, each generating more than one token, all handed over.
    assert_eq!(req_out, split.len() as f64);
    assert_eq!(req_in, req_out);
    assert!(blocks_out >= req_out, "at least one block per request");
    assert_eq!(blocks_in, blocks_out);
    assert!(bytes > 0.0 && bytes % blocks_out == 0.0);
    assert_eq!(
        prefill_on_decode, 0.0,
        "the decode agent recomputed nothing"
    );
    assert!(prefill_on_prefill > 0.0);
    let used = server.wait_metric(
        "npu_serving_kv_handoff_region_blocks{state=\"used\"}",
        Duration::from_secs(30),
        |v| v == 0.0,
    );
    assert_eq!(used, 0.0, "every handoff block is free again");
    assert_eq!(
        server.wait_metric("npu_serving_kv_blocks_used", Duration::from_secs(30), |v| {
            v == 0.0
        }),
        0.0
    );
}

/// The pid of the agent started with `--agent-id id`.
fn agent_pid(server: &Server, id: u32) -> u32 {
    server
        .agent_pids()
        .into_iter()
        .find(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<String> = cmd
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            args.windows(2)
                .any(|w| w[0] == "--agent-id" && w[1] == id.to_string())
        })
        .unwrap_or_else(|| panic!("no agent {id}"))
}

#[test]
fn a_killed_decode_agent_costs_no_request() {
    let _serial = serial();
    let server = Server::start("pd-kill", &opts(Some("[prefill, decode]")));
    let prompts: Vec<(String, usize)> = prompts().into_iter().take(8).map(|p| (p, 48)).collect();
    let alone: Vec<String> = prompts
        .iter()
        .map(|(p, n)| {
            let r = server.stream(Api::LlmServing, p, *n);
            assert!(r.success, "{:?}", r.error);
            r.resp_text
        })
        .collect();
    let decode = agent_pid(&server, 1);
    let before = server.metric("npu_serving_generation_tokens_total");
    let records = std::thread::scope(|s| {
        let load = s.spawn(|| server.stream_concurrently(Api::LlmServing, &prompts, 8));
        // Kill the decode agent once the load is streaming.
        let until = std::time::Instant::now() + Duration::from_secs(120);
        while server.metric("npu_serving_generation_tokens_total") < before + 40.0 {
            assert!(
                std::time::Instant::now() < until,
                "the load produced no tokens"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: kill(2) on the server's decode agent process.
        assert_eq!(unsafe { libc::kill(decode as i32, libc::SIGKILL) }, 0);
        load.join().unwrap()
    });
    for (i, r) in records.iter().enumerate() {
        assert!(r.success, "client {i}: {:?}", r.error);
        assert_eq!(
            r.resp_text, alone[i],
            "client {i}: the crash changed the text"
        );
    }
    // The restart is counted once the new agent is up, which may come after the last request
    // has finished elsewhere.
    assert!(
        server.wait_metric(
            "npu_serving_agent_restarts_total",
            Duration::from_secs(120),
            |v| v >= 1.0
        ) >= 1.0
    );
    assert_eq!(
        server.wait_metric(
            "npu_serving_kv_handoff_region_blocks{state=\"used\"}",
            Duration::from_secs(30),
            |v| v == 0.0
        ),
        0.0
    );
}

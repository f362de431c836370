//! End to end: one server serving two models (`npu_serving.models`) with room for one
//! (`max_resident_models: 1`): the default model and a random-weight synth GGUF file, each
//! described by its own config. Nothing is loaded at start; each request's `model` field picks
//! its model, which is loaded on demand after the other is unloaded. Alternating requests, a
//! request sent while its model loads, and two requests for different models sent together are
//! all answered with the greedy tokens each model gives when served alone; an unknown model is
//! 404 naming it; /v1/models lists both with their state; loads, evictions, held requests and
//! load times are in /metrics, and only one model's agents run at a time. A model whose load
//! fails (its file removed after start) gets its request a 500 naming it, and the others still
//! load; SIGTERM stops the server and the loaded model's agents with it. With room for two, a
//! load that fails beside a loaded model is tried again alone before the error.

mod e2e_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use e2e_support::*;
use serde_json::{json, Value};

const PROMPT: &str = "The capital of France is";
/// The synth file's variant (a small Qwen2-shaped model, f32 weights).
const VARIANT: &str = "qwen2_hd32_gqa4_bias0_base1e6_untied_f32";
const SMOL: &str = "smol";
const TINY: &str = "tiny";

/// A greedy completion of `n` tokens from `model` (None: the field left out): its tokens.
fn greedy(server: &Server, model: Option<&str>, n: u32) -> Vec<String> {
    let mut body = json!({"prompt": PROMPT, "max_tokens": n, "temperature": 0,
        "logprobs": 0, "ignore_eos": true});
    if let Some(m) = model {
        body["model"] = json!(m);
    }
    let (status, answer) = server.post_json("/v1/completions", &body);
    assert_eq!(status, 200, "{answer}; log:\n{}", server.log_tail());
    if let Some(m) = model {
        assert_eq!(answer["model"], m, "{answer}");
    }
    answer["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs.tokens: {answer}"))
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect()
}

/// One model's own config (the test's usual one, its model file given or the default model).
fn model_yaml(model_file: Option<&Path>) -> String {
    let mut opts = ServerOpts {
        num_blocks: 256,
        ..ServerOpts::default()
    };
    if let Some(f) = model_file {
        opts.npu_serving_extra = format!("  model_file: '{}'\n", f.display());
    }
    opts.yaml()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// `name`'s state in /v1/models.
fn state(server: &Server, name: &str) -> String {
    let (status, text) = server.get("/v1/models");
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let entry = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == name)
        .unwrap_or_else(|| panic!("{name} not in /v1/models: {v}"))
        .clone();
    assert_eq!(
        entry["loaded"].as_bool().unwrap(),
        entry["status"]["value"] == "loaded",
        "{entry}"
    );
    entry["status"]["value"].as_str().unwrap().to_string()
}

fn per_model(server: &Server, metric: &str, model: &str) -> f64 {
    server.metric(&format!("{metric}{{model=\"{model}\"}}"))
}

#[test]
fn two_models_with_room_for_one_answer_alternating_requests_as_each_alone() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("npu-e2e-multimodel-files-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let gguf = dir.join("tiny.gguf");
    let out = Command::new(env!("CARGO_BIN_EXE_npu-serving"))
        .args(["synth-model", "--variant", VARIANT])
        .arg(&gguf)
        .output()
        .expect("npu-serving synth-model runs");
    assert!(
        out.status.success(),
        "synth-model: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let smol_cfg = write(&dir, "smol.yaml", &model_yaml(None));
    let tiny_cfg = write(&dir, "tiny.yaml", &model_yaml(Some(&gguf)));
    // A third model whose file is removed once the server has started: its loads fail.
    let gone = dir.join("gone.gguf");
    std::fs::copy(&gguf, &gone).unwrap();
    write(&dir, "gone.yaml", &model_yaml(Some(&gone)));

    // Each model served alone: the reference tokens.
    let alone = |name: &str, cfg: &Path| {
        let server = Server::start_file(&format!("models-alone-{name}"), cfg);
        (greedy(&server, None, 12), greedy(&server, None, 40))
    };
    let (smol_ref, smol_long) = alone(SMOL, &smol_cfg);
    let (tiny_ref, tiny_long) = alone(TINY, &tiny_cfg);
    assert_ne!(
        smol_ref, tiny_ref,
        "the two models must differ for the test to mean anything"
    );

    // The listing config: the model configs by relative path, room for one.
    let top = write(
        &dir,
        "models.yaml",
        "serving_config:\n  server_ip: '127.0.0.1'\n  server_port: 8835\n\
         npu_serving:\n  max_resident_models: 1\n  models:\n    \
         - {name: smol, config: smol.yaml}\n    - {name: tiny, config: tiny.yaml}\n    \
         - {name: gone, config: gone.yaml}\n",
    );
    let server = Server::start_file("models", &top);
    std::fs::remove_file(&gone).unwrap();
    assert!(
        server.agent_pids().is_empty(),
        "nothing loads before a request"
    );
    assert_eq!(state(&server, SMOL), "unloaded");
    assert_eq!(state(&server, TINY), "unloaded");
    assert_eq!(server.metric("npu_serving_models_resident"), 0.0);

    // An unknown model is 404 naming it (and the served ones); nothing loads.
    let (status, v) = server.post_json(
        "/v1/completions",
        &json!({"model": "nope", "prompt": PROMPT, "max_tokens": 2}),
    );
    assert_eq!(status, 404, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("nope") && msg.contains(SMOL) && msg.contains(TINY),
        "{v}"
    );
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    let (status, _) = server.get("/v1/models/nope");
    assert_eq!(status, 404);
    let (status, _) = server.post_json("/sleep", &json!({"level": 1}));
    assert_eq!(status, 400, "sleep is refused on a multi-model server");

    // Alternating requests: each loads its model after the other is unloaded.
    let started = Instant::now();
    for round in 0..2 {
        assert_eq!(greedy(&server, Some(SMOL), 12), smol_ref, "round {round}");
        assert_eq!(state(&server, SMOL), "loaded");
        assert_eq!(server.agent_pids().len(), 1, "one model's agent at a time");
        assert_eq!(greedy(&server, Some(TINY), 12), tiny_ref, "round {round}");
        assert_eq!(state(&server, TINY), "loaded");
        assert_eq!(state(&server, SMOL), "unloaded");
        assert_eq!(server.agent_pids().len(), 1, "one model's agent at a time");
    }
    let alternating = started.elapsed();
    // The loaded model again: no load.
    assert_eq!(greedy(&server, Some(TINY), 12), tiny_ref);
    assert_eq!(
        per_model(&server, "npu_serving_model_loads_total", SMOL),
        2.0
    );
    assert_eq!(
        per_model(&server, "npu_serving_model_loads_total", TINY),
        2.0
    );
    assert_eq!(
        per_model(&server, "npu_serving_model_evictions_total", SMOL),
        2.0
    );
    assert_eq!(
        per_model(&server, "npu_serving_model_evictions_total", TINY),
        1.0
    );
    assert_eq!(
        per_model(&server, "npu_serving_model_requests_total", TINY),
        3.0
    );
    assert_eq!(
        per_model(&server, "npu_serving_model_held_requests_total", TINY),
        2.0
    );
    assert_eq!(server.metric("npu_serving_models_resident"), 1.0);
    assert_eq!(server.metric("npu_serving_models_max_resident"), 1.0);
    let smol_load = per_model(&server, "npu_serving_model_last_load_seconds", SMOL);
    let tiny_load = per_model(&server, "npu_serving_model_last_load_seconds", TINY);
    assert!(smol_load > 0.0 && tiny_load > 0.0);

    // A request arriving while its model loads is held and answered.
    std::thread::scope(|s| {
        let first = s.spawn(|| greedy(&server, Some(SMOL), 12));
        let until = Instant::now() + Duration::from_secs(60);
        while per_model(&server, "npu_serving_model_loading", SMOL) != 1.0 {
            assert!(
                Instant::now() < until,
                "smol never loading; log:\n{}",
                server.log_tail()
            );
            assert!(
                !first.is_finished(),
                "the first request ended before smol was loading"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(state(&server, SMOL), "loading");
        let second = greedy(&server, Some(SMOL), 12);
        assert_eq!(second, smol_ref, "the request sent during the load");
        assert_eq!(first.join().unwrap(), smol_ref);
    });
    assert_eq!(
        per_model(&server, "npu_serving_model_loads_total", SMOL),
        3.0
    );
    assert_eq!(
        per_model(&server, "npu_serving_model_held_requests_total", SMOL),
        4.0
    );

    // Requests for both models at once: the loaded one finishes its request before it is
    // unloaded, and the other is held until then; both are right.
    std::thread::scope(|s| {
        let a = s.spawn(|| greedy(&server, Some(SMOL), 40));
        let b = s.spawn(|| greedy(&server, Some(TINY), 40));
        assert_eq!(a.join().unwrap(), smol_long);
        assert_eq!(b.join().unwrap(), tiny_long);
    });
    assert_eq!(server.metric("npu_serving_models_resident"), 1.0);
    assert_eq!(server.agent_pids().len(), 1);
    assert_eq!(server.metric("npu_serving_http_responses_5xx_total"), 0.0);

    // A load that fails (alone: the loaded model made room first) ends the held request with
    // the error naming the model.
    let (status, v) = server.post_json(
        "/v1/completions",
        &json!({"model": "gone", "prompt": PROMPT, "max_tokens": 2}),
    );
    assert_eq!(status, 500, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("gone") && msg.contains("could not be loaded"),
        "{v}"
    );
    assert_eq!(
        per_model(&server, "npu_serving_model_load_failures_total", "gone"),
        1.0
    );
    assert_eq!(
        per_model(&server, "npu_serving_model_loads_total", "gone"),
        0.0
    );
    assert_eq!(state(&server, "gone"), "unloaded");
    assert_eq!(server.metric("npu_serving_models_resident"), 0.0);
    assert!(server.agent_pids().is_empty());
    // The others still load and answer.
    assert_eq!(greedy(&server, Some(TINY), 12), tiny_ref);
    let total_loads = per_model(&server, "npu_serving_model_loads_total", SMOL)
        + per_model(&server, "npu_serving_model_loads_total", TINY);
    println!(
        "2 models, room for 1: 4 alternating requests (4 loads) in {:.2} s; last load smol \
         {smol_load:.3} s, tiny {tiny_load:.3} s; {total_loads} loads in all",
        alternating.as_secs_f64()
    );
    // SIGTERM: the loaded model's engine drains and its agents exit with the server.
    let agents = server.agent_pids();
    let mut server = server;
    server.signal(libc::SIGTERM);
    assert!(server.wait_exit(Duration::from_secs(60)).success());
    let until = Instant::now() + Duration::from_secs(10);
    while agents
        .iter()
        .any(|p| Path::new(&format!("/proc/{p}")).exists())
    {
        assert!(
            Instant::now() < until,
            "agents {agents:?} outlived the server"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // Room for two: a load that fails beside a loaded model is tried again alone (the other
    // unloaded first, in case memory was short); failing again, its request gets the error.
    std::fs::copy(&gguf, &gone).unwrap();
    let top2 = write(
        &dir,
        "models2.yaml",
        "serving_config:\n  server_ip: '127.0.0.1'\n  server_port: 8835\n\
         npu_serving:\n  max_resident_models: 2\n  models:\n    \
         - {name: tiny, config: tiny.yaml}\n    - {name: gone, config: gone.yaml}\n",
    );
    let server = Server::start_file("models-retry", &top2);
    std::fs::remove_file(&gone).unwrap();
    assert_eq!(greedy(&server, Some(TINY), 12), tiny_ref);
    let (status, v) = server.post_json(
        "/v1/completions",
        &json!({"model": "gone", "prompt": PROMPT, "max_tokens": 2}),
    );
    assert_eq!(status, 500, "{v}");
    assert_eq!(
        per_model(&server, "npu_serving_model_load_failures_total", "gone"),
        2.0,
        "tried beside tiny, then alone"
    );
    assert_eq!(
        per_model(&server, "npu_serving_model_evictions_total", TINY),
        1.0
    );
    assert_eq!(greedy(&server, Some(TINY), 12), tiny_ref);
    assert_eq!(
        per_model(&server, "npu_serving_model_loads_total", TINY),
        2.0
    );
    let _ = std::fs::remove_dir_all(&dir);
}

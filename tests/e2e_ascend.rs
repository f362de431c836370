//! End to end on the Ascend backend over the strict CANN emulation (`ASCEND_HOME_PATH`, else the
//! directory `scripts/ascend-emulator.sh` builds): `generate --device ascend` and the real server
//! with `npu_serving.device: ascend` give the CPU backend's greedy tokens up to each prompt's first
//! near-tie (a top-1/top-2 gap below 0.15 for llama.cpp or for the CPU backend: there an f16
//! device legitimately picks the other token), answer both APIs, streaming and concurrent, with
//! the same tokens as single requests, and leave nothing alive in the emulation at exit
//! (`aclFinalize` once, after the model is dropped); `POST /sleep` at level 1 moves the weights to
//! host memory and frees their device memory, and the wake copies them back (no reload), with
//! the same greedy tokens after. Built with the `ascend` feature.

#![cfg(feature = "ascend")]

mod e2e_support;

use std::process::Command;
use std::time::Duration;

use e2e_support::*;
use serde_json::{json, Value};

const NEAR_TIE: f64 = 0.15;
const NEW_TOKENS: usize = 32;

/// What the emulation prints at a clean `aclFinalize`; leaks print "never destroyed" instead.
const CLEAN_FINALIZE: &str = "ascend-emulator: nothing left alive at aclFinalize";

/// Runs `npu-serving` with `args` and the emulation as CANN; (stdout, stderr), asserting success.
fn npu_serving(args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_npu-serving"))
        .env("ASCEND_HOME_PATH", ascend_emulator())
        .args(args)
        .output()
        .expect("npu-serving runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{args:?} failed:\n{stderr}");
    (stdout, stderr)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// `generate --json` greedy output ids on `device`, and the stderr of the run.
fn generate(device: &str, prompt: &str) -> (Vec<u32>, String) {
    let n = NEW_TOKENS.to_string();
    let (out, err) = npu_serving(&[
        "generate",
        "--prompt",
        prompt,
        "--max-tokens",
        &n,
        "--temperature",
        "0",
        "--device",
        device,
        "--json",
    ]);
    let v: Value = serde_json::from_str(out.trim()).expect("generate --json prints JSON");
    (ids(&v["output_ids"]), err)
}

/// The CPU backend's top-1/top-2 gaps along `continuation` (teacher-forced, `score`).
fn cpu_gaps(prompt: &str, continuation: &[u32]) -> Vec<f64> {
    let list: Vec<String> = continuation.iter().map(|t| t.to_string()).collect();
    let (out, _) = npu_serving(&[
        "score",
        "--prompt",
        prompt,
        "--continuation-ids",
        &list.join(","),
        "--device",
        "cpu",
        "--json",
    ]);
    let v: Value = serde_json::from_str(out.trim()).expect("score --json prints JSON");
    v["positions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["gap"].as_f64().unwrap())
        .collect()
}

/// One prompt's CPU greedy tokens and how many of them are decided: up to the first near-tie of
/// the CPU backend or (for the reference prompts) of llama.cpp.
struct CpuRef {
    prompt: String,
    tokens: Vec<u32>,
    decided: usize,
}

/// llama.cpp's first near-tie of each reference prompt (the agent's test data).
fn llama_near_ties() -> Vec<(String, usize)> {
    let text = include_str!("../agent/tests/data/greedy_smollm2_q4_1.jsonl");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let n = v["output_ids"].as_array().unwrap().len();
            let tie = v["first_step_gap_below_0.15"]
                .as_u64()
                .map_or(n, |k| k as usize);
            (v["prompt"].as_str().unwrap().to_string(), tie)
        })
        .collect()
}

/// The reference prompts and two others, with the CPU backend's greedy tokens.
fn cpu_refs() -> Vec<CpuRef> {
    let mut prompts = llama_near_ties();
    for p in ["Water boils at", "The three primary colours are"] {
        prompts.push((p.to_string(), NEW_TOKENS));
    }
    prompts
        .into_iter()
        .map(|(prompt, llama_tie)| {
            let (tokens, _) = generate("cpu", &prompt);
            let gaps = cpu_gaps(&prompt, &tokens);
            let cpu_tie = gaps
                .iter()
                .position(|&g| g < NEAR_TIE)
                .unwrap_or(gaps.len());
            CpuRef {
                decided: cpu_tie.min(llama_tie).min(tokens.len()),
                prompt,
                tokens,
            }
        })
        .collect()
}

fn decode(ids: &[u32]) -> String {
    let model = npu_gguf::store::resolve_model(None).unwrap();
    let gguf = npu_gguf::GgufFile::open(&model).unwrap();
    let tokenizer = npu_tokenizer::Tokenizer::for_model(&gguf, &model).unwrap();
    tokenizer.decode_continuation(ids, true)
}

#[test]
fn generate_on_ascend_gives_the_cpu_tokens_up_to_the_first_near_tie() {
    let _serial = serial();
    for r in cpu_refs() {
        let (got, err) = generate("ascend", &r.prompt);
        let same = got
            .iter()
            .zip(&r.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!(
            "{:?}: {same} tokens as the CPU backend, {} decided",
            r.prompt, r.decided
        );
        assert!(
            got.len() >= r.decided && got[..r.decided] == r.tokens[..r.decided],
            "{:?}: ascend {got:?} differs from the CPU backend's {:?} before step {}",
            r.prompt,
            r.tokens,
            r.decided
        );
        assert!(err.contains("(emulation)"), "not on the emulation:\n{err}");
        assert!(!err.contains("never destroyed"), "leaks:\n{err}");
        assert_eq!(err.matches(CLEAN_FINALIZE).count(), 1, "{err}");
    }
}

/// The single-request text of each prompt on `api`.
fn singles(server: &Server, api: Api, prompts: &[(String, usize)]) -> Vec<String> {
    prompts
        .iter()
        .map(|(p, n)| {
            let r = server.stream(api, p, *n);
            assert!(r.success, "{p:?}: {:?}", r.error);
            r.resp_text
        })
        .collect()
}

fn assert_concurrent_equal_singles(server: &Server, api: Api, prompts: &[(String, usize)]) {
    let want = singles(server, api, prompts);
    let records = server.stream_concurrently(api, prompts, 2 * prompts.len());
    for (i, r) in records.iter().enumerate() {
        assert!(r.success, "{api:?} client {i}: {:?}", r.error);
        assert_eq!(
            r.resp_text,
            want[i % want.len()],
            "{api:?} client {i}: concurrent output differs from the single request's"
        );
    }
}

#[test]
fn serve_on_ascend_answers_both_apis_with_the_cpu_tokens() {
    let _serial = serial();
    let refs = cpu_refs();
    // The CPU server's greedy text: the CPU tokens (as `generate` gives them) in full.
    let cpu = Server::start("ascend-e2e-cpu", &ServerOpts::default());
    for r in &refs {
        let got = cpu.stream(Api::LlmServing, &r.prompt, NEW_TOKENS);
        assert!(got.success, "{:?}", got.error);
        assert_eq!(
            got.resp_text,
            decode(&r.tokens),
            "{:?} on the CPU",
            r.prompt
        );
    }
    drop(cpu);

    let opts = ServerOpts {
        device: "ascend",
        block_size: 128,
        num_blocks: 96,
        decode_batch_size: 16,
        env: vec![("ASCEND_HOME_PATH".into(), ascend_emulator())],
        ..ServerOpts::default()
    };
    let mut server = Server::start("ascend-e2e", &opts);
    for api in [Api::LlmServing, Api::Completions] {
        for r in &refs {
            let got = server.stream(api, &r.prompt, NEW_TOKENS);
            assert!(got.success, "{api:?} {:?}: {:?}", r.prompt, got.error);
            let want = decode(&r.tokens[..r.decided]);
            assert!(
                got.resp_text.starts_with(&want),
                "{api:?} {:?}: {:?} does not start with the CPU server's {want:?}",
                r.prompt,
                got.resp_text
            );
        }
    }
    let prompts: Vec<(String, usize)> = prompts()
        .into_iter()
        .take(6)
        .enumerate()
        .map(|(i, p)| (p, 12 + (i % 3) * 6))
        .collect();
    assert_concurrent_equal_singles(&server, Api::LlmServing, &prompts);
    assert_concurrent_equal_singles(&server, Api::Completions, &prompts);
    assert_concurrent_equal_singles(&server, Api::Chat, &prompts[..3]);
    assert_eq!(server.metric("npu_serving_http_responses_5xx_total"), 0.0);

    // A drained server's agent releases everything it made, then finalizes the runtime once.
    server.signal(libc::SIGTERM);
    let status = server.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{status:?}\n{}", server.log_tail());
    let log = server.log_text();
    assert!(!log.contains("never destroyed"), "leaks:\n{log}");
    assert_eq!(
        log.matches(CLEAN_FINALIZE).count(),
        1,
        "{}",
        server.log_tail()
    );
}

/// Bytes of one KV block of the default model at block size 128 (f16 K and V, 30 layers, 3 KV
/// heads of 64).
const ASCEND_BLOCK_BYTES: u64 = 30 * 2 * 128 * 3 * 64 * 2;

/// The server with `device: ascend` on an emulated device of `hbm_mb` MiB whose KV pool takes
/// `fraction` of the memory free after the weights.
fn memory_sized_opts(hbm_mb: u32, fraction: f64) -> ServerOpts {
    ServerOpts {
        device: "ascend",
        block_size: 128,
        // A cap out of reach: the free memory decides.
        num_blocks: 100_000,
        kv_cache_memory_fraction: Some(fraction),
        env: vec![
            ("ASCEND_HOME_PATH".into(), ascend_emulator()),
            ("ASCEND_EMULATOR_HBM_MB".into(), hbm_mb.to_string().into()),
        ],
        ..ServerOpts::default()
    }
}

#[test]
fn serve_on_ascend_sizes_the_kv_pool_from_free_device_memory() {
    let _serial = serial();
    let prompt = "The capital of France is";
    let (cpu_tokens, _) = generate("cpu", prompt);
    let want = decode(&cpu_tokens[..4]);

    // The same model on a device with 1 GiB more: half of that GiB more blocks, in whole
    // blocks (the weights and step buffers take the same bytes on both).
    let mut pools = Vec::new();
    for hbm_mb in [1024, 2048] {
        let server = Server::start(
            &format!("ascend-kv-{hbm_mb}"),
            &memory_sized_opts(hbm_mb, 0.5),
        );
        let blocks = server.metric("npu_serving_kv_blocks_total") as u64;
        let got = server.stream(Api::LlmServing, prompt, 8);
        assert!(got.success, "{:?}", got.error);
        assert!(got.resp_text.starts_with(&want), "{:?}", got.resp_text);
        assert!(
            server
                .log_text()
                .contains("KV pool sized from free device memory"),
            "{}",
            server.log_tail()
        );
        pools.push(blocks);
    }
    let more = pools[1] - pools[0];
    let half_gib = (512u64 << 20) / ASCEND_BLOCK_BYTES;
    assert!(
        (half_gib..=half_gib + 1).contains(&more),
        "pools {pools:?}: {more} more blocks, expected {half_gib} (or one more)"
    );
    // The 1 GiB device: its pool at a fraction of 0.5 says how much was free; a fraction that
    // leaves room for fewer blocks than one 1,024-token sequence needs (8) is refused naming
    // the setting, before any request is taken. Of the 4 blocks it sizes, decode-step graphs
    // (`graph_capture: auto`, the default) keep one for their padded rows (up to 31 rows of
    // the bucket of 64, a slot each, in blocks of 128), so the scheduler is offered 3.
    let free = pools[0] * ASCEND_BLOCK_BYTES * 2;
    let fraction = 4.5 * ASCEND_BLOCK_BYTES as f64 / free as f64;
    let opts = memory_sized_opts(1024, fraction);
    let env: Vec<(&str, Option<&str>)> = opts
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.to_str()))
        .collect();
    let (status, stderr) = serve_refused_env("ascend-kv-small", &opts.yaml(), &[], &env);
    assert!(!status.success());
    assert!(
        stderr.contains("npu_serving.kv_cache_memory_fraction: 3 blocks"),
        "{stderr}"
    );
    assert!(stderr.contains("at least 8"), "{stderr}");
}

/// Sleep level 1 on the served Ascend device: the agent keeps its engine, copies the weights to
/// host memory and frees their device memory (`released_bytes` counts them, at least the
/// 135M-parameter model's INT4 matrices and f16 embedding table), a wake copies them back
/// within half the cold load, without loading the checkpoint again, and the greedy tokens are
/// those before the sleep.
#[test]
fn serve_on_ascend_sleeps_at_level_one_with_the_weights_in_host_memory() {
    let _serial = serial();
    let opts = ServerOpts {
        device: "ascend",
        block_size: 128,
        num_blocks: 32,
        env: vec![("ASCEND_HOME_PATH".into(), ascend_emulator())],
        ..ServerOpts::default()
    };
    let server = Server::start("ascend-sleep", &opts);
    let prompt = "The capital of France is";
    let greedy = || {
        let got = server.stream(Api::Completions, prompt, 12);
        assert!(got.success, "{:?}\n{}", got.error, server.log_tail());
        got.resp_text
    };
    let before = greedy();
    let cold = server.metric("npu_serving_cold_start_seconds");

    let (status, s1) = server.post_json("/sleep", &json!({"level": 1}));
    assert_eq!(status, 200, "{s1}\n{}", server.log_tail());
    assert_eq!(
        (s1["is_sleeping"].as_bool(), s1["level"].as_u64()),
        (Some(true), Some(1))
    );
    let released = s1["released_bytes"].as_u64().unwrap();
    assert!(
        released > 64 << 20,
        "{released} bytes released at level 1\n{}",
        server.log_tail()
    );
    let (status, w1) = server.post_json("/wake_up", &json!({}));
    assert_eq!(status, 200, "{w1}");
    assert_eq!(w1["woke_from_level"], 1, "{w1}");
    let wake = w1["wake_seconds"].as_f64().unwrap();
    println!(
        "ascend level 1: released {:.1} MiB, wake {wake:.3} s, cold load {cold:.3} s",
        released as f64 / (1 << 20) as f64
    );
    let log = server.log_text();
    assert!(
        log.contains("weights copied to host memory"),
        "{}",
        server.log_tail()
    );
    assert!(
        !log.contains("loaded again from the checkpoint"),
        "level 1 reloaded the model:\n{}",
        server.log_tail()
    );
    assert!(wake < 0.5 * cold, "wake {wake} s, cold load {cold} s");
    assert_eq!(
        greedy(),
        before,
        "greedy tokens after sleep level 1 and wake"
    );
}

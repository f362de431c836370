//! End to end, the KV memory hierarchy through the real server, agent processes and model:
//! swap preemption under a small device pool keeps every greedy output equal to the request
//! run alone; a repeated prefix that was evicted from the device is served from the host tier
//! (and gives the same text as recomputing it); the host->device bytes of a step do not grow
//! with context length except for the block table, one 4-byte entry per block; a pool sized
//! from free memory (`npu_serving.kv_cache_memory_fraction`) is what the scheduler plans with.

mod e2e_support;

use std::time::Duration;

use e2e_support::*;
use serde_json::json;

/// `n` distinct prompts of exactly `tokens` tokens (by the model's tokenizer).
fn long_prompts(n: usize, tokens: usize) -> Vec<String> {
    let base = prompts();
    (0..n)
        .map(|i| {
            let mut text = format!("Note {i} of a long collection of questions and answers.\n");
            while token_counter().prompt_tokens(&text).unwrap() < tokens + 8 {
                for k in 0..base.len() {
                    text.push_str(&base[(i + k) % base.len()]);
                    text.push('\n');
                }
            }
            let p = token_counter().truncate_to_tokens(&text, tokens).unwrap();
            assert_eq!(token_counter().prompt_tokens(&p).unwrap(), tokens);
            p
        })
        .collect()
}

#[test]
fn swap_preemption_keeps_every_greedy_output_and_moves_blocks_both_ways() {
    let _serial = serial();
    // 64 blocks of 16 tokens hold three 300-token prompts; their decoding outgrows the pool,
    // and 24 requests are in flight at once.
    let opts = ServerOpts {
        num_blocks: 64,
        seq_length: 512,
        swap_space_mb: 64,
        prefix_cache: false,
        ..ServerOpts::default()
    };
    let prompts: Vec<(String, usize)> =
        long_prompts(24, 300).into_iter().map(|p| (p, 64)).collect();
    let server = Server::start("kv-swap", &opts);
    assert!(server.metric("npu_serving_kv_host_blocks_total") > 0.0);
    let alone: Vec<String> = prompts
        .iter()
        .map(|(p, n)| {
            let r = server.stream(Api::LlmServing, p, *n);
            assert!(r.success, "{:?}", r.error);
            r.resp_text
        })
        .collect();
    assert_eq!(server.metric("npu_serving_kv_swap_out_blocks_total"), 0.0);
    let records = server.stream_concurrently(Api::LlmServing, &prompts, 24);
    for (i, r) in records.iter().enumerate() {
        assert!(r.success, "client {i}: {:?}", r.error);
        assert_eq!(
            r.resp_text, alone[i],
            "client {i}: output under swapping differs from the request run alone"
        );
    }
    let out = server.metric("npu_serving_kv_swap_out_blocks_total");
    let back = server.metric("npu_serving_kv_swap_in_blocks_total");
    let swaps = server.metric("npu_serving_preemptions_by_kind_total{kind=\"swap\"}");
    let recomputes = server.metric("npu_serving_preemptions_by_kind_total{kind=\"recompute\"}");
    let bytes_out = server.metric("npu_serving_kv_swap_out_bytes_total");
    let bytes_in = server.metric("npu_serving_kv_swap_in_bytes_total");
    eprintln!(
        "swap: {swaps} swapped and {recomputes} recomputed preemptions, {out} blocks out \
         ({bytes_out} B), {back} blocks in ({bytes_in} B)"
    );
    assert!(
        swaps > 0.0,
        "the small pool should have forced swap preemptions"
    );
    assert!(out > 0.0 && back > 0.0);
    assert_eq!(
        out, back,
        "every swapped-out block came back (all requests resumed)"
    );
    assert!(bytes_out > 0.0 && bytes_out / out == bytes_in / back);
    assert_eq!(server.metric("npu_serving_kv_host_blocks_swapped"), 0.0);
    let used = server.wait_metric("npu_serving_kv_blocks_used", Duration::from_secs(30), |v| {
        v == 0.0
    });
    assert_eq!(used, 0.0);
}

/// Runs `prefixes` each with a suffix, in order, then the first prefix again with another
/// suffix; returns the texts and the TTFTs of the first and of the repeated request.
fn prefix_round(server: &Server, prefixes: &[String]) -> (Vec<String>, f64, f64) {
    let mut texts = Vec::new();
    let mut first_ttft = 0.0;
    for (i, p) in prefixes.iter().enumerate() {
        let r = server.stream(
            Api::LlmServing,
            &format!("{p}\nQuestion: what is note {i} about?"),
            8,
        );
        assert!(r.success, "{:?}", r.error);
        if i == 0 {
            first_ttft = r.ttft_s.unwrap();
        }
        texts.push(r.resp_text);
    }
    let again = format!("{}\nQuestion: summarise it in one line.", prefixes[0]);
    let r = server.stream(Api::LlmServing, &again, 8);
    assert!(r.success, "{:?}", r.error);
    texts.push(r.resp_text);
    (texts, first_ttft, r.ttft_s.unwrap())
}

#[test]
fn an_evicted_prefix_comes_back_from_the_host_tier() {
    let _serial = serial();
    // Six 320-token prefixes (120 blocks of 16) against a device pool of 64 blocks: the
    // first prefix has left the device when it is asked for again.
    let prefixes = long_prompts(6, 320);
    let opts = ServerOpts {
        num_blocks: 64,
        seq_length: 512,
        prefix_cache: true,
        ..ServerOpts::default()
    };
    let (want, _, recompute_ttft) = {
        let server = Server::start("kv-tier-off", &opts);
        let round = prefix_round(&server, &prefixes);
        assert_eq!(
            server.metric("npu_serving_prefix_cache_hit_tokens_total{tier=\"device\"}"),
            0.0,
            "the repeated prefix was evicted from the device"
        );
        round
    };
    let server = Server::start(
        "kv-tier-on",
        &ServerOpts {
            swap_space_mb: 64,
            ..opts
        },
    );
    let (got, cold_ttft, host_ttft) = prefix_round(&server, &prefixes);
    assert_eq!(got, want, "texts with the host tier equal texts recomputed");
    let host_hits = server.metric("npu_serving_prefix_cache_hit_tokens_total{tier=\"host\"}");
    let spilled = server.metric("npu_serving_kv_host_spilled_blocks_total");
    eprintln!(
        "host tier: {host_hits} prefix tokens from the host tier ({spilled} blocks spilled); \
         TTFT cold {:.1} ms, recomputed (no host tier) {:.1} ms, from the host tier {:.1} ms",
        cold_ttft * 1e3,
        recompute_ttft * 1e3,
        host_ttft * 1e3
    );
    assert!(spilled > 0.0);
    assert!(
        host_hits >= 320.0 - 16.0,
        "the repeated 320-token prefix came from the host tier ({host_hits} tokens)"
    );
}

/// Bytes of the last step's host->device inputs after a request of `prompt` generating exactly
/// `n` tokens alone: (all input bytes, block-table bytes, context length of that step).
fn last_step_bytes(server: &Server, prompt: &str, n: u64) -> (f64, f64, u64) {
    let (status, v) = server.post_json(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{v}");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(n));
    // The last step fed generated token n-1 and sampled token n.
    let context = prompt_tokens + n - 1;
    (
        server.metric("npu_serving_last_step_h2d_input_bytes"),
        server.metric("npu_serving_last_step_h2d_block_table_bytes"),
        context,
    )
}

#[test]
fn step_input_bytes_do_not_grow_with_context_but_for_the_block_table() {
    let _serial = serial();
    let server = Server::start(
        "kv-h2d",
        &ServerOpts {
            seq_length: 2048,
            prefix_cache: false,
            ..ServerOpts::default()
        },
    );
    let prompts = long_prompts(2, 2000);
    let short = token_counter()
        .truncate_to_tokens(&prompts[0], 100)
        .unwrap();
    let (small_total, small_table, small_ctx) = last_step_bytes(&server, &short, 8);
    let (big_total, big_table, big_ctx) = last_step_bytes(&server, &prompts[1], 8);
    eprintln!(
        "decode step, batch 1: context {small_ctx}: {small_total} B ({small_table} B of block \
         table); context {big_ctx}: {big_total} B ({big_table} B of block table)"
    );
    // One decode token: token, position, slot mapping and logit row (4 B each) and one
    // sequence span (12 B), whatever the context.
    assert_eq!(small_total - small_table, 28.0);
    assert_eq!(big_total - big_table, 28.0);
    // The block table: 4 B per block of 16 tokens of context.
    assert_eq!(small_table, 4.0 * small_ctx.div_ceil(16) as f64);
    assert_eq!(big_table, 4.0 * big_ctx.div_ceil(16) as f64);
    assert!(server.metric("npu_serving_step_h2d_input_bytes_total") > big_total);
}

#[test]
fn bench_model_reports_block_copy_bandwidth_both_ways() {
    let _serial = serial();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_npu-serving"))
        .args([
            "bench-model",
            "--json",
            "--skip-long",
            "--skip-prefill",
            "--batches",
            "4",
            "--decode-steps",
            "2",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in ["kv_block_copy_d2h_gb_s", "kv_block_copy_h2d_gb_s"] {
        let gb_s = v[key].as_f64().unwrap_or(0.0);
        assert!(gb_s > 0.0, "{key} = {gb_s} in {v}");
    }
    // SmolLM2-135M: 30 layers x K and V x 3 KV heads x 64 dims x 16 tokens x 2 bytes.
    assert_eq!(v["kv_block_bytes"].as_u64(), Some(30 * 2 * 3 * 64 * 16 * 2));
}

/// `--bandwidth-rounds`: each round its own probe and step time, the share their quotient, the
/// weight bytes the default model's matrices hold, and the median among the rounds' shares.
#[test]
fn bench_model_rounds_pair_each_probe_with_its_steps() {
    let _serial = serial();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_npu-serving"))
        .args(["bench-model", "--json", "--bandwidth-rounds", "3"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bytes = v["weight_bytes_per_step"].as_u64().unwrap_or(0);
    // SmolLM2-135M in Q4_1: about 135M weights read a step (the tied embedding as the output
    // head), at 4.5 to 8.5 bits each.
    assert!(
        (60_000_000..160_000_000).contains(&bytes),
        "weight bytes a step: {bytes}"
    );
    let rounds = v["rounds"].as_array().expect("rounds");
    assert_eq!(rounds.len(), 3, "{v}");
    assert_eq!(v["steps_per_round"].as_u64(), Some(16));
    let mut shares = Vec::new();
    for r in rounds {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        let (probe, ms, gb_s, share) = (
            f("probe_gb_s"),
            f("ms_per_step"),
            f("weight_gb_s"),
            f("share"),
        );
        assert!(probe > 0.0 && ms > 0.0, "{r}");
        assert!(
            (gb_s - bytes as f64 / (ms * 1e-3) / 1e9).abs() <= 1e-6 * gb_s,
            "{r}"
        );
        assert!((share - gb_s / probe).abs() <= 1e-9 * share, "{r}");
        shares.push(share);
    }
    shares.sort_by(f64::total_cmp);
    assert_eq!(v["median_share"].as_f64(), Some(shares[1]), "{v}");
    assert_eq!(v["min_share"].as_f64(), Some(shares[0]), "{v}");
    assert_eq!(v["max_share"].as_f64(), Some(shares[2]), "{v}");
}

#[test]
fn a_pool_sized_from_free_memory_is_the_schedulers_pool() {
    let _serial = serial();
    // Half this host's free memory is far more than 300 blocks: the cap the config gives binds,
    // and the scheduler plans with what the agent allocated.
    let opts = ServerOpts {
        num_blocks: 300,
        kv_cache_memory_fraction: Some(0.5),
        ..ServerOpts::default()
    };
    let server = Server::start("kv-fraction", &opts);
    assert_eq!(server.metric("npu_serving_kv_blocks_total"), 300.0);
    let got = server.stream(Api::LlmServing, "The capital of France is", 8);
    assert!(got.success, "{:?}", got.error);
    assert!(
        server
            .log_text()
            .contains("KV pool sized from free device memory"),
        "{}",
        server.log_tail()
    );
}

//! The agent's host KV pool on the real model: the handshake's KV facts (block size, host
//! blocks, measured copy bandwidth), swap preemption planned by the real scheduler giving the
//! same greedy tokens as each request run alone, and bad copies refused before anything moves.

mod common;

use common::{engine, engine_config};
use npu_agent::engine::AgentEngine;
use npu_agent::inproc;
use npu_protocol::{KvCopy, SamplingParams, StepPlan};
use npu_scheduler::{GenerateRequest, KvHostConfig, Scheduler, SchedulerConfig};

fn request(id: u64, prompt: Vec<u32>, n: u32) -> GenerateRequest {
    GenerateRequest {
        id,
        prompt_ids: prompt,
        params: SamplingParams::greedy(),
        max_new_tokens: n,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: true,
        speculative: true,
    }
}

/// Runs `reqs` to the end on `engine` under `cfg`; the tokens of each, and the scheduler.
fn run(
    engine: &mut AgentEngine,
    cfg: SchedulerConfig,
    reqs: &[GenerateRequest],
) -> (Vec<Vec<u32>>, Scheduler) {
    let mut sched = Scheduler::new(cfg).unwrap();
    for r in reqs {
        sched.add(r).unwrap();
    }
    let mut out = vec![Vec::new(); reqs.len()];
    let mut swap_bytes = (0, 0);
    while !sched.is_idle() {
        let plan = sched.schedule().expect("work to plan");
        let res = engine.step(&plan).unwrap();
        swap_bytes.0 += res.transfer.swap_out_bytes;
        swap_bytes.1 += res.transfer.swap_in_bytes;
        for o in sched.on_result(&res).unwrap() {
            out[o.id as usize].push(o.token.token);
        }
        sched.check_invariants().unwrap();
    }
    let st = sched.stats();
    assert_eq!(
        swap_bytes.0,
        st.swap_out_blocks * st.block_bytes,
        "bytes moved out"
    );
    assert_eq!(
        swap_bytes.1,
        st.swap_in_blocks * st.block_bytes,
        "bytes moved in"
    );
    (out, sched)
}

#[test]
fn swapped_sequences_continue_with_exactly_the_tokens_of_an_uninterrupted_run() {
    // 24 blocks of 16 tokens; four 100-token prompts generating 60 tokens need 40.
    let mut cfg = engine_config(4, 24);
    cfg.swap_space_mb = 16;
    let mut e = engine(&cfg);
    let kv = e.facts().kv;
    let m = e.facts();
    assert_eq!(
        kv.block_bytes,
        (m.n_layers * 2 * m.n_kv_heads * m.head_dim * 16 * 2) as u64,
        "a block holds every layer's K and V in f16"
    );
    assert_eq!(kv.host_blocks as u64, (16 << 20) / kv.block_bytes);
    assert!(kv.d2h_bytes_per_s > 0.0 && kv.h2d_bytes_per_s > 0.0);
    let sched_cfg = SchedulerConfig {
        kv_host: Some(KvHostConfig {
            host_blocks: kv.host_blocks as usize,
            block_bytes: kv.block_bytes,
            d2h_bytes_per_s: kv.d2h_bytes_per_s,
            h2d_bytes_per_s: kv.h2d_bytes_per_s,
            max_copies_per_step: cfg.max_kv_copies() as usize,
        }),
        ..inproc::scheduler_config(&cfg)
    };
    let prompt = |i: u32| {
        (0..100)
            .map(|k| 1000 + 37 * i + 11 * k)
            .collect::<Vec<u32>>()
    };
    let reqs: Vec<GenerateRequest> = (0..4).map(|i| request(i as u64, prompt(i), 60)).collect();
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| {
            let mut one = r.clone();
            one.id = 0;
            run(&mut e, sched_cfg.clone(), &[one]).0.remove(0)
        })
        .collect();
    let (together, sched) = run(&mut e, sched_cfg, &reqs);
    let st = sched.stats();
    eprintln!(
        "{} preemptions, {} by swap: {} blocks out, {} in",
        st.preemptions, st.preemptions_swap, st.swap_out_blocks, st.swap_in_blocks
    );
    assert!(st.preemptions_swap > 0, "the pool should have forced swaps");
    assert_eq!(st.swap_out_blocks, st.swap_in_blocks);
    assert_eq!(together, alone);
}

#[test]
fn copies_with_ids_outside_either_pool_are_refused() {
    let mut cfg = engine_config(1, 8);
    cfg.swap_space_mb = 1;
    let mut e = engine(&cfg);
    let host = e.facts().kv.host_blocks;
    for copy in [KvCopy::to_host(8, 0), KvCopy::to_device(host, 0)] {
        let plan = StepPlan {
            step_id: 1,
            kv_copies: vec![KvCopy::to_host(0, 0), copy],
            ..StepPlan::default()
        };
        let err = e.step(&plan).unwrap_err().to_string();
        assert!(err.contains("KV copy 1"), "{err}");
    }
    // Without a host pool every copy is refused.
    let mut e = engine(&engine_config(1, 8));
    assert_eq!(e.facts().kv.host_blocks, 0);
    let plan = StepPlan {
        step_id: 1,
        kv_copies: vec![KvCopy::to_host(0, 0)],
        ..StepPlan::default()
    };
    assert!(e.step(&plan).is_err());
}

/// Swap preemption with the int8 KV cache on the CUDA backend's emulation
/// (`kv_cache_dtype: int8`): the handshake's block is the int8 block (the CPU backend's block
/// bytes, values then scales), and sequences swapped out to the host pool and back continue with
/// exactly the tokens of each run alone.
#[cfg(feature = "cuda")]
#[test]
fn int8_blocks_swap_on_the_cuda_emulation_with_the_tokens_of_an_uninterrupted_run() {
    use npu_protocol::agent::{DeviceKind, KvCacheDtype};
    std::env::set_var("NPU_SERVING_CUDA_EMULATION", "1");
    // 4 blocks of 16 tokens: two 24-token prompts fit, and generating 12 tokens each needs 6.
    let mut cfg = engine_config(2, 4);
    cfg.device = DeviceKind::Cuda;
    cfg.kv_cache_dtype = KvCacheDtype::Int8;
    cfg.swap_space_mb = 4;
    let mut e = engine(&cfg);
    let kv = e.facts().kv;
    let m = e.facts();
    let values = m.n_layers * 2 * m.n_kv_heads * m.head_dim * 16;
    let scales = m.n_layers * 2 * m.n_kv_heads * 16 * 2;
    assert_eq!(
        kv.block_bytes,
        (values + scales) as u64,
        "int8 values, then scales"
    );
    let sched_cfg = SchedulerConfig {
        kv_host: Some(KvHostConfig {
            host_blocks: kv.host_blocks as usize,
            block_bytes: kv.block_bytes,
            d2h_bytes_per_s: kv.d2h_bytes_per_s,
            h2d_bytes_per_s: kv.h2d_bytes_per_s,
            max_copies_per_step: cfg.max_kv_copies() as usize,
        }),
        ..inproc::scheduler_config(&cfg)
    };
    let reqs: Vec<GenerateRequest> = (0..2u32)
        .map(|i| {
            let prompt = (0..24).map(|k| 1000 + 37 * i + 11 * k).collect();
            request(i as u64, prompt, 12)
        })
        .collect();
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| {
            let mut one = r.clone();
            one.id = 0;
            run(&mut e, sched_cfg.clone(), &[one]).0.remove(0)
        })
        .collect();
    let (together, sched) = run(&mut e, sched_cfg, &reqs);
    let st = sched.stats();
    eprintln!(
        "cuda int8: {} preemptions, {} by swap: {} blocks out, {} in",
        st.preemptions, st.preemptions_swap, st.swap_out_blocks, st.swap_in_blocks
    );
    assert!(st.preemptions_swap > 0, "the pool should have forced swaps");
    assert_eq!(st.swap_out_blocks, st.swap_in_blocks);
    assert_eq!(together, alone);
}

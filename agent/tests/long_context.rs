//! Long-context mode on the real model: below its resident length it gives exactly the tokens
//! of normal mode; past its budget it offloads, selects and loads memory units, holds no more
//! than its device blocks, and still continues a repeated passage as normal mode does.

mod common;

use common::{engine, engine_config, refs};
use npu_agent::engine::AgentEngineConfig;
use npu_agent::inproc::{self, Arrival};
use npu_protocol::{LongContextConfig, SamplingParams};
use npu_scheduler::GenerateRequest;

fn greedy(id: u64, prompt: &[u32], n: usize) -> Arrival {
    Arrival {
        request: GenerateRequest {
            id,
            prompt_ids: prompt.to_vec(),
            params: SamplingParams::greedy(),
            max_new_tokens: n as u32,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            speculative: true,
        },
        at_step: 0,
    }
}

fn long_config(base: &AgentEngineConfig, lc: LongContextConfig) -> AgentEngineConfig {
    AgentEngineConfig {
        long_context: Some(lc),
        ..base.clone()
    }
}

fn run(
    cfg: &AgentEngineConfig,
    eng: &mut npu_agent::engine::AgentEngine,
    arrivals: &[Arrival],
) -> Vec<Vec<u32>> {
    let (out, _) =
        inproc::run(eng, inproc::scheduler_config(cfg), arrivals, &mut |_, _| {}).unwrap();
    out.iter().map(|o| o.token_ids()).collect()
}

#[test]
fn below_its_resident_length_the_mode_gives_the_tokens_of_normal_mode() {
    let normal = engine_config(4, 128);
    // 1 initial + 27 ring blocks of 16 tokens: 448 tokens before memory starts.
    let long = long_config(
        &normal,
        LongContextConfig {
            initial_blocks: 1,
            local_blocks: 4,
            topk_blocks: 4,
            representative_keys: 4,
            device_blocks: 32,
        },
    );
    let arrivals: Vec<Arrival> = refs()
        .iter()
        .enumerate()
        .map(|(i, r)| greedy(i as u64, &r.prompt_ids, 24))
        .collect();
    let want = run(&normal, &mut engine(&normal), &arrivals);
    let mut eng = engine(&long);
    let got = run(&long, &mut eng, &arrivals);
    assert_eq!(got, want);
    assert_eq!(eng.long_context_stats().unwrap().memory_steps, 0);
}

#[test]
fn past_its_budget_the_mode_uses_memory_and_keeps_to_its_blocks() {
    // The pool is the budget: 8 blocks of 16 tokens (1 initial, a ring of 5, 2 cache entries)
    // for a prompt of about 400 tokens.
    let lc = LongContextConfig {
        initial_blocks: 1,
        local_blocks: 2,
        topk_blocks: 2,
        representative_keys: 4,
        device_blocks: 8,
    };
    let r = &refs()[0];
    let mut prompt = Vec::new();
    while prompt.len() < 400 {
        prompt.extend(&r.prompt_ids);
    }
    let long = AgentEngineConfig {
        num_blocks: 8,
        max_blocks_per_seq: 8,
        ..long_config(&engine_config(1, 8), lc)
    };
    let mut eng = engine(&long);
    let got = run(&long, &mut eng, &[greedy(0, &prompt, 8)]);
    let stats = eng.long_context_stats().unwrap();
    assert!(stats.memory_steps > 0, "{stats:?}");
    let layers = eng.model_config().n_layers as u64;
    // Every block between the initial one and the local window went to host memory.
    assert!(
        stats.layer_blocks_offloaded >= layers * ((prompt.len() as u64) / 16 - 4),
        "{stats:?}"
    );
    assert!(stats.layer_blocks_loaded >= layers * 2, "{stats:?}");
    // Normal mode, with room for the whole context, continues the repetition; so must this.
    let normal = engine_config(1, 64);
    let want = run(&normal, &mut engine(&normal), &[greedy(0, &prompt, 8)]);
    assert_eq!(
        got[0][..4],
        want[0][..4],
        "long {:?} normal {:?}",
        got[0],
        want[0]
    );
}

#[test]
fn bad_long_context_settings_name_their_key() {
    let base = engine_config(1, 16);
    let bad = |lc: LongContextConfig| {
        npu_agent::engine::AgentEngine::load(&long_config(&base, lc))
            .err()
            .expect("refused")
            .to_string()
    };
    let lc = LongContextConfig::default();
    let e = bad(LongContextConfig {
        topk_blocks: 0,
        ..lc
    });
    assert!(e.contains("long_context.topk_blocks"), "{e}");
    // 64 blocks of budget on a pool of 16.
    let e = bad(lc);
    assert!(e.contains("long_context.device_blocks"), "{e}");
}

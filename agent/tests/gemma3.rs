//! Gemma 3 270M (Q4_K_M, llama.cpp's conversion) on the CPU backend against llama.cpp's
//! references (`tests/data/greedy_gemma3_*.jsonl`): the tokenizer's ids, greedy tokens up to
//! each prompt's first near-tie, the same tokens batched with chunked prefill, and teacher-forced
//! top-1 wherever llama.cpp's own choice is clear (gap >= 0.15) — including a prompt longer than
//! the model's 512-token sliding window, so the local layers' window is exercised.

mod common;

use common::{engine_config, gemma3_path, gemma3_refs, refs_from, Ref};
use npu_agent::cli::DeviceArgs;
use npu_agent::engine::AgentEngine;
use npu_agent::inproc::{self, Arrival};
use npu_protocol::SamplingParams;
use npu_scheduler::GenerateRequest;

fn gemma_engine(
    max_slots: u32,
    num_blocks: u32,
) -> (AgentEngine, npu_agent::engine::AgentEngineConfig) {
    let mut cfg = engine_config(max_slots, num_blocks);
    cfg.model_path = gemma3_path();
    (AgentEngine::load(&cfg).expect("loading Gemma 3"), cfg)
}

/// Every reference of Gemma 3: the shared prompts and the long one.
fn all_refs() -> Vec<Ref> {
    let mut refs = gemma3_refs();
    refs.extend(refs_from(include_str!("data/greedy_gemma3_long.jsonl")));
    assert!(
        refs.len() >= 4,
        "the Gemma 3 reference files hold {} prompts",
        refs.len()
    );
    refs
}

fn greedy(id: u64, prompt: &[u32], n: usize, at_step: usize) -> Arrival {
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
        at_step,
    }
}

fn check_prefix(r: &Ref, got: &[u32], what: &str) {
    let n = r
        .first_near_tie
        .unwrap_or(r.output_ids.len())
        .min(got.len());
    assert_eq!(
        &got[..n],
        &r.output_ids[..n],
        "{what}: {:?} differs from llama.cpp before its first near-tie (step {n})",
        r.prompt
    );
}

#[test]
fn tokenizer_ids_equal_llama_cpp() {
    let file = npu_gguf::GgufFile::open(gemma3_path()).unwrap();
    let tok = npu_tokenizer::Tokenizer::from_gguf(&file).unwrap();
    for r in all_refs() {
        assert_eq!(
            tok.encode(&r.prompt).unwrap(),
            r.prompt_ids,
            "{:?}",
            r.prompt
        );
    }
}

#[test]
fn greedy_matches_llama_cpp_up_to_near_ties_alone_and_batched() {
    let refs = all_refs();
    let (mut eng, cfg) = gemma_engine(8, 256);
    let alone: Vec<Vec<u32>> = refs
        .iter()
        .map(|r| {
            let (out, _) = inproc::run(
                &mut eng,
                inproc::scheduler_config(&cfg),
                &[greedy(0, &r.prompt_ids, r.output_ids.len(), 0)],
                &mut |_, _| {},
            )
            .unwrap();
            let got = out[0].token_ids();
            check_prefix(r, &got, "alone");
            got
        })
        .collect();
    // Together, staggered, with a step budget that splits every prompt over several steps.
    let reqs: Vec<Arrival> = refs
        .iter()
        .enumerate()
        .map(|(i, r)| greedy(i as u64, &r.prompt_ids, r.output_ids.len(), i * 2))
        .collect();
    let mut sched = inproc::scheduler_config(&cfg);
    sched.max_tokens_per_step = 61;
    let (out, _) = inproc::run(&mut eng, sched, &reqs, &mut |_, _| {}).unwrap();
    for (i, o) in out.iter().enumerate() {
        assert_eq!(
            o.token_ids(),
            alone[i],
            "{:?} batched vs alone",
            refs[i].prompt
        );
    }
}

#[test]
fn teacher_forced_top1_matches_where_llama_cpp_is_decided() {
    let path = gemma3_path();
    for r in all_refs() {
        let scored = npu_agent::cli::score::score_ids(
            &path,
            DeviceArgs::default(),
            0,
            &r.prompt_ids,
            &r.output_ids,
        )
        .unwrap();
        assert_eq!(scored.len(), r.output_ids.len());
        for (i, (s, &want)) in scored.iter().zip(&r.output_ids).enumerate() {
            if r.gaps[i] >= 0.15 {
                assert_eq!(
                    s.top1_id, want,
                    "{:?} position {i}: top-1 {} but llama.cpp chose {want} (its gap {})",
                    r.prompt, s.top1_id, r.gaps[i]
                );
            }
        }
    }
}

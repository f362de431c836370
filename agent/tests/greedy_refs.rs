//! Greedy generation of the reference prompts on the CPU backend against llama.cpp's tokens
//! (tests/data/greedy_smollm2_q4_1.jsonl): exact up to each prompt's first near-tie, and the
//! same tokens whether the prompts run alone or batched together with chunked prefill, under the
//! real scheduler.

mod common;

use common::{engine, engine_config, refs, Ref};
use npu_agent::cli::DeviceArgs;
use npu_agent::inproc::{self, Arrival};
use npu_protocol::SamplingParams;
use npu_scheduler::GenerateRequest;

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
fn greedy_matches_llama_cpp_up_to_near_ties() {
    let cfg = engine_config(4, 64);
    let mut eng = engine(&cfg);
    for r in refs() {
        let (out, _) = inproc::run(
            &mut eng,
            inproc::scheduler_config(&cfg),
            &[greedy(0, &r.prompt_ids, 32, 0)],
            &mut |_, _| {},
        )
        .unwrap();
        check_prefix(&r, &out[0].token_ids(), "alone");
    }
}

#[test]
fn batching_and_chunking_do_not_change_tokens() {
    let refs = refs();
    let cfg = engine_config(8, 64);
    let mut eng = engine(&cfg);
    let alone: Vec<Vec<u32>> = refs
        .iter()
        .map(|r| {
            let (out, _) = inproc::run(
                &mut eng,
                inproc::scheduler_config(&cfg),
                &[greedy(0, &r.prompt_ids, 24, 0)],
                &mut |_, _| {},
            )
            .unwrap();
            out[0].token_ids()
        })
        .collect();
    // All prompts together; staggered arrivals mix one sequence's prefill with the others'
    // decode, and a step budget of 7 tokens splits the prompts over several steps.
    let reqs: Vec<Arrival> = refs
        .iter()
        .enumerate()
        .map(|(i, r)| greedy(i as u64, &r.prompt_ids, 24, i * 2))
        .collect();
    let mut sched = inproc::scheduler_config(&cfg);
    sched.max_tokens_per_step = 7;
    let (out, timing) = inproc::run(&mut eng, sched, &reqs, &mut |_, _| {}).unwrap();
    assert!(timing.steps > 24, "the batch ran in {} steps", timing.steps);
    assert!(
        timing.decode_steps.iter().any(|&(_, n)| n > 1),
        "no step decoded several sequences together"
    );
    for (i, o) in out.iter().enumerate() {
        let got = o.token_ids();
        assert_eq!(
            got, alone[i],
            "prompt {:?} batched vs alone",
            refs[i].prompt
        );
        check_prefix(&refs[i], &got, "batched");
    }
}

/// Past a near-tie llama.cpp itself is not stable, so the rest is checked teacher-forced: fed the
/// reference continuation, the model's top-1 must be the reference token wherever the reference's
/// own top-1/top-2 gap is at least 0.15.
#[test]
fn teacher_forced_top1_matches_where_llama_cpp_is_decided() {
    let path = common::model_path();
    for r in refs() {
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
            assert!(s.logprob <= 0.0 && s.gap >= 0.0);
        }
    }
}

/// A plain-greedy step lets the backend pick on the device; asking for one top alternative makes
/// the engine read logits back and sample instead. Both give the same tokens and bit-identical
/// log-probabilities.
#[test]
fn device_greedy_pick_equals_the_sampler() {
    let cfg = engine_config(4, 64);
    let mut eng = engine(&cfg);
    let refs = refs();
    let run = |eng: &mut npu_agent::engine::AgentEngine, top_n: u32| {
        let reqs: Vec<Arrival> = refs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let mut a = greedy(i as u64, &r.prompt_ids, 12, 0);
                a.request.params.top_n = top_n;
                a
            })
            .collect();
        let (out, _) =
            inproc::run(eng, inproc::scheduler_config(&cfg), &reqs, &mut |_, _| {}).unwrap();
        out
    };
    let on_device = run(&mut eng, 0);
    let sampled = run(&mut eng, 1);
    for (d, s) in on_device.iter().zip(&sampled) {
        assert_eq!(d.token_ids(), s.token_ids());
        for (a, b) in d.tokens.iter().zip(&s.tokens) {
            assert_eq!(a.logprob.to_bits(), b.logprob.to_bits(), "{a:?} vs {b:?}");
            assert!(a.logprob < 0.0);
        }
        // The sampler's top alternative is the pick itself.
        assert!(s
            .top
            .iter()
            .zip(&s.tokens)
            .all(|(t, tok)| t.len() == 1 && t[0].token == tok.token));
    }
}

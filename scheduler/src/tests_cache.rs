//! Prefix-cache tests through the scheduler: hits shorten prefill, shared blocks are counted
//! and never written, released blocks stay cached and are evicted least recently released
//! first, and a preempted request resumes from its own cached blocks.

use npu_protocol::StepPlan;

use super::test_util::*;
use super::*;

fn cached_cfg(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        prefix_cache: true,
        ..cfg(num_blocks, block_size)
    }
}

/// Every KV slot a plan writes lies in a private block of the writer (never a shared or
/// cached one).
fn assert_writes_private(s: &Scheduler, plan: &StepPlan) {
    let bs = s.cfg.block_size as u32;
    for q in &plan.seqs {
        for &m in &q.slot_mapping {
            let b = m / bs;
            assert!(q.block_table.contains(&b));
            assert_eq!(s.blocks.refs(b), 1, "block {b} written while shared");
            assert!(!s.blocks.is_cached(b), "block {b} written while cached");
        }
    }
}

fn cached_step(s: &mut Scheduler, token: u32) -> (StepPlan, Vec<SchedOutput>) {
    let plan = s.schedule().expect("a step to run");
    assert_writes_private(s, &plan);
    let out = s.on_result(&answer(&plan, |_| token)).unwrap();
    s.check_invariants().unwrap();
    (plan, out)
}

#[test]
fn a_shared_prefix_is_not_prefilled_again() {
    let mut s = sched(cached_cfg(16, 4));
    let p = prompt(0, 10);
    s.add(&req(1, &p, 10)).unwrap();
    let (plan, _) = cached_step(&mut s, 7);
    assert_eq!(plan.seqs[0].tokens.len(), 10);
    let a_table = plan.seqs[0].block_table.clone();

    let mut q = p[..8].to_vec();
    q.extend([90, 91]);
    s.add(&req(2, &q, 10)).unwrap();
    let (plan, _) = cached_step(&mut s, 7);
    let b = seq_of(&plan, 1);
    assert_eq!((b.start_pos, b.tokens.clone()), (8, vec![90, 91]));
    assert_eq!(&b.block_table[..2], &a_table[..2]);
    assert_ne!(b.block_table[2], a_table[2], "the partial block is private");
    assert_eq!(s.stats().prefix_hit_tokens, 8);
    assert_eq!(
        (s.blocks.refs(a_table[0]), s.blocks.refs(a_table[1])),
        (2, 2)
    );

    assert!(s.finish(1, FinishReason::Stop));
    assert_eq!(s.blocks.refs(a_table[0]), 1);
    assert!(s.finish(2, FinishReason::Stop));
    s.check_invariants().unwrap();
    let st = s.stats();
    assert_eq!(st.blocks_used, 0);
    assert!(st.blocks_cached >= 2, "released full blocks stay cached");
    assert_eq!(st.blocks_cached + st.blocks_free, st.blocks_total);
}

#[test]
fn the_last_prompt_token_is_always_computed() {
    let mut s = sched(cached_cfg(16, 4));
    let p = prompt(0, 8);
    s.add(&req(1, &p, 1)).unwrap();
    cached_step(&mut s, 7);
    assert!(s.is_idle());
    s.add(&req(2, &p, 1)).unwrap();
    let (plan, out) = cached_step(&mut s, 7);
    let q = &plan.seqs[0];
    assert_eq!((q.start_pos, q.tokens.len(), q.sample), (4, 4, true));
    assert_eq!(out.len(), 1);
}

#[test]
fn released_blocks_are_evicted_least_recently_released_first() {
    // 4 blocks of 2 tokens.
    let mut s = sched(cached_cfg(4, 2));
    let x = [1, 2, 3];
    let y = [4, 5, 6];
    s.add(&req(1, &x, 1)).unwrap();
    cached_step(&mut s, 9); // X caches [1,2]
    s.add(&req(2, &y, 1)).unwrap();
    cached_step(&mut s, 9); // Y caches [4,5], released after X's
    assert_eq!(s.stats().blocks_cached, 2);
    s.add(&req(3, &[7, 8, 10, 11, 12], 1)).unwrap();
    cached_step(&mut s, 9); // needs 3 blocks: 2 free, then evicts X's block
    s.add(&req(4, &y, 1)).unwrap();
    let (plan, _) = cached_step(&mut s, 9);
    assert_eq!(plan.seqs[0].start_pos, 2, "Y's block survived");
    s.add(&req(5, &x, 1)).unwrap();
    let (plan, _) = cached_step(&mut s, 9);
    assert_eq!(plan.seqs[0].start_pos, 0, "X's block was evicted");
    assert_eq!(s.stats().prefix_hit_tokens, 2);
}

#[test]
fn chains_match_only_the_same_whole_prefix() {
    let mut s = sched(cached_cfg(16, 2));
    s.add(&req(1, &[1, 2, 3, 4, 5], 1)).unwrap();
    cached_step(&mut s, 9);
    // Same second block after a different first block: no hit.
    s.add(&req(2, &[9, 2, 3, 4, 5], 1)).unwrap();
    let (plan, _) = cached_step(&mut s, 9);
    assert_eq!(plan.seqs[0].start_pos, 0);
    // Same first block, different second: one block.
    s.add(&req(3, &[1, 2, 3, 9, 5], 1)).unwrap();
    let (plan, _) = cached_step(&mut s, 9);
    assert_eq!(plan.seqs[0].start_pos, 2);
}

#[test]
fn generated_tokens_are_cached_too_and_a_preempted_request_reuses_its_blocks() {
    // As in the preemption test: 7 blocks of 2, three prompts of 3 tokens.
    let mut s = sched(cached_cfg(7, 2));
    for id in 1..=3 {
        s.add(&req(id, &prompt(10 * id as u32, 3), 4)).unwrap();
    }
    cached_step(&mut s, 50);
    cached_step(&mut s, 51); // positions 0..4 computed: two full blocks each
    cached_step(&mut s, 52); // C preempted; B evicts C's tail block
    assert_eq!(s.stats().preemptions, 1);
    cached_step(&mut s, 53); // A and B finish
    let (plan, _) = cached_step(&mut s, 54);
    let c = &plan.seqs[0];
    assert_eq!(c.start_pos, 2, "C's first block came back from the cache");
    assert_eq!(c.tokens, vec![33, 50, 51]);
    assert_eq!(c.n_prompt_tokens, 1);
}

/// Tokens taken from the cache never reach the agent's per-slot history, so requests whose
/// sampling depends on that history are limited: sampling and presence/frequency penalties
/// reuse prompt blocks only, a repetition penalty reuses nothing.
#[test]
fn history_dependent_sampling_limits_prefix_hits() {
    use npu_protocol::SamplingParams;
    let with = |id: u64, p: &[u32], params: SamplingParams| GenerateRequest {
        params,
        ..req(id, p, 8)
    };
    let mut s = sched(cached_cfg(32, 2));
    // Prompt of 3 then 3 generated: blocks [p0 p1] [p2 g0] [g1 g2] are cached after it ends.
    let p = prompt(0, 3);
    s.add(&req(1, &p, 4)).unwrap();
    for t in [50, 51, 52, 53] {
        cached_step(&mut s, t);
    }
    assert!(s.is_idle());
    let mut resumed = p.clone();
    resumed.extend([50, 51, 52, 53]);

    // Greedy: everything cached before the last token is reused.
    s.add(&req(2, &resumed, 2)).unwrap();
    let (plan, _) = cached_step(&mut s, 9);
    assert_eq!(plan.seqs[0].start_pos, 6);
    s.abort(2);

    // The same tokens as a recovered sampled request: only the prompt's full block is reused,
    // so every generated token is sent (and counted as generated) again.
    let sampled = SamplingParams {
        do_sample: true,
        temperature: 0.8,
        ..SamplingParams::greedy()
    };
    s.add_recovered(RecoveredRequest {
        request: with(3, &p, sampled),
        generated: vec![50, 51, 52, 53],
    })
    .unwrap();
    let (plan, _) = cached_step(&mut s, 9);
    let q = &plan.seqs[0];
    assert_eq!((q.start_pos, q.n_prompt_tokens), (2, 1));
    assert_eq!(q.tokens, vec![p[2], 50, 51, 52, 53]);
    s.abort(3);

    // A repetition penalty counts prompt tokens too: no reuse at all.
    let penalised = SamplingParams {
        repetition_penalty: 1.2,
        ..SamplingParams::greedy()
    };
    s.add(&with(4, &resumed, penalised)).unwrap();
    let (plan, _) = cached_step(&mut s, 9);
    assert_eq!(plan.seqs[0].start_pos, 0);
}

//! The host KV pool through the scheduler: swap preemption (blocks out, back in, the sequence
//! continues where it stopped), the per-victim choice of swap or recompute, and the prefix
//! cache's host tier (spill on eviction, a later hit brought back). A model of the two pools
//! (`test_util::KvModel`) replays every plan's copies in order and then its KV writes, and
//! checks after each step that every sequence's context reads back the right tokens at the
//! right positions.

use std::collections::HashMap;

use npu_protocol::{CopyDirection, SamplingParams, StepPlan};

use super::test_util::*;
use super::*;

/// Plans one step, checks the KV it reads, answers `token(slot)`.
fn kv_step(
    s: &mut Scheduler,
    kv: &mut KvModel,
    token: impl Fn(u32) -> u32,
) -> (StepPlan, Vec<SchedOutput>) {
    let plan = s.schedule().expect("a step to run");
    check_plan(&plan, &s.cfg);
    kv.apply(&plan, &expected_tokens(s));
    let out = s.on_result(&answer(&plan, token)).unwrap();
    s.check_invariants().unwrap();
    (plan, out)
}

fn copies(plan: &StepPlan, dir: CopyDirection) -> usize {
    plan.kv_copies.iter().filter(|c| c.direction == dir).count()
}

/// Three 3-token prompts in 7 blocks of 2 tokens: the fourth decode step preempts the newest.
fn three_running(c: SchedulerConfig) -> (Scheduler, KvModel) {
    let mut s = sched(c);
    for id in 1..=3 {
        s.add(&req(id, &prompt(10 * id as u32, 3), 4)).unwrap();
    }
    let kv = KvModel::new(&s);
    (s, kv)
}

#[test]
fn a_swapped_out_sequence_comes_back_by_copy_and_continues_where_it_stopped() {
    let (mut s, mut kv) = three_running(host_cfg(cfg(7, 2), 8));
    let tok = |step: u32| move |slot: u32| 100 + step * 10 + slot;
    let mut generated: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut record = |out: &[SchedOutput]| {
        for o in out {
            generated.entry(o.id).or_default().push(o.token.token);
        }
    };
    record(&kv_step(&mut s, &mut kv, tok(1)).1);
    record(&kv_step(&mut s, &mut kv, tok(2)).1);
    let (plan, out) = kv_step(&mut s, &mut kv, tok(3));
    record(&out);
    let st = s.stats();
    assert_eq!((st.preemptions, st.preemptions_swap), (1, 1));
    assert_eq!(plan.forget, vec![2], "the swapped-out slot is forgotten");
    // C had computed 4 positions (prompt and one generated token): 2 blocks go out.
    assert_eq!(copies(&plan, CopyDirection::DeviceToHost), 2);
    assert_eq!((st.swap_out_blocks, st.host_blocks_swapped), (2, 2));
    let (_, out) = kv_step(&mut s, &mut kv, tok(4)); // A and B finish
    record(&out);
    let (plan, out) = kv_step(&mut s, &mut kv, tok(5));
    record(&out);
    assert_eq!(copies(&plan, CopyDirection::HostToDevice), 2);
    let c = &plan.seqs[0];
    assert_eq!(
        (c.start_pos, c.tokens.len(), c.n_prompt_tokens),
        (4, 1, 0),
        "C resumes with its next decode token, nothing recomputed"
    );
    assert_eq!(out[0].id, 3);
    while !s.is_idle() {
        record(&kv_step(&mut s, &mut kv, tok(6)).1);
    }
    assert_eq!(generated[&3], vec![112, 122, 152, 162]);
    let st = s.stats();
    assert_eq!((st.swap_in_blocks, st.host_blocks_swapped), (2, 0));
    assert_eq!(st.blocks_used, 0);
}

#[test]
fn recompute_is_chosen_when_it_is_cheaper_or_the_host_pool_is_short() {
    // Copying 2 blocks out and back takes 2 x 2 x 1000 B / 1000 B/s = 4 s; prefilling 4
    // tokens at 1000 tok/s takes 4 ms: recompute.
    let mut c = host_cfg(cfg(7, 2), 8);
    if let Some(h) = c.kv_host.as_mut() {
        h.d2h_bytes_per_s = 1000.0;
        h.h2d_bytes_per_s = 1000.0;
    }
    let (mut s, mut kv) = three_running(c);
    s.observe_step(1000, 1_000_000);
    for step in 1..=3 {
        kv_step(&mut s, &mut kv, |_| 100 + step);
    }
    let st = s.stats();
    assert_eq!(
        (st.preemptions, st.preemptions_swap, st.swap_out_blocks),
        (1, 0, 0)
    );

    // A host pool of one block cannot take C's two.
    let (mut s, mut kv) = three_running(host_cfg(cfg(7, 2), 1));
    for step in 1..=3 {
        kv_step(&mut s, &mut kv, |_| 100 + step);
    }
    assert_eq!(s.stats().preemptions_swap, 0);
    assert_eq!(s.stats().preemptions, 1);
}

#[test]
fn a_sampling_request_with_generated_tokens_is_recomputed_not_swapped() {
    let mut s = sched(host_cfg(cfg(7, 2), 8));
    for id in 1..=3 {
        let mut r = req(id, &prompt(10 * id as u32, 3), 4);
        r.params = SamplingParams {
            do_sample: true,
            seed: id,
            ..SamplingParams::default()
        };
        s.add(&r).unwrap();
    }
    let mut kv = KvModel::new(&s);
    for step in 1..=3 {
        kv_step(&mut s, &mut kv, |_| 100 + step);
    }
    let st = s.stats();
    assert_eq!((st.preemptions, st.preemptions_swap), (1, 0));
}

#[test]
fn evicted_cached_blocks_spill_to_the_host_and_a_later_hit_brings_them_back() {
    // 5 device blocks of 2 tokens; a 9-token prompt holds all of them.
    let c = SchedulerConfig {
        prefix_cache: true,
        ..host_cfg(cfg(5, 2), 8)
    };
    let mut s = sched(c);
    let mut kv = KvModel::new(&s);
    let a = prompt(0, 9);
    s.add(&req(1, &a, 1)).unwrap();
    kv_step(&mut s, &mut kv, |_| 50);
    assert!(s.is_idle());
    assert_eq!(
        s.stats().blocks_cached,
        4,
        "A's four full blocks stay cached"
    );
    // B, a different prompt, needs 5 blocks: the free one, and the 4 cached ones, evicted
    // and spilled.
    s.add(&req(2, &prompt(100, 9), 1)).unwrap();
    let (plan, _) = kv_step(&mut s, &mut kv, |_| 60);
    assert_eq!(copies(&plan, CopyDirection::DeviceToHost), 4);
    assert_eq!(s.stats().host_spilled_blocks, 4);
    assert_eq!(s.stats().host_blocks_cached, 4);
    // A again: its first 8 tokens come back from the host (B's blocks are cached on the device
    // and give way, spilling in turn).
    s.add(&req(3, &a, 1)).unwrap();
    let (plan, out) = kv_step(&mut s, &mut kv, |_| 70);
    assert_eq!(copies(&plan, CopyDirection::HostToDevice), 4);
    let q = &plan.seqs[0];
    assert_eq!(
        (q.start_pos, q.tokens.len()),
        (8, 1),
        "only the last token computed"
    );
    assert_eq!(out[0].token.token, 70);
    let st = s.stats();
    assert_eq!((st.prefix_hit_tokens, st.prefix_hit_tokens_host), (8, 8));
    // The copies ran in order: B's blocks went out before A's came into the same blocks (the
    // KV model above checked what A read).
    let first_in = plan
        .kv_copies
        .iter()
        .position(|c| c.direction == CopyDirection::HostToDevice)
        .unwrap();
    assert!(copies(&plan, CopyDirection::DeviceToHost) > 0);
    assert!(plan.kv_copies[..first_in]
        .iter()
        .all(|c| c.direction == CopyDirection::DeviceToHost));
}

#[test]
fn the_host_tier_evicts_its_least_recently_used_block_first() {
    let mut m = BlockManager::with_host(2, 1, true, 1, 8);
    let a = m.allocate().unwrap();
    let b = m.allocate().unwrap();
    m.register(a, None, 0, &[10]);
    m.register(b, None, 0, &[20]);
    m.release(a);
    m.release(b);
    // Both device blocks are taken again: a spills first, then b replaces it on the host.
    let x = m.allocate().unwrap();
    assert_eq!(m.find_prefix(&[10], 0, 1).blocks, vec![Tier::Host(0)]);
    let y = m.allocate().unwrap();
    assert_eq!((x, y), (a, b));
    assert!(
        m.find_prefix(&[10], 0, 1).blocks.is_empty(),
        "a left the host tier"
    );
    assert_eq!(m.find_prefix(&[20], 0, 1).blocks, vec![Tier::Host(0)]);
    let copies = m.take_copies();
    assert_eq!(copies.len(), 2);
    assert!(copies.iter().all(|c| c.host_block == 0));
    m.check_pools(&[1, 1], &[0]).unwrap();
}

#[test]
fn the_prefill_rate_comes_from_large_steps_only() {
    let mut s = sched(host_cfg(cfg(7, 2), 8));
    assert!(s.host_hit_pays(1), "copying while no rate is known");
    s.observe_step(4, 1);
    assert_eq!(s.prefill_tok_per_s, None, "a decode step says nothing");
    s.observe_step(100, 100_000);
    assert_eq!(s.prefill_tok_per_s, Some(1000.0));
    // A block: 1000 B at 1e9 B/s (1 us) against 2 tokens at 1000 tok/s (2 ms).
    assert!(s.host_hit_pays(1));
    let mut c = host_cfg(cfg(7, 2), 8);
    if let Some(h) = c.kv_host.as_mut() {
        h.h2d_bytes_per_s = 1000.0; // 1 s per block
    }
    let mut s = sched(c);
    s.observe_step(100, 100_000);
    assert!(!s.host_hit_pays(1), "a slow copy loses to recomputing");
}

#[test]
fn an_aborted_swapped_request_frees_its_host_blocks_and_take_all_resets_the_pool() {
    let (mut s, mut kv) = three_running(host_cfg(cfg(7, 2), 8));
    for step in 1..=3 {
        kv_step(&mut s, &mut kv, |_| 100 + step);
    }
    assert_eq!(s.stats().host_blocks_swapped, 2);
    assert!(s.abort(3));
    s.check_invariants().unwrap();
    assert_eq!(s.stats().host_blocks_swapped, 0);
    assert_eq!(s.blocks.host_available(), 8);

    let (mut s, mut kv) = three_running(host_cfg(cfg(7, 2), 8));
    for step in 1..=3 {
        kv_step(&mut s, &mut kv, |_| 100 + step);
    }
    let back = s.take_all();
    assert_eq!(back.len(), 3);
    assert_eq!(
        back[2].generated.len(),
        2,
        "C keeps its tokens, recomputed on the new agent"
    );
    s.check_invariants().unwrap();
    assert_eq!(s.blocks.host_available(), 8);
}

#[test]
fn a_failed_step_leaves_no_one_reading_what_its_copies_may_not_have_moved() {
    // The step that swaps C out fails: C is recomputed from its tokens, not swapped in.
    let (mut s, mut kv) = three_running(host_cfg(cfg(7, 2), 8));
    kv_step(&mut s, &mut kv, |_| 101);
    kv_step(&mut s, &mut kv, |_| 102);
    let plan = s.schedule().unwrap();
    assert_eq!(copies(&plan, CopyDirection::DeviceToHost), 2);
    kv.garble(&plan);
    for id in s.step_failed(plan.step_id) {
        s.abort(id);
    }
    s.check_invariants().unwrap();
    assert_eq!(s.stats().host_blocks_swapped, 0, "the swap is void");
    while !s.is_idle() {
        let (plan, _) = kv_step(&mut s, &mut kv, |_| 103);
        assert_eq!(copies(&plan, CopyDirection::HostToDevice), 0);
        if let Some(q) = plan.seqs.iter().find(|q| q.n_prompt_tokens == 3) {
            assert_eq!(q.start_pos, 0, "C recomputes its prompt and tokens");
        }
    }

    // The step that brings a prefix back from the host tier fails: that content is forgotten
    // on both tiers, and the next request with the prefix computes it.
    let c = SchedulerConfig {
        prefix_cache: true,
        ..host_cfg(cfg(5, 2), 8)
    };
    let mut s = sched(c);
    let mut kv = KvModel::new(&s);
    let a = prompt(0, 9);
    s.add(&req(1, &a, 1)).unwrap();
    kv_step(&mut s, &mut kv, |_| 50);
    s.add(&req(2, &prompt(100, 9), 1)).unwrap();
    kv_step(&mut s, &mut kv, |_| 60);
    s.add(&req(3, &a, 1)).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(copies(&plan, CopyDirection::HostToDevice), 4);
    kv.garble(&plan);
    for id in s.step_failed(plan.step_id) {
        s.abort(id);
    }
    s.check_invariants().unwrap();
    s.add(&req(4, &a, 1)).unwrap();
    let (plan, _) = kv_step(&mut s, &mut kv, |_| 70);
    assert_eq!(plan.seqs[0].start_pos, 0, "the prefix is computed again");
}

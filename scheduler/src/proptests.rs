//! Property test: random adds, aborts, finishes, schedules, (out of order) results, failed
//! steps and agent deaths against a small pool, with and without a host pool. After every call
//! the bookkeeping invariants hold; every plan respects its limits and writes only private
//! blocks of the writer; a model of the KV memory replaying every plan's copies and writes in
//! order shows every sequence reading its own tokens at every position; and once arrivals stop,
//! every request finishes within a bounded number of steps with all blocks free. With
//! speculative decoding on, the agent keeps each draft that equals the token it answers.

use std::collections::HashSet;

use npu_protocol::StepPlan;
use proptest::prelude::*;

use super::test_util::*;
use super::*;

#[derive(Debug, Clone)]
enum Op {
    Add {
        prefix: usize,
        extra: Vec<u32>,
        max_new: u32,
        ignore_eos: bool,
    },
    Abort(usize),
    Finish(usize),
    Schedule,
    Deliver {
        pick: usize,
        token: u32,
    },
    /// The agent could not run the latest plan (it is still up).
    Fail,
    AgentDied,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3usize, prop::collection::vec(1..6u32, 0..10), 1..8u32, any::<bool>()).prop_map(
            |(prefix, extra, max_new, ignore_eos)| Op::Add { prefix, extra, max_new, ignore_eos }
        ),
        1 => any::<usize>().prop_map(Op::Abort),
        1 => any::<usize>().prop_map(Op::Finish),
        4 => Just(Op::Schedule),
        4 => (any::<usize>(), 0..6u32).prop_map(|(pick, token)| Op::Deliver { pick, token }),
        1 => Just(Op::Fail),
        1 => Just(Op::AgentDied),
    ]
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (
        (4..16usize, 1..5usize, 1..5usize, 1..4usize),
        (
            1..16usize,
            0..3usize,
            any::<bool>(),
            any::<bool>(),
            2..24usize,
            0..12usize,
        ),
        (0..3usize, 1..3usize, 1..5usize),
    )
        .prop_map(
            |(
                (num_blocks, block_size, max_running, prompts),
                (budget, extra_slots, stat, pc, mbs, host),
                (drafts, lookup_min, max_batch),
            )| {
                SchedulerConfig {
                    // Host pools of 0 (none) to 11 blocks, copy room from 1 to 3 per block.
                    kv_host: (host > 0).then_some(crate::KvHostConfig {
                        host_blocks: host,
                        block_bytes: 64,
                        d2h_bytes_per_s: 1e9,
                        h2d_bytes_per_s: 1e9,
                        max_copies_per_step: num_blocks * (1 + host % 3),
                    }),
                    handoff_copies_per_step: 0,
                    num_blocks,
                    block_size,
                    max_running,
                    max_new_prompts_per_step: prompts,
                    max_tokens_per_step: budget,
                    max_slots: Some(max_running + extra_slots),
                    max_blocks_per_seq: mbs,
                    max_model_len: 40,
                    max_generate_length: None,
                    policy: if stat {
                        BatchingPolicy::Static
                    } else {
                        BatchingPolicy::Continuous
                    },
                    prefix_cache: pc,
                    eos_ids: vec![EOS],
                    long_context: None,
                    // Speculative decoding off, or drafting up to 2 or 4 tokens.
                    speculative: (drafts > 0).then_some(SpeculativeConfig {
                        num_speculative_tokens: 2 * drafts,
                        prompt_lookup_min: lookup_min,
                        prompt_lookup_max: 3,
                        max_batch,
                        min_acceptance: 0.3,
                    }),
                }
            },
        )
}

const PREFIXES: [&[u32]; 3] = [&[1, 2, 3, 4, 5, 6], &[1, 2, 3, 9], &[7]];

/// Checks one plan against the limits and the scheduler state right after `schedule`.
fn check_new_plan(s: &Scheduler, plan: &StepPlan, admitted_before: &HashSet<u32>) {
    let cfg = &s.cfg;
    check_plan(plan, cfg);
    let (host_blocks, max_copies) = cfg
        .kv_host
        .map_or((0, 0), |h| (h.host_blocks, h.max_copies_per_step));
    assert!(plan.kv_copies.len() <= max_copies, "copy room exceeded");
    for c in &plan.kv_copies {
        assert!(
            (c.device_block as usize) < cfg.num_blocks && (c.host_block as usize) < host_blocks
        );
    }
    let bs = cfg.block_size as u32;
    let mut slots = HashSet::new();
    for q in &plan.seqs {
        assert!(slots.insert(q.slot), "slot {} twice in a plan", q.slot);
        assert!(!q.tokens.is_empty());
        assert!(q.block_table.len() <= cfg.max_blocks_per_seq);
        for &m in &q.slot_mapping {
            let b = m / bs;
            assert!(q.block_table.contains(&b), "slot mapping outside the table");
            assert_eq!(s.blocks.refs(b), 1, "write into a shared block");
            assert!(!s.blocks.is_cached(b), "write into a cached block");
        }
    }
    for a in &plan.admit {
        assert!(
            !admitted_before.contains(&a.slot),
            "slot {} reused before forget",
            a.slot
        );
    }
    if cfg.policy == BatchingPolicy::Continuous {
        assert!(plan.admit.len() <= cfg.max_new_prompts_per_step);
    }
}

/// Slots the agent holds: admitted and not yet forgotten by a sent plan.
fn apply_to_agent(agent: &mut HashSet<u32>, plan: &StepPlan) {
    for f in &plan.forget {
        assert!(
            agent.remove(f),
            "forget of slot {f} the agent does not hold"
        );
    }
    for a in &plan.admit {
        agent.insert(a.slot);
    }
}

fn run(cfg: SchedulerConfig, ops: Vec<Op>) {
    let mut s = sched(cfg.clone());
    let mut ids: Vec<u64> = Vec::new();
    let mut pending: Vec<StepPlan> = Vec::new();
    let mut agent: HashSet<u32> = HashSet::new();
    // What the agent's KV memory holds: every plan's reads are checked against it.
    let mut kv = KvModel::new(&s);
    let mut last: Option<u64> = None;
    let mut next_id = 0u64;
    for op in ops {
        match op {
            Op::Add {
                prefix,
                extra,
                max_new,
                ignore_eos,
            } => {
                let mut p = PREFIXES[prefix].to_vec();
                p.extend(extra);
                let mut r = req(next_id, &p, max_new);
                r.ignore_eos = ignore_eos;
                next_id += 1;
                match s.add(&r) {
                    Ok(()) => ids.push(r.id),
                    Err(SchedError::ExceedsPool { .. }) => {}
                    Err(e) => panic!("unexpected refusal: {e}"),
                }
            }
            Op::Abort(i) if !ids.is_empty() => {
                s.abort(ids[i % ids.len()]);
            }
            Op::Finish(i) if !ids.is_empty() => {
                s.finish(ids[i % ids.len()], FinishReason::Stop);
            }
            Op::Schedule => {
                if let Some(plan) = s.schedule() {
                    check_new_plan(&s, &plan, &agent);
                    apply_to_agent(&mut agent, &plan);
                    kv.apply(&plan, &expected_tokens(&s));
                    last = Some(plan.step_id);
                    pending.push(plan);
                }
            }
            Op::Fail if last.is_some() && pending.last().map(|p| p.step_id) == last => {
                // Only the latest plan: the agent ran every earlier one.
                let plan = pending.pop().expect("checked");
                kv.garble(&plan);
                for id in s.step_failed(plan.step_id) {
                    s.abort(id);
                }
            }
            Op::Deliver { pick, token } if !pending.is_empty() => {
                let plan = pending.remove(pick % pending.len());
                s.on_result(&answer_drafts(&plan, |_| token)).unwrap();
            }
            Op::AgentDied => {
                pending.clear();
                agent.clear();
                kv.clear();
                for r in s.take_all() {
                    s.add_recovered(r).unwrap();
                }
            }
            _ => {}
        }
        s.check_invariants().unwrap();
        assert!(s.stats().running <= cfg.max_running);
    }

    // No more arrivals: everything finishes within a bound, and the pool ends empty.
    for plan in std::mem::take(&mut pending) {
        s.on_result(&answer_drafts(&plan, |_| 3)).unwrap();
    }
    let work: usize = 40 * (s.seqs.len() + 1);
    let bound = 4 * work * (s.seqs.len() + 1) + 8;
    let mut steps = 0;
    while let Some(plan) = s.schedule() {
        check_new_plan(&s, &plan, &agent);
        apply_to_agent(&mut agent, &plan);
        kv.apply(&plan, &expected_tokens(&s));
        s.on_result(&answer_drafts(&plan, |_| 3)).unwrap();
        s.check_invariants().unwrap();
        steps += 1;
        assert!(steps <= bound, "not finished after {bound} steps");
    }
    assert!(s.is_idle());
    assert!(agent.is_empty(), "every admitted slot was forgotten");
    let st = s.stats();
    assert_eq!(st.blocks_used, 0);
    assert_eq!(st.blocks_free + st.blocks_cached, st.blocks_total);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn random_traffic_keeps_invariants_and_drains(
        cfg in config(),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        run(cfg, ops);
    }
}

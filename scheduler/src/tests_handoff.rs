//! Prefill/decode disaggregation through two schedulers: requests prefilled on one are handed
//! over (their blocks copied out to handoff blocks in the next plan) and continued on the other
//! (blocks copied in before the step that continues them). A model of each agent's KV memory
//! and of the handoff region replays every plan and checks that every sequence reads the right
//! KV, and the decode side computes no prompt token.

use std::collections::HashMap;

use npu_protocol::{CopyDirection, SamplingParams};

use super::test_util::*;
use super::*;

fn split_cfg(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        handoff_copies_per_step: 2 * num_blocks,
        ..cfg(num_blocks, block_size)
    }
}

/// One step of `s`: plan, check the KV it reads, answer `100 + step + slot`.
fn run_step(s: &mut Scheduler, kv: &mut KvModel, n: u32) -> Vec<SchedOutput> {
    let plan = s.schedule().expect("a step to run");
    check_plan(&plan, &s.cfg);
    kv.apply(&plan, &expected_tokens(s));
    let out = s.on_result(&answer(&plan, |slot| 100 + n + slot)).unwrap();
    s.check_invariants().unwrap();
    out
}

#[test]
fn handed_over_requests_continue_on_the_decode_side_with_nothing_recomputed() {
    let (mut p, mut d) = (sched(split_cfg(16, 2)), sched(split_cfg(16, 2)));
    let (mut kp, mut kd) = (KvModel::new(&p), KvModel::new(&d));
    for id in 1..=3u64 {
        p.add(&req(id, &prompt(10 * id as u32, 5), 4)).unwrap();
    }
    let mut generated: HashMap<RequestId, Vec<u32>> = HashMap::new();
    for o in run_step(&mut p, &mut kp, 0) {
        generated.entry(o.id).or_default().push(o.token.token);
    }
    let ready = p.ready_to_hand_over();
    assert_eq!(
        ready.len(),
        3,
        "every prompt computed and sampled: {ready:?}"
    );
    let mut next_handoff = 0u32;
    let mut handed = Vec::new();
    for (id, n) in ready {
        assert_eq!(n, 3, "5 positions in blocks of 2");
        let blocks: Vec<u32> = (next_handoff..next_handoff + n as u32).collect();
        next_handoff += n as u32;
        assert!(
            p.hand_over(id, &blocks[..1]).is_none(),
            "too few handoff blocks"
        );
        let h = p.hand_over(id, &blocks).expect("ready to hand over");
        assert_eq!((h.num_computed, h.generated.len()), (5, 1));
        handed.push(h);
    }
    assert!(p.is_idle());
    // The plan that copies the blocks out carries nothing else; the prefill side's blocks are
    // free again after it.
    let plan = p.schedule().expect("the copies out");
    assert_eq!(plan.kv_copies.len(), 9);
    assert!(plan
        .kv_copies
        .iter()
        .all(|c| c.direction == CopyDirection::DeviceToHandoff));
    kp.apply(&plan, &expected_tokens(&p));
    p.on_result(&answer(&plan, |_| 0)).unwrap();
    assert_eq!(p.stats().blocks_used, 0);
    assert_eq!(
        (p.stats().handoff_out_requests, p.stats().handoff_out_blocks),
        (3, 9)
    );

    kd.handoff = std::mem::take(&mut kp.handoff);
    for h in handed {
        let id = h.request.id;
        d.add_handed_over(h).unwrap();
        assert!(d.awaits_handoff(id));
    }
    let mut step = 1;
    while !d.is_idle() {
        for o in run_step(&mut d, &mut kd, step) {
            generated.entry(o.id).or_default().push(o.token.token);
        }
        step += 1;
    }
    for id in 1..=3 {
        assert_eq!(
            generated[&id].len(),
            4,
            "request {id}: {:?}",
            generated[&id]
        );
        assert!(!d.awaits_handoff(id));
    }
    let st = d.stats();
    assert_eq!((st.handoff_in_requests, st.handoff_in_blocks), (3, 9));
    assert_eq!(st.prefill_tokens, 0, "the decode side recomputed nothing");
    assert_eq!(p.stats().prefill_tokens, 15);
}

#[test]
fn requests_whose_penalties_need_the_prompt_are_not_handed_over() {
    let mut p = sched(split_cfg(16, 2));
    let mut r = req(1, &prompt(10, 5), 4);
    r.params = SamplingParams {
        repetition_penalty: 1.3,
        ..SamplingParams::greedy()
    };
    p.add(&r).unwrap();
    p.add(&req(2, &prompt(30, 5), 4)).unwrap();
    let mut kp = KvModel::new(&p);
    run_step(&mut p, &mut kp, 0);
    let ready: Vec<RequestId> = p.ready_to_hand_over().into_iter().map(|r| r.0).collect();
    assert_eq!(ready, vec![2]);
    assert!(p.hand_over(1, &[0, 1, 2]).is_none());
}

#[test]
fn a_bad_handover_is_refused_and_a_waiting_one_can_be_aborted() {
    let mut d = sched(split_cfg(16, 2));
    let h = HandedOver {
        request: req(1, &prompt(10, 5), 4),
        generated: vec![7],
        handoff_blocks: vec![0, 1],
        num_computed: 5,
    };
    let e = d.add_handed_over(h.clone()).unwrap_err().to_string();
    assert!(e.contains("2 handoff blocks"), "{e}");
    d.add_handed_over(HandedOver {
        handoff_blocks: vec![0, 1, 2],
        ..h
    })
    .unwrap();
    assert!(d.abort(1));
    d.check_invariants().unwrap();
    assert!(d.is_idle());
}

//! LoRA adapters through the scheduler: admissions carry their request's adapter, the prefix
//! cache never hands KV computed under one adapter to another adapter or to the base model
//! (and does to the same adapter), and no more distinct adapters are admitted than the agent
//! has slots for (the next waits, FCFS, until one ends).

use npu_protocol::LoraRequest;

use super::test_util::*;
use super::*;

fn lora(id: u32) -> LoraRequest {
    LoraRequest {
        id,
        path: format!("/adapters/{id}"),
    }
}

fn cached(num_blocks: usize, block_size: usize) -> Scheduler {
    let mut s = sched(SchedulerConfig {
        prefix_cache: true,
        ..cfg(num_blocks, block_size)
    });
    s.set_max_loras(2);
    s
}

/// Adds request `id` with prompt `p` under adapter `l` (0: base) and runs its prefill step;
/// returns the step's sequence start (the tokens the cache saved).
fn prefill(s: &mut Scheduler, id: u64, p: &[u32], l: u32) -> (u32, Option<LoraRequest>) {
    s.add(&req(id, p, 1)).unwrap();
    if l != 0 {
        s.set_lora(id, lora(l)).unwrap();
    }
    let (plan, _) = step(s, 7);
    assert_eq!(plan.admit.len(), 1);
    (plan.seqs[0].start_pos, plan.admit[0].lora.clone())
}

#[test]
fn the_prefix_cache_is_keyed_on_the_adapter() {
    let mut s = cached(32, 4);
    let p = prompt(0, 10);
    // Adapter 1 computes the prompt; its admission names the adapter.
    assert_eq!(prefill(&mut s, 1, &p, 1), (0, Some(lora(1))));
    // The base model and adapter 2 recompute all of it...
    assert_eq!(prefill(&mut s, 2, &p, 0), (0, None));
    assert_eq!(prefill(&mut s, 3, &p, 2), (0, Some(lora(2))));
    // ...while adapter 1 again, and the base model again, reuse their own two full blocks.
    assert_eq!(prefill(&mut s, 4, &p, 1).0, 8);
    assert_eq!(prefill(&mut s, 5, &p, 0).0, 8);
    s.check_invariants().unwrap();
}

#[test]
fn no_more_adapters_are_admitted_than_there_are_slots() {
    let mut s = sched(cfg(64, 4));
    s.set_max_loras(1);
    s.add(&req(1, &prompt(0, 3), 3)).unwrap();
    s.set_lora(1, lora(1)).unwrap();
    s.add(&req(2, &prompt(10, 3), 3)).unwrap();
    s.set_lora(2, lora(2)).unwrap();
    s.add(&req(3, &prompt(20, 3), 3)).unwrap();
    let plan = s.schedule().unwrap();
    // Adapter 2 would need a second slot: it waits, and FCFS keeps the base request behind it.
    assert_eq!(plan.admit.len(), 1);
    assert_eq!(plan.admit[0].lora, Some(lora(1)));
    assert_eq!(s.lora_ids(), (vec![1], vec![2]));
    s.on_result(&answer(&plan, |_| 7)).unwrap();
    // Request 1 generates its 3 tokens; the others are admitted only once it has ended.
    let mut admitted = Vec::new();
    for _ in 0..6 {
        let Some(plan) = s.schedule() else { break };
        admitted.extend(plan.admit.iter().map(|a| a.lora.clone()));
        s.on_result(&answer(&plan, |_| 7)).unwrap();
        s.check_invariants().unwrap();
    }
    assert_eq!(admitted, vec![Some(lora(2)), None]);
    assert_eq!(s.lora_ids(), (vec![], vec![]));
}

#[test]
fn an_adapter_is_set_only_while_queued_and_only_when_served() {
    let mut s = sched(cfg(16, 4));
    s.add(&req(1, &prompt(0, 3), 3)).unwrap();
    let e = s.set_lora(1, lora(1)).unwrap_err().to_string();
    assert!(e.contains("max_loras 0"), "{e}");
    s.set_max_loras(1);
    assert!(s.set_lora(1, lora(0)).is_err());
    assert!(s.set_lora(9, lora(1)).is_err());
    step(&mut s, 7);
    let e = s.set_lora(1, lora(1)).unwrap_err().to_string();
    assert!(e.contains("already admitted"), "{e}");
}

#[test]
fn a_sequence_the_agent_could_not_run_is_ended_alone_and_nothing_of_it_is_cached() {
    let mut s = cached(32, 4);
    let p = prompt(0, 10);
    s.add(&req(1, &p, 1)).unwrap();
    s.add(&req(2, &p, 3)).unwrap();
    s.set_lora(2, lora(1)).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.admit.len(), 2);
    let slot = plan.admit.iter().find(|a| a.lora.is_some()).unwrap().slot;
    // The agent could not read adapter 1: request 2 has no result, only a failure.
    let mut res = answer(&plan, |_| 7);
    res.seqs.retain(|r| r.slot != slot);
    res.failed = vec![npu_protocol::SeqFailure {
        slot,
        error: "adapter 1 is gone".into(),
    }];
    // Applied before its request is ended: refused, nothing applied.
    assert_eq!(
        s.on_result(&res),
        Err(SchedError::FailedNotEnded {
            step_id: plan.step_id,
            slot
        })
    );
    assert_eq!(s.failed_requests(&res), vec![(2, "adapter 1 is gone")]);
    assert!(s.abort(2));
    let outs = s.on_result(&res).unwrap();
    assert_eq!(outs.iter().map(|o| o.id).collect::<Vec<_>>(), vec![1]);
    assert!(s.failed_requests(&res).is_empty());
    s.check_invariants().unwrap();
    // The base model's blocks were cached; none under adapter 1 (it never ran).
    assert_eq!(prefill(&mut s, 3, &p, 0).0, 8);
    assert_eq!(prefill(&mut s, 4, &p, 1).0, 0);
    s.check_invariants().unwrap();
}

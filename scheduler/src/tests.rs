//! Scheduling tests with hand-made step results: slot mapping, chunked prefill, decode-first
//! order, budgets and caps, static batches, finishes, aborts, preemption, FCFS, recovery and
//! the errors for bad input.

use super::test_util::*;
use super::*;
use npu_protocol::{SeqResult, StepResult, TokenLogprob};

#[test]
fn slot_mapping_follows_the_block_table() {
    let c = cfg(8, 4);
    let mut s = sched(c.clone());
    s.add(&req(1, &prompt(0, 3), 10)).unwrap();
    s.add(&req(2, &prompt(0, 10), 10)).unwrap();
    let (plan, out) = step(&mut s, 50);
    check_plan(&plan, &c);
    assert_eq!(out.len(), 2);
    let a = seq_of(&plan, 0);
    assert_eq!(a.block_table, vec![0]);
    assert_eq!(a.slot_mapping, vec![0, 1, 2]);
    let b = seq_of(&plan, 1);
    assert_eq!(b.block_table, vec![1, 2, 3]);
    assert_eq!(b.slot_mapping, (4..14).collect::<Vec<u32>>());

    let (plan, _) = step(&mut s, 51);
    check_plan(&plan, &c);
    // A decodes position 3 (last slot of block 0); B position 10 = block 3, offset 2.
    assert_eq!(seq_of(&plan, 0).slot_mapping, vec![3]);
    assert_eq!(seq_of(&plan, 1).slot_mapping, vec![3 * 4 + 2]);
    assert_eq!(seq_of(&plan, 1).block_table, vec![1, 2, 3]);

    // A's position 4 needs a new block: the next free one, 4.
    let (plan, _) = step(&mut s, 52);
    let a = seq_of(&plan, 0);
    assert_eq!((a.start_pos, a.block_table.clone()), (4, vec![0, 4]));
    assert_eq!(a.slot_mapping, vec![4 * 4]);
    assert_eq!(a.tokens, vec![51], "decode feeds the last sampled token");
}

#[test]
fn chunked_prefill_splits_exactly_and_only_the_last_chunk_samples() {
    let mut c = cfg(16, 4);
    c.max_tokens_per_step = 4;
    let mut s = sched(c.clone());
    let p = prompt(10, 10);
    s.add(&req(1, &p, 5)).unwrap();
    let mut seen: Vec<u32> = Vec::new();
    let mut chunks = Vec::new();
    loop {
        let (plan, out) = step(&mut s, 77);
        check_plan(&plan, &c);
        let q = &plan.seqs[0];
        chunks.push((q.start_pos, q.tokens.len(), q.sample, q.n_prompt_tokens));
        seen.extend(&q.tokens);
        if !out.is_empty() {
            assert!(q.sample);
            break;
        }
        assert!(!q.sample);
    }
    assert_eq!(
        chunks,
        vec![(0, 4, false, 4), (4, 4, false, 4), (8, 2, true, 2)]
    );
    assert_eq!(seen, p);
    let (plan, _) = step(&mut s, 78);
    let q = &plan.seqs[0];
    assert_eq!(
        (q.start_pos, q.tokens.clone(), q.sample, q.n_prompt_tokens),
        (10, vec![77], true, 0)
    );
}

#[test]
fn decode_tokens_go_first_and_never_stall_behind_a_long_prompt() {
    let mut c = cfg(32, 4);
    c.max_tokens_per_step = 8;
    let mut s = sched(c.clone());
    s.add(&req(1, &prompt(0, 2), 20)).unwrap();
    step(&mut s, 5);
    s.add(&req(2, &prompt(0, 20), 20)).unwrap();
    let mut b_chunks = Vec::new();
    for _ in 0..3 {
        let (plan, out) = step(&mut s, 5);
        check_plan(&plan, &c);
        assert_eq!(plan.seqs[0].slot, 0, "the decoding sequence comes first");
        assert_eq!(plan.seqs[0].tokens.len(), 1);
        assert!(out.iter().any(|o| o.id == 1), "A gets a token every step");
        b_chunks.push(plan.seqs[1].tokens.len());
        assert_eq!(plan.n_tokens(), 8.min(1 + plan.seqs[1].tokens.len()));
    }
    assert_eq!(b_chunks, vec![7, 7, 6]);
}

#[test]
fn token_budget_is_honoured_and_every_token_is_computed_once() {
    let mut c = cfg(64, 4);
    c.max_tokens_per_step = 10;
    let mut s = sched(c.clone());
    let lens = [1usize, 7, 23, 4, 15, 2];
    for (i, &n) in lens.iter().enumerate() {
        s.add(&req(i as u64, &prompt(0, n), 6)).unwrap();
    }
    let mut computed = vec![0usize; lens.len()];
    while !s.is_idle() {
        let plan = s.schedule().unwrap();
        check_plan(&plan, &c);
        for q in &plan.seqs {
            let slot_of = |r: &u64| s.seqs[r].admitted.as_ref().unwrap().slot;
            let id = s
                .running
                .iter()
                .copied()
                .find(|r| slot_of(r) == q.slot)
                .unwrap();
            computed[id as usize] += q.tokens.len();
        }
        s.on_result(&answer(&plan, |_| 9)).unwrap();
        s.check_invariants().unwrap();
    }
    // Each request computes its prompt and all generated tokens but the last.
    let expect: Vec<usize> = lens.iter().map(|n| n + 6 - 1).collect();
    assert_eq!(computed, expect);
}

#[test]
fn prefill_batch_size_caps_admissions_per_step() {
    let mut c = cfg(64, 4);
    c.max_new_prompts_per_step = 2;
    let mut s = sched(c);
    for id in 0..5 {
        s.add(&req(id, &prompt(0, 2), 10)).unwrap();
    }
    let admitted: Vec<usize> = (0..3).map(|_| step(&mut s, 3).0.admit.len()).collect();
    assert_eq!(admitted, vec![2, 2, 1]);
}

#[test]
fn static_policy_admits_a_batch_and_waits_for_all_of_it() {
    let mut c = cfg(64, 4);
    c.max_running = 2;
    c.max_slots = Some(4);
    c.policy = BatchingPolicy::Static;
    let mut s = sched(c.clone());
    s.add(&req(1, &prompt(0, 3), 1)).unwrap();
    s.add(&req(2, &prompt(0, 3), 3)).unwrap();
    s.add(&req(3, &prompt(0, 3), 3)).unwrap();
    let (plan, out) = step(&mut s, 4);
    assert_eq!(plan.admit.len(), 2);
    assert_eq!(out[0].finished, Some(FinishReason::Length));
    let (plan, _) = step(&mut s, 4);
    assert!(plan.admit.is_empty(), "no admission while the batch runs");
    let (plan, out) = step(&mut s, 4);
    assert!(plan.admit.is_empty());
    assert_eq!(out[0].finished, Some(FinishReason::Length));
    let (plan, _) = step(&mut s, 4);
    assert_eq!(plan.admit.len(), 1, "the next batch once all finished");

    // The continuous policy admits the third request as soon as there is room.
    c.policy = BatchingPolicy::Continuous;
    let mut s = sched(c);
    for id in 1..=3 {
        s.add(&req(id, &prompt(0, 3), if id == 1 { 1 } else { 3 }))
            .unwrap();
    }
    step(&mut s, 4);
    assert_eq!(step(&mut s, 4).0.admit.len(), 1);
}

#[test]
fn requests_finish_on_eos_stop_ids_length_and_context() {
    let run = |c: SchedulerConfig, r: GenerateRequest, tokens: &[u32]| {
        let mut s = sched(c);
        s.add(&r).unwrap();
        let mut outs = Vec::new();
        for &t in tokens {
            let (_, out) = step(&mut s, t);
            outs.extend(out);
            if outs.last().is_some_and(|o| o.finished.is_some()) {
                break;
            }
        }
        assert_eq!(
            s.stats().blocks_used,
            0,
            "a finished request frees its blocks"
        );
        assert!(s.is_idle());
        (outs.len(), outs.last().unwrap().finished)
    };
    let c = cfg(16, 4);
    let r = req(1, &prompt(0, 5), 10);
    assert_eq!(
        run(c.clone(), r.clone(), &[7, 8, EOS]),
        (3, Some(FinishReason::Eos))
    );
    let mut ignore = r.clone();
    ignore.ignore_eos = true;
    ignore.max_new_tokens = 4;
    assert_eq!(
        run(c.clone(), ignore.clone(), &[EOS; 10]),
        (4, Some(FinishReason::Length))
    );
    ignore.stop_token_ids = vec![9];
    assert_eq!(
        run(c.clone(), ignore, &[EOS, 9, 7]),
        (2, Some(FinishReason::Eos))
    );
    assert_eq!(
        run(c.clone(), req(1, &prompt(0, 5), 3), &[7; 9]),
        (3, Some(FinishReason::Length))
    );

    let mut ctx = c.clone();
    ctx.max_model_len = 8;
    assert_eq!(
        run(ctx, r.clone(), &[7; 9]),
        (3, Some(FinishReason::ContextLength))
    );
    let mut gen = c.clone();
    gen.max_generate_length = Some(7);
    assert_eq!(
        run(gen, r.clone(), &[7; 9]),
        (2, Some(FinishReason::ContextLength))
    );
    // The pool holds 8 tokens for one sequence.
    assert_eq!(
        run(cfg(2, 4), r, &[7; 9]),
        (3, Some(FinishReason::ContextLength))
    );
}

#[test]
fn abort_frees_everything_in_every_state() {
    let mut c = cfg(16, 4);
    c.max_running = 3;
    c.max_tokens_per_step = 6;
    let mut s = sched(c);
    s.add(&req(1, &prompt(0, 2), 50)).unwrap(); // will be decoding
    s.add(&req(3, &prompt(0, 2), 50)).unwrap();
    s.add(&req(2, &prompt(0, 12), 50)).unwrap(); // will be prefilling
    s.add(&req(4, &prompt(0, 2), 50)).unwrap(); // waiting (max_running 3)
    step(&mut s, 5);
    step(&mut s, 5);
    assert_eq!((s.stats().running, s.stats().waiting), (3, 1));

    assert!(s.abort(4), "waiting");
    assert!(s.abort(2), "prefilling");
    assert!(s.finish(1, FinishReason::Stop), "decoding");
    s.check_invariants().unwrap();
    // Request 3 has a step in flight when it is aborted: its result is ignored.
    let plan = s.schedule().unwrap();
    assert_eq!(plan.forget.len(), 2);
    assert!(s.abort(3));
    assert!(!s.abort(3), "already gone");
    let out = s.on_result(&answer(&plan, |_| 5)).unwrap();
    assert!(out.is_empty());
    assert_eq!(s.stats().blocks_used, 0);
    assert!(s.is_idle());
    let last = s.schedule().expect("a plan forgetting the last slot");
    assert!(last.seqs.is_empty() && last.admit.is_empty());
    assert_eq!(last.forget, vec![plan.seqs[0].slot]);
    s.on_result(&answer(&last, |_| 5)).unwrap();
    assert!(s.schedule().is_none());
    assert_eq!(s.stats().slots_in_use, 0);
}

#[test]
fn a_slot_is_reused_only_after_a_plan_forgot_it() {
    let mut c = cfg(16, 4);
    c.max_running = 1;
    let mut s = sched(c);
    s.add(&req(1, &prompt(0, 2), 1)).unwrap();
    let (plan, out) = step(&mut s, 3);
    assert_eq!(
        (admitted_slots(&plan), out[0].finished),
        (vec![0], Some(FinishReason::Length))
    );
    s.add(&req(2, &prompt(0, 2), 1)).unwrap();
    let (plan, out) = step(&mut s, 3);
    assert_eq!(plan.forget, vec![0]);
    assert!(
        plan.admit.is_empty() && out.is_empty(),
        "slot 0 was not forgotten yet"
    );
    let (plan, _) = step(&mut s, 3);
    assert_eq!(admitted_slots(&plan), vec![0]);
}

#[test]
fn preemption_takes_the_newest_requeues_it_first_and_resumes_it_exactly() {
    // 7 blocks of 2 tokens; three prompts of 3 tokens take 2 blocks each.
    let mut c = cfg(7, 2);
    c.max_tokens_per_step = 64;
    let mut s = sched(c.clone());
    for id in 1..=3 {
        s.add(&req(id, &prompt(0, 3), 4)).unwrap();
    }
    let tok = |step: u32| move |slot: u32| 100 + step * 10 + slot;
    let mut generated: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let mut run = |s: &mut Scheduler, n: u32| {
        let plan = s.schedule().unwrap();
        check_plan(&plan, &c);
        let out = s.on_result(&answer(&plan, tok(n))).unwrap();
        s.check_invariants().unwrap();
        for o in &out {
            generated.entry(o.id).or_default().push(o.token.token);
        }
        (plan, out)
    };
    run(&mut s, 1); // prefill: 6 blocks used
    run(&mut s, 2); // decode position 3: no new block
    s.add(&req(4, &prompt(0, 1), 4)).unwrap(); // fits one block, but must not jump the queue
    let (plan, _) = run(&mut s, 3); // position 4: A takes the free block, B preempts C
    assert_eq!(s.stats().preemptions, 1);
    assert_eq!(
        plan.forget,
        vec![2],
        "the preempted slot is forgotten at once"
    );
    assert_eq!(
        plan.seqs.iter().map(|q| q.slot).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert_eq!(s.waiting.iter().copied().collect::<Vec<_>>(), vec![3, 4]);
    assert_eq!(
        s.generated(3).unwrap().len(),
        2,
        "C keeps its generated tokens"
    );
    let (plan, out) = run(&mut s, 4); // A and B reach 4 tokens and finish
    assert!(
        plan.admit.is_empty(),
        "no room yet; request 4 stays behind C"
    );
    assert!(out.iter().all(|o| o.finished == Some(FinishReason::Length)));
    let (plan, out) = run(&mut s, 5);
    assert_eq!(plan.forget, vec![0, 1]);
    assert_eq!(plan.admit.len(), 2);
    let c_step = &plan.seqs[0];
    let mut expect_tokens = prompt(0, 3);
    expect_tokens.extend([112, 122]);
    assert_eq!(
        c_step.tokens, expect_tokens,
        "prompt then its generated tokens"
    );
    assert_eq!(
        (c_step.start_pos, c_step.n_prompt_tokens, c_step.sample),
        (0, 3, true)
    );
    assert_eq!(out[0].id, 3, "C is re-admitted before request 4");
    while !s.is_idle() {
        run(&mut s, 6);
    }
    assert_eq!(
        generated[&3].len(),
        4,
        "C's output continues where it stopped"
    );
    assert_eq!(s.stats().blocks_used, 0);
}

#[test]
fn no_request_starves_first_tokens_come_in_arrival_order() {
    let mut c = cfg(10, 2);
    c.max_tokens_per_step = 6;
    let mut s = sched(c.clone());
    let lens = [9usize, 1, 5, 12, 2, 1, 7, 3];
    for (i, &n) in lens.iter().enumerate() {
        s.add(&req(i as u64, &prompt(0, n), 6)).unwrap();
    }
    let mut first = Vec::new();
    let mut steps = 0;
    while !s.is_idle() {
        let (plan, out) = step(&mut s, 9);
        check_plan(&plan, &c);
        for o in out {
            if !first.contains(&o.id) {
                first.push(o.id);
            }
        }
        steps += 1;
        assert!(steps < 500, "no progress");
    }
    assert_eq!(first, (0..lens.len() as u64).collect::<Vec<_>>());
}

#[test]
fn take_all_returns_everything_and_recovered_requests_resume_exactly() {
    let mut c = cfg(32, 4);
    c.max_running = 2;
    let mut s = sched(c.clone());
    s.add(&req(1, &prompt(0, 4), 5)).unwrap();
    s.add(&req(2, &prompt(20, 3), 5)).unwrap();
    s.add(&req(3, &prompt(40, 2), 5)).unwrap();
    step(&mut s, 11);
    step(&mut s, 12);
    let lost = s.schedule().unwrap(); // in flight when the agent dies
    let recovered = s.take_all();
    assert_eq!(
        recovered.iter().map(|r| r.request.id).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert_eq!(recovered[0].generated, vec![11, 12]);
    assert_eq!(recovered[2].generated, Vec::<u32>::new());
    assert!(s.is_idle());
    assert_eq!((s.stats().blocks_used, s.stats().slots_in_use), (0, 0));
    assert_eq!(
        s.on_result(&answer(&lost, |_| 1)),
        Err(SchedError::UnknownStep {
            step_id: lost.step_id
        })
    );

    // A fresh request already queued on the restarted agent goes after the recovered ones.
    s.add(&req(9, &prompt(60, 2), 5)).unwrap();
    for r in recovered {
        s.add_recovered(r).unwrap();
    }
    let (plan, _) = step(&mut s, 13);
    check_plan(&plan, &c);
    let a = seq_of(&plan, 0);
    let mut want = prompt(0, 4);
    want.extend([11, 12]);
    assert_eq!((a.tokens.clone(), a.n_prompt_tokens), (want, 4));
    assert_eq!(seq_of(&plan, 1).n_prompt_tokens, 3);
    let mut finished = Vec::new();
    while !s.is_idle() {
        let (_, out) = step(&mut s, 14);
        finished.extend(out.iter().filter(|o| o.finished.is_some()).map(|o| o.id));
    }
    assert_eq!(finished, vec![1, 2, 3, 9]);
}

#[test]
fn bad_requests_and_results_get_clear_errors() {
    let mut c = cfg(4, 4); // one sequence holds at most 16 tokens
    c.max_model_len = 12;
    let mut s = sched(c.clone());
    assert_eq!(
        s.add(&req(1, &[], 5)),
        Err(SchedError::EmptyPrompt { id: 1 })
    );
    assert_eq!(
        s.add(&req(1, &[3], 0)),
        Err(SchedError::NothingToGenerate { id: 1 })
    );
    let e = s.add(&req(1, &prompt(0, 12), 5)).unwrap_err();
    assert!(e.to_string().contains("12 tokens") && e.to_string().contains("max_model_len"));
    c.max_model_len = 100;
    let mut s = sched(c.clone());
    let e = s.add(&req(1, &prompt(0, 16), 5)).unwrap_err();
    assert!(
        matches!(
            e,
            SchedError::ExceedsPool {
                blocks_needed: 5,
                blocks_max: 4,
                ..
            }
        ),
        "{e}"
    );
    s.add(&req(1, &prompt(0, 15), 5)).unwrap();
    assert_eq!(
        s.add(&req(1, &[3], 1)),
        Err(SchedError::DuplicateRequest { id: 1 })
    );
    let e = s
        .add_recovered(RecoveredRequest {
            request: req(2, &[3], 2),
            generated: vec![4, 5],
        })
        .unwrap_err();
    assert!(matches!(e, SchedError::AlreadyComplete { .. }));

    let plan = s.schedule().unwrap();
    let tl = TokenLogprob {
        token: 3,
        logprob: -1.0,
    };
    let bad = |seqs: Vec<SeqResult>, step_id| StepResult {
        transfer: Default::default(),
        failed: Vec::new(),
        step_id,
        seqs,
        timing: Default::default(),
    };
    let res = |slot| SeqResult {
        slot,
        token: tl,
        top: vec![],
        extra: Vec::new(),
    };
    assert_eq!(
        s.on_result(&bad(vec![], 99)),
        Err(SchedError::UnknownStep { step_id: 99 })
    );
    let id = plan.step_id;
    assert_eq!(
        s.on_result(&bad(vec![res(5)], id)),
        Err(SchedError::UnexpectedResult {
            step_id: id,
            slot: 5
        })
    );
    assert_eq!(
        s.on_result(&bad(vec![], id)),
        Err(SchedError::MissingResult {
            step_id: id,
            slot: 0
        })
    );
    assert_eq!(
        s.on_result(&bad(vec![res(0), res(0)], id)),
        Err(SchedError::DuplicateResult {
            step_id: id,
            slot: 0
        })
    );
    assert_eq!(
        s.on_result(&bad(vec![res(0)], id)).unwrap().len(),
        1,
        "errors applied nothing"
    );
}

#[test]
fn config_validation_names_the_field() {
    let bad = |f: fn(&mut SchedulerConfig)| {
        let mut c = SchedulerConfig::default();
        f(&mut c);
        c.validate().unwrap_err().to_string()
    };
    assert!(SchedulerConfig::default().validate().is_ok());
    assert!(bad(|c| c.block_size = 0).contains("block_size is 0"));
    assert!(bad(|c| c.max_tokens_per_step = 0).contains("max_tokens_per_step"));
    assert!(bad(|c| c.max_slots = Some(0)).contains("max_slots"));
    assert!(bad(|c| c.max_generate_length = Some(1)).contains("max_generate_length"));
    assert!(bad(|c| c.num_blocks = usize::MAX / 2).contains("num_blocks"));
    assert!(Scheduler::new(SchedulerConfig {
        max_running: 0,
        ..Default::default()
    })
    .is_err());
}

#[test]
fn a_failed_step_gives_back_its_requests_and_leaves_the_others() {
    let mut s = sched(cfg(16, 4));
    s.add(&req(1, &prompt(0, 3), 4)).unwrap();
    let first = s.schedule().unwrap();
    s.add(&req(2, &prompt(10, 3), 4)).unwrap();
    let second = s.schedule().unwrap();
    assert_eq!(second.seqs.len(), 1, "request 1 is busy in the first step");
    assert_eq!(s.step_failed(first.step_id), vec![1]);
    assert!(s.abort(1));
    s.check_invariants().unwrap();
    assert_eq!(s.stats().steps_in_flight, 1);
    let out = s.on_result(&answer(&second, |_| 7)).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].id, 2);
    assert!(s.step_failed(first.step_id).is_empty(), "already forgotten");
}

//! Speculative decoding in the scheduler: which sequences draft and how much, how a result with
//! kept drafts advances a sequence (tokens, KV length, the finish), and what is refused.

use npu_protocol::{SeqResult, StepResult, TokenLogprob};

use super::test_util::*;
use super::*;

fn spec_cfg(max_batch: usize) -> SchedulerConfig {
    SchedulerConfig {
        speculative: Some(SpeculativeConfig {
            num_speculative_tokens: 4,
            prompt_lookup_min: 2,
            prompt_lookup_max: 3,
            max_batch,
            // Draft whatever the record says (these tests are about the mechanics).
            min_acceptance: 0.0,
        }),
        ..cfg(32, 4)
    }
}

/// A prompt that repeats "5 6 7 8" and ends inside the repeat.
const REPEAT: [u32; 11] = [1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6];

fn prefill(s: &mut Scheduler, token: u32) {
    let (plan, out) = step(s, token);
    assert!(
        plan.seqs.iter().all(|q| q.n_draft == 0),
        "no drafts in a prefill"
    );
    assert!(!out.is_empty());
}

#[test]
fn a_decoding_sequence_drafts_what_followed_its_suffix_and_advances_by_the_kept_drafts() {
    let mut s = sched(spec_cfg(4));
    s.add(&req(1, &REPEAT, 20)).unwrap();
    // The prefill samples 7: the text is now ... 5 6 7, last seen followed by 8 5 6 7.
    prefill(&mut s, 7);
    let plan = s.schedule().unwrap();
    let q = &plan.seqs[0];
    assert_eq!(q.tokens, vec![7, 8, 5, 6, 7]);
    assert_eq!((q.n_draft, q.start_pos, q.sample), (4, 11, true));
    check_plan(&plan, &s.cfg);
    // The agent keeps the first two drafts (8, 5) and then samples 9 where 6 was drafted.
    let res = StepResult {
        step_id: plan.step_id,
        seqs: vec![SeqResult {
            slot: q.slot,
            token: TokenLogprob {
                token: 8,
                logprob: -0.1,
            },
            top: Vec::new(),
            extra: [5, 9]
                .map(|token| TokenLogprob {
                    token,
                    logprob: -0.2,
                })
                .to_vec(),
        }],
        timing: Default::default(),
        transfer: Default::default(),
        failed: Vec::new(),
    };
    let out = s.on_result(&res).unwrap();
    assert_eq!(
        out.iter().map(|o| o.token.token).collect::<Vec<_>>(),
        [8, 5, 9]
    );
    assert!(out.iter().all(|o| o.finished.is_none()));
    s.check_invariants().unwrap();
    let st = s.stats();
    assert_eq!((st.spec_drafted_tokens, st.spec_accepted_tokens), (4, 2));
    // Positions 11 (7), 12 (8) and 13 (5) are computed; 9 is next, at position 14.
    let plan = s.schedule().unwrap();
    assert_eq!(plan.seqs[0].start_pos, 14);
    assert_eq!(plan.seqs[0].tokens[0], 9);
}

#[test]
fn drafting_stops_past_max_batch_and_for_requests_that_may_not_draft() {
    // Two decoding sequences with max_batch 1: neither drafts.
    let mut s = sched(spec_cfg(1));
    s.add(&req(1, &REPEAT, 20)).unwrap();
    s.add(&req(2, &REPEAT, 20)).unwrap();
    prefill(&mut s, 7);
    let (plan, _) = step(&mut s, 7);
    assert_eq!(plan.n_draft(), 0);

    // One sequence that turned speculation off, one that asks for alternatives: no drafts.
    let mut s = sched(spec_cfg(4));
    let mut off = req(1, &REPEAT, 20);
    off.speculative = false;
    let mut top = req(2, &REPEAT, 20);
    top.params.top_n = 2;
    s.add(&off).unwrap();
    s.add(&top).unwrap();
    prefill(&mut s, 7);
    let (plan, _) = step(&mut s, 7);
    assert_eq!(plan.n_draft(), 0);

    // The same request drafts when allowed.
    let mut s = sched(spec_cfg(4));
    s.add(&req(1, &REPEAT, 20)).unwrap();
    prefill(&mut s, 7);
    let (plan, _) = step(&mut s, 7);
    assert_eq!(plan.n_draft(), 4);
}

#[test]
fn drafts_never_reach_past_max_new_tokens_and_an_end_drops_the_rest() {
    // Three new tokens: the first from the prefill, then one decode step may add at most two.
    let mut s = sched(spec_cfg(4));
    s.add(&req(1, &REPEAT, 3)).unwrap();
    prefill(&mut s, 7);
    let plan = s.schedule().unwrap();
    assert_eq!(
        plan.seqs[0].n_draft, 1,
        "room for one kept draft and one more token"
    );
    let out = s.on_result(&answer_drafts(&plan, |_| 8)).unwrap();
    assert_eq!(
        out.iter().map(|o| o.token.token).collect::<Vec<_>>(),
        [8, 8]
    );
    assert_eq!(out[1].finished, Some(FinishReason::Length));
    assert!(s.is_idle());

    // EOS sampled where it was drafted ends the request there: what followed is dropped.
    let mut s = sched(spec_cfg(4));
    s.add(&req(1, &[1, 5, 6, EOS, 7, 5], 20)).unwrap();
    prefill(&mut s, 6);
    let plan = s.schedule().unwrap();
    assert_eq!(plan.seqs[0].tokens, vec![6, EOS, 7, 5, 6]);
    let mut res = answer_drafts(&plan, |_| EOS);
    res.seqs[0].extra = [7, 5]
        .map(|token| TokenLogprob {
            token,
            logprob: -0.1,
        })
        .to_vec();
    let out = s.on_result(&res).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].token.token, EOS);
    assert_eq!(out[0].finished, Some(FinishReason::Eos));
    assert!(s.is_idle());
}

#[test]
fn more_tokens_than_drafts_is_refused_and_nothing_is_applied() {
    let mut s = sched(spec_cfg(4));
    s.add(&req(1, &REPEAT, 20)).unwrap();
    prefill(&mut s, 7);
    let plan = s.schedule().unwrap();
    let mut res = answer_drafts(&plan, |_| 8);
    res.seqs[0].extra = vec![res.seqs[0].token; 5];
    let e = s.on_result(&res).unwrap_err();
    assert!(
        matches!(
            e,
            SchedError::TooManyTokens {
                got: 6,
                drafted: 4,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(s.stats().spec_accepted_tokens, 0);
}

#[test]
fn speculative_settings_are_checked_with_the_config() {
    let mut c = spec_cfg(4);
    c.speculative = Some(SpeculativeConfig {
        num_speculative_tokens: 0,
        ..SpeculativeConfig::default()
    });
    let e = Scheduler::new(c).unwrap_err().to_string();
    assert!(e.contains("speculative.num_speculative_tokens"), "{e}");
}

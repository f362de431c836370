//! The one check of a step: a good plan becomes exactly the device inputs it describes, and each
//! kind of bad plan is refused with a message that names the problem.

use npu_protocol::{SeqStep, StepPlan};

use super::*;

const LIM: StepLimits = StepLimits {
    max_tokens: 16,
    max_slots: 4,
    max_blocks_per_seq: 4,
    num_blocks: 10,
    block_size: 4,
    vocab: 100,
    long_context: None,
};

/// A sequence on `table` with `n` new tokens from `start`, mapped through its table.
fn seq(slot: u32, start: u32, n: u32, table: &[u32], sample: bool) -> SeqStep {
    let bs = LIM.block_size as u32;
    SeqStep {
        slot,
        tokens: (0..n).map(|j| 10 + slot * 10 + j).collect(),
        start_pos: start,
        block_table: table.to_vec(),
        slot_mapping: (start..start + n)
            .map(|p| table[(p / bs) as usize] * bs + p % bs)
            .collect(),
        sample,
        n_prompt_tokens: if start == 0 { n } else { 0 },
        n_draft: 0,
    }
}

fn plan(seqs: Vec<SeqStep>) -> StepPlan {
    StepPlan {
        step_id: 9,
        seqs,
        ..Default::default()
    }
}

fn read(p: &StepPlan) -> Result<StepRead, StepError> {
    let mut r = StepRead::default();
    r.read(p, &LIM, |slot| slot != 3)?;
    Ok(r)
}

fn refused(p: &StepPlan, needle: &str) {
    let e = read(p).expect_err(needle).to_string();
    assert!(e.contains(needle), "{e:?} should mention {needle:?}");
}

#[test]
fn a_plan_becomes_the_inputs_it_describes() {
    // A prefill chunk of 5 that does not sample, and a decode token at position 6.
    let p = plan(vec![
        seq(1, 0, 5, &[7, 2], false),
        seq(0, 6, 1, &[4, 5], true),
    ]);
    let r = read(&p).unwrap();
    let m = &r.inputs;
    assert_eq!(m.tokens, vec![20, 21, 22, 23, 24, 10]);
    assert_eq!(m.positions, vec![0, 1, 2, 3, 4, 6]);
    assert_eq!(m.slot_mapping, vec![28, 29, 30, 31, 8, 22]);
    assert_eq!(m.max_blocks, 2);
    assert_eq!(m.block_tables, vec![7, 2, 4, 5]);
    assert_eq!(
        m.seqs,
        vec![
            SeqSpan {
                q_row: 0,
                n_q: 5,
                start_pos: 0
            },
            SeqSpan {
                q_row: 5,
                n_q: 1,
                start_pos: 6
            }
        ]
    );
    assert_eq!(m.logit_rows, vec![5]);
    assert_eq!(r.logit_slots, vec![0]);
    assert_eq!(
        r.seqs,
        vec![
            SeqFacts {
                slot: 1,
                n_prompt: 5,
                n_draft: 0
            },
            SeqFacts {
                slot: 0,
                n_prompt: 0,
                n_draft: 0
            }
        ]
    );
    assert_eq!(r.tokens(0), &[20, 21, 22, 23, 24]);
    // Shorter tables are padded with block 0.
    let p = plan(vec![seq(1, 0, 2, &[7], true), seq(0, 6, 1, &[4, 5], true)]);
    let r = read(&p).unwrap();
    assert_eq!(r.inputs.block_tables, vec![7, 0, 4, 5]);
    assert_eq!(r.inputs.logit_rows, vec![1, 2]);
}

#[test]
fn a_drafting_sequence_samples_after_its_last_real_token_and_each_draft() {
    // Slot 0 prefills 2 tokens without sampling; slot 1 decodes its token and 3 drafts.
    let mut spec = seq(1, 6, 4, &[4, 5, 6], true);
    spec.n_draft = 3;
    let p = plan(vec![seq(0, 0, 2, &[7], false), spec]);
    let r = read(&p).unwrap();
    assert_eq!(r.inputs.logit_rows, vec![2, 3, 4, 5]);
    assert_eq!(r.logit_slots, vec![1; 4]);
    assert_eq!(
        r.sampling,
        vec![SamplingSeq {
            seq: 1,
            slot: 1,
            first_row: 0,
            n_draft: 3
        }]
    );
    assert_eq!(r.drafts(1), &r.tokens(1)[1..]);
    assert!(r.drafts(0).is_empty());

    for (n_draft, n_prompt, sample) in [(4, 0, true), (1, 0, false), (2, 3, true), (17, 0, true)] {
        let mut bad = seq(1, 6, 4, &[4, 5, 6], sample);
        bad.n_draft = n_draft;
        bad.n_prompt_tokens = n_prompt;
        refused(&plan(vec![bad]), "drafted tokens");
    }
}

#[test]
fn bad_plans_are_refused_naming_the_problem() {
    refused(
        &plan(vec![seq(3, 0, 2, &[1], true)]),
        "slot 3 was not admitted",
    );
    refused(
        &plan(vec![seq(9, 0, 2, &[1], true)]),
        "slot 9 was not admitted",
    );
    refused(
        &plan(vec![seq(1, 0, 2, &[1], true), seq(1, 4, 1, &[1, 2], true)]),
        "slot 1 appears twice",
    );
    refused(
        &plan(vec![
            seq(1, 0, 9, &[1, 2, 3], true),
            seq(2, 0, 8, &[4, 5], true),
        ]),
        "17 tokens exceed the step capacity 16",
    );
    refused(
        &plan(vec![seq(1, 0, 1, &[1, 2, 3, 4, 5], true)]),
        "a block table of 5 blocks exceeds 4",
    );
    refused(
        &plan(vec![seq(1, 0, 2, &[10], true)]),
        "block 10 is beyond the KV pool (10 blocks)",
    );
    // A table that does not cover the new positions.
    let mut s = seq(1, 0, 4, &[1], true);
    s.tokens.push(1);
    s.slot_mapping.push(8);
    refused(&plan(vec![s]), "5 positions need more than its 1 blocks");
    // A slot mapping that disagrees with the table.
    let mut s = seq(1, 2, 2, &[1], true);
    s.slot_mapping[1] = 5;
    refused(
        &plan(vec![s]),
        "token 1 maps to slot 5 but its block table gives 7",
    );
    let mut s = seq(1, 0, 2, &[1], true);
    s.tokens[0] = 100;
    refused(
        &plan(vec![s]),
        "token id 100 is beyond the vocabulary (100)",
    );
    let mut s = seq(1, 0, 2, &[1], true);
    s.n_prompt_tokens = 3;
    refused(&plan(vec![s]), "3 prompt tokens");
    let mut s = seq(1, 0, 2, &[1], true);
    s.slot_mapping.pop();
    refused(&plan(vec![s]), "1 slot mappings");
    let mut s = seq(1, 0, 1, &[1], true);
    s.start_pos = u32::MAX;
    refused(&plan(vec![s]), "positions beyond 32 bits");
    let mut s = seq(1, 0, 1, &[1], true);
    s.tokens.clear();
    s.slot_mapping.clear();
    s.n_prompt_tokens = 0;
    refused(&plan(vec![s, seq(2, 0, 1, &[2], true)]), "0 tokens");
}

/// In long-context mode the table is the budget and slots go through the layout's ring; a slot
/// mapped the ordinary way, a short table or a chunk that overruns the ring is refused.
#[test]
fn long_context_plans_map_slots_through_the_ring() {
    use npu_protocol::{LongContextConfig, LongContextLayout};
    // Budget 4 blocks of 4 tokens: 1 initial, a ring of 2, 1 cache entry; memory from 12.
    let layout = LongContextLayout::new(
        LongContextConfig {
            initial_blocks: 1,
            local_blocks: 1,
            topk_blocks: 1,
            representative_keys: 1,
            device_blocks: 4,
        },
        4,
    )
    .unwrap();
    let lim = StepLimits {
        long_context: Some(layout),
        ..LIM
    };
    let read_long = |p: &StepPlan| {
        let mut r = StepRead::default();
        r.read(p, &lim, |_| true).map(|()| r)
    };
    let table = [7u32, 2, 5, 9];
    let ring_seq = |start: u32, n: u32| SeqStep {
        slot: 0,
        tokens: (0..n).map(|j| 10 + j).collect(),
        start_pos: start,
        block_table: table.to_vec(),
        slot_mapping: (start..start + n)
            .map(|p| layout.slot(&table, u64::from(p)).unwrap())
            .collect(),
        sample: true,
        n_prompt_tokens: 0,
        n_draft: 0,
    };
    // Position 20 lies in logical block 5: ring entry 1 + (4 % 2) = 1, block 2.
    let r = read_long(&plan(vec![ring_seq(20, 2)])).unwrap();
    assert_eq!(r.inputs.slot_mapping, vec![8, 9]);
    assert_eq!(r.inputs.block_tables, table.to_vec());
    // Mapped as in normal mode (block table entry 5 does not exist): refused.
    let mut bad = ring_seq(20, 2);
    bad.slot_mapping = vec![20 * 4, 20 * 4 + 1];
    let e = read_long(&plan(vec![bad])).unwrap_err().to_string();
    assert!(e.contains("maps to slot"), "{e}");
    // Once memory is active the whole budget must be there.
    let mut short = ring_seq(20, 2);
    short.block_table = table[..3].to_vec();
    let e = read_long(&plan(vec![short])).unwrap_err().to_string();
    assert!(e.contains("need more than"), "{e}");
    // From 20 the ring holds the window block 4 and block 5: at most 4 tokens.
    let e = read_long(&plan(vec![ring_seq(20, 5)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("overrun"), "{e}");
}

#[test]
fn skipped_slots_leave_the_step_and_the_rest_is_read_as_without_them() {
    // Slot 1 (a prefill that samples) is skipped: slot 0's sequence is read as if alone, its
    // logit row and sampling entry index the read sequences, not the plan's.
    let p = plan(vec![
        seq(1, 0, 5, &[7, 2], true),
        seq(0, 6, 1, &[4, 5], true),
    ]);
    let mut r = StepRead::default();
    r.read_skipping(&p, &LIM, |s| s != 1, |s| s == 1).unwrap();
    let alone = read(&plan(vec![seq(0, 6, 1, &[4, 5], true)])).unwrap();
    assert_eq!(r.inputs.tokens, alone.inputs.tokens);
    assert_eq!(r.inputs.seqs, alone.inputs.seqs);
    assert_eq!(r.inputs.logit_rows, vec![0]);
    assert_eq!(r.seqs, alone.seqs);
    assert_eq!(r.sampling, alone.sampling);
    // Everything skipped: nothing to run.
    r.read_skipping(&p, &LIM, |_| false, |_| true).unwrap();
    assert!(r.seqs.is_empty() && r.inputs.tokens.is_empty() && r.sampling.is_empty());
    // A skipped slot still appears once at most; an unskipped one must still be admitted.
    let twice = plan(vec![seq(1, 0, 1, &[7], true), seq(1, 1, 1, &[7], true)]);
    let e = r.read_skipping(&twice, &LIM, |_| true, |s| s == 1);
    assert!(e.unwrap_err().to_string().contains("twice"));
    let e = r.read_skipping(&p, &LIM, |s| s == 1, |s| s == 1);
    assert!(e.unwrap_err().to_string().contains("not admitted"));
}

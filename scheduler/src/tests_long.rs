//! Long-context mode in the scheduler: a sequence far longer than its budget runs on a bounded
//! block table, every slot mapping follows the layout, and chunks never outgrow the ring.

use super::test_util::*;
use super::*;
use npu_protocol::{LongContextConfig, LongContextLayout};

fn long_cfg(num_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_tokens_per_step: 48,
        max_model_len: 100_000,
        long_context: Some(LongContextConfig {
            initial_blocks: 1,
            local_blocks: 2,
            topk_blocks: 2,
            representative_keys: 2,
            device_blocks: 8,
        }),
        ..cfg(num_blocks, 4)
    }
}

#[test]
fn a_sequence_far_past_its_budget_runs_on_a_bounded_table() {
    let c = long_cfg(8);
    let layout = LongContextLayout::new(c.long_context.unwrap(), 4).unwrap();
    let mut s = sched(c.clone());
    // 300 prompt tokens and 20 generated ones on 8 blocks of 4 tokens.
    s.add(&req(1, &prompt(0, 300), 20)).unwrap();
    let mut generated = 0;
    let mut next_pos = 0u32;
    while generated < 20 {
        let (plan, out) = step(&mut s, 9);
        assert!(plan.n_tokens() <= c.max_tokens_per_step);
        let q = &plan.seqs[0];
        assert_eq!(q.start_pos, next_pos, "positions run on without a gap");
        next_pos += q.tokens.len() as u32;
        let ctx = u64::from(q.start_pos);
        assert!(
            q.tokens.len() as u64 <= layout.max_chunk(ctx),
            "chunk at {ctx}"
        );
        assert!(q.block_table.len() <= 8);
        assert_eq!(q.block_table.len(), layout.table_len(u64::from(next_pos)));
        for (i, &m) in q.slot_mapping.iter().enumerate() {
            let pos = ctx + i as u64;
            assert_eq!(Some(m), layout.slot(&q.block_table, pos), "slot of {pos}");
        }
        assert!(s.stats().blocks_used <= 8);
        generated += out.len();
    }
    assert_eq!(next_pos, 319, "the last sampled token is never fed back");
    s.check_invariants().unwrap();
}

#[test]
fn long_context_settings_are_checked_against_the_pool() {
    let mut c = long_cfg(8);
    assert!(c.validate().is_ok());
    c.num_blocks = 7;
    c.max_blocks_per_seq = 7;
    let e = c.validate().unwrap_err().to_string();
    assert!(
        e.contains("long_context") && e.contains("device_blocks"),
        "{e}"
    );
    let mut c = long_cfg(8);
    c.long_context = Some(LongContextConfig {
        topk_blocks: 0,
        ..c.long_context.unwrap()
    });
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("topk_blocks"), "{e}");
    // The context limit no longer follows the pool.
    assert_eq!(long_cfg(8).max_total_len(), 100_000);
}

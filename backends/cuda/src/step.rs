//! One step's inputs, checked and packed into a single i32 array for one host→device copy:
//! tokens, positions, slot mapping, per-sequence (first row, new tokens, start position), block
//! tables, logit rows, and the attention work lists (for each query-tile size, the (sequence,
//! first token) of every tile). Every check a kernel's memory safety depends on is made here.

use npu_backend::{BackendError, KvSpec, StepInputs};

/// Query-tile sizes the attention work lists are made for.
pub const QUERY_TILES: [usize; 4] = [1, 2, 4, 8];

/// Where each part lies in the packed array (element offsets) and how long it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepLayout {
    pub n_tokens: usize,
    pub n_seqs: usize,
    pub max_blocks: usize,
    pub tokens: usize,
    pub positions: usize,
    pub slots: usize,
    pub seq_info: usize,
    pub block_tables: usize,
    pub logit_rows: usize,
    pub n_logit_rows: usize,
    /// Per entry of `QUERY_TILES`: (offset, number of work items).
    pub items: [(usize, usize); 4],
    /// Longest context of any sequence (start position + new tokens).
    pub max_ctx: usize,
    pub total: usize,
}

fn bad(m: String) -> Result<StepLayout, BackendError> {
    Err(BackendError::BadStep(m))
}

/// Checks `s` (against the KV pool when there is one) and packs it into `out` (cleared first).
/// Without a pool (`kv` None) slots, block ids and context lengths are not checked: only the
/// token ops may run on such a step, and the backend forgets it when a pool is made.
pub fn pack(
    s: &StepInputs,
    kv: Option<&KvSpec>,
    out: &mut Vec<i32>,
) -> Result<StepLayout, BackendError> {
    let t = s.tokens.len();
    if s.positions.len() != t || s.slot_mapping.len() != t {
        return bad(format!(
            "{t} tokens but {} positions and {} slots",
            s.positions.len(),
            s.slot_mapping.len()
        ));
    }
    if t > i32::MAX as usize / 2 {
        return bad(format!("{t} tokens in one step"));
    }
    // With no pool, nothing can be beyond it.
    let (num_blocks, block_size) = kv.map_or((usize::MAX, 1), |k| (k.num_blocks, k.block_size));
    let slots = num_blocks.saturating_mul(block_size);
    if let Some(bad_slot) = s.slot_mapping.iter().find(|&&x| x as usize >= slots) {
        return bad(format!(
            "slot {bad_slot} is beyond the KV pool ({slots} slots)"
        ));
    }
    if let Some(&p) = s.positions.iter().find(|&&p| p > i32::MAX as u32) {
        return bad(format!("position {p} is out of range"));
    }
    if let Some(&tok) = s.tokens.iter().find(|&&x| x > i32::MAX as u32) {
        return bad(format!("token id {tok} is out of range"));
    }
    let n_seqs = s.seqs.len();
    if s.block_tables.len() != n_seqs.saturating_mul(s.max_blocks) {
        return bad(format!(
            "{} block table entries for {n_seqs} sequences of {} blocks",
            s.block_tables.len(),
            s.max_blocks
        ));
    }
    if let Some(b) = s.block_tables.iter().find(|&&b| b as usize >= num_blocks) {
        return bad(format!(
            "block {b} is beyond the KV pool ({num_blocks} blocks)"
        ));
    }
    let mut next_row = 0usize;
    let mut max_ctx = 0usize;
    for (i, q) in s.seqs.iter().enumerate() {
        let (row, n, start) = (q.q_row as usize, q.n_q as usize, q.start_pos as usize);
        if row != next_row || n == 0 {
            return bad(format!(
                "sequence {i}: its rows must follow the previous sequence's and be non-empty"
            ));
        }
        next_row += n;
        let end = start + n;
        if end > i32::MAX as usize {
            return bad(format!("sequence {i}: context of {end} positions"));
        }
        if kv.is_some() && end.div_ceil(block_size) > s.max_blocks {
            return bad(format!(
                "sequence {i}: {end} positions need more than its {} blocks",
                s.max_blocks
            ));
        }
        max_ctx = max_ctx.max(end);
    }
    // A step without sequences runs token ops only (no attention work): its rows need no cover.
    if next_row != t && !s.seqs.is_empty() {
        return bad(format!(
            "the sequences cover {next_row} of the step's {t} token rows"
        ));
    }
    if let Some(r) = s.logit_rows.iter().find(|&&r| r as usize >= t) {
        return bad(format!("logit row {r} is beyond the step's {t} tokens"));
    }

    out.clear();
    let mut lay = StepLayout {
        n_tokens: t,
        n_seqs,
        max_blocks: s.max_blocks,
        n_logit_rows: s.logit_rows.len(),
        max_ctx,
        ..Default::default()
    };
    lay.tokens = out.len();
    out.extend(s.tokens.iter().map(|&x| x as i32));
    lay.positions = out.len();
    out.extend(s.positions.iter().map(|&x| x as i32));
    lay.slots = out.len();
    out.extend(s.slot_mapping.iter().map(|&x| x as i32));
    lay.seq_info = out.len();
    for q in &s.seqs {
        out.extend([q.q_row as i32, q.n_q as i32, q.start_pos as i32]);
    }
    lay.block_tables = out.len();
    out.extend(s.block_tables.iter().map(|&x| x as i32));
    lay.logit_rows = out.len();
    out.extend(s.logit_rows.iter().map(|&x| x as i32));
    for (k, &qt) in QUERY_TILES.iter().enumerate() {
        let at = out.len();
        for (i, q) in s.seqs.iter().enumerate() {
            for t0 in (0..q.n_q as usize).step_by(qt) {
                out.extend([i as i32, t0 as i32]);
            }
        }
        lay.items[k] = (at, (out.len() - at) / 2);
    }
    lay.total = out.len();
    Ok(lay)
}

#[cfg(test)]
mod tests {
    use super::*;
    use npu_backend::SeqSpan;

    fn spec() -> KvSpec {
        KvSpec {
            n_layers: 2,
            num_blocks: 8,
            block_size: 4,
            n_kv_heads: 1,
            head_dim: 8,
        }
    }

    fn step() -> StepInputs {
        // Sequence 0: prefill of 3 at 0 (blocks 2); sequence 1: decode at position 5 (blocks 1, 3).
        StepInputs {
            tokens: vec![10, 11, 12, 13],
            positions: vec![0, 1, 2, 5],
            slot_mapping: vec![8, 9, 10, 13],
            seqs: vec![
                SeqSpan {
                    q_row: 0,
                    n_q: 3,
                    start_pos: 0,
                },
                SeqSpan {
                    q_row: 3,
                    n_q: 1,
                    start_pos: 5,
                },
            ],
            block_tables: vec![2, 0, 1, 3],
            max_blocks: 2,
            logit_rows: vec![2, 3],
        }
    }

    #[test]
    fn packs_every_part_and_the_work_lists() {
        let mut out = Vec::new();
        let l = pack(&step(), Some(&spec()), &mut out).unwrap();
        assert_eq!(&out[l.tokens..l.tokens + 4], &[10, 11, 12, 13]);
        assert_eq!(&out[l.seq_info..l.seq_info + 6], &[0, 3, 0, 3, 1, 5]);
        assert_eq!(&out[l.block_tables..l.block_tables + 4], &[2, 0, 1, 3]);
        assert_eq!(&out[l.logit_rows..l.logit_rows + 2], &[2, 3]);
        // qt = 1: one item per token; qt = 2: (0,0), (0,2), (1,0).
        assert_eq!(l.items[0].1, 4);
        let (at, n) = l.items[1];
        assert_eq!(&out[at..at + 2 * n], &[0, 0, 0, 2, 1, 0]);
        assert_eq!(l.max_ctx, 6);
        assert_eq!(l.total, out.len());
    }

    #[test]
    fn refuses_what_would_reach_outside_the_pool() {
        let mut out = Vec::new();
        let mut s = step();
        s.slot_mapping[0] = 32;
        assert!(pack(&s, Some(&spec()), &mut out).is_err());
        let mut s = step();
        s.block_tables[1] = 8;
        assert!(pack(&s, Some(&spec()), &mut out).is_err());
        let mut s = step();
        s.seqs[1].start_pos = 8; // 9 positions need 3 blocks of 4
        assert!(pack(&s, Some(&spec()), &mut out).is_err());
        let mut s = step();
        s.logit_rows[0] = 4;
        assert!(pack(&s, Some(&spec()), &mut out).is_err());
        let mut s = step();
        s.seqs[1].n_q = 2; // rows beyond the tokens
        assert!(pack(&s, Some(&spec()), &mut out).is_err());
        let mut s = step();
        s.positions.pop();
        assert!(pack(&s, Some(&spec()), &mut out).is_err());
    }

    #[test]
    fn without_a_pool_only_the_pool_checks_are_left_out() {
        let mut out = Vec::new();
        let mut s = step();
        s.slot_mapping[0] = 1000;
        s.block_tables[1] = 1000;
        assert!(pack(&s, Some(&spec()), &mut out).is_err());
        let l = pack(&s, None, &mut out).unwrap();
        assert_eq!(l.n_tokens, 4);
        // A step of tokens without sequences (token ops only) packs, with no attention work.
        let mut t = step();
        t.seqs.clear();
        t.block_tables.clear();
        t.logit_rows.clear();
        let l = pack(&t, None, &mut out).unwrap();
        assert_eq!((l.n_seqs, l.items[0].1), (0, 0));
        // The step's own consistency is still checked.
        s.logit_rows[0] = 4;
        assert!(pack(&s, None, &mut out).is_err());
    }
}

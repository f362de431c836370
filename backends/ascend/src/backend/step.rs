//! One step's inputs on the device: every index array the step's operators read, packed into one
//! INT32 buffer so that `begin_step` moves them host→device in a single copy, plus what the
//! host keeps of them (attention's per-sequence lengths are host arguments of its first phase).
//!
//! Attention takes one of two documented paths of FusedInferAttentionScore's paged mode:
//! - **token-wise** (the incremental branch, S = 1): each new token is its own batch entry whose
//!   KV length is its position + 1 and whose block-table row is its sequence's, so causality is
//!   the KV length and prefill chunks need no mask. A decode-only step is exactly this with one
//!   token per sequence (the block tables as they come). Any block size that is a multiple of 16.
//! - **prompt** (S > 1, right-down causal mask): for steps with prefill chunks when the block size
//!   is a multiple of 128, as that branch requires. Queries are gathered into a (sequences,
//!   longest chunk) padded batch and the results gathered back to the step's rows.
//!
//! Sliding-window layers: the prompt branch takes band mode over the same mask (the window is
//! preTokens back from the diagonal); the incremental branch has no such parameter, so each
//! entry gets a key mask (1 before `kv_len − window`), built here on the host and packed into
//! the step's upload for every window the backend has met ([`StepPlan::pack_window_masks`]).

use npu_backend::{BackendError, StepInputs};

/// Which attention path a step takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnPath {
    /// One batch entry per token (incremental branch).
    TokenWise,
    /// One batch entry per sequence, padded to `s_max` queries (prompt branch).
    Prompt { s_max: usize },
}

/// Offsets (in INT32 elements) of each array in the step's device buffer, each a multiple of
/// [`ALIGN_ELEMS`] (32 bytes), and the host copies of what attention's first phase takes.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    pub tokens: usize,
    pub n_tokens: usize,
    pub positions: usize,
    pub slots: usize,
    pub logit_rows: usize,
    pub n_logit_rows: usize,
    /// Block tables: one row per attention batch entry (`batch` rows of `max_blocks`).
    pub tables: usize,
    pub batch: usize,
    pub max_blocks: usize,
    /// Prompt path: step row of each padded query row, and padded row of each step row.
    pub pad_rows: usize,
    pub unpad_rows: usize,
    /// Per batch entry: query count and KV length.
    pub q_lens: Vec<i64>,
    pub kv_lens: Vec<i64>,
    pub path: Option<AttnPath>,
    /// Batch entries split into runs whose blocks add up to at most the pool's: the attention
    /// operator takes no more blocks per call than the cache holds (one call per run).
    pub groups: Vec<std::ops::Range<usize>>,
    pub max_position: u32,
    /// The pool's block size (1 without a pool).
    pub block_size: usize,
    /// Token-wise path: key masks of sliding windows packed into `data`, as (window, offset in
    /// INT32 elements of its bytes); a window whose entries all fit in it has none.
    pub window_masks: Vec<(u32, usize)>,
    /// Graph form ([`StepPlan::graph_form`]): every entry's KV length is the block tables'
    /// whole reach, and the keys past each entry's own length are hidden by a key mask packed
    /// into `data` at this offset (INT32 elements), so no length is a first-phase argument.
    pub length_mask: Option<usize>,
    /// The packed arrays.
    pub data: Vec<i32>,
}

fn bad(s: String) -> BackendError {
    BackendError::BadStep(s)
}

/// INT32 elements between the starts of packed arrays: every array begins 32 bytes into the
/// buffer times a whole number, the alignment CANN's runtime pages ask of device addresses where
/// they state one (the operator pages state none for a view's start).
pub const ALIGN_ELEMS: usize = 8;

/// Pads `d` with zeros to the next multiple of [`ALIGN_ELEMS`] and returns that offset: where the
/// next array starts.
fn align(d: &mut Vec<i32>) -> usize {
    let at = d.len().next_multiple_of(ALIGN_ELEMS);
    d.resize(at, 0);
    at
}

/// Appends `vals` at the next aligned offset and returns that offset.
fn push(d: &mut Vec<i32>, vals: impl IntoIterator<Item = i32>) -> usize {
    let at = align(d);
    d.extend(vals);
    at
}

impl StepPlan {
    /// Checks `step` against the pool (`num_blocks` blocks of `block_size`) and packs it.
    pub fn new(
        step: &StepInputs,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, BackendError> {
        Self::plan(step, Some((num_blocks, block_size)), false)
    }

    /// [`Self::new`] on the token-wise path whatever the block size: what FusedInferAttention-
    /// ScoreV3's MLA form takes (S = 1 entries, no mask; `mla_ops`).
    pub fn token_wise(
        step: &StepInputs,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, BackendError> {
        Self::plan(step, Some((num_blocks, block_size)), true)
    }

    /// A step before the KV pool exists: the token-wise ops work, KV write and attention refuse.
    pub fn without_kv(step: &StepInputs) -> Result<Self, BackendError> {
        Self::plan(step, None, false)
    }

    fn plan(
        step: &StepInputs,
        pool: Option<(usize, usize)>,
        token_wise: bool,
    ) -> Result<Self, BackendError> {
        let t = step.tokens.len();
        if t == 0 {
            return Err(bad("a step needs at least one token".into()));
        }
        if step.positions.len() != t || step.slot_mapping.len() != t {
            return Err(bad(
                "positions and slot mapping need one entry per token".into()
            ));
        }
        let (nseq, mb) = (step.seqs.len(), step.max_blocks);
        let (num_blocks, block_size) = pool.unwrap_or((usize::MAX / 2, 1));
        if step.block_tables.len() != nseq * mb || (nseq > 0 && mb == 0) {
            return Err(bad(format!(
                "{} block-table entries for {nseq} sequences of {mb} blocks",
                step.block_tables.len()
            )));
        }
        let slots = num_blocks.saturating_mul(block_size).min(u32::MAX as usize) as u32;
        if let Some(s) = step.slot_mapping.iter().find(|&&s| s >= slots) {
            return Err(bad(format!("slot {s} is outside the pool's {slots} slots")));
        }
        if let Some(b) = step
            .block_tables
            .iter()
            .find(|&&b| b as usize >= num_blocks)
        {
            return Err(bad(format!(
                "block {b} is outside the pool's {num_blocks} blocks"
            )));
        }
        if let Some(r) = step.logit_rows.iter().find(|&&r| r as usize >= t) {
            return Err(bad(format!(
                "logit row {r} is beyond the step's {t} tokens"
            )));
        }
        let mut next = 0u32;
        for (i, s) in step.seqs.iter().enumerate() {
            if s.q_row != next || s.n_q == 0 {
                return Err(bad(format!(
                    "sequence {i}: rows must follow each other and be non-empty"
                )));
            }
            next += s.n_q;
            let end = s.start_pos as usize + s.n_q as usize;
            if pool.is_some() && end.div_ceil(block_size) > mb {
                return Err(bad(format!(
                    "sequence {i}: {end} positions need more than its {mb} blocks"
                )));
            }
        }
        if nseq > 0 && next as usize != t {
            return Err(bad("the sequences do not cover the step's tokens".into()));
        }
        let chunked = step.seqs.iter().any(|s| s.n_q > 1);
        // Without a pool or without sequences there is nothing to attend: token ops only.
        if pool.is_none() || nseq == 0 {
            let mut p = StepPlan {
                n_tokens: t,
                n_logit_rows: step.logit_rows.len(),
                max_blocks: mb,
                max_position: step.positions.iter().copied().max().unwrap_or(0),
                ..Default::default()
            };
            let d = &mut p.data;
            p.tokens = push(d, step.tokens.iter().map(|&v| v as i32));
            p.positions = push(d, step.positions.iter().map(|&v| v as i32));
            p.slots = push(d, step.slot_mapping.iter().map(|&v| v as i32));
            p.logit_rows = push(d, step.logit_rows.iter().map(|&v| v as i32));
            return Ok(p);
        }
        let path = if chunked && block_size.is_multiple_of(128) && !token_wise {
            AttnPath::Prompt {
                s_max: step.seqs.iter().map(|s| s.n_q as usize).max().unwrap_or(1),
            }
        } else {
            AttnPath::TokenWise
        };

        let mut p = StepPlan {
            n_tokens: t,
            n_logit_rows: step.logit_rows.len(),
            max_blocks: mb,
            block_size,
            path: Some(path),
            max_position: step.positions.iter().copied().max().unwrap_or(0),
            ..Default::default()
        };
        let d = &mut p.data;
        p.tokens = push(d, step.tokens.iter().map(|&v| v as i32));
        p.positions = push(d, step.positions.iter().map(|&v| v as i32));
        p.slots = push(d, step.slot_mapping.iter().map(|&v| v as i32));
        p.logit_rows = push(d, step.logit_rows.iter().map(|&v| v as i32));
        match path {
            AttnPath::TokenWise if !chunked => {
                p.tables = push(d, step.block_tables.iter().map(|&v| v as i32));
                p.batch = nseq;
                p.q_lens = vec![1; nseq];
                p.kv_lens = step.seqs.iter().map(|s| s.start_pos as i64 + 1).collect();
            }
            AttnPath::TokenWise => {
                p.tables = align(d);
                for (i, s) in step.seqs.iter().enumerate() {
                    let row = &step.block_tables[i * mb..(i + 1) * mb];
                    for j in 0..s.n_q {
                        d.extend(row.iter().map(|&v| v as i32));
                        p.kv_lens.push(s.start_pos as i64 + j as i64 + 1);
                    }
                }
                p.batch = t;
                p.q_lens = vec![1; t];
            }
            AttnPath::Prompt { s_max } => {
                p.tables = push(d, step.block_tables.iter().map(|&v| v as i32));
                p.batch = nseq;
                p.q_lens = step.seqs.iter().map(|s| s.n_q as i64).collect();
                p.kv_lens = step
                    .seqs
                    .iter()
                    .map(|s| (s.start_pos + s.n_q) as i64)
                    .collect();
                p.pad_rows = align(d);
                for s in &step.seqs {
                    for j in 0..s_max as u32 {
                        // Padding rows repeat the sequence's first row (their results are unused).
                        let row = if j < s.n_q { s.q_row + j } else { s.q_row };
                        d.push(row as i32);
                    }
                }
                p.unpad_rows = align(d);
                for (b, s) in step.seqs.iter().enumerate() {
                    for j in 0..s.n_q as usize {
                        d.push((b * s_max + j) as i32);
                    }
                }
            }
        }
        p.groups = groups(&p.kv_lens, block_size, num_blocks);
        Ok(p)
    }

    /// A decode-only step (one token per sequence) in the form a captured graph replays: the
    /// same arrays, but every entry's KV length the tables' reach (`max_blocks · block_size`)
    /// with a key mask (1 past the entry's own length) packed behind them, and the rotary
    /// rows sized for the tables' last position. What attention's first phase takes on the host
    /// then depends on the step's shape alone.
    pub fn graph_form(
        step: &StepInputs,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, BackendError> {
        if step.seqs.is_empty() || step.seqs.iter().any(|s| s.n_q != 1) {
            return Err(bad(
                "a captured step is decode-only: one new token per sequence".into(),
            ));
        }
        let mut p = Self::new(step, num_blocks, block_size)?;
        let width = p.mask_width();
        let real = std::mem::replace(&mut p.kv_lens, vec![width as i64; p.batch]);
        let mut m = vec![0u8; p.batch * width];
        for (row, &l) in m.chunks_exact_mut(width).zip(&real) {
            row[l as usize..].fill(1);
        }
        let at = align(&mut p.data);
        p.data.extend(m.chunks(4).map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            i32::from_le_bytes(b)
        }));
        p.length_mask = Some(at);
        p.max_position = width.saturating_sub(1) as u32;
        p.groups = groups(&p.kv_lens, block_size, num_blocks);
        Ok(p)
    }

    /// The packed arrays as bytes.
    pub fn bytes(&self) -> Vec<u8> {
        self.data.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// Bytes of one entry's key mask: the block table's reach (at least maxBlockNumPerSeq ·
    /// blockSize, as the incremental branch requires of a mask with page attention).
    pub fn mask_width(&self) -> usize {
        self.max_blocks * self.block_size
    }

    /// The token-wise path's key mask for a window of `window` positions: per batch entry
    /// [`Self::mask_width`] bytes, 1 for the keys before `kv_len − window` (outside the window of
    /// the entry's query at position `kv_len − 1`), 0 elsewhere. `None` when no entry reaches
    /// past its window (nothing to mask) or the step does not go token-wise.
    pub fn window_mask(&self, window: u32) -> Option<Vec<u8>> {
        if self.path != Some(AttnPath::TokenWise)
            || self.kv_lens.iter().all(|&l| l <= window as i64)
        {
            return None;
        }
        let width = self.mask_width();
        let mut m = vec![0u8; self.kv_lens.len() * width];
        for (row, &l) in m.chunks_exact_mut(width).zip(&self.kv_lens) {
            let hidden = (l - window as i64).max(0) as usize;
            row[..hidden.min(width)].fill(1);
        }
        Some(m)
    }

    /// Packs the key masks of `windows` (those [`Self::window_mask`] gives) into the step's data,
    /// so they go up with the step's one copy.
    pub fn pack_window_masks(&mut self, windows: &[u32]) {
        for &w in windows {
            if self.window_masks.iter().any(|&(x, _)| x == w) {
                continue;
            }
            if let Some(m) = self.window_mask(w) {
                let at = align(&mut self.data);
                self.data.extend(m.chunks(4).map(|c| {
                    let mut b = [0u8; 4];
                    b[..c.len()].copy_from_slice(c);
                    i32::from_le_bytes(b)
                }));
                self.window_masks.push((w, at));
            }
        }
    }
}

/// Batch entries split into runs whose blocks add up to at most the pool's `num_blocks`.
fn groups(kv_lens: &[i64], block_size: usize, num_blocks: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut used = 0;
    for (i, &len) in kv_lens.iter().enumerate() {
        let need = (len as usize).div_ceil(block_size);
        if used + need > num_blocks && i > start {
            out.push(start..i);
            start = i;
            used = 0;
        }
        used += need;
    }
    out.push(start..kv_lens.len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use npu_backend::SeqSpan;

    fn step(seqs: &[(u32, u32)], block_size: u32) -> StepInputs {
        let mut s = StepInputs {
            max_blocks: 4,
            ..Default::default()
        };
        let mut row = 0;
        for (i, &(start, n)) in seqs.iter().enumerate() {
            s.seqs.push(SeqSpan {
                q_row: row,
                n_q: n,
                start_pos: start,
            });
            let table = [
                i as u32 * 4,
                i as u32 * 4 + 1,
                i as u32 * 4 + 2,
                i as u32 * 4 + 3,
            ];
            s.block_tables.extend(table);
            for j in 0..n {
                let pos = start + j;
                s.tokens.push(7);
                s.positions.push(pos);
                s.slot_mapping
                    .push(table[(pos / block_size) as usize] * block_size + pos % block_size);
            }
            row += n;
            s.logit_rows.push(row - 1);
        }
        s
    }

    #[test]
    fn decode_steps_use_the_tables_as_they_come() {
        let p = StepPlan::new(&step(&[(5, 1), (9, 1)], 16), 16, 16).unwrap();
        assert_eq!(p.path, Some(AttnPath::TokenWise));
        assert_eq!((p.batch, p.kv_lens.clone()), (2, vec![6, 10]));
        assert_eq!(&p.data[p.tables..p.tables + 8], &[0, 1, 2, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn a_token_wise_plan_takes_chunks_token_wise_at_any_block_size() {
        let st = step(&[(3, 2), (9, 1)], 128);
        assert!(matches!(
            StepPlan::new(&st, 16, 128).unwrap().path,
            Some(AttnPath::Prompt { s_max: 2 })
        ));
        let p = StepPlan::token_wise(&st, 16, 128).unwrap();
        assert_eq!(p.path, Some(AttnPath::TokenWise));
        assert_eq!((p.batch, p.kv_lens.clone()), (3, vec![4, 5, 10]));
        assert_eq!(&p.data[p.tables + 4..p.tables + 8], &[0, 1, 2, 3]);
    }

    #[test]
    fn chunks_with_small_blocks_go_token_wise() {
        let p = StepPlan::new(&step(&[(3, 2), (9, 1)], 16), 16, 16).unwrap();
        assert_eq!(p.path, Some(AttnPath::TokenWise));
        assert_eq!((p.batch, p.kv_lens.clone()), (3, vec![4, 5, 10]));
        assert_eq!(&p.data[p.tables + 4..p.tables + 8], &[0, 1, 2, 3]);
        assert_eq!(&p.data[p.tables + 8..p.tables + 12], &[4, 5, 6, 7]);
        assert_eq!(p.groups, vec![0..3]);
        // Token entries re-reading a sequence's blocks may add up to more than the pool:
        // they are split into calls that each stay within it.
        let p = StepPlan::new(&step(&[(30, 3)], 16), 4, 16).unwrap();
        assert_eq!(p.kv_lens, vec![31, 32, 33]);
        assert_eq!(p.groups, vec![0..2, 2..3]);
    }

    #[test]
    fn chunks_with_128_blocks_go_through_the_prompt_branch() {
        let p = StepPlan::new(&step(&[(3, 3), (9, 1)], 128), 16, 128).unwrap();
        assert_eq!(p.path, Some(AttnPath::Prompt { s_max: 3 }));
        assert_eq!(p.q_lens, vec![3, 1]);
        assert_eq!(p.kv_lens, vec![6, 10]);
        assert_eq!(&p.data[p.pad_rows..p.pad_rows + 6], &[0, 1, 2, 3, 3, 3]);
        assert_eq!(&p.data[p.unpad_rows..p.unpad_rows + 4], &[0, 1, 2, 3]);
    }

    #[test]
    fn without_a_pool_only_the_token_arrays_are_packed() {
        let s = step(&[(3, 2), (9, 1)], 16);
        let p = StepPlan::without_kv(&s).unwrap();
        assert_eq!(p.path, None);
        assert_eq!(&p.data[p.positions..p.positions + 3], &[3, 4, 9]);
        assert_eq!(&p.data[p.logit_rows..p.logit_rows + 2], &[1, 2]);
    }

    #[test]
    fn a_step_of_tokens_without_sequences_has_no_attention() {
        let mut s = step(&[(3, 2)], 16);
        s.seqs.clear();
        s.block_tables.clear();
        s.logit_rows.clear();
        let p = StepPlan::new(&s, 16, 16).unwrap();
        assert_eq!((p.path, p.n_tokens), (None, 2));
    }

    #[test]
    fn window_masks_hide_the_keys_before_each_entrys_window() {
        // Token-wise: a 3-token chunk at positions 30..33 and a decode token at 9.
        let mut p = StepPlan::new(&step(&[(30, 3), (9, 1)], 16), 16, 16).unwrap();
        assert_eq!(p.kv_lens, vec![31, 32, 33, 10]);
        assert_eq!(p.mask_width(), 64);
        assert_eq!(p.window_mask(40), None, "every entry fits in the window");
        let m = p.window_mask(8).unwrap();
        for (e, &l) in p.kv_lens.iter().enumerate() {
            let row = &m[e * 64..(e + 1) * 64];
            let hidden = (l as usize).saturating_sub(8);
            assert!(row[..hidden].iter().all(|&b| b == 1), "entry {e}");
            assert!(row[hidden..].iter().all(|&b| b == 0), "entry {e}");
        }
        let before = p.data.len().next_multiple_of(ALIGN_ELEMS);
        p.pack_window_masks(&[8, 40, 8]);
        assert_eq!(p.window_masks, vec![(8, before)]);
        let packed: Vec<u8> = p.data[before..]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(&packed[..m.len()], &m[..]);
        // The prompt branch takes band mode instead: no key masks.
        let p = StepPlan::new(&step(&[(30, 3), (9, 1)], 128), 16, 128).unwrap();
        assert_eq!(p.window_mask(8), None);
    }

    #[test]
    fn every_packed_array_starts_32_bytes_aligned() {
        // Odd lengths everywhere (3 tokens, 2 logit rows), so back-to-back packing would
        // misalign every later array.
        let check = |p: &StepPlan, what: &str| {
            let mut offsets = vec![p.tokens, p.positions, p.slots, p.logit_rows];
            if p.path.is_some() {
                offsets.push(p.tables);
            }
            if matches!(p.path, Some(AttnPath::Prompt { .. })) {
                offsets.extend([p.pad_rows, p.unpad_rows]);
            }
            offsets.extend(p.window_masks.iter().map(|&(_, at)| at));
            for at in offsets {
                assert_eq!((at * 4) % 32, 0, "{what}: offset {at} elements");
                assert!(at <= p.data.len(), "{what}: offset {at} past the data");
            }
        };
        let s = step(&[(30, 2), (9, 1)], 16);
        check(&StepPlan::without_kv(&s).unwrap(), "without a pool");
        let mut p = StepPlan::new(&s, 16, 16).unwrap();
        p.pack_window_masks(&[8, 4]);
        assert_eq!(p.window_masks.len(), 2);
        check(&p, "token-wise with masks");
        check(
            &StepPlan::new(&step(&[(5, 1), (9, 1), (2, 1)], 16), 16, 16).unwrap(),
            "decode",
        );
        let p = StepPlan::new(&step(&[(3, 3), (9, 1)], 128), 16, 128).unwrap();
        check(&p, "prompt");
        // The values are where the offsets say.
        assert_eq!(&p.data[p.positions..p.positions + 4], &[3, 4, 5, 9]);
        assert_eq!(&p.data[p.unpad_rows..p.unpad_rows + 4], &[0, 1, 2, 3]);
    }

    #[test]
    fn the_graph_form_masks_past_each_length_instead_of_passing_it() {
        let s = step(&[(5, 1), (9, 1)], 16);
        let p = StepPlan::graph_form(&s, 16, 16).unwrap();
        assert_eq!(p.kv_lens, vec![64, 64]);
        assert_eq!(p.max_position, 63);
        let at = p.length_mask.unwrap();
        assert_eq!((at * 4) % 32, 0);
        let bytes: Vec<u8> = p.data[at..].iter().flat_map(|v| v.to_le_bytes()).collect();
        for (e, real) in [6usize, 10].into_iter().enumerate() {
            let row = &bytes[e * 64..(e + 1) * 64];
            assert!(row[..real].iter().all(|&b| b == 0), "entry {e}");
            assert!(row[real..].iter().all(|&b| b == 1), "entry {e}");
        }
        // The same shape with other lengths packs to the same size (one graph replays both).
        let q = StepPlan::graph_form(&step(&[(40, 1), (0, 1)], 16), 16, 16).unwrap();
        assert_eq!(q.data.len(), p.data.len());
        assert!(StepPlan::graph_form(&step(&[(3, 2)], 16), 16, 16).is_err());
    }

    #[test]
    fn inconsistent_steps_are_refused() {
        let mut s = step(&[(3, 2)], 16);
        s.slot_mapping[0] = 10_000;
        assert!(StepPlan::new(&s, 16, 16).is_err());
        let mut s = step(&[(3, 2)], 16);
        s.seqs[0].n_q = 1;
        assert!(StepPlan::new(&s, 16, 16).is_err());
        let mut s = step(&[(3, 2)], 16);
        s.logit_rows = vec![2];
        assert!(StepPlan::new(&s, 16, 16).is_err());
    }
}

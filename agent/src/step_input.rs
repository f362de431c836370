//! Where a step plan becomes the device's step inputs: one pass over the plan where it lies (the
//! shared-memory segment, or a plan built in this process) fills the backend's `StepInputs` and
//! the per-sequence facts the engine needs (slot, prompt tokens, which logit row samples for
//! which slot), and checks everything the model and the KV pool rely on, once: capacities,
//! admitted slots used once each, positions, block tables within the pool covering every new
//! token, slot mapping consistent with the block table (through the long-context layout's ring
//! when that mode is on, with chunks that fit it), token ids within the vocabulary, logit rows.
//! Nothing downstream checks a step again.

use npu_backend::{SeqSpan, StepInputs};
use npu_protocol::{LongContextLayout, PlanSource, MAX_DRAFT_TOKENS, MAX_STEP_DRAFT_TOKENS};
use thiserror::Error;

/// What a step may hold, fixed when the engine is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLimits {
    pub max_tokens: usize,
    pub max_slots: usize,
    pub max_blocks_per_seq: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub vocab: usize,
    /// Long-context mode: block tables and slot mappings follow this layout.
    pub long_context: Option<LongContextLayout>,
}

#[derive(Debug, Error, PartialEq, Eq)]
#[error("bad step plan: {0}")]
pub struct StepError(pub String);

/// One sequence of the step, as the engine needs it besides the device inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqFacts {
    pub slot: u32,
    /// Leading tokens of its new tokens that are prompt.
    pub n_prompt: u32,
    /// Trailing tokens of its new tokens that are drafts (speculative decoding).
    pub n_draft: u32,
}

/// A sequence that samples in the step: its logit rows are `first_row..first_row + n_draft + 1`
/// (one after its last real token, then one after each draft).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplingSeq {
    /// Index into `StepRead::seqs` (and `inputs.seqs`).
    pub seq: usize,
    pub slot: u32,
    pub first_row: usize,
    pub n_draft: u32,
}

/// A step read from a plan: the device inputs and, per sequence and per logit row, what the
/// engine needs to keep histories and sample. Reused from step to step.
#[derive(Debug, Default, Clone)]
pub struct StepRead {
    pub inputs: StepInputs,
    /// Parallel to `inputs.seqs`.
    pub seqs: Vec<SeqFacts>,
    /// Parallel to `inputs.logit_rows`: the slot each logit row samples for.
    pub logit_slots: Vec<u32>,
    /// The sequences that sample, in plan order, with their logit rows.
    pub sampling: Vec<SamplingSeq>,
}

impl StepRead {
    /// The new tokens of sequence `i`.
    pub fn tokens(&self, i: usize) -> &[u32] {
        let s = &self.inputs.seqs[i];
        &self.inputs.tokens[s.q_row as usize..(s.q_row + s.n_q) as usize]
    }

    /// The drafted tokens of sequence `i` (its last `n_draft` new tokens).
    pub fn drafts(&self, i: usize) -> &[u32] {
        let t = self.tokens(i);
        &t[t.len() - self.seqs[i].n_draft as usize..]
    }

    /// Reads and checks the sequences of `plan` (forget and admit already applied:
    /// `admitted(slot)` says which slots hold a request). On error the contents are unspecified.
    pub fn read(
        &mut self,
        plan: &dyn PlanSource,
        lim: &StepLimits,
        admitted: impl Fn(u32) -> bool,
    ) -> Result<(), StepError> {
        self.read_skipping(plan, lim, admitted, |_| false)
    }

    /// `read`, leaving out the sequences of the slots `skipped` names (requests whose
    /// admission failed: none of their tokens run this step). The rest may be none.
    pub fn read_skipping(
        &mut self,
        plan: &dyn PlanSource,
        lim: &StepLimits,
        admitted: impl Fn(u32) -> bool,
        skipped: impl Fn(u32) -> bool,
    ) -> Result<(), StepError> {
        let bad = |s: String| Err(StepError(s));
        let n_tokens = plan.n_tokens();
        if n_tokens == 0 {
            return bad("a step with sequences needs at least one token".into());
        }
        if n_tokens > lim.max_tokens {
            return bad(format!(
                "{n_tokens} tokens exceed the step capacity {}",
                lim.max_tokens
            ));
        }
        let n_seqs = plan.n_seqs();
        let max_blocks = (0..n_seqs)
            .map(|i| plan.seq(i).block_table.len())
            .max()
            .unwrap_or(0);
        if max_blocks > lim.max_blocks_per_seq {
            return bad(format!(
                "a block table of {max_blocks} blocks exceeds {}",
                lim.max_blocks_per_seq
            ));
        }
        let m = &mut self.inputs;
        m.tokens.clear();
        m.positions.clear();
        m.slot_mapping.clear();
        m.seqs.clear();
        m.block_tables.clear();
        m.logit_rows.clear();
        m.max_blocks = max_blocks;
        self.seqs.clear();
        self.logit_slots.clear();
        self.sampling.clear();
        let mut n_draft_total = 0usize;
        let mut seen = vec![false; lim.max_slots];
        let bs = lim.block_size as u64;
        for i in 0..n_seqs {
            let seq = plan.seq(i);
            let slot = seq.slot as usize;
            if slot < lim.max_slots && skipped(seq.slot) {
                if std::mem::replace(&mut seen[slot], true) {
                    return bad(format!("slot {} appears twice in one step", seq.slot));
                }
                continue;
            }
            if slot >= lim.max_slots || !admitted(seq.slot) {
                return bad(format!("sequence {i}: slot {} was not admitted", seq.slot));
            }
            if std::mem::replace(&mut seen[slot], true) {
                return bad(format!("slot {} appears twice in one step", seq.slot));
            }
            let n = seq.tokens.len();
            if n == 0 || seq.slot_mapping.len() != n || seq.n_prompt_tokens as usize > n {
                return bad(format!(
                    "sequence {i}: {n} tokens, {} slot mappings, {} prompt tokens",
                    seq.slot_mapping.len(),
                    seq.n_prompt_tokens
                ));
            }
            let n_draft = seq.n_draft as usize;
            if n_draft > 0
                && (!seq.sample
                    || n_draft > MAX_DRAFT_TOKENS
                    || n_draft >= n
                    || seq.n_prompt_tokens as usize > n - n_draft
                    || lim.long_context.is_some())
            {
                return bad(format!(
                    "sequence {i}: {n_draft} drafted tokens with {n} tokens, {} of them prompt, \
                     sample {} (drafts follow a real token, at most {MAX_DRAFT_TOKENS}, only \
                     when sampling, not in long-context mode)",
                    seq.n_prompt_tokens, seq.sample
                ));
            }
            n_draft_total += n_draft;
            if n_draft_total > MAX_STEP_DRAFT_TOKENS {
                return bad(format!(
                    "more than {MAX_STEP_DRAFT_TOKENS} drafted tokens in one step"
                ));
            }
            let start = seq.start_pos as u64;
            let end = start + n as u64;
            if end > u32::MAX as u64 {
                return bad(format!("sequence {i}: positions beyond 32 bits"));
            }
            let table = seq.block_table;
            let blocks_needed = match &lim.long_context {
                Some(l) => {
                    if n as u64 > l.max_chunk(start) {
                        return bad(format!(
                            "sequence {i}: {n} tokens from position {start} overrun the \
                             long-context ring (at most {})",
                            l.max_chunk(start)
                        ));
                    }
                    l.table_len(end) as u64
                }
                None => end.div_ceil(bs),
            };
            if blocks_needed > table.len() as u64 {
                return bad(format!(
                    "sequence {i}: {end} positions need more than its {} blocks",
                    table.len()
                ));
            }
            let q_row = m.tokens.len() as u32;
            for (j, (tok, mapped)) in seq.tokens.iter().zip(seq.slot_mapping.iter()).enumerate() {
                if tok as usize >= lim.vocab {
                    return bad(format!(
                        "sequence {i}: token id {tok} is beyond the vocabulary ({})",
                        lim.vocab
                    ));
                }
                let pos = start + j as u64;
                let want = match &lim.long_context {
                    Some(l) => table
                        .get(l.table_index(pos / bs))
                        .map_or(u64::MAX, |b| b as u64 * bs + pos % bs),
                    None => {
                        // In range: pos < end <= table.len() * bs.
                        let block = table.get((pos / bs) as usize).unwrap_or(u32::MAX) as u64;
                        block * bs + pos % bs
                    }
                };
                if mapped as u64 != want {
                    return bad(format!(
                        "sequence {i}: token {j} maps to slot {mapped} but its block table gives \
                         {want}"
                    ));
                }
                m.tokens.push(tok);
                m.positions.push(pos as u32);
                m.slot_mapping.push(mapped);
            }
            for b in table.iter() {
                if b as usize >= lim.num_blocks {
                    return bad(format!(
                        "sequence {i}: block {b} is beyond the KV pool ({} blocks)",
                        lim.num_blocks
                    ));
                }
                m.block_tables.push(b);
            }
            m.block_tables
                .extend(std::iter::repeat_n(0, max_blocks - table.len()));
            m.seqs.push(SeqSpan {
                q_row,
                n_q: n as u32,
                start_pos: seq.start_pos,
            });
            self.seqs.push(SeqFacts {
                slot: seq.slot,
                n_prompt: seq.n_prompt_tokens,
                n_draft: seq.n_draft,
            });
            if seq.sample {
                self.sampling.push(SamplingSeq {
                    seq: self.seqs.len() - 1,
                    slot: seq.slot,
                    first_row: m.logit_rows.len(),
                    n_draft: seq.n_draft,
                });
                for r in (n - 1 - n_draft)..n {
                    m.logit_rows.push(q_row + r as u32);
                    self.logit_slots.push(seq.slot);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;

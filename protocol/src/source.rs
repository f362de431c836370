//! Reading a step plan where it lies: `PlanSource` is what an agent reads a step from, whether
//! the plan sits in the shared-memory segment (`shm::PlanView`, values read straight out of the
//! mapping) or in a `StepPlan` built in the same process. The agent turns either into its
//! device's step inputs in one pass and checks it there, once.

use crate::step::{Admission, KvCopy, StepPlan, TokenMask};

/// A run of u32 values: little-endian bytes in the segment, or a slice in memory.
#[derive(Debug, Clone, Copy)]
pub enum U32s<'a> {
    Le(&'a [u8]),
    Slice(&'a [u32]),
}

impl<'a> U32s<'a> {
    pub fn len(&self) -> usize {
        match self {
            Self::Le(b) => b.len() / 4,
            Self::Slice(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn get(&self, i: usize) -> Option<u32> {
        match self {
            Self::Le(b) => b
                .get(i.checked_mul(4)?..i.checked_mul(4)?.checked_add(4)?)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            Self::Slice(s) => s.get(i).copied(),
        }
    }
    pub fn iter(&self) -> impl Iterator<Item = u32> + 'a {
        let (le, slice) = match *self {
            Self::Le(b) => (Some(b), None),
            Self::Slice(s) => (None, Some(s)),
        };
        let le = le.into_iter().flat_map(|b| {
            b.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        });
        le.chain(slice.into_iter().flatten().copied())
    }
    pub fn to_vec(&self) -> Vec<u32> {
        self.iter().collect()
    }
}

/// One sequence's share of a step, borrowed from where the plan lies (see `SeqStep`).
#[derive(Debug, Clone, Copy)]
pub struct SeqRef<'a> {
    pub slot: u32,
    pub tokens: U32s<'a>,
    pub start_pos: u32,
    pub block_table: U32s<'a>,
    pub slot_mapping: U32s<'a>,
    pub sample: bool,
    pub n_prompt_tokens: u32,
    pub n_draft: u32,
}

/// A step plan an agent can read: the same content as `StepPlan`, wherever it lies. A source
/// guarantees its structure only (counts, offsets, one slot-mapping entry per token, prompt
/// tokens within the tokens, slots below the segment's `max_slots`); what a plan means for the
/// agent's model and KV pool is checked by the agent.
pub trait PlanSource {
    fn step_id(&self) -> u64;
    /// Slots to forget before this step.
    fn forget(&self) -> U32s<'_>;
    /// Slots admitted before this step.
    fn admissions(&self) -> &[Admission];
    /// KV block copies to do, in order, before the step's compute.
    fn kv_copies(&self) -> &[KvCopy];
    fn n_seqs(&self) -> usize;
    /// Sequence `i` (< `n_seqs()`).
    fn seq(&self, i: usize) -> SeqRef<'_>;
    /// New tokens over all sequences.
    fn n_tokens(&self) -> usize {
        (0..self.n_seqs()).map(|i| self.seq(i).tokens.len()).sum()
    }
    /// Number of token masks (constrained sequences sampling in this step).
    fn n_masks(&self) -> usize;
    /// Mask `i` (< `n_masks()`): its slot and words (no words while they follow the plan).
    fn mask(&self, i: usize) -> (u32, U32s<'_>);
    /// Whether the masks' words follow the plan (see [`StepPlan::masks_follow`]): whoever
    /// runs the step must get them before it samples.
    fn masks_follow(&self) -> bool;
    /// A `StepPlan` with the same content.
    fn to_plan(&self) -> StepPlan {
        StepPlan {
            step_id: self.step_id(),
            forget: self.forget().to_vec(),
            admit: self.admissions().to_vec(),
            kv_copies: self.kv_copies().to_vec(),
            seqs: (0..self.n_seqs())
                .map(|i| {
                    let s = self.seq(i);
                    crate::step::SeqStep {
                        slot: s.slot,
                        tokens: s.tokens.to_vec(),
                        start_pos: s.start_pos,
                        block_table: s.block_table.to_vec(),
                        slot_mapping: s.slot_mapping.to_vec(),
                        sample: s.sample,
                        n_prompt_tokens: s.n_prompt_tokens,
                        n_draft: s.n_draft,
                    }
                })
                .collect(),
            masks: (0..self.n_masks())
                .map(|i| {
                    let (slot, words) = self.mask(i);
                    TokenMask {
                        slot,
                        words: words.to_vec(),
                    }
                })
                .collect(),
        }
    }
}

impl PlanSource for StepPlan {
    fn step_id(&self) -> u64 {
        self.step_id
    }
    fn forget(&self) -> U32s<'_> {
        U32s::Slice(&self.forget)
    }
    fn admissions(&self) -> &[Admission] {
        &self.admit
    }
    fn kv_copies(&self) -> &[KvCopy] {
        &self.kv_copies
    }
    fn n_seqs(&self) -> usize {
        self.seqs.len()
    }
    fn seq(&self, i: usize) -> SeqRef<'_> {
        let s = &self.seqs[i];
        SeqRef {
            slot: s.slot,
            tokens: U32s::Slice(&s.tokens),
            start_pos: s.start_pos,
            block_table: U32s::Slice(&s.block_table),
            slot_mapping: U32s::Slice(&s.slot_mapping),
            sample: s.sample,
            n_prompt_tokens: s.n_prompt_tokens,
            n_draft: s.n_draft,
        }
    }
    fn n_tokens(&self) -> usize {
        StepPlan::n_tokens(self)
    }
    fn n_masks(&self) -> usize {
        self.masks.len()
    }
    fn mask(&self, i: usize) -> (u32, U32s<'_>) {
        let m = &self.masks[i];
        (m.slot, U32s::Slice(&m.words))
    }
    fn masks_follow(&self) -> bool {
        StepPlan::masks_follow(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn little_endian_and_slices_read_alike() {
        let values = [1u32, 0xdead_beef, 7];
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let (le, sl) = (U32s::Le(&bytes), U32s::Slice(&values));
        assert_eq!(le.len(), 3);
        assert_eq!(le.to_vec(), sl.to_vec());
        assert_eq!(le.get(1), Some(0xdead_beef));
        assert_eq!(le.get(3), None);
        assert_eq!(le.get(usize::MAX), None);
    }
}

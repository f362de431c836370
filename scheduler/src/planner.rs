//! Building one step plan: decode tokens of running sequences first (preempting the newest
//! sequence when a decode token finds no free block), then the next prefill chunks of sequences
//! already admitted, then FCFS admission of waiting requests under the slot, batch, block and
//! token-budget limits (or, with the static policy, whole batches). The KV copies that
//! preemption, admission and eviction queued go into the plan in the order they were made.

use npu_protocol::{Admission, SeqStep, StepPlan, MAX_STEP_DRAFT_TOKENS};

use super::config::BatchingPolicy;
use super::prefix_cache::Tier;
use super::speculative::{ngram_draft, SpeculativeConfig};
use super::{Planned, Scheduler};
use crate::types::RequestId;

impl Scheduler {
    /// The next step, or None when there is nothing to send. Every block a scheduled token
    /// needs is allocated before the plan is returned.
    pub fn schedule(&mut self) -> Option<StepPlan> {
        let step_id = self.next_step_id;
        let mut budget = self.cfg.max_tokens_per_step;
        let mut steps: Vec<SeqStep> = Vec::new();
        let mut planned: Vec<Planned> = Vec::new();

        // 1. One decode token for each running sequence that is decoding, oldest first, and
        //    with speculative decoding, while few enough decode, the drafts that follow it.
        let decoding = self.decoding();
        let speculative = self.cfg.speculative.filter(|s| decoding <= s.max_batch);
        if let Some(sp) = speculative {
            self.draft_threshold = self
                .step_cost
                .break_even(decoding)
                .map_or(sp.min_acceptance, |b| b.max(sp.min_acceptance));
        }
        let mut draft_budget = MAX_STEP_DRAFT_TOKENS;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            let busy = seq.admitted.as_ref().is_some_and(|a| a.in_flight.is_some());
            if busy || seq.remaining() != 1 {
                i += 1;
                continue;
            }
            let end = seq.total_len();
            if !self.grow_table_preempting(id, end) {
                // It was the newest and gave up its own blocks (so it left `running`).
                if self.running.get(i) == Some(&id) {
                    i += 1;
                }
                continue;
            }
            let draft = match speculative {
                Some(sp) => self.draft(id, &sp, (budget - 1).min(draft_budget)),
                None => Vec::new(),
            };
            self.emit_with_drafts(step_id, id, 1, &draft, &mut steps, &mut planned);
            budget -= 1 + draft.len();
            draft_budget -= draft.len();
            i += 1;
        }

        // 2. The next chunk of each sequence in the middle of its prefill, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            i += 1;
            let seq = &self.seqs[&id];
            let busy = seq.admitted.as_ref().is_some_and(|a| a.in_flight.is_some());
            if busy || seq.remaining() <= 1 {
                continue;
            }
            let n = self.chunk(id, seq.remaining().min(budget));
            let seq = &self.seqs[&id];
            if self.grow_table(id, seq.num_computed() + n) {
                self.emit(step_id, id, n, &mut steps, &mut planned);
                budget -= n;
            }
        }

        // 3. Admission, strictly FCFS: when the oldest waiting request cannot be admitted, no
        //    other is.
        let mut admit = Vec::new();
        let forming_batch = self.static_batch.is_empty();
        while let Some(&id) = self.waiting.front() {
            if self.running.len() >= self.cfg.max_running || self.free_slots.is_empty() {
                break;
            }
            match self.cfg.policy {
                BatchingPolicy::Continuous => {
                    if budget == 0 || admit.len() >= self.cfg.max_new_prompts_per_step {
                        break;
                    }
                }
                BatchingPolicy::Static => {
                    if !forming_batch && !self.static_batch.contains(&id) {
                        break;
                    }
                }
            }
            if !self.lora_fits(id) {
                // Every adapter slot is taken by running requests: it waits (FCFS holds).
                break;
            }
            let Some(slot) = self.try_admit(id) else {
                break;
            };
            if self.cfg.policy == BatchingPolicy::Static {
                self.static_batch.insert(id);
            }
            admit.push(Admission {
                slot,
                params: self.seqs[&id].params().clone(),
                lora: self.seqs[&id].lora.clone(),
            });
            if budget > 0 {
                let n = self.chunk(id, self.seqs[&id].remaining().min(budget));
                self.emit(step_id, id, n, &mut steps, &mut planned);
                budget -= n;
            }
        }

        // Slots released since the last plan are forgotten by this one; reusable after it.
        let forget = std::mem::take(&mut self.pending_forget);
        let kv_copies = self.blocks.take_copies();
        if steps.is_empty() && admit.is_empty() && forget.is_empty() && kv_copies.is_empty() {
            return None;
        }
        self.free_slots.extend(forget.iter().copied());
        self.next_step_id += 1;
        self.in_flight.insert(step_id, planned);
        if !kv_copies.is_empty() {
            self.in_flight_copies.insert(step_id, kv_copies.clone());
        }
        Some(StepPlan {
            step_id,
            forget,
            admit,
            kv_copies,
            seqs: steps,
            masks: Vec::new(),
        })
    }

    /// Admits the oldest waiting request if a slot and the blocks for its whole prefill (less
    /// its cached prefix) are available; returns its slot.
    fn try_admit(&mut self, id: RequestId) -> Option<u32> {
        if self.seqs[&id].swapped.is_some() {
            return self.try_admit_swapped(id);
        }
        let bs = self.cfg.block_size;
        let seq = &self.seqs[&id];
        let total = seq.total_len();
        // Reuse only full blocks before the last token: that one is always computed, so that
        // there are logits to sample, and it is written into a private block.
        let max_hit = ((total - 1) / bs)
            .min(self.cfg.max_blocks_per_seq)
            .min(reusable_blocks(seq, bs));
        let mut hit = if self.blocks.caching() {
            self.blocks
                .find_prefix(&seq.all_tokens(), seq.lora_id(), max_hit)
        } else {
            Default::default()
        };
        // Host-tier blocks come back by copy when the plan has room and copying beats
        // recomputing them; otherwise the hit ends before the first of them.
        let n_host = hit.n_host();
        if n_host > 0 && (n_host > self.blocks.copies_left() || !self.host_hit_pays(n_host)) {
            let first = hit.blocks.iter().position(|t| matches!(t, Tier::Host(_)));
            let blocks = &self.blocks;
            hit.truncate(first.unwrap_or(0), |b| blocks.refs(b));
        }
        let n_host = hit.n_host();
        let n_device = hit.blocks.len() - n_host;
        let need = self.blocks_for(total) - n_device;
        if need > self.blocks.num_available() - hit.revived {
            return None;
        }
        let slot = *self.free_slots.first()?;
        self.blocks.hold(&hit.blocks);
        let Some(fresh) = self.blocks.allocate_keeping_copies(need, n_host) else {
            self.blocks.unhold(&hit.blocks);
            return None;
        };
        self.free_slots.remove(&slot);
        let mut fresh = fresh.into_iter();
        let mut blocks = Vec::with_capacity(need + n_device);
        for t in &hit.blocks {
            match *t {
                Tier::Device(b) => blocks.push(b),
                Tier::Host(h) => {
                    let d = fresh.next().expect("a device block for every host hit");
                    self.blocks.bring_back(h, d);
                    blocks.push(d);
                }
            }
        }
        blocks.extend(fresh);
        let seq = self.seqs.get_mut(&id).expect("waiting request is known");
        let n_hit = hit.blocks.len();
        seq.incarnation += 1;
        seq.admitted = Some(super::request::Admitted {
            slot,
            blocks,
            num_computed: n_hit * bs,
            num_registered: n_hit,
            last_hash: hit.last_hash(),
            in_flight: None,
        });
        self.prefix_hit_tokens += (n_hit * bs) as u64;
        self.prefix_hit_tokens_host += (n_host * bs) as u64;
        if self.blocks.caching() {
            self.prefix_query_tokens += total as u64;
        }
        self.waiting.pop_front();
        self.running.push(id);
        Some(slot)
    }

    /// Grows a sequence's block table to cover positions `0..end` from available blocks only.
    fn grow_table(&mut self, id: RequestId, end: usize) -> bool {
        let bs = self.cfg.block_size;
        loop {
            let adm = self.seqs.get_mut(&id).and_then(|s| s.admitted.as_mut());
            let Some(adm) = adm else { return false };
            if adm.blocks.len() >= blocks_for(self.long_context.as_ref(), bs, end) {
                return true;
            }
            match self.blocks.allocate() {
                Some(b) => adm.blocks.push(b),
                None => return false,
            }
        }
    }

    /// Grows a sequence's block table to cover positions `0..end`, preempting the newest running
    /// sequence while no block is available. False when the sequence itself was preempted.
    /// Only sequences newer than `id` can be preempted, and none of those is in the plan yet.
    fn grow_table_preempting(&mut self, id: RequestId, end: usize) -> bool {
        while !self.grow_table(id, end) {
            let Some(&newest) = self.running.last() else {
                return false;
            };
            self.preempt(newest);
            if newest == id {
                return false;
            }
        }
        true
    }

    /// Blocks a sequence of `tokens` tokens holds.
    fn blocks_for(&self, tokens: usize) -> usize {
        blocks_for(self.long_context.as_ref(), self.cfg.block_size, tokens)
    }

    /// `n` new tokens of a sequence's prefill, capped in long-context mode so that the step
    /// fits its ring (see `LongContextLayout::max_chunk`).
    fn chunk(&self, id: RequestId, n: usize) -> usize {
        let (Some(l), Some(seq)) = (&self.long_context, self.seqs.get(&id)) else {
            return n;
        };
        let cap = l.max_chunk(seq.num_computed() as u64);
        n.min(usize::try_from(cap).unwrap_or(usize::MAX))
    }

    /// Adds the next `n` tokens of an admitted sequence to the plan.
    fn emit(
        &mut self,
        step_id: u64,
        id: RequestId,
        n: usize,
        steps: &mut Vec<SeqStep>,
        planned: &mut Vec<Planned>,
    ) {
        self.emit_with_drafts(step_id, id, n, &[], steps, planned);
    }

    /// Adds the next `n` tokens of an admitted sequence to the plan, then `draft` (guessed
    /// tokens after them, to verify; only for a sequence that samples after its `n` tokens,
    /// with its block table already covering them).
    fn emit_with_drafts(
        &mut self,
        step_id: u64,
        id: RequestId,
        n_real: usize,
        draft: &[u32],
        steps: &mut Vec<SeqStep>,
        planned: &mut Vec<Planned>,
    ) {
        let bs = self.cfg.block_size;
        let seq = self.seqs.get_mut(&id).expect("scheduled request is known");
        let total = seq.total_len();
        let n_prompt = seq.prompt_part(seq.num_computed(), n_real) as u32;
        let adm = seq
            .admitted
            .as_ref()
            .expect("scheduled request is admitted");
        let start = adm.num_computed;
        let n = n_real + draft.len();
        let end = start + n;
        let mut tokens = seq.tokens(start, start + n_real);
        tokens.extend_from_slice(draft);
        let block_table = adm.blocks[..blocks_for(self.long_context.as_ref(), bs, end)].to_vec();
        let slot_mapping = match &self.long_context {
            Some(l) => (start..end)
                .map(|pos| l.slot(&block_table, pos as u64).unwrap_or(u32::MAX))
                .collect(),
            None => (start..end)
                .map(|pos| block_table[pos / bs] * bs as u32 + (pos % bs) as u32)
                .collect(),
        };
        let sample = start + n_real == total;
        let slot = adm.slot;
        steps.push(SeqStep {
            slot,
            tokens,
            start_pos: start as u32,
            block_table,
            slot_mapping,
            sample,
            n_prompt_tokens: n_prompt,
            n_draft: draft.len() as u32,
        });
        planned.push(Planned {
            slot,
            id,
            incarnation: seq.incarnation,
            n_tokens: n,
            sample,
            n_draft: draft.len(),
        });
        if let Some(adm) = seq.admitted.as_mut() {
            adm.in_flight = Some(step_id);
        }
        self.scheduled_tokens += n as u64;
        // Everything but the one newest generated token of a decoding sequence is prefill (a
        // prompt, or tokens computed again after a preemption or recovery).
        if !(n_real == 1 && start >= seq.prompt_len()) {
            self.prefill_tokens += n_real as u64;
        }
        self.spec_drafted_tokens += draft.len() as u64;
    }

    /// Running sequences that decode in the next step (one token each, not in flight).
    fn decoding(&self) -> usize {
        self.running
            .iter()
            .filter(|id| {
                let s = &self.seqs[*id];
                s.remaining() == 1 && s.admitted.as_ref().is_some_and(|a| a.in_flight.is_none())
            })
            .count()
    }

    /// The drafts of a decoding sequence (its table already covering its next token): as many
    /// as its record says are worth verifying at this batch size (`DraftRecord::draft_len`),
    /// at most `cap`, what its limits leave room for, and what free blocks can hold (drafts
    /// never preempt). Empty when the request does not draft now.
    fn draft(&mut self, id: RequestId, sp: &SpeculativeConfig, cap: usize) -> Vec<u32> {
        let bs = self.cfg.block_size;
        let seq = &self.seqs[&id];
        if !seq.req.speculative || seq.params().top_n > 0 {
            return Vec::new();
        }
        let total = seq.total_len();
        // Every draft kept yields one more token: no more than the request may still make.
        let room = (seq.req.max_new_tokens as usize)
            .saturating_sub(seq.generated.len() + 1)
            .min(seq.max_total_len.saturating_sub(total + 1));
        let worth = seq.drafts.draft_len(
            self.draft_prior.rate(),
            self.draft_threshold,
            sp.num_speculative_tokens,
        );
        if worth == 0 {
            // Not worth it now: the request's record fades toward the prior until it is.
            if let Some(s) = self.seqs.get_mut(&id) {
                s.drafts.idle();
            }
            return Vec::new();
        }
        let k = worth.min(cap).min(room);
        if k == 0 {
            return Vec::new();
        }
        let mut draft = ngram_draft(
            &seq.all_tokens(),
            sp.prompt_lookup_min,
            sp.prompt_lookup_max,
            k,
        );
        if draft.is_empty() {
            return draft;
        }
        self.grow_table(id, total + draft.len());
        let covered = self.seqs[&id]
            .admitted
            .as_ref()
            .map_or(0, |a| a.blocks.len() * bs);
        draft.truncate(covered.saturating_sub(total));
        draft
    }
}

/// Blocks a sequence of `tokens` tokens holds: one per `bs` tokens, up to the budget in
/// long-context mode.
fn blocks_for(
    long_context: Option<&npu_protocol::LongContextLayout>,
    bs: usize,
    tokens: usize,
) -> usize {
    match long_context {
        Some(l) => l.table_len(tokens as u64),
        None => tokens.div_ceil(bs),
    }
}

/// How many leading blocks of a sequence may come from the prefix cache: those whose tokens the
/// agent does not need to see again (see `swap::history_free_tokens`).
fn reusable_blocks(seq: &super::request::Sequence, bs: usize) -> usize {
    super::swap::history_free_tokens(seq) / bs
}

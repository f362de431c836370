//! Preemption, by swapping or by recomputation, chosen per victim from measured costs: its
//! computed blocks copied out and back at the agent's measured block copy bandwidth, against
//! its computed tokens at the prefill rate measured from step results. Also the re-admission of
//! a swapped-out sequence (its blocks copied back before the step that continues it) and the
//! prefill-rate estimate.

use std::collections::HashSet;

use npu_protocol::{CopyDirection, KvCopy};

use super::request::{Admitted, Sequence, Swapped};
use super::Scheduler;
use crate::types::RequestId;

/// Steps with at least this many tokens measure the prefill rate.
const PREFILL_SAMPLE_TOKENS: usize = 32;

impl Scheduler {
    /// Preempts `id`: its KV goes to the host pool when that is possible and cheaper than
    /// recomputing it, otherwise it is dropped. Either way its device blocks and slot are freed
    /// and it goes to the front of the waiting queue, keeping its generated tokens.
    pub(crate) fn preempt(&mut self, id: RequestId) {
        let swapped = self.try_swap_out(id);
        self.release(id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.resumed = true;
            if swapped.is_some() {
                self.preemptions_swap += 1;
            }
            seq.swapped = swapped;
        }
        self.waiting.push_front(id);
        self.preemptions += 1;
    }

    fn try_swap_out(&mut self, id: RequestId) -> Option<Swapped> {
        let host = self.cfg.kv_host?;
        // A long-context sequence's blocks are a ring and a device cache whose host side lives in
        // the agent's slot: it is recomputed, never swapped.
        if self.long_context.is_some() {
            return None;
        }
        let bs = self.cfg.block_size;
        let seq = self.seqs.get(&id)?;
        let adm = seq.admitted.as_ref()?;
        let computed = adm.num_computed;
        if computed == 0 || computed > history_free_tokens(seq) {
            return None;
        }
        let n = computed.div_ceil(bs);
        if let Some(rate) = self.prefill_tok_per_s {
            if host.round_trip_s(n) >= computed as f64 / rate {
                return None;
            }
        }
        let table = adm.blocks[..n].to_vec();
        let (num_registered, last_hash) = (adm.num_registered.min(n), adm.last_hash);
        let host_blocks = self.blocks.swap_out(&table)?;
        self.swap_out_blocks += n as u64;
        Some(Swapped {
            host_blocks,
            num_computed: computed,
            num_registered,
            last_hash,
            handoff: false,
        })
    }

    /// Admits a swapped-out sequence (the oldest waiting one) when a slot, blocks for its whole
    /// context and room for its copies are free: its blocks come back before this step's
    /// compute. Returns its slot.
    pub(crate) fn try_admit_swapped(&mut self, id: RequestId) -> Option<u32> {
        let bs = self.cfg.block_size;
        let seq = &self.seqs[&id];
        let sw = seq.swapped.as_ref()?;
        let need = seq.total_len().div_ceil(bs);
        let n = sw.host_blocks.len();
        if need > self.blocks.num_available() || n > self.blocks.copies_left() {
            return None;
        }
        let slot = *self.free_slots.first()?;
        let fresh = self.blocks.allocate_keeping_copies(need, n)?;
        self.free_slots.remove(&slot);
        let seq = self.seqs.get_mut(&id).expect("waiting request is known");
        let sw = seq.swapped.take().expect("checked above");
        if sw.handoff {
            for (&h, &d) in sw.host_blocks.iter().zip(&fresh[..n]) {
                self.blocks.queue_copy(KvCopy::from_handoff(h, d));
            }
            self.handoff_in_blocks += n as u64;
            self.handoff_in_requests += 1;
        } else {
            self.blocks.swap_in(&sw.host_blocks, &fresh[..n]);
            self.swap_in_blocks += n as u64;
        }
        seq.incarnation += 1;
        seq.admitted = Some(Admitted {
            slot,
            blocks: fresh,
            num_computed: sw.num_computed,
            num_registered: sw.num_registered,
            last_hash: sw.last_hash,
            in_flight: None,
        });
        self.waiting.pop_front();
        self.running.push(id);
        Some(slot)
    }

    /// Whether bringing `blocks` of a prefix hit back from the host tier is cheaper than
    /// computing their tokens again (copying when no prefill rate is known yet).
    pub(crate) fn host_hit_pays(&self, blocks: usize) -> bool {
        match (self.cfg.kv_host, self.prefill_tok_per_s) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(h), Some(rate)) => {
                h.to_device_s(blocks) < (blocks * self.cfg.block_size) as f64 / rate
            }
        }
    }

    /// The copies of a failed step may not have run: their destinations hold unknown bytes.
    /// Cached content there is forgotten, swapped-out sequences whose host blocks were being
    /// written lose their swap (they will be recomputed), and admitted sequences reading a block
    /// being written are preempted for recomputation.
    pub(crate) fn distrust_copies(&mut self, copies: &[KvCopy]) {
        // Copies into the handoff region are the engine's to distrust (it owns those blocks).
        let host: HashSet<u32> = copies
            .iter()
            .filter(|c| c.direction == CopyDirection::DeviceToHost)
            .map(|c| c.host_block)
            .collect();
        let device: HashSet<u32> = copies
            .iter()
            .filter(|c| {
                matches!(
                    c.direction,
                    CopyDirection::HostToDevice | CopyDirection::HandoffToDevice
                )
            })
            .map(|c| c.device_block)
            .collect();
        let device_list: Vec<u32> = device.iter().copied().collect();
        let host_list: Vec<u32> = host.iter().copied().collect();
        self.blocks.forget_content(&device_list, &host_list);
        for id in self.waiting.clone() {
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue;
            };
            if seq
                .swapped
                .as_ref()
                .is_some_and(|sw| !sw.handoff && sw.host_blocks.iter().any(|h| host.contains(h)))
            {
                if let Some(sw) = seq.swapped.take() {
                    self.blocks.drop_swapped(&sw.host_blocks);
                }
            }
        }
        let readers: Vec<RequestId> = self
            .running
            .iter()
            .copied()
            .filter(|id| {
                self.seqs[id]
                    .admitted
                    .as_ref()
                    .is_some_and(|a| a.blocks.iter().any(|b| device.contains(b)))
            })
            .collect();
        for id in readers.into_iter().rev() {
            self.release(id);
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.resumed = true;
            }
            self.waiting.push_front(id);
            self.preemptions += 1;
        }
    }

    /// Folds one step's tokens and forward time into the prefill-rate estimate.
    pub(crate) fn observe_step(&mut self, tokens: usize, forward_us: u64) {
        if tokens < PREFILL_SAMPLE_TOKENS || forward_us == 0 {
            return;
        }
        let rate = tokens as f64 / (forward_us as f64 / 1e6);
        self.prefill_tok_per_s = Some(match self.prefill_tok_per_s {
            None => rate,
            Some(old) => 0.7 * old + 0.3 * rate,
        });
    }
}

/// How many leading positions of a sequence the agent can continue from without being sent
/// their tokens again. The agent rebuilds a slot's token history (penalties, the sampler's
/// generated-token index) from the tokens plans send, so a resumed sequence whose history
/// matters must be recomputed: a repetition penalty needs every token; sampling and
/// presence/frequency penalties need the generated ones.
pub(crate) fn history_free_tokens(seq: &Sequence) -> usize {
    let p = seq.params();
    if p.repetition_penalty != 1.0 {
        0
    } else if !p.is_greedy() || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        seq.prompt_len()
    } else {
        usize::MAX
    }
}

//! Prefill/decode disaggregation on one scheduler. On a prefill agent's scheduler, a request
//! whose prompt is computed and whose first token is sampled is handed over: each computed
//! block is copied out of the device into a block of the handoff region (a copy ordered in the
//! next plan, like a swap-out) and the request leaves with its device blocks and slot freed. On
//! a decode agent's scheduler, a handed-over request waits ahead of fresh ones and is admitted
//! like a swapped-out sequence, its blocks copied in from the handoff region before the step
//! that continues it: nothing is recomputed. Which handoff blocks a request uses, and that the
//! copy out has run before the copy in is planned, is the engine's business.

use npu_protocol::KvCopy;

use super::error::SchedError;
use super::request::Swapped;
use super::swap::history_free_tokens;
use super::Scheduler;
use crate::types::{GenerateRequest, RequestId};

/// A request whose KV was handed out of one agent, for another to continue.
#[derive(Debug, Clone, PartialEq)]
pub struct HandedOver {
    pub request: GenerateRequest,
    /// Tokens generated so far (the first was sampled where the prompt was computed).
    pub generated: Vec<u32>,
    /// Handoff region blocks holding its first `num_computed` positions, in table order.
    pub handoff_blocks: Vec<u32>,
    pub num_computed: usize,
}

impl Scheduler {
    /// Requests that could be handed over now, oldest first, with the handoff blocks each
    /// needs: admitted, not in a step, prompt computed and a token sampled, and no penalty that
    /// needs the prompt's tokens on the agent that continues (those decode here).
    pub fn ready_to_hand_over(&self) -> Vec<(RequestId, usize)> {
        let bs = self.cfg.block_size;
        self.running
            .iter()
            .filter_map(|&id| {
                let seq = &self.seqs[&id];
                let adm = seq.admitted.as_ref()?;
                let ready = adm.in_flight.is_none()
                    && !seq.generated.is_empty()
                    && seq.remaining() == 1
                    && adm.num_computed > 0
                    && adm.num_computed <= history_free_tokens(seq);
                ready.then(|| (id, adm.num_computed.div_ceil(bs)))
            })
            .collect()
    }

    /// Hands `id` over through `handoff_blocks` (one per computed block): the copies out go
    /// into the next plan, its device blocks and slot are freed and it leaves this scheduler.
    /// None, with nothing done, when it is not ready (see `ready_to_hand_over`), the number of
    /// blocks is wrong or the next plan has no room for the copies.
    pub fn hand_over(&mut self, id: RequestId, handoff_blocks: &[u32]) -> Option<HandedOver> {
        let n = self
            .ready_to_hand_over()
            .into_iter()
            .find(|(r, _)| *r == id)?
            .1;
        if n != handoff_blocks.len() || n > self.blocks.copies_left() {
            return None;
        }
        let seq = &self.seqs[&id];
        let adm = seq.admitted.as_ref()?;
        for (&d, &h) in adm.blocks[..n].iter().zip(handoff_blocks) {
            self.blocks.queue_copy(KvCopy::to_handoff(d, h));
        }
        let num_computed = adm.num_computed;
        self.release(id);
        self.static_batch.remove(&id);
        let seq = self.seqs.remove(&id)?;
        self.handoff_out_blocks += n as u64;
        self.handoff_out_requests += 1;
        Some(HandedOver {
            request: seq.req,
            generated: seq.generated,
            handoff_blocks: handoff_blocks.to_vec(),
            num_computed,
        })
    }

    /// Takes in a request handed over by another agent. It waits ahead of fresh requests; when
    /// admitted, its blocks are copied in from the handoff region before the step that
    /// continues it (the handoff blocks may be reused once that step's result is back).
    pub fn add_handed_over(&mut self, h: HandedOver) -> Result<(), SchedError> {
        let id = h.request.id;
        let covered = h.handoff_blocks.len() * self.cfg.block_size;
        let total = h.request.prompt_ids.len() + h.generated.len();
        if h.num_computed == 0 || h.num_computed >= total || covered < h.num_computed {
            return Err(SchedError::BadHandover {
                id,
                reason: format!(
                    "{} computed positions of {total}, {} handoff blocks of {} tokens",
                    h.num_computed,
                    h.handoff_blocks.len(),
                    self.cfg.block_size
                ),
            });
        }
        self.enqueue(h.request, h.generated, true)?;
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.swapped = Some(Swapped {
                host_blocks: h.handoff_blocks,
                num_computed: h.num_computed,
                num_registered: 0,
                last_hash: None,
                handoff: true,
            });
        }
        Ok(())
    }

    /// Whether `id` still waits for its handed-over blocks to be copied in (its handoff blocks
    /// are still needed).
    pub fn awaits_handoff(&self, id: RequestId) -> bool {
        self.seqs
            .get(&id)
            .and_then(|s| s.swapped.as_ref())
            .is_some_and(|sw| sw.handoff)
    }
}

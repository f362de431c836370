//! Taking a step result back: checks it against the plan it answers, advances each sequence's
//! computed length, offers newly full blocks to the prefix cache, appends sampled tokens and
//! ends requests on EOS, stop token ids, max_new_tokens or the length limit.

use std::collections::HashMap;

use npu_protocol::{SeqResult, StepResult, TokenLogprob};

use super::error::SchedError;
use super::{Planned, Scheduler};
use crate::types::{FinishReason, RequestId};

/// One generated token of a request, and whether it ended the request.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedOutput {
    pub id: RequestId,
    pub token: TokenLogprob,
    pub top: Vec<TokenLogprob>,
    /// Set when this token ended the request; its blocks and slot are already freed.
    pub finished: Option<FinishReason>,
}

impl Scheduler {
    /// Applies the agent's result of a step. Results of sequences aborted, finished or preempted
    /// since the plan are ignored. The result must match its plan: a result for a step not in
    /// flight, for a slot that was not to sample, or a missing result is an error (and nothing
    /// is applied). The requests of the sequences the agent could not run (`res.failed`) must
    /// be ended first (see `failed_requests`).
    pub fn on_result(&mut self, res: &StepResult) -> Result<Vec<SchedOutput>, SchedError> {
        let step_id = res.step_id;
        let planned = self
            .in_flight
            .get(&step_id)
            .ok_or(SchedError::UnknownStep { step_id })?;
        for f in &res.failed {
            if planned
                .iter()
                .any(|p| p.slot == f.slot && self.is_current(step_id, p))
            {
                return Err(SchedError::FailedNotEnded {
                    step_id,
                    slot: f.slot,
                });
            }
        }
        let mut by_slot: HashMap<u32, &SeqResult> = HashMap::new();
        for r in &res.seqs {
            let Some(p) = planned.iter().find(|p| p.slot == r.slot && p.sample) else {
                return Err(SchedError::UnexpectedResult {
                    step_id,
                    slot: r.slot,
                });
            };
            if r.extra.len() > p.n_draft {
                return Err(SchedError::TooManyTokens {
                    step_id,
                    slot: r.slot,
                    got: 1 + r.extra.len(),
                    drafted: p.n_draft,
                });
            }
            if by_slot.insert(r.slot, r).is_some() {
                return Err(SchedError::DuplicateResult {
                    step_id,
                    slot: r.slot,
                });
            }
        }
        for p in planned {
            if p.sample && self.is_current(step_id, p) && !by_slot.contains_key(&p.slot) {
                return Err(SchedError::MissingResult {
                    step_id,
                    slot: p.slot,
                });
            }
        }

        let planned = self.in_flight.remove(&step_id).unwrap_or_default();
        self.in_flight_copies.remove(&step_id);
        let n_tokens = planned.iter().map(|p| p.n_tokens).sum();
        self.observe_step(n_tokens, res.timing.forward_us);
        // Decode-only steps (one real token a sequence, drafts besides) measure what a row
        // costs, for speculative decoding's break-even share.
        if self.cfg.speculative.is_some() && planned.iter().all(|p| p.n_tokens - p.n_draft == 1) {
            self.step_cost.observe(n_tokens, res.timing.forward_us);
        }
        let mut out = Vec::new();
        for p in planned {
            if !self.is_current(step_id, &p) {
                continue;
            }
            if !p.sample {
                self.advance(p.id, p.n_tokens);
                continue;
            }
            let r = by_slot[&p.slot];
            let seq = self.seqs.get_mut(&p.id).expect("current sequence is known");
            // The sampled token, then one more for each draft the agent kept, up to the first
            // that ends the request.
            let mut finished = None;
            let mut made = 0;
            for (j, t) in std::iter::once(&r.token).chain(&r.extra).enumerate() {
                seq.generated.push(t.token);
                made += 1;
                finished = seq.finish_reason(t.token, &self.cfg.eos_ids);
                out.push(SchedOutput {
                    id: p.id,
                    token: *t,
                    top: if j == 0 { r.top.clone() } else { Vec::new() },
                    finished,
                });
                if finished.is_some() {
                    break;
                }
            }
            if p.n_draft > 0 {
                self.spec_accepted_tokens += r.extra.len() as u64;
                seq.drafts.record(p.n_draft, r.extra.len());
                self.draft_prior.record_global(p.n_draft, r.extra.len());
            }
            // The real tokens and the drafts kept before the last token made have their KV.
            self.advance(p.id, p.n_tokens - p.n_draft + made - 1);
            if finished.is_some() {
                self.remove(p.id);
            }
        }
        Ok(out)
    }

    /// The requests of the sequences of step `step_id` the agent could not run (`res.failed`),
    /// each with the agent's reason, for the caller to end (`finish` or `abort`) before it
    /// applies the result: their slots hold nothing on the agent, none of their tokens ran.
    pub fn failed_requests<'a>(&self, res: &'a StepResult) -> Vec<(RequestId, &'a str)> {
        let Some(planned) = self.in_flight.get(&res.step_id) else {
            return Vec::new();
        };
        res.failed
            .iter()
            .filter_map(|f| {
                planned
                    .iter()
                    .find(|p| p.slot == f.slot && self.is_current(res.step_id, p))
                    .map(|p| (p.id, f.error.as_str()))
            })
            .collect()
    }

    /// The agent reported that it could not run a step (it is still up): forgets the step and
    /// returns the requests it carried that are still here. Their KV state on the agent is
    /// unknown, so the caller ends them (`finish` or `abort`). The step's KV copies may not have
    /// happened: sequences and cached content that relied on them are recomputed instead.
    pub fn step_failed(&mut self, step_id: u64) -> Vec<RequestId> {
        let planned = self.in_flight.remove(&step_id).unwrap_or_default();
        if let Some(copies) = self.in_flight_copies.remove(&step_id) {
            self.distrust_copies(&copies);
        }
        let mut ids = Vec::new();
        for p in planned {
            if self.is_current(step_id, &p) {
                if let Some(adm) = self.seqs.get_mut(&p.id).and_then(|s| s.admitted.as_mut()) {
                    adm.in_flight = None;
                }
                ids.push(p.id);
            }
        }
        ids
    }

    /// Whether a planned entry still belongs to the same admission of a live sequence.
    fn is_current(&self, step_id: u64, p: &Planned) -> bool {
        self.seqs.get(&p.id).is_some_and(|s| {
            s.incarnation == p.incarnation
                && s.admitted
                    .as_ref()
                    .is_some_and(|a| a.in_flight == Some(step_id))
        })
    }

    /// Marks `n` more tokens of a sequence computed and registers its newly full blocks.
    fn advance(&mut self, id: RequestId, n: usize) {
        let bs = self.cfg.block_size;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        let Some(adm) = seq.admitted.as_mut() else {
            return;
        };
        adm.in_flight = None;
        adm.num_computed += n;
        if !self.blocks.caching() {
            return;
        }
        let full = adm.num_computed / bs;
        let mut registered = adm.num_registered;
        let mut last_hash = adm.last_hash;
        let blocks: Vec<u32> = adm.blocks[registered..full].to_vec();
        let lora = seq.lora_id();
        for block in blocks {
            let tokens = seq.tokens(registered * bs, (registered + 1) * bs);
            last_hash = Some(self.blocks.register(block, last_hash, lora, &tokens));
            registered += 1;
        }
        let adm = seq.admitted.as_mut().expect("checked above");
        adm.num_registered = registered;
        adm.last_hash = last_hash;
    }
}

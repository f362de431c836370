//! npu-scheduler: the scheduler of one agent. It queues requests, decides each step (continuous
//! batching with chunked prefill, or static batches), manages the agent's paged KV pool and
//! request slots (and, when the agent has one, its host KV pool), preempts by swapping or by
//! recomputation, and turns step results into generated tokens and finishes. Plain data in (requests, step results), plain data out (step plans): the server's
//! engine loop and the CLI's in-process runs drive the same code.

mod block_manager;
mod config;
mod error;
mod handoff;
mod host_pool;
mod kv_events;
mod lora;
mod planner;
mod prefix_cache;
mod request;
mod results;
mod speculative;
mod swap;
pub mod types;

#[cfg(test)]
mod proptests;
#[cfg(test)]
pub(crate) mod test_util;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_cache;
#[cfg(test)]
mod tests_handoff;
#[cfg(test)]
mod tests_kv_events;
#[cfg(test)]
mod tests_long;
#[cfg(test)]
mod tests_lora;
#[cfg(test)]
mod tests_spec;
#[cfg(test)]
mod tests_swap;

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

pub use block_manager::{BlockManager, PrefixHit};
pub use config::{BatchingPolicy, KvHostConfig, SchedulerConfig};
pub use error::SchedError;
pub use handoff::HandedOver;
pub use kv_events::{KvEvent, KvMedium};
pub use prefix_cache::{BlockHash, Tier};
pub use request::RecoveredRequest;
pub use results::SchedOutput;
pub use speculative::{ngram_draft, SpeculativeConfig};
pub use types::{FinishReason, GenerateRequest, RequestId};

use request::{check_request, Sequence};

/// Counters and gauges of one scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedStats {
    /// Admitted sequences (prefilling or decoding).
    pub running: usize,
    pub waiting: usize,
    /// Blocks held by sequences.
    pub blocks_used: usize,
    /// Blocks with no holder and no cached content.
    pub blocks_free: usize,
    /// Cached blocks nobody holds (reusable by a prefix hit, evicted when space is needed).
    pub blocks_cached: usize,
    pub blocks_total: usize,
    /// Sequences preempted so far (swapped out or dropped for recomputation).
    pub preemptions: u64,
    /// Of `preemptions`, those whose KV was swapped out to the host pool.
    pub preemptions_swap: u64,
    /// Blocks copied to the host pool by swap-outs, and back by swap-ins.
    pub swap_out_blocks: u64,
    pub swap_in_blocks: u64,
    /// Bytes of one KV block (0 without a host pool).
    pub block_bytes: u64,
    /// Host pool blocks: in all, holding spilled prefix-cache content, held by swapped-out
    /// sequences.
    pub host_blocks_total: usize,
    pub host_blocks_cached: usize,
    pub host_blocks_swapped: usize,
    /// Cached blocks spilled from the device to the host tier.
    pub host_spilled_blocks: u64,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed (both tiers).
    pub prefix_hit_tokens: u64,
    /// Of `prefix_hit_tokens`, those brought back from the host tier.
    pub prefix_hit_tokens_host: u64,
    /// Tokens of admitted sequences looked up in the prefix cache (0 while caching is off).
    pub prefix_query_tokens: u64,
    /// Tokens sent to the agent for computing (prefill chunks and decode tokens).
    pub scheduled_tokens: u64,
    /// Of `scheduled_tokens`, those that were not a decoding sequence's newest token (prompts,
    /// and tokens computed again after a preemption or a recovery).
    pub prefill_tokens: u64,
    /// Requests and blocks handed out to the handoff region (prefill/decode disaggregation),
    /// and taken in from it.
    pub handoff_out_requests: u64,
    pub handoff_out_blocks: u64,
    pub handoff_in_requests: u64,
    pub handoff_in_blocks: u64,
    pub steps_in_flight: usize,
    pub slots_in_use: usize,
    /// Speculative decoding: tokens drafted (sent to be verified), and of them those the agent
    /// kept (each saved one decode step).
    pub spec_drafted_tokens: u64,
    pub spec_accepted_tokens: u64,
}

/// One sequence's share of a step that is in flight, to match its result.
#[derive(Debug, Clone)]
struct Planned {
    slot: u32,
    id: RequestId,
    incarnation: u64,
    n_tokens: usize,
    sample: bool,
    /// Of `n_tokens`, the trailing drafted ones.
    n_draft: usize,
}

/// The scheduler and KV block manager of one agent.
///
/// Synchronous plain data: `add` requests, call `schedule` for a `StepPlan`, hand the agent's
/// `StepResult` to `on_result`, repeat. Several steps may be in flight; a sequence is in at most
/// one. A plan may carry only `forget` entries (no sequences): send it all the same, so that the
/// slots it releases can be reused (a slot is reused only after a plan has forgotten it).
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    /// Set in long-context mode: how a sequence's bounded table is used.
    long_context: Option<npu_protocol::LongContextLayout>,
    blocks: BlockManager,
    seqs: HashMap<RequestId, Sequence>,
    /// Not admitted, in admission order: resumed requests first, then fresh ones FCFS.
    waiting: VecDeque<RequestId>,
    /// Admitted, in admission order (oldest first; the last is the newest, preempted first).
    running: Vec<RequestId>,
    free_slots: BTreeSet<u32>,
    /// Slots released since the last plan; free again once a plan has carried them.
    pending_forget: Vec<u32>,
    in_flight: HashMap<u64, Vec<Planned>>,
    /// The KV copies of steps in flight (what to distrust if the step fails).
    in_flight_copies: HashMap<u64, Vec<npu_protocol::KvCopy>>,
    /// Static policy: the members of the current batch that have not finished.
    static_batch: HashSet<RequestId>,
    next_step_id: u64,
    preemptions: u64,
    preemptions_swap: u64,
    swap_out_blocks: u64,
    swap_in_blocks: u64,
    /// Prefill tokens per second, measured from step results (None until a large step came
    /// back).
    prefill_tok_per_s: Option<f64>,
    prefix_hit_tokens: u64,
    prefix_hit_tokens_host: u64,
    prefix_query_tokens: u64,
    scheduled_tokens: u64,
    prefill_tokens: u64,
    handoff_out_requests: u64,
    handoff_out_blocks: u64,
    handoff_in_requests: u64,
    handoff_in_blocks: u64,
    spec_drafted_tokens: u64,
    spec_accepted_tokens: u64,
    /// Decode step time against rows (speculative decoding's break-even share).
    step_cost: speculative::StepCost,
    /// The chance of keeping a draft below which none is made, as of the last plan.
    draft_threshold: f64,
    /// How often drafts were kept, all requests together (each request's prior).
    draft_prior: speculative::DraftRecord,
    /// Most distinct LoRA adapters among admitted requests (the agent's adapter slots); 0: no
    /// limit (no adapters are served).
    max_loras: usize,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Result<Self, SchedError> {
        cfg.validate()?;
        let (host_blocks, max_copies) = cfg
            .kv_host
            .map_or((0, 0), |h| (h.host_blocks, h.max_copies_per_step));
        let max_copies = max_copies.max(cfg.handoff_copies_per_step);
        Ok(Self {
            blocks: BlockManager::with_host(
                cfg.num_blocks,
                cfg.block_size,
                cfg.prefix_cache && cfg.long_context.is_none(),
                host_blocks,
                max_copies,
            ),
            long_context: cfg.long_context_layout(),
            free_slots: (0..cfg.slots() as u32).collect(),
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending_forget: Vec::new(),
            in_flight: HashMap::new(),
            in_flight_copies: HashMap::new(),
            static_batch: HashSet::new(),
            next_step_id: 1,
            preemptions: 0,
            preemptions_swap: 0,
            swap_out_blocks: 0,
            swap_in_blocks: 0,
            prefill_tok_per_s: None,
            prefix_hit_tokens: 0,
            prefix_hit_tokens_host: 0,
            prefix_query_tokens: 0,
            scheduled_tokens: 0,
            prefill_tokens: 0,
            handoff_out_requests: 0,
            handoff_out_blocks: 0,
            handoff_in_requests: 0,
            handoff_in_blocks: 0,
            spec_drafted_tokens: 0,
            spec_accepted_tokens: 0,
            step_cost: Default::default(),
            draft_threshold: 0.0,
            draft_prior: speculative::DraftRecord::initial_prior(),
            max_loras: 0,
        })
    }

    /// Records every later change to the prefix cache's blocks as a [`KvEvent`].
    pub fn record_kv_events(&mut self) {
        self.blocks.record_kv_events();
    }

    /// The changes to the cached blocks since the last call, oldest first (none unless
    /// `record_kv_events` was called).
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.blocks.take_kv_events()
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues a request (FCFS), or refuses one that could never run here.
    pub fn add(&mut self, req: &GenerateRequest) -> Result<(), SchedError> {
        self.enqueue(req.clone(), Vec::new(), false)
    }

    /// Queues a request recovered from a dead agent with the tokens it had generated. It goes
    /// ahead of fresh requests (behind other resumed ones); its prefill recomputes prompt and
    /// generated tokens, and generation continues at the same generated-token index.
    pub fn add_recovered(&mut self, rec: RecoveredRequest) -> Result<(), SchedError> {
        self.enqueue(rec.request, rec.generated, true)
    }

    fn enqueue(
        &mut self,
        req: GenerateRequest,
        generated: Vec<u32>,
        resumed: bool,
    ) -> Result<(), SchedError> {
        if self.seqs.contains_key(&req.id) {
            return Err(SchedError::DuplicateRequest { id: req.id });
        }
        let max_total_len = check_request(&self.cfg, &req, generated.len())?;
        let id = req.id;
        let seq = Sequence {
            req,
            generated,
            max_total_len,
            resumed,
            incarnation: 0,
            admitted: None,
            swapped: None,
            drafts: Default::default(),
            lora: None,
        };
        self.seqs.insert(id, seq);
        if resumed {
            let at = self
                .waiting
                .iter()
                .take_while(|w| self.seqs[w].resumed)
                .count();
            self.waiting.insert(at, id);
        } else {
            self.waiting.push_back(id);
        }
        Ok(())
    }

    /// Ends a request now (the engine matched a stop string): frees its blocks and slot.
    /// False when the request is not here (already finished or never added).
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) -> bool {
        let _ = reason; // the engine reports the reason; here every ending frees the same way
        self.remove(id)
    }

    /// Drops a request whose client went away, whatever its state. False when it is not here.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.remove(id)
    }

    fn remove(&mut self, id: RequestId) -> bool {
        if !self.seqs.contains_key(&id) {
            return false;
        }
        self.release(id);
        self.waiting.retain(|w| *w != id);
        self.static_batch.remove(&id);
        if let Some(sw) = self.seqs.remove(&id).and_then(|s| s.swapped) {
            if !sw.handoff {
                self.blocks.drop_swapped(&sw.host_blocks);
            }
        }
        true
    }

    /// Frees an admitted sequence's blocks and slot and takes it out of `running`; it stays in
    /// `seqs` (the caller removes or re-queues it).
    fn release(&mut self, id: RequestId) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        if let Some(adm) = seq.admitted.take() {
            self.blocks.release_table(&adm.blocks);
            self.pending_forget.push(adm.slot);
            self.running.retain(|r| *r != id);
        }
    }

    /// The agent died: gives back every request (oldest first) with its generated tokens, and
    /// resets the pool, the slots and the steps in flight.
    pub fn take_all(&mut self) -> Vec<RecoveredRequest> {
        // Running sequences were admitted before any waiting one arrived or was preempted.
        let order: Vec<RequestId> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        let mut seqs = std::mem::take(&mut self.seqs);
        self.static_batch.clear();
        self.in_flight.clear();
        self.in_flight_copies.clear();
        self.pending_forget.clear();
        self.free_slots = (0..self.cfg.slots() as u32).collect();
        self.blocks.reset();
        order
            .into_iter()
            .filter_map(|id| seqs.remove(&id))
            .map(|s| RecoveredRequest {
                request: s.req,
                generated: s.generated,
            })
            .collect()
    }

    pub fn stats(&self) -> SchedStats {
        let (host_cached, host_swapped) = self.blocks.host_cached_and_held();
        SchedStats {
            preemptions_swap: self.preemptions_swap,
            swap_out_blocks: self.swap_out_blocks,
            swap_in_blocks: self.swap_in_blocks,
            block_bytes: self.cfg.kv_host.map_or(0, |h| h.block_bytes),
            host_blocks_total: self.blocks.host_total(),
            host_blocks_cached: host_cached,
            host_blocks_swapped: host_swapped,
            host_spilled_blocks: self.blocks.spilled(),
            prefix_hit_tokens_host: self.prefix_hit_tokens_host,
            running: self.running.len(),
            waiting: self.waiting.len(),
            blocks_used: self.blocks.num_used(),
            blocks_free: self.blocks.num_free(),
            blocks_cached: self.blocks.num_evictable(),
            blocks_total: self.blocks.num_total(),
            preemptions: self.preemptions,
            prefix_hit_tokens: self.prefix_hit_tokens,
            prefix_query_tokens: self.prefix_query_tokens,
            scheduled_tokens: self.scheduled_tokens,
            prefill_tokens: self.prefill_tokens,
            handoff_out_requests: self.handoff_out_requests,
            handoff_out_blocks: self.handoff_out_blocks,
            handoff_in_requests: self.handoff_in_requests,
            handoff_in_blocks: self.handoff_in_blocks,
            steps_in_flight: self.in_flight.len(),
            slots_in_use: self.cfg.slots() - self.free_slots.len() - self.pending_forget.len(),
            spec_drafted_tokens: self.spec_drafted_tokens,
            spec_accepted_tokens: self.spec_accepted_tokens,
        }
    }

    /// The chance of keeping a draft below which none is made, as of the last plan: the larger
    /// of `speculative.min_acceptance` and the break-even share at that plan's batch size
    /// measured from step times (0 before speculative decoding planned anything).
    pub fn draft_threshold(&self) -> f64 {
        self.draft_threshold
    }

    /// The chance that a draft is kept, all requests together (recent steps weigh more).
    pub fn draft_acceptance(&self) -> f64 {
        self.draft_prior.rate()
    }

    /// Work held by this scheduler, for least-loaded dispatch: the tokens (prompt, generated and
    /// still to generate) of every request here.
    pub fn load(&self) -> u64 {
        self.seqs.values().map(Sequence::load).sum()
    }

    /// No request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Whether a request is waiting or running here.
    pub fn contains(&self, id: RequestId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// The (slot, request) pairs that sample in step `step_id` (planned, not yet answered): where
    /// a constrained request's token mask goes.
    pub fn sampling_in(&self, step_id: u64) -> Vec<(u32, RequestId)> {
        self.in_flight
            .get(&step_id)
            .map(|planned| {
                planned
                    .iter()
                    .filter(|p| p.sample)
                    .map(|p| (p.slot, p.id))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Generated tokens of a request still here.
    pub fn generated(&self, id: RequestId) -> Option<&[u32]> {
        self.seqs.get(&id).map(|s| s.generated.as_slice())
    }

    /// Checks the bookkeeping: every block's holders, the pool's free/cached lists, the
    /// queues and the slots. For tests and debug assertions; O(blocks + tokens held).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut holders = vec![0u32; self.blocks.num_total()];
        let mut slots = HashSet::new();
        for id in &self.running {
            let seq = self.seqs.get(id).ok_or(format!("running {id} unknown"))?;
            let adm = seq
                .admitted
                .as_ref()
                .ok_or(format!("running {id} not admitted"))?;
            if !slots.insert(adm.slot) || self.free_slots.contains(&adm.slot) {
                return Err(format!("slot {} of {id} is shared or free", adm.slot));
            }
            if adm.blocks.len() > self.cfg.max_blocks_per_seq {
                return Err(format!("{id} holds {} blocks", adm.blocks.len()));
            }
            if adm.num_computed > seq.total_len() || seq.total_len() >= seq.max_total_len {
                return Err(format!("{id}: lengths out of range"));
            }
            for &b in &adm.blocks {
                holders[b as usize] += 1;
            }
        }
        for (b, &h) in holders.iter().enumerate() {
            if h > 1 && !self.blocks.is_cached(b as u32) {
                return Err(format!(
                    "block {b} held by {h} sequences but not a cached full block"
                ));
            }
        }
        for s in &self.pending_forget {
            if !slots.insert(*s) || self.free_slots.contains(s) {
                return Err(format!("forgotten slot {s} still in use or free"));
            }
        }
        if slots.len() + self.free_slots.len() != self.cfg.slots() {
            return Err("slots leaked".into());
        }
        if self.running.len() > self.cfg.max_running {
            return Err(format!("{} running > max_running", self.running.len()));
        }
        let mut host_holders = vec![0u32; self.blocks.host_total()];
        for id in &self.waiting {
            let seq = self.seqs.get(id).ok_or(format!("waiting {id} unknown"))?;
            if seq.admitted.is_some() {
                return Err(format!("waiting {id} is admitted"));
            }
            if let Some(sw) = &seq.swapped {
                if sw.host_blocks.len() != sw.num_computed.div_ceil(self.cfg.block_size) {
                    return Err(format!("swapped {id}: blocks do not cover its computed KV"));
                }
                for &h in sw.host_blocks.iter().filter(|_| !sw.handoff) {
                    let n = host_holders
                        .get_mut(h as usize)
                        .ok_or(format!("swapped {id}: host block {h} out of range"))?;
                    *n += 1;
                }
            }
        }
        for id in &self.running {
            if self.seqs[id].swapped.is_some() {
                return Err(format!("running {id} is still marked swapped out"));
            }
        }
        if self.waiting.len() + self.running.len() != self.seqs.len() {
            return Err("a request is neither waiting nor running (or both)".into());
        }
        self.blocks.check_pools(&holders, &host_holders)
    }
}

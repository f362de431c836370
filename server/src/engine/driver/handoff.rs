//! Prefill/decode disaggregation in the engine: the handoff region's blocks (a free list owned
//! here), handing a prefilled request over from a prefill agent (the copies out of its device
//! ride on that agent's next step), giving it to the least-loaded decode agent once that step is
//! back (the copies into its device ride on the decode agent's next step), and freeing a
//! handoff block once the decode agent's step that read it is back or its request is gone. A
//! handover whose copies out may not have run (the step failed, the agent died) is recomputed
//! on a prefill agent, like any recovered request.

use std::collections::HashMap;

use npu_scheduler::{HandedOver, RecoveredRequest, SchedStats};

use super::{Engine, Health, Pending};
use crate::config::AgentRole;
use crate::engine::handle::{EngineStats, PdStats};
use crate::engine::types::{FinishReason, RequestId};

/// The disaggregation counters of every agent together.
#[derive(Debug, Default)]
pub(super) struct PdTotals {
    out_requests: u64,
    out_blocks: u64,
    in_requests: u64,
    in_blocks: u64,
    /// Prefill tokens computed by agents of each role: prefill, decode, both.
    prefill_tokens: [u64; 3],
}

impl PdTotals {
    pub(super) fn add(&mut self, role: AgentRole, st: &SchedStats) {
        self.out_requests += st.handoff_out_requests;
        self.out_blocks += st.handoff_out_blocks;
        self.in_requests += st.handoff_in_requests;
        self.in_blocks += st.handoff_in_blocks;
        let r = match role {
            AgentRole::Prefill => 0,
            AgentRole::Decode => 1,
            AgentRole::Both => 2,
        };
        self.prefill_tokens[r] += st.prefill_tokens;
    }

    pub(super) fn publish(&self, s: &PdStats, blocks: &HandoffBlocks, block_bytes: u64) {
        for (stat, v) in [
            (&s.handoff_out_requests_total, self.out_requests),
            (&s.handoff_out_blocks_total, self.out_blocks),
            (&s.handoff_out_bytes_total, self.out_blocks * block_bytes),
            (&s.handoff_in_requests_total, self.in_requests),
            (&s.handoff_in_blocks_total, self.in_blocks),
            (&s.handoff_in_bytes_total, self.in_blocks * block_bytes),
            (
                &s.prefill_tokens_prefill_agents_total,
                self.prefill_tokens[0],
            ),
            (
                &s.prefill_tokens_decode_agents_total,
                self.prefill_tokens[1],
            ),
            (&s.prefill_tokens_both_agents_total, self.prefill_tokens[2]),
            (&s.handoff_blocks_total, blocks.total() as u64),
            (&s.handoff_blocks_used, blocks.used() as u64),
        ] {
            EngineStats::set(stat, v);
        }
    }
}

/// The handoff region's blocks: which are free. Empty when prefill and decode are colocated.
#[derive(Debug, Default)]
pub(super) struct HandoffBlocks {
    free: Vec<u32>,
    total: u32,
}

impl HandoffBlocks {
    pub(super) fn new(total: u32) -> Self {
        Self {
            free: (0..total).rev().collect(),
            total,
        }
    }

    pub(super) fn total(&self) -> u32 {
        self.total
    }

    pub(super) fn used(&self) -> u32 {
        self.total - self.free.len() as u32
    }

    fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        Some(self.free.split_off(self.free.len() - n))
    }

    fn give_back(&mut self, blocks: Vec<u32>) {
        self.free.extend(blocks);
    }
}

/// What one agent has to do with handovers.
#[derive(Debug, Default)]
pub(super) struct AgentHandoffs {
    /// Handed out in the step in flight (prefill agent): they go on when it is back.
    pub(super) handing_out: Vec<HandedOver>,
    /// Handoff blocks of requests given to this (decode) agent, until its step that copied
    /// them in is back.
    pub(super) held: HashMap<RequestId, Vec<u32>>,
}

impl Engine {
    /// Before a prefill agent's next plan: hands over every request ready for it while
    /// handoff blocks are free (the others decode here, or wait for blocks to free up). While
    /// no decode agent is up (one is restarting), requests decode where they were prefilled.
    pub(super) fn hand_over_ready(&mut self, i: usize) {
        if self.agents[i].role != AgentRole::Prefill || self.handoff.total() == 0 {
            return;
        }
        if !self
            .agents
            .iter()
            .any(|a| a.health == Health::Up && a.role.decodes())
        {
            return;
        }
        for (id, n) in self.agents[i].sched.ready_to_hand_over() {
            // Without room now it decodes here and is handed over later, once blocks free up
            // (or never, when it outgrows the region).
            let Some(blocks) = self.handoff.take(n) else {
                continue;
            };
            match self.agents[i].sched.hand_over(id, &blocks) {
                Some(h) => self.agents[i].handoffs.handing_out.push(h),
                None => self.handoff.give_back(blocks),
            }
        }
    }

    /// A prefill agent's step came back: what it handed out goes to decode agents.
    pub(super) fn deliver_handed_over(&mut self, i: usize) {
        for h in std::mem::take(&mut self.agents[i].handoffs.handing_out) {
            let id = h.request.id;
            if !self.requests.contains_key(&id) {
                // Aborted or ended meanwhile.
                self.handoff.give_back(h.handoff_blocks);
                continue;
            }
            let target = self
                .agents
                .iter()
                .enumerate()
                .filter(|(_, a)| a.health == Health::Up && a.role.decodes())
                .min_by_key(|(_, a)| a.sched.load())
                .map(|(j, _)| j);
            let Some(j) = target else {
                // No decode agent is up: recompute it where prompts are computed.
                self.recompute_handover(h);
                continue;
            };
            let blocks = h.handoff_blocks.clone();
            match self.agents[j].sched.add_handed_over(h) {
                Ok(()) => {
                    self.agents[j].handoffs.held.insert(id, blocks);
                    if let Some(e) = self.requests.get_mut(&id) {
                        e.agent = Some(j);
                    }
                }
                Err(e) => {
                    self.handoff.give_back(blocks);
                    self.emit_finished(id, FinishReason::Error, Some(e.to_string()));
                }
            }
        }
    }

    /// A (decode) agent's step came back, or the agent is idle: the handoff blocks of requests
    /// no longer waiting for them are free.
    pub(super) fn release_taken_in(&mut self, i: usize) {
        let a = &mut self.agents[i];
        if a.step_in_flight.is_some() {
            return;
        }
        let done: Vec<RequestId> = a
            .handoffs
            .held
            .keys()
            .copied()
            .filter(|id| !a.sched.awaits_handoff(*id))
            .collect();
        for id in done {
            if let Some(blocks) = a.handoffs.held.remove(&id) {
                self.handoff.give_back(blocks);
            }
        }
    }

    /// Agent `i` is down or its step failed: the handovers of that step may not have been
    /// copied out (they are recomputed), and nothing of it reads handoff blocks any more.
    pub(super) fn handoffs_lost(&mut self, i: usize, agent_down: bool) {
        for h in std::mem::take(&mut self.agents[i].handoffs.handing_out) {
            self.recompute_handover(h);
        }
        if agent_down {
            for (_, blocks) in std::mem::take(&mut self.agents[i].handoffs.held) {
                self.handoff.give_back(blocks);
            }
        }
    }

    fn recompute_handover(&mut self, h: HandedOver) {
        let id = h.request.id;
        self.handoff.give_back(h.handoff_blocks);
        if !self.requests.contains_key(&id) {
            return;
        }
        if let Some(e) = self.requests.get_mut(&id) {
            e.agent = None;
        }
        self.dispatch(Pending::Recovered(RecoveredRequest {
            request: h.request,
            generated: h.generated,
        }));
    }
}

//! Helpers for the scheduler's tests: small configs, requests, and hand-made step results that
//! stand in for the agent (the scheduler never sees a model).

use std::collections::HashMap;

use npu_protocol::{
    CopyDirection, SamplingParams, SeqResult, SeqStep, StepPlan, StepResult, TokenLogprob,
};

use super::{SchedOutput, Scheduler, SchedulerConfig};
use crate::types::GenerateRequest;

/// The EOS id the test configs use.
pub const EOS: u32 = 0;

/// A small continuous-batching config without prefix caching.
pub fn cfg(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_running: 8,
        max_new_prompts_per_step: 8,
        max_tokens_per_step: 64,
        max_slots: None,
        max_blocks_per_seq: num_blocks,
        max_model_len: 1024,
        max_generate_length: None,
        prefix_cache: false,
        eos_ids: vec![EOS],
        ..SchedulerConfig::default()
    }
}

/// `c` with a host KV pool of `host_blocks` blocks (fast copies, room for many per step).
pub fn host_cfg(c: SchedulerConfig, host_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        kv_host: Some(crate::KvHostConfig {
            host_blocks,
            block_bytes: 1000,
            d2h_bytes_per_s: 1e9,
            h2d_bytes_per_s: 1e9,
            max_copies_per_step: 4 * c.num_blocks,
        }),
        ..c
    }
}

pub fn sched(cfg: SchedulerConfig) -> Scheduler {
    Scheduler::new(cfg).expect("valid test config")
}

/// A greedy request with the given prompt and max_new_tokens.
pub fn req(id: u64, prompt: &[u32], max_new: u32) -> GenerateRequest {
    GenerateRequest {
        id,
        prompt_ids: prompt.to_vec(),
        params: SamplingParams::greedy(),
        max_new_tokens: max_new,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        speculative: true,
    }
}

/// A prompt of `n` tokens starting at `first` (never the EOS id).
pub fn prompt(first: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| first + i + 1).collect()
}

/// The agent's answer to `plan`: every sampling sequence gets `token(slot)`.
pub fn answer(plan: &StepPlan, token: impl Fn(u32) -> u32) -> StepResult {
    StepResult {
        transfer: Default::default(),
        failed: Vec::new(),
        step_id: plan.step_id,
        seqs: plan
            .seqs
            .iter()
            .filter(|s| s.sample)
            .map(|s| SeqResult {
                slot: s.slot,
                token: TokenLogprob {
                    token: token(s.slot),
                    logprob: -0.5,
                },
                top: Vec::new(),
                extra: Vec::new(),
            })
            .collect(),
        timing: Default::default(),
    }
}

/// The agent's answer to `plan` when it samples `token(slot)` at every position: a drafting
/// sequence keeps each draft while it equals that token (the first that differs ends it).
pub fn answer_drafts(plan: &StepPlan, token: impl Fn(u32) -> u32) -> StepResult {
    let mut res = answer(plan, &token);
    for (r, q) in res
        .seqs
        .iter_mut()
        .zip(plan.seqs.iter().filter(|s| s.sample))
    {
        let t = token(q.slot);
        let drafts = &q.tokens[q.tokens.len() - q.n_draft as usize..];
        r.extra = drafts
            .iter()
            .take_while(|&&d| d == t)
            .map(|_| TokenLogprob {
                token: t,
                logprob: -0.5,
            })
            .collect();
    }
    res
}

/// Schedules one step and answers it with `token` for every sampling sequence.
pub fn step(s: &mut Scheduler, token: u32) -> (StepPlan, Vec<SchedOutput>) {
    let plan = s.schedule().expect("a step to run");
    let out = s
        .on_result(&answer(&plan, |_| token))
        .expect("result accepted");
    s.check_invariants().expect("invariants hold");
    (plan, out)
}

/// The plan's entry for `slot`.
pub fn seq_of(plan: &StepPlan, slot: u32) -> &SeqStep {
    plan.seqs
        .iter()
        .find(|s| s.slot == slot)
        .expect("slot in the plan")
}

/// The slot a request got when `plan` admitted it, by the order of admission.
pub fn admitted_slots(plan: &StepPlan) -> Vec<u32> {
    plan.admit.iter().map(|a| a.slot).collect()
}

/// Checks what every plan must satisfy: slot mapping by the block table, tables covering the
/// context, the token budget.
pub fn check_plan(plan: &StepPlan, cfg: &SchedulerConfig) {
    assert!(plan.n_tokens() <= cfg.max_tokens_per_step, "token budget");
    let bs = cfg.block_size as u32;
    for s in &plan.seqs {
        assert_eq!(s.block_table.len() as u32, s.context_len().div_ceil(bs));
        assert_eq!(s.slot_mapping.len(), s.tokens.len());
        for (i, &m) in s.slot_mapping.iter().enumerate() {
            let pos = s.start_pos + i as u32;
            assert_eq!(m, s.block_table[(pos / bs) as usize] * bs + pos % bs);
        }
    }
}

/// What a KV slot holds: (position, token), or nothing.
pub type KvSlot = Option<(u32, u32)>;

/// Device and host KV pools, slot by slot: what an agent's memory holds after each plan.
pub struct KvModel {
    bs: usize,
    device: Vec<Vec<KvSlot>>,
    host: Vec<Vec<KvSlot>>,
    /// The handoff region's blocks (shared between agents: a test moves them across).
    pub handoff: HashMap<u32, Vec<KvSlot>>,
}

impl KvModel {
    pub fn new(s: &Scheduler) -> Self {
        let bs = s.cfg.block_size;
        Self {
            bs,
            device: vec![vec![None; bs]; s.cfg.num_blocks],
            host: vec![vec![None; bs]; s.blocks.host_total()],
            handoff: HashMap::new(),
        }
    }

    /// Runs the plan's copies in order, writes its new tokens, and checks every sequence's
    /// context (`expected[slot]`: all its tokens so far) through its block table.
    pub fn apply(&mut self, plan: &StepPlan, expected: &HashMap<u32, Vec<u32>>) {
        for c in &plan.kv_copies {
            let (d, h) = (c.device_block as usize, c.host_block as usize);
            match c.direction {
                CopyDirection::DeviceToHost => self.host[h] = self.device[d].clone(),
                CopyDirection::HostToDevice => self.device[d] = self.host[h].clone(),
                CopyDirection::DeviceToHandoff => {
                    self.handoff.insert(c.host_block, self.device[d].clone());
                }
                CopyDirection::HandoffToDevice => {
                    self.device[d] = self.handoff.get(&c.host_block).cloned().unwrap_or_else(|| {
                        panic!("handoff block {} read before it was written", c.host_block)
                    })
                }
            }
        }
        let bs = self.bs as u32;
        for q in &plan.seqs {
            for (i, &m) in q.slot_mapping.iter().enumerate() {
                let pos = q.start_pos + i as u32;
                self.device[(m / bs) as usize][(m % bs) as usize] = Some((pos, q.tokens[i]));
            }
        }
        for q in &plan.seqs {
            let want = &expected[&q.slot];
            // Drafts are not the sequence's tokens (yet): they read what the step wrote.
            let real = q.context_len() - q.n_draft;
            for pos in 0..q.context_len() {
                let b = q.block_table[(pos / bs) as usize] as usize;
                let token = if pos < real {
                    want[pos as usize]
                } else {
                    q.tokens[(pos - q.start_pos) as usize]
                };
                assert_eq!(
                    self.device[b][(pos % bs) as usize],
                    Some((pos, token)),
                    "slot {} position {pos} reads the wrong KV",
                    q.slot
                );
            }
        }
    }
}

/// Content nobody wrote knowingly (the copies and writes of a failed step).
const GARBAGE: KvSlot = Some((u32::MAX, u32::MAX));

impl KvModel {
    /// The plan failed part-way: every slot its copies or writes reach holds unknown bytes.
    pub fn garble(&mut self, plan: &StepPlan) {
        for c in &plan.kv_copies {
            match c.direction {
                CopyDirection::DeviceToHost => self.host[c.host_block as usize].fill(GARBAGE),
                CopyDirection::HostToDevice | CopyDirection::HandoffToDevice => {
                    self.device[c.device_block as usize].fill(GARBAGE)
                }
                CopyDirection::DeviceToHandoff => {
                    self.handoff.insert(c.host_block, vec![GARBAGE; self.bs]);
                }
            }
        }
        let bs = self.bs as u32;
        for q in &plan.seqs {
            for &m in &q.slot_mapping {
                self.device[(m / bs) as usize][(m % bs) as usize] = GARBAGE;
            }
        }
    }

    /// The agent's memory is gone.
    pub fn clear(&mut self) {
        for b in self.device.iter_mut().chain(self.host.iter_mut()) {
            b.fill(None);
        }
    }
}

/// Every admitted sequence's tokens so far, by slot.
pub fn expected_tokens(s: &Scheduler) -> HashMap<u32, Vec<u32>> {
    s.seqs
        .values()
        .filter_map(|q| Some((q.admitted.as_ref()?.slot, q.all_tokens())))
        .collect()
}

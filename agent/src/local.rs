//! Runs whole generations on an in-process engine without the server: a minimal planner that gives
//! each sequence a slot and blocks from a free list and feeds prompts in chunks and generated
//! tokens back one at a time, mixing prefill and decode in the same steps. The CLI commands
//! (generate, bench-model) and the engine tests use it.

use std::time::{Duration, Instant};

use npu_protocol::{Admission, SamplingParams, SeqStep, StepPlan, TokenLogprob};

use crate::engine::{AgentEngine, EngineError};

/// One sequence to generate.
#[derive(Debug, Clone)]
pub struct LocalRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_new_tokens: usize,
    /// Stop at one of these token ids (it is kept in the output).
    pub stop_ids: Vec<u32>,
    /// Steps to wait before this sequence starts (to mix prefill with others' decode).
    pub start_delay_steps: usize,
}

/// What one sequence produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LocalOutput {
    pub tokens: Vec<TokenLogprob>,
    pub top: Vec<Vec<TokenLogprob>>,
}

/// Timing of a run.
#[derive(Debug, Clone, Default)]
pub struct LocalTiming {
    /// Time of steps that carried prompt tokens, and how many prompt tokens they carried.
    pub prefill: Duration,
    pub prefill_tokens: usize,
    /// Time of steps that carried only decode tokens, and how many tokens they produced.
    pub decode: Duration,
    pub decode_tokens: usize,
    /// Duration and token count of every decode-only step.
    pub decode_steps: Vec<(Duration, usize)>,
    pub steps: usize,
}

struct Active {
    req: usize,
    slot: u32,
    /// Tokens in the KV cache.
    pos: usize,
    /// Prompt tokens not yet fed.
    fed: usize,
    blocks: Vec<u32>,
    out: LocalOutput,
    done: bool,
}

/// A planner over an engine: `num_blocks` blocks of `block_size`, `max_slots` slots.
pub struct LocalRunner<'e> {
    engine: &'e mut AgentEngine,
    /// Most tokens per step (prefill chunks are cut to fit).
    pub token_budget: usize,
    /// Longest prefill chunk of one sequence.
    pub chunk: usize,
}

impl LocalTiming {
    /// Decode tokens per second at the median step time of steps with `batch` sequences (robust to
    /// a noisy machine); None when there were no such steps.
    pub fn median_decode_tok_s(&self, batch: usize) -> Option<f64> {
        let mut d: Vec<f64> = self
            .decode_steps
            .iter()
            .filter(|(_, n)| *n == batch)
            .map(|(t, _)| t.as_secs_f64())
            .collect();
        if d.is_empty() {
            return None;
        }
        d.sort_by(f64::total_cmp);
        Some(batch as f64 / d[d.len() / 2])
    }
}

impl<'e> LocalRunner<'e> {
    pub fn new(engine: &'e mut AgentEngine) -> Self {
        let budget = engine.config().max_tokens_per_step as usize;
        Self {
            engine,
            token_budget: budget,
            chunk: budget,
        }
    }

    /// Runs all requests to completion (every sequence is admitted at once: the caller keeps the
    /// batch within the engine's slots and blocks).
    pub fn run(
        &mut self,
        reqs: &[LocalRequest],
    ) -> Result<(Vec<LocalOutput>, LocalTiming), EngineError> {
        self.run_with(reqs, &mut |_, _| {})
    }

    /// Like `run`, calling `on_token(request index, token)` as each token is sampled.
    pub fn run_with(
        &mut self,
        reqs: &[LocalRequest],
        on_token: &mut dyn FnMut(usize, &TokenLogprob),
    ) -> Result<(Vec<LocalOutput>, LocalTiming), EngineError> {
        let cfg = self.engine.config().clone();
        let bs = cfg.block_size as usize;
        if reqs.len() > cfg.max_slots as usize {
            return Err(EngineError::BadPlan(format!(
                "{} sequences exceed the engine's {} slots",
                reqs.len(),
                cfg.max_slots
            )));
        }
        let mut free: Vec<u32> = (0..cfg.num_blocks).rev().collect();
        let mut act: Vec<Active> = reqs
            .iter()
            .enumerate()
            .map(|(i, _)| Active {
                req: i,
                slot: i as u32,
                pos: 0,
                fed: 0,
                blocks: Vec::new(),
                out: LocalOutput::default(),
                done: false,
            })
            .collect();
        let mut timing = LocalTiming::default();
        let mut step_id = 0u64;
        let mut admitted = vec![false; reqs.len()];
        let mut forget = Vec::new();
        loop {
            let mut plan = StepPlan {
                step_id,
                forget: std::mem::take(&mut forget),
                admit: Vec::new(),
                seqs: Vec::new(),
            };
            let mut budget = self.token_budget;
            let mut prompt_tokens = 0;
            // Decode tokens first, then prefill chunks, as the server's scheduler does.
            for pass in 0..2 {
                for a in act.iter_mut().filter(|a| !a.done) {
                    let r = &reqs[a.req];
                    if step_id < r.start_delay_steps as u64 {
                        continue;
                    }
                    let decoding = a.fed == r.prompt.len();
                    if (pass == 0) != decoding || budget == 0 {
                        continue;
                    }
                    let tokens: Vec<u32> = if decoding {
                        vec![a.out.tokens.last().expect("decoding after a sample").token]
                    } else {
                        let n = (r.prompt.len() - a.fed).min(self.chunk).min(budget);
                        r.prompt[a.fed..a.fed + n].to_vec()
                    };
                    budget -= tokens.len();
                    let end = a.pos + tokens.len();
                    while a.blocks.len() * bs < end {
                        let b = free.pop().ok_or_else(|| {
                            EngineError::BadPlan("the local runner ran out of KV blocks".into())
                        })?;
                        a.blocks.push(b);
                    }
                    let slot_mapping = (a.pos..end)
                        .map(|p| a.blocks[p / bs] * bs as u32 + (p % bs) as u32)
                        .collect();
                    if !admitted[a.req] {
                        admitted[a.req] = true;
                        plan.admit.push(Admission {
                            slot: a.slot,
                            params: r.params.clone(),
                        });
                    }
                    let n_prompt = if decoding { 0 } else { tokens.len() };
                    prompt_tokens += n_prompt;
                    if !decoding {
                        a.fed += tokens.len();
                    }
                    plan.seqs.push(SeqStep {
                        slot: a.slot,
                        start_pos: a.pos as u32,
                        block_table: a.blocks.clone(),
                        slot_mapping,
                        sample: a.fed == r.prompt.len(),
                        n_prompt_tokens: n_prompt as u32,
                        tokens,
                    });
                    a.pos = end;
                }
            }
            if plan.seqs.is_empty() {
                if act.iter().all(|a| a.done) {
                    break;
                }
                step_id += 1;
                continue;
            }
            let t0 = Instant::now();
            let res = self.engine.step(&plan)?;
            let dt = t0.elapsed();
            timing.steps += 1;
            if prompt_tokens > 0 {
                timing.prefill += dt;
                timing.prefill_tokens += prompt_tokens;
            } else {
                timing.decode += dt;
                timing.decode_tokens += res.seqs.len();
                timing.decode_steps.push((dt, res.seqs.len()));
            }
            for s in res.seqs {
                let a = &mut act[s.slot as usize];
                let r = &reqs[a.req];
                on_token(a.req, &s.token);
                a.out.tokens.push(s.token);
                a.out.top.push(s.top);
                if a.out.tokens.len() >= r.max_new_tokens || r.stop_ids.contains(&s.token.token) {
                    a.done = true;
                    forget.push(a.slot);
                    free.append(&mut a.blocks);
                }
            }
            step_id += 1;
        }
        if !forget.is_empty() {
            self.engine.step(&StepPlan {
                step_id,
                forget,
                ..Default::default()
            })?;
        }
        Ok((act.into_iter().map(|a| a.out).collect(), timing))
    }
}

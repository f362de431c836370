//! Whole generations in this process, without the server: the real scheduler (`npu-scheduler`,
//! the one the server runs) plans every step, the engine runs it, and the results go back to
//! the scheduler, exactly as between the server and an agent, minus the shared memory. The CLI
//! commands (`generate`, `bench-model`) and the engine's tests run through it.

use std::time::{Duration, Instant};

use npu_protocol::TokenLogprob;
use npu_scheduler::{FinishReason, GenerateRequest, SchedError, Scheduler, SchedulerConfig};
use thiserror::Error;

use crate::engine::{AgentEngine, AgentEngineConfig, EngineError};

#[derive(Debug, Error)]
pub enum InprocError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Sched(#[from] SchedError),
    #[error("the scheduler holds work but plans no step")]
    Stalled,
    /// A request the engine could not run (its LoRA adapter's files could not be read).
    #[error("slot {slot}: {error}")]
    SeqFailed { slot: u32, error: String },
}

/// One request of a run, and the step before which it arrives (0: at the start).
#[derive(Debug, Clone)]
pub struct Arrival {
    pub request: GenerateRequest,
    pub at_step: usize,
}

/// What one request produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunOutput {
    pub tokens: Vec<TokenLogprob>,
    pub top: Vec<Vec<TokenLogprob>>,
    pub finished: Option<FinishReason>,
}

impl RunOutput {
    pub fn token_ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.token).collect()
    }
}

/// Timing of a run.
#[derive(Debug, Clone, Default)]
pub struct RunTiming {
    /// Time of steps that carried prompt tokens, and how many prompt tokens they carried.
    pub prefill: Duration,
    pub prefill_tokens: usize,
    /// Time of steps that carried only decode tokens, and how many tokens they produced.
    pub decode: Duration,
    pub decode_tokens: usize,
    /// Duration and token count of every decode-only step.
    pub decode_steps: Vec<(Duration, usize)>,
    pub steps: usize,
    /// The most KV blocks sequences held at once (after planning a step).
    pub peak_blocks_used: usize,
    /// Speculative decoding: tokens drafted, and of them those kept.
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
}

impl RunTiming {
    /// Decode tokens per second at the median step time of steps with `batch` sequences (robust
    /// to a noisy machine); None when there were no such steps.
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

/// A scheduler config that fits `engine`: its pool, block size, slots, step budget and block
/// tables, continuous batching, no prefix cache (each run computes what it measures), no end
/// tokens (requests carry their own `stop_token_ids`), context up to what the tables hold (any
/// length in long-context mode).
pub fn scheduler_config(engine: &AgentEngineConfig) -> SchedulerConfig {
    let slots = engine.max_slots as usize;
    SchedulerConfig {
        num_blocks: engine.num_blocks as usize,
        block_size: engine.block_size as usize,
        max_running: slots,
        max_new_prompts_per_step: slots,
        max_tokens_per_step: engine.max_tokens_per_step as usize,
        max_slots: Some(slots),
        max_blocks_per_seq: engine.max_blocks_per_seq as usize,
        // Long-context mode holds any length on its bounded tables.
        max_model_len: if engine.long_context.is_some() {
            u32::MAX as usize
        } else {
            engine.max_blocks_per_seq as usize * engine.block_size as usize
        },
        max_generate_length: None,
        prefix_cache: false,
        eos_ids: Vec::new(),
        long_context: engine.long_context,
        ..SchedulerConfig::default()
    }
}

/// Runs `arrivals` to completion on `engine` under a scheduler made from `cfg`, calling
/// `on_token(arrival index, token)` as each token is generated. Outputs are in arrival order.
pub fn run(
    engine: &mut AgentEngine,
    cfg: SchedulerConfig,
    arrivals: &[Arrival],
    on_token: &mut dyn FnMut(usize, &TokenLogprob),
) -> Result<(Vec<RunOutput>, RunTiming), InprocError> {
    // The pool as built: captured step graphs keep one block of the asked-for pool for their
    // padded rows, so a config made before the load may name one block too many.
    let mut cfg = cfg;
    cfg.num_blocks = cfg.num_blocks.min(engine.config().num_blocks as usize);
    run_steps(&mut |plan| engine.step(plan), cfg, arrivals, on_token)
}

/// `run` with each step run by `step` (an engine, or a tensor-parallel group of them).
pub fn run_steps(
    run_step: &mut dyn FnMut(
        &npu_protocol::StepPlan,
    ) -> Result<npu_protocol::StepResult, EngineError>,
    cfg: SchedulerConfig,
    arrivals: &[Arrival],
    on_token: &mut dyn FnMut(usize, &TokenLogprob),
) -> Result<(Vec<RunOutput>, RunTiming), InprocError> {
    let mut sched = Scheduler::new(cfg)?;
    let index: std::collections::HashMap<u64, usize> = arrivals
        .iter()
        .enumerate()
        .map(|(i, a)| (a.request.id, i))
        .collect();
    let mut outputs = vec![RunOutput::default(); arrivals.len()];
    let mut timing = RunTiming::default();
    let mut order: Vec<usize> = (0..arrivals.len()).collect();
    order.sort_by_key(|&i| arrivals[i].at_step);
    let mut next = 0;
    let mut step = 0usize;
    loop {
        while next < order.len() && arrivals[order[next]].at_step <= step {
            sched.add(&arrivals[order[next]].request)?;
            next += 1;
        }
        let Some(plan) = sched.schedule() else {
            if next < order.len() {
                step = arrivals[order[next]].at_step;
                continue;
            }
            if sched.is_idle() {
                break;
            }
            return Err(InprocError::Stalled);
        };
        timing.peak_blocks_used = timing.peak_blocks_used.max(sched.stats().blocks_used);
        let prompt_tokens: usize = plan.seqs.iter().map(|s| s.n_prompt_tokens as usize).sum();
        let t0 = Instant::now();
        let res = run_step(&plan)?;
        let dt = t0.elapsed();
        let made: usize = res.seqs.iter().map(|s| 1 + s.extra.len()).sum();
        if !plan.seqs.is_empty() {
            timing.steps += 1;
            if prompt_tokens > 0 {
                timing.prefill += dt;
                timing.prefill_tokens += prompt_tokens;
            } else {
                timing.decode += dt;
                timing.decode_tokens += made;
                timing.decode_steps.push((dt, made));
            }
        }
        if let Some(f) = res.failed.first() {
            return Err(InprocError::SeqFailed {
                slot: f.slot,
                error: f.error.clone(),
            });
        }
        for out in sched.on_result(&res)? {
            let Some(&i) = index.get(&out.id) else {
                continue;
            };
            on_token(i, &out.token);
            let o = &mut outputs[i];
            o.tokens.push(out.token);
            o.top.push(out.top);
            o.finished = out.finished;
        }
        step += 1;
    }
    let st = sched.stats();
    timing.drafted_tokens = st.spec_drafted_tokens;
    timing.accepted_tokens = st.spec_accepted_tokens;
    Ok((outputs, timing))
}

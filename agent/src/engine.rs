//! The agent's engine: owns the model (on its backend, with the paged KV pool), the per-slot
//! sampling state, and executes one `StepPlan` into one `StepResult`. This is what the agent
//! process's step loop calls, and what the local CLI commands drive directly.

use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use npu_protocol::agent::{AgentEngineConfig, ModelFacts};
use npu_protocol::{SamplingParams, SeqResult, StepPlan, StepResult, StepTiming};
use thiserror::Error;

use crate::model::{Model, ModelConfig, ModelError, ModelOptions};
use crate::sampler::{SampleOutput, Sampler, SamplerError, TokenHistory};
use npu_backend::legacy::{Backend, SeqMeta, StepMeta};
use npu_backend_cpu::disjoint::TileGrid;
use npu_backend_cpu::threadpool::{PoolError, ThreadPool};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::{GgufError, GgufFile};

thread_local! {
    /// Sampling scratch of each compute thread.
    static SAMPLER: std::cell::RefCell<Sampler> = std::cell::RefCell::new(Sampler::new());
}

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    #[error("bad step plan: {0}")]
    BadPlan(String),
    #[error("bad engine configuration: {0}")]
    BadConfig(String),
    #[error("sampling: {0}")]
    Sampling(#[from] PoolError),
}

struct Slot {
    params: SamplingParams,
    history: TokenHistory,
}

/// A model that can run a step, whatever its backend.
trait StepModel: Send {
    fn forward(&mut self, meta: &StepMeta, logits: &mut Vec<f32>) -> Result<(), ModelError>;
    fn config(&self) -> &ModelConfig;
}

impl<B: Backend> StepModel for Model<B> {
    fn forward(&mut self, meta: &StepMeta, logits: &mut Vec<f32>) -> Result<(), ModelError> {
        Model::forward(self, meta, logits)
    }
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
}

pub struct AgentEngine {
    cfg: AgentEngineConfig,
    model: Box<dyn StepModel>,
    facts: ModelFacts,
    slots: Vec<Option<Slot>>,
    /// Sequences are sampled in parallel on the backend's compute pool.
    pool: Arc<ThreadPool>,
    meta: StepMeta,
    logits: Vec<f32>,
    /// Plan sequence index of each logit row.
    logit_seq: Vec<usize>,
}

/// End-of-generation token ids from the metadata (eos, and eot/eom where present).
fn eos_ids(f: &GgufFile) -> Vec<u32> {
    let mut ids = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(id) = f.get_u64(key) {
            if !ids.contains(&(id as u32)) {
                ids.push(id as u32);
            }
        }
    }
    ids
}

impl AgentEngine {
    pub fn load(cfg: &AgentEngineConfig) -> Result<Self, EngineError> {
        if cfg.max_slots == 0 || cfg.max_tokens_per_step == 0 || cfg.max_blocks_per_seq == 0 {
            return Err(EngineError::BadConfig(format!(
                "max_slots, max_tokens_per_step and max_blocks_per_seq must be positive: {cfg:?}"
            )));
        }
        let file = GgufFile::open(&cfg.model_path)?;
        let opts = ModelOptions {
            max_tokens: cfg.max_tokens_per_step as usize,
            max_logit_rows: cfg.max_slots as usize,
            num_blocks: cfg.num_blocks as usize,
            block_size: cfg.block_size as usize,
        };
        let backend = CpuBackend::new(CpuConfig {
            threads: cfg.threads as usize,
            f32_reference: false,
        });
        let pool = backend.pool();
        let model = Model::load(&file, backend, opts)?;
        if model.lossy_weights() {
            tracing::warn!(
                "some weights (Q2_K/Q3_K/Q6_K) were re-quantized to 8-bit blocks for the CPU kernels"
            );
        }
        let mc = &model.cfg;
        let facts = ModelFacts {
            name: mc.name.clone(),
            architecture: mc.arch.name().to_string(),
            vocab_size: mc.vocab as u32,
            n_layers: mc.n_layers as u32,
            hidden: mc.hidden as u32,
            n_heads: mc.n_heads as u32,
            n_kv_heads: mc.n_kv_heads as u32,
            head_dim: mc.head_dim as u32,
            context_length: mc.context_length as u32,
            eos_ids: eos_ids(&file),
            bos_id: file
                .get_u64("tokenizer.ggml.bos_token_id")
                .map(|v| v as u32),
            backend: model.backend().describe(),
        };
        Ok(Self {
            cfg: cfg.clone(),
            model: Box::new(model),
            facts,
            slots: (0..cfg.max_slots).map(|_| None).collect(),
            pool,
            meta: StepMeta::default(),
            logits: Vec::new(),
            logit_seq: Vec::new(),
        })
    }

    pub fn facts(&self) -> &ModelFacts {
        &self.facts
    }

    pub fn config(&self) -> &AgentEngineConfig {
        &self.cfg
    }

    pub fn model_config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// Forget every slot (after a server-side reset).
    pub fn reset(&mut self) {
        self.slots.iter_mut().for_each(|s| *s = None);
    }

    fn slot_index(&self, slot: u32) -> Result<usize, EngineError> {
        if slot < self.cfg.max_slots {
            Ok(slot as usize)
        } else {
            Err(EngineError::BadPlan(format!(
                "slot {slot} is beyond the agent's {} slots",
                self.cfg.max_slots
            )))
        }
    }

    /// Runs one step: forget and admit slots, run the model on every sequence's new tokens,
    /// sample where asked.
    pub fn step(&mut self, plan: &StepPlan) -> Result<StepResult, EngineError> {
        let t_start = Instant::now();
        for &s in &plan.forget {
            let i = self.slot_index(s)?;
            self.slots[i] = None;
        }
        for a in &plan.admit {
            let i = self.slot_index(a.slot)?;
            self.slots[i] = Some(Slot {
                params: a.params.clone(),
                history: TokenHistory::new(),
            });
        }
        if plan.seqs.is_empty() {
            return Ok(StepResult {
                step_id: plan.step_id,
                seqs: Vec::new(),
                timing: StepTiming::default(),
            });
        }
        self.build_meta(plan)?;
        // History first: penalties see every token up to and including this step's inputs.
        for seq in &plan.seqs {
            let i = seq.slot as usize;
            let slot = self.slots[i].as_mut().expect("checked in build_meta");
            let np = (seq.n_prompt_tokens as usize).min(seq.tokens.len());
            slot.history.push_prompt(&seq.tokens[..np]);
            for &t in &seq.tokens[np..] {
                slot.history.push_generated(t);
            }
        }
        let t_fwd = Instant::now();
        self.model.forward(&self.meta, &mut self.logits)?;
        let forward_us = t_fwd.elapsed().as_micros() as u64;
        let t_sample = Instant::now();
        let vocab = self.model.config().vocab;
        let n = self.logit_seq.len();
        let have = self.logits.len();
        let rows = self.logits.get_mut(..n * vocab).ok_or_else(|| {
            EngineError::BadPlan(format!("{have} logits for {n} rows of {vocab}"))
        })?;
        let logits = TileGrid::rows(rows, vocab, (0..n).map(|r| r..r + 1).collect())
            .map_err(|e| EngineError::BadPlan(format!("logits: {e}")))?;
        let outs: Vec<Mutex<Option<Result<SampleOutput, SamplerError>>>> =
            (0..n).map(|_| Mutex::new(None)).collect();
        let (slots, logit_seq) = (&self.slots, &self.logit_seq);
        self.pool.run(n, |row| {
            let seq = &plan.seqs[logit_seq[row]];
            let slot = slots[seq.slot as usize]
                .as_ref()
                .expect("checked in build_meta");
            let mut row_tile = logits.take(row, 0);
            let row_logits = row_tile.contiguous_mut();
            let gen_index = slot.history.n_generated();
            let out = SAMPLER.with(|s| {
                s.borrow_mut()
                    .sample(row_logits, &slot.params, &slot.history, gen_index)
            });
            *outs[row].lock().unwrap_or_else(|e| e.into_inner()) = Some(out);
        })?;
        let mut seqs = Vec::with_capacity(n);
        for (row, out) in outs.into_iter().enumerate() {
            let out = out
                .into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .expect("every row was sampled")?;
            seqs.push(SeqResult {
                slot: plan.seqs[self.logit_seq[row]].slot,
                token: out.token,
                top: out.top,
            });
        }
        let sample_us = t_sample.elapsed().as_micros() as u64;
        Ok(StepResult {
            step_id: plan.step_id,
            seqs,
            timing: StepTiming {
                forward_us,
                sample_us,
                total_us: t_start.elapsed().as_micros() as u64,
            },
        })
    }

    /// Flattens a plan into the backend's step metadata, checking it against the capacities.
    fn build_meta(&mut self, plan: &StepPlan) -> Result<(), EngineError> {
        let bad = |s: String| Err(EngineError::BadPlan(s));
        let n_tokens = plan.n_tokens();
        if n_tokens > self.cfg.max_tokens_per_step as usize {
            return bad(format!(
                "{n_tokens} tokens exceed the step capacity {}",
                self.cfg.max_tokens_per_step
            ));
        }
        let max_blocks = plan
            .seqs
            .iter()
            .map(|s| s.block_table.len())
            .max()
            .unwrap_or(0);
        if max_blocks > self.cfg.max_blocks_per_seq as usize {
            return bad(format!(
                "a block table of {max_blocks} blocks exceeds {}",
                self.cfg.max_blocks_per_seq
            ));
        }
        let m = &mut self.meta;
        m.tokens.clear();
        m.positions.clear();
        m.slot_mapping.clear();
        m.seqs.clear();
        m.block_tables.clear();
        m.logit_rows.clear();
        m.max_blocks = max_blocks;
        self.logit_seq.clear();
        let mut seen = vec![false; self.slots.len()];
        for (si, seq) in plan.seqs.iter().enumerate() {
            let i = seq.slot as usize;
            if i >= self.slots.len() || self.slots[i].is_none() {
                return bad(format!("sequence {si}: slot {} was not admitted", seq.slot));
            }
            if std::mem::replace(&mut seen[i], true) {
                return bad(format!("slot {} appears twice in one step", seq.slot));
            }
            if seq.tokens.is_empty() || seq.slot_mapping.len() != seq.tokens.len() {
                return bad(format!(
                    "sequence {si}: {} tokens with {} slot mappings",
                    seq.tokens.len(),
                    seq.slot_mapping.len()
                ));
            }
            let q_row = m.tokens.len() as u32;
            m.seqs.push(SeqMeta {
                q_row,
                n_q: seq.tokens.len() as u32,
                start_pos: seq.start_pos,
            });
            m.tokens.extend_from_slice(&seq.tokens);
            m.positions
                .extend((0..seq.tokens.len() as u32).map(|j| seq.start_pos + j));
            m.slot_mapping.extend_from_slice(&seq.slot_mapping);
            m.block_tables.extend_from_slice(&seq.block_table);
            m.block_tables
                .extend(std::iter::repeat_n(0, max_blocks - seq.block_table.len()));
            if seq.sample {
                m.logit_rows.push(q_row + seq.tokens.len() as u32 - 1);
                self.logit_seq.push(si);
            }
        }
        Ok(())
    }
}

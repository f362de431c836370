//! The agent's engine: owns the model runner, the paged KV pool, the per-slot sampling state, and
//! executes one `StepPlan` into one `StepResult`. This is what the agent process's step loop calls.

use std::path::PathBuf;

use npu_protocol::{StepPlan, StepResult};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// How to build an engine (sizes come from the server's config and must match the shm layout).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentEngineConfig {
    pub model_path: PathBuf,
    /// KV pool: blocks of `block_size` token slots (per layer).
    pub num_blocks: u32,
    pub block_size: u32,
    /// Request slots (most sequences held at once).
    pub max_slots: u32,
    /// Most tokens in one step (sum over sequences).
    pub max_tokens_per_step: u32,
    /// Most blocks in one sequence's table.
    pub max_blocks_per_seq: u32,
    /// Compute threads (0 = all cores).
    pub threads: u32,
}

/// What the server needs to know about the loaded model (sent in the handshake).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelFacts {
    pub name: String,
    pub architecture: String,
    pub vocab_size: u32,
    pub n_layers: u32,
    pub hidden: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// Trained context length from the model metadata.
    pub context_length: u32,
    pub eos_ids: Vec<u32>,
    pub bos_id: Option<u32>,
}

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("engine not available yet: {0}")]
    Unavailable(String),
    #[error("bad step plan: {0}")]
    BadPlan(String),
}

pub struct AgentEngine {
    _private: (),
}

impl AgentEngine {
    pub fn load(cfg: &AgentEngineConfig) -> Result<Self, EngineError> {
        Err(EngineError::Unavailable(format!(
            "model runner for {} is still being written",
            cfg.model_path.display()
        )))
    }

    pub fn facts(&self) -> &ModelFacts {
        unreachable!("no engine can be constructed yet")
    }

    pub fn step(&mut self, _plan: &StepPlan) -> Result<StepResult, EngineError> {
        Err(EngineError::Unavailable("step".into()))
    }

    /// Forget every slot (after a server-side reset).
    pub fn reset(&mut self) {}
}

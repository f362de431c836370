//! The agent's side of the contract that is not per step: how the server starts an agent (its
//! command-line arguments and engine configuration) and what the agent reports about its model in
//! the handshake.

use std::os::fd::RawFd;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

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
    /// Backend and instruction set the agent runs with.
    pub backend: String,
}

/// Command-line arguments of `npu-serving agent` (the server passes them; they hold no secret).
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct AgentArgs {
    /// Index of this agent (its device offset).
    #[arg(long)]
    pub agent_id: u32,
    /// The inherited file descriptor of this agent's end of its control socket pair.
    #[arg(long)]
    pub control_fd: RawFd,
}

impl AgentArgs {
    /// The arguments as a command line (after the `agent` subcommand).
    pub fn to_command_line(&self) -> Vec<String> {
        vec![
            "--agent-id".into(),
            self.agent_id.to_string(),
            "--control-fd".into(),
            self.control_fd.to_string(),
        ]
    }
}

//! The agent's side of the contract that is not per step: how the server starts an agent (its
//! command-line arguments and engine configuration) and what the agent reports about its model in
//! the handshake.

use std::os::fd::RawFd;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::long_context::LongContextConfig;

/// The kinds of device an agent can run on (`npu_serving.device`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
    Ascend,
}

impl DeviceKind {
    pub const ALL: [DeviceKind; 3] = [Self::Cpu, Self::Cuda, Self::Ascend];

    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Ascend => "ascend",
        }
    }

    /// The cargo feature of the `npu-serving` package that compiles this device's backend in
    /// (`None`: always built).
    pub fn cargo_feature(self) -> Option<&'static str> {
        match self {
            Self::Cpu => None,
            Self::Cuda => Some("cuda"),
            Self::Ascend => Some("ascend"),
        }
    }

    /// `cpu`, `cuda` (or `gpu`), `ascend` (or `npu`), any case.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "cpu" => Self::Cpu,
            "cuda" | "gpu" => Self::Cuda,
            "ascend" | "npu" => Self::Ascend,
            _ => return None,
        })
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s).ok_or_else(|| format!("{s:?} is not a device: one of cpu, cuda, ascend"))
    }
}

/// How to build an engine (sizes come from the server's config and must match the shm layout).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentEngineConfig {
    /// The device kind this agent runs its model on.
    #[serde(default)]
    pub device: DeviceKind,
    /// Which device of that kind (`serving_config.start_device_id` + the agent's index).
    #[serde(default)]
    pub device_id: u32,
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
    /// Host compute threads (0 = all cores): the CPU backend's kernels, and sampling on every
    /// device.
    pub threads: u32,
    /// Long-context mode (`npu_serving.long_context`): the block layout of sequences admitted
    /// as long ones; None = off.
    #[serde(default)]
    pub long_context: Option<LongContextConfig>,
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

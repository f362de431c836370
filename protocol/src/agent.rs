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
    /// KV pool: blocks of `block_size` token slots (per layer); with `kv_memory_fraction`, the
    /// most blocks the agent may allocate.
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
    /// Host memory for KV blocks (swapped-out sequences and the prefix cache's host tier), in
    /// MiB; 0: no host pool.
    #[serde(default)]
    pub swap_space_mb: u64,
    /// Long-context mode (`npu_serving.long_context`): the block layout of sequences admitted
    /// as long ones; None = off.
    #[serde(default)]
    pub long_context: Option<LongContextConfig>,
    /// The KV handoff region (prefill/decode disaggregation) this agent maps; None: no handoff.
    #[serde(default)]
    pub handoff: Option<HandoffSpec>,
    /// `npu_serving.kv_cache_memory_fraction`: when set, the agent sizes its KV pool to this
    /// fraction of the device memory free after its weights and step buffers are placed (at
    /// most `num_blocks` blocks) and reports the blocks it took in `KvFacts::device_blocks`.
    #[serde(default)]
    pub kv_memory_fraction: Option<f64>,
    /// This agent's place in a tensor-parallel group (`npu_serving.tensor_parallel_size` > 1);
    /// None: the agent runs the whole model.
    #[serde(default)]
    pub tensor_parallel: Option<TensorParallelSpec>,
    /// `npu_serving.quantize`: float weight matrices quantized into this format while loading
    /// (q8_0, q4_k, q4_0); None: as stored.
    #[serde(default)]
    pub quantize: Option<String>,
    /// `npu_serving.kv_cache_dtype`: what the KV pool stores (`auto`: f16 today).
    #[serde(default)]
    pub kv_cache_dtype: KvCacheDtype,
    /// `npu_serving.graph_capture`: decode steps captured as device graphs per batch bucket
    /// where the backend can (`auto`), or never (`off`, the default).
    #[serde(default)]
    pub graph_capture: GraphCapture,
}

/// `npu_serving.graph_capture`: whether decode steps are captured as device graphs and
/// replayed (Ascend's ACL graph; prefill and mixed steps stay eager). `auto`: where the backend
/// captures and the model allows it, else eager (logged with the reason); `off`: never.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GraphCapture {
    Auto,
    #[default]
    Off,
}

impl GraphCapture {
    /// `auto` or `off` (any case).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Some(Self::Auto),
            "off" => Some(Self::Off),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Off => "off",
        }
    }
}

impl std::fmt::Display for GraphCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for GraphCapture {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s).ok_or_else(|| format!("{s:?} is not a graph_capture setting: auto or off"))
    }
}

/// `npu_serving.kv_cache_dtype`: what each agent's KV pool stores. `auto` is f16 today; `int8`
/// (the CPU and CUDA backends) stores one byte a value and one f16 scale per token and KV head,
/// about half the bytes of f16 per token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtype {
    #[default]
    Auto,
    F16,
    Int8,
}

impl KvCacheDtype {
    /// `auto`, `f16` or `int8` (any case).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Some(Self::Auto),
            "f16" => Some(Self::F16),
            "int8" => Some(Self::Int8),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::F16 => "f16",
            Self::Int8 => "int8",
        }
    }
}

impl std::fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s)
            .ok_or_else(|| format!("{s:?} is not a KV cache dtype: one of auto, f16, int8"))
    }
}

/// An agent's place in a tensor-parallel group: its rank, the group's size and the group's
/// shared-memory region (`shm::GroupRegion`, created by the server) through which the ranks
/// sum and gather activations. Rank 0 samples and answers the step; every rank runs its shard
/// of every layer on the same plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorParallelSpec {
    pub rank: u32,
    pub size: u32,
    /// The name of the group's region.
    pub region: String,
    /// How long one collective waits for the slowest rank before the group gives up (ms).
    pub wait_ms: u64,
    /// How long a rank waits at start for the others to load their shards and join (ms).
    pub join_ms: u64,
    /// `npu_serving.moe_tensor_parallel: whole_experts`: each rank holds a range of whole
    /// routed experts; false (share_each_expert): its share of every expert's columns.
    #[serde(default)]
    pub whole_experts: bool,
}

/// Where the KV handoff region lies (`shm::HandoffRegion`): its name and bytes of block data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandoffSpec {
    pub name: String,
    pub data_bytes: u64,
}

/// The largest `kv_memory_fraction` (`npu_serving.kv_cache_memory_fraction`): the rest of the
/// free memory stays for the device's own workspaces and allocator slack.
pub const MAX_KV_MEMORY_FRACTION: f64 = 0.99;

/// The most blocks a KV pool sized from free memory may have when `pa_config.num_blocks` does
/// not cap it (the segment's copy lists are sized for it).
pub const KV_AUTO_MAX_BLOCKS: u32 = 1 << 16;

/// Most KV block copies one step may carry through the handoff region: every block of the pool
/// handed out or taken in, twice over.
pub fn handoff_copies_per_step(num_blocks: u32) -> u32 {
    num_blocks.saturating_mul(2).min(1 << 20)
}

/// Most KV block copies one step may carry for a pool of `num_blocks` device blocks: every
/// block of the pool spilled or swapped out, and every block brought back, twice over; none
/// without a host pool. The scheduler plans within it and the segment is sized by it.
pub fn kv_copies_per_step(num_blocks: u32, swap_space_mb: u64) -> u32 {
    if swap_space_mb == 0 {
        0
    } else {
        num_blocks.saturating_mul(4).min(1 << 20)
    }
}

impl AgentEngineConfig {
    /// See `kv_copies_per_step`.
    /// With a handoff region, at least `handoff_copies_per_step`.
    pub fn max_kv_copies(&self) -> u32 {
        let host = kv_copies_per_step(self.num_blocks, self.swap_space_mb);
        match self.handoff {
            Some(_) => host.max(handoff_copies_per_step(self.num_blocks)),
            None => host,
        }
    }

    /// Blocks of `block_bytes` that `swap_space_mb` holds (the agent's host KV pool).
    pub fn host_kv_blocks(&self, block_bytes: u64) -> u32 {
        if block_bytes == 0 {
            return 0;
        }
        let bytes = self.swap_space_mb.saturating_mul(1 << 20);
        (bytes / block_bytes).min(u32::MAX as u64) as u32
    }
}

/// The agent's KV pools and how fast blocks move between them (sent in the handshake).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct KvFacts {
    /// Blocks in the agent's device KV pool (`num_blocks`, or what the memory fraction gave).
    #[serde(default)]
    pub device_blocks: u32,
    /// Bytes of one KV block (every layer's K and V): the unit of every device<->host copy.
    pub block_bytes: u64,
    /// Blocks in the agent's host KV pool (0: none).
    pub host_blocks: u32,
    /// Whether the host pool is page-locked (or registered) memory the device copies to directly.
    pub host_page_locked: bool,
    /// Measured at start: device->host and host->device block copy bandwidth, bytes per second.
    pub d2h_bytes_per_s: f64,
    pub h2d_bytes_per_s: f64,
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
    /// KV pool facts: block size in bytes, host pool, copy bandwidth.
    #[serde(default)]
    pub kv: KvFacts,
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

/// An agent's LoRA settings (`npu_serving.max_loras`, `npu_serving.max_lora_rank`). They travel
/// in the Setup's engine-config JSON under the key [`LORA_CONFIG_KEY`], beside the
/// `AgentEngineConfig` fields (which ignore it); absent: the agent takes no adapters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentLoraConfig {
    /// Adapter slots on the device (adapters resident at once).
    pub max_loras: u32,
    /// Largest adapter rank a slot holds.
    pub max_lora_rank: u32,
}

/// The key of [`AgentLoraConfig`] in the Setup's engine-config JSON.
pub const LORA_CONFIG_KEY: &str = "lora";

impl AgentLoraConfig {
    /// `engine_json` (an `AgentEngineConfig` as JSON) with `lora` added under its key.
    pub fn add_to(lora: Option<&Self>, engine_json: &str) -> Result<String, serde_json::Error> {
        let Some(lora) = lora else {
            return Ok(engine_json.to_string());
        };
        let mut v: serde_json::Value = serde_json::from_str(engine_json)?;
        if let serde_json::Value::Object(m) = &mut v {
            m.insert(LORA_CONFIG_KEY.into(), serde_json::to_value(lora)?);
        }
        serde_json::to_string(&v)
    }

    /// The LoRA settings in an engine-config JSON, if any.
    pub fn read_from(engine_json: &str) -> Result<Option<Self>, serde_json::Error> {
        let v: serde_json::Value = serde_json::from_str(engine_json)?;
        match v.get(LORA_CONFIG_KEY) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(l) => Ok(Some(serde_json::from_value(l.clone())?)),
        }
    }
}

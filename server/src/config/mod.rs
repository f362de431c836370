//! The server's YAML config: llm-serving's schema as users already write it (model_config,
//! serving_config, pa_config, tokenizer, ...) plus our own `npu_serving:` section, loaded into
//! typed structs with defaults, validated at load with errors that name the key.

mod access;
mod error;
mod lora;
mod models;
mod reader;
mod responses;
mod roles;
mod sections;
mod sleep;
mod speculative;

use std::path::{Path, PathBuf};
use std::time::Duration;

pub(crate) use access::check_key;
pub use access::{AccessConfig, ApiKeySource, TlsFiles};
pub use error::{ConfigError, ConfigWarning};
pub use lora::{expand_home_path, LoraConfig, LoraEntry};
pub use models::{ModelEntry, ModelsConfig};
pub(crate) use reader::closest;
pub use reader::parse_bool_str;
pub use responses::ResponsesConfig;
pub use roles::{AgentRole, MAX_HANDOFF_SPACE_MB};
pub use sleep::SleepConfig;

use crate::http::HttpLimits;

/// llm-serving's `model_config` section (the keys that mean something here).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Served model name (`/v1/models`, `/serving/get_serverd_model_info`).
    pub model_name: String,
    /// Cap on prompt + generated tokens of one request, when set.
    pub max_generate_length: Option<u32>,
    /// Extra end-of-sequence token ids from the config (besides the model's own EOS ids).
    pub end_token: Vec<u32>,
    /// Sequence length buckets; the largest is the context limit from the config.
    pub seq_length: Option<Vec<u32>>,
    pub vocab_size: Option<u32>,
    /// Prefill batch buckets; the largest caps new prompts admitted per step.
    pub prefill_batch_size: Vec<u32>,
    /// Decode batch buckets; the largest caps running sequences per agent.
    pub decode_batch_size: Vec<u32>,
    pub batching_strategy: BatchingStrategy,
    /// Kept only to report it (`/serving/get_serverd_model_info`); weights' types come from the GGUF.
    pub model_dtype: Option<String>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            model_name: "SmolLM2-135M-Instruct".into(),
            max_generate_length: None,
            end_token: Vec::new(),
            seq_length: None,
            vocab_size: None,
            prefill_batch_size: vec![8],
            decode_batch_size: vec![64],
            batching_strategy: BatchingStrategy::Continuous,
            model_dtype: None,
        }
    }
}

/// `model_config.batching_strategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchingStrategy {
    Continuous,
    Static,
}

/// llm-serving's `serving_config` section.
#[derive(Debug, Clone, PartialEq)]
pub struct ServingConfig {
    /// One entry per agent: the number of agents. The values are not used (agents talk to the
    /// server over private socket pairs; no port is opened for them).
    pub agent_ports: Vec<u16>,
    pub start_device_id: u32,
    pub server_ip: String,
    /// 0 lets the OS choose (tests).
    pub server_port: u16,
}

impl Default for ServingConfig {
    fn default() -> Self {
        Self {
            agent_ports: vec![0],
            start_device_id: 0,
            server_ip: "127.0.0.1".into(),
            server_port: 8835,
        }
    }
}

/// llm-serving's `pa_config` section (paged attention KV pool, per agent).
#[derive(Debug, Clone, PartialEq)]
pub struct PaConfig {
    pub num_blocks: u32,
    /// Whether the file gave `num_blocks` (with `npu_serving.kv_cache_memory_fraction` it is
    /// then the most blocks the pool may have).
    pub num_blocks_set: bool,
    pub block_size: u32,
    /// Longest sequence paged decoding serves, when set (another cap on the context length).
    pub decode_seq_length: Option<u32>,
}

impl Default for PaConfig {
    fn default() -> Self {
        Self {
            num_blocks: 2048,
            num_blocks_set: false,
            block_size: 16,
            decode_seq_length: None,
        }
    }
}

pub use npu_protocol::agent::{DeviceKind, GraphCapture, KvCacheDtype};

/// The context limit in long-context mode when no key sets a lower one (prompt + generated
/// tokens of one request).
pub const LONG_CONTEXT_MAX_LEN: u32 = 1 << 20;

/// `npu_serving.generation_config`: what a Hugging Face model directory's
/// `generation_config.json` does (a GGUF file has none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GenerationConfigMode {
    /// Its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens are the
    /// defaults of requests that do not set them (vLLM's `--generation-config auto`).
    #[default]
    Auto,
    /// Not read for sampling: requests default as for a GGUF model (vLLM's
    /// `--generation-config vllm`). Its `eos_token_id` still ends generation.
    Ignore,
}

impl GenerationConfigMode {
    /// The value's YAML name: `auto` or `ignore`.
    pub fn from_name(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Some(Self::Auto),
            "ignore" => Some(Self::Ignore),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Ignore => "ignore",
        }
    }
}

/// Our own settings: the `npu_serving:` section.
#[derive(Debug, Clone, PartialEq)]
pub struct NpuServingConfig {
    /// The model: a GGUF file, a Hugging Face directory, or `ORG/NAME` in the local Hugging
    /// Face cache; None = the default model (`npu_gguf::store::resolve_model(None)`).
    pub model_file: Option<PathBuf>,
    /// `quantize`: float weight matrices quantized into this format while loading (q8_0, q4_k,
    /// q4_0); None (`none`): as stored.
    pub quantize: Option<String>,
    /// `kv_cache_dtype`: what the KV pools store (auto = f16; int8 on the CPU and CUDA backends).
    pub kv_cache_dtype: KvCacheDtype,
    /// `graph_capture`: decode steps captured as device graphs where the backend and the model
    /// allow it (auto, the default) or never (off).
    pub graph_capture: GraphCapture,
    pub device: DeviceKind,
    /// Threads each agent uses; 0 = all cores divided among the agents.
    pub threads_per_agent: u32,
    /// Token budget of one step (chunked prefill).
    pub max_tokens_per_step: u32,
    pub prefix_cache: bool,
    /// Host memory for KV blocks per agent, in MiB: swapped-out sequences and the prefix
    /// cache's host tier. 0: no host pool (preemption recomputes, evicted prefixes are lost).
    pub swap_space_mb: u64,
    /// Waiting requests before new ones get 429.
    pub max_queue: u32,
    pub max_body_bytes: u64,
    pub max_header_bytes: u32,
    /// A request's head (and then its body) must arrive within this time, else 408.
    pub header_timeout_ms: u64,
    /// An agent step taking longer than this counts as a hung agent.
    pub step_deadline_ms: u64,
    /// max_new_tokens when a request does not say.
    pub max_new_tokens_default: u32,
    /// Whether the file gave `max_new_tokens_default` (it then wins over a model directory's
    /// generation_config.json `max_new_tokens`).
    pub max_new_tokens_default_set: bool,
    /// `generation_config`: whether a model directory's generation_config.json sets the
    /// sampling defaults of requests (vLLM's `--generation-config auto`) or not.
    pub generation_config: GenerationConfigMode,
    /// Context limit (prompt + generated); None = min(seq_length, model context).
    pub max_model_len: Option<u32>,
    /// On shutdown, how long running requests may take to finish before they are aborted.
    pub shutdown_grace_ms: u64,
    /// Model names the OpenAI routes answer to (the first is listed first by /v1/models);
    /// empty = `model_config.model_name` alone.
    pub served_model_names: Vec<String>,
    /// Long-context mode (InfLLM: bounded device KV per sequence, the middle in host memory);
    /// None = off. See `npu_protocol::long_context`.
    pub long_context: Option<npu_protocol::LongContextConfig>,
    /// Each agent's role (prefill/decode disaggregation), one per agent; empty: every agent
    /// prefills and decodes.
    pub agent_roles: Vec<AgentRole>,
    /// Shared memory through which prefill agents hand KV blocks to decode agents, in MiB
    /// (used only when some agent's role is not `both`).
    pub handoff_space_mb: u64,
    /// When set, each agent's KV pool takes this fraction of the device memory free after its
    /// weights and step buffers are placed (at most `pa_config.num_blocks` blocks when that key
    /// is given); None: exactly `pa_config.num_blocks`.
    pub kv_cache_memory_fraction: Option<f64>,
    /// Ranks of one tensor-parallel group: the agents form `agents / tensor_parallel_size`
    /// groups of this many ranks, each group one model split over its ranks (1: every agent
    /// runs the whole model, as before).
    pub tensor_parallel_size: u32,
    /// How a tensor-parallel group splits an MoE model's routed experts
    /// (`moe_tensor_parallel`): each rank its share of every expert's columns, or whole
    /// experts per rank.
    pub moe_tensor_parallel: npu_model::shard::ExpertSplit,
    /// Where KV-cache events are published (`kv_events_endpoint`, `kv_events_topic`); None:
    /// not published.
    pub kv_events: Option<crate::kv_events::KvEventsConfig>,
    /// Speculative decoding with n-gram drafts (`speculative`); None: off.
    pub speculative: Option<npu_scheduler::SpeculativeConfig>,
    /// API keys, whether the health routes need one, TLS (`api_keys`, `protect_health`, `tls`).
    pub access: AccessConfig,
    /// The Responses API store (`responses_store_size`, `responses_ttl_s`).
    pub responses: ResponsesConfig,
    /// Sleeping by itself when idle (`sleep_idle_seconds`, `sleep_idle_level`).
    pub sleep: SleepConfig,
    /// Several models behind one server (`models`, `max_resident_models`); no entries: one.
    pub models: ModelsConfig,
    /// LoRA adapters (`lora_adapters`, `max_loras`, `max_lora_rank`); None: off.
    pub lora: Option<LoraConfig>,
}

impl Default for NpuServingConfig {
    fn default() -> Self {
        Self {
            model_file: None,
            quantize: None,
            kv_cache_dtype: KvCacheDtype::Auto,
            graph_capture: GraphCapture::Auto,
            device: DeviceKind::Cpu,
            threads_per_agent: 0,
            max_tokens_per_step: 128,
            prefix_cache: true,
            swap_space_mb: 0,
            max_queue: 1024,
            max_body_bytes: 1 << 20,
            max_header_bytes: 16 * 1024,
            header_timeout_ms: 10_000,
            step_deadline_ms: 30_000,
            max_new_tokens_default: 256,
            max_new_tokens_default_set: false,
            generation_config: GenerationConfigMode::Auto,
            max_model_len: None,
            shutdown_grace_ms: 30_000,
            served_model_names: Vec::new(),
            long_context: None,
            agent_roles: Vec::new(),
            handoff_space_mb: 256,
            kv_cache_memory_fraction: None,
            tensor_parallel_size: 1,
            moe_tensor_parallel: npu_model::shard::ExpertSplit::default(),
            kv_events: None,
            speculative: None,
            access: AccessConfig::default(),
            responses: ResponsesConfig::default(),
            sleep: SleepConfig::default(),
            models: ModelsConfig::default(),
            lora: None,
        }
    }
}

/// The whole config, with the warnings its loading produced (already logged).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServerConfig {
    pub model_config: ModelConfig,
    pub serving_config: ServingConfig,
    pub pa_config: PaConfig,
    pub npu_serving: NpuServingConfig,
    /// Keys accepted without effect and unknown keys, one entry each.
    pub warnings: Vec<ConfigWarning>,
}

impl ServerConfig {
    pub fn from_yaml_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        Self::from_yaml_file_with(path, false)
    }

    /// `from_yaml_file`; `strict` makes every unknown key an error (`--strict-config`).
    pub fn from_yaml_file_with(path: impl AsRef<Path>, strict: bool) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_yaml_str_with(&text, strict)
    }

    /// Parses and validates; each warning is logged once with `tracing::warn!`. Unknown keys
    /// warn in llm-serving's sections and are errors in `npu_serving`.
    pub fn from_yaml_str(text: &str) -> Result<Self, ConfigError> {
        Self::from_yaml_str_with(text, false)
    }

    /// `from_yaml_str`; `strict` makes every unknown key an error (`--strict-config`).
    pub fn from_yaml_str_with(text: &str, strict: bool) -> Result<Self, ConfigError> {
        let cfg = sections::parse(text, strict)?;
        for w in &cfg.warnings {
            tracing::warn!(key = %w.path, "config: {}", w.message);
        }
        Ok(cfg)
    }

    /// Running sequences per agent (the largest decode bucket).
    pub fn decode_batch_size(&self) -> u32 {
        largest(&self.model_config.decode_batch_size).unwrap_or(1)
    }

    /// New prompts admitted per step (the largest prefill bucket).
    pub fn prefill_batch_size(&self) -> u32 {
        largest(&self.model_config.prefill_batch_size).unwrap_or(1)
    }

    /// The largest `model_config.seq_length`, when given.
    pub fn seq_length(&self) -> Option<u32> {
        self.model_config.seq_length.as_deref().and_then(largest)
    }

    /// Context limit (prompt + generated tokens): the smallest of `npu_serving.max_model_len`,
    /// `model_config.seq_length`, `pa_config.decode_seq_length` and the model's own context.
    pub fn max_model_len(&self, model_context: u32) -> u32 {
        let model_context = self.context_cap(model_context);
        [
            self.npu_serving.max_model_len,
            self.seq_length(),
            self.pa_config.decode_seq_length,
            Some(model_context),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(model_context)
    }

    /// The longest sequence (prompt + generated) a request may reach, and the key that sets it:
    /// `max_model_len` and `model_config.max_generate_length`, whichever is smaller.
    pub fn longest_sequence(&self, model_context: u32) -> (u32, &'static str) {
        let model_context = self.context_cap(model_context);
        let candidates = [
            (self.npu_serving.max_model_len, "npu_serving.max_model_len"),
            (self.seq_length(), "model_config.seq_length"),
            (
                self.pa_config.decode_seq_length,
                "pa_config.decode_seq_length",
            ),
            (
                self.model_config.max_generate_length,
                "model_config.max_generate_length",
            ),
            (Some(model_context), "the model's context length"),
        ];
        candidates
            .into_iter()
            .filter_map(|(v, key)| Some((v?, key)))
            .min_by_key(|&(v, _)| v)
            .unwrap_or((model_context, "the model's context length"))
    }

    /// The limit the model's own context sets: its training length, or in long-context mode
    /// (which goes past it) `LONG_CONTEXT_MAX_LEN`.
    fn context_cap(&self, model_context: u32) -> u32 {
        if self.npu_serving.long_context.is_some() {
            LONG_CONTEXT_MAX_LEN
        } else {
            model_context
        }
    }

    /// The blocks the server plans for before the agents start: `pa_config.num_blocks`, or with
    /// a memory fraction the most the agents may allocate (`pa_config.num_blocks` when given,
    /// else `KV_AUTO_MAX_BLOCKS`). The agents' handshakes then say what they have.
    pub fn kv_pool_blocks_planned(&self) -> u32 {
        match self.npu_serving.kv_cache_memory_fraction {
            Some(_) if !self.pa_config.num_blocks_set => npu_protocol::agent::KV_AUTO_MAX_BLOCKS,
            _ => self.pa_config.num_blocks,
        }
    }

    /// `check_kv_pool_blocks` on `pa_config.num_blocks`; with a memory fraction nothing yet (the
    /// pool's size is known once the agents have sized theirs).
    pub fn check_kv_pool(&self, model_context: u32) -> Result<(), ConfigError> {
        if self.npu_serving.kv_cache_memory_fraction.is_some() {
            return Ok(());
        }
        self.check_kv_pool_blocks(model_context, self.pa_config.num_blocks)
    }

    /// Refuses a KV pool (`num_blocks` x `block_size` token slots per agent) that cannot hold
    /// one sequence of the longest length a request may reach: such a request could never run
    /// (in long-context mode: one sequence's `device_blocks`). The error names the keys and
    /// the values that would work.
    pub fn check_kv_pool_blocks(
        &self,
        model_context: u32,
        num_blocks: u32,
    ) -> Result<(), ConfigError> {
        let (pool_path, raise) = match self.npu_serving.kv_cache_memory_fraction {
            Some(_) => (
                "npu_serving.kv_cache_memory_fraction",
                "npu_serving.kv_cache_memory_fraction (or free device memory) so the pool has",
            ),
            None => ("pa_config.num_blocks", "pa_config.num_blocks to"),
        };
        if let Some(lc) = &self.npu_serving.long_context {
            if num_blocks < lc.device_blocks {
                return Err(ConfigError::not_allowed(
                    "npu_serving.long_context.device_blocks",
                    lc.device_blocks,
                    format!(
                        "at most the KV pool's {num_blocks} blocks ({pool_path}): one sequence \
                         holds that many blocks"
                    ),
                ));
            }
            return Ok(());
        }
        let (limit, limit_path) = self.longest_sequence(model_context);
        let pa = &self.pa_config;
        let slots = u64::from(num_blocks) * u64::from(pa.block_size);
        if slots >= u64::from(limit) {
            return Ok(());
        }
        let lower = if limit_path.starts_with("the model") {
            "model_config.seq_length"
        } else {
            limit_path
        };
        Err(ConfigError::PoolTooSmall {
            pool_path,
            raise,
            num_blocks,
            block_size: pa.block_size,
            slots,
            limit_path,
            limit,
            blocks_needed: u64::from(limit).div_ceil(u64::from(pa.block_size.max(1))),
            lower,
        })
    }

    /// The names `/v1/*` requests may give as `model`: `npu_serving.served_model_names`, or
    /// `model_config.model_name` when that is not set.
    pub fn served_model_names(&self) -> Vec<String> {
        if self.npu_serving.served_model_names.is_empty() {
            vec![self.model_config.model_name.clone()]
        } else {
            self.npu_serving.served_model_names.clone()
        }
    }

    pub fn max_generate_length(&self) -> Option<u32> {
        self.model_config.max_generate_length
    }

    pub fn num_agents(&self) -> usize {
        self.serving_config.agent_ports.len()
    }

    /// Ranks of a tensor-parallel group (`npu_serving.tensor_parallel_size`).
    pub fn tensor_parallel_size(&self) -> usize {
        self.npu_serving.tensor_parallel_size.max(1) as usize
    }

    /// Groups the agents form (each runs one copy of the model; with a size of 1, the agents).
    pub fn num_groups(&self) -> usize {
        (self.num_agents() / self.tensor_parallel_size()).max(1)
    }

    /// Each agent's role (every agent `both` unless `npu_serving.agent_roles` says otherwise).
    pub fn agent_roles(&self) -> Vec<AgentRole> {
        let n = self.num_agents().max(1);
        let given = &self.npu_serving.agent_roles;
        (0..n)
            .map(|i| given.get(i).copied().unwrap_or_default())
            .collect()
    }

    /// Whether prefill and decode run on different agents (some role is not `both`).
    pub fn disaggregated(&self) -> bool {
        self.npu_serving
            .agent_roles
            .iter()
            .any(|r| *r != AgentRole::Both)
    }

    /// `server_ip:server_port`, ready for `TcpListener::bind`.
    pub fn server_addr(&self) -> String {
        let ip = &self.serving_config.server_ip;
        if ip.contains(':') {
            format!("[{ip}]:{}", self.serving_config.server_port)
        } else {
            format!("{ip}:{}", self.serving_config.server_port)
        }
    }

    pub fn model_name(&self) -> &str {
        &self.model_config.model_name
    }

    /// Token ids from `model_config.end_token` that end generation besides the model's EOS ids.
    pub fn end_token_ids(&self) -> &[u32] {
        &self.model_config.end_token
    }

    pub fn step_deadline(&self) -> Duration {
        Duration::from_millis(self.npu_serving.step_deadline_ms)
    }

    /// Warnings about config values that the loaded model overrides: `model_config.vocab_size`
    /// different from the model's, and context limits beyond the model's context. Logged too.
    pub fn model_warnings(&self, model_vocab: u32, model_context: u32) -> Vec<ConfigWarning> {
        let mut out = Vec::new();
        if let Some(v) = self.model_config.vocab_size {
            if v != model_vocab {
                out.push(ConfigWarning {
                    path: "model_config.vocab_size".into(),
                    message: format!("ignored: {v} differs from the model's vocabulary ({model_vocab}); the model's is used"),
                });
            }
        }
        let limits = [
            ("npu_serving.max_model_len", self.npu_serving.max_model_len),
            ("model_config.seq_length", self.seq_length()),
            (
                "pa_config.decode_seq_length",
                self.pa_config.decode_seq_length,
            ),
        ];
        for (path, v) in limits {
            if let Some(v) = v.filter(|&v| v > model_context) {
                out.push(ConfigWarning {
                    path: path.into(),
                    message: format!("{v} is beyond the model's context ({model_context}); using {model_context}"),
                });
            }
        }
        for w in &out {
            tracing::warn!(key = %w.path, "config: {}", w.message);
        }
        out
    }

    /// The HTTP layer's limits.
    pub fn http_limits(&self) -> HttpLimits {
        let n = &self.npu_serving;
        HttpLimits {
            max_body_bytes: n.max_body_bytes,
            max_header_bytes: n.max_header_bytes as usize,
            header_timeout: Duration::from_millis(n.header_timeout_ms),
            shutdown_grace: Duration::from_millis(n.shutdown_grace_ms),
            max_queue: u64::from(n.max_queue),
            ..HttpLimits::default()
        }
    }
}

fn largest(v: &[u32]) -> Option<u32> {
    v.iter().copied().max()
}

//! The engine loop's typed settings (the scheduler limits of each agent, step deadline, restart
//! policy and idle watch, shutdown grace), their defaults, and how they follow from the server config.

use std::time::Duration;

use super::agent_thread::AgentThreadSettings;
use super::scheduler::{BatchingPolicy, SchedulerConfig};
use crate::config::{AgentRole, BatchingStrategy, ServerConfig, SleepConfig};

/// Settings of the engine loop.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Limits of each agent's scheduler (every agent, or tensor-parallel group, is a full
    /// replica with the same pool).
    pub scheduler: SchedulerConfig,
    /// A step taking longer counts as a hung agent: it is killed and restarted.
    pub step_deadline: Duration,
    /// A failed agent is restarted at once; after a failed attempt the next one waits this
    /// long, doubled after each further failure up to `restart_backoff_max`. Attempts go on
    /// for as long as the server runs.
    pub restart_backoff: Duration,
    pub restart_backoff_max: Duration,
    /// How often an idle agent is looked at (process exit, closed control socket).
    pub agent_watch_interval: Duration,
    /// After a shutdown request, how long running requests may take before they are ended
    /// with `FinishReason::Shutdown`.
    pub shutdown_grace: Duration,
    /// How often an idle loop looks at the shutdown signal.
    pub idle_tick: Duration,
    /// Each agent's role (prefill/decode disaggregation); empty or short: `Both`.
    pub roles: Vec<AgentRole>,
    /// Blocks of the KV handoff region (0: prefill and decode colocated), and their size.
    pub handoff_blocks: u32,
    pub handoff_block_bytes: u64,
    /// Agent processes behind each engine agent: the ranks of a tensor-parallel group (1: each
    /// engine agent is one agent process). Only counted (/health, /metrics).
    pub tensor_parallel_size: u32,
    /// Sleeping by itself after a time without requests.
    pub sleep: SleepConfig,
    /// The served LoRA adapters (None: LoRA off).
    pub lora: Option<crate::lora::LoraHandle>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            scheduler: SchedulerConfig::default(),
            step_deadline: Duration::from_secs(30),
            restart_backoff: Duration::from_millis(500),
            restart_backoff_max: Duration::from_secs(30),
            agent_watch_interval: Duration::from_millis(50),
            shutdown_grace: Duration::from_secs(29),
            idle_tick: Duration::from_millis(20),
            roles: Vec::new(),
            handoff_blocks: 0,
            handoff_block_bytes: 0,
            tensor_parallel_size: 1,
            sleep: SleepConfig::default(),
            lora: None,
        }
    }
}

impl EngineConfig {
    /// The engine settings for `cfg`, with the context limit `max_model_len` (config and model
    /// combined) and the token ids that end generation (the model's and `end_token`).
    pub fn from_server_config(cfg: &ServerConfig, max_model_len: u32, eos_ids: Vec<u32>) -> Self {
        let block_size = cfg.pa_config.block_size as usize;
        let scheduler = SchedulerConfig {
            kv_host: None,
            num_blocks: cfg.kv_pool_blocks_planned() as usize,
            block_size,
            max_running: cfg.decode_batch_size() as usize,
            max_new_prompts_per_step: cfg.prefill_batch_size() as usize,
            max_tokens_per_step: cfg.npu_serving.max_tokens_per_step as usize,
            max_slots: None,
            // Long-context mode bounds every table by its budget, however long the context.
            max_blocks_per_seq: match &cfg.npu_serving.long_context {
                Some(lc) => lc.device_blocks as usize,
                None => (max_model_len as usize).div_ceil(block_size.max(1)),
            },
            max_model_len: max_model_len as usize,
            max_generate_length: cfg.max_generate_length().map(|g| g as usize),
            policy: match cfg.model_config.batching_strategy {
                BatchingStrategy::Continuous => BatchingPolicy::Continuous,
                BatchingStrategy::Static => BatchingPolicy::Static,
            },
            prefix_cache: cfg.npu_serving.prefix_cache,
            eos_ids,
            long_context: cfg.npu_serving.long_context,
            handoff_copies_per_step: 0,
            speculative: cfg.npu_serving.speculative,
        };
        // The HTTP side aborts what is left when its grace ends; the engine ends requests a
        // little earlier so that their clients get the reason.
        let grace = Duration::from_millis(cfg.npu_serving.shutdown_grace_ms);
        let margin = (grace / 10).min(Duration::from_secs(1));
        Self {
            scheduler,
            step_deadline: cfg.step_deadline(),
            shutdown_grace: grace - margin,
            sleep: cfg.npu_serving.sleep,
            roles: if cfg.disaggregated() {
                cfg.agent_roles()
            } else {
                Vec::new()
            },
            ..Self::default()
        }
    }

    pub(crate) fn thread_settings(&self) -> AgentThreadSettings {
        AgentThreadSettings {
            step_deadline: self.step_deadline,
            restart_backoff: self.restart_backoff,
            restart_backoff_max: self.restart_backoff_max,
            watch_interval: self.agent_watch_interval,
        }
    }
}

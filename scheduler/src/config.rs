//! The scheduler's typed configuration (one agent's KV pool and batching limits), its defaults,
//! and its validation.

use npu_protocol::{LongContextConfig, LongContextLayout};

use super::error::SchedError;
use super::speculative::SpeculativeConfig;

/// How requests are grouped into steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchingPolicy {
    /// Every step mixes decode tokens of running sequences with prefill chunks of new ones.
    #[default]
    Continuous,
    /// llm-serving's `batching_strategy: static`: a batch of up to `max_running` requests is
    /// admitted together, and no new request is admitted until all of that batch have finished.
    Static,
}

/// Limits of one scheduler (one agent's KV pool).
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// KV blocks in the agent's pool (`pa_config.num_blocks`).
    pub num_blocks: usize,
    /// Token slots per KV block (`pa_config.block_size`).
    pub block_size: usize,
    /// Most sequences running at once (`model_config.decode_batch_size`).
    pub max_running: usize,
    /// Most requests admitted in one step (`model_config.prefill_batch_size`); continuous policy.
    pub max_new_prompts_per_step: usize,
    /// Token budget of one step (decode tokens plus prefill chunks).
    pub max_tokens_per_step: usize,
    /// Request slots the agent holds; `None` means `max_running`.
    pub max_slots: Option<usize>,
    /// Longest block table of one sequence.
    pub max_blocks_per_seq: usize,
    /// Context limit: prompt plus generated tokens must fit.
    pub max_model_len: usize,
    /// Optional cap on prompt plus generated tokens (`model_config.max_generate_length`).
    pub max_generate_length: Option<usize>,
    pub policy: BatchingPolicy,
    /// Share full KV blocks between requests with the same token prefix.
    pub prefix_cache: bool,
    /// Token ids that end generation (unless a request sets `ignore_eos`).
    pub eos_ids: Vec<u32>,
    /// The agent's host KV pool (swap preemption, the prefix cache's host tier); None: no host
    /// pool, preemption recomputes.
    pub kv_host: Option<KvHostConfig>,
    /// Long-context mode (`npu_protocol::long_context`): every sequence holds at most
    /// `device_blocks` blocks, however long; the prefix cache is off (ring blocks are rewritten).
    pub long_context: Option<LongContextConfig>,
    /// Most copies through the KV handoff region one plan may carry (prefill/decode
    /// disaggregation; the segment's capacity); 0: no handoff.
    pub handoff_copies_per_step: usize,
    /// Speculative decoding with n-gram drafts; None: off.
    pub speculative: Option<SpeculativeConfig>,
}

/// The agent's host KV pool and what moving a block costs (from the agent's handshake).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvHostConfig {
    /// Blocks in the host pool (`swap_space_mb` over the block size).
    pub host_blocks: usize,
    /// Bytes of one block (every layer's K and V).
    pub block_bytes: u64,
    /// Measured block copy bandwidth, bytes per second.
    pub d2h_bytes_per_s: f64,
    pub h2d_bytes_per_s: f64,
    /// Most copies one plan may carry (the segment's capacity).
    pub max_copies_per_step: usize,
}

impl KvHostConfig {
    /// Seconds to copy `blocks` out to the host and back.
    pub fn round_trip_s(&self, blocks: usize) -> f64 {
        let bytes = blocks as f64 * self.block_bytes as f64;
        bytes / self.d2h_bytes_per_s + bytes / self.h2d_bytes_per_s
    }

    /// Seconds to copy `blocks` from the host to the device.
    pub fn to_device_s(&self, blocks: usize) -> f64 {
        blocks as f64 * self.block_bytes as f64 / self.h2d_bytes_per_s
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            num_blocks: 1024,
            block_size: 16,
            max_running: 16,
            max_new_prompts_per_step: 8,
            max_tokens_per_step: 512,
            max_slots: None,
            max_blocks_per_seq: 128,
            max_model_len: 2048,
            max_generate_length: None,
            policy: BatchingPolicy::Continuous,
            prefix_cache: true,
            eos_ids: Vec::new(),
            kv_host: None,
            long_context: None,
            handoff_copies_per_step: 0,
            speculative: None,
        }
    }
}

impl SchedulerConfig {
    /// Request slots the agent holds.
    pub fn slots(&self) -> usize {
        self.max_slots.unwrap_or(self.max_running)
    }

    /// Blocks one sequence can ever hold: limited by its table and by the pool.
    pub fn max_blocks_one_seq(&self) -> usize {
        self.num_blocks.min(self.max_blocks_per_seq)
    }

    /// The long-context layout, when that mode is on and its settings are valid.
    pub fn long_context_layout(&self) -> Option<LongContextLayout> {
        let cfg = self.long_context?;
        LongContextLayout::new(cfg, u32::try_from(self.block_size).ok()?).ok()
    }

    /// Longest prompt-plus-generated length any sequence may reach: the context limit, the
    /// optional generate-length cap, and the KV room one sequence can have (unbounded in
    /// long-context mode).
    pub fn max_total_len(&self) -> usize {
        let kv_tokens = if self.long_context.is_some() {
            usize::MAX
        } else {
            self.max_blocks_one_seq().saturating_mul(self.block_size)
        };
        let mut limit = self.max_model_len.min(kv_tokens);
        if let Some(g) = self.max_generate_length {
            limit = limit.min(g);
        }
        limit
    }

    /// Checks every limit; the error names the field, its value and what is allowed.
    pub fn validate(&self) -> Result<(), SchedError> {
        fn at_least(field: &'static str, value: usize, min: usize) -> Result<(), SchedError> {
            if value < min {
                return Err(SchedError::InvalidConfig {
                    field,
                    reason: format!("is {value}, must be at least {min}"),
                });
            }
            Ok(())
        }
        at_least("num_blocks", self.num_blocks, 1)?;
        at_least("block_size", self.block_size, 1)?;
        at_least("max_running", self.max_running, 1)?;
        at_least("max_new_prompts_per_step", self.max_new_prompts_per_step, 1)?;
        at_least("max_tokens_per_step", self.max_tokens_per_step, 1)?;
        at_least("max_blocks_per_seq", self.max_blocks_per_seq, 1)?;
        at_least("max_model_len", self.max_model_len, 2)?;
        if let Some(slots) = self.max_slots {
            at_least("max_slots", slots, 1)?;
            if slots > u32::MAX as usize {
                return Err(SchedError::InvalidConfig {
                    field: "max_slots",
                    reason: format!("is {slots}, must fit in 32 bits"),
                });
            }
        }
        if let Some(g) = self.max_generate_length {
            at_least("max_generate_length", g, 2)?;
        }
        if let Some(h) = &self.kv_host {
            at_least("kv_host.host_blocks", h.host_blocks, 1)?;
            at_least("kv_host.max_copies_per_step", h.max_copies_per_step, 1)?;
            at_least("kv_host.block_bytes", h.block_bytes as usize, 1)?;
            for (field, v) in [
                ("kv_host.d2h_bytes_per_s", h.d2h_bytes_per_s),
                ("kv_host.h2d_bytes_per_s", h.h2d_bytes_per_s),
            ] {
                if !(v.is_finite() && v > 0.0) {
                    return Err(SchedError::InvalidConfig {
                        field,
                        reason: format!("is {v}, must be a positive measured rate"),
                    });
                }
            }
        }
        let pool_slots = (self.num_blocks as u128) * (self.block_size as u128);
        if pool_slots > u32::MAX as u128 {
            return Err(SchedError::InvalidConfig {
                field: "num_blocks",
                reason: format!(
                    "num_blocks {} x block_size {} = {pool_slots} KV slots, more than 32-bit slot ids \
                     can address",
                    self.num_blocks, self.block_size
                ),
            });
        }
        if let Some(lc) = &self.long_context {
            let bs = u32::try_from(self.block_size).unwrap_or(u32::MAX);
            lc.validate(bs).map_err(|e| SchedError::InvalidConfig {
                field: "long_context",
                reason: e.to_string(),
            })?;
            let room = self.max_blocks_one_seq();
            if lc.device_blocks as usize > room {
                return Err(SchedError::InvalidConfig {
                    field: "long_context",
                    reason: format!(
                        "device_blocks {} is more than one sequence can hold (min(num_blocks {}, \
                         max_blocks_per_seq {}) = {room})",
                        lc.device_blocks, self.num_blocks, self.max_blocks_per_seq
                    ),
                });
            }
        }
        if let Some(sp) = &self.speculative {
            sp.validate()?;
            if self.long_context.is_some() {
                return Err(SchedError::InvalidConfig {
                    field: "speculative",
                    reason: "is set with long_context (drafts do not run in long-context mode)"
                        .into(),
                });
            }
        }
        if self.max_total_len() < 2 {
            return Err(SchedError::InvalidConfig {
                field: "max_blocks_per_seq",
                reason: format!(
                    "one sequence can hold only {} tokens (min(num_blocks {}, max_blocks_per_seq {}) \
                     x block_size {}, max_model_len {}); at least 2 are needed",
                    self.max_total_len(),
                    self.num_blocks,
                    self.max_blocks_per_seq,
                    self.block_size,
                    self.max_model_len
                ),
            });
        }
        Ok(())
    }
}

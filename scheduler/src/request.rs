//! One request inside the scheduler: its prompt and generated tokens, its length limits, and,
//! while admitted, its slot, block table and how far its KV has been computed. Also the checks
//! that refuse a request which could never run.

use npu_protocol::{LoraRequest, SamplingParams};

use super::config::SchedulerConfig;
use super::error::SchedError;
use super::prefix_cache::BlockHash;
use super::speculative::DraftRecord;
use crate::types::{FinishReason, GenerateRequest};

/// A request the scheduler gives back after its agent died: the original request and the tokens
/// generated so far. `Scheduler::add_recovered` resumes it exactly where it stopped.
#[derive(Debug, Clone, PartialEq)]
pub struct RecoveredRequest {
    pub request: GenerateRequest,
    pub generated: Vec<u32>,
}

/// The part of a sequence's state that exists only while it holds a slot and blocks.
#[derive(Debug, Clone)]
pub(crate) struct Admitted {
    pub slot: u32,
    /// Block table: covers every position up to the context length scheduled so far.
    pub blocks: Vec<u32>,
    /// Positions whose KV the agent has written (steps whose result came back).
    pub num_computed: usize,
    /// Leading full blocks already offered to the prefix cache.
    pub num_registered: usize,
    /// Chain hash of the last registered block.
    pub last_hash: Option<BlockHash>,
    /// The step computing this sequence's next tokens, while the agent runs it.
    pub in_flight: Option<u64>,
}

/// A preempted sequence whose KV waits in host blocks (swapped out, not recomputed).
#[derive(Debug, Clone)]
pub(crate) struct Swapped {
    /// Host blocks holding its first `num_computed` positions, in table order.
    pub host_blocks: Vec<u32>,
    pub num_computed: usize,
    pub num_registered: usize,
    pub last_hash: Option<BlockHash>,
    /// The blocks are in the handoff region (handed over by another agent), not the host pool.
    pub handoff: bool,
}

/// A request in the scheduler, waiting or admitted.
#[derive(Debug, Clone)]
pub(crate) struct Sequence {
    pub req: GenerateRequest,
    pub generated: Vec<u32>,
    /// Prompt plus generated tokens may not reach past this (context and pool limits).
    pub max_total_len: usize,
    /// Was admitted before (preempted or recovered): queues ahead of fresh requests.
    pub resumed: bool,
    /// Counts admissions; a step result for an earlier admission is stale.
    pub incarnation: u64,
    pub admitted: Option<Admitted>,
    /// Set while it waits with its KV swapped out to the host pool.
    pub swapped: Option<Swapped>,
    /// How its drafts fared (speculative decoding).
    pub drafts: DraftRecord,
    /// The LoRA adapter it runs under (None: the base model).
    pub lora: Option<LoraRequest>,
}

impl Sequence {
    pub fn params(&self) -> &SamplingParams {
        &self.req.params
    }

    /// Its adapter's id (0: the base model): the prefix cache keys its blocks on it.
    pub fn lora_id(&self) -> u32 {
        self.lora.as_ref().map_or(0, |l| l.id)
    }

    pub fn prompt_len(&self) -> usize {
        self.req.prompt_ids.len()
    }

    /// Prompt plus generated tokens.
    pub fn total_len(&self) -> usize {
        self.prompt_len() + self.generated.len()
    }

    pub fn token_at(&self, pos: usize) -> u32 {
        let p = self.prompt_len();
        if pos < p {
            self.req.prompt_ids[pos]
        } else {
            self.generated[pos - p]
        }
    }

    /// Tokens at positions `start..end` (prompt then generated).
    pub fn tokens(&self, start: usize, end: usize) -> Vec<u32> {
        (start..end).map(|pos| self.token_at(pos)).collect()
    }

    /// All tokens, prompt then generated.
    pub fn all_tokens(&self) -> Vec<u32> {
        self.tokens(0, self.total_len())
    }

    /// Tokens whose KV is written or being written.
    pub fn num_computed(&self) -> usize {
        self.admitted.as_ref().map_or(0, |a| a.num_computed)
    }

    /// Tokens still to compute before the next sample (1 while decoding).
    pub fn remaining(&self) -> usize {
        self.total_len() - self.num_computed()
    }

    /// How many of the positions `start..start+len` are prompt.
    pub fn prompt_part(&self, start: usize, len: usize) -> usize {
        self.prompt_len().saturating_sub(start).min(len)
    }

    /// Why the request ends after `token` was appended, if it does.
    pub fn finish_reason(&self, token: u32, eos_ids: &[u32]) -> Option<FinishReason> {
        let eos = !self.req.ignore_eos && eos_ids.contains(&token);
        if eos || self.req.stop_token_ids.contains(&token) {
            Some(FinishReason::Eos)
        } else if self.generated.len() >= self.req.max_new_tokens as usize {
            Some(FinishReason::Length)
        } else if self.total_len() >= self.max_total_len {
            Some(FinishReason::ContextLength)
        } else {
            None
        }
    }

    /// Tokens this request will still occupy or process at most (for load balancing).
    pub fn load(&self) -> u64 {
        let left = (self.req.max_new_tokens as usize).saturating_sub(self.generated.len());
        (self.total_len() + left.min(self.max_total_len.saturating_sub(self.total_len()))) as u64
    }
}

/// Refuses a request (with `generated` tokens already made) that could never run under `cfg`;
/// otherwise returns the most tokens (prompt plus generated) it may reach.
pub(crate) fn check_request(
    cfg: &SchedulerConfig,
    req: &GenerateRequest,
    generated: usize,
) -> Result<usize, SchedError> {
    let id = req.id;
    if req.prompt_ids.is_empty() {
        return Err(SchedError::EmptyPrompt { id });
    }
    if req.max_new_tokens == 0 {
        return Err(SchedError::NothingToGenerate { id });
    }
    if generated >= req.max_new_tokens as usize {
        return Err(SchedError::AlreadyComplete {
            id,
            generated,
            max_new_tokens: req.max_new_tokens as usize,
        });
    }
    let len = req.prompt_ids.len() + generated;
    if len + 1 > cfg.max_model_len {
        return Err(SchedError::TooLong {
            id,
            len,
            limit: cfg.max_model_len,
            which: "max_model_len",
        });
    }
    if let Some(g) = cfg.max_generate_length {
        if len + 1 > g {
            return Err(SchedError::TooLong {
                id,
                len,
                limit: g,
                which: "max_generate_length",
            });
        }
    }
    let blocks_needed = (len + 1).div_ceil(cfg.block_size);
    let blocks_max = cfg.max_blocks_one_seq();
    // In long-context mode a sequence never holds more than its budget (checked with the config).
    if blocks_needed > blocks_max && cfg.long_context.is_none() {
        return Err(SchedError::ExceedsPool {
            id,
            len,
            blocks_needed,
            block_size: cfg.block_size,
            blocks_max,
        });
    }
    Ok(cfg.max_total_len())
}

//! The scheduler layer's error type: invalid configuration, requests that can never run, and
//! step results that do not match the plan they answer.

use thiserror::Error;

use crate::types::RequestId;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SchedError {
    #[error("scheduler config: {field} {reason}")]
    InvalidConfig { field: &'static str, reason: String },

    #[error("request {id}: the prompt is empty")]
    EmptyPrompt { id: RequestId },

    #[error("request {id}: max_new_tokens is 0, nothing to generate")]
    NothingToGenerate { id: RequestId },

    #[error(
        "request {id}: {len} tokens plus one to generate exceed the context limit of {limit} tokens \
         ({which})"
    )]
    TooLong {
        id: RequestId,
        len: usize,
        limit: usize,
        which: &'static str,
    },

    #[error(
        "request {id}: {len} tokens plus one need {blocks_needed} KV blocks of {block_size} tokens, \
         but one sequence can hold at most {blocks_max} (min of num_blocks and max_blocks_per_seq)"
    )]
    ExceedsPool {
        id: RequestId,
        len: usize,
        blocks_needed: usize,
        block_size: usize,
        blocks_max: usize,
    },

    #[error("request {id}: already has {generated} of its {max_new_tokens} new tokens")]
    AlreadyComplete {
        id: RequestId,
        generated: usize,
        max_new_tokens: usize,
    },

    #[error("request {id} is already queued or running in this scheduler")]
    DuplicateRequest { id: RequestId },

    #[error("step result for step {step_id}, which is not in flight")]
    UnknownStep { step_id: u64 },

    #[error("step {step_id}: a result for slot {slot}, which did not sample in that step")]
    UnexpectedResult { step_id: u64, slot: u32 },

    #[error(
        "step {step_id}: {got} tokens for slot {slot}, which drafted {drafted} (at most one more \
         than its drafts)"
    )]
    TooManyTokens {
        step_id: u64,
        slot: u32,
        got: usize,
        drafted: usize,
    },

    #[error("step {step_id}: two results for slot {slot}")]
    DuplicateResult { step_id: u64, slot: u32 },

    #[error("step {step_id}: no result for slot {slot}, which was to sample")]
    MissingResult { step_id: u64, slot: u32 },
    #[error("step {step_id}: the agent could not run slot {slot}, and its request was not ended")]
    FailedNotEnded { step_id: u64, slot: u32 },

    #[error("request {id} cannot be taken over: {reason}")]
    BadHandover { id: RequestId, reason: String },
    #[error("request {id}: {reason}")]
    Lora { id: u64, reason: String },
}

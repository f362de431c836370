//! Plain data between the HTTP side and the engine loop: a generation request in, a stream of
//! generation events out. Both API front ends (llm-serving, OpenAI) map onto these.

use npu_protocol::TokenLogprob;
use serde::Serialize;

pub use npu_scheduler::types::{FinishReason, GenerateRequest, RequestId};

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
}

/// What the engine reports about a request, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// One generated token, and the text it completes (may be empty while a multi-byte character
    /// or a possible stop string is still pending).
    Token {
        token: TokenLogprob,
        top: Vec<TokenLogprob>,
        text: String,
    },
    /// The request is over; no more events follow.
    Finished {
        reason: FinishReason,
        usage: Usage,
        /// Set with FinishReason::Error.
        message: Option<String>,
    },
}

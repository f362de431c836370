//! The requests a scheduler takes and how they end: plain data shared by the server's engine
//! loop and the in-process runs of the CLI.

use npu_protocol::SamplingParams;
use serde::Serialize;

/// Server-wide request id (unique for the life of the process).
pub type RequestId = u64;

/// A validated, tokenized generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub id: RequestId,
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
    /// Most tokens to generate (already checked against the configured limits).
    pub max_new_tokens: u32,
    /// Stop strings: generation ends when the text contains one; it is not included in the output.
    pub stop: Vec<String>,
    /// Extra token ids that end generation (besides the model's EOS ids).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS (benchmarks).
    pub ignore_eos: bool,
    /// May the scheduler draft tokens for it when speculative decoding is on (false for
    /// constrained requests and when the request turns it off).
    pub speculative: bool,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced an end-of-sequence token (or a stop token id).
    Eos,
    /// A stop string matched.
    Stop,
    /// max_new_tokens reached.
    Length,
    /// The total length limit (model_config.max_generate_length / the context) was reached.
    ContextLength,
    /// The client went away or asked to cancel.
    Aborted,
    /// The server is shutting down and could not finish it.
    Shutdown,
    /// An internal error ended it (the message says which).
    Error,
    /// It can never run under the server's limits (the message says which); nothing was
    /// generated. The API answers it as a client error.
    Rejected,
}

impl FinishReason {
    /// The name the OpenAI API uses.
    pub fn openai(self) -> &'static str {
        match self {
            Self::Eos | Self::Stop => "stop",
            Self::Length | Self::ContextLength => "length",
            Self::Aborted | Self::Shutdown | Self::Error | Self::Rejected => "abort",
        }
    }
    /// The name the llm-serving / TGI API uses.
    pub fn tgi(self) -> &'static str {
        match self {
            Self::Eos => "eos_token",
            Self::Stop => "stop_sequence",
            Self::Length | Self::ContextLength => "length",
            Self::Aborted => "aborted",
            Self::Shutdown => "shutdown",
            Self::Error => "error",
            Self::Rejected => "rejected",
        }
    }
}

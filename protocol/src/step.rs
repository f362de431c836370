//! The plain data that crosses the scheduler/agent boundary: a step plan in, a step result out,
//! and the sampling parameters a request slot is admitted with. These are the in-process forms;
//! `shm` lays the same data out in the shared-memory segment.

use serde::{Deserialize, Serialize};

/// Sampling parameters, sent once when a request is admitted to an agent slot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// false: greedy (argmax), whatever the other settings say.
    pub do_sample: bool,
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: u32,
    /// Nucleus sampling mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below min_p times the top probability; 0 disables.
    pub min_p: f32,
    /// CTRL-style repetition penalty over prompt and generated tokens; 1 disables.
    pub repetition_penalty: f32,
    /// OpenAI-style presence penalty over generated tokens; 0 disables.
    pub presence_penalty: f32,
    /// OpenAI-style frequency penalty over generated tokens; 0 disables.
    pub frequency_penalty: f32,
    /// Seed of the request's random stream; the same seed gives the same tokens.
    pub seed: u64,
    /// Number of most likely alternatives to return with their log-probabilities (0..=MAX_TOP_N).
    pub top_n: u32,
    /// OpenAI's `logit_bias`: (token, bias) added to the token's logit before the pick, after
    /// the penalties; each bias finite and within [-100, 100], at most MAX_LOGIT_BIAS entries.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
}

/// Most alternatives a step result can carry per sequence.
pub const MAX_TOP_N: usize = 20;
/// Most drafted tokens one sequence may carry in a step (speculative decoding).
pub const MAX_DRAFT_TOKENS: usize = 16;
/// Most drafted tokens one step may carry over all its sequences: each is a logit row the agent
/// holds room for besides one per slot.
pub const MAX_STEP_DRAFT_TOKENS: usize = 64;
/// Most `logit_bias` entries one request may carry (each admission has room for this many).
pub const MAX_LOGIT_BIAS: usize = 256;
/// Largest magnitude of one logit bias (OpenAI's range).
pub const MAX_LOGIT_BIAS_VALUE: f32 = 100.0;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            do_sample: false,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            top_n: 0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// True when the next token is the argmax of the (penalised) logits.
    pub fn is_greedy(&self) -> bool {
        !self.do_sample || self.temperature <= 0.0 || self.top_k == 1
    }
}

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeqStep {
    /// The request slot on the agent (0..max_seqs); its sampling params were sent on admission.
    pub slot: u32,
    /// New tokens to process this step: a prefill chunk, or the one last sampled token.
    pub tokens: Vec<u32>,
    /// Position of the first new token (= tokens already in the KV cache for this sequence).
    pub start_pos: u32,
    /// KV block ids of the sequence, in order; covers positions 0..start_pos+tokens.len().
    pub block_table: Vec<u32>,
    /// KV slot of each new token: block_table[pos / block_size] * block_size + pos % block_size.
    pub slot_mapping: Vec<u32>,
    /// Whether to sample a token after this chunk (false for a prefill chunk that is not the last).
    pub sample: bool,
    /// How many tokens of `tokens` are prompt (the rest were generated); lets the agent keep the
    /// per-slot token history that repetition penalties need.
    pub n_prompt_tokens: u32,
    /// Speculative decoding: how many trailing tokens of `tokens` are drafts (guessed, not yet
    /// generated; at most `MAX_DRAFT_TOKENS`, only with `sample`). The agent samples after the
    /// last non-draft token and after each draft in turn, keeping going while each sampled token
    /// equals the next draft; the result's `extra` holds what it sampled after the first.
    #[serde(default)]
    pub n_draft: u32,
}

impl SeqStep {
    pub fn context_len(&self) -> u32 {
        self.start_pos + self.tokens.len() as u32
    }
}

/// A request admitted to an agent slot this step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Admission {
    pub slot: u32,
    pub params: SamplingParams,
    /// The LoRA adapter every token of the slot runs under until it is forgotten; None: the
    /// base model.
    #[serde(default)]
    pub lora: Option<LoraRequest>,
}

/// Longest adapter path (UTF-8 bytes) an admission carries.
pub const MAX_LORA_PATH: usize = 1024;

/// A LoRA adapter as a request names it to an agent: the server's id of this load of the
/// adapter (never reused in a server's life, never 0) and where its files are, which the agent
/// reads when the adapter is not in one of its slots yet.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LoraRequest {
    pub id: u32,
    pub path: String,
}

/// Which way a KV block copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CopyDirection {
    /// Device block -> host block (swap-out, or a cached block spilled to the host tier).
    DeviceToHost,
    /// Host block -> device block (swap-in, or a host-tier prefix hit brought back).
    HostToDevice,
    /// Device block -> handoff block (a prefilled request's KV handed to a decode agent).
    DeviceToHandoff,
    /// Handoff block -> device block (a handed-over request's KV taken in by a decode agent).
    HandoffToDevice,
}

/// One whole-block copy between the agent's device KV pool and its host KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvCopy {
    pub direction: CopyDirection,
    /// Block id in the device pool (`0..num_blocks`).
    pub device_block: u32,
    /// Block id in the host pool (`0..host blocks`), or in the handoff region for the handoff
    /// directions.
    pub host_block: u32,
}

impl KvCopy {
    pub fn to_host(device_block: u32, host_block: u32) -> Self {
        Self {
            direction: CopyDirection::DeviceToHost,
            device_block,
            host_block,
        }
    }
    pub fn to_device(host_block: u32, device_block: u32) -> Self {
        Self {
            direction: CopyDirection::HostToDevice,
            device_block,
            host_block,
        }
    }
    pub fn to_handoff(device_block: u32, handoff_block: u32) -> Self {
        Self {
            direction: CopyDirection::DeviceToHandoff,
            device_block,
            host_block: handoff_block,
        }
    }
    pub fn from_handoff(handoff_block: u32, device_block: u32) -> Self {
        Self {
            direction: CopyDirection::HandoffToDevice,
            device_block,
            host_block: handoff_block,
        }
    }
    /// Whether the copy goes through the handoff region (not the agent's host pool).
    pub fn is_handoff(&self) -> bool {
        matches!(
            self.direction,
            CopyDirection::DeviceToHandoff | CopyDirection::HandoffToDevice
        )
    }
}

/// What the scheduler asks of an agent for one step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepPlan {
    pub step_id: u64,
    /// Slots to forget before this step (finished, aborted or preempted requests).
    pub forget: Vec<u32>,
    /// Slots admitted before this step.
    pub admit: Vec<Admission>,
    /// Block copies between the device and host KV pools, done in this order after forget and
    /// admit and before the step's compute. The order matters: a block freed by one copy may be
    /// the destination of a later one.
    #[serde(default)]
    pub kv_copies: Vec<KvCopy>,
    pub seqs: Vec<SeqStep>,
    /// Token masks of constrained sequences (structured output), one per slot that samples in
    /// this step under a grammar: only tokens whose bit is set may be picked. Masks without
    /// words announce words that follow the plan (see [`StepPlan::masks_follow`]): either every
    /// mask of a plan has its words or none has.
    #[serde(default)]
    pub masks: Vec<TokenMask>,
}

/// Which tokens a constrained sequence may pick next: bit `t % 32` of `words[t / 32]` set for
/// token `t` allowed (tokens past the words are not). The server's grammar matcher makes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenMask {
    pub slot: u32,
    pub words: Vec<u32>,
}

impl TokenMask {
    /// Whether token `t` may be picked under the mask `words`.
    pub fn allows(words: &crate::source::U32s<'_>, t: u32) -> bool {
        words
            .get((t / 32) as usize)
            .is_some_and(|w| w & (1 << (t % 32)) != 0)
    }
}

impl StepPlan {
    /// Whether the plan names its masked slots but their words follow it: the server computes
    /// them while the agent runs the step's forward pass and announces them with a `Masks`
    /// frame; the agent waits for them only before it samples.
    pub fn masks_follow(&self) -> bool {
        !self.masks.is_empty() && self.masks.iter().all(|m| m.words.is_empty())
    }

    pub fn n_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Drafted tokens over all sequences.
    pub fn n_draft(&self) -> usize {
        self.seqs.iter().map(|s| s.n_draft as usize).sum()
    }
}

/// A token and its log-probability.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    /// Natural-log softmax probability under the model's distribution (before sampling filters).
    pub logprob: f32,
}

/// The outcome for one sequence that sampled this step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeqResult {
    pub slot: u32,
    pub token: TokenLogprob,
    /// The most likely alternatives, best first (up to the slot's top_n).
    pub top: Vec<TokenLogprob>,
    /// Speculative decoding: the tokens sampled after `token` in the same step, in order (each
    /// one before them equalled its draft); empty without drafts. Never more than the drafts.
    #[serde(default)]
    pub extra: Vec<TokenLogprob>,
}

/// Timing of one step on the agent, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTiming {
    pub forward_us: u64,
    pub sample_us: u64,
    pub total_us: u64,
}

/// What moved between host and device memory in one step, as the agent measured it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepTransfer {
    /// Bytes of step inputs taken host->device (tokens, positions, slot mapping, sequence spans,
    /// block tables, logit rows); KV history never moves.
    pub input_bytes: u64,
    /// The part of `input_bytes` that is block tables (4 bytes per entry; a table grows by one
    /// entry per `block_size` tokens of context).
    pub block_table_bytes: u64,
    /// KV bytes copied device->host (swap-outs and spills to the host tier).
    pub swap_out_bytes: u64,
    /// KV bytes copied host->device (swap-ins and host-tier prefix hits).
    pub swap_in_bytes: u64,
    /// Time spent on those KV copies, before the forward.
    pub copy_us: u64,
}

/// Longest reason (UTF-8 bytes) a [`SeqFailure`] carries; longer ones are cut.
pub const MAX_SEQ_FAILURE: usize = 1024;

/// A sequence the agent could not run while the rest of its step ran: the request in `slot`
/// cannot go on (the server ends it with `error`), and the agent ran none of its tokens this
/// step (no KV written, no result). Today: its LoRA adapter's files could not be read or
/// placed at admission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeqFailure {
    pub slot: u32,
    pub error: String,
}

/// What an agent answers for one step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepResult {
    pub step_id: u64,
    pub seqs: Vec<SeqResult>,
    pub timing: StepTiming,
    #[serde(default)]
    pub transfer: StepTransfer,
    /// Sequences of the plan the agent could not run (they have no entry in `seqs`). They
    /// travel in the `StepDone` frame, not in the segment.
    #[serde(default)]
    pub failed: Vec<SeqFailure>,
}

//! How the HTTP side talks to the engine thread: commands in over a channel, generation events
//! out over one channel (the HTTP loop is woken by a `mio::Waker` after each send), and live
//! counters that /health, /metrics and /serving/* read without asking the engine.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_channel::Sender;

use super::types::{GenEvent, GenerateRequest, RequestId};

/// A command from the HTTP side to the engine thread.
#[derive(Debug)]
pub enum EngineCommand {
    /// Start a request; its events arrive on the engine's event channel tagged with `req.id`.
    Submit(GenerateRequest),
    /// Start a request whose output follows a grammar (structured output): each token it
    /// samples is masked by the constraint, which the engine advances with every token.
    SubmitConstrained(GenerateRequest, Box<npu_structured::Constraint>),
    /// The client went away or cancelled: end the request and free its KV blocks.
    Abort(RequestId),
    /// Stop admitting, finish or end running requests, stop the agents.
    Shutdown,
    /// `POST /sleep`: put every agent to sleep at `level` (1: KV pools freed, weights kept; 2:
    /// weights and KV dropped). The answer comes as request `id`'s `Finished` event whose
    /// message is a `ControlReply` as JSON.
    Sleep { id: RequestId, level: u8 },
    /// `POST /wake_up`: wake every agent; answered like `Sleep`.
    Wake { id: RequestId },
    /// A request that runs under a LoRA adapter (with its grammar, if any).
    SubmitLora(
        GenerateRequest,
        Option<Box<npu_structured::Constraint>>,
        npu_protocol::LoraRequest,
    ),
    /// `POST /v1/load_lora_adapter`: read and serve the adapter; answered like `Sleep`.
    LoadLora {
        id: RequestId,
        name: String,
        path: String,
    },
}

/// The engine's answer to a control command (`Sleep`, `Wake`): an HTTP status and its JSON
/// body, carried as JSON in the `Finished` event's message.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ControlReply {
    pub status: u16,
    pub body: serde_json::Value,
}

/// Live counters shared by the engine (writer) and the HTTP side (reader).
#[derive(Debug, Default)]
pub struct EngineStats {
    /// All agents have completed their handshake and none is down.
    pub ready: AtomicBool,
    /// Shutting down: requests still running may finish, new ones are refused.
    pub draining: AtomicBool,
    /// Agent processes configured and up (with tensor parallelism: the ranks of the groups
    /// that are up; a group is up only with all its ranks).
    pub agents_total: AtomicU64,
    pub agents_up: AtomicU64,
    /// Model replicas: tensor-parallel groups (one agent each without tensor parallelism).
    pub groups_total: AtomicU64,
    pub groups_up: AtomicU64,
    /// Ranks per group (`npu_serving.tensor_parallel_size`).
    pub tensor_parallel_size: AtomicU64,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub generated_tokens_total: AtomicU64,
    pub requests_finished_total: AtomicU64,
    pub preemptions_total: AtomicU64,
    /// Tokens of admitted requests looked up in the prefix cache.
    pub prefix_cache_queried_tokens_total: AtomicU64,
    /// Of those, tokens whose KV came from the cache.
    pub prefix_cache_hit_tokens_total: AtomicU64,
    pub agent_restarts_total: AtomicU64,
    pub steps_total: AtomicU64,
    /// Speculative decoding: tokens drafted, and of them those the agents kept.
    pub spec_draft_tokens_total: AtomicU64,
    pub spec_accepted_tokens_total: AtomicU64,
    /// The KV memory hierarchy (host pool, swapping, host tier, host->device step inputs).
    pub kv: KvStats,
    /// Prefill/decode disaggregation (KV handed over between agents).
    pub pd: PdStats,
    /// Sleep and wake (`POST /sleep`, `/wake_up`, the idle timeout).
    pub sleep: SleepStats,
}

/// Sleep and wake, all agents together.
#[derive(Debug, Default)]
pub struct SleepStats {
    /// 0 awake; 1 or 2: asleep at that level (also while falling asleep or waking up).
    pub level: AtomicU64,
    pub sleeps_total: AtomicU64,
    /// Of those, the ones the idle timeout started.
    pub idle_sleeps_total: AtomicU64,
    pub wakes_total: AtomicU64,
    /// The last wake's time (first Wake sent to every agent answered), microseconds.
    pub last_wake_us: AtomicU64,
    /// The agents' start at server start (spawn to accepted handshake, all in parallel),
    /// microseconds: the cold load time wakes are compared with.
    pub cold_start_us: AtomicU64,
}

/// Counters and gauges of prefill/decode disaggregation, all agents together.
#[derive(Debug, Default)]
pub struct PdStats {
    /// Requests and KV blocks (bytes) copied out of prefill agents into the handoff region...
    pub handoff_out_requests_total: AtomicU64,
    pub handoff_out_blocks_total: AtomicU64,
    pub handoff_out_bytes_total: AtomicU64,
    /// ...and copied from it into decode agents.
    pub handoff_in_requests_total: AtomicU64,
    pub handoff_in_blocks_total: AtomicU64,
    pub handoff_in_bytes_total: AtomicU64,
    /// Prefill tokens (prompts and recomputations) computed by agents of each role.
    pub prefill_tokens_prefill_agents_total: AtomicU64,
    pub prefill_tokens_decode_agents_total: AtomicU64,
    pub prefill_tokens_both_agents_total: AtomicU64,
    /// Blocks of the handoff region, and those in use.
    pub handoff_blocks_total: AtomicU64,
    pub handoff_blocks_used: AtomicU64,
}

/// Counters and gauges of the KV memory hierarchy, all agents together.
#[derive(Debug, Default)]
pub struct KvStats {
    /// Of `preemptions_total`, those that swapped the victim's KV out (the rest recompute).
    pub preemptions_swap_total: AtomicU64,
    pub swap_out_blocks_total: AtomicU64,
    pub swap_in_blocks_total: AtomicU64,
    pub swap_out_bytes_total: AtomicU64,
    pub swap_in_bytes_total: AtomicU64,
    /// Of `prefix_cache_hit_tokens_total`, those brought back from the host tier.
    pub prefix_hit_tokens_host_total: AtomicU64,
    /// Cached blocks spilled from the device to the host tier.
    pub host_spilled_blocks_total: AtomicU64,
    pub host_blocks_total: AtomicU64,
    pub host_blocks_cached: AtomicU64,
    pub host_blocks_swapped: AtomicU64,
    /// Bytes of step inputs sent host->device (tokens, positions, slot mappings, spans, block
    /// tables, logit rows), and the last step's figures.
    pub step_input_bytes_total: AtomicU64,
    pub last_step_input_bytes: AtomicU64,
    pub last_step_block_table_bytes: AtomicU64,
    /// Agent time spent on KV block copies, microseconds.
    pub copy_us_total: AtomicU64,
}

impl EngineStats {
    pub fn get(v: &AtomicU64) -> u64 {
        v.load(Ordering::Relaxed)
    }
    pub fn set(v: &AtomicU64, x: u64) {
        v.store(x, Ordering::Relaxed)
    }
    pub fn add(v: &AtomicU64, x: u64) {
        v.fetch_add(x, Ordering::Relaxed);
    }
}

/// The HTTP side's end of the engine.
#[derive(Clone)]
pub struct EngineHandle {
    pub commands: Sender<EngineCommand>,
    pub stats: Arc<EngineStats>,
}

/// An event for the HTTP side: which request it belongs to, and what happened.
pub type TaggedEvent = (RequestId, GenEvent);

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
    /// The client went away or cancelled: end the request and free its KV blocks.
    Abort(RequestId),
    /// Stop admitting, finish or end running requests, stop the agents.
    Shutdown,
}

/// Live counters shared by the engine (writer) and the HTTP side (reader).
#[derive(Debug, Default)]
pub struct EngineStats {
    /// All agents have completed their handshake and none is down.
    pub ready: AtomicBool,
    /// Shutting down: requests still running may finish, new ones are refused.
    pub draining: AtomicBool,
    pub agents_total: AtomicU64,
    pub agents_up: AtomicU64,
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

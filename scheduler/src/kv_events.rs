//! KV-cache events: what entered and left the prefix cache of one agent's pools, in the order
//! it happened, for a gateway that routes each request to the replica already holding its
//! prefix. Recorded only once asked for (`Scheduler::record_kv_events`); the engine drains
//! them after every loop turn.

use super::prefix_cache::BlockHash;

/// Where a cached block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvMedium {
    /// The device KV pool (NPU or GPU memory; the CPU backend's main pool).
    Device,
    /// The host tier (blocks spilled from the device pool).
    Host,
}

/// One change to the set of cached blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// A full block's content is now cached in `medium`.
    Stored {
        hash: BlockHash,
        /// Hash of the block before it in its sequence (None for a first block).
        parent: Option<BlockHash>,
        /// The block's tokens (one full block).
        tokens: Box<[u32]>,
        /// The LoRA adapter's id its KV was computed under (0: the base model).
        lora: u32,
        medium: KvMedium,
    },
    /// The content with this hash is no longer cached in `medium`.
    Removed { hash: BlockHash, medium: KvMedium },
    /// Every cached block is gone (the agent restarted and its pools were reset).
    AllCleared,
}

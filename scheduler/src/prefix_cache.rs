//! Content addressing for prefix caching: the chained 128-bit hash of a full KV block, the
//! index from hash to the cached block (in the device pool or in the host tier), and the
//! least-recently-released order of cached device blocks that no sequence holds (the eviction
//! order). Its tick counter also orders the host tier, so both tiers share one LRU order.
//! Every change to the index can be recorded as a KV event (`kv_events`).

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash, Hasher};

use super::kv_events::{KvEvent, KvMedium};

/// Chained content hash of a full block: it covers the block's tokens and, through the parent
/// hash, every token before them.
pub type BlockHash = u128;

/// What a cached block holds, kept to verify every hit (a hash is never trusted alone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedContent {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    /// The LoRA adapter the KV was computed under (0: the base model); part of the hash.
    pub lora: u32,
    pub tokens: Box<[u32]>,
}

/// Where a cached block's content lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// A block of the device KV pool.
    Device(u32),
    /// A block of the agent's host KV pool.
    Host(u32),
}

impl Tier {
    pub fn medium(self) -> KvMedium {
        match self {
            Tier::Device(_) => KvMedium::Device,
            Tier::Host(_) => KvMedium::Host,
        }
    }
}

/// Hash index and eviction order of the cached blocks. The block manager owns the blocks;
/// this only says which block holds which content and which unused one to evict first.
#[derive(Debug)]
pub struct PrefixIndex {
    /// Two independently keyed SipHash instances (random keys per process), one per 64-bit
    /// half: prompts are user input, so the hash must not be predictable.
    keys: [RandomState; 2],
    by_hash: HashMap<BlockHash, Tier>,
    /// Cached blocks with no holder, by release tick: the first entry is evicted first.
    evictable: BTreeMap<u64, u32>,
    next_tick: u64,
    /// Changes not yet taken, while recording (None: not recording).
    events: Option<Vec<KvEvent>>,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixIndex {
    pub fn new() -> Self {
        Self {
            keys: [RandomState::new(), RandomState::new()],
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            next_tick: 0,
            events: None,
        }
    }

    /// Records every later change as a [`KvEvent`] (until taken by `take_events`).
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The changes recorded since the last call, oldest first (none when not recording).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn record(&mut self, event: KvEvent) {
        if let Some(events) = &mut self.events {
            events.push(event);
        }
    }

    fn record_stored(&mut self, content: &CachedContent, at: Tier) {
        if self.events.is_some() {
            self.record(KvEvent::Stored {
                hash: content.hash,
                parent: content.parent,
                tokens: content.tokens.clone(),
                lora: content.lora,
                medium: at.medium(),
            });
        }
    }

    /// Hash of a full block given its parent's hash (None for the first block) and the LoRA
    /// adapter its KV was computed under (0: the base model): KV of one adapter never matches
    /// another's, nor the base model's.
    pub fn chain_hash(&self, parent: Option<BlockHash>, lora: u32, tokens: &[u32]) -> BlockHash {
        let half = |key: &RandomState| {
            let mut h = key.build_hasher();
            parent.hash(&mut h);
            lora.hash(&mut h);
            tokens.hash(&mut h);
            h.finish()
        };
        (u128::from(half(&self.keys[0])) << 64) | u128::from(half(&self.keys[1]))
    }

    pub fn get(&self, hash: BlockHash) -> Option<Tier> {
        self.by_hash.get(&hash).copied()
    }

    /// Moves an indexed content to another block (spilled to the host, or brought back).
    pub fn relocate(&mut self, content: &CachedContent, to: Tier) {
        let Some(t) = self.by_hash.get_mut(&content.hash) else {
            return;
        };
        let from = std::mem::replace(t, to);
        if from.medium() != to.medium() {
            self.record(KvEvent::Removed {
                hash: content.hash,
                medium: from.medium(),
            });
            self.record_stored(content, to);
        }
    }

    /// A fresh tick: later than every tick handed out before.
    pub fn tick(&mut self) -> u64 {
        let t = self.next_tick;
        self.next_tick += 1;
        t
    }

    /// Records `block` as the holder of `content`; false (and nothing recorded) when another
    /// block already holds that content.
    pub fn insert(&mut self, content: &CachedContent, block: Tier) -> bool {
        match self.by_hash.entry(content.hash) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(block);
                self.record_stored(content, block);
                true
            }
        }
    }

    pub fn remove(&mut self, hash: BlockHash) {
        if let Some(was) = self.by_hash.remove(&hash) {
            self.record(KvEvent::Removed {
                hash,
                medium: was.medium(),
            });
        }
    }

    pub fn entries(&self) -> impl Iterator<Item = (BlockHash, Tier)> + '_ {
        self.by_hash.iter().map(|(h, b)| (*h, *b))
    }

    /// Puts a cached block nobody holds at the back of the eviction order; returns its tick.
    pub fn push_evictable(&mut self, block: u32) -> u64 {
        let tick = self.tick();
        self.evictable.insert(tick, block);
        tick
    }

    /// Takes a block out of the eviction order (it is held again).
    pub fn remove_evictable(&mut self, tick: u64) {
        self.evictable.remove(&tick);
    }

    /// The least recently released cached block and its tick, removed from the eviction order.
    pub fn pop_lru(&mut self) -> Option<(u64, u32)> {
        self.evictable.pop_first()
    }

    pub fn num_evictable(&self) -> usize {
        self.evictable.len()
    }

    pub fn evictable_blocks(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.evictable.iter().map(|(t, b)| (*t, *b))
    }

    /// Forgets every cached block (the agent's KV is gone).
    pub fn clear(&mut self) {
        self.by_hash.clear();
        self.evictable.clear();
        if let Some(events) = &mut self.events {
            // What came before no longer matters to anyone reading the events.
            events.clear();
            events.push(KvEvent::AllCleared);
        }
    }
}

//! Content addressing for prefix caching: the chained 128-bit hash of a full KV block, the
//! index from hash to cached block, and the least-recently-released order of cached blocks
//! that no sequence holds (the eviction order).

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash, Hasher};

/// Chained content hash of a full block: it covers the block's tokens and, through the parent
/// hash, every token before them.
pub type BlockHash = u128;

/// What a cached block holds, kept to verify every hit (a hash is never trusted alone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedContent {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tokens: Box<[u32]>,
}

/// Hash index and eviction order of the cached blocks. The block manager owns the blocks;
/// this only says which block holds which content and which unused one to evict first.
#[derive(Debug)]
pub struct PrefixIndex {
    /// Two independently keyed SipHash instances (random keys per process), one per 64-bit
    /// half: prompts are user input, so the hash must not be predictable.
    keys: [RandomState; 2],
    by_hash: HashMap<BlockHash, u32>,
    /// Cached blocks with no holder, by release tick: the first entry is evicted first.
    evictable: BTreeMap<u64, u32>,
    next_tick: u64,
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
        }
    }

    /// Hash of a full block given its parent's hash (None for the first block).
    pub fn chain_hash(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let half = |key: &RandomState| {
            let mut h = key.build_hasher();
            parent.hash(&mut h);
            tokens.hash(&mut h);
            h.finish()
        };
        (u128::from(half(&self.keys[0])) << 64) | u128::from(half(&self.keys[1]))
    }

    pub fn get(&self, hash: BlockHash) -> Option<u32> {
        self.by_hash.get(&hash).copied()
    }

    /// Records `block` as the holder of `hash`; false (and nothing recorded) when another block
    /// already holds that content.
    pub fn insert(&mut self, hash: BlockHash, block: u32) -> bool {
        match self.by_hash.entry(hash) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(block);
                true
            }
        }
    }

    pub fn remove(&mut self, hash: BlockHash) {
        self.by_hash.remove(&hash);
    }

    pub fn entries(&self) -> impl Iterator<Item = (BlockHash, u32)> + '_ {
        self.by_hash.iter().map(|(h, b)| (*h, *b))
    }

    /// Puts a cached block nobody holds at the back of the eviction order; returns its tick.
    pub fn push_evictable(&mut self, block: u32) -> u64 {
        let tick = self.next_tick;
        self.next_tick += 1;
        self.evictable.insert(tick, block);
        tick
    }

    /// Takes a block out of the eviction order (it is held again).
    pub fn remove_evictable(&mut self, tick: u64) {
        self.evictable.remove(&tick);
    }

    /// The least recently released cached block, removed from the eviction order.
    pub fn pop_lru(&mut self) -> Option<u32> {
        self.evictable.pop_first().map(|(_, b)| b)
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
    }
}

//! The paged KV block pool of one agent: allocation, reference counts and release, plus the
//! prefix cache's shared full blocks (lookup of the longest cached prefix, registration of newly
//! computed full blocks, LRU eviction of cached blocks nobody holds).

use std::collections::VecDeque;

use super::prefix_cache::{BlockHash, CachedContent, PrefixIndex};

#[derive(Debug, Clone, Default)]
struct Block {
    /// Sequences whose block table holds this block.
    refs: u32,
    /// Set while the block is in the prefix cache (full, computed, content known).
    cached: Option<CachedContent>,
    /// Position in the eviction order while cached and held by nobody.
    evict_tick: Option<u64>,
}

/// The longest cached full-block prefix of a token sequence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// The cached blocks, in table order.
    pub blocks: Vec<u32>,
    /// Chain hash of the last hit block (the parent of the next one).
    pub last_hash: Option<BlockHash>,
    /// How many of `blocks` nobody holds now (taking them lowers the available count).
    pub revived: usize,
}

/// One agent's KV block pool.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    blocks: Vec<Block>,
    /// Blocks with no holder and no cached content, allocated first.
    free: VecDeque<u32>,
    index: PrefixIndex,
    caching: bool,
}

impl BlockManager {
    /// A pool of `num_blocks` blocks of `block_size` tokens; `caching` turns prefix caching on.
    pub fn new(num_blocks: usize, block_size: usize, caching: bool) -> Self {
        Self {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            free: (0..num_blocks as u32).collect(),
            index: PrefixIndex::new(),
            caching,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    pub fn num_total(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks with no holder and no cached content.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Cached blocks nobody holds (kept for later hits, evicted when space is needed).
    pub fn num_evictable(&self) -> usize {
        self.index.num_evictable()
    }

    /// Blocks an allocation can take: free ones, then evictable cached ones.
    pub fn num_available(&self) -> usize {
        self.num_free() + self.num_evictable()
    }

    /// Blocks held by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.num_total() - self.num_available()
    }

    pub fn refs(&self, block: u32) -> u32 {
        self.blocks[block as usize].refs
    }

    pub fn is_cached(&self, block: u32) -> bool {
        self.blocks[block as usize].cached.is_some()
    }

    /// One block for a single holder: a free one, else the least recently released cached one
    /// (its content is forgotten). None when every block is held.
    pub fn allocate(&mut self) -> Option<u32> {
        let block = match self.free.pop_front() {
            Some(b) => b,
            None => {
                let b = self.index.pop_lru()?;
                let info = &mut self.blocks[b as usize];
                info.evict_tick = None;
                if let Some(content) = info.cached.take() {
                    self.index.remove(content.hash);
                }
                b
            }
        };
        self.blocks[block as usize].refs = 1;
        Some(block)
    }

    /// `n` blocks, or none at all when fewer are available.
    pub fn allocate_many(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.num_available() {
            return None;
        }
        (0..n).map(|_| self.allocate()).collect()
    }

    /// Drops one holder of `block`. A block nobody holds any more goes to the free list, or,
    /// if cached, to the back of the eviction order.
    pub fn release(&mut self, block: u32) {
        let info = &mut self.blocks[block as usize];
        debug_assert!(info.refs > 0, "release of unheld block {block}");
        info.refs = info.refs.saturating_sub(1);
        if info.refs == 0 {
            if info.cached.is_some() {
                info.evict_tick = Some(self.index.push_evictable(block));
            } else {
                self.free.push_back(block);
            }
        }
    }

    /// Releases a whole block table, last block first, so that a sequence's tail is evicted
    /// before the prefix others are more likely to share.
    pub fn release_table(&mut self, table: &[u32]) {
        for &b in table.iter().rev() {
            self.release(b);
        }
    }

    /// Chain hash of a full block (see `PrefixIndex::chain_hash`).
    pub fn chain_hash(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        self.index.chain_hash(parent, tokens)
    }

    /// The longest run of cached full blocks matching `tokens` from the start, at most
    /// `max_blocks` long. Every hit is verified against the stored tokens and parent hash.
    pub fn find_prefix(&self, tokens: &[u32], max_blocks: usize) -> PrefixHit {
        let mut hit = PrefixHit::default();
        if !self.caching {
            return hit;
        }
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let hash = self.chain_hash(hit.last_hash, chunk);
            let Some(block) = self.index.get(hash) else {
                break;
            };
            let info = &self.blocks[block as usize];
            let verified = info
                .cached
                .as_ref()
                .is_some_and(|c| c.parent == hit.last_hash && *c.tokens == *chunk);
            if !verified {
                break;
            }
            if info.refs == 0 {
                hit.revived += 1;
            }
            hit.blocks.push(block);
            hit.last_hash = Some(hash);
        }
        hit
    }

    /// Takes one more hold on each block of a prefix hit.
    pub fn hold(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let info = &mut self.blocks[b as usize];
            debug_assert!(info.cached.is_some(), "hold of uncached block {b}");
            if info.refs == 0 {
                if let Some(tick) = info.evict_tick.take() {
                    self.index.remove_evictable(tick);
                }
            }
            info.refs += 1;
        }
    }

    /// Offers a newly computed full block to the prefix cache and returns its chain hash (the
    /// parent of the next block). When another block already caches the same content, this one
    /// stays private. Does nothing but hash when caching is off.
    pub fn register(&mut self, block: u32, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let hash = self.chain_hash(parent, tokens);
        if !self.caching || tokens.len() != self.block_size {
            return hash;
        }
        let info = &self.blocks[block as usize];
        if info.cached.is_some() || info.refs == 0 {
            return hash;
        }
        if self.index.insert(hash, block) {
            self.blocks[block as usize].cached = Some(CachedContent {
                hash,
                parent,
                tokens: tokens.into(),
            });
        }
        hash
    }

    /// Forgets every block and every cached content (the agent's KV pool is gone).
    pub fn reset(&mut self) {
        let n = self.blocks.len();
        self.blocks = vec![Block::default(); n];
        self.free = (0..n as u32).collect();
        self.index.clear();
    }

    /// Checks the pool's bookkeeping against `holders` (how many block tables hold each block).
    pub fn check(&self, holders: &[u32]) -> Result<(), String> {
        if holders.len() != self.blocks.len() {
            return Err(format!(
                "{} holder counts for {} blocks",
                holders.len(),
                self.blocks.len()
            ));
        }
        let mut in_free = vec![false; self.blocks.len()];
        for &b in &self.free {
            if std::mem::replace(&mut in_free[b as usize], true) {
                return Err(format!("block {b} twice in the free list"));
            }
        }
        for (b, info) in self.blocks.iter().enumerate() {
            if info.refs != holders[b] {
                return Err(format!(
                    "block {b}: refs {} but {} holders",
                    info.refs, holders[b]
                ));
            }
            let free = in_free[b];
            match (info.refs, &info.cached) {
                (0, None) if !free => return Err(format!("block {b} unheld, uncached, not free")),
                (0, Some(_)) if info.evict_tick.is_none() => {
                    return Err(format!("block {b} cached and unheld but not evictable"))
                }
                (r, _) if r > 0 && (free || info.evict_tick.is_some()) => {
                    return Err(format!("block {b} held yet free or evictable"))
                }
                (_, Some(_)) if free => return Err(format!("block {b} cached yet in free list")),
                _ => {}
            }
            if let Some(c) = &info.cached {
                if self.index.get(c.hash) != Some(b as u32) {
                    return Err(format!("block {b} cached but not indexed under its hash"));
                }
                if c.tokens.len() != self.block_size {
                    return Err(format!("block {b} cached while not full"));
                }
            }
        }
        for (hash, b) in self.index.entries() {
            if self.blocks[b as usize].cached.as_ref().map(|c| c.hash) != Some(hash) {
                return Err(format!(
                    "index entry for block {b} does not match its content"
                ));
            }
        }
        for (tick, b) in self.index.evictable_blocks() {
            let info = &self.blocks[b as usize];
            if info.evict_tick != Some(tick) || info.refs != 0 || info.cached.is_none() {
                return Err(format!("evictable block {b} is held or uncached"));
            }
        }
        let used = self.blocks.iter().filter(|b| b.refs > 0).count();
        if used + self.num_free() + self.num_evictable() != self.num_total() {
            return Err(format!(
                "used {used} + free {} + evictable {} != total {}",
                self.num_free(),
                self.num_evictable(),
                self.num_total()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holders(m: &BlockManager, tables: &[&[u32]]) -> Vec<u32> {
        let mut h = vec![0; m.num_total()];
        for t in tables {
            for &b in *t {
                h[b as usize] += 1;
            }
        }
        h
    }

    #[test]
    fn allocation_is_all_or_nothing_and_release_frees() {
        let mut m = BlockManager::new(4, 2, false);
        let a = m.allocate_many(3).unwrap();
        assert_eq!(m.num_used(), 3);
        assert!(m.allocate_many(2).is_none());
        assert_eq!(m.num_used(), 3, "a failed allocation takes nothing");
        m.check(&holders(&m, &[&a])).unwrap();
        m.release_table(&a);
        assert_eq!(m.num_free(), 4);
        m.check(&holders(&m, &[])).unwrap();
    }

    #[test]
    fn registered_blocks_are_found_shared_and_counted() {
        let mut m = BlockManager::new(4, 2, true);
        let tokens = [1, 2, 3, 4, 5];
        let t = m.allocate_many(3).unwrap();
        let h0 = m.register(t[0], None, &tokens[0..2]);
        m.register(t[1], Some(h0), &tokens[2..4]);
        let hit = m.find_prefix(&tokens, 8);
        assert_eq!(hit.blocks, &t[..2]);
        assert_eq!(hit.revived, 0);
        m.hold(&hit.blocks);
        assert_eq!(m.refs(t[0]), 2);
        m.check(&holders(&m, &[&t, &hit.blocks])).unwrap();
        // A different second block only matches the first.
        let other = m.find_prefix(&[1, 2, 3, 9], 8);
        assert_eq!(other.blocks, &t[..1]);
        // The same second block after a different first block is no hit at all.
        assert!(m.find_prefix(&[7, 2, 3, 4], 8).blocks.is_empty());
        // max_blocks limits the hit.
        assert_eq!(m.find_prefix(&tokens, 1).blocks, &t[..1]);
    }

    #[test]
    fn released_cached_blocks_stay_until_evicted_lru() {
        let mut m = BlockManager::new(3, 1, true);
        let a = m.allocate().unwrap();
        let b = m.allocate().unwrap();
        m.register(a, None, &[10]);
        m.register(b, None, &[20]);
        m.release(a); // a released first: evicted first
        m.release(b);
        assert_eq!(m.num_evictable(), 2);
        assert_eq!(m.num_available(), 3);
        m.check(&holders(&m, &[])).unwrap();
        let hit = m.find_prefix(&[20], 1);
        assert_eq!((hit.blocks.clone(), hit.revived), (vec![b], 1));
        let free_one = m.allocate().unwrap();
        assert!(
            free_one != a && free_one != b,
            "free blocks go before cached ones"
        );
        let evicted = m.allocate().unwrap();
        assert_eq!(
            evicted, a,
            "least recently released cached block is evicted first"
        );
        assert!(
            m.find_prefix(&[10], 1).blocks.is_empty(),
            "evicted content is forgotten"
        );
        assert_eq!(m.find_prefix(&[20], 1).blocks, vec![b]);
        m.check(&holders(&m, &[&[free_one, evicted]])).unwrap();
    }

    #[test]
    fn duplicate_content_stays_private() {
        let mut m = BlockManager::new(2, 2, true);
        let a = m.allocate().unwrap();
        let b = m.allocate().unwrap();
        let ha = m.register(a, None, &[1, 2]);
        let hb = m.register(b, None, &[1, 2]);
        assert_eq!(ha, hb);
        assert!(m.is_cached(a) && !m.is_cached(b));
        m.release(b);
        assert_eq!(m.num_free(), 1);
        m.check(&holders(&m, &[&[a]])).unwrap();
    }

    #[test]
    fn caching_off_never_shares() {
        let mut m = BlockManager::new(2, 1, false);
        let a = m.allocate().unwrap();
        m.register(a, None, &[5]);
        assert!(!m.is_cached(a));
        assert!(m.find_prefix(&[5], 1).blocks.is_empty());
        m.release(a);
        assert_eq!(m.num_free(), 2);
    }
}

//! The paged KV block pools of one agent: allocation, reference counts and release of device
//! blocks, plus the prefix cache's shared full blocks (lookup of the longest cached prefix,
//! registration of newly computed full blocks, LRU eviction of cached blocks nobody holds).
//! With a host pool, an evicted cached block spills to the host tier (one LRU order across both
//! tiers) and comes back on a later hit, and preempted sequences swap their blocks out and in.
//! Every such move is a `KvCopy` queued in order for the next plan.

use std::collections::VecDeque;

use npu_protocol::KvCopy;

use super::host_pool::HostPool;
use super::kv_events::KvEvent;
use super::prefix_cache::{BlockHash, CachedContent, PrefixIndex, Tier};

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
    /// The cached blocks, in table order, in the tier each lives in.
    pub blocks: Vec<Tier>,
    /// Chain hash of each hit block (the last is the parent of the next block).
    pub hashes: Vec<BlockHash>,
    /// How many device blocks of `blocks` nobody holds now (taking them lowers the available
    /// count).
    pub revived: usize,
}

impl PrefixHit {
    pub fn last_hash(&self) -> Option<BlockHash> {
        self.hashes.last().copied()
    }

    /// Hit blocks in the host tier (each needs a device block and a copy).
    pub fn n_host(&self) -> usize {
        self.blocks
            .iter()
            .filter(|t| matches!(t, Tier::Host(_)))
            .count()
    }

    /// Keeps the first `n` blocks; `revived` is recounted from `refs`.
    pub fn truncate(&mut self, n: usize, refs: impl Fn(u32) -> u32) {
        self.blocks.truncate(n);
        self.hashes.truncate(n);
        self.revived = self
            .blocks
            .iter()
            .filter(|t| matches!(t, Tier::Device(b) if refs(*b) == 0))
            .count();
    }
}

/// One agent's KV block pools (device, and host when configured).
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    blocks: Vec<Block>,
    /// Blocks with no holder and no cached content, allocated first.
    free: VecDeque<u32>,
    index: PrefixIndex,
    caching: bool,
    host: HostPool,
    /// Copies queued for the next plan, in the order they must run.
    copies: Vec<KvCopy>,
    max_copies: usize,
    /// Copy room kept for copies an admission will queue after its allocations (which may
    /// spill and so queue copies of their own first).
    reserved: usize,
    /// Cached blocks spilled to the host tier so far.
    spilled: u64,
}

impl BlockManager {
    /// A pool of `num_blocks` blocks of `block_size` tokens; `caching` turns prefix caching on.
    pub fn new(num_blocks: usize, block_size: usize, caching: bool) -> Self {
        Self::with_host(num_blocks, block_size, caching, 0, 0)
    }

    /// Same, with a host pool of `host_blocks` blocks and at most `max_copies` copies per plan.
    pub fn with_host(
        num_blocks: usize,
        block_size: usize,
        caching: bool,
        host_blocks: usize,
        max_copies: usize,
    ) -> Self {
        Self {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            free: (0..num_blocks as u32).collect(),
            index: PrefixIndex::new(),
            caching,
            host: HostPool::new(host_blocks),
            copies: Vec::new(),
            max_copies,
            reserved: 0,
            spilled: 0,
        }
    }

    /// The copies queued since the last call, in order (they go into the next plan).
    pub fn take_copies(&mut self) -> Vec<KvCopy> {
        std::mem::take(&mut self.copies)
    }

    /// Queues one copy for the next plan (the caller checked `copies_left`).
    pub fn queue_copy(&mut self, copy: KvCopy) {
        self.copies.push(copy);
    }

    /// Copies the next plan can still carry.
    pub fn copies_left(&self) -> usize {
        self.max_copies
            .saturating_sub(self.copies.len())
            .saturating_sub(self.reserved)
    }

    /// `n` blocks (see `allocate_many`) while keeping room for `keep` copies queued after them.
    pub fn allocate_keeping_copies(&mut self, n: usize, keep: usize) -> Option<Vec<u32>> {
        self.reserved = keep;
        let got = self.allocate_many(n);
        self.reserved = 0;
        got
    }

    pub fn host_total(&self) -> usize {
        self.host.num_total()
    }

    /// Host blocks a swap-out could take now.
    pub fn host_available(&self) -> usize {
        self.host.num_available()
    }

    /// Host blocks holding spilled prefix-cache content, and held by swapped-out sequences.
    pub fn host_cached_and_held(&self) -> (usize, usize) {
        (self.host.num_cached(), self.host.num_held())
    }

    /// Cached blocks spilled from the device to the host tier so far.
    pub fn spilled(&self) -> u64 {
        self.spilled
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
                let (tick, b) = self.index.pop_lru()?;
                let info = &mut self.blocks[b as usize];
                info.evict_tick = None;
                if let Some(content) = info.cached.take() {
                    self.spill_or_forget(b, tick, content);
                }
                b
            }
        };
        self.blocks[block as usize].refs = 1;
        Some(block)
    }

    /// An evicted cached device block's content goes to the host tier when a host block is free
    /// or holds older content (one LRU order across the tiers) and the plan has room for the
    /// copy; otherwise it is forgotten.
    fn spill_or_forget(&mut self, block: u32, tick: u64, content: CachedContent) {
        if self.copies_left() > 0 {
            if let Some((h, evicted)) = self.host.take(tick) {
                if let Some(old) = evicted {
                    self.index.remove(old.hash);
                }
                self.index.relocate(&content, Tier::Host(h));
                let hb = &mut self.host.blocks[h as usize];
                hb.cached = Some(content);
                hb.evict_tick = Some(tick);
                self.host.evictable.insert(tick, h);
                self.copies.push(KvCopy::to_host(block, h));
                self.spilled += 1;
                return;
            }
        }
        self.index.remove(content.hash);
    }

    /// Copies the KV of `table` (a preempted sequence's computed blocks) to newly held host
    /// blocks, evicting cached host content if needed; None (nothing done) when the host pool
    /// or the plan's copy room is too small.
    pub fn swap_out(&mut self, table: &[u32]) -> Option<Vec<u32>> {
        if table.len() > self.host.num_available() || table.len() > self.copies_left() {
            return None;
        }
        let mut host = Vec::with_capacity(table.len());
        for &b in table {
            let (h, evicted) = self.host.take(u64::MAX)?;
            if let Some(old) = evicted {
                self.index.remove(old.hash);
            }
            self.host.blocks[h as usize].refs = 1;
            self.copies.push(KvCopy::to_host(b, h));
            host.push(h);
        }
        Some(host)
    }

    /// Copies swapped-out KV back into `device` blocks (already allocated) and frees the host
    /// blocks (a later copy may reuse them: the copies run in order).
    pub fn swap_in(&mut self, host: &[u32], device: &[u32]) {
        for (&h, &d) in host.iter().zip(device) {
            self.copies.push(KvCopy::to_device(h, d));
            self.host.release(h);
        }
    }

    /// Frees the host blocks of a swapped-out sequence that will not resume.
    pub fn drop_swapped(&mut self, host: &[u32]) {
        for &h in host {
            self.host.release(h);
        }
    }

    /// Brings a pinned host-tier hit back into `device` (allocated to the sequence): the
    /// content is indexed at the device block from now on and the host block is freed.
    pub fn bring_back(&mut self, host: u32, device: u32) {
        let content = self.host.blocks[host as usize].cached.take();
        self.copies.push(KvCopy::to_device(host, device));
        self.host.release(host);
        if let Some(c) = content {
            self.index.relocate(&c, Tier::Device(device));
            self.blocks[device as usize].cached = Some(c);
        }
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
    pub fn chain_hash(&self, parent: Option<BlockHash>, lora: u32, tokens: &[u32]) -> BlockHash {
        self.index.chain_hash(parent, lora, tokens)
    }

    /// The longest run of cached full blocks matching `tokens` from the start, computed under
    /// LoRA adapter `lora` (0: the base model), at most `max_blocks` long. Every hit is
    /// verified against the stored tokens, adapter and parent hash.
    pub fn find_prefix(&self, tokens: &[u32], lora: u32, max_blocks: usize) -> PrefixHit {
        let mut hit = PrefixHit::default();
        if !self.caching {
            return hit;
        }
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let parent = hit.last_hash();
            let hash = self.chain_hash(parent, lora, chunk);
            let Some(tier) = self.index.get(hash) else {
                break;
            };
            let (cached, refs) = match tier {
                Tier::Device(b) => {
                    let info = &self.blocks[b as usize];
                    (&info.cached, info.refs)
                }
                Tier::Host(h) => (&self.host.blocks[h as usize].cached, 1),
            };
            let verified = cached
                .as_ref()
                .is_some_and(|c| c.parent == parent && c.lora == lora && *c.tokens == *chunk);
            if !verified {
                break;
            }
            if refs == 0 {
                hit.revived += 1;
            }
            hit.blocks.push(tier);
            hit.hashes.push(hash);
        }
        hit
    }

    /// Takes one more hold on each block of a prefix hit (host-tier blocks are pinned until
    /// `bring_back`).
    pub fn hold(&mut self, blocks: &[Tier]) {
        for &t in blocks {
            let b = match t {
                Tier::Device(b) => b,
                Tier::Host(h) => {
                    self.host.pin(h);
                    continue;
                }
            };
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

    /// Forgets cached content at these device and host blocks (copies into them may not have
    /// happened): unheld device blocks become free, host blocks nobody holds are freed.
    pub fn forget_content(&mut self, device: &[u32], host: &[u32]) {
        for &b in device {
            let info = &mut self.blocks[b as usize];
            let Some(c) = info.cached.take() else {
                continue;
            };
            self.index.remove(c.hash);
            if let Some(tick) = info.evict_tick.take() {
                self.index.remove_evictable(tick);
                self.free.push_back(b);
            }
        }
        for &h in host {
            let hb = &mut self.host.blocks[h as usize];
            if let Some(c) = hb.cached.take() {
                self.index.remove(c.hash);
                if hb.refs == 0 {
                    self.host.release(h);
                }
            }
        }
    }

    /// Undoes `hold` (an admission that could not get its blocks after all).
    pub fn unhold(&mut self, blocks: &[Tier]) {
        for &t in blocks.iter().rev() {
            match t {
                Tier::Device(b) => self.release(b),
                Tier::Host(h) => {
                    let tick = self.index.tick();
                    self.host.unpin(h, tick);
                }
            }
        }
    }

    /// Offers a newly computed full block to the prefix cache and returns its chain hash (the
    /// parent of the next block). When another block already caches the same content, this one
    /// stays private. Does nothing but hash when caching is off.
    pub fn register(
        &mut self,
        block: u32,
        parent: Option<BlockHash>,
        lora: u32,
        tokens: &[u32],
    ) -> BlockHash {
        let hash = self.chain_hash(parent, lora, tokens);
        if !self.caching || tokens.len() != self.block_size {
            return hash;
        }
        let info = &self.blocks[block as usize];
        if info.cached.is_some() || info.refs == 0 {
            return hash;
        }
        if let Some(Tier::Host(h)) = self.index.get(hash) {
            // The same content spilled earlier: keep the device copy, free the host one.
            if self.host.blocks[h as usize].refs == 0 {
                self.index.remove(hash);
                self.host.release(h);
            }
        }
        let content = CachedContent {
            hash,
            parent,
            lora,
            tokens: tokens.into(),
        };
        if self.index.insert(&content, Tier::Device(block)) {
            self.blocks[block as usize].cached = Some(content);
        }
        hash
    }

    /// Records every later change to the cached blocks (see `kv_events`).
    pub fn record_kv_events(&mut self) {
        self.index.record_events();
    }

    /// The changes to the cached blocks since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.index.take_events()
    }

    /// Every cached content and where it lives (the tests replay the KV events against it).
    #[cfg(test)]
    pub(crate) fn cached_entries(&self) -> Vec<(BlockHash, Tier)> {
        self.index.entries().collect()
    }

    /// Forgets every block and every cached content (the agent's KV pool is gone).
    pub fn reset(&mut self) {
        let n = self.blocks.len();
        self.blocks = vec![Block::default(); n];
        self.free = (0..n as u32).collect();
        self.index.clear();
        self.host = HostPool::new(self.host.num_total());
        self.copies.clear();
    }

    /// Checks both pools against `holders` (how many block tables hold each device block) and
    /// `host_holders` (how many swapped-out sequences hold each host block).
    pub fn check_pools(&self, holders: &[u32], host_holders: &[u32]) -> Result<(), String> {
        self.check(holders)?;
        self.host.check(host_holders)?;
        for (&t, &h) in &self.host.evictable {
            let c = self.host.blocks[h as usize].cached.as_ref();
            if c.is_none_or(|c| self.index.get(c.hash) != Some(Tier::Host(h))) {
                return Err(format!(
                    "host block {h} (tick {t}) cached but not indexed there"
                ));
            }
        }
        Ok(())
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
                if self.index.get(c.hash) != Some(Tier::Device(b as u32)) {
                    return Err(format!("block {b} cached but not indexed under its hash"));
                }
                if c.tokens.len() != self.block_size {
                    return Err(format!("block {b} cached while not full"));
                }
            }
        }
        for (hash, tier) in self.index.entries() {
            let cached = match tier {
                Tier::Device(b) => &self.blocks[b as usize].cached,
                Tier::Host(h) => &self.host.blocks[h as usize].cached,
            };
            if cached.as_ref().map(|c| c.hash) != Some(hash) {
                return Err(format!(
                    "index entry for block {tier:?} does not match its content"
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
#[path = "block_manager_tests.rs"]
mod tests;

//! The agent's host KV pool as the scheduler sees it: which host blocks hold a swapped-out
//! sequence's KV (held), which hold prefix-cache content spilled from the device (cached,
//! evictable in the shared LRU order), and which are free. The agent owns the memory; the
//! scheduler only hands out block ids and orders the copies.

use std::collections::{BTreeMap, VecDeque};

use super::prefix_cache::CachedContent;

#[derive(Debug, Clone, Default)]
pub(crate) struct HostBlock {
    /// 1 while a swapped-out sequence (or a prefix hit being brought back) holds it.
    pub refs: u32,
    /// Prefix-cache content spilled from the device.
    pub cached: Option<CachedContent>,
    /// Position in the shared LRU order while cached and unheld.
    pub evict_tick: Option<u64>,
}

/// Host block ids and their state.
#[derive(Debug, Default)]
pub(crate) struct HostPool {
    pub blocks: Vec<HostBlock>,
    pub free: VecDeque<u32>,
    /// Cached unheld host blocks by tick (the device's ticks: one LRU order across tiers).
    pub evictable: BTreeMap<u64, u32>,
}

impl HostPool {
    pub fn new(n: usize) -> Self {
        Self {
            blocks: vec![HostBlock::default(); n],
            free: (0..n as u32).collect(),
            evictable: BTreeMap::new(),
        }
    }

    pub fn num_total(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks a swap-out can take: free ones, then cached unheld ones.
    pub fn num_available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks holding spilled prefix-cache content.
    pub fn num_cached(&self) -> usize {
        self.blocks.iter().filter(|b| b.cached.is_some()).count()
    }

    /// Blocks held by swapped-out sequences.
    pub fn num_held(&self) -> usize {
        self.blocks.iter().filter(|b| b.refs > 0).count()
    }

    /// A free block, else the least recently used cached one when `evict_before` allows it
    /// (its tick is older); the evicted content is returned so the caller unindexes it. The
    /// block comes back unheld and uncached.
    pub fn take(&mut self, evict_before: u64) -> Option<(u32, Option<CachedContent>)> {
        if let Some(h) = self.free.pop_front() {
            return Some((h, None));
        }
        let (&tick, &h) = self.evictable.iter().next()?;
        if tick >= evict_before {
            return None;
        }
        self.evictable.remove(&tick);
        let b = &mut self.blocks[h as usize];
        b.evict_tick = None;
        Some((h, b.cached.take()))
    }

    /// Takes a hold on a host block (cached content being brought back).
    pub fn pin(&mut self, h: u32) {
        let b = &mut self.blocks[h as usize];
        if b.refs == 0 {
            if let Some(t) = b.evict_tick.take() {
                self.evictable.remove(&t);
            }
        }
        b.refs += 1;
    }

    /// Undoes `pin`: a cached block nobody holds is evictable again, at `tick`.
    pub fn unpin(&mut self, h: u32, tick: u64) {
        let b = &mut self.blocks[h as usize];
        b.refs = b.refs.saturating_sub(1);
        if b.refs == 0 {
            if b.cached.is_some() {
                b.evict_tick = Some(tick);
                self.evictable.insert(tick, h);
            } else {
                self.free.push_back(h);
            }
        }
    }

    /// Drops the hold on a block whose content is no longer needed: it is free again.
    pub fn release(&mut self, h: u32) {
        let b = &mut self.blocks[h as usize];
        b.refs = b.refs.saturating_sub(1);
        if b.refs == 0 {
            b.cached = None;
            if let Some(t) = b.evict_tick.take() {
                self.evictable.remove(&t);
            }
            self.free.push_back(h);
        }
    }

    /// Checks the free list, holds and the LRU entries against `holders` (how many swapped-out
    /// sequences hold each block).
    pub fn check(&self, holders: &[u32]) -> Result<(), String> {
        if holders.len() != self.blocks.len() {
            return Err(format!(
                "{} host holder counts for {} host blocks",
                holders.len(),
                self.blocks.len()
            ));
        }
        let mut in_free = vec![false; self.blocks.len()];
        for &h in &self.free {
            if std::mem::replace(&mut in_free[h as usize], true) {
                return Err(format!("host block {h} twice in the free list"));
            }
        }
        for (h, b) in self.blocks.iter().enumerate() {
            if b.refs != holders[h] {
                return Err(format!(
                    "host block {h}: refs {} but {} holders",
                    b.refs, holders[h]
                ));
            }
            let ok = match (b.refs, &b.cached, in_free[h]) {
                (0, None, free) => free && b.evict_tick.is_none(),
                (0, Some(_), free) => !free && b.evict_tick.is_some(),
                (_, _, free) => !free && b.evict_tick.is_none(),
            };
            if !ok {
                return Err(format!(
                    "host block {h}: refs {}, cached {}, free {}, evictable {}",
                    b.refs,
                    b.cached.is_some(),
                    in_free[h],
                    b.evict_tick.is_some()
                ));
            }
        }
        for (&t, &h) in &self.evictable {
            if self.blocks[h as usize].evict_tick != Some(t) {
                return Err(format!("host LRU entry {t} for block {h} is stale"));
            }
        }
        Ok(())
    }
}

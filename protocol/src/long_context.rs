//! Long-context mode (after InfLLM): how a sequence uses a fixed budget of KV blocks however long
//! it grows. The scheduler (which allocates the budget and maps each new token to a KV slot) and
//! the agent (which offloads, selects and attends) both follow this one layout, so a plan stays
//! self-describing and its slot mapping is checked where it is read.
//!
//! A sequence holds at most `device_blocks` pool blocks, used as its table says:
//!
//! ```text
//! table: [ initial: I | local ring: R | device cache: K ]     R = device_blocks - I - K
//! ```
//!
//! - Logical block `j < I` (the initial tokens) lives in table entry `j` for good.
//! - Logical block `j >= I` lives in ring entry `I + (j - I) % R`.
//! - While the context is under `(I + R)` blocks nothing wraps: the table is the ordinary one and
//!   the mode computes exactly what normal mode does.
//! - From then on memory is active: the local window of a step starting at position `P` is the
//!   `W = local_blocks` blocks before the one holding `P`, plus the blocks the step writes (a
//!   chunk is capped by `max_chunk` so that they all fit the ring). The blocks between the
//!   initial ones and the local window are *memory units*: the agent copies each to host memory
//!   with its representative keys as it leaves the window, and each step loads, per layer, the
//!   `K = topk_blocks` best-scoring units into the device-cache entries.
//!
//! Positions follow InfLLM: local tokens keep their own positions; every memory token (initial
//! blocks and selected units) is placed at one position, `memory_position`, just before the local
//! window, so no relative distance exceeds `R * block_size` however long the context grows.

use serde::{Deserialize, Serialize};

/// The settings of long-context mode (`npu_serving.long_context`), in KV blocks of the pool's
/// block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LongContextConfig {
    /// Blocks of initial tokens kept on the device (attention sinks).
    pub initial_blocks: u32,
    /// Blocks of the local window before the current block.
    pub local_blocks: u32,
    /// Memory units each layer attends to per step.
    pub topk_blocks: u32,
    /// Tokens of a memory unit whose keys stand for it when units are scored.
    pub representative_keys: u32,
    /// Pool blocks one sequence holds at most: initial + local ring + device cache.
    pub device_blocks: u32,
}

impl Default for LongContextConfig {
    fn default() -> Self {
        Self {
            initial_blocks: 1,
            local_blocks: 16,
            topk_blocks: 16,
            representative_keys: 4,
            device_blocks: 64,
        }
    }
}

/// A long-context setting that cannot work: which (as in `npu_serving.long_context`), its value
/// and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LongContextSettingError {
    pub key: &'static str,
    pub value: u32,
    pub allowed: String,
}

impl std::fmt::Display for LongContextSettingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is {}, must be {}",
            self.key, self.value, self.allowed
        )
    }
}

impl LongContextConfig {
    /// Checks the settings against the pool's block size.
    pub fn validate(&self, block_size: u32) -> Result<(), LongContextSettingError> {
        let err = |key: &'static str, value: u32, allowed: String| {
            Err(LongContextSettingError {
                key,
                value,
                allowed,
            })
        };
        for (key, v) in [
            ("local_blocks", self.local_blocks),
            ("topk_blocks", self.topk_blocks),
            ("representative_keys", self.representative_keys),
        ] {
            if v == 0 {
                return err(key, v, "at least 1".into());
            }
        }
        if self.representative_keys > block_size {
            return err(
                "representative_keys",
                self.representative_keys,
                format!("at most the block size ({block_size})"),
            );
        }
        let fixed = u64::from(self.initial_blocks)
            + u64::from(self.local_blocks)
            + u64::from(self.topk_blocks);
        if u64::from(self.device_blocks) < fixed + 1 {
            return err(
                "device_blocks",
                self.device_blocks,
                format!(
                    "at least initial_blocks + local_blocks + topk_blocks + 1 = {} (one block at \
                     least for the tokens being written)",
                    fixed + 1
                ),
            );
        }
        Ok(())
    }
}

/// The layout of one sequence's blocks (see the module doc), for a checked config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LongContextLayout {
    pub cfg: LongContextConfig,
    pub block_size: u32,
}

impl LongContextLayout {
    /// The layout for `cfg` on a pool of `block_size`-token blocks, or the setting that is wrong.
    pub fn new(cfg: LongContextConfig, block_size: u32) -> Result<Self, LongContextSettingError> {
        if block_size == 0 {
            return Err(LongContextSettingError {
                key: "block_size",
                value: 0,
                allowed: "at least 1".into(),
            });
        }
        cfg.validate(block_size)?;
        Ok(Self { cfg, block_size })
    }

    fn bs(&self) -> u64 {
        u64::from(self.block_size)
    }
    fn init(&self) -> u64 {
        u64::from(self.cfg.initial_blocks)
    }

    /// R: the local ring (local window plus room for the blocks a step writes).
    pub fn ring_blocks(&self) -> u32 {
        self.cfg.device_blocks - self.cfg.initial_blocks - self.cfg.topk_blocks
    }

    /// Tokens a sequence holds before memory starts (up to here the mode is normal mode).
    pub fn resident_tokens(&self) -> u64 {
        (self.init() + u64::from(self.ring_blocks())) * self.bs()
    }

    /// Whether a step starting at `ctx` (tokens already in the cache) has memory units.
    pub fn memory_active(&self, ctx: u64) -> bool {
        ctx >= self.resident_tokens()
    }

    /// The first logical block of the local window of a step starting at `ctx`, while memory is
    /// active (before, every block is attended to as usual).
    pub fn first_local_block(&self, ctx: u64) -> u64 {
        ctx / self.bs() - u64::from(self.cfg.local_blocks)
    }

    /// Memory units (logical blocks `I..first_local_block`) of a step starting at `ctx`.
    pub fn memory_units(&self, ctx: u64) -> u64 {
        if self.memory_active(ctx) {
            self.first_local_block(ctx) - self.init()
        } else {
            0
        }
    }

    /// The one position every memory token takes in a step starting at `ctx` (memory active):
    /// just before the local window.
    pub fn memory_position(&self, ctx: u64) -> u64 {
        self.first_local_block(ctx) * self.bs() - 1
    }

    /// The table entry holding logical block `j` while it is initial or local.
    pub fn table_index(&self, j: u64) -> usize {
        if j < self.init() {
            j as usize
        } else {
            (self.init() + (j - self.init()) % u64::from(self.ring_blocks())) as usize
        }
    }

    /// The table entry of device-cache entry `c` (< `topk_blocks`).
    pub fn cache_index(&self, c: u32) -> usize {
        (self.cfg.initial_blocks + self.ring_blocks() + c) as usize
    }

    /// Table entries a sequence of `tokens` tokens holds: one block per `block_size` tokens
    /// while they fit the initial blocks and the ring, the whole budget (device cache included)
    /// once they do not.
    pub fn table_len(&self, tokens: u64) -> usize {
        if tokens > self.resident_tokens() {
            self.cfg.device_blocks as usize
        } else {
            tokens.div_ceil(self.bs()) as usize
        }
    }

    /// The most new tokens a step starting at `ctx` may carry (at least 1), so that it never
    /// writes over a block it attends to: before memory starts, up to the end of the ring; after,
    /// up to the ring entry of the local window's first block.
    pub fn max_chunk(&self, ctx: u64) -> u64 {
        if self.memory_active(ctx) {
            (self.first_local_block(ctx) + u64::from(self.ring_blocks())) * self.bs() - ctx
        } else {
            self.resident_tokens() - ctx
        }
    }

    /// The KV slot of position `pos` through the sequence's `table` (None when the table is
    /// shorter than the layout needs or the slot does not fit 32 bits).
    pub fn slot(&self, table: &[u32], pos: u64) -> Option<u32> {
        let b = *table.get(self.table_index(pos / self.bs()))?;
        let slot = u64::from(b) * self.bs() + pos % self.bs();
        u32::try_from(slot).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(i: u32, w: u32, k: u32, b: u32, bs: u32) -> LongContextLayout {
        LongContextLayout::new(
            LongContextConfig {
                initial_blocks: i,
                local_blocks: w,
                topk_blocks: k,
                representative_keys: 2,
                device_blocks: b,
            },
            bs,
        )
        .unwrap()
    }

    #[test]
    fn the_budget_splits_into_initial_ring_and_cache() {
        let l = layout(2, 16, 16, 59, 64);
        assert_eq!(l.ring_blocks(), 41);
        assert_eq!(l.cache_index(0), 43);
        assert_eq!(l.cache_index(15), 58);
        assert_eq!(l.resident_tokens(), 43 * 64);
        assert_eq!(l.table_len(10), 1);
        assert_eq!(l.table_len(43 * 64), 43);
        assert_eq!(l.table_len(43 * 64 + 1), 59);
        assert_eq!(l.table_len(1_000_000), 59);
    }

    #[test]
    fn bad_settings_name_their_key() {
        let base = LongContextConfig::default();
        let bad =
            |cfg: LongContextConfig, bs: u32| LongContextLayout::new(cfg, bs).unwrap_err().key;
        let with = |f: &dyn Fn(&mut LongContextConfig)| {
            let mut c = base;
            f(&mut c);
            c
        };
        assert_eq!(bad(with(&|c| c.device_blocks = 33), 16), "device_blocks");
        assert_eq!(bad(with(&|c| c.local_blocks = 0), 16), "local_blocks");
        assert_eq!(bad(with(&|c| c.topk_blocks = 0), 16), "topk_blocks");
        assert_eq!(
            bad(with(&|c| c.representative_keys = 17), 16),
            "representative_keys"
        );
        assert_eq!(bad(base, 0), "block_size");
        assert!(LongContextLayout::new(base, 16).is_ok());
        assert!(LongContextLayout::new(with(&|c| c.device_blocks = 34), 16).is_ok());
    }

    #[test]
    fn memory_starts_once_the_ring_is_full() {
        let l = layout(1, 4, 2, 10, 16);
        // I = 1, R = 7: 8 blocks (128 tokens) before anything wraps.
        assert!(!l.memory_active(127));
        assert_eq!(l.max_chunk(100), 28);
        assert!(l.memory_active(128));
        assert_eq!(l.first_local_block(128), 4);
        assert_eq!(l.memory_units(128), 3);
        assert_eq!(l.memory_position(128), 63);
        assert_eq!(l.memory_units(16 * 100 + 5), 100 - 4 - 1);
    }

    /// Every step, whatever its chunk, writes only into ring entries that hold no block it
    /// attends to, and never beyond the ring; initial blocks keep their entries.
    #[test]
    fn chunks_never_overwrite_what_they_attend_to() {
        for (i, w, k, b, bs) in [(1, 4, 2, 10, 16), (0, 3, 1, 5, 4), (2, 2, 2, 12, 8)] {
            let l = layout(i, w, k, b, bs);
            let ring = u64::from(l.ring_blocks());
            let (mut ctx, mut step) = (0u64, 0u64);
            while ctx < 3000 {
                let n = l.max_chunk(ctx).min(1 + step * 7 % 40);
                assert!(n >= 1);
                let first = if l.memory_active(ctx) {
                    l.first_local_block(ctx)
                } else {
                    0
                };
                let last = (ctx + n - 1) / u64::from(bs);
                let attended: Vec<u64> = (first.max(u64::from(i))..=last).collect();
                assert!(attended.len() as u64 <= ring, "ctx {ctx} n {n}");
                let mut entries: Vec<usize> = attended.iter().map(|&j| l.table_index(j)).collect();
                entries.sort_unstable();
                entries.dedup();
                assert_eq!(entries.len(), attended.len(), "ctx {ctx} n {n}");
                assert!(entries
                    .iter()
                    .all(|&e| e >= i as usize && e < (u64::from(i) + ring) as usize));
                ctx += n;
                step += 1;
            }
        }
    }

    #[test]
    fn slots_go_through_the_ring() {
        let l = layout(1, 2, 2, 6, 4);
        // I = 1, R = 3, K = 2.
        let table = [10, 11, 12, 13, 14, 15];
        assert_eq!(l.slot(&table, 0), Some(40));
        assert_eq!(l.slot(&table, 5), Some(45));
        assert_eq!(l.slot(&table, 13), Some(13 * 4 + 1));
        // Logical block 4 wraps onto ring entry 1 + (3 % 3) = 1.
        assert_eq!(l.slot(&table, 16), Some(44));
        assert_eq!(l.cache_index(0), 4);
        assert_eq!(l.slot(&table[..2], 8), None);
    }
}

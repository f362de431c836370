//! The paged KV cache in the layout FusedInferAttentionScore's page-attention mode takes with a
//! BSH query: per layer one key and one value tensor of shape (blocks, block_size, KV_N·D) in
//! f16 — the same bytes ScatterPaKvCache's "Norm" mode writes as (blocks, block_size, KV_N, D).
//! Block sizes must be multiples of 16 (the decode branch's rule for f16 caches); the prefill
//! branch further needs a multiple of 128 in [128, 512], so 128 is the recommended size.

use crate::error::{AscendError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSpec {
    pub layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvSpec {
    /// Refuses block sizes the attention operator does not take.
    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 || !self.block_size.is_multiple_of(16) || self.block_size > 512 {
            return Err(AscendError::Invalid(format!(
                "pa_config.block_size = {}: the Ascend backend needs a multiple of 16 up to 512 (128 recommended; prefill attention needs a multiple of 128)",
                self.block_size
            )));
        }
        if !self.head_dim.is_multiple_of(16) {
            return Err(AscendError::Invalid(format!(
                "head dim {} is not a multiple of 16, which FusedInferAttentionScore needs for f16",
                self.head_dim
            )));
        }
        Ok(())
    }

    /// Bytes of one layer's key (or value) cache.
    pub fn layer_bytes(&self) -> usize {
        self.num_blocks * self.block_size * self.kv_heads * self.head_dim * 2
    }

    /// Bytes of the whole pool (keys and values of every layer).
    pub fn total_bytes(&self) -> usize {
        2 * self.layers * self.layer_bytes()
    }

    /// The most blocks that fit in `fraction` of `free` device bytes after `reserve` bytes.
    pub fn blocks_for_memory(&self, free: usize, fraction: f64, reserve: usize) -> usize {
        let budget = ((free as f64 * fraction) as usize).saturating_sub(reserve);
        let per_block = 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * 2;
        budget / per_block.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(block_size: usize) -> KvSpec {
        KvSpec {
            layers: 30,
            num_blocks: 64,
            block_size,
            kv_heads: 3,
            head_dim: 64,
        }
    }

    #[test]
    fn block_sizes_follow_the_attention_operator() {
        assert!(spec(128).validate().is_ok());
        assert!(spec(16).validate().is_ok());
        let e = spec(24).validate().unwrap_err().to_string();
        assert!(e.contains("block_size = 24"), "{e}");
        assert!(spec(1024).validate().is_err());
    }

    #[test]
    fn pool_sized_from_free_memory() {
        let s = spec(128);
        let per_block = 2 * 30 * 128 * 3 * 64 * 2;
        assert_eq!(s.blocks_for_memory(per_block * 10 + 5, 1.0, 0), 10);
        assert_eq!(s.blocks_for_memory(per_block * 10, 0.5, 0), 5);
        assert_eq!(s.blocks_for_memory(per_block * 10, 1.0, per_block * 4), 6);
        assert_eq!(s.total_bytes(), 64 * per_block);
    }
}

//! The CPU backend's paged KV pool: one f16 allocation where each block holds, for every layer
//! in turn, that layer's K block then its V block. A block is therefore one contiguous run of
//! memory, so moving a block (device copy, host swap, prefill-to-decode handoff) is one copy;
//! the attention kernel steps over the other layers with the layout's block stride.

use half::f16;
use npu_backend::{BackendError, KvSpec};

use super::buffer::{alloc_vec_huge, bad};
use crate::kernels::attention::KvLayout;

pub(crate) struct KvPool {
    pub spec: KvSpec,
    data: Vec<f16>,
    /// f16 values of one layer's K (or V) in one block.
    block_elems: usize,
    /// f16 values of one whole block (every layer's K and V).
    block_len: usize,
}

impl KvPool {
    pub fn new(spec: KvSpec) -> Result<Self, BackendError> {
        let too_big = || {
            bad(
                "init_kv",
                format!("a KV pool of {spec:?} does not fit the address space"),
            )
        };
        let block_elems = spec
            .n_kv_heads
            .checked_mul(spec.head_dim)
            .and_then(|v| v.checked_mul(spec.block_size))
            .ok_or_else(too_big)?;
        let block_len = block_elems
            .checked_mul(2)
            .and_then(|v| v.checked_mul(spec.n_layers))
            .ok_or_else(too_big)?;
        let total = block_len
            .checked_mul(spec.num_blocks)
            .filter(|t| t.checked_mul(2).is_some())
            .ok_or_else(too_big)?;
        if block_elems == 0 || spec.num_blocks == 0 {
            return Err(bad("init_kv", format!("an empty KV pool: {spec:?}")));
        }
        Ok(Self {
            spec,
            data: alloc_vec_huge(total, f16::ZERO, "the KV cache")?,
            block_elems,
            block_len,
        })
    }

    /// The attention kernels' view of one layer.
    pub fn layout(&self) -> KvLayout {
        KvLayout {
            n_kv_heads: self.spec.n_kv_heads,
            head_dim: self.spec.head_dim,
            block_size: self.spec.block_size,
            block_stride: self.block_len,
        }
    }

    /// Where `layer`'s K and V blocks start (block 0), or an error for a layer the pool lacks.
    pub fn bases(&self, op: &'static str, layer: usize) -> Result<(usize, usize), BackendError> {
        if layer >= self.spec.n_layers {
            return Err(bad(
                op,
                format!("layer {layer} of a {}-layer KV pool", self.spec.n_layers),
            ));
        }
        let k = 2 * layer * self.block_elems;
        Ok((k, k + self.block_elems))
    }

    pub fn data(&self) -> &[f16] {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut [f16] {
        &mut self.data
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.block_len * std::mem::size_of::<f16>()
    }

    fn block_range(
        &self,
        op: &'static str,
        block: u32,
    ) -> Result<std::ops::Range<usize>, BackendError> {
        let b = block as usize;
        if b >= self.spec.num_blocks {
            return Err(bad(
                op,
                format!("block {b} of a {}-block pool", self.spec.num_blocks),
            ));
        }
        Ok(b * self.block_len..(b + 1) * self.block_len)
    }

    /// Copies whole blocks, `(src, dst)` pairs in order.
    pub fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), BackendError> {
        const OP: &str = "kv_copy_blocks";
        for &(src, dst) in pairs {
            let from = self.block_range(OP, src)?;
            let to = self.block_range(OP, dst)?;
            self.data.copy_within(from, to.start);
        }
        Ok(())
    }

    /// Copies `blocks` into `dst`, one block's bytes after another.
    pub fn save_blocks(&self, blocks: &[u32], dst: &mut [u8]) -> Result<(), BackendError> {
        const OP: &str = "kv_blocks_to_host";
        let bb = self.block_bytes();
        self.check_host_len(OP, blocks.len(), dst.len())?;
        for (&b, out) in blocks.iter().zip(dst.chunks_exact_mut(bb)) {
            let r = self.block_range(OP, b)?;
            out.copy_from_slice(bytemuck::cast_slice(&self.data[r]));
        }
        Ok(())
    }

    /// Copies host bytes (as `save_blocks` wrote them) into `blocks`.
    pub fn load_blocks(&mut self, src: &[u8], blocks: &[u32]) -> Result<(), BackendError> {
        const OP: &str = "kv_blocks_from_host";
        let bb = self.block_bytes();
        self.check_host_len(OP, blocks.len(), src.len())?;
        for (&b, bytes) in blocks.iter().zip(src.chunks_exact(bb)) {
            let r = self.block_range(OP, b)?;
            bytemuck::cast_slice_mut::<f16, u8>(&mut self.data[r]).copy_from_slice(bytes);
        }
        Ok(())
    }

    fn check_host_len(
        &self,
        op: &'static str,
        blocks: usize,
        bytes: usize,
    ) -> Result<(), BackendError> {
        if blocks.checked_mul(self.block_bytes()) != Some(bytes) {
            return Err(bad(
                op,
                format!(
                    "{bytes} host bytes for {blocks} blocks of {} bytes",
                    self.block_bytes()
                ),
            ));
        }
        Ok(())
    }
}

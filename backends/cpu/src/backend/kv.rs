//! The CPU backend's paged KV pool: one f16 allocation where each block holds, for every layer
//! in turn, that layer's K block then its V block. A block is therefore one contiguous run of
//! memory, so moving a block (device copy, host swap, prefill-to-decode handoff) is one copy;
//! the attention kernel steps over the other layers with the layout's block stride.
//!
//! A latent pool (multi-head latent attention) holds one row per token and layer instead: the
//! token's latent then its rotated key, `head_dim` values, token after token; there are no
//! values apart (attention reads the latent as the value).

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
    /// A latent pool: one row per token and layer, no V blocks.
    pub latent: bool,
}

impl KvPool {
    pub fn new(spec: KvSpec) -> Result<Self, BackendError> {
        Self::with_kind(spec, false)
    }

    /// A latent pool (see the module note): `spec.n_kv_heads` must be 1.
    pub fn new_latent(spec: KvSpec) -> Result<Self, BackendError> {
        if spec.n_kv_heads != 1 {
            return Err(bad(
                "init_latent_kv",
                format!("a latent pool has one row per token, not {spec:?}"),
            ));
        }
        Self::with_kind(spec, true)
    }

    fn with_kind(spec: KvSpec, latent: bool) -> Result<Self, BackendError> {
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
            .checked_mul(if latent { 1 } else { 2 })
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
            latent,
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
        if self.latent {
            return Err(bad(
                op,
                "a latent KV pool has no separate K and V (latent attention's ops use it)".into(),
            ));
        }
        let k = 2 * layer * self.block_elems;
        Ok((k, k + self.block_elems))
    }

    /// Where `layer`'s rows of block 0 start in a latent pool.
    pub fn latent_base(&self, op: &'static str, layer: usize) -> Result<usize, BackendError> {
        if !self.latent || layer >= self.spec.n_layers {
            return Err(bad(
                op,
                format!(
                    "layer {layer} of a {}-layer {} pool",
                    self.spec.n_layers,
                    if self.latent {
                        "latent"
                    } else {
                        "K/V (not latent)"
                    }
                ),
            ));
        }
        Ok(layer * self.block_elems)
    }

    /// f16 values between the same layer's rows of consecutive blocks.
    pub fn block_len(&self) -> usize {
        self.block_len
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

    /// Reads one layer of one block into token-major f32 rows.
    pub fn save_layer_block(
        &self,
        layer: usize,
        block: u32,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), BackendError> {
        const OP: &str = "kv_layer_block_to_host";
        let (k_base, v_base, lay) = self.layer_block(OP, layer, block, k.len(), v.len())?;
        let hd = lay.head_dim;
        for t in 0..lay.block_size {
            for kvh in 0..lay.n_kv_heads {
                let row = t * lay.n_kv_heads * hd + kvh * hd;
                for d in 0..hd {
                    k[row + d] = self.data[k_base + lay.k_at(0, kvh, d, t)].to_f32();
                    v[row + d] = self.data[v_base + lay.v_at(0, kvh, t, d)].to_f32();
                }
            }
        }
        Ok(())
    }

    /// Writes token-major f32 rows into one layer of one block.
    pub fn load_layer_block(
        &mut self,
        layer: usize,
        block: u32,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), BackendError> {
        const OP: &str = "kv_layer_block_from_host";
        let (k_base, v_base, lay) = self.layer_block(OP, layer, block, k.len(), v.len())?;
        let hd = lay.head_dim;
        for t in 0..lay.block_size {
            for kvh in 0..lay.n_kv_heads {
                let row = t * lay.n_kv_heads * hd + kvh * hd;
                for d in 0..hd {
                    self.data[k_base + lay.k_at(0, kvh, d, t)] = f16::from_f32(k[row + d]);
                    self.data[v_base + lay.v_at(0, kvh, t, d)] = f16::from_f32(v[row + d]);
                }
            }
        }
        Ok(())
    }

    /// Where `layer`'s K and V of `block` start, after checking the block, the layer and the
    /// host rows' lengths.
    fn layer_block(
        &self,
        op: &'static str,
        layer: usize,
        block: u32,
        k_len: usize,
        v_len: usize,
    ) -> Result<(usize, usize, KvLayout), BackendError> {
        let start = self.block_range(op, block)?.start;
        let (k0, v0) = self.bases(op, layer)?;
        if k_len != self.block_elems || v_len != self.block_elems {
            return Err(bad(
                op,
                format!(
                    "host rows of {k_len} and {v_len} values for a layer block of {}",
                    self.block_elems
                ),
            ));
        }
        Ok((start + k0, start + v0, self.layout()))
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

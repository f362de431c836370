//! The CPU backend's paged KV pool: one f16 allocation where each block holds, for every layer
//! in turn, that layer's K block then its V block. A block is therefore one contiguous run of
//! memory, so moving a block (device copy, host swap, prefill-to-decode handoff) is one copy;
//! the attention kernel steps over the other layers with the layout's block stride.
//!
//! An int8 pool (`KvDtype::Int8`) holds the values as int8 in `q` (the same K and V layouts,
//! one byte a value) and, in `data`, one f16 scale per token and KV head for K and for V: per
//! block, for each layer in turn, its K scales then its V scales (`[kv_head][block_pos]` each).
//! A block's bytes, as the host copies carry them, are its int8 values then its scales.
//!
//! A latent pool (multi-head latent attention) holds one row per token and layer instead: the
//! token's latent then its rotated key, `head_dim` values, token after token; there are no
//! values apart (attention reads the latent as the value).

use half::f16;
use npu_backend::{BackendError, KvDtype, KvSpec};

use super::buffer::{alloc_vec_huge, bad};
use crate::kernels::attention::{dequantize_row_i8, quantize_row_i8, I8Cache, KvLayout};

pub(crate) struct KvPool {
    pub spec: KvSpec,
    /// The f16 values; in an int8 pool, the scales.
    data: Vec<f16>,
    /// An int8 pool's values (empty otherwise).
    q: Vec<i8>,
    /// Values of one layer's K (or V) in one block.
    block_elems: usize,
    /// Values of one whole block (every layer's K and V).
    block_len: usize,
    /// An int8 pool's scales of one whole block (0 otherwise).
    scale_len: usize,
    /// A latent pool: one row per token and layer, no V blocks.
    pub latent: bool,
    pub dtype: KvDtype,
}

/// Bytes of one block of a pool of `spec` storing `dtype` (scales included), saturating.
pub(crate) fn block_bytes_for(spec: &KvSpec, dtype: KvDtype) -> usize {
    // One byte a value, and one f16 scale per token, KV head, K or V, and layer.
    spec.block_bytes(dtype)
}

impl KvPool {
    pub fn new(spec: KvSpec, dtype: KvDtype) -> Result<Self, BackendError> {
        let mut pool = Self::with_kind(spec, false, dtype)?;
        if dtype == KvDtype::Int8 {
            // `with_kind` sized `data` for f16 values: here it holds the scales instead.
            let scale_len = 2 * spec.n_layers * spec.n_kv_heads * spec.block_size;
            pool.data = Vec::new();
            pool.data = alloc_vec_huge(scale_len * spec.num_blocks, f16::ZERO, "the KV scales")?;
            pool.q = alloc_vec_huge(pool.block_len * spec.num_blocks, 0i8, "the KV cache")?;
            pool.scale_len = scale_len;
        }
        Ok(pool)
    }

    /// A latent pool (see the module note): `spec.n_kv_heads` must be 1.
    pub fn new_latent(spec: KvSpec) -> Result<Self, BackendError> {
        if spec.n_kv_heads != 1 {
            return Err(bad(
                "init_latent_kv",
                format!("a latent pool has one row per token, not {spec:?}"),
            ));
        }
        Self::with_kind(spec, true, KvDtype::F16)
    }

    fn with_kind(spec: KvSpec, latent: bool, dtype: KvDtype) -> Result<Self, BackendError> {
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
        let data = match dtype {
            KvDtype::F16 => alloc_vec_huge(total, f16::ZERO, "the KV cache")?,
            // `new` allocates the int8 pool's arrays.
            KvDtype::Int8 => Vec::new(),
        };
        Ok(Self {
            spec,
            data,
            q: Vec::new(),
            block_elems,
            block_len,
            scale_len: 0,
            latent,
            dtype,
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

    /// The layout of an int8 pool's scales: one value per token and KV head (`head_dim` 1).
    fn scale_layout(&self) -> KvLayout {
        KvLayout {
            n_kv_heads: self.spec.n_kv_heads,
            head_dim: 1,
            block_size: self.spec.block_size,
            block_stride: self.scale_len,
        }
    }

    /// Where `layer`'s K and V scales start (block 0) in an int8 pool.
    fn scale_bases(&self, layer: usize) -> (usize, usize) {
        let n = self.spec.n_kv_heads * self.spec.block_size;
        (2 * layer * n, 2 * layer * n + n)
    }

    /// The attention kernels' view of `layer` of an int8 pool (None for an f16 pool).
    pub fn i8_cache(
        &self,
        op: &'static str,
        layer: usize,
    ) -> Result<Option<I8Cache<'_>>, BackendError> {
        if self.dtype != KvDtype::Int8 {
            return Ok(None);
        }
        let (k, v) = self.bases(op, layer)?;
        let (ks, vs) = self.scale_bases(layer);
        Ok(Some(I8Cache {
            k: &self.q[k..],
            v: &self.q[v..],
            ks: &self.data[ks..],
            vs: &self.data[vs..],
            slay: self.scale_layout(),
        }))
    }

    /// Writes `n` new tokens' K and V rows (f32, rows `ldk` and `ldv` apart) into `layer` of an
    /// int8 pool at `slots`: each token's row of each KV head quantized with its own scale.
    #[allow(clippy::too_many_arguments)]
    pub fn write_i8(
        &mut self,
        op: &'static str,
        layer: usize,
        k: &[f32],
        ldk: usize,
        v: &[f32],
        ldv: usize,
        slots: &[u32],
    ) -> Result<(), BackendError> {
        let (k0, v0) = self.bases(op, layer)?;
        let (ks0, vs0) = self.scale_bases(layer);
        let (lay, slay) = (self.layout(), self.scale_layout());
        let (hd, bs) = (lay.head_dim, lay.block_size);
        let width = lay.n_kv_heads * hd;
        let mut row = vec![0i8; hd];
        for (i, &slot) in slots.iter().enumerate() {
            let (block, t) = (slot as usize / bs, slot as usize % bs);
            if block >= self.spec.num_blocks {
                return Err(bad(
                    op,
                    format!("slot {slot} beyond the {}-block pool", self.spec.num_blocks),
                ));
            }
            let k_row = &k[i * ldk..i * ldk + width];
            let v_row = &v[i * ldv..i * ldv + width];
            for kvh in 0..lay.n_kv_heads {
                let scale = quantize_row_i8(&k_row[kvh * hd..(kvh + 1) * hd], &mut row);
                for (d, &x) in row.iter().enumerate() {
                    self.q[k0 + lay.k_at(block, kvh, d, t)] = x;
                }
                self.data[ks0 + slay.k_at(block, kvh, 0, t)] = scale;
                let at = v0 + lay.v_at(block, kvh, t, 0);
                let scale =
                    quantize_row_i8(&v_row[kvh * hd..(kvh + 1) * hd], &mut self.q[at..at + hd]);
                self.data[vs0 + slay.v_at(block, kvh, t, 0)] = scale;
            }
        }
        Ok(())
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

    /// Bytes of one block (an int8 pool's: its values, then its scales).
    pub fn block_bytes(&self) -> usize {
        match self.dtype {
            KvDtype::F16 => self.block_len * std::mem::size_of::<f16>(),
            KvDtype::Int8 => self.block_len + self.scale_len * std::mem::size_of::<f16>(),
        }
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

    /// An int8 pool's scales of `block` (after `block_range` checked it).
    fn scale_range(&self, block: u32) -> std::ops::Range<usize> {
        let b = block as usize;
        b * self.scale_len..(b + 1) * self.scale_len
    }

    /// Copies whole blocks, `(src, dst)` pairs in order.
    pub fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), BackendError> {
        const OP: &str = "kv_copy_blocks";
        for &(src, dst) in pairs {
            let from = self.block_range(OP, src)?;
            let to = self.block_range(OP, dst)?;
            if self.dtype == KvDtype::Int8 {
                self.q.copy_within(from, to.start);
                let (from, to) = (self.scale_range(src), self.scale_range(dst));
                self.data.copy_within(from, to.start);
            } else {
                self.data.copy_within(from, to.start);
            }
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
            if self.dtype == KvDtype::Int8 {
                let (values, scales) = out.split_at_mut(self.block_len);
                values.copy_from_slice(bytemuck::cast_slice(&self.q[r]));
                scales.copy_from_slice(bytemuck::cast_slice(&self.data[self.scale_range(b)]));
                continue;
            }
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
            if self.dtype == KvDtype::Int8 {
                let (values, scales) = bytes.split_at(self.block_len);
                bytemuck::cast_slice_mut::<i8, u8>(&mut self.q[r]).copy_from_slice(values);
                let sr = self.scale_range(b);
                bytemuck::cast_slice_mut::<f16, u8>(&mut self.data[sr]).copy_from_slice(scales);
                continue;
            }
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
        if self.dtype == KvDtype::Int8 {
            // Dequantized: value times its row's scale.
            let (ks, vs) = self.scale_bases(layer);
            let s0 = self.scale_range(block).start;
            let slay = self.scale_layout();
            let mut row = vec![0i8; hd];
            for t in 0..lay.block_size {
                for kvh in 0..lay.n_kv_heads {
                    let at = t * lay.n_kv_heads * hd + kvh * hd;
                    for (d, x) in row.iter_mut().enumerate() {
                        *x = self.q[k_base + lay.k_at(0, kvh, d, t)];
                    }
                    let scale = self.data[s0 + ks + slay.k_at(0, kvh, 0, t)];
                    dequantize_row_i8(&row, scale, &mut k[at..at + hd]);
                    let v0 = v_base + lay.v_at(0, kvh, t, 0);
                    let scale = self.data[s0 + vs + slay.v_at(0, kvh, t, 0)];
                    dequantize_row_i8(&self.q[v0..v0 + hd], scale, &mut v[at..at + hd]);
                }
            }
            return Ok(());
        }
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
        if self.dtype == KvDtype::Int8 {
            // Quantized again, row by row, as `write_i8` does.
            let slots: Vec<u32> = (0..lay.block_size as u32)
                .map(|t| block * lay.block_size as u32 + t)
                .collect();
            let _ = (k_base, v_base);
            let width = lay.n_kv_heads * hd;
            return self.write_i8(OP, layer, k, width, v, width, &slots);
        }
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

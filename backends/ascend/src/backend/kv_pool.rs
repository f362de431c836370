//! The paged KV pool on the device: per layer one key and one value cache of shape
//! (num_blocks, block_size, KV_N·D) f16 ([`crate::kv`] checks the block size the attention
//! operator takes). A block's bytes in one cache are contiguous and a multiple of 64, so blocks
//! move with `aclrtMemcpyAsync` (which needs 64-byte aligned addresses): device→device on the
//! stream, and device↔host through pinned memory, every layer's K then V in turn.
//!
//! A latent pool (DeepSeek's latent attention, [`KvPool::new_latent`]) holds per layer one cache
//! of (num_blocks, block_size, row) with a token's latent then its rotated key in each row, and
//! no value cache (the attention reads the latents from the same rows): its blocks move the same
//! way, every layer's cache in turn. A latent pool of DeepSeek's own rows (512 + 64,
//! [`MLA_ROW`]) is split for FusedInferAttentionScoreV3's MLA form, which takes the latents and
//! the rotated keys as two contiguous caches: per layer (num_blocks, block_size, 512) then
//! (num_blocks, block_size, 64), a block's host bytes per layer its latents then its rotated keys.
//!
//! The pool stores f16 (or bf16) only: `kv_cache_dtype: int8` is refused ([`INT8_KV_REFUSAL`]),
//! naming the attention forms CANN's pages lack for our int8 scheme (docs/kv-cache.md).

use std::sync::Arc;

use npu_backend::{BackendError, KvDtype, KvSpec};

use super::objects::zeroed;
use super::{err, AscendBackend};
use crate::device::Device;
use crate::memory::DeviceBuffer as Mem;

/// The latent row FusedInferAttentionScoreV3's MLA form takes: a 512-wide latent then a 64-wide
/// rotated key (DeepSeek-V2/V3/R1, Kimi-K2).
pub const MLA_ROW: (usize, usize) = (512, 64);

pub struct KvPool {
    pub spec: KvSpec,
    /// A latent pool: `k` holds each layer's rows, `v` is empty (unless `mla`).
    pub latent: bool,
    /// A latent pool of [`MLA_ROW`]s, split: `k` holds the latents, `v` the rotated keys.
    pub mla: Option<(usize, usize)>,
    k: Vec<Mem>,
    v: Vec<Mem>,
}

/// Why the Ascend pool does not store int8 (our scheme: one scale per token, KV head and K or V,
/// computed as the row is written and kept in the paged blocks). aclnnFusedInferAttentionScore
/// V2–V5 (CANN 8.1–8.5) read such scales from a paged INT8 cache only when Q_S = 1
/// (keyAntiquantMode = valueAntiquantMode = 5, "per-token叠加per head并使用page attention模式管理
/// scale/offset": FLOAT32 scales of shape (blockNum, KV_N, blockSize)); with Q_S > 1 the pages
/// take INT8 keys and values in modes 0 and 1 only (per-channel, or per-token without per-head),
/// with BFLOAT16 queries, Q_S <= 16 and without page attention, so prefill, chunks and
/// speculative verification over a paged int8 cache have no documented form. The emulator
/// implements mode 5 for Q_S = 1 (`backends/ascend/tests/int8_kv_fia.rs`); the pool, the
/// quantizing write and a dequantized f16 scratch for Q_S > 1 are not built (docs/kv-cache.md).
pub const INT8_KV_REFUSAL: &str = "the int8 KV cache is built on the CPU and CUDA backends only: \
     on ascend, FusedInferAttentionScore (V2-V5, CANN 8.1-8.5) reads a paged INT8 cache with one \
     scale per token and KV head (keyAntiquantMode/valueAntiquantMode 5, FLOAT32 scales \
     (blockNum, KV_N, blockSize)) only when Q_S = 1; for Q_S > 1 (prefill, chunks, speculative \
     verification) its page takes INT8 keys/values only in modes 0/1 (per-channel or per-token \
     without per-head), BFLOAT16 queries, Q_S <= 16 and no page attention";

/// `set_kv_dtype` on Ascend: f16 (the activations' 16-bit type) only; int8 refused by name.
pub(super) fn check_kv_dtype(dtype: KvDtype) -> Result<(), BackendError> {
    match dtype {
        KvDtype::F16 => Ok(()),
        KvDtype::Int8 => Err(BackendError::Unsupported {
            backend: "ascend",
            what: format!("kv_cache_dtype int8 ({INT8_KV_REFUSAL})"),
        }),
    }
}

impl KvPool {
    pub(super) fn new(dev: &Arc<Device>, spec: KvSpec) -> Result<Self, BackendError> {
        Self::make(dev, spec, false)
    }

    /// A latent pool: `spec.n_kv_heads` must be 1 and `spec.head_dim` is the row (latent then
    /// rotated key), a multiple of 16 as FusedInferAttentionScoreV2 takes the rows as keys.
    pub(super) fn new_latent(dev: &Arc<Device>, spec: KvSpec) -> Result<Self, BackendError> {
        if spec.n_kv_heads != 1 {
            return Err(BackendError::BadArgument {
                op: "init_latent_kv",
                message: format!(
                    "{} KV heads: a latent pool has one row a token",
                    spec.n_kv_heads
                ),
            });
        }
        let ops = &dev.acl.api.ops;
        if spec.head_dim == MLA_ROW.0 + MLA_ROW.1
            && ops
                .aclnnFusedInferAttentionScoreV3GetWorkspaceSize
                .is_none()
        {
            return Err(BackendError::Unsupported {
                backend: super::NAME,
                what: "latent attention: rows of 512 + 64 need aclnnFusedInferAttentionScoreV3's \
                       MLA form (this CANN release does not have the operator)"
                    .into(),
            });
        }
        if spec.head_dim == MLA_ROW.0 + MLA_ROW.1 && ![16, 128].contains(&spec.block_size) {
            return Err(BackendError::Unsupported {
                backend: super::NAME,
                what: format!(
                    "latent attention: rows of 512 + 64 go through FusedInferAttentionScoreV3's MLA \
                     form, whose paged cache takes blocks of 16 or 128 tokens, not \
                     pa_config.block_size = {}",
                    spec.block_size
                ),
            });
        }
        Self::make(dev, spec, true)
    }

    /// Row widths of each of a layer's caches (K/V: both `n_kv_heads · head_dim`).
    fn widths(&self) -> Vec<usize> {
        match (self.latent, self.mla) {
            (true, Some((l, r))) => vec![l, r],
            (true, None) => vec![self.spec.head_dim],
            (false, _) => vec![self.spec.n_kv_heads * self.spec.head_dim; 2],
        }
    }

    fn make(dev: &Arc<Device>, spec: KvSpec, latent: bool) -> Result<Self, BackendError> {
        let layout = crate::kv::KvSpec {
            layers: spec.n_layers,
            num_blocks: spec.num_blocks,
            block_size: spec.block_size,
            kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
        };
        layout.validate().map_err(|e| BackendError::Unsupported {
            backend: super::NAME,
            what: e.to_string(),
        })?;
        if spec.n_layers == 0 || spec.num_blocks == 0 || spec.n_kv_heads == 0 {
            return Err(BackendError::BadArgument {
                op: "init_kv",
                message: format!("an empty KV pool: {spec:?}"),
            });
        }
        // Sized against aclrtGetMemInfo before anything is allocated, so that a pool too large
        // fails at start with what would fit, not midway through the layers.
        let (free, _) = dev.mem_info().map_err(err)?;
        let caches = if latent { 1 } else { 2 };
        let total = layout.total_bytes() / 2 * caches;
        if total > free {
            let fits = layout.blocks_for_memory(free, 0.95, 0) * 2 / caches;
            return Err(BackendError::OutOfMemory {
                backend: super::NAME,
                what: format!(
                    "the KV pool of {} blocks of {} tokens: {free} bytes of device memory are free, \
                     room for about {fits} blocks — lower pa_config.num_blocks",
                    spec.num_blocks, spec.block_size
                ),
                bytes: total,
            });
        }
        let bytes = layout.layer_bytes();
        let mla = (latent && spec.head_dim == MLA_ROW.0 + MLA_ROW.1).then_some(MLA_ROW);
        let mut k = Vec::with_capacity(spec.n_layers);
        let mut v = Vec::with_capacity(spec.n_layers);
        for l in 0..spec.n_layers {
            if let Some((lat, rope)) = mla {
                let rows = spec.num_blocks * spec.block_size * 2;
                k.push(zeroed(
                    dev,
                    rows * lat,
                    &format!("layer {l}'s latent cache"),
                )?);
                v.push(zeroed(
                    dev,
                    rows * rope,
                    &format!("layer {l}'s rotated-key cache"),
                )?);
                continue;
            }
            if latent {
                k.push(zeroed(dev, bytes, &format!("layer {l}'s latent cache"))?);
                continue;
            }
            k.push(zeroed(dev, bytes, &format!("layer {l}'s key cache"))?);
            v.push(zeroed(dev, bytes, &format!("layer {l}'s value cache"))?);
        }
        Ok(Self {
            spec,
            latent,
            mla,
            k,
            v,
        })
    }

    /// Layer `l`'s caches in the order their blocks move: K then V, or the latent rows alone.
    fn caches(&self, l: usize) -> impl Iterator<Item = &Mem> {
        std::iter::once(&self.k[l]).chain(self.v.get(l))
    }

    /// Bytes of one block in each of a layer's caches (in [`Self::caches`]' order).
    fn cache_block_bytes(&self) -> Vec<usize> {
        let bs = self.spec.block_size;
        self.widths().into_iter().map(|w| bs * w * 2).collect()
    }

    /// Bytes of one block over every layer's K and V (or latent rows).
    pub fn block_bytes(&self) -> usize {
        self.spec.n_layers * self.cache_block_bytes().iter().sum::<usize>()
    }

    /// Layer `layer`'s key and value caches; of a latent pool, its rows as both (FusedInfer-
    /// AttentionScoreV2 reads the keys and the values from them); of a split one (`mla`), its
    /// latents and its rotated keys.
    pub fn layer(&self, layer: usize) -> Result<(&Mem, &Mem), BackendError> {
        let v = if self.latent && self.mla.is_none() {
            self.k.get(layer)
        } else {
            self.v.get(layer)
        };
        match (self.k.get(layer), v) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(BackendError::BadArgument {
                op: "kv",
                message: format!("layer {layer} of a {}-layer pool", self.spec.n_layers),
            }),
        }
    }

    fn check_block(&self, b: u32) -> Result<(), BackendError> {
        if b as usize >= self.spec.num_blocks {
            return Err(BackendError::BadArgument {
                op: "kv blocks",
                message: format!("block {b} of a {}-block pool", self.spec.num_blocks),
            });
        }
        Ok(())
    }

    pub(super) fn copy_blocks(
        &mut self,
        dev: &Device,
        pairs: &[(u32, u32)],
    ) -> Result<(), BackendError> {
        for &(s, d) in pairs {
            self.check_block(s)?;
            self.check_block(d)?;
        }
        let cbs = self.cache_block_bytes();
        for &(s, d) in pairs {
            if s == d {
                continue;
            }
            for l in 0..self.spec.n_layers {
                let caches = std::iter::once(&mut self.k[l]).chain(self.v.get_mut(l));
                for (cache, &cb) in caches.zip(&cbs) {
                    cache
                        .copy_within_async(d as usize * cb, s as usize * cb, cb, dev)
                        .map_err(err)?;
                }
            }
        }
        Ok(())
    }
}

impl AscendBackend {
    pub(super) fn kv_to_host(
        &mut self,
        blocks: &[u32],
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        self.bind()?;
        let kv = self.kv()?;
        let bb = kv.block_bytes();
        if dst.len() != blocks.len() * bb {
            return Err(BackendError::BadArgument {
                op: "kv_blocks_to_host",
                message: format!("{} bytes for {} blocks of {bb}", dst.len(), blocks.len()),
            });
        }
        for &b in blocks {
            kv.check_block(b)?;
        }
        if blocks.is_empty() {
            return Ok(());
        }
        let cbs = kv.cache_block_bytes();
        let staging = self.staging.get(self.dev.acl, dst.len())?;
        let kv = self.kv.as_ref().expect("checked");
        let mut at = 0;
        for &b in blocks {
            for l in 0..kv.spec.n_layers {
                for (cache, &cb) in kv.caches(l).zip(&cbs) {
                    cache
                        .download_async(b as usize * cb, staging, at, cb, &self.dev)
                        .map_err(err)?;
                    at += cb;
                }
            }
        }
        self.staging.busy = true;
        self.pending = true;
        self.sync()?;
        let staging = self.staging.current().expect("just used");
        dst.copy_from_slice(&staging.as_slice()[..dst.len()]);
        Ok(())
    }

    pub(super) fn kv_from_host(&mut self, src: &[u8], blocks: &[u32]) -> Result<(), BackendError> {
        self.bind()?;
        let kv = self.kv()?;
        let bb = kv.block_bytes();
        if src.len() != blocks.len() * bb {
            return Err(BackendError::BadArgument {
                op: "kv_blocks_from_host",
                message: format!("{} bytes for {} blocks of {bb}", src.len(), blocks.len()),
            });
        }
        for &b in blocks {
            kv.check_block(b)?;
        }
        if blocks.is_empty() {
            return Ok(());
        }
        let cbs = kv.cache_block_bytes();
        let staging = self.staging.get(self.dev.acl, src.len())?;
        staging.as_mut_slice()[..src.len()].copy_from_slice(src);
        let kv = self.kv.as_mut().expect("checked");
        let mut at = 0;
        for &b in blocks {
            for l in 0..kv.spec.n_layers {
                let caches = std::iter::once(&mut kv.k[l]).chain(kv.v.get_mut(l));
                for (cache, &cb) in caches.zip(&cbs) {
                    cache
                        .upload_async(b as usize * cb, staging, at, cb, &self.dev)
                        .map_err(err)?;
                    at += cb;
                }
            }
        }
        // The copies read the staging memory when they run: it stays until the next sync.
        self.staging.busy = true;
        self.pending = true;
        Ok(())
    }
}

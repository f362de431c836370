//! The CUDA backend's paged KV pool: one device allocation of `num_blocks` blocks, a block
//! holding K and V of every layer, so that moving a block (device copy, host swap, prefix-cache
//! host tier, prefill-to-decode handoff) is one contiguous copy. The backend's `Backend` methods
//! for the pool (`init_kv`, the block copies) are built here.
//!
//! **f16 pools** (and latent ones, `mla.rs`): `[block][layer][K, V][kv_head][block_pos][head_dim]`
//! (attention.cu).
//!
//! **int8 pools** (`KvDtype::Int8`, `npu_serving.kv_cache_dtype: int8`) hold exactly the CPU
//! backend's block bytes (`backends/cpu/src/backend/kv.rs`): a block's int8 values, then its f16
//! scales. Values: for each layer in turn, K as `[kv_head][head_dim][block_pos]` then V as
//! `[kv_head][block_pos][head_dim]`, one byte a value. Scales: for each layer in turn, K's
//! `[kv_head][block_pos]` then V's, one per token and KV head (`scale = f16(max|x| / 127)`,
//! `q = round(x / scale)`, ±127; kernels/attention_i8.cu). A block is
//! `KvSpec::int8_block_bytes` (the CPU's size), so a pool sized from free memory holds ~1.9x
//! the tokens of an f16 one, and host copies carry the same bytes on either backend.

use npu_backend::{BackendError, KvDtype, KvSpec};

use crate::backend::{CudaBackend, NAME};
use crate::buffer::DeviceMem;
use crate::gpu::DevPtr;

/// The paged KV pool (module note).
pub(crate) struct KvPool {
    pub spec: KvSpec,
    pub mem: DeviceMem,
    /// f16 elements of one block of an f16 or latent pool; 0 in an int8 pool (whose f16
    /// kernels are never launched: see `block_bytes`).
    pub block_elems: usize,
    /// A latent pool (latent attention's ops read it; `kv_write` and `attention` refuse it).
    pub latent: bool,
    /// What the pool stores (a latent pool: f16).
    pub dtype: KvDtype,
}

/// Byte offsets inside a block of one layer of an int8 pool (module note): its K values (its V
/// values follow `n_kv * head_dim * block_size` bytes later) and its K scales (its V scales
/// follow `n_kv * block_size` scales later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct I8Layer {
    pub values: usize,
    pub scales: usize,
}

impl KvPool {
    /// Element offset of `layer`'s K inside a block of an f16 pool (its V follows
    /// `n_kv * bs * hd` later); in a latent pool, of `layer`'s rows.
    pub fn layer_offset(&self, layer: usize) -> usize {
        let s = &self.spec;
        let parts = if self.latent { 1 } else { 2 };
        layer * parts * s.n_kv_heads * s.block_size * s.head_dim
    }

    /// Bytes of one block (an int8 pool's: its values, then its scales).
    pub fn block_bytes(&self) -> usize {
        match self.dtype {
            KvDtype::F16 => self.block_elems * 2,
            KvDtype::Int8 => self.spec.int8_block_bytes(),
        }
    }

    /// Where `layer` lies in a block of an int8 pool (module note).
    pub fn i8_layer(&self, layer: usize) -> I8Layer {
        i8_layer(&self.spec, layer)
    }
}

/// Where `layer` lies in a block of an int8 pool of `spec` (module note).
pub(crate) fn i8_layer(s: &KvSpec, layer: usize) -> I8Layer {
    let head = s.n_kv_heads * s.block_size;
    I8Layer {
        values: 2 * layer * head * s.head_dim,
        scales: 2 * s.n_layers * head * s.head_dim + 2 * (2 * layer * head),
    }
}

/// f16 elements of one block of an f16 pool (K and V of every layer).
fn f16_block_elems(spec: &KvSpec) -> usize {
    [
        spec.n_layers,
        2,
        spec.n_kv_heads,
        spec.block_size,
        spec.head_dim,
    ]
    .into_iter()
    .fold(1usize, usize::saturating_mul)
}

impl CudaBackend {
    /// `set_kv_dtype`: f16 or int8 (a latent pool refuses int8 when it is made).
    pub(crate) fn op_set_kv_dtype(&mut self, dtype: KvDtype) -> Result<(), BackendError> {
        self.kv_dtype = dtype;
        Ok(())
    }

    /// `init_kv`: the pool of `spec` storing `kv_dtype`, zeroed.
    pub(crate) fn op_init_kv(&mut self, spec: KvSpec) -> Result<(), BackendError> {
        let dtype = self.kv_dtype;
        let block_bytes = spec.block_bytes(dtype);
        let slots = spec.num_blocks.checked_mul(spec.block_size);
        if f16_block_elems(&spec) == 0
            || block_bytes == usize::MAX
            || spec.num_blocks == 0
            || !matches!(slots, Some(n) if n <= i32::MAX as usize)
        {
            return Err(BackendError::BadArgument {
                op: "init_kv",
                message: format!("unusable KV pool shape {spec:?}"),
            });
        }
        // What the attention kernel cannot read is refused here, when the model loads, rather
        // than at its first step (review finding 9).
        if !spec.head_dim.is_multiple_of(2) || spec.head_dim > crate::attention::ATT_MAX_HD {
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!(
                    "attention heads of {} values (even, at most {})",
                    spec.head_dim,
                    crate::attention::ATT_MAX_HD
                ),
            });
        }
        let bytes =
            spec.num_blocks
                .checked_mul(block_bytes)
                .ok_or_else(|| BackendError::OutOfMemory {
                    backend: NAME,
                    what: "the KV pool".into(),
                    bytes: usize::MAX,
                })?;
        self.kv = None;
        self.layout = None;
        let mem = self.alloc_mem(bytes).map_err(|e| match e {
            BackendError::OutOfMemory { bytes, .. } => BackendError::OutOfMemory {
                backend: NAME,
                what: format!(
                    "the KV pool ({} blocks of {})",
                    spec.num_blocks,
                    dtype.name()
                ),
                bytes,
            },
            e => e,
        })?;
        self.kv = Some(KvPool {
            spec,
            mem,
            block_elems: if dtype == KvDtype::F16 {
                f16_block_elems(&spec)
            } else {
                0
            },
            latent: false,
            dtype,
        });
        Ok(())
    }

    /// Refuses block ids beyond the pool; the pool otherwise.
    fn check_block_ids(&self, ids: &[u32], op: &'static str) -> Result<&KvPool, BackendError> {
        let kv = self.kv_pool()?;
        if let Some(b) = ids.iter().find(|&&b| b as usize >= kv.spec.num_blocks) {
            return Err(BackendError::BadArgument {
                op,
                message: format!(
                    "block {b} is beyond the KV pool ({} blocks)",
                    kv.spec.num_blocks
                ),
            });
        }
        Ok(kv)
    }

    /// Refuses host memory that is not `blocks` whole blocks; the block's bytes otherwise.
    fn check_host_len(
        op: &'static str,
        kv: &KvPool,
        blocks: usize,
        len: usize,
    ) -> Result<usize, BackendError> {
        let bb = kv.block_bytes();
        if len != blocks * bb {
            return Err(BackendError::BadArgument {
                op,
                message: format!("{len} bytes for {blocks} blocks of {bb}"),
            });
        }
        Ok(bb)
    }

    pub(crate) fn op_kv_copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), BackendError> {
        let ids: Vec<u32> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
        self.device_wrote();
        let kv = self.check_block_ids(&ids, "kv_copy_blocks")?;
        let bb = kv.block_bytes();
        let base = kv.mem.ptr();
        for &(s, d) in pairs {
            if s != d {
                self.gpu.dtod(
                    base + (d as usize * bb) as u64,
                    base + (s as usize * bb) as u64,
                    bb,
                )?;
            }
        }
        Ok(())
    }

    pub(crate) fn op_kv_blocks_to_host(
        &mut self,
        blocks: &[u32],
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        const OP: &str = "kv_blocks_to_host";
        let kv = self.check_block_ids(blocks, OP)?;
        let bb = Self::check_host_len(OP, kv, blocks.len(), dst.len())?;
        let base = kv.mem.ptr();
        let regions: Vec<(DevPtr, usize)> = blocks
            .iter()
            .map(|&b| (base + (b as usize * bb) as u64, bb))
            .collect();
        let mut bytes = std::mem::take(&mut self.read_buf);
        let res = self.gpu.read(&regions, &mut bytes);
        if res.is_ok() {
            dst.copy_from_slice(&bytes[..dst.len()]);
        }
        self.read_buf = bytes;
        res
    }

    pub(crate) fn op_kv_blocks_from_host(
        &mut self,
        src: &[u8],
        blocks: &[u32],
    ) -> Result<(), BackendError> {
        const OP: &str = "kv_blocks_from_host";
        self.device_wrote();
        let kv = self.check_block_ids(blocks, OP)?;
        let bb = Self::check_host_len(OP, kv, blocks.len(), src.len())?;
        let base = kv.mem.ptr();
        for (i, &b) in blocks.iter().enumerate() {
            self.gpu
                .htod(base + (b as usize * bb) as u64, &src[i * bb..(i + 1) * bb])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_layers_lie_where_the_cpu_pool_puts_them() {
        let spec = KvSpec {
            n_layers: 3,
            num_blocks: 2,
            block_size: 4,
            n_kv_heads: 2,
            head_dim: 8,
        };
        // Values: 3 layers x (K, V) x 2 heads x 8 x 4 = 384 bytes, then 3 x 2 x 2 x 4 f16 scales.
        assert_eq!(spec.int8_block_bytes(), 384 + 48 * 2);
        let at = |l| {
            let x = i8_layer(&spec, l);
            (x.values, x.scales)
        };
        assert_eq!(at(0), (0, 384));
        assert_eq!(at(1), (128, 384 + 32));
        // The last layer's V values end where the scales begin, its V scales at the block's end.
        assert_eq!(at(2).0 + 2 * 2 * 8 * 4, 384);
        assert_eq!(at(2).1 + 2 * 2 * 4 * 2, spec.int8_block_bytes());
    }
}

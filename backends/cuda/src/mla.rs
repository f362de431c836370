//! DeepSeek's ops on the CUDA backend (kernels/mla.cu): scored expert routing
//! ([`Capability::ScoredRouting`]: one warp a token, f32 scores, the selection bias a device f32
//! vector, group-limited choice, normalisation and routed scale, nothing read back), and
//! multi-head latent attention over a paged pool of latents ([`Capability::LatentAttention`]).
//!
//! The latent pool holds, per block and layer, `block_size` f16 rows of `head_dim` values (a
//! token's latent, then its rotated key), block-contiguous across layers as the K/V pool is, so
//! `kv_copy_blocks`, `kv_blocks_to_host` and `kv_blocks_from_host` move its blocks unchanged.
//! `attention_latent` runs one block per (token row, chunk of up to 8 heads): the chunk's heads
//! share every tile of cached rows it loads; the context is not split across blocks (a long
//! decode at batch 1 runs on few blocks).
//!
//! [`Capability::ScoredRouting`]: npu_backend::Capability::ScoredRouting
//! [`Capability::LatentAttention`]: npu_backend::Capability::LatentAttention

use npu_backend::{
    AttnGeometry, BackendError, DType, DeviceBuffer, KvSpec, RouteSpec, View, ViewMut,
};
use npu_model::Gating;

use crate::backend::{CudaBackend, KvPool, NAME};
use crate::buffer::CudaBuffer;
use crate::gpu::{Args, LaunchDims};
use crate::kernels::{op_kernel, Op};
use crate::ops::{addr, addr_mut, float, grid_rows, int, need, same};
use crate::step::QUERY_TILES;

/// Positions per tile of cached rows (ATTL_TILE in mla.cu).
const ATTL_TILE: usize = 32;
/// Most latent values per head the attention kernel's accumulators hold (ATTL_MAX_LAT).
pub(crate) const ATTL_MAX_LAT: usize = 512;
/// Longest pool row (latent and rotated key) a latent pool is made for.
pub(crate) const ATTL_MAX_ROW: usize = 1024;
/// Heads (warps) per attention block, at most (ATTL_MAX_THREADS / 32 in mla.cu is 16).
const ATTL_WARPS: usize = 8;
/// Shared memory a kernel gets without opting in.
const DEFAULT_SMEM: usize = 48 * 1024;

/// f16 elements of one latent block: every layer's `block_size` rows of `head_dim`.
pub(crate) fn latent_block_elems(spec: &KvSpec) -> usize {
    [spec.n_layers, spec.block_size, spec.head_dim]
        .into_iter()
        .fold(1usize, usize::saturating_mul)
}

/// Threads for a row kernel over `n` columns: a multiple of 32, at most `max`.
fn row_threads(n: usize, max: usize) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, max) as u32
}

impl CudaBackend {
    pub(crate) fn op_init_latent_kv(&mut self, spec: KvSpec) -> Result<(), BackendError> {
        const OP: &str = "init_latent_kv";
        if self.kv_dtype != npu_backend::KvDtype::F16 {
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!(
                    "kv_cache_dtype {} with latent attention (the latent KV pool stays f16)",
                    self.kv_dtype.name()
                ),
            });
        }
        need(spec.n_kv_heads == 1, OP, || {
            format!("a latent pool has one row per token, not {spec:?}")
        })?;
        let block_elems = latent_block_elems(&spec);
        let slots = spec.num_blocks.checked_mul(spec.block_size);
        need(
            block_elems > 0
                && block_elems < usize::MAX
                && spec.num_blocks > 0
                && matches!(slots, Some(n) if n <= i32::MAX as usize),
            OP,
            || format!("unusable latent KV pool shape {spec:?}"),
        )?;
        // What latent attention cannot read is refused when the model loads.
        if !spec.head_dim.is_multiple_of(2) || spec.head_dim > ATTL_MAX_ROW {
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!(
                    "latent attention over rows of {} values (even, at most {ATTL_MAX_ROW})",
                    spec.head_dim
                ),
            });
        }
        let bytes = spec
            .num_blocks
            .checked_mul(block_elems * 2)
            .ok_or_else(|| BackendError::OutOfMemory {
                backend: NAME,
                what: "the latent KV pool".into(),
                bytes: usize::MAX,
            })?;
        self.kv = None;
        self.layout = None;
        let mem = self.alloc_mem(bytes).map_err(|e| match e {
            BackendError::OutOfMemory { bytes, .. } => BackendError::OutOfMemory {
                backend: NAME,
                what: format!("the latent KV pool ({} blocks)", spec.num_blocks),
                bytes,
            },
            e => e,
        })?;
        self.kv = Some(KvPool {
            spec,
            mem,
            block_elems,
            latent: true,
            dtype: npu_backend::KvDtype::F16,
        });
        Ok(())
    }

    /// The pool, if it is a latent one holding `layer`.
    fn latent_pool(&self, op: &'static str, layer: usize) -> Result<&KvPool, BackendError> {
        let kv = self.kv_pool()?;
        need(kv.latent, op, || {
            "the KV pool is not a latent one (init_latent_kv)".into()
        })?;
        need(layer < kv.spec.n_layers, op, || {
            format!("layer {layer} of a pool of {} layers", kv.spec.n_layers)
        })?;
        Ok(kv)
    }

    pub(crate) fn op_kv_write_latent(
        &mut self,
        latent: View<'_, CudaBuffer>,
        rope: View<'_, CudaBuffer>,
        layer: usize,
    ) -> Result<(), BackendError> {
        const OP: &str = "kv_write_latent";
        self.own(latent.buf(), OP)?;
        self.own(rope.buf(), OP)?;
        let (lay, meta) = self.step_meta()?;
        let row = self.latent_pool(OP, layer)?.spec.head_dim;
        let dt = float(OP, latent.dtype())?;
        same(OP, dt, rope.dtype())?;
        let (ll, rl) = (latent.layout(), rope.layout());
        need(
            ll.rows() == lay.n_tokens && rl.rows() == lay.n_tokens && ll.cols() + rl.cols() == row,
            OP,
            || {
                format!(
                    "latent {}x{} and rope {}x{} for {} tokens of rows of {row}",
                    ll.rows(),
                    ll.cols(),
                    rl.rows(),
                    rl.cols(),
                    lay.n_tokens
                )
            },
        )?;
        if lay.n_tokens == 0 {
            return Ok(());
        }
        let kv = self.kv_pool()?;
        self.launch(
            op_kernel(Op::KvWriteLatent, dt),
            LaunchDims::linear([int(OP, lay.n_tokens)? as u32, 1, 1], row_threads(row, 256)),
            Args::new()
                .ptr(addr(&latent))
                .i32(int(OP, ll.stride())?)
                .i32(int(OP, ll.cols())?)
                .ptr(addr(&rope))
                .i32(int(OP, rl.stride())?)
                .ptr(meta + 4 * lay.slots as u64)
                .ptr(kv.mem.ptr())
                .i64(kv.block_elems as i64)
                .i64(kv.layer_offset(layer) as i64)
                .i32(int(OP, row)?)
                .i32(int(OP, kv.spec.block_size)?),
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_attention_latent(
        &mut self,
        q_latent: View<'_, CudaBuffer>,
        q_rope: View<'_, CudaBuffer>,
        g: &AttnGeometry,
        latent_dim: usize,
        layer: usize,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "attention_latent";
        self.own(q_latent.buf(), OP)?;
        self.own(q_rope.buf(), OP)?;
        self.own(out.buf(), OP)?;
        let (lay, meta) = self.step_meta()?;
        let row = self.latent_pool(OP, layer)?.spec.head_dim;
        let dt = float(OP, q_latent.dtype())?;
        same(OP, dt, q_rope.dtype())?;
        same(OP, dt, out.dtype())?;
        let h = g.n_heads;
        need(
            g.head_dim == row && g.n_kv_heads == 1 && latent_dim > 0 && latent_dim < row && h > 0,
            OP,
            || {
                format!(
                    "a geometry of {h} heads, {} KV heads of {} with a latent of {latent_dim} \
                     over a pool of rows of {row}",
                    g.n_kv_heads, g.head_dim
                )
            },
        )?;
        need(g.window.is_none(), OP, || {
            "latent attention through a window".into()
        })?;
        if !latent_dim.is_multiple_of(2) || latent_dim > ATTL_MAX_LAT {
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!(
                    "latent attention with latents of {latent_dim} (even, at most {ATTL_MAX_LAT})"
                ),
            });
        }
        let rope_dim = row - latent_dim;
        let (ql, qr, ol) = (q_latent.layout(), q_rope.layout(), out.layout());
        let n = lay.n_tokens;
        let dims = |l: npu_backend::Layout| (l.rows(), l.cols());
        need(
            dims(ql) == (n, h * latent_dim)
                && dims(qr) == (n, h * rope_dim)
                && dims(ol) == (n, h * latent_dim),
            OP,
            || {
                format!(
                    "q_latent {:?}, q_rope {:?}, out {:?} (rows, cols) for {n} tokens of {h} \
                     heads of {latent_dim} + {rope_dim}",
                    dims(ql),
                    dims(qr),
                    dims(ol)
                )
            },
        )?;
        if n == 0 {
            return Ok(());
        }
        if lay.n_seqs == 0 {
            return Err(BackendError::BadStep(
                "attention in a step without sequences (its tokens belong to none)".into(),
            ));
        }
        // The one-token work list: item i is token row i (the sequences' rows are consecutive).
        debug_assert_eq!(QUERY_TILES[0], 1);
        let (items_at, n_items) = lay.items[0];
        need(n_items == n, OP, || {
            format!("{n_items} work items for {n} token rows")
        })?;
        let max_smem = (self.gpu.max_dynamic_smem() as usize).max(DEFAULT_SMEM);
        let smem_for = |warps: usize| ATTL_TILE * (row / 2 + 1) * 4 + warps * row * 4;
        let mut warps = h.min(ATTL_WARPS);
        while warps > 1 && smem_for(warps) > max_smem {
            warps /= 2;
        }
        let smem = smem_for(warps);
        if smem > max_smem {
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!(
                    "latent attention needing {smem} bytes of shared memory (the device allows \
                     {max_smem})"
                ),
            });
        }
        let kv = self.kv_pool()?;
        self.launch(
            op_kernel(Op::AttentionLatent, dt),
            LaunchDims {
                grid: [int(OP, n)? as u32, grid_rows(OP, h.div_ceil(warps))?, 1],
                block: [(warps * 32) as u32, 1, 1],
                smem: smem as u32,
            },
            Args::new()
                .ptr(addr(&q_latent))
                .i32(int(OP, ql.stride())?)
                .ptr(addr(&q_rope))
                .i32(int(OP, qr.stride())?)
                .ptr(addr_mut(&out))
                .i32(int(OP, ol.stride())?)
                .ptr(kv.mem.ptr())
                .i64(kv.block_elems as i64)
                .i64(kv.layer_offset(layer) as i64)
                .ptr(meta + 4 * items_at as u64)
                .ptr(meta + 4 * lay.seq_info as u64)
                .ptr(meta + 4 * lay.block_tables as u64)
                .i32(int(OP, lay.max_blocks)?)
                .i32(int(OP, h)?)
                .i32(int(OP, latent_dim)?)
                .i32(int(OP, row)?)
                .i32(int(OP, kv.spec.block_size)?)
                .f32(g.scale),
        )
    }

    pub(crate) fn op_moe_route_scored(
        &mut self,
        logits: View<'_, CudaBuffer>,
        bias: Option<&CudaBuffer>,
        spec: &RouteSpec,
        ids: ViewMut<'_, CudaBuffer>,
        weights: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "moe_route_scored";
        self.own(logits.buf(), OP)?;
        self.own(ids.buf(), OP)?;
        self.own(weights.buf(), OP)?;
        let dt = float(OP, logits.dtype())?;
        need(ids.dtype() == DType::I32, OP, || {
            format!("ids are {}, not i32", ids.dtype().name())
        })?;
        need(weights.dtype() == DType::F32, OP, || {
            format!("weights are {}, not f32", weights.dtype().name())
        })?;
        let (ll, il, wl) = (logits.layout(), ids.layout(), weights.layout());
        let (t, ne, k) = (ll.rows(), ll.cols(), spec.k);
        need(k >= 1 && k <= ne, OP, || format!("{k} experts of {ne}"))?;
        if let Some(b) = bias {
            self.own(b, OP)?;
            need(b.dtype() == DType::F32 && b.len() == ne, OP, || {
                format!(
                    "a bias of {} {} values for {ne} experts (f32 expected)",
                    b.len(),
                    b.dtype().name()
                )
            })?;
        }
        let (groups, used) = spec.groups.unwrap_or((0, 0));
        if spec.groups.is_some() {
            need(
                groups >= 2 && ne.is_multiple_of(groups) && used > 0 && used < groups,
                OP,
                || format!("{used} of {groups} groups over {ne} experts"),
            )?;
            need(k <= used * (ne / groups), OP, || {
                format!("{k} experts from {used} groups of {}", ne / groups)
            })?;
        }
        need(
            (il.rows(), il.cols(), wl.rows(), wl.cols()) == (t, k, t, k),
            OP,
            || {
                format!(
                    "ids {}x{} and weights {}x{} for {t} rows of {k}",
                    il.rows(),
                    il.cols(),
                    wl.rows(),
                    wl.cols()
                )
            },
        )?;
        let smem = (2 * ne + 2 * groups) * 4;
        if smem > DEFAULT_SMEM {
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!("scored routing over {ne} experts"),
            });
        }
        if t == 0 {
            return Ok(());
        }
        self.launch(
            op_kernel(Op::MoeRouteScored, dt),
            LaunchDims {
                grid: [grid_rows(OP, t)?, 1, 1],
                block: [32, 1, 1],
                smem: smem as u32,
            },
            Args::new()
                .ptr(addr(&logits))
                .i32(int(OP, ll.stride())?)
                .i32(int(OP, ne)?)
                .i32(int(OP, k)?)
                .ptr(bias.map_or(0, |b| b.addr(0)))
                .i32(i32::from(spec.gating == Gating::Sigmoid))
                .i32(i32::from(spec.normalize))
                .f32(spec.scale)
                .i32(int(OP, groups)?)
                .i32(int(OP, used)?)
                .ptr(addr_mut(&ids))
                .i32(int(OP, il.stride())?)
                .ptr(addr_mut(&weights))
                .i32(int(OP, wl.stride())?),
        )
    }
}

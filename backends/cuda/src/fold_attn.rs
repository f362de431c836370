//! Decode attention with the output projection and the residual add in one launch
//! (`attention_matmul_add`, kernels/attention_out.cu; `CudaConfig::fold_attn_out`,
//! `NPU_SERVING_CUDA_FUSE=4`): each block of the attention grid (work item, KV head, split)
//! quantizes its heads' outputs to 8 bits as `quantize_q8` would and multiplies them by their
//! columns of the quantized output matrix, for every output row, into a scratch of partial sums
//! (split attention: the split finishing last merges the splits first, with
//! `attention_combine`'s arithmetic); the grid's last block (a device counter, `atomicInc`)
//! adds the partial sums in a fixed order, writes the product and adds it into the residual.
//! The attention output and its 8-bit form are the separate kernels' bits; the product's terms
//! are added in another order than the GEMV's, so the result is deterministic (the same bits
//! every run, a graph replay the eager step's) but not bit for bit `attention` then
//! `matmul_add`.
//!
//! Used for decode-only steps (every sequence one new token) of at most 8 rows on the quantized
//! GEMV path (`folds_norms`) with an f16 KV pool, a Q4_0, Q4_1 or Q8_0 output matrix, and a KV
//! head's group of query heads a multiple of 32 values (whole blocks of the 8-bit form);
//! anything else (an int8 pool, prefill chunks, f16 weights, ...) runs `attention` and
//! `matmul_add` as before. The scratch and the counters stay at fixed addresses while they are
//! large enough (a graph names them), and every launch leaves the counters at 0 (`atomicInc`
//! wraps), so a replay finds them as the capture did.

use npu_backend::{AttnGeometry, BackendError, DeviceBuffer, KvDtype, View, ViewMut};

use crate::backend::CudaBackend;
use crate::buffer::{CudaBuffer, DeviceMem, Scratch};
use crate::gpu::{Args, DevPtr, LaunchDims};
use crate::kernels::attention_out_kernel;
use crate::ops::{addr, addr_mut, float, grid_rows, int, need, same};
use crate::weights::{CudaMatrix, MatrixKind};

/// Positions of a tile of the cache (ATT_TILE in attention.cu).
const ATT_TILE: usize = 32;
/// Largest head and group the attention kernel takes (ATT_MAX_HD, ATT_MAX_THREADS / 32).
const ATT_MAX_HD: usize = 256;
const ATT_MAX_GROUP: usize = 16;
/// Fewest context tiles a split covers (as `op_attention` splits).
const ATT_MIN_TILES_PER_SPLIT: usize = 4;
/// Fewest warps a block has: the projection's threads (the warps past the group's only help
/// there).
const MIN_WARPS: usize = 8;

/// The fused launch's own device memory: the partial products and 8-bit heads, and the counters.
#[derive(Default)]
pub(crate) struct AttnOutScratch {
    work: Scratch,
    counters: Option<DeviceMem>,
}

/// What one fused launch reads beyond its views.
struct Plan {
    kernel: usize,
    n_items: usize,
    items_at: usize,
    group: usize,
    window: i32,
    n_splits: usize,
    tiles_per_split: usize,
    smem: usize,
}

impl CudaBackend {
    /// Turns the attention + output projection fold (`CudaConfig::fold_attn_out`) on or off; it
    /// takes effect with `fuse` and `fold_gemv` on.
    pub fn set_fold_attn_out(&mut self, on: bool) {
        self.cfg.fold_attn_out = on;
    }

    /// `attention` of `q` into `attn`, then `matmul_add` of `attn` by `w` into `out` and
    /// `residual`: one launch where it folds (module note), else the two ops.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_attention_matmul_add(
        &mut self,
        q: View<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
        mut attn: ViewMut<'_, CudaBuffer>,
        w: &CudaMatrix,
        out: ViewMut<'_, CudaBuffer>,
        residual: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        if let Some(plan) = self.attn_out_plan(&q, g, layer, &attn, w, &out, &residual)? {
            return self.attn_out_launch(plan, q, g, layer, attn, w, out, residual);
        }
        let cols = attn.layout().cols();
        self.op_attention(q, g, layer, attn.col_range(0, cols)?)?;
        self.op_matmul_add(attn.as_view(), w, out, residual)
    }

    /// The fused launch's settings, or `None` where the ops run apart (module note).
    #[allow(clippy::too_many_arguments)]
    fn attn_out_plan(
        &mut self,
        q: &View<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
        attn: &ViewMut<'_, CudaBuffer>,
        w: &CudaMatrix,
        out: &ViewMut<'_, CudaBuffer>,
        residual: &ViewMut<'_, CudaBuffer>,
    ) -> Result<Option<Plan>, BackendError> {
        const OP: &str = "attention_matmul_add";
        let rows = q.layout().rows();
        let MatrixKind::Packed(fmt) = w.kind else {
            return Ok(None);
        };
        let (dt, hd) = (q.dtype(), g.head_dim);
        let Some(kernel) = attention_out_kernel(fmt, float(OP, dt)?) else {
            return Ok(None);
        };
        let Ok((lay, _)) = self.step_meta() else {
            return Ok(None); // the ops apart name what is missing
        };
        let Some(kv) = self.kv.as_ref() else {
            return Ok(None);
        };
        let geometry_fits = g.n_heads > 0
            && g.n_kv_heads > 0
            && g.n_heads.is_multiple_of(g.n_kv_heads)
            && g.n_heads / g.n_kv_heads <= ATT_MAX_GROUP
            && hd.is_multiple_of(2)
            && (g.n_heads / g.n_kv_heads * hd).is_multiple_of(32)
            && hd <= ATT_MAX_HD
            && g.window != Some(0);
        let decode_only = lay.n_seqs > 0
            && lay.n_tokens == lay.n_seqs
            && self.step.seqs.iter().all(|s| s.n_q == 1);
        let width = g.q_width();
        let (ql, al, ol, rl) = (q.layout(), attn.layout(), out.layout(), residual.layout());
        let shapes = ql.cols() >= width
            && al.rows() == rows
            && al.cols() == width
            && w.k == width
            && ol.rows() == rows
            && rl.rows() == rows
            && ol.cols() == w.n
            && rl.cols() == w.n;
        let bufs = [q.buf(), attn.buf(), out.buf(), residual.buf()];
        let apart = (1..4).all(|i| (0..i).all(|j| bufs[i].addr(0) != bufs[j].addr(0)));
        let same_dt = bufs.iter().all(|b| b.dtype() == dt);
        if !(self.cfg.fold_attn_out
            && self.folds_norms(rows)
            && w.mem.device() == self.device
            && !kv.latent
            && kv.dtype == KvDtype::F16
            && kv.spec.n_kv_heads == g.n_kv_heads
            && kv.spec.head_dim == hd
            && layer < kv.spec.n_layers
            && geometry_fits
            && decode_only
            && lay.n_tokens == rows
            && shapes
            && apart
            && same_dt)
        {
            return Ok(None);
        }
        for b in bufs {
            self.own(b, OP)?;
        }
        let group = g.n_heads / g.n_kv_heads;
        let warps = group.max(MIN_WARPS);
        let smem = 2 * ATT_TILE * (hd / 2 + 1) * 4 + warps * hd * 4;
        if smem > self.gpu.max_dynamic_smem() as usize {
            return Ok(None);
        }
        let window = g.window.map_or(0, |w| w.min(i32::MAX as u32) as i32);
        // `op_attention`'s split for a decode-only step (one token a work item).
        let (items_at, n_items) = lay.items[0];
        let mut max_tiles = lay.max_ctx.div_ceil(ATT_TILE).max(1);
        if window > 0 {
            max_tiles = max_tiles.min((window as usize).div_ceil(ATT_TILE) + 1);
        }
        let base_blocks = n_items * g.n_kv_heads;
        let target = 2 * self.gpu.sm_count().max(1) as usize;
        let mut n_splits = if base_blocks >= target {
            1
        } else {
            target
                .div_ceil(base_blocks.max(1))
                .min(max_tiles / ATT_MIN_TILES_PER_SPLIT)
                .max(1)
        };
        let tiles_per_split = max_tiles.div_ceil(n_splits);
        n_splits = max_tiles.div_ceil(tiles_per_split);
        Ok(Some(Plan {
            kernel,
            n_items,
            items_at,
            group,
            window,
            n_splits,
            tiles_per_split,
            smem,
        }))
    }

    /// The counters (zeroed when made; every launch leaves them at 0) for `groups` (work item,
    /// KV head) pairs.
    fn attn_out_counters(&mut self, groups: usize) -> Result<DevPtr, BackendError> {
        let bytes = 4 * (1 + groups);
        let big_enough = matches!(&self.attn_out.counters, Some(m) if m.bytes() >= bytes);
        if !big_enough {
            let bytes = bytes.next_power_of_two().max(1024);
            self.attn_out.counters = None;
            let mem = DeviceMem::alloc(&self.gpu, self.device, bytes)?;
            self.gpu.htod(mem.ptr(), &vec![0u8; bytes])?;
            self.device_wrote();
            self.attn_out.counters = Some(mem);
        }
        Ok(self.attn_out.counters.as_ref().map_or(0, |m| m.ptr()))
    }

    #[allow(clippy::too_many_arguments)]
    fn attn_out_launch(
        &mut self,
        p: Plan,
        q: View<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
        attn: ViewMut<'_, CudaBuffer>,
        w: &CudaMatrix,
        out: ViewMut<'_, CudaBuffer>,
        residual: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "attention_matmul_add";
        let (lay, meta) = self.step_meta()?;
        let rows = lay.n_tokens;
        let (hd, n_kv, k) = (g.head_dim, g.n_kv_heads, w.k);
        same(OP, q.dtype(), out.dtype())?;
        need(p.group * n_kv == g.n_heads, OP, || "the head groups".into())?;
        let part = if p.n_splits > 1 {
            let bytes = rows * g.n_heads * p.n_splits * (hd + 2) * 4;
            self.scratch_attn.ensure(&self.gpu, self.device, bytes)?
        } else {
            0
        };
        // The work area: partial products (f32), then the 8-bit heads and their scales.
        let proj_bytes = rows * n_kv * w.n * 4;
        let q8 = rows * k + rows * (k / 32) * 16;
        let work = self
            .attn_out
            .work
            .ensure(&self.gpu, self.device, proj_bytes + q8)?;
        let xq = work + proj_bytes as u64;
        let xs = xq + (rows * k) as u64;
        let counters = self.attn_out_counters(p.n_items * n_kv)?;
        let kv = self.kv_pool()?;
        let (ql, al, ol, rl) = (q.layout(), attn.layout(), out.layout(), residual.layout());
        let wp = w.mem.ptr();
        let warps = p.group.max(MIN_WARPS);
        self.launch(
            p.kernel,
            LaunchDims {
                grid: [
                    int(OP, p.n_items)? as u32,
                    grid_rows(OP, n_kv)?,
                    grid_rows(OP, p.n_splits)?,
                ],
                block: [(warps * 32) as u32, 1, 1],
                smem: p.smem as u32,
            },
            Args::new()
                .ptr(addr(&q))
                .i32(int(OP, ql.stride())?)
                .ptr(addr_mut(&attn))
                .i32(int(OP, al.stride())?)
                .ptr(kv.mem.ptr())
                .i64(kv.block_elems as i64)
                .i64(kv.layer_offset(layer) as i64)
                .ptr(meta + 4 * p.items_at as u64)
                .ptr(meta + 4 * lay.seq_info as u64)
                .ptr(meta + 4 * lay.block_tables as u64)
                .i32(int(OP, lay.max_blocks)?)
                .i32(int(OP, g.n_heads)?)
                .i32(int(OP, n_kv)?)
                .i32(int(OP, hd)?)
                .i32(int(OP, kv.spec.block_size)?)
                .f32(g.scale)
                .i32(p.window)
                .i32(p.n_splits as i32)
                .i32(int(OP, p.tiles_per_split)?)
                .ptr(part)
                .ptr(xq)
                .ptr(xs)
                .ptr(wp)
                .ptr(wp + w.scales_at as u64)
                .ptr(wp + w.mins_at as u64)
                .i32(int(OP, w.n)?)
                .ptr(work)
                .ptr(counters)
                .i32(int(OP, rows)?)
                .ptr(addr_mut(&out))
                .i32(int(OP, ol.stride())?)
                .ptr(addr_mut(&residual))
                .i32(int(OP, rl.stride())?),
        )?;
        // The 8-bit heads are this launch's own; nothing after it reads them.
        self.q8_ready = None;
        Ok(())
    }
}

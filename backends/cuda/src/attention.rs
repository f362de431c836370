//! Paged attention and the KV writes on the CUDA backend: the launch code of `kv_write` and
//! `attention` over an f16 pool (kernels/attention.cu) or an int8 one (kernels/attention_i8.cu,
//! the pool's layout in `kv.rs`), with the checks each makes of its views against the step and
//! the pool. The fused rope + KV write is in `fused.rs`.

use npu_backend::{AttnGeometry, BackendError, KvDtype, View, ViewMut};

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;
use crate::gpu::{Args, LaunchDims};
use crate::kernels::{op_kernel, Op};
use crate::ops::{addr, addr_mut, bad, float, grid_rows, int, need, row_threads, same};
use crate::step::QUERY_TILES;

/// Query rows (warps) an attention block aims for.
const ATT_TARGET_WARPS: usize = 8;
/// Positions of a tile of the cache (ATT_TILE in attention.cu).
const ATT_TILE: usize = 32;
/// Largest head the attention kernels read (ATT_MAX_HD in attention.cu).
pub(crate) const ATT_MAX_HD: usize = 256;
/// Most query heads per KV head (a block's warps; ATT_MAX_THREADS in attention.cu).
const ATT_MAX_GROUP: usize = 16;
/// Fewest context tiles a split of attention should cover.
const ATT_MIN_TILES_PER_SPLIT: usize = 4;

impl CudaBackend {
    /// Checks the geometry against the pool and the layer index.
    pub(crate) fn check_kv_geometry(
        &self,
        op: &'static str,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        let pool = self.kv_pool()?;
        need(!pool.latent, op, || {
            "a latent KV pool (latent attention's ops read it)".into()
        })?;
        let s = pool.spec;
        need(
            g.n_kv_heads == s.n_kv_heads && g.head_dim == s.head_dim && layer < s.n_layers,
            op,
            || {
                format!(
                    "layer {layer} with {} KV heads of {} for a pool of {} layers, {} KV heads of {}",
                    g.n_kv_heads, g.head_dim, s.n_layers, s.n_kv_heads, s.head_dim
                )
            },
        )
    }

    pub(crate) fn op_kv_write(
        &mut self,
        k: View<'_, CudaBuffer>,
        v: View<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        const OP: &str = "kv_write";
        self.own(k.buf(), OP)?;
        self.own(v.buf(), OP)?;
        let (lay, meta) = self.step_meta()?;
        self.check_kv_geometry(OP, g, layer)?;
        let dt = float(OP, k.dtype())?;
        same(OP, dt, v.dtype())?;
        let width = g.kv_width();
        let (kl, vl) = (k.layout(), v.layout());
        for (name, l) in [("K", kl), ("V", vl)] {
            need(l.rows() == lay.n_tokens && l.cols() == width, OP, || {
                format!(
                    "{name} window {}x{} for {} tokens of {width}",
                    l.rows(),
                    l.cols(),
                    lay.n_tokens
                )
            })?;
        }
        if lay.n_tokens == 0 {
            return Ok(());
        }
        let kv = self.kv_pool()?;
        if kv.dtype == KvDtype::Int8 {
            let at = kv.i8_layer(layer);
            return self.launch(
                op_kernel(Op::KvWriteI8, dt),
                LaunchDims::linear(
                    [
                        int(OP, lay.n_tokens)? as u32,
                        grid_rows(OP, 2 * g.n_kv_heads)?,
                        1,
                    ],
                    32,
                ),
                Args::new()
                    .ptr(addr(&k))
                    .i32(int(OP, kl.stride())?)
                    .ptr(addr(&v))
                    .i32(int(OP, vl.stride())?)
                    .ptr(meta + 4 * lay.slots as u64)
                    .ptr(kv.mem.ptr())
                    .i64(kv.block_bytes() as i64)
                    .i64(at.values as i64)
                    .i64(at.scales as i64)
                    .i32(int(OP, g.n_kv_heads)?)
                    .i32(int(OP, g.head_dim)?)
                    .i32(int(OP, kv.spec.block_size)?),
            );
        }
        self.launch(
            op_kernel(Op::KvWrite, dt),
            LaunchDims::linear(
                [int(OP, lay.n_tokens)? as u32, 1, 1],
                row_threads(width, 256),
            ),
            Args::new()
                .ptr(addr(&k))
                .i32(int(OP, kl.stride())?)
                .ptr(addr(&v))
                .i32(int(OP, vl.stride())?)
                .ptr(meta + 4 * lay.slots as u64)
                .ptr(kv.mem.ptr())
                .i64(kv.block_elems as i64)
                .i64(kv.layer_offset(layer) as i64)
                .i32(int(OP, g.n_kv_heads)?)
                .i32(int(OP, g.head_dim)?)
                .i32(int(OP, kv.spec.block_size)?),
        )
    }

    pub(crate) fn op_attention(
        &mut self,
        q: View<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "attention";
        self.own(q.buf(), OP)?;
        self.own(out.buf(), OP)?;
        let (lay, meta) = self.step_meta()?;
        self.check_kv_geometry(OP, g, layer)?;
        let dt = float(OP, q.dtype())?;
        same(OP, dt, out.dtype())?;
        let hd = g.head_dim;
        need(
            g.n_heads > 0
                && g.n_kv_heads > 0
                && g.n_heads.is_multiple_of(g.n_kv_heads)
                && g.n_heads / g.n_kv_heads <= ATT_MAX_GROUP,
            OP,
            || {
                format!(
                    "{} query heads over {} KV heads (groups of at most {ATT_MAX_GROUP})",
                    g.n_heads, g.n_kv_heads
                )
            },
        )?;
        if !hd.is_multiple_of(2) || hd > ATT_MAX_HD {
            return Err(BackendError::Unsupported {
                backend: "cuda",
                what: format!("attention heads of {hd} values (even, at most {ATT_MAX_HD})"),
            });
        }
        let window = match g.window {
            None => 0,
            Some(0) => {
                return Err(bad(
                    OP,
                    "a sliding window of 0 positions (a query would see nothing)".into(),
                ))
            }
            Some(w) => w.min(i32::MAX as u32) as i32,
        };
        let (ql, ol) = (q.layout(), out.layout());
        let width = g.q_width();
        need(
            ql.rows() == lay.n_tokens
                && ol.rows() == lay.n_tokens
                && ql.cols() >= width
                && ol.cols() == width,
            OP,
            || {
                format!(
                    "q {}x{} and out {}x{} for {} tokens of {width}",
                    ql.rows(),
                    ql.cols(),
                    ol.rows(),
                    ol.cols(),
                    lay.n_tokens
                )
            },
        )?;
        if lay.n_tokens == 0 {
            return Ok(());
        }
        if lay.n_seqs == 0 {
            return Err(BackendError::BadStep(
                "attention in a step without sequences (its tokens belong to none)".into(),
            ));
        }
        let group = g.n_heads / g.n_kv_heads;
        // Tokens per block: as many as fill the target warps, but no more than the longest
        // sequence of the step has (a decode-only step gets one token per block).
        let max_nq = self
            .step
            .seqs
            .iter()
            .map(|s| s.n_q as usize)
            .max()
            .unwrap_or(1);
        let tile_idx = QUERY_TILES
            .iter()
            .rposition(|&qt| qt * group <= ATT_TARGET_WARPS && qt <= max_nq.next_power_of_two())
            .unwrap_or(0);
        let qt = QUERY_TILES[tile_idx];
        let warps = qt * group;
        let (items_at, n_items) = lay.items[tile_idx];
        let int8 = self.kv_pool()?.dtype == KvDtype::Int8;
        let smem = if int8 {
            // The tile's scales, the warps' queries, the tile's int8 K and V values.
            (2 * ATT_TILE + warps * hd) * 4 + 2 * ATT_TILE * hd
        } else {
            2 * ATT_TILE * (hd / 2 + 1) * 4 + warps * hd * 4
        };
        if smem > self.gpu.max_dynamic_smem() as usize {
            return Err(BackendError::Unsupported {
                backend: "cuda",
                what: format!(
                    "attention needing {smem} bytes of shared memory (the device allows {})",
                    self.gpu.max_dynamic_smem()
                ),
            });
        }
        // Split the context when the blocks would not fill the device (flash-decoding). Through a
        // window a block sees at most window + qt - 1 positions, from anywhere in its first tile.
        let mut max_tiles = lay.max_ctx.div_ceil(ATT_TILE).max(1);
        if window > 0 {
            max_tiles = max_tiles.min((window as usize + qt - 1).div_ceil(ATT_TILE) + 1);
        }
        let base_blocks = n_items * g.n_kv_heads;
        let target = 2 * self.gpu.sm_count().max(1) as usize;
        let mut n_splits = if base_blocks >= target {
            1
        } else {
            target
                .div_ceil(base_blocks)
                .min(max_tiles / ATT_MIN_TILES_PER_SPLIT)
                .max(1)
        };
        let tiles_per_split = max_tiles.div_ceil(n_splits);
        n_splits = max_tiles.div_ceil(tiles_per_split);
        let partial = if n_splits > 1 {
            let bytes = lay.n_tokens * g.n_heads * n_splits * (hd + 2) * 4;
            self.scratch_attn.ensure(&self.gpu, self.device, bytes)?
        } else {
            0
        };
        // The output projection's 8-bit activations, written by whichever kernel writes the
        // normalised output (`fused`).
        let q8 = if hd.is_multiple_of(32) {
            self.q8_target(ol.rows(), ol.cols())?
        } else {
            None
        };
        let (xq, xs) = q8.unwrap_or((0, 0));
        let (aq, as_) = if n_splits == 1 { (xq, xs) } else { (0, 0) };
        let kv = self.kv_pool()?;
        let out_ptr = addr_mut(&out);
        // The pool: an f16 pool's block stride and layer offset in elements; an int8 pool's in
        // bytes, with its layer's scales.
        let (kernel, stride, layer_off, scales) = if int8 {
            let at = kv.i8_layer(layer);
            (
                Op::AttentionI8,
                kv.block_bytes(),
                at.values,
                Some(at.scales),
            )
        } else {
            (Op::Attention, kv.block_elems, kv.layer_offset(layer), None)
        };
        let mut args = Args::new()
            .ptr(addr(&q))
            .i32(int(OP, ql.stride())?)
            .ptr(out_ptr)
            .i32(int(OP, ol.stride())?)
            .ptr(kv.mem.ptr())
            .i64(stride as i64)
            .i64(layer_off as i64);
        if let Some(s) = scales {
            args = args.i64(s as i64);
        }
        self.launch(
            op_kernel(kernel, dt),
            LaunchDims {
                grid: [
                    int(OP, n_items)? as u32,
                    grid_rows(OP, g.n_kv_heads)?,
                    grid_rows(OP, n_splits)?,
                ],
                block: [(warps * 32) as u32, 1, 1],
                smem: smem as u32,
            },
            args.ptr(meta + 4 * items_at as u64)
                .i32(qt as i32)
                .ptr(meta + 4 * lay.seq_info as u64)
                .ptr(meta + 4 * lay.block_tables as u64)
                .i32(int(OP, lay.max_blocks)?)
                .i32(int(OP, g.n_heads)?)
                .i32(int(OP, g.n_kv_heads)?)
                .i32(int(OP, hd)?)
                .i32(int(OP, kv.spec.block_size)?)
                .f32(g.scale)
                .i32(window)
                .i32(n_splits as i32)
                .i32(int(OP, tiles_per_split)?)
                .ptr(partial)
                .ptr(aq)
                .ptr(as_),
        )?;
        if n_splits > 1 {
            self.launch(
                op_kernel(Op::AttentionCombine, dt),
                LaunchDims::linear(
                    [int(OP, lay.n_tokens)? as u32, grid_rows(OP, g.n_heads)?, 1],
                    row_threads(hd, 256),
                ),
                Args::new()
                    .ptr(partial)
                    .i32(n_splits as i32)
                    .i32(int(OP, g.n_heads)?)
                    .i32(int(OP, hd)?)
                    .ptr(out_ptr)
                    .i32(int(OP, ol.stride())?)
                    .ptr(xq)
                    .ptr(xs),
            )?;
        }
        self.q8_made(q8, out_ptr, ol, dt);
        Ok(())
    }
}

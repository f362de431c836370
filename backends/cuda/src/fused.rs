//! The row ops whose kernels can take a neighbour's work, so that a decode layer launches fewer
//! kernels with the same bits: RMS norm, SwiGLU, and the residual add folded into the next RMS
//! norm (`add_rms_norm`, one pass over the row), and rope with the KV write (`rope_kv_write`;
//! into an int8 pool, `rope_kv_write_i8`, one warp per head, quantizing each key and value row),
//! with Qwen3's per-head Q and K norms first where the model has them (`norm_rope_kv_write`, one
//! block per head; an int8 pool launches the norms apart).
//!
//! **The activation quantizer folded into its producer.** A quantized matrix product multiplies
//! 8-bit activations (`quantize_q8`, matmul.cu). When the kernel producing its input is one of
//! `rms_norm`, `add_rms_norm`, `swiglu` or attention (`attention`, or `attention_combine` after
//! a split one; in ops.rs), that kernel writes the 8-bit form too (the same
//! `q8_store_block` as `quantize_q8`, on the values as stored), into the GEMV's activation
//! scratch, and the backend records what it wrote (`Q8Ready`). The next GEMV uses it instead of
//! launching `quantize_q8` only when nothing ran in between: the record names the producer's
//! output window (address, stride, rows, columns, dtype) and the counts of launches and of other
//! device writes at the time, and it is taken by the first matmul that looks at it. So a write
//! between the producer and the product (another kernel, an upload, a collective) leaves the
//! GEMV quantizing for itself, as before. The split projections of one input (a GEMV after a
//! GEMV of the same rows) reuse the same 8-bit rows likewise.
//!
//! The 8-bit form is written only where the next product would read it: the backend holds a
//! quantized matrix, the row length is a multiple of 32, and a step of this many rows takes the
//! quantized path (`matmul` mode and `gemv_max_rows`). `CudaConfig::fuse` off (NPU_SERVING_CUDA_FUSE=0)
//! launches every op on its own.

use std::sync::atomic::Ordering;

use npu_backend::{AttnGeometry, BackendError, DType, DeviceBuffer, Layout, View, ViewMut};
use npu_model::RopeStyle;

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;
use crate::config::MatmulMode;
use crate::gpu::{blocks, Args, DevPtr, LaunchDims};
use crate::kernels::{op_kernel, Op};
use crate::ops::{
    addr, addr_mut, dt_code, float, grid_rows, int, need, row_threads, same, EW_THREADS,
};

/// What `rope_kv_args` checked and computed: the step's metadata, the byte offsets of its
/// positions and slot mapping in it, the frequency factor table (0: none) and base^(-2/dims).
pub(crate) struct RopeKvArgs {
    pub(crate) meta: DevPtr,
    pub(crate) positions: u64,
    pub(crate) slots: u64,
    pub(crate) factors: DevPtr,
    pub(crate) theta_scale: f32,
}

/// 8-bit activations a producer kernel wrote for the next quantized product (module note).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Q8Ready {
    /// The producer's output window: its first element, row stride, rows, columns, dtype.
    x: DevPtr,
    stride: usize,
    rows: usize,
    cols: usize,
    dt: DType,
    /// The int8 rows and the per-block scales (layout of `quantize_q8`).
    xq: DevPtr,
    xs: DevPtr,
    /// Quantized 256 values a scale (`quantize_q8k`, for packed K-quants) rather than 32.
    per256: bool,
    /// `launches` and `device_writes` just after the producer was queued.
    launches: u64,
    writes: u64,
}

/// Bytes of the 8-bit form of `rows` rows of `cols` values (int8 rows, then 16 bytes of scales
/// per block of 32).
pub(crate) fn q8_bytes(rows: usize, cols: usize) -> usize {
    rows * cols + rows * (cols / 32) * 16
}

impl CudaBackend {
    /// Counts a device write that is not a kernel launch (an upload, a device copy, a
    /// collective): 8-bit activations recorded before it are not used after it.
    pub(crate) fn device_wrote(&self) {
        self.device_writes.fetch_add(1, Ordering::Relaxed);
    }

    /// Where a producer of `rows` x `cols` activations of `dt` writes their 8-bit form, when the
    /// next quantized product of them would read it (module note); `None`: it does not.
    pub(crate) fn q8_target(
        &mut self,
        rows: usize,
        cols: usize,
    ) -> Result<Option<(DevPtr, DevPtr)>, BackendError> {
        let quantized_path = match self.cfg.matmul {
            MatmulMode::Quantized => true,
            MatmulMode::Auto => rows <= self.cfg.gemv_max_rows,
            MatmulMode::Dequantized => false,
        };
        if !self.cfg.fuse
            || !self.quantized_matrices
            || !quantized_path
            || rows == 0
            || !cols.is_multiple_of(32)
        {
            return Ok(None);
        }
        let xq = self
            .scratch_x
            .ensure(&self.gpu, self.device, q8_bytes(rows, cols))?;
        Ok(Some((xq, xq + (rows * cols) as u64)))
    }

    /// Records that the launch just queued wrote the 8-bit form of `out` at `target`.
    pub(crate) fn q8_made(
        &mut self,
        target: Option<(DevPtr, DevPtr)>,
        out: DevPtr,
        l: Layout,
        dt: DType,
    ) {
        self.q8_ready = target.map(|(xq, xs)| Q8Ready {
            x: out,
            stride: l.stride(),
            rows: l.rows(),
            cols: l.cols(),
            dt,
            xq,
            xs,
            per256: false,
            launches: self.launches.load(Ordering::Relaxed),
            writes: self.device_writes.load(Ordering::Relaxed),
        });
    }

    /// The 8-bit form of `x` (a product's input of `dt`), 32 values a scale (`per256`: 256,
    /// Q8_K), when the last thing queued wrote it; the record is used up either way.
    pub(crate) fn q8_take(
        &mut self,
        x: &View<'_, CudaBuffer>,
        dt: DType,
        per256: bool,
    ) -> Option<(DevPtr, DevPtr)> {
        let r = self.q8_ready.take()?;
        if r.per256 != per256 {
            return None;
        }
        let l = x.layout();
        let fresh = r.launches == self.launches.load(Ordering::Relaxed)
            && r.writes == self.device_writes.load(Ordering::Relaxed);
        let same_rows = r.x == addr(x)
            && r.stride == l.stride()
            && r.rows == l.rows()
            && r.cols == l.cols()
            && r.dt == dt;
        (fresh && same_rows).then_some((r.xq, r.xs))
    }

    /// After a quantized product of `x` whose 8-bit rows are at `(xq, xs)` and whose output is
    /// not in `x`'s buffer: the next product of the same `x` may use them too.
    pub(crate) fn q8_keep(
        &mut self,
        x: &View<'_, CudaBuffer>,
        out: &ViewMut<'_, CudaBuffer>,
        q8: (DevPtr, DevPtr),
        dt: DType,
    ) {
        self.q8_keep_as(x, out, q8, dt, false);
    }

    /// `q8_keep` for 8-bit rows of 256 values a scale (`per256`) or 32.
    pub(crate) fn q8_keep_as(
        &mut self,
        x: &View<'_, CudaBuffer>,
        out: &ViewMut<'_, CudaBuffer>,
        q8: (DevPtr, DevPtr),
        dt: DType,
        per256: bool,
    ) {
        if !self.cfg.fuse || x.buf().addr(0) == out.buf().addr(0) {
            return;
        }
        self.q8_made(Some(q8), addr(x), x.layout(), dt);
        if let Some(r) = self.q8_ready.as_mut() {
            r.per256 = per256;
        }
    }

    pub(crate) fn op_rms_norm(
        &mut self,
        x: View<'_, CudaBuffer>,
        w: &CudaBuffer,
        eps: f32,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "rms_norm";
        self.own(x.buf(), OP)?;
        self.own(w, OP)?;
        self.own(out.buf(), OP)?;
        let dt = float(OP, x.dtype())?;
        same(OP, dt, out.dtype())?;
        let wdt = float(OP, w.dtype())?;
        let (xl, ol) = (x.layout(), out.layout());
        need(
            xl.rows() == ol.rows() && xl.cols() == ol.cols() && w.len() == xl.cols(),
            OP,
            || {
                format!(
                    "x {}x{}, out {}x{}, weight of {}",
                    xl.rows(),
                    xl.cols(),
                    ol.rows(),
                    ol.cols(),
                    w.len()
                )
            },
        )?;
        if xl.rows() == 0 || xl.cols() == 0 {
            return Ok(());
        }
        let q8 = self.q8_target(ol.rows(), ol.cols())?;
        let (xq, xs) = q8.unwrap_or((0, 0));
        self.launch(
            op_kernel(Op::RmsNorm, dt),
            LaunchDims::linear(
                [int(OP, xl.rows())? as u32, 1, 1],
                row_threads(xl.cols(), 256),
            ),
            Args::new()
                .ptr(addr(&x))
                .i32(int(OP, xl.stride())?)
                .ptr(w.addr(0))
                .i32(dt_code(wdt))
                .f32(eps)
                .i32(int(OP, xl.cols())?)
                .ptr(addr_mut(&out))
                .i32(int(OP, ol.stride())?)
                .ptr(xq)
                .ptr(xs),
        )?;
        self.q8_made(q8, addr_mut(&out), ol, dt);
        Ok(())
    }

    /// `x += y`, then `out = rms_norm(x) * w`, in one kernel (`add_rms_norm`); two launches
    /// (`add`, `rms_norm`) with `fuse` off.
    pub(crate) fn op_add_rms_norm(
        &mut self,
        mut x: ViewMut<'_, CudaBuffer>,
        y: View<'_, CudaBuffer>,
        w: &CudaBuffer,
        eps: f32,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "add_rms_norm";
        if !self.cfg.fuse {
            let cols = x.layout().cols();
            self.op_add(x.col_range(0, cols)?, y)?;
            return self.op_rms_norm(x.as_view(), w, eps, out);
        }
        self.own(x.buf(), OP)?;
        self.own(y.buf(), OP)?;
        self.own(w, OP)?;
        self.own(out.buf(), OP)?;
        let dt = float(OP, x.dtype())?;
        same(OP, dt, y.dtype())?;
        same(OP, dt, out.dtype())?;
        let wdt = float(OP, w.dtype())?;
        let (xl, yl, ol) = (x.layout(), y.layout(), out.layout());
        let shape = |l: Layout| (l.rows(), l.cols());
        need(
            shape(xl) == shape(yl) && shape(xl) == shape(ol) && w.len() == xl.cols(),
            OP,
            || {
                format!(
                    "x {:?}, y {:?}, out {:?} (rows, cols), weight of {}",
                    shape(xl),
                    shape(yl),
                    shape(ol),
                    w.len()
                )
            },
        )?;
        if xl.rows() == 0 || xl.cols() == 0 {
            return Ok(());
        }
        let q8 = self.q8_target(ol.rows(), ol.cols())?;
        let (xq, xs) = q8.unwrap_or((0, 0));
        self.launch(
            op_kernel(Op::AddRmsNorm, dt),
            LaunchDims::linear(
                [int(OP, xl.rows())? as u32, 1, 1],
                row_threads(xl.cols(), 256),
            ),
            Args::new()
                .ptr(addr_mut(&x))
                .i32(int(OP, xl.stride())?)
                .ptr(addr(&y))
                .i32(int(OP, yl.stride())?)
                .ptr(w.addr(0))
                .i32(dt_code(wdt))
                .f32(eps)
                .i32(int(OP, xl.cols())?)
                .ptr(addr_mut(&out))
                .i32(int(OP, ol.stride())?)
                .ptr(xq)
                .ptr(xs),
        )?;
        self.q8_made(q8, addr_mut(&out), ol, dt);
        Ok(())
    }

    pub(crate) fn op_swiglu(
        &mut self,
        gate: View<'_, CudaBuffer>,
        up: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "swiglu";
        let Some((dt, gl, ul, ol)) = self.check_gated(OP, &gate, &up, &out)? else {
            return Ok(());
        };
        let q8 = self.q8_target(ol.rows(), ol.cols())?;
        let (xq, xs) = q8.unwrap_or((0, 0));
        self.launch(
            op_kernel(Op::Swiglu, dt),
            LaunchDims::linear(
                [blocks(gl.cols(), EW_THREADS), grid_rows(OP, gl.rows())?, 1],
                EW_THREADS as u32,
            ),
            Args::new()
                .ptr(addr(&gate))
                .i32(int(OP, gl.stride())?)
                .ptr(addr(&up))
                .i32(int(OP, ul.stride())?)
                .ptr(addr_mut(&out))
                .i32(int(OP, ol.stride())?)
                .i32(int(OP, gl.cols())?)
                .ptr(xq)
                .ptr(xs),
        )?;
        self.q8_made(q8, addr_mut(&out), ol, dt);
        Ok(())
    }
}

impl CudaBackend {
    /// `rope` on the Q and K heads of `qkv` (rows of n_heads query heads, n_kv key heads, n_kv
    /// value heads), then `kv_write` of its K and V into `layer`'s cache, in one kernel
    /// (`rope_kv_write`); the two launches with `fuse` off.
    pub(crate) fn op_rope_kv_write(
        &mut self,
        mut qkv: ViewMut<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        const OP: &str = "rope_kv_write";
        let (qw, kvw) = (g.q_width(), g.kv_width());
        if !self.cfg.fuse {
            self.op_rope(qkv.col_range(0, qw + kvw)?, g)?;
            let v = qkv.as_view();
            return self.op_kv_write(v.col_range(qw, kvw)?, v.col_range(qw + kvw, kvw)?, g, layer);
        }
        let Some(RopeKvArgs {
            meta,
            positions,
            slots,
            factors,
            theta_scale,
        }) = self.rope_kv_args(OP, &qkv, g, layer)?
        else {
            return Ok(());
        };
        let dt = float(OP, qkv.dtype())?;
        let l = qkv.layout();
        let (hd, dims) = (g.head_dim, g.rope.dims);
        let heads = g.n_heads + g.n_kv_heads;
        let n = heads * (dims / 2) + g.n_kv_heads * (hd - dims) + kvw;
        let kv = self.kv_pool()?;
        if kv.dtype == npu_backend::KvDtype::Int8 {
            // One warp per head of a row (kernels/attention_i8.cu): a key or value head is
            // quantized whole, with one scale.
            let at = kv.i8_layer(layer);
            return self.launch(
                op_kernel(Op::RopeKvWriteI8, dt),
                LaunchDims::linear(
                    [
                        int(OP, l.rows())? as u32,
                        grid_rows(OP, heads + g.n_kv_heads)?,
                        1,
                    ],
                    32,
                ),
                Args::new()
                    .ptr(addr_mut(&qkv))
                    .i32(int(OP, l.stride())?)
                    .i32(int(OP, g.n_heads)?)
                    .i32(int(OP, g.n_kv_heads)?)
                    .i32(int(OP, hd)?)
                    .i32(int(OP, dims)?)
                    .i32(i32::from(g.rope.style == RopeStyle::Halves))
                    .f32(theta_scale)
                    .f32(g.rope.freq_scale)
                    .ptr(meta + positions)
                    .ptr(factors)
                    .ptr(meta + slots)
                    .ptr(kv.mem.ptr())
                    .i64(kv.block_bytes() as i64)
                    .i64(at.values as i64)
                    .i64(at.scales as i64)
                    .i32(int(OP, kv.spec.block_size)?),
            );
        }
        self.launch(
            op_kernel(Op::RopeKvWrite, dt),
            LaunchDims::linear(
                [int(OP, l.rows())? as u32, blocks(n, EW_THREADS), 1],
                row_threads(n, EW_THREADS),
            ),
            Args::new()
                .ptr(addr_mut(&qkv))
                .i32(int(OP, l.stride())?)
                .i32(int(OP, g.n_heads)?)
                .i32(int(OP, g.n_kv_heads)?)
                .i32(int(OP, hd)?)
                .i32(int(OP, dims)?)
                .i32(i32::from(g.rope.style == RopeStyle::Halves))
                .f32(theta_scale)
                .f32(g.rope.freq_scale)
                .ptr(meta + positions)
                .ptr(factors)
                .ptr(meta + slots)
                .ptr(kv.mem.ptr())
                .i64(kv.block_elems as i64)
                .i64(kv.layer_offset(layer) as i64)
                .i32(int(OP, kv.spec.block_size)?),
        )
    }

    /// `rms_norm_heads` of the query heads by `q_norm` and of the key heads by `k_norm`, then
    /// `rope_kv_write`, in one kernel (`norm_rope_kv_write`, one block per head of a row, as
    /// many threads as `rms_norm_heads` gives a head, so the norms have its bits). An int8 KV
    /// pool, or `fuse` off, launches the norms on their own and then `rope_kv_write` (or `rope`
    /// and `kv_write`).
    pub(crate) fn op_norm_rope_kv_write(
        &mut self,
        mut qkv: ViewMut<'_, CudaBuffer>,
        q_norm: &CudaBuffer,
        k_norm: &CudaBuffer,
        eps: f32,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        const OP: &str = "norm_rope_kv_write";
        let (qw, kvw) = (g.q_width(), g.kv_width());
        let int8 = self.kv_pool()?.dtype == npu_backend::KvDtype::Int8;
        if !self.cfg.fuse || int8 {
            self.op_rms_norm_heads(qkv.col_range(0, qw)?, q_norm, eps, g.head_dim)?;
            self.op_rms_norm_heads(qkv.col_range(qw, kvw)?, k_norm, eps, g.head_dim)?;
            return self.op_rope_kv_write(qkv, g, layer);
        }
        self.own(q_norm, OP)?;
        self.own(k_norm, OP)?;
        let hd = g.head_dim;
        need(q_norm.len() == hd && k_norm.len() == hd, OP, || {
            format!(
                "{} query and {} key norm weights for heads of {hd}",
                q_norm.len(),
                k_norm.len()
            )
        })?;
        let (qdt, kdt) = (float(OP, q_norm.dtype())?, float(OP, k_norm.dtype())?);
        let Some(RopeKvArgs {
            meta,
            positions,
            slots,
            factors,
            theta_scale,
        }) = self.rope_kv_args(OP, &qkv, g, layer)?
        else {
            return Ok(());
        };
        let dt = float(OP, qkv.dtype())?;
        let l = qkv.layout();
        let kv = self.kv_pool()?;
        self.launch(
            op_kernel(Op::NormRopeKvWrite, dt),
            LaunchDims::linear(
                [
                    int(OP, l.rows())? as u32,
                    grid_rows(OP, g.n_heads + 2 * g.n_kv_heads)?,
                    1,
                ],
                row_threads(hd, 256),
            ),
            Args::new()
                .ptr(addr_mut(&qkv))
                .i32(int(OP, l.stride())?)
                .i32(int(OP, g.n_heads)?)
                .i32(int(OP, g.n_kv_heads)?)
                .i32(int(OP, hd)?)
                .i32(int(OP, g.rope.dims)?)
                .i32(i32::from(g.rope.style == RopeStyle::Halves))
                .f32(theta_scale)
                .f32(g.rope.freq_scale)
                .ptr(meta + positions)
                .ptr(factors)
                .ptr(q_norm.addr(0))
                .i32(dt_code(qdt))
                .ptr(k_norm.addr(0))
                .i32(dt_code(kdt))
                .f32(eps)
                .ptr(meta + slots)
                .ptr(kv.mem.ptr())
                .i64(kv.block_elems as i64)
                .i64(kv.layer_offset(layer) as i64)
                .i32(int(OP, kv.spec.block_size)?),
        )
    }

    /// The checks `rope_kv_write` and `norm_rope_kv_write` share (a Q, K and V window of the
    /// step's tokens, the rotary geometry, the layer's cache) and their common arguments;
    /// `None`: no tokens.
    pub(crate) fn rope_kv_args(
        &mut self,
        op: &'static str,
        qkv: &ViewMut<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<Option<RopeKvArgs>, BackendError> {
        let (qw, kvw) = (g.q_width(), g.kv_width());
        self.own(qkv.buf(), op)?;
        let (lay, meta) = self.step_meta()?;
        self.check_kv_geometry(op, g, layer)?;
        float(op, qkv.dtype())?;
        let l = qkv.layout();
        let (hd, dims) = (g.head_dim, g.rope.dims);
        need(
            l.rows() == lay.n_tokens && l.cols() == qw + 2 * kvw,
            op,
            || {
                format!(
                    "a {}x{} window for {} tokens of Q, K and V ({qw} + 2 x {kvw})",
                    l.rows(),
                    l.cols(),
                    lay.n_tokens
                )
            },
        )?;
        need(dims <= hd && dims.is_multiple_of(2), op, || {
            format!("{dims} rotary dimensions of a {hd}-value head")
        })?;
        if let Some(f) = g.rope.factors {
            need(f.len() == dims / 2, op, || {
                format!(
                    "{} frequency factors for {} rotary pairs",
                    f.len(),
                    dims / 2
                )
            })?;
        }
        if lay.n_tokens == 0 {
            return Ok(None);
        }
        let factors = match g.rope.factors {
            Some(f) => self.rope_factor_table(f)?,
            None => 0,
        };
        let theta_scale = g.rope.base.powf(-2.0 / dims.max(1) as f32);
        Ok(Some(RopeKvArgs {
            meta,
            positions: 4 * lay.positions as u64,
            slots: 4 * lay.slots as u64,
            factors,
            theta_scale,
        }))
    }
}

//! The quantized GEMVs with their neighbours folded into the same launch (`gemv_fold_*`,
//! kernels/matmul.cu), the bits of the separate kernels unchanged: the RMS norm before a product
//! (`rms_norm_matmul`: every block of the GEMV normalises the input rows itself with the norm
//! kernel's code and block size, quantizes them to 8 bits in shared memory, and block 0 writes
//! the normalised rows), the residual add after one (`matmul_add`: the lane that stores an output
//! adds it into the residual), and SwiGLU after the fused gate/up product
//! (`rms_norm_matmul_swiglu`: the warp computing gate row j computes up row j too, and writes
//! silu(g) * u and, for the down product, its 8-bit form with `q8_store_block`), and rope with
//! the KV write after the Q/K/V product (`rms_norm_matmul_rope_kv_write`: each block owns one
//! head, and after its barrier rotates it and writes it to the f16 cache with the code of
//! `norm_rope_kv_write`, `rope_head_to_cache`).
//!
//! With these a Llama decode layer is 5 launches (6 by default: the rope fold is opt-in,
//! `NPU_SERVING_CUDA_FUSE=3`, as its one block per head may starve a large GPU's SMs;
//! `CudaConfig::fold_rope`): Q/K/V GEMV (with the attention norm, rope and
//! the KV write), attention, output GEMV (with the residual add), gate/up GEMV (with the FFN norm
//! and SwiGLU), down GEMV (with the residual add); Qwen3's too, its query and key head norms
//! in the Q/K/V GEMV's launch before the rope (the block's first `row_threads(head_dim, 256)`
//! threads, as `rms_norm_heads` has, so the same bits). They are used where the model asks
//! (`Backend::folds_norms_into_matmuls`: `CudaConfig::fuse` and `fold_gemv` on, quantized
//! matrices, a step of at most 8 token rows on the GEMV path) and the product is one of a
//! quantized matrix in one GEMV pass; anything else (F16 weights, the cuBLAS or tensor-core
//! paths, more rows, a norm whose 8-bit rows exceed the device's shared memory) runs the same
//! ops one launch each, with the same results.

use npu_backend::{AttnGeometry, BackendError, DType, DeviceBuffer, KvDtype, View, ViewMut};
use npu_model::RopeStyle;

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;
use crate::config::MatmulMode;
use crate::gpu::{Args, DevPtr, LaunchDims};
use crate::kernels::{gemv_fold_kernel, GEMV_ROWS};
use crate::ops::{addr, addr_mut, dt_code, float, int, need, row_threads, same};
use crate::weights::{CudaMatrix, MatrixKind};

/// What the kernel does after the product (`FOLD_*` in matmul.cu).
const FOLD_STORE: i32 = 0;
const FOLD_ADD: i32 = 1;
const FOLD_SWIGLU: i32 = 2;
const FOLD_ROPE: i32 = 3;
/// Output units (outputs, or gate/up pairs) of one block.
const FOLD_UNITS: usize = 32;
/// Threads of a block without the norm prologue.
const FOLD_THREADS: u32 = 256;

/// The norm prologue's arguments: the rows to normalise, the weights, and where block 0 writes
/// the normalised rows.
struct NormIn {
    x: DevPtr,
    ldx: i32,
    w: DevPtr,
    wdt: i32,
    eps: f32,
    xn: DevPtr,
    ldxn: i32,
}

/// The epilogue's arguments beyond `out`.
struct Epilogue {
    fold: i32,
    res: (DevPtr, i32),
    h: (DevPtr, i32),
    hq: (DevPtr, DevPtr),
    rope: Option<RopeOut>,
}

/// FOLD_ROPE's arguments: the heads, the rotary settings and the step's positions, the slot
/// mapping and the layer's place in the f16 KV pool (as `rope_kv_write` takes them).
struct RopeOut {
    heads: (i32, i32, i32),
    dims: i32,
    halves: i32,
    theta_scale: f32,
    freq_scale: f32,
    pos: DevPtr,
    factors: DevPtr,
    slots: DevPtr,
    pool: DevPtr,
    block_stride: i64,
    layer_off: i64,
    bs: i32,
    /// The per-head query and key norms' weights and dtypes (0: none), and the threads
    /// `rms_norm_heads` gives a head.
    norms: (DevPtr, i32, DevPtr, i32),
    head_threads: i32,
}

impl CudaBackend {
    /// Turns folding ops into fewer launches on or off (`CudaConfig::fuse` and `fold_gemv`) for
    /// the ops queued from now on: the same results bit for bit, in more launches when off.
    pub fn set_fuse(&mut self, on: bool) {
        self.cfg.fuse = on;
        self.cfg.fold_gemv = on;
        self.q8_ready = None;
    }

    /// Turns only the folds into the GEMVs (`CudaConfig::fold_gemv`) on or off; they take
    /// effect with `fuse` on.
    pub fn set_fold_gemv(&mut self, on: bool) {
        self.cfg.fold_gemv = on;
    }

    /// Turns the rope and KV write fold into the Q/K/V GEMV (`CudaConfig::fold_rope`) on or
    /// off; it takes effect with `fuse` and `fold_gemv` on.
    pub fn set_fold_rope(&mut self, on: bool) {
        self.cfg.fold_rope = on;
    }

    /// Whether the model should hand over norms and residual adds with their products for a
    /// step of `rows` rows (`Backend::folds_norms_into_matmuls`).
    pub(crate) fn folds_norms(&self, rows: usize) -> bool {
        self.cfg.fuse
            && self.cfg.fold_gemv
            && self.quantized_matrices
            && rows > 0
            && rows <= GEMV_ROWS[1]
            && self.gemv_path(rows)
    }

    fn gemv_path(&self, rows: usize) -> bool {
        match self.cfg.matmul {
            MatmulMode::Quantized => true,
            MatmulMode::Auto => rows <= self.cfg.gemv_max_rows,
            MatmulMode::Dequantized => false,
        }
    }

    /// The folded GEMV for `rows` rows of `dt` by `w`, where it is used (module note).
    fn fold_kernel(&self, w: &CudaMatrix, rows: usize, dt: DType) -> Option<usize> {
        let MatrixKind::Packed(fmt) = w.kind else {
            return None;
        };
        if !(self.cfg.fuse && self.cfg.fold_gemv)
            || rows == 0
            || rows > GEMV_ROWS[1]
            || !self.gemv_path(rows)
            || w.mem.device() != self.device
        {
            return None;
        }
        gemv_fold_kernel(fmt, usize::from(rows > 1), dt)
    }

    /// The shape checks of a product of `x` (rows x w.k) into `out` (rows x `n`), all of `dt`.
    fn fold_check(
        &self,
        op: &'static str,
        x: &View<'_, CudaBuffer>,
        w: &CudaMatrix,
        out: &ViewMut<'_, CudaBuffer>,
    ) -> Result<DType, BackendError> {
        self.own(x.buf(), op)?;
        self.own(out.buf(), op)?;
        let dt = float(op, x.dtype())?;
        same(op, dt, out.dtype())?;
        let (xl, ol) = (x.layout(), out.layout());
        need(
            xl.cols() == w.k && ol.cols() == w.n && xl.rows() == ol.rows(),
            op,
            || {
                format!(
                    "x {}x{} times a {}x{} matrix into {}x{}",
                    xl.rows(),
                    xl.cols(),
                    w.n,
                    w.k,
                    ol.rows(),
                    ol.cols()
                )
            },
        )?;
        Ok(dt)
    }

    /// `rms_norm` of `x` by `nw` into `xn`, then `matmul` of `xn` by `w` into `out`, in one
    /// launch where it folds (module note).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_rms_norm_matmul(
        &mut self,
        x: View<'_, CudaBuffer>,
        nw: &CudaBuffer,
        eps: f32,
        mut xn: ViewMut<'_, CudaBuffer>,
        w: &CudaMatrix,
        mut out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "rms_norm_matmul";
        if let Some((kernel, norm)) = self.norm_fold(OP, &x, nw, eps, &xn, w, &out)? {
            let dims = self.norm_dims(w.n, x.layout().rows(), w.k)?;
            let epi = Epilogue {
                fold: FOLD_STORE,
                res: (0, 0),
                h: (0, 0),
                hq: (0, 0),
                rope: None,
            };
            return self.fold_launch(OP, kernel, dims, w, Some(norm), (0, 0), &out, epi);
        }
        let cols = xn.layout().cols();
        self.op_rms_norm(x, nw, eps, xn.col_range(0, cols)?)?;
        let cols = out.layout().cols();
        self.op_matmul(xn.as_view(), w, out.col_range(0, cols)?)
    }

    /// `rms_norm_matmul` into `qkv`, then `rope_kv_write` of it into `layer`'s cache (with
    /// `head_norms`, `norm_rope_kv_write`: the query and key heads normalised first, by the same
    /// `eps`), in one launch where it folds (an f16 KV pool, the product's outputs exactly the
    /// Q, K and V heads): each block owns one head.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_rms_norm_matmul_rope_kv_write(
        &mut self,
        x: View<'_, CudaBuffer>,
        nw: &CudaBuffer,
        eps: f32,
        xn: ViewMut<'_, CudaBuffer>,
        w: &CudaMatrix,
        mut qkv: ViewMut<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
        head_norms: Option<(&CudaBuffer, &CudaBuffer)>,
    ) -> Result<(), BackendError> {
        const OP: &str = "rms_norm_matmul_rope_kv_write";
        let heads = g.n_heads + 2 * g.n_kv_heads;
        let hd = g.head_dim;
        let f16_pool = self.kv_pool()?.dtype == KvDtype::F16;
        let head_threads = row_threads(hd, 256);
        let mut norms = (0, 0, 0, 0);
        if let Some((qn, kn)) = head_norms {
            self.own(qn, OP)?;
            self.own(kn, OP)?;
            need(qn.len() == hd && kn.len() == hd, OP, || {
                format!(
                    "{} query and {} key norm weights for heads of {hd}",
                    qn.len(),
                    kn.len()
                )
            })?;
            let (qdt, kdt) = (float(OP, qn.dtype())?, float(OP, kn.dtype())?);
            norms = (qn.addr(0), dt_code(qdt), kn.addr(0), dt_code(kdt));
        }
        let threads_fit = head_threads <= row_threads(w.k, 256);
        if self.cfg.fold_rope
            && f16_pool
            && threads_fit
            && w.n == heads * hd
            && qkv.layout().cols() == w.n
        {
            if let Some((kernel, norm)) = self.norm_fold(OP, &x, nw, eps, &xn, w, &qkv)? {
                let Some(a) = self.rope_kv_args(OP, &qkv, g, layer)? else {
                    return Ok(());
                };
                let kv = self.kv_pool()?;
                let rope = RopeOut {
                    heads: (
                        int(OP, g.n_heads)?,
                        int(OP, g.n_kv_heads)?,
                        int(OP, g.head_dim)?,
                    ),
                    dims: int(OP, g.rope.dims)?,
                    halves: i32::from(g.rope.style == RopeStyle::Halves),
                    theta_scale: a.theta_scale,
                    freq_scale: g.rope.freq_scale,
                    pos: a.meta + a.positions,
                    factors: a.factors,
                    slots: a.meta + a.slots,
                    pool: kv.mem.ptr(),
                    block_stride: kv.block_elems as i64,
                    layer_off: kv.layer_offset(layer) as i64,
                    bs: int(OP, kv.spec.block_size)?,
                    norms,
                    head_threads: head_threads as i32,
                };
                let mut dims = self.norm_dims(w.n, x.layout().rows(), w.k)?;
                dims.grid[0] = int(OP, heads)? as u32;
                let epi = Epilogue {
                    fold: FOLD_ROPE,
                    res: (0, 0),
                    h: (0, 0),
                    hq: (0, 0),
                    rope: Some(rope),
                };
                return self.fold_launch(OP, kernel, dims, w, Some(norm), (0, 0), &qkv, epi);
            }
        }
        let cols = qkv.layout().cols();
        self.op_rms_norm_matmul(x, nw, eps, xn, w, qkv.col_range(0, cols)?)?;
        match head_norms {
            Some((qn, kn)) => self.op_norm_rope_kv_write(qkv, qn, kn, eps, g, layer),
            None => self.op_rope_kv_write(qkv, g, layer),
        }
    }

    /// `rms_norm_matmul` into `gate_up`, then `swiglu` of its halves into `h`, in one launch
    /// where it folds, which also writes `h`'s 8-bit form for the down product.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_rms_norm_matmul_swiglu(
        &mut self,
        x: View<'_, CudaBuffer>,
        nw: &CudaBuffer,
        eps: f32,
        xn: ViewMut<'_, CudaBuffer>,
        w: &CudaMatrix,
        mut gate_up: ViewMut<'_, CudaBuffer>,
        h: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "rms_norm_matmul_swiglu";
        let (gl, hl) = (gate_up.layout(), h.layout());
        need(
            gl.cols().is_multiple_of(2) && hl.cols() * 2 == gl.cols() && hl.rows() == gl.rows(),
            OP,
            || {
                format!(
                    "gate/up rows {}x{} into {}x{} (half as many columns)",
                    gl.rows(),
                    gl.cols(),
                    hl.rows(),
                    hl.cols()
                )
            },
        )?;
        self.own(h.buf(), OP)?;
        let apart = h.buf().addr(0) != gate_up.buf().addr(0)
            && h.buf().addr(0) != x.buf().addr(0)
            && h.dtype() == gate_up.dtype();
        if apart {
            if let Some((kernel, norm)) = self.norm_fold(OP, &x, nw, eps, &xn, w, &gate_up)? {
                let rows = hl.rows();
                let dt = h.dtype();
                let units = hl.cols();
                let q8 = self.q8_target(rows, units)?;
                let dims = self.norm_dims(units, rows, w.k)?;
                let epi = Epilogue {
                    fold: FOLD_SWIGLU,
                    res: (0, 0),
                    h: (addr_mut(&h), int(OP, hl.stride())?),
                    hq: q8.unwrap_or((0, 0)),
                    rope: None,
                };
                self.fold_launch(OP, kernel, dims, w, Some(norm), (0, 0), &gate_up, epi)?;
                self.q8_made(q8, addr_mut(&h), hl, dt);
                return Ok(());
            }
        }
        let cols = gl.cols();
        self.op_rms_norm_matmul(x, nw, eps, xn, w, gate_up.col_range(0, cols)?)?;
        let gu = gate_up.as_view();
        self.op_swiglu(
            gu.col_range(0, cols / 2)?,
            gu.col_range(cols / 2, cols / 2)?,
            h,
        )
    }

    /// `matmul` of `x` by `w` into `out`, then `residual += out`, in one launch where it folds
    /// (the 8-bit rows of `x` as `matmul` gets them: written by their producer, else
    /// `quantize_q8`).
    pub(crate) fn op_matmul_add(
        &mut self,
        x: View<'_, CudaBuffer>,
        w: &CudaMatrix,
        mut out: ViewMut<'_, CudaBuffer>,
        mut residual: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "matmul_add";
        let rows = x.layout().rows();
        let fold = self.fold_kernel(w, rows, x.dtype());
        if let Some(kernel) = fold {
            let dt = self.fold_check(OP, &x, w, &out)?;
            self.own(residual.buf(), OP)?;
            same(OP, dt, residual.dtype())?;
            let (ol, rl) = (out.layout(), residual.layout());
            need(rl.rows() == ol.rows() && rl.cols() == ol.cols(), OP, || {
                format!(
                    "a {}x{} residual for a {}x{} product",
                    rl.rows(),
                    rl.cols(),
                    ol.rows(),
                    ol.cols()
                )
            })?;
            if residual.buf().addr(0) != out.buf().addr(0) {
                let q8 = self.q8_input(w, &x, dt)?;
                let dims = LaunchDims::linear(
                    [int(OP, w.n.div_ceil(FOLD_UNITS))? as u32, 1, 1],
                    FOLD_THREADS,
                );
                let epi = Epilogue {
                    fold: FOLD_ADD,
                    res: (addr_mut(&residual), int(OP, rl.stride())?),
                    h: (0, 0),
                    hq: (0, 0),
                    rope: None,
                };
                return self.fold_launch(OP, kernel, dims, w, None, q8, &out, epi);
            }
        }
        let cols = out.layout().cols();
        self.op_matmul(x, w, out.col_range(0, cols)?)?;
        let cols = residual.layout().cols();
        self.op_add(residual.col_range(0, cols)?, out.as_view())
    }

    /// The folded kernel and the norm prologue's arguments for `rms_norm_matmul`, or `None`
    /// where the ops run apart: no folded kernel, or buffers the blocks would race on.
    #[allow(clippy::too_many_arguments)]
    fn norm_fold(
        &mut self,
        op: &'static str,
        x: &View<'_, CudaBuffer>,
        nw: &CudaBuffer,
        eps: f32,
        xn: &ViewMut<'_, CudaBuffer>,
        w: &CudaMatrix,
        out: &ViewMut<'_, CudaBuffer>,
    ) -> Result<Option<(usize, NormIn)>, BackendError> {
        let (xl, nl) = (x.layout(), xn.layout());
        let Some(kernel) = self.fold_kernel(w, xl.rows(), x.dtype()) else {
            return Ok(None);
        };
        let dt = self.fold_check(op, x, w, out)?;
        self.own(nw, op)?;
        self.own(xn.buf(), op)?;
        same(op, dt, xn.dtype())?;
        let wdt = float(op, nw.dtype())?;
        need(
            nl.rows() == xl.rows() && nl.cols() == xl.cols() && nw.len() == xl.cols(),
            op,
            || {
                format!(
                    "x {}x{}, normalised rows {}x{}, norm weight of {}",
                    xl.rows(),
                    xl.cols(),
                    nl.rows(),
                    nl.cols(),
                    nw.len()
                )
            },
        )?;
        // Every block reads all of x while block 0 writes xn and each block its outputs.
        let (xb, nb, ob) = (x.buf().addr(0), xn.buf().addr(0), out.buf().addr(0));
        let smem = xl.rows() * w.k + xl.rows() * (w.k / 32) * 16;
        if xb == nb || xb == ob || nb == ob || smem > self.gpu.max_dynamic_smem() as usize {
            return Ok(None);
        }
        Ok(Some((
            kernel,
            NormIn {
                x: addr(x),
                ldx: int(op, xl.stride())?,
                w: nw.addr(0),
                wdt: dt_code(wdt),
                eps,
                xn: addr_mut(xn),
                ldxn: int(op, nl.stride())?,
            },
        )))
    }

    /// A norm-prologue launch over `units` output units: the norm kernel's block size for rows
    /// of `k`, and shared memory for `rows` rows' 8-bit form.
    fn norm_dims(&self, units: usize, rows: usize, k: usize) -> Result<LaunchDims, BackendError> {
        let mut dims = LaunchDims::linear(
            [int("matmul", units.div_ceil(FOLD_UNITS))? as u32, 1, 1],
            row_threads(k, 256),
        );
        dims.smem = (rows * k + rows * (k / 32) * 16) as u32;
        Ok(dims)
    }

    #[allow(clippy::too_many_arguments)]
    fn fold_launch(
        &mut self,
        op: &'static str,
        kernel: usize,
        dims: LaunchDims,
        w: &CudaMatrix,
        norm: Option<NormIn>,
        q8: (DevPtr, DevPtr),
        out: &ViewMut<'_, CudaBuffer>,
        epi: Epilogue,
    ) -> Result<(), BackendError> {
        let ol = out.layout();
        let wp = w.mem.ptr();
        let n = NormIn {
            x: 0,
            ldx: 0,
            w: 0,
            wdt: 0,
            eps: 0.0,
            xn: 0,
            ldxn: 0,
        };
        let nm = norm.unwrap_or(n);
        let r = epi.rope.unwrap_or(RopeOut {
            heads: (0, 0, 0),
            dims: 0,
            halves: 0,
            theta_scale: 0.0,
            freq_scale: 0.0,
            pos: 0,
            factors: 0,
            slots: 0,
            pool: 0,
            block_stride: 0,
            layer_off: 0,
            bs: 0,
            norms: (0, 0, 0, 0),
            head_threads: 0,
        });
        self.launch(
            kernel,
            dims,
            Args::new()
                .ptr(wp)
                .ptr(wp + w.scales_at as u64)
                .ptr(wp + w.mins_at as u64)
                .i32(int(op, w.n)?)
                .i32(int(op, w.k)?)
                .ptr(nm.x)
                .i32(nm.ldx)
                .ptr(nm.w)
                .i32(nm.wdt)
                .f32(nm.eps)
                .ptr(nm.xn)
                .i32(nm.ldxn)
                .ptr(q8.0)
                .ptr(q8.1)
                .i32(int(op, ol.rows())?)
                .ptr(addr_mut(out))
                .i32(int(op, ol.stride())?)
                .i32(epi.fold)
                .ptr(epi.res.0)
                .i32(epi.res.1)
                .ptr(epi.h.0)
                .i32(epi.h.1)
                .ptr(epi.hq.0)
                .ptr(epi.hq.1)
                .i32(r.heads.0)
                .i32(r.heads.1)
                .i32(r.heads.2)
                .i32(r.dims)
                .i32(r.halves)
                .f32(r.theta_scale)
                .f32(r.freq_scale)
                .ptr(r.pos)
                .ptr(r.factors)
                .ptr(r.slots)
                .ptr(r.pool)
                .i64(r.block_stride)
                .i64(r.layer_off)
                .i32(r.bs)
                .ptr(r.norms.0)
                .i32(r.norms.1)
                .ptr(r.norms.2)
                .i32(r.norms.3)
                .i32(r.head_threads),
        )
    }
}

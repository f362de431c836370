//! Matrix products: the quantized GEMV kernels (activations quantized to 8 bits first, or by the
//! kernel that produced them: `fused`), or cuBLAS on weights dequantized at load or into a
//! scratch buffer, as the matmul mode says.

use npu_backend::{BackendError, DType, View, ViewMut};

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;
use crate::config::MatmulMode;
use crate::gpu::{blocks, Args, DevPtr, Gemm, LaunchDims};
use crate::kernels::{
    self, dequant_kernel, gemm_kernel, gemm_tiled_kernel, gemv_kernel, gemv_wide_kernel, op_kernel,
    Op, WeightFormat,
};
use crate::ops::{addr, addr_mut, float, grid_rows, int, need, same, EW_THREADS};
use crate::weights::{CudaMatrix, MatrixKind};

/// Which quantized GEMV kernels a backend launches for Q4_0, Q4_1 and Q8_0 matrices
/// (`NPU_SERVING_CUDA_GEMV`, [`crate::config::ENV_GEMV`]). Both give the same bits: the wide
/// kernels add each lane's blocks in the plain kernels' order with their arithmetic and differ
/// only in how many weight loads a lane has in flight (kernels/matmul.cu, `gemv_q_partial_wide`).
/// Only the stand-alone GEMV (`gemv_*`) has a wide form; the folded GEMVs (`gemv_fold_*`,
/// `NPU_SERVING_CUDA_FUSE` >= 2) and the packed K-quant GEMVs are unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GemvVariant {
    /// `gemv_*`: one block's loads, then its dot products (the default).
    #[default]
    Plain,
    /// `gemv_wide_*`: four blocks' loads per lane issued before their dot products, read
    /// through the read-only data path. Not yet measured on a GPU.
    Wide,
}

impl GemvVariant {
    pub fn name(self) -> &'static str {
        match self {
            GemvVariant::Plain => "plain",
            GemvVariant::Wide => "wide",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "plain" => Some(GemvVariant::Plain),
            "wide" => Some(GemvVariant::Wide),
            _ => None,
        }
    }

    /// `NPU_SERVING_CUDA_GEMV` read through `get` (unset: `Plain`); a bad value is an error
    /// naming the variable.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        use crate::config::ENV_GEMV;
        match get(ENV_GEMV) {
            None => Ok(GemvVariant::Plain),
            Some(v) => {
                Self::parse(&v).ok_or_else(|| format!("{ENV_GEMV}={v:?}: expected plain or wide"))
            }
        }
    }

    /// As `from_vars` on the process environment, a bad value falling back to `Plain` with a
    /// warning (`CudaConfig::from_env`, which the agent calls first, refuses it by name).
    pub(crate) fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok()).unwrap_or_else(|e| {
            tracing::warn!("cuda: {e}; using the plain GEMV");
            GemvVariant::Plain
        })
    }
}

/// Warps per block of the GEMV kernels (one output each).
const GEMV_WARPS: usize = 4;

/// Token rows from which a quantized product on the int8 tensor cores takes the tiled GEMM
/// (`gemm_tiled_*`, kernels/gemm_tiled.cu: 64 rows x 64 outputs a block of 256 threads, the
/// activations and weight blocks staged through shared memory by `cp.async`). From 9 to 32 rows
/// `gemm_*` (kernels/matmul.cu: 32 rows x 32 outputs a block of 128 threads, fragments read from
/// global memory) covers the rows with one block row, where a 64-row tile would compute at least
/// half its rows for nothing; from 33 rows it would read every weight block twice or more, the
/// tiled one reads it once per 64 rows. Same bits either way; neither speed has been measured
/// (no GPU run of the tiled kernel yet).
pub(crate) const TILED_MIN_ROWS: usize = 33;
/// The tiled GEMM's tile: token rows, outputs and threads of a block (kernels/gemm_tiled.cu).
const TILE_ROWS: usize = 64;
const TILE_OUTS: usize = 64;
const TILE_THREADS: u32 = 256;

/// Bytes of weight scratch a matmul of `w` may dequantize into under `mode` (`None`: never).
pub(crate) fn dequant_scratch_bytes(mode: MatmulMode, w: &CudaMatrix, dt: DType) -> Option<usize> {
    match (mode, w.kind) {
        (MatmulMode::Auto, MatrixKind::Packed(fmt))
            if !(fmt == WeightFormat::F16 && dt == DType::F16) =>
        {
            Some(w.n * w.k * dt.size())
        }
        _ => None,
    }
}

impl CudaBackend {
    /// The quantized GEMV kernels this backend launches (`NPU_SERVING_CUDA_GEMV` when it was
    /// made, else the last `set_gemv_variant`).
    pub fn gemv_variant(&self) -> GemvVariant {
        self.gemv
    }

    /// Chooses the quantized GEMV kernels for the products that follow (same bits either way;
    /// a CUDA graph captured before keeps the kernels it recorded).
    pub fn set_gemv_variant(&mut self, v: GemvVariant) {
        self.gemv = v;
    }

    pub(crate) fn op_matmul(
        &mut self,
        x: View<'_, CudaBuffer>,
        w: &CudaMatrix,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "matmul";
        self.own(x.buf(), OP)?;
        self.own(out.buf(), OP)?;
        need(w.mem.device() == self.device, OP, || {
            "a matrix of another backend instance".into()
        })?;
        let dt = float(OP, x.dtype())?;
        same(OP, dt, out.dtype())?;
        let (xl, ol) = (x.layout(), out.layout());
        need(
            xl.cols() == w.k && ol.cols() == w.n && xl.rows() == ol.rows(),
            OP,
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
        let rows = xl.rows();
        if rows == 0 {
            return Ok(());
        }
        match w.kind {
            MatrixKind::Dense(wdt) => {
                need(wdt == dt, OP, || {
                    format!("a {} matrix with {} activations", wdt.name(), dt.name())
                })?;
                self.cublas(w.mem.ptr(), w, &x, &out, dt)
            }
            // The GEMV, 8 rows a launch, or from TILED_MIN_ROWS rows the tiled tensor-core
            // GEMM with the GEMV's bits (module note of `matmul_k`).
            MatrixKind::Q4K | MatrixKind::Q6K => self.gemv_kquant(w, x, out, dt),
            MatrixKind::Packed(fmt) => {
                let gemv = self.cfg.matmul == MatmulMode::Quantized
                    || (self.cfg.matmul == MatmulMode::Auto && rows <= self.cfg.gemv_max_rows);
                if gemv {
                    return self.gemv(fmt, w, x, out, dt);
                }
                let a = if fmt == WeightFormat::F16 && dt == DType::F16 {
                    w.mem.ptr()
                } else {
                    self.dequantize(fmt, w, dt)?
                };
                self.cublas(a, w, &x, &out, dt)
            }
        }
    }

    /// Dequantizes `w` into the weight scratch as a dense `dt` matrix; returns its address.
    fn dequantize(
        &mut self,
        fmt: WeightFormat,
        w: &CudaMatrix,
        dt: DType,
    ) -> Result<DevPtr, BackendError> {
        const OP: &str = "matmul";
        let bytes = w.n * w.k * dt.size();
        // Made at its largest when the matrices were loaded (see `load_matrix`).
        let dst = self.scratch_w.ensure(&self.gpu, self.device, bytes)?;
        let units = if fmt == WeightFormat::F16 {
            w.n * w.k
        } else {
            w.n * (w.k / 32)
        };
        let grid = blocks(units, EW_THREADS).min(self.gpu.sm_count().max(1) * 32);
        self.launch(
            dequant_kernel(fmt, dt),
            LaunchDims::linear([grid, 1, 1], EW_THREADS as u32),
            Args::new()
                .ptr(w.mem.ptr())
                .ptr(w.mem.ptr() + w.scales_at as u64)
                .ptr(w.mem.ptr() + w.mins_at as u64)
                .i32(int(OP, w.n)?)
                .i32(int(OP, w.k)?)
                .ptr(dst),
        )?;
        Ok(dst)
    }

    /// out = x . a^T with cuBLAS, `a` a dense `n x k` matrix of `dt`.
    fn cublas(
        &self,
        a: DevPtr,
        w: &CudaMatrix,
        x: &View<'_, CudaBuffer>,
        out: &ViewMut<'_, CudaBuffer>,
        dt: DType,
    ) -> Result<(), BackendError> {
        self.launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.gpu.gemm(&Gemm {
            m: w.n,
            n: x.layout().rows(),
            k: w.k,
            a,
            lda: w.k,
            b: addr(x),
            ldb: x.layout().stride(),
            c: addr_mut(out),
            ldc: out.layout().stride(),
            ab_type: dt,
            c_type: dt,
        })
    }

    /// The GEMV kernels, up to 8 activation rows per pass over the weights; quantized weights
    /// multiply the activations quantized to 8 bits first.
    fn gemv(
        &mut self,
        fmt: WeightFormat,
        w: &CudaMatrix,
        x: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
        dt: DType,
    ) -> Result<(), BackendError> {
        const OP: &str = "matmul";
        let xl = x.layout();
        let (rows, es) = (xl.rows(), dt.size());
        let (n, k) = (int(OP, w.n)?, int(OP, w.k)?);
        let nb = w.k / 32;
        let quantized = if fmt == WeightFormat::F16 {
            None
        } else {
            Some(self.q8_input(w, &x, dt)?)
        };
        let kept = quantized.map(|q8| (x, q8));
        let ol = out.layout();
        let op = addr_mut(&out);
        if let (Some((xq, xs)), Some((kernel, tiled))) = (quantized, self.mma_kernel(fmt, rows, dt))
        {
            // Many rows: the int8 tensor cores, the GEMV's arithmetic bit for bit.
            let wp = w.mem.ptr();
            let dims = if tiled {
                LaunchDims::linear(
                    [
                        blocks(rows, TILE_ROWS),
                        grid_rows(OP, w.n.div_ceil(TILE_OUTS))?,
                        1,
                    ],
                    TILE_THREADS,
                )
            } else {
                LaunchDims::linear([blocks(rows, 32), grid_rows(OP, w.n.div_ceil(32))?, 1], 128)
            };
            self.launch(
                kernel,
                dims,
                Args::new()
                    .ptr(wp)
                    .ptr(wp + w.scales_at as u64)
                    .ptr(wp + w.mins_at as u64)
                    .i32(n)
                    .i32(k)
                    .ptr(xq)
                    .ptr(xs)
                    .i32(int(OP, rows)?)
                    .ptr(op)
                    .i32(int(OP, ol.stride())?),
            )?;
            if let Some((x, q8)) = kept {
                self.q8_keep(&x, &out, q8, dt);
            }
            return Ok(());
        }
        let variant = usize::from(rows > 1);
        let per = kernels::GEMV_ROWS[variant];
        let dims = LaunchDims::linear([blocks(w.n, GEMV_WARPS), 1, 1], (GEMV_WARPS * 32) as u32);
        let wp = w.mem.ptr();
        let kernel = match self.gemv {
            GemvVariant::Wide => gemv_wide_kernel(fmt, variant, dt),
            GemvVariant::Plain => None,
        }
        .unwrap_or_else(|| gemv_kernel(fmt, variant, dt));
        let mut r0 = 0;
        while r0 < rows {
            let n_r = per.min(rows - r0) as i32;
            let out_at = op + (r0 * ol.stride() * es) as u64;
            let args = match quantized {
                Some((xq, xs)) => Args::new()
                    .ptr(wp)
                    .ptr(wp + w.scales_at as u64)
                    .ptr(wp + w.mins_at as u64)
                    .i32(n)
                    .i32(k)
                    .ptr(xq + (r0 * w.k) as u64)
                    .ptr(xs + (r0 * nb * 16) as u64)
                    .i32(n_r),
                None => Args::new()
                    .ptr(wp)
                    .i32(n)
                    .i32(k)
                    .ptr(addr(&x) + (r0 * xl.stride() * es) as u64)
                    .i32(int(OP, xl.stride())?)
                    .i32(n_r),
            };
            self.launch(kernel, dims, args.ptr(out_at).i32(int(OP, ol.stride())?))?;
            r0 += per;
        }
        if let Some((x, q8)) = kept {
            self.q8_keep(&x, &out, q8, dt);
        }
        Ok(())
    }

    /// The 8-bit form of `x` for a quantized product by `w`: the one the kernel that produced
    /// `x` (or the product before this one, of the same rows) wrote, where nothing ran since
    /// (`fused`), else `quantize_q8` into the activation scratch. Returns (int8 rows, scales).
    pub(crate) fn q8_input(
        &mut self,
        w: &CudaMatrix,
        x: &View<'_, CudaBuffer>,
        dt: DType,
    ) -> Result<(DevPtr, DevPtr), BackendError> {
        self.q8_input_as(w, x, dt, false)
    }

    /// `q8_input` with 32 values a scale (`quantize_q8`) or, `per256`, 256 (`quantize_q8k`, Q8_K,
    /// for packed K-quants), in the same layout.
    pub(crate) fn q8_input_as(
        &mut self,
        w: &CudaMatrix,
        x: &View<'_, CudaBuffer>,
        dt: DType,
        per256: bool,
    ) -> Result<(DevPtr, DevPtr), BackendError> {
        const OP: &str = "matmul";
        if let Some(q8) = self.q8_take(x, dt, per256) {
            return Ok(q8);
        }
        let xl = x.layout();
        let rows = xl.rows();
        let nb = w.k / 32;
        let xq_bytes = rows * w.k;
        let dst = self
            .scratch_x
            .ensure(&self.gpu, self.device, xq_bytes + rows * nb * 16)?;
        let xs = dst + xq_bytes as u64;
        // One warp a 32-value block (quantize_q8) or a 256-value super-block (quantize_q8k).
        let (op, units) = if per256 {
            (Op::QuantizeQ8K, w.k / 256)
        } else {
            (Op::QuantizeQ8, nb)
        };
        self.launch(
            op_kernel(op, dt),
            LaunchDims::linear([blocks(units, 8), grid_rows(OP, rows)?, 1], 256),
            Args::new()
                .ptr(addr(x))
                .i32(int(OP, xl.stride())?)
                .i32(int(OP, w.k)?)
                .ptr(dst)
                .ptr(xs),
        )?;
        Ok((dst, xs))
    }

    /// The int8 tensor-core GEMM for a quantized product of `rows` rows, where it is used: more
    /// rows than one GEMV pass takes, a device with `mma.m16n8k32` and the setting on. Returns
    /// the kernel and whether it is the tiled one (from [`TILED_MIN_ROWS`] rows).
    fn mma_kernel(&self, fmt: WeightFormat, rows: usize, dt: DType) -> Option<(usize, bool)> {
        if rows <= kernels::GEMV_ROWS[1] || !self.cfg.int8_mma || !self.gpu.int8_mma() {
            return None;
        }
        if rows >= TILED_MIN_ROWS {
            return gemm_tiled_kernel(fmt, dt).map(|k| (k, true));
        }
        gemm_kernel(fmt, dt).map(|k| (k, false))
    }
}

#[cfg(test)]
mod tests {
    use super::GemvVariant;
    use crate::config::ENV_GEMV;

    #[test]
    fn gemv_variant_from_the_environment() {
        let get = |v: &'static str| move |k: &str| (k == ENV_GEMV).then(|| v.to_string());
        assert_eq!(GemvVariant::from_vars(|_| None), Ok(GemvVariant::Plain));
        assert_eq!(GemvVariant::from_vars(get("wide")), Ok(GemvVariant::Wide));
        assert_eq!(GemvVariant::from_vars(get("plain")), Ok(GemvVariant::Plain));
        let e = GemvVariant::from_vars(get("fast")).unwrap_err();
        assert!(e.contains(ENV_GEMV), "{e}");
        let e = crate::CudaConfig::from_vars(get("4")).unwrap_err();
        assert!(e.contains(ENV_GEMV), "{e}");
    }
}

//! Products by packed K-quant matrices (`MatrixKind::Q4K`, `Q6K`;
//! `NPU_SERVING_CUDA_KQUANTS=packed`): the activations quantized to 8 bits 256 values a scale
//! (`q8_input_as`, `quantize_q8k`: Q8_K, as llama.cpp's CPU build and the CPU backend quantize them
//! for K-quants), then the packed GEMV (`gemv_q4_k_*`, `gemv_q6_k_*`, kernels/matmul_k.cu), 8
//! token rows a launch; from [`TILED_MIN_ROWS`] rows on a device with int8 `mma` (and
//! `NPU_SERVING_CUDA_MMA` not 0) the tiled tensor-core GEMM (`gemm_tiled_q4_k_*`,
//! `gemm_tiled_q6_k_*`, kernels/gemm_tiled_k.cu), which gives the GEMV's bits, reading each
//! weight block once per 64 rows. From 9 to 32 rows the GEMV loop stays (at most 4 launches; a
//! 64-row tile would compute half its rows or more for nothing), as for the other formats. No
//! cuBLAS or folded path reads packed K-quants. Neither speed is measured.

use npu_backend::{BackendError, DType, View, ViewMut};

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;
use crate::gpu::{blocks, Args, LaunchDims};
use crate::kernels::{gemm_tiled_k_kernel, gemv_q4k_kernel, gemv_q6k_kernel, GEMV_ROWS};
use crate::matmul::TILED_MIN_ROWS;
use crate::ops::{addr_mut, grid_rows, int};
use crate::weights::{CudaMatrix, MatrixKind};

/// Warps per block (one output each), as the other GEMVs.
const WARPS: usize = 4;
/// The tiled GEMM's tile: token rows, outputs and threads of a block (kernels/gemm_tiled_k.cu).
const TILE_ROWS: usize = 64;
const TILE_OUTS: usize = 64;
const TILE_THREADS: u32 = 256;

impl CudaBackend {
    /// How K-quant matrices loaded from now on are kept (`CudaConfig::kquants`; matrices
    /// already loaded keep their form): lets one backend hold both forms, as the conformance
    /// case comparing them does.
    pub fn set_kquants(&mut self, kquants: crate::config::KQuants) {
        self.cfg.kquants = kquants;
    }

    /// out = x . w^T for a packed Q4_K or Q6_K `w` (shapes checked by `op_matmul`).
    pub(crate) fn gemv_kquant(
        &mut self,
        w: &CudaMatrix,
        x: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
        dt: DType,
    ) -> Result<(), BackendError> {
        const OP: &str = "matmul";
        let rows = x.layout().rows();
        let (n, k) = (int(OP, w.n)?, int(OP, w.k)?);
        let nb = w.k / 32;
        let (xq, xs) = self.q8_input_as(w, &x, dt, true)?;
        let ol = out.layout();
        let op = addr_mut(&out);
        let q6 = w.kind == MatrixKind::Q6K;
        if rows >= TILED_MIN_ROWS && self.cfg.int8_mma && self.gpu.int8_mma() {
            let dims = LaunchDims::linear(
                [
                    blocks(rows, TILE_ROWS),
                    grid_rows(OP, w.n.div_ceil(TILE_OUTS))?,
                    1,
                ],
                TILE_THREADS,
            );
            self.launch(
                gemm_tiled_k_kernel(q6, dt),
                dims,
                Args::new()
                    .ptr(w.mem.ptr())
                    .i32(n)
                    .i32(k)
                    .ptr(xq)
                    .ptr(xs)
                    .i32(int(OP, rows)?)
                    .ptr(op)
                    .i32(int(OP, ol.stride())?),
            )?;
            self.q8_keep_as(&x, &out, (xq, xs), dt, true);
            return Ok(());
        }
        let kernel = if q6 { gemv_q6k_kernel } else { gemv_q4k_kernel };
        let variant = usize::from(rows > 1);
        let per = GEMV_ROWS[variant];
        let dims = LaunchDims::linear([blocks(w.n, WARPS), 1, 1], (WARPS * 32) as u32);
        let mut r0 = 0;
        while r0 < rows {
            let n_r = per.min(rows - r0) as i32;
            self.launch(
                kernel(variant, dt),
                dims,
                Args::new()
                    .ptr(w.mem.ptr())
                    .i32(n)
                    .i32(k)
                    .ptr(xq + (r0 * w.k) as u64)
                    .ptr(xs + (r0 * nb * 16) as u64)
                    .i32(n_r)
                    .ptr(op + (r0 * ol.stride() * dt.size()) as u64)
                    .i32(int(OP, ol.stride())?),
            )?;
            r0 += per;
        }
        self.q8_keep_as(&x, &out, (xq, xs), dt, true);
        Ok(())
    }
}

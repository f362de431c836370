//! Products by packed K-quant matrices (`MatrixKind::Q4K`, `Q6K`;
//! `NPU_SERVING_CUDA_KQUANTS=packed`): the activations quantized to 8 bits (`q8_input`, as for
//! Q4_0/Q4_1/Q8_0), then the packed GEMV (`gemv_q4_k_*`, `gemv_q6_k_*`, kernels/matmul_k.cu), 8 token rows a launch for every step size: no cuBLAS,
//! tensor-core or folded path reads packed Q4_K, and looping the GEMV over a long prefill is the
//! simplest correct choice (it reads the weights once per 8 rows; unmeasured).

use npu_backend::{BackendError, DType, View, ViewMut};

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;
use crate::gpu::{blocks, Args, LaunchDims};
use crate::kernels::{gemv_q4k_kernel, gemv_q6k_kernel, GEMV_ROWS};
use crate::ops::{addr_mut, int};
use crate::weights::{CudaMatrix, MatrixKind};

/// Warps per block (one output each), as the other GEMVs.
const WARPS: usize = 4;

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
        let (xq, xs) = self.q8_input(w, &x, dt)?;
        let ol = out.layout();
        let op = addr_mut(&out);
        let kernel = if w.kind == MatrixKind::Q6K {
            gemv_q6k_kernel
        } else {
            gemv_q4k_kernel
        };
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
        self.q8_keep(&x, &out, (xq, xs), dt);
        Ok(())
    }
}

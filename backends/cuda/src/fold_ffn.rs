//! A decode layer's whole feed-forward block in one launch (`Backend::rms_norm_ffn`,
//! `ffn_fused_*` in kernels/ffn_fused.cu; `CudaConfig::fold_ffn`, `NPU_SERVING_CUDA_FUSE=4`):
//! the FFN norm, the gate/up product, SwiGLU, the activations' 8-bit form, the down product and
//! the residual add. Each block takes 32 units of the intermediate dimension and writes its
//! part of the down product for every output to a scratch area; the grid's last block to finish
//! (an `atomicInc` ticket) adds those parts in block order and adds the sum into the residual.
//!
//! The norm, gate/up and SwiGLU values are the bits of the level-2 and 3 folds; the down
//! product's sum is taken in another fixed order than the GEMV's lanes, so `out` and the residual
//! are the same bits every run and in a graph replay, not bit for bit those of the separate
//! launches. The scratch and the counter stay at fixed device addresses (sized for the most rows
//! a GEMV pass takes), so captured graphs keep naming them; the counter wraps back to 0 in every
//! launch's last block. Where the launch does not fit (`fold_ffn` off, an F16 or dequantized
//! matrix, more than 8 rows, the cuBLAS path, shared buffers, rows whose 8-bit form exceeds the
//! device's shared memory) the block runs as the level-3 ops (`rms_norm_matmul_swiglu`, then
//! `matmul_add`), by choice and without an error. Nothing of this has run on a GPU.

use npu_backend::{BackendError, DType, DeviceBuffer, ViewMut};

use crate::backend::CudaBackend;
use crate::buffer::{CudaBuffer, Scratch};
use crate::gpu::{Args, DevPtr, LaunchDims};
use crate::kernels::{ffn_fused_kernel, WeightFormat, GEMV_ROWS};
use crate::ops::{addr_mut, dt_code, float, int, row_threads};
use crate::weights::{CudaMatrix, MatrixKind};

/// Units of the intermediate dimension one block takes (`FFN_UNITS` in ffn_fused.cu): one block
/// of 32 of the 8-bit activations, so each block quantizes its own. The smallest such chunk is
/// also what keeps a large GPU busy: Llama 3 8B's 14336 units make 448 blocks, over 2x the 132
/// SMs of an H100 (64 units would give 224, under 2x), and the blocks' gate/up rows are as many
/// as the FUSE=2 gate/up GEMV's. The price is the scratch the last block reads: blocks x rows x
/// hidden f32 values (7.3 MB a row for Llama 3 8B), unmeasured on a GPU.
const FFN_UNITS: usize = 32;
/// Bytes before the partial sums: the counter, alone in its 256.
const COUNTER_BYTES: usize = 256;

/// The partial sums and the last-block counter (at offset 0), and the allocation whose counter
/// has been zeroed.
#[derive(Default)]
pub(crate) struct FfnScratch {
    mem: Scratch,
    zeroed: DevPtr,
}

impl CudaBackend {
    /// Turns the one-launch feed-forward block (`CudaConfig::fold_ffn`) on or off; it takes
    /// effect with `fuse` and `fold_gemv` on.
    pub fn set_fold_ffn(&mut self, on: bool) {
        self.cfg.fold_ffn = on;
    }

    /// Whether the model should hand over the feed-forward block whole for a step of `rows`
    /// rows (`Backend::folds_ffn`).
    pub(crate) fn folds_ffn_rows(&self, rows: usize) -> bool {
        self.cfg.fold_ffn && self.folds_norms(rows)
    }

    /// `rms_norm_matmul_swiglu` of `residual` then `matmul_add` of `h` into `out` and `residual`,
    /// in one launch where it fits (module note).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_rms_norm_ffn(
        &mut self,
        residual: ViewMut<'_, CudaBuffer>,
        nw: &CudaBuffer,
        eps: f32,
        xn: ViewMut<'_, CudaBuffer>,
        gu_m: &CudaMatrix,
        gate_up: ViewMut<'_, CudaBuffer>,
        mut h: ViewMut<'_, CudaBuffer>,
        down: &CudaMatrix,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "rms_norm_ffn";
        for b in [residual.buf(), xn.buf(), gate_up.buf(), h.buf(), out.buf()] {
            self.own(b, OP)?;
        }
        if let Some((kernel, dfmt)) =
            self.ffn_kernel(&residual, nw, &xn, gu_m, &gate_up, &h, down, &out)
        {
            return self.ffn_launch(
                OP, kernel, dfmt, residual, nw, eps, xn, gu_m, gate_up, h, down, out,
            );
        }
        let cols = h.layout().cols();
        let x = residual.as_view();
        self.op_rms_norm_matmul_swiglu(x, nw, eps, xn, gu_m, gate_up, h.col_range(0, cols)?)?;
        self.op_matmul_add(h.as_view(), down, out, residual)
    }

    /// The kernel and the down matrix's format code where the one launch fits: every shape
    /// right for one dense SwiGLU block, five distinct buffers of one float dtype, quantized
    /// matrices on the GEMV path, the 8-bit rows within the device's shared memory.
    #[allow(clippy::too_many_arguments)]
    fn ffn_kernel(
        &self,
        x: &ViewMut<'_, CudaBuffer>,
        nw: &CudaBuffer,
        xn: &ViewMut<'_, CudaBuffer>,
        gu_m: &CudaMatrix,
        gate_up: &ViewMut<'_, CudaBuffer>,
        h: &ViewMut<'_, CudaBuffer>,
        down: &CudaMatrix,
        out: &ViewMut<'_, CudaBuffer>,
    ) -> Option<(usize, i32)> {
        let (MatrixKind::Packed(gfmt), MatrixKind::Packed(dfmt)) = (gu_m.kind, down.kind) else {
            return None;
        };
        let dt = x.dtype();
        let rows = x.layout().rows();
        let (k, ff) = (x.layout().cols(), h.layout().cols());
        let same_dt = [xn.dtype(), gate_up.dtype(), h.dtype(), out.dtype()]
            .iter()
            .all(|&d| d == dt);
        let shapes = [
            (xn.layout().rows(), xn.layout().cols(), k),
            (gate_up.layout().rows(), gate_up.layout().cols(), 2 * ff),
            (h.layout().rows(), 2 * ff, 2 * ff),
            (out.layout().rows(), out.layout().cols(), k),
        ]
        .iter()
        .all(|&(r, c, want)| r == rows && c == want);
        let matrices = gu_m.k == k
            && gu_m.n == 2 * ff
            && down.k == ff
            && down.n == k
            && nw.len() == k
            && ff.is_multiple_of(FFN_UNITS)
            && dfmt != WeightFormat::F16
            && gu_m.mem.device() == self.device
            && down.mem.device() == self.device;
        let addrs = [x.buf(), xn.buf(), gate_up.buf(), h.buf(), out.buf()].map(|b| b.addr(0));
        let apart = (0..5).all(|i| (i + 1..5).all(|j| addrs[i] != addrs[j]));
        let smem = rows * k + rows * (k / 32) * 16;
        if !(self.folds_ffn_rows(rows)
            && dt != DType::I32
            && float("rms_norm_ffn", nw.dtype()).is_ok()
            && same_dt
            && shapes
            && matrices
            && apart
            && smem <= self.gpu.max_dynamic_smem() as usize)
        {
            return None;
        }
        let kernel = ffn_fused_kernel(gfmt, usize::from(rows > GEMV_ROWS[0]), dt)?;
        Some((kernel, dfmt as i32))
    }

    /// The scratch of `blocks` blocks' partial sums for rows of `n` outputs, and its counter
    /// (zeroed when the memory is new: an upload, outside any capture, since the eager run
    /// before a capture makes it).
    fn ffn_scratch(&mut self, blocks: usize, n: usize) -> Result<(DevPtr, DevPtr), BackendError> {
        let bytes = COUNTER_BYTES + blocks * GEMV_ROWS[1] * n * 4;
        let p = self.ffn.mem.ensure(&self.gpu, self.device, bytes)?;
        if p != self.ffn.zeroed {
            self.gpu.htod(p, &[0u8; 4])?;
            self.device_wrote();
            self.ffn.zeroed = p;
        }
        Ok((p + COUNTER_BYTES as u64, p))
    }

    #[allow(clippy::too_many_arguments)]
    fn ffn_launch(
        &mut self,
        op: &'static str,
        kernel: usize,
        dfmt: i32,
        x: ViewMut<'_, CudaBuffer>,
        nw: &CudaBuffer,
        eps: f32,
        xn: ViewMut<'_, CudaBuffer>,
        gu_m: &CudaMatrix,
        gate_up: ViewMut<'_, CudaBuffer>,
        h: ViewMut<'_, CudaBuffer>,
        down: &CudaMatrix,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        let (xl, rows, k) = (x.layout(), x.layout().rows(), gu_m.k);
        let blocks = down.k / FFN_UNITS;
        let (partials, counter) = self.ffn_scratch(blocks, down.n)?;
        let mut dims = LaunchDims::linear([int(op, blocks)? as u32, 1, 1], row_threads(k, 256));
        dims.smem = (rows * k + rows * (k / 32) * 16) as u32;
        let (gp, dp) = (gu_m.mem.ptr(), down.mem.ptr());
        let nwdt = dt_code(float(op, nw.dtype())?);
        let args = Args::new()
            .ptr(gp)
            .ptr(gp + gu_m.scales_at as u64)
            .ptr(gp + gu_m.mins_at as u64)
            .i32(int(op, down.k)?)
            .i32(int(op, k)?)
            .ptr(dp)
            .ptr(dp + down.scales_at as u64)
            .ptr(dp + down.mins_at as u64)
            .i32(dfmt)
            .i32(int(op, down.n)?)
            .ptr(addr_mut(&x))
            .i32(int(op, xl.stride())?)
            .ptr(nw.addr(0))
            .i32(nwdt)
            .f32(eps)
            .ptr(addr_mut(&xn))
            .i32(int(op, xn.layout().stride())?)
            .i32(int(op, rows)?)
            .ptr(addr_mut(&gate_up))
            .i32(int(op, gate_up.layout().stride())?)
            .ptr(addr_mut(&h))
            .i32(int(op, h.layout().stride())?)
            .ptr(addr_mut(&out))
            .i32(int(op, out.layout().stride())?)
            .ptr(partials)
            .ptr(counter);
        self.q8_ready = None;
        self.launch(kernel, dims, args)
    }
}

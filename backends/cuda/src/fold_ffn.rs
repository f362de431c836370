//! A decode layer's whole feed-forward block in one launch (`Backend::rms_norm_ffn`,
//! `ffn_fused_*` in kernels/ffn_fused.cu; `CudaConfig::fold_ffn`, `NPU_SERVING_CUDA_FUSE=4`):
//! the FFN norm, the gate/up product, SwiGLU, the activations' 8-bit form, the down product and
//! the residual add. Each block takes 32 (or, for a grid of many waves, 64) units of the
//! intermediate dimension and writes its share of the down product for every output to a
//! scratch area; a two-level reduction adds the shares: the last block of each group of
//! consecutive blocks to finish (an `atomicInc` ticket on the group's counter) sums its group's
//! shares in block order, and the last group to finish (a ticket on a global counter) sums the
//! group sums in group order and adds the result into the residual.
//!
//! The norm, gate/up and SwiGLU values are the bits of the level-2 and 3 folds; the down
//! product's sum is taken in another fixed order than the GEMV's lanes (it depends only on the
//! shapes and the device's SM count, through the chunk per block), so `out` and the residual
//! are the same bits every run and in a graph replay, not bit for bit those of the separate
//! launches. The scratch and the counters stay at fixed device addresses (sized for the most
//! rows a GEMV pass takes), so captured graphs keep naming them; every counter wraps back to 0
//! at its last ticket of each launch. Where the launch does not fit (`fold_ffn` off, an F16 or
//! dequantized matrix, more than 8 rows, the cuBLAS path, shared buffers, rows whose 8-bit form
//! exceeds the device's shared memory) the block runs as the level-3 ops
//! (`rms_norm_matmul_swiglu`, then `matmul_add`), by choice and without an error. Nothing of
//! this has run on a GPU, and the reduction's cost on one is unmeasured.

use npu_backend::{BackendError, DType, DeviceBuffer, ViewMut};

use crate::backend::CudaBackend;
use crate::buffer::{CudaBuffer, Scratch};
use crate::gpu::{Args, DevPtr, LaunchDims};
use crate::kernels::{ffn_fused_kernel, WeightFormat, GEMV_ROWS};
use crate::ops::{addr_mut, dt_code, float, int, row_threads};
use crate::weights::{CudaMatrix, MatrixKind};

/// Units of the intermediate dimension one block takes (`units` in ffn_fused.cu): one block
/// of 32 of the 8-bit activations, so each block quantizes its own. The smallest such chunk is
/// also what keeps a large GPU busy: Llama 3 8B's 14336 units make 448 blocks, over 3x the 132
/// SMs of an H100, and the blocks' gate/up rows are as many as the FUSE=2 gate/up GEMV's.
const FFN_UNITS: usize = 32;
/// Past this many 32-unit blocks an SM, a block takes 64 units (`ffn_units`). A 256-thread
/// block holds at most 8 (2048 threads / 256) and, with its 8-bit rows in shared memory, often
/// fewer blocks resident on an SM, so such a grid runs in several waves anyway, while each
/// block redoes the norm of every row (reading the residual and the norm weights) and writes a
/// share of every output for the reduction: halving the blocks halves that overhead and the
/// reduction's first level, with still 2 or more blocks an SM. Llama 3 8B on an H100 stays at
/// 32 (448 blocks, under 4 x 132); Llama 3 70B (28672 units) takes 64 (448 blocks, not 896).
const WIDE_BLOCKS_PER_SM: usize = 4;
/// Bytes before the group sums: the counters (the global one, then one a group).
const COUNTER_BYTES: usize = 1024;

/// The chunk of units a block takes for `ff` units on a GPU of `sms` SMs (`WIDE_BLOCKS_PER_SM`).
fn ffn_units(ff: usize, sms: usize) -> usize {
    if ff.is_multiple_of(2 * FFN_UNITS) && ff / FFN_UNITS > WIDE_BLOCKS_PER_SM * sms.max(1) {
        2 * FFN_UNITS
    } else {
        FFN_UNITS
    }
}

/// Blocks a group of the reduction's first level takes: ceil(sqrt(blocks)). The launch's
/// reduction ends with one block summing G shares (its group's) and then the ceil(blocks / G)
/// group sums: G + blocks / G values an output and row on the critical path, least at
/// G = sqrt(blocks), where both levels read about sqrt(blocks) values (not blocks, as one level
/// would). Llama 3 8B: 448 blocks, G = 22, 21 groups (the last of 8 blocks): 22 and 21 values
/// (88 and 84 bytes) an output and row: 352 KiB and 336 KiB a row of 4096 outputs, where a
/// single level had one block read 448 (7 MiB a row). Fixed by the shapes, so the order is too.
fn ffn_group(blocks: usize) -> usize {
    let g = blocks.isqrt();
    if g * g < blocks {
        g + 1
    } else {
        g.max(1)
    }
}

/// The counters (at offset 0), the group sums and the blocks' shares, and the allocation whose
/// counters have been zeroed, with the bytes asked of it then.
#[derive(Default)]
pub(crate) struct FfnScratch {
    mem: Scratch,
    zeroed: (DevPtr, usize),
}

/// How a launch splits the intermediate dimension: units a block, blocks, blocks a group, groups.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Split {
    units: usize,
    blocks: usize,
    group: usize,
    groups: usize,
}

impl Split {
    fn new(ff: usize, sms: usize) -> Split {
        let units = ffn_units(ff, sms);
        let blocks = ff / units;
        let group = ffn_group(blocks);
        Split {
            units,
            blocks,
            group,
            groups: blocks.div_ceil(group),
        }
    }
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
            && ff > 0
            && 4 * (1 + self.ffn_split(ff).groups) <= COUNTER_BYTES
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

    /// The split of `ff` units on this device.
    fn ffn_split(&self, ff: usize) -> Split {
        Split::new(ff, self.gpu.sm_count() as usize)
    }

    /// The counters, the group sums and the shares of `split` for rows of `n` outputs (the
    /// counters zeroed when the memory may be new: an upload, outside any capture, since the
    /// eager run before a capture makes it; every launch leaves them at 0).
    fn ffn_scratch(
        &mut self,
        split: Split,
        n: usize,
    ) -> Result<(DevPtr, DevPtr, DevPtr), BackendError> {
        let area = GEMV_ROWS[1] * n * 4;
        let bytes = COUNTER_BYTES + (split.groups + split.blocks) * area;
        let p = self.ffn.mem.ensure(&self.gpu, self.device, bytes)?;
        if p != self.ffn.zeroed.0 || bytes > self.ffn.zeroed.1 {
            self.gpu.htod(p, &[0u8; COUNTER_BYTES])?;
            self.device_wrote();
            self.ffn.zeroed = (p, bytes);
        }
        let sums = p + COUNTER_BYTES as u64;
        Ok((p, sums, sums + (split.groups * area) as u64))
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
        let split = self.ffn_split(down.k);
        let (counters, sums, shares) = self.ffn_scratch(split, down.n)?;
        let mut dims =
            LaunchDims::linear([int(op, split.blocks)? as u32, 1, 1], row_threads(k, 256));
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
            .i32(int(op, split.units)?)
            .i32(int(op, split.group)?)
            .ptr(shares)
            .ptr(sums)
            .ptr(counters);
        self.q8_ready = None;
        self.launch(kernel, dims, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_about_the_square_root_of_the_blocks() {
        // Llama 3 8B on an H100 (132 SMs): 448 blocks of 32, in 21 groups of 22 (the last 8).
        let s = Split::new(14336, 132);
        let want = Split {
            units: 32,
            blocks: 448,
            group: 22,
            groups: 21,
        };
        assert_eq!(s, want);
        // Llama 3 70B: 896 blocks of 32 would be over 4 an SM, so 448 of 64.
        assert_eq!(Split::new(28672, 132).units, 64);
        assert_eq!(Split::new(28672, 132).blocks, 448);
        // Not a multiple of 64: 32 whatever the grid.
        assert_eq!(Split::new(32 * 999, 8).units, 32);
        for (blocks, group) in [(1, 1), (2, 2), (3, 2), (4, 2), (5, 3), (9, 3), (10, 4)] {
            assert_eq!(ffn_group(blocks), group, "{blocks} blocks");
        }
        for blocks in 1..5000 {
            let g = ffn_group(blocks);
            assert!(g * g >= blocks && (g - 1) * (g - 1) < blocks, "{blocks}");
        }
    }
}

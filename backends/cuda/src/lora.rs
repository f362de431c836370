//! Low-rank adapters on CUDA ([`Capability::Lora`](npu_backend::Capability::Lora)): the
//! segmented LoRA product of one step, `out[r] += scale_g * B_g (A_g x[r])` for the rows of each
//! adapter group (kernels/lora.cu, one launch per group: the engine's runs of rows on one
//! adapter, never a launch per token). Every group's shapes, dtypes and rows are checked before
//! anything is launched, as the CPU backend checks them (backends/cpu/src/backend/lora.rs).

use npu_backend::{BackendError, DType, DeviceBuffer, LoraGroup, View, ViewMut};

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;
use crate::gpu::{Args, LaunchDims};
use crate::kernels::{op_kernel, Op};
use crate::ops::{bad, dt_code, float, int, need, same};

const OP: &str = "lora_add";

/// The largest rank a group may have (the kernel keeps a row's `A x` in shared memory).
pub(crate) const MAX_RANK: usize = 256;
/// Threads of a LoRA block (`LORA_THREADS` in kernels/lora.cu).
const THREADS: u32 = 256;

impl CudaBackend {
    pub(crate) fn op_lora_add(
        &mut self,
        x: View<'_, CudaBuffer>,
        groups: &[LoraGroup<'_, CudaBuffer>],
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.own(x.buf(), OP)?;
        self.own(out.buf(), OP)?;
        let dt = float(OP, x.dtype())?;
        same(OP, dt, out.dtype())?;
        let (xl, ol) = (x.layout(), out.layout());
        need(xl.rows() == ol.rows(), OP, || {
            format!("x of {} rows and out of {}", xl.rows(), ol.rows())
        })?;
        let (n_in, n_out) = (xl.cols(), ol.cols());
        // Every group checked first; rows sorted to find overlaps.
        let mut spans = Vec::with_capacity(groups.len());
        for (gi, g) in groups.iter().enumerate() {
            self.own(g.a, OP)?;
            self.own(g.b_t, OP)?;
            if g.rank == 0 || g.rank > MAX_RANK {
                return Err(bad(
                    OP,
                    format!("group {gi}: rank {} (1..={MAX_RANK})", g.rank),
                ));
            }
            let wdt = g.a.dtype();
            if wdt != g.b_t.dtype() || !matches!(wdt, DType::F32 | DType::BF16) {
                return Err(bad(
                    OP,
                    format!(
                        "group {gi}: A is {} and B {}; both f32 or both bf16",
                        wdt.name(),
                        g.b_t.dtype().name()
                    ),
                ));
            }
            let (a_len, b_len) = (g.a.len(), g.b_t.len());
            if a_len != g.rank * n_in || b_len != g.rank * n_out {
                return Err(bad(
                    OP,
                    format!(
                        "group {gi}: A of {a_len} and B of {b_len} values for rank {} and a \
                         {n_in} -> {n_out} projection",
                        g.rank
                    ),
                ));
            }
            let end = g.row.checked_add(g.n).filter(|&e| e <= xl.rows());
            if end.is_none() {
                return Err(bad(
                    OP,
                    format!("group {gi}: rows {}+{} of {}", g.row, g.n, xl.rows()),
                ));
            }
            if g.n > 0 {
                spans.push((g.row, g.n, gi));
            }
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                let gi = w[0].2.max(w[1].2);
                return Err(bad(OP, format!("group {gi} overlaps another group's rows")));
            }
        }
        let (ldx, ldo) = (int(OP, xl.stride())?, int(OP, ol.stride())?);
        let (ni, no) = (int(OP, n_in)?, int(OP, n_out)?);
        for &(row, n, gi) in &spans {
            let g = &groups[gi];
            let grid = u32::try_from(n).map_err(|_| BackendError::Unsupported {
                backend: "cuda",
                what: format!("{OP} over {n} rows of one adapter"),
            })?;
            self.launch(
                op_kernel(Op::Lora, dt),
                LaunchDims::linear([grid, 1, 1], THREADS),
                Args::new()
                    .ptr(x.buf().addr(xl.offset() + row * xl.stride()))
                    .i32(ldx)
                    .ptr(out.buf().addr(ol.offset() + row * ol.stride()))
                    .i32(ldo)
                    .ptr(g.a.addr(0))
                    .ptr(g.b_t.addr(0))
                    .i32(dt_code(g.a.dtype()))
                    .i32(ni)
                    .i32(no)
                    .i32(g.rank as i32)
                    .f32(g.scale),
            )?;
        }
        Ok(())
    }
}

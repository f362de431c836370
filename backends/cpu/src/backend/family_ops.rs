//! The CPU's ops beyond the Llama step, for the families that need them: per-head Q/K RMS norm
//! (Qwen3, Gemma 3), the GELU-gated FFN and row scaling (Gemma). The trait methods of
//! `CpuBackend` call these; the shapes are checked here before any kernel runs.

use npu_backend::{BackendError, Capability, View, ViewMut};

use super::buffer::{bad, rows, rows_mut, shape};
use super::{CpuBackend, CpuBuffer};
use crate::kernels::elementwise;

/// What the CPU backend has of [`Capability`]: all of it but the mixture-of-experts ops.
pub(super) fn supports(c: Capability) -> bool {
    match c {
        Capability::HeadNorm
        | Capability::GeluGate
        | Capability::ScaleRows
        | Capability::SlidingWindow
        | Capability::RopeFactors
        | Capability::PerLayerRope => true,
        Capability::Moe => false,
    }
}

impl CpuBackend {
    pub(super) fn rms_norm_heads_op(
        &mut self,
        mut x: ViewMut<'_, CpuBuffer>,
        w: &CpuBuffer,
        eps: f32,
        head_dim: usize,
    ) -> Result<(), BackendError> {
        const OP: &str = "rms_norm_heads";
        let x = rows_mut(&mut x, OP)?;
        let w = w.f32s(OP)?;
        if head_dim == 0 || w.len() != head_dim || !x.cols.is_multiple_of(head_dim) {
            return Err(bad(
                OP,
                format!(
                    "{} weights for heads of {head_dim} in rows of {}",
                    w.len(),
                    x.cols
                ),
            ));
        }
        self.par_rows_mut(x, |_, row| elementwise::rms_norm_in_place(row, w, eps))
    }

    pub(super) fn scale_rows_op(
        &mut self,
        mut x: ViewMut<'_, CpuBuffer>,
        s: f32,
    ) -> Result<(), BackendError> {
        let x = rows_mut(&mut x, "scale_rows")?;
        self.par_rows_mut(x, |_, row| elementwise::scale(row, s))
    }

    pub(super) fn geglu_op(
        &mut self,
        gate: View<'_, CpuBuffer>,
        up: View<'_, CpuBuffer>,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "geglu";
        let (gate, up) = (rows(&gate, OP)?, rows(&up, OP)?);
        let o = rows_mut(&mut out, OP)?;
        shape(OP, "up", up.rows, up.cols, gate.rows, gate.cols)?;
        shape(OP, "out", o.rows, o.cols, gate.rows, gate.cols)?;
        self.par_rows_mut_quantized(o, |r, dst| elementwise::geglu(gate.row(r), up.row(r), dst))
    }
}

//! The ops of the newer model families ([`npu_backend::Capability`]), each a documented aclnn
//! call (or pair) on the agent's stream over strided views of the seam's buffers:
//!
//! - `rms_norm_heads`: RmsNorm over the rows seen as (rows, heads, head_dim) with a head_dim
//!   gamma (RmsNorm normalises over gamma's trailing dimensions), written back in place; the
//!   1/rms output goes to a scratch (rows, heads, 1).
//! - `scale_rows`: InplaceMuls by a host scalar (kept as f32: "other参数对于float无精度损失").
//! - `geglu`: GeluV2 with `approximate` = 1 (tanh) of the gate into `out`, then InplaceMul by
//!   `up`. The kernel computes GELU in f32 from the f16 gate and rounds the result to f16, which
//!   is exactly ggml's CPU table (f16 input, gelu in f32, f16 output; 0 at or below -10 and the
//!   gate itself at or above 10 follow from the saturation of the exponential); the product with
//!   `up` is rounded once more to f16. Against the f32 reference that is the f16 rounding of the
//!   gate and up activations and of the two results: within the conformance suite's elementwise
//!   bound (2e-3 of the RMS plus three f16 roundings per value).

use npu_backend::{BackendError, DType, DeviceBuffer as _, View, ViewMut};

use super::layer_ops::{bad, half_of, tview, want_act};
use super::objects::AscendBuffer;
use super::{err, AscendBackend};
use crate::reuse::Arg;
use crate::tensor::{self, View as TView};

/// GeluV2's `approximate` for the tanh form.
const GELU_TANH: i64 = 1;

impl AscendBackend {
    pub(super) fn missing(&self, what: &str) -> BackendError {
        BackendError::Unsupported {
            backend: super::NAME,
            what: format!("{what} (this CANN release does not have the operator)"),
        }
    }

    pub(super) fn op_rms_norm_heads(
        &mut self,
        x: ViewMut<'_, AscendBuffer>,
        w: &AscendBuffer,
        eps: f32,
        head_dim: usize,
    ) -> Result<(), BackendError> {
        let op = "rms_norm_heads";
        let act = self.act_t();
        let l = x.layout();
        want_act(op, "x", x.dtype(), self.act)?;
        if head_dim == 0 || w.len() != head_dim || !l.cols().is_multiple_of(head_dim) {
            return Err(bad(
                op,
                format!(
                    "{} weights for heads of {head_dim} in rows of {}",
                    w.len(),
                    l.cols()
                ),
            ));
        }
        if w.dtype() != DType::F32 && w.dtype() != self.act {
            return Err(bad(op, format!("a {} weight", w.dtype().name())));
        }
        if eps.is_nan() || eps <= 0.0 {
            return Err(bad(op, format!("epsilon {eps} must be positive")));
        }
        let (rows, heads) = (l.rows(), l.cols() / head_dim);
        if rows == 0 || heads == 0 {
            return Ok(());
        }
        // Gamma in x's type (see `op_rms_norm`).
        let cast = self.half_vector(op, w, "gamma16")?;
        self.scratch
            .ensure(&self.dev, "rstd_heads", rows * heads * 4)?;
        let rstd = self.scratch.get("rstd_heads");
        let gamma = half_of(&self.scratch, w, "gamma16", cast);
        // (rows, heads, head_dim): the row stride, then heads side by side.
        let xv = TView::strided(
            act,
            &[rows as i64, heads as i64, head_dim as i64],
            &[l.stride() as i64, head_dim as i64, 1],
            l.offset() as i64,
        );
        let api = self.dev.acl.api.ops;
        let prep = api.aclnnRmsNormGetWorkspaceSize;
        let eps = eps as f64;
        self.pending = true;
        self.ops
            .call(
                "aclnnRmsNorm",
                api.aclnnRmsNorm,
                &[
                    Arg::input("x", 0, &x.buf().mem, xv.clone()),
                    Arg::input(
                        "gamma",
                        1,
                        gamma,
                        TView::contiguous(act, &[head_dim as i64]),
                    ),
                    Arg::output("yOut", 0, &x.buf().mem, xv),
                    Arg::output(
                        "rstdOut",
                        1,
                        rstd,
                        TView::contiguous(tensor::DType::F32, &[rows as i64, heads as i64, 1]),
                    ),
                ],
                &[eps.to_bits() as i64],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    prep(
                        ts[0].raw(),
                        ts[1].raw(),
                        eps,
                        ts[2].raw(),
                        ts[3].raw(),
                        w,
                        e,
                    )
                }),
            )
            .map_err(err)
    }

    pub(super) fn op_scale_rows(
        &mut self,
        x: ViewMut<'_, AscendBuffer>,
        s: f32,
    ) -> Result<(), BackendError> {
        let op = "scale_rows";
        let l = x.layout();
        want_act(op, "x", x.dtype(), self.act)?;
        if l.elements() == 0 {
            return Ok(());
        }
        let api = self.dev.acl.api.ops;
        let (Some(prep), Some(launch)) =
            (api.aclnnInplaceMulsGetWorkspaceSize, api.aclnnInplaceMuls)
        else {
            return Err(self.missing("row scaling (aclnnInplaceMuls)"));
        };
        self.pending = true;
        self.ops
            .call(
                "aclnnInplaceMuls",
                launch,
                &[Arg::fixed("selfRef", &x.buf().mem, tview(x.dtype(), l))],
                &[],
                &[s],
                // SAFETY (closure): a live tensor, scalar and out-pointers from the launcher.
                Box::new(move |ts, sc, w, e| unsafe { prep(ts[0].raw(), sc[0].raw(), w, e) }),
            )
            .map_err(err)
    }

    pub(super) fn op_geglu(
        &mut self,
        gate: View<'_, AscendBuffer>,
        up: View<'_, AscendBuffer>,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "geglu";
        let (gl, ul, ol) = (gate.layout(), up.layout(), out.layout());
        for (w, dt) in [
            ("gate", gate.dtype()),
            ("up", up.dtype()),
            ("out", out.dtype()),
        ] {
            want_act(op, w, dt, self.act)?;
        }
        if gl.rows() != ul.rows()
            || gl.cols() != ul.cols()
            || ol.rows() != gl.rows()
            || ol.cols() != gl.cols()
        {
            return Err(bad(op, "gate, up and out must have one shape"));
        }
        if gl.elements() == 0 {
            return Ok(());
        }
        let api = self.dev.acl.api.ops;
        let (Some(pg), Some(lg), Some(pm), Some(lm)) = (
            api.aclnnGeluV2GetWorkspaceSize,
            api.aclnnGeluV2,
            api.aclnnInplaceMulGetWorkspaceSize,
            api.aclnnInplaceMul,
        ) else {
            return Err(self.missing("the GELU gate (aclnnGeluV2, aclnnInplaceMul)"));
        };
        self.pending = true;
        let om = &out.buf().mem;
        self.ops
            .call(
                "aclnnGeluV2",
                lg,
                &[
                    Arg::input("x", 0, &gate.buf().mem, tview(gate.dtype(), gl)),
                    Arg::output("y", 0, om, tview(out.dtype(), ol)),
                ],
                &[GELU_TANH],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    pg(ts[0].raw(), GELU_TANH, ts[1].raw(), w, e)
                }),
            )
            .map_err(err)?;
        self.ops
            .call(
                "aclnnInplaceMul",
                lm,
                &[
                    Arg::fixed("selfRef", om, tview(out.dtype(), ol)),
                    Arg::fixed("other", &up.buf().mem, tview(up.dtype(), ul)),
                ],
                &[],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe { pm(ts[0].raw(), ts[1].raw(), w, e) }),
            )
            .map_err(err)
    }
}

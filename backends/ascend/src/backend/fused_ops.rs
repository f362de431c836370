//! The residual add folded into the norm after it: `add_rms_norm` as one aclnnAddRmsNorm call
//! (vllm-ascend's `torch_npu.npu_add_rms_norm`), where its page's limits hold, instead of
//! InplaceAdd then RmsNorm.
//!
//! The residual `x` is updated in place as aclnnInplaceAddRmsNorm updates its `x2` (the sum is
//! written over it; the operator shares that one's tiling and kernels): `x1` = the branch output
//! `y`, `x2` = `xOut` = `x`, `yOut` = `out`. The page refuses non-contiguous and empty tensors
//! and asks gamma in x's type; where a view is strided, the release lacks the operator, or the
//! activations are not of the backend's type, the two-call path (`add`, then `rms_norm`) runs.

use npu_backend::{BackendError, View, ViewMut};

use super::layer_ops::{bad, dense, half_of, tview, want_act};
use super::objects::AscendBuffer;
use super::{err, AscendBackend};
use crate::reuse::Arg;
use crate::tensor::{self, View as TView};

impl AscendBackend {
    pub(super) fn op_add_rms_norm(
        &mut self,
        mut x: ViewMut<'_, AscendBuffer>,
        y: View<'_, AscendBuffer>,
        w: &AscendBuffer,
        eps: f32,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        use npu_backend::DeviceBuffer as _;
        let op = "add_rms_norm";
        let (xl, yl, ol) = (x.layout(), y.layout(), out.layout());
        for (what, dt) in [("x", x.dtype()), ("y", y.dtype()), ("out", out.dtype())] {
            want_act(op, what, dt, self.act)?;
        }
        let same = |a: npu_backend::Layout, b: npu_backend::Layout| {
            a.rows() == b.rows() && a.cols() == b.cols()
        };
        if !same(xl, yl) || !same(xl, ol) || w.len() != xl.cols() {
            return Err(bad(
                op,
                format!(
                    "x {}x{}, y {}x{}, weight {}, out {}x{}",
                    xl.rows(),
                    xl.cols(),
                    yl.rows(),
                    yl.cols(),
                    w.len(),
                    ol.rows(),
                    ol.cols()
                ),
            ));
        }
        if eps.is_nan() || eps <= 0.0 {
            return Err(bad(op, format!("epsilon {eps} must be positive")));
        }
        let api = self.dev.acl.api.ops;
        let fused = api
            .aclnnAddRmsNormGetWorkspaceSize
            .zip(api.aclnnAddRmsNorm)
            .filter(|_| xl.rows() > 0 && dense(xl) && dense(yl) && dense(ol));
        let Some((prep, launch)) = fused else {
            // The two documented calls: InplaceAdd, then RmsNorm of the sum.
            let cols = xl.cols();
            self.op_add(x.col_range(0, cols)?, y)?;
            return self.op_rms_norm(x.as_view(), w, eps, out);
        };
        let act = self.act_t();
        let rows = xl.rows();
        // Gamma in x's type (the page: gamma's type is x1's).
        let cast = self.half_vector(op, w, "gamma16")?;
        self.scratch.ensure(&self.dev, "rstd", rows * 4)?;
        let rstd = self.scratch.get("rstd");
        let gamma = half_of(&self.scratch, w, "gamma16", cast);
        let resid = tview(x.dtype(), xl);
        let eps = eps as f64;
        self.pending = true;
        self.ops
            .call(
                "aclnnAddRmsNorm",
                launch,
                &[
                    Arg::input("x1", 0, &y.buf().mem, tview(y.dtype(), yl)),
                    // x2 and xOut: the residual, read and written in place.
                    Arg::fixed("x2", &x.buf().mem, resid.clone()),
                    Arg::input("gamma", 2, gamma, TView::contiguous(act, &[w.len() as i64])),
                    Arg::output("yOut", 0, &out.buf().mem, tview(out.dtype(), ol)),
                    Arg::output(
                        "rstdOut",
                        1,
                        rstd,
                        TView::contiguous(tensor::DType::F32, &[rows as i64, 1]),
                    ),
                    Arg::fixed("xOut", &x.buf().mem, resid),
                ],
                &[eps.to_bits() as i64],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    prep(
                        ts[0].raw(),
                        ts[1].raw(),
                        ts[2].raw(),
                        eps,
                        ts[3].raw(),
                        ts[4].raw(),
                        ts[5].raw(),
                        w,
                        e,
                    )
                }),
            )
            .map_err(err)
    }
}

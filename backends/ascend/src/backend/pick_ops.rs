//! The greedy pick on the device: ArgMax over sanitized logit rows (Cast to INT32), and the
//! pick's log-probability through LogSoftmax, each a few aclnn calls on the agent's stream.

use npu_backend::{BackendError, DType, View, ViewMut};

use super::layer_ops::{bad, tview, want_act};
use super::objects::AscendBuffer;
use super::{err, AscendBackend};
use crate::reuse::Arg;
use crate::tensor::{self, View as TView};

impl AscendBackend {
    /// The greedy pick of each `logits` row into the INT64 scratch "argmax" (values read as the
    /// sampler reads them: f32, NaN as −inf, +inf as `f32::MAX`; first index on ties), leaving
    /// the sanitized f32 rows in scratch "pick_x". Done once per step and logits view.
    fn pick(
        &mut self,
        op: &'static str,
        logits: &View<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let l = logits.layout();
        want_act(op, "logits", logits.dtype(), self.act)?;
        let key = (self.serial, logits.buf().mem.ptr() as usize, l);
        if self.picked == Some(key) {
            return Ok(());
        }
        let (rows, cols) = (l.rows(), l.cols());
        self.scratch.ensure(&self.dev, "pick_x", rows * cols * 4)?;
        self.scratch.ensure(&self.dev, "pick_y", rows * cols * 4)?;
        self.scratch.ensure(&self.dev, "argmax", rows * 8)?;
        let f32v = TView::contiguous(tensor::DType::F32, &[rows as i64, cols as i64]);
        let (x, y) = (self.scratch.get("pick_x"), self.scratch.get("pick_y"));
        let api = self.dev.acl.api.ops;
        let (pc, pn, pa) = (
            api.aclnnCastGetWorkspaceSize,
            api.aclnnNanToNumGetWorkspaceSize,
            api.aclnnArgMaxGetWorkspaceSize,
        );
        self.pending = true;
        self.ops
            .call(
                "aclnnCast",
                api.aclnnCast,
                &[
                    Arg::input("self", 0, &logits.buf().mem, tview(logits.dtype(), l)),
                    Arg::output("out", 0, y, f32v.clone()),
                ],
                &[npu_ffi::types::ACL_FLOAT as i64],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    pc(ts[0].raw(), npu_ffi::types::ACL_FLOAT, ts[1].raw(), w, e)
                }),
            )
            .map_err(err)?;
        self.ops
            .call(
                "aclnnNanToNum",
                api.aclnnNanToNum,
                &[
                    Arg::input("self", 0, y, f32v.clone()),
                    Arg::output("out", 0, x, f32v.clone()),
                ],
                &[],
                &[f32::NEG_INFINITY, f32::MAX, f32::NEG_INFINITY],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    pn(
                        ts[0].raw(),
                        f32::NEG_INFINITY,
                        f32::MAX,
                        f32::NEG_INFINITY,
                        ts[1].raw(),
                        w,
                        e,
                    )
                }),
            )
            .map_err(err)?;
        self.ops
            .call(
                "aclnnArgMax",
                api.aclnnArgMax,
                &[
                    Arg::input("self", 0, x, f32v),
                    Arg::output(
                        "out",
                        0,
                        self.scratch.get("argmax"),
                        TView::contiguous(tensor::DType::I64, &[rows as i64]),
                    ),
                ],
                &[1],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    pa(ts[0].raw(), 1, false, ts[1].raw(), w, e)
                }),
            )
            .map_err(err)?;
        self.picked = Some(key);
        Ok(())
    }

    /// One value per row of a `rows`-row output view: down a column or along a row.
    fn per_row(
        op: &'static str,
        ol: npu_backend::Layout,
        rows: usize,
        dt: tensor::DType,
    ) -> Result<TView, BackendError> {
        if ol.elements() != rows || (ol.rows() != rows && ol.rows() != 1) {
            return Err(bad(
                op,
                format!("{}x{} out for {rows} rows", ol.rows(), ol.cols()),
            ));
        }
        let stride = if ol.rows() == rows && rows > 1 {
            ol.stride()
        } else {
            1
        };
        Ok(TView::strided(
            dt,
            &[rows as i64],
            &[stride as i64],
            ol.offset() as i64,
        ))
    }

    pub(super) fn op_argmax(
        &mut self,
        logits: View<'_, AscendBuffer>,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "argmax_rows";
        if out.dtype() != DType::I32 {
            return Err(bad(op, format!("out is {}, not i32", out.dtype().name())));
        }
        let rows = logits.layout().rows();
        let ov = Self::per_row(op, out.layout(), rows, tensor::DType::I32)?;
        if rows == 0 {
            return Ok(());
        }
        self.pick(op, &logits)?;
        let api = self.dev.acl.api.ops;
        let pc = api.aclnnCastGetWorkspaceSize;
        self.ops
            .call(
                "aclnnCast",
                api.aclnnCast,
                &[
                    Arg::input(
                        "self",
                        0,
                        self.scratch.get("argmax"),
                        TView::contiguous(tensor::DType::I64, &[rows as i64]),
                    ),
                    Arg::output("out", 0, &out.buf().mem, ov),
                ],
                &[npu_ffi::types::ACL_INT32 as i64],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    pc(ts[0].raw(), npu_ffi::types::ACL_INT32, ts[1].raw(), w, e)
                }),
            )
            .map_err(err)
    }

    /// The log-probability of each row's greedy pick: LogSoftmax over the sanitized f32 rows,
    /// gathered at the pick; a row with nothing finite (NaN there) is uniform, −ln(cols).
    pub(super) fn op_argmax_logprob(
        &mut self,
        logits: View<'_, AscendBuffer>,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "argmax_logprob_rows";
        if out.dtype() != DType::F32 {
            return Err(bad(op, format!("out is {}, not f32", out.dtype().name())));
        }
        let (rows, cols) = (logits.layout().rows(), logits.layout().cols());
        let ov = Self::per_row(op, out.layout(), rows, tensor::DType::F32)?;
        if rows == 0 {
            return Ok(());
        }
        self.pick(op, &logits)?;
        let f32v = TView::contiguous(tensor::DType::F32, &[rows as i64, cols as i64]);
        let (x, y) = (self.scratch.get("pick_x"), self.scratch.get("pick_y"));
        let api = self.dev.acl.api.ops;
        let (pl, pg, pn) = (
            api.aclnnLogSoftmaxGetWorkspaceSize,
            api.aclnnGatherGetWorkspaceSize,
            api.aclnnNanToNumGetWorkspaceSize,
        );
        self.ops
            .call(
                "aclnnLogSoftmax",
                api.aclnnLogSoftmax,
                &[
                    Arg::input("self", 0, x, f32v.clone()),
                    Arg::output("out", 0, y, f32v),
                ],
                &[1],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe { pl(ts[0].raw(), 1, ts[1].raw(), w, e) }),
            )
            .map_err(err)?;
        let col = |v: TView| TView {
            dims: vec![rows as i64, 1],
            strides: vec![v.strides[0], 1],
            ..v
        };
        self.ops
            .call(
                "aclnnGather",
                api.aclnnGather,
                &[
                    Arg::input(
                        "self",
                        0,
                        y,
                        TView::contiguous(tensor::DType::F32, &[rows as i64, cols as i64]),
                    ),
                    Arg::input(
                        "index",
                        1,
                        self.scratch.get("argmax"),
                        TView::contiguous(tensor::DType::I64, &[rows as i64, 1]),
                    ),
                    Arg::output("out", 0, &out.buf().mem, col(ov.clone())),
                ],
                &[1],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    pg(ts[0].raw(), 1, ts[1].raw(), ts[2].raw(), w, e)
                }),
            )
            .map_err(err)?;
        let uniform = -(cols as f32).ln();
        self.ops
            .call(
                "aclnnNanToNum",
                api.aclnnNanToNum,
                &[
                    Arg::fixed("self", &out.buf().mem, col(ov.clone())),
                    Arg::fixed("out", &out.buf().mem, col(ov)),
                ],
                &[],
                &[uniform, 0.0, f32::NEG_INFINITY],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    pn(
                        ts[0].raw(),
                        uniform,
                        0.0,
                        f32::NEG_INFINITY,
                        ts[1].raw(),
                        w,
                        e,
                    )
                }),
            )
            .map_err(err)
    }
}

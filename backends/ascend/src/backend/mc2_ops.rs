//! A row-parallel projection and its all-reduce as one operator: aclnnMatmulAllReduce (`output
//! = AllReduce(x1 @ x2)` over the HCCL communicator named `group`, vllm-ascend's fused form of
//! the attention output and FFN down products under tensor parallelism), where its page's limits
//! hold: f16/bf16 activations of the weight's type, contiguous rows, at least one row, a dense
//! (not quantized) matrix, reduceOp "sum", commTurn 0, streamMode 1, no bias; Atlas A2 (the page
//! marks A3 unsupported). Otherwise — a release without the operator, quantized weights (their
//! WeightQuantBatchMatmulV2 product stays a separate call: aclnnWeightQuantMatmulAllReduce is not
//! built), strided views — the caller runs `matmul` then `HcclAllReduce`.
//!
//! On Atlas A2 the operator is not deterministic unless `HCCL_DETERMINISTIC=true` (its page);
//! every rank still receives the same sum. Only the strict emulation has run it.

use std::ffi::CStr;

use npu_backend::{BackendError, DType, View, ViewMut};

use super::layer_ops::{dense, tview};
use super::objects::{AscendBuffer, AscendMatrix, MatrixForm};
use super::{err, AscendBackend};
use crate::reuse::Arg;

impl AscendBackend {
    /// Whether [`Self::op_matmul_all_reduce`] takes this case (else the two calls).
    pub(super) fn fuses_matmul_all_reduce(
        &self,
        x: &View<'_, AscendBuffer>,
        w: &AscendMatrix,
        out: &ViewMut<'_, AscendBuffer>,
    ) -> bool {
        let api = self.dev.acl.api.ops;
        let (xl, ol) = (x.layout(), out.layout());
        api.aclnnMatmulAllReduceGetWorkspaceSize.is_some()
            && api.aclnnMatmulAllReduce.is_some()
            && matches!(w.form, MatrixForm::Half { .. })
            && matches!(self.act, DType::F16 | DType::BF16)
            && x.dtype() == self.act
            && out.dtype() == self.act
            && w.half == self.act_t()
            && xl.rows() > 0
            && xl.rows() == ol.rows()
            && xl.cols() == w.k
            && ol.cols() == w.n
            && dense(xl)
            && dense(ol)
    }

    /// `out = AllReduce(x . w)` over the communicator named `group`, one aclnnMatmulAllReduce
    /// launch on the backend's stream. The caller checks [`Self::fuses_matmul_all_reduce`]; a
    /// case outside it is refused naming the operator.
    pub(super) fn op_matmul_all_reduce(
        &mut self,
        x: View<'_, AscendBuffer>,
        w: &AscendMatrix,
        mut out: ViewMut<'_, AscendBuffer>,
        group: &CStr,
    ) -> Result<(), BackendError> {
        let op = "aclnnMatmulAllReduce";
        if !self.fuses_matmul_all_reduce(&x, w, &out) {
            return Err(BackendError::BadArgument {
                op: "matmul_all_reduce_sum",
                message: format!(
                    "{op} does not take this case (release without it, quantized weights, strided or empty rows, or activations other than f16/bf16)"
                ),
            });
        }
        let api = self.dev.acl.api.ops;
        let (Some(prep), Some(launch)) = (
            api.aclnnMatmulAllReduceGetWorkspaceSize,
            api.aclnnMatmulAllReduce,
        ) else {
            unreachable!("checked by fuses_matmul_all_reduce");
        };
        let MatrixForm::Half { data } = &w.form else {
            unreachable!("checked by fuses_matmul_all_reduce");
        };
        let (xl, ol) = (x.layout(), out.layout());
        self.bind()?;
        self.picked = None;
        self.pending = true;
        out.buf_mut().half = None;
        let sum = c"sum";
        self.ops
            .call(
                op,
                launch,
                &[
                    Arg::input("x1", 0, &x.buf().mem, tview(x.dtype(), xl)),
                    Arg::input("x2", 1, data, w.weight_view()),
                    Arg::output("output", 0, &out.buf().mem, tview(out.dtype(), ol)),
                ],
                &[],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher; a null bias
                // (optional); `group` and "sum" are NUL-terminated and outlive the call.
                Box::new(move |ts, _, ws, e| unsafe {
                    prep(
                        ts[0].raw(),
                        ts[1].raw(),
                        std::ptr::null(),
                        group.as_ptr(),
                        sum.as_ptr(),
                        0,
                        1,
                        ts[2].raw(),
                        ws,
                        e,
                    )
                }),
            )
            .map_err(err)
    }
}

//! A row-parallel projection and its all-reduce as one operator: aclnnMatmulAllReduce (`output
//! = AllReduce(x1 @ x2)` over the HCCL communicator named `group`, vllm-ascend's fused form of
//! the attention output and FFN down products under tensor parallelism), where its page's limits
//! hold: f16/bf16 activations, contiguous rows, at least one row, reduceOp "sum", commTurn 0,
//! streamMode 1, no bias; Atlas A2 (the pages mark A3 unsupported). A dense matrix of the
//! activations' type takes aclnnMatmulAllReduce; a quantized one (WeightQuantBatchMatmulV2's
//! form: INT8/INT4, per-group antiquant scale and offset) aclnnWeightQuantMatmulAllReduce, when k
//! and n are within its [1, 65535] and the 8-bit activation path is off. Otherwise — a release
//! without the operator, wider matrices, strided views, `q8_activations` — the caller runs
//! `matmul` then `HcclAllReduce`.
//!
//! On Atlas A2 the operator is not deterministic unless `HCCL_DETERMINISTIC=true` (its page);
//! every rank still receives the same sum. Only the strict emulation has run it.

use std::ffi::CStr;

use npu_backend::{BackendError, DType, View, ViewMut};

use super::layer_ops::{dense, tview};
use super::objects::{AscendBuffer, AscendMatrix, MatrixForm, WQBMM_MAX_DIM};
use super::{err, AscendBackend};
use crate::reuse::Arg;
use crate::weights::GROUP;

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
        let has_op = match w.form {
            MatrixForm::Half { .. } => {
                api.aclnnMatmulAllReduceGetWorkspaceSize.is_some()
                    && api.aclnnMatmulAllReduce.is_some()
                    && w.half == self.act_t()
            }
            // One WeightQuantBatchMatmulV2-shaped call (k and n within its page's range), on
            // the activations as they are (the 8-bit activation path keeps the two calls).
            MatrixForm::Quant { .. } => {
                api.aclnnWeightQuantMatmulAllReduceGetWorkspaceSize
                    .is_some()
                    && api.aclnnWeightQuantMatmulAllReduce.is_some()
                    && !self.cfg.q8_activations
                    && w.n <= WQBMM_MAX_DIM
                    && w.k <= WQBMM_MAX_DIM
            }
        };
        // Not on an Atlas A3 (its pages; an unknown SoC is taken for one that has them).
        has_op
            && !self.dev.acl.is_atlas_a3()
            && matches!(self.act, DType::F16 | DType::BF16)
            && x.dtype() == self.act
            && out.dtype() == self.act
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
                    "{op} does not take this case (release without it, an Atlas A3 SoC, quantized weights, strided or empty rows, or activations other than f16/bf16)"
                ),
            });
        }
        self.bind()?;
        self.picked = None;
        self.pending = true;
        out.buf_mut().half = None;
        if let MatrixForm::Quant { .. } = &w.form {
            return self.op_wq_matmul_all_reduce(x, w, out, group);
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

    /// The quantized form: aclnnWeightQuantMatmulAllReduce with WeightQuantBatchMatmulV2's
    /// arguments (the INT8/INT4 weight as its transposed (k, n) view, the per-group antiquant
    /// scale and optional offset, `antiquantGroupSize` GROUP) and the group's.
    fn op_wq_matmul_all_reduce(
        &mut self,
        x: View<'_, AscendBuffer>,
        w: &AscendMatrix,
        out: ViewMut<'_, AscendBuffer>,
        group: &CStr,
    ) -> Result<(), BackendError> {
        let op = "aclnnWeightQuantMatmulAllReduce";
        let api = self.dev.acl.api.ops;
        let (Some(prep), Some(launch)) = (
            api.aclnnWeightQuantMatmulAllReduceGetWorkspaceSize,
            api.aclnnWeightQuantMatmulAllReduce,
        ) else {
            unreachable!("checked by fuses_matmul_all_reduce");
        };
        let MatrixForm::Quant {
            weight,
            scale,
            offset,
            ..
        } = &w.form
        else {
            unreachable!("checked by op_matmul_all_reduce");
        };
        let (xl, ol) = (x.layout(), out.layout());
        let mut args = vec![
            Arg::input("x1", 0, &x.buf().mem, tview(x.dtype(), xl)),
            Arg::input("x2", 1, weight, w.weight_view()),
            Arg::input("antiquantScale", 2, scale, w.group_cols(0..w.n)),
        ];
        if let Some(o) = offset {
            args.push(Arg::input("antiquantOffset", 3, o, w.group_cols(0..w.n)));
        }
        args.push(Arg::output(
            "output",
            0,
            &out.buf().mem,
            tview(out.dtype(), ol),
        ));
        let has_offset = offset.is_some();
        let sum = c"sum";
        self.ops
            .call(
                op,
                launch,
                &args,
                &[GROUP as i64],
                &[],
                // SAFETY (closure): live tensors (or null optionals) and out-pointers from the
                // launcher; `group` and "sum" are NUL-terminated and outlive the call.
                Box::new(move |ts, _, ws, e| unsafe {
                    let (off, y) = if has_offset {
                        (ts[3].raw() as *const _, ts[4].raw())
                    } else {
                        (std::ptr::null(), ts[3].raw())
                    };
                    prep(
                        ts[0].raw(),
                        ts[1].raw(),
                        std::ptr::null(),
                        ts[2].raw(),
                        off,
                        std::ptr::null(),
                        group.as_ptr(),
                        sum.as_ptr(),
                        0,
                        1,
                        GROUP as i64,
                        y,
                        ws,
                        e,
                    )
                }),
            )
            .map_err(err)
    }
}

//! Mixture-of-experts routing and the routed experts' SwiGLU FFN ([`Capability::Moe`],
//! Qwen3-MoE), as documented aclnn calls on the agent's stream.
//!
//! `moe_route(logits, k, normalize, ids, weights)`:
//! 1. Cast: the f16 router logits to an f32 scratch (MoeGatingTopKSoftmaxV2's yOut has x's type,
//!    and the weights are f32).
//! 2. MoeGatingTopKSoftmaxV2(x, null, k, renorm, false, yOut = weights, expertIdxOut = ids,
//!    null). Without normalisation, renorm 0: softmax over the experts, then the k most probable.
//!    With it, renorm 1: the k largest logits, then softmax over those k — which is
//!    `p_j / Σ_chosen p` exactly (the other experts' exponentials cancel). ggml clamps that sum
//!    at 6.103515625e-5 before dividing; the sum of the k largest of E probabilities is at least
//!    k/E, so the clamp cannot bind while E ≤ 8192·k, which is checked (more experts are
//!    refused rather than computed without the clamp).
//!
//! `moe_ffn(x, ids, weights, gate_up, down, ff, out)`:
//! 1. The ids are read back (one stream synchronization; t·k INT32 values) and the host lays out
//!    the grouping: the (token, slot) pairs of expert 0, then of expert 1, …, each in token
//!    order; `src[p]` is the token of grouped row p and `dst[r·k + j]` the grouped row of token
//!    r's slot j (aclnnMoeInitRoutingV2's expandedRowIdx, row order). Both go up in one copy.
//! 2. Embedding (x as the table, `src` as indices): the grouped rows, contiguous per expert.
//! 3. Gate and up of every expert in one GroupedMatmulV4 call (groupType 0, the grouped rows as
//!    one x, the experts' f16 weights as a list, each its (n, k) storage seen transposed, one
//!    out; groupListType 0 with the cumulative row counts, uploaded with the indices) when every
//!    expert is in the f16 form and there are at most 128; otherwise each expert with rows over
//!    its rows (WeightQuantBatchMatmulV2 or Matmul, the backend's `matmul`).
//! 4. SwiGlu over all grouped rows in one call.
//! 5. Down, the same way.
//! 6. Cast: the routing weights to f16 (MoeFinalizeRoutingV2's scales must have expandedX's type
//!    unless expandedX is BFLOAT16).
//! 7. MoeFinalizeRoutingV2(expandedX = expert outputs, expandedRowIdx = dst, scales = weights,
//!    dropPadMode 2): `out[r] = Σ_j w[r][j] · y[dst[r·k + j]]`, the slots in order.
//!
//! Quantized experts (INT8/INT4 with a scale per 32 inputs, each expert its own allocation)
//! stay one call per active expert and projection: GroupedMatmulV4's page takes quantized
//! weights with f16 activations (A16W8 / A16W4) only as one stacked (E, K, N) weight tensor, and
//! A16W8 only with per-channel scales. The ids are still read back once a layer (the grouping is
//! planned on the host); MoeInitRoutingV2 (grouping on the device, no read-back) is not used yet.

use npu_backend::moe::{check_expert_shapes, ExpertGroups};
use npu_backend::{
    Backend, BackendError, DType, DeviceBuffer as _, HostSliceMut, Readback, View, ViewMut,
};

use super::layer_ops::{bad, dense, gather, tview, want_f16};
use super::objects::{AscendBuffer, AscendMatrix, MatrixForm};
use super::{err, AscendBackend};
use crate::memory::DeviceBuffer as Mem;
use crate::reuse::{Arg, Launcher};
use crate::tensor::{self, View as TView};

/// ggml's floor of the chosen weights' sum (see the module note on why it cannot bind).
const MIN_SUM: f64 = 6.103_515_625e-5;
/// Where the second index array starts in the index buffer: 32-byte aligned.
const ALIGN_I32: usize = 8;
/// The most weight tensors GroupedMatmulV4 takes in a list ("最多128个tensor").
const GMM_MAX_LIST: usize = 128;

/// The device buffers of `moe_ffn`, grown on demand and kept across layers and steps.
#[derive(Default)]
pub(super) struct MoeBufs {
    idx: Option<AscendBuffer>,
    xs: Option<AscendBuffer>,
    gu: Option<AscendBuffer>,
    act: Option<AscendBuffer>,
    y: Option<AscendBuffer>,
}

/// `dst = cast(src)` between float types (aclnnCast).
fn cast(
    ops: &mut Launcher,
    src: (&Mem, TView),
    dst: (&Mem, TView),
    to: npu_ffi::types::aclDataType,
) -> Result<(), BackendError> {
    let api = ops.runner.acl().api.ops;
    let pc = api.aclnnCastGetWorkspaceSize;
    ops.call(
        "aclnnCast",
        api.aclnnCast,
        &[
            Arg::input("self", 0, src.0, src.1),
            Arg::output("out", 0, dst.0, dst.1),
        ],
        &[to as i64],
        &[],
        // SAFETY (closure): live tensors and out-pointers from the launcher.
        Box::new(move |ts, _, w, e| unsafe { pc(ts[0].raw(), to, ts[1].raw(), w, e) }),
    )
    .map_err(err)
}

impl AscendBackend {
    /// `slot` holding at least `len` values of `dtype` (a smaller one is replaced; callers do
    /// this right after a synchronization, so the drop's wait costs nothing).
    fn fit<'a>(
        &self,
        slot: &'a mut Option<AscendBuffer>,
        dtype: DType,
        len: usize,
    ) -> Result<&'a mut AscendBuffer, BackendError> {
        if slot.as_ref().is_none_or(|b| b.len() < len) {
            *slot = None;
            *slot = Some(AscendBuffer::new(
                &self.dev,
                dtype,
                len.max(1).next_power_of_two(),
            )?);
        }
        Ok(slot.as_mut().expect("just filled"))
    }

    pub(super) fn op_moe_route(
        &mut self,
        logits: View<'_, AscendBuffer>,
        k: usize,
        normalize: bool,
        ids: ViewMut<'_, AscendBuffer>,
        weights: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "moe_route";
        let (ll, il, wl) = (logits.layout(), ids.layout(), weights.layout());
        want_f16(op, "logits", logits.dtype())?;
        if ids.dtype() != DType::I32 || weights.dtype() != DType::F32 {
            return Err(bad(
                op,
                format!(
                    "ids {} and weights {}: INT32 and f32 expected",
                    ids.dtype().name(),
                    weights.dtype().name()
                ),
            ));
        }
        let (t, ne) = (ll.rows(), ll.cols());
        if il.rows() != t || il.cols() != k || wl.rows() != t || wl.cols() != k {
            return Err(bad(
                op,
                format!(
                    "{t}x{ne} logits with ids {}x{} and weights {}x{} for k = {k}",
                    il.rows(),
                    il.cols(),
                    wl.rows(),
                    wl.cols()
                ),
            ));
        }
        if k == 0 || k > ne || k > 1024 {
            return Err(bad(
                op,
                format!("k = {k} of {ne} experts (MoeGatingTopKSoftmaxV2: 0 < k <= E, k <= 1024)"),
            ));
        }
        if normalize && (k as f64) / (ne as f64) < 2.0 * MIN_SUM {
            return Err(bad(
                op,
                format!(
                    "{ne} experts for k = {k}: the normalised weights' floor of {MIN_SUM} could \
                     bind, which renorm 1 does not apply"
                ),
            ));
        }
        if !dense(il) || !dense(wl) {
            return Err(bad(
                op,
                "ids and weights must be dense rows (the operator's outputs do not support \
                 non-contiguous tensors)",
            ));
        }
        if t == 0 {
            return Ok(());
        }
        let api = self.dev.acl.api.ops;
        let (Some(pg), Some(lg)) = (
            api.aclnnMoeGatingTopKSoftmaxV2GetWorkspaceSize,
            api.aclnnMoeGatingTopKSoftmaxV2,
        ) else {
            return Err(self.missing("expert routing (aclnnMoeGatingTopKSoftmaxV2)"));
        };
        self.pending = true;
        self.scratch.ensure(&self.dev, "moe_logits", t * ne * 4)?;
        let f32v = TView::contiguous(tensor::DType::F32, &[t as i64, ne as i64]);
        let s = self.scratch.get("moe_logits");
        cast(
            &mut self.ops,
            (&logits.buf().mem, tview(DType::F16, ll)),
            (s, f32v.clone()),
            npu_ffi::types::ACL_FLOAT,
        )?;
        let (kk, renorm) = (k as i64, i64::from(normalize));
        self.ops
            .call(
                "aclnnMoeGatingTopKSoftmaxV2",
                lg,
                &[
                    Arg::input("x", 0, s, f32v),
                    Arg::output("yOut", 0, &weights.buf().mem, tview(DType::F32, wl)),
                    Arg::output("expertIdxOut", 1, &ids.buf().mem, tview(DType::I32, il)),
                ],
                &[kk, renorm],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher; the
                // optional finished mask and softmax output are absent (null).
                Box::new(move |ts, _, w, e| unsafe {
                    pg(
                        ts[0].raw(),
                        std::ptr::null(),
                        kk,
                        renorm,
                        false,
                        ts[1].raw(),
                        ts[2].raw(),
                        std::ptr::null(),
                        w,
                        e,
                    )
                }),
            )
            .map_err(err)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_moe_ffn(
        &mut self,
        x: View<'_, AscendBuffer>,
        ids: View<'_, AscendBuffer>,
        weights: View<'_, AscendBuffer>,
        gate_up: &[AscendMatrix],
        down: &[AscendMatrix],
        ff: usize,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "moe_ffn";
        let (xl, il, wl, ol) = (x.layout(), ids.layout(), weights.layout(), out.layout());
        want_f16(op, "x", x.dtype())?;
        want_f16(op, "out", out.dtype())?;
        let (t, h, k) = (xl.rows(), xl.cols(), il.cols());
        if ids.dtype() != DType::I32 || weights.dtype() != DType::F32 {
            return Err(bad(op, "ids must be INT32 and weights f32"));
        }
        if il.rows() != t || wl.rows() != t || wl.cols() != k || ol.rows() != t || ol.cols() != h {
            return Err(bad(
                op,
                format!(
                    "x {t}x{h}, ids {}x{k}, weights {}x{}, out {}x{}",
                    il.rows(),
                    wl.rows(),
                    wl.cols(),
                    ol.rows(),
                    ol.cols()
                ),
            ));
        }
        if !dense(ol) {
            return Err(bad(
                op,
                "out must be dense rows (MoeFinalizeRoutingV2's out)",
            ));
        }
        check_expert_shapes(
            op,
            gate_up.iter().map(|m| (m.k, m.n)),
            down.iter().map(|m| (m.k, m.n)),
            h,
            ff,
        )?;
        if t == 0 || k == 0 {
            return Ok(());
        }
        let api = self.dev.acl.api.ops;
        let (Some(pf), Some(lf)) = (
            api.aclnnMoeFinalizeRoutingV2GetWorkspaceSize,
            api.aclnnMoeFinalizeRoutingV2,
        ) else {
            return Err(self.missing("the experts' weighted sum (aclnnMoeFinalizeRoutingV2)"));
        };
        // 1. The grouping, from the ids.
        let mut host = vec![0i32; t * k];
        self.read_back(&mut [Readback {
            src: View::new(ids.buf(), il)?,
            dst: HostSliceMut::I32(&mut host),
        }])?;
        let groups = ExpertGroups::plan(op, &host, k, gate_up.len())?;
        let tk = t * k;
        let dst_at = tk.next_multiple_of(ALIGN_I32);
        // The group list (GroupedMatmulV4's groupListOptional, INT64 cumulative row counts)
        // after the two index arrays, 32-byte aligned, as pairs of INT32 words.
        let gl_at = (dst_at + tk).next_multiple_of(ALIGN_I32);
        let mut index = vec![0i32; gl_at + 2 * groups.counts.len()];
        index[..tk].copy_from_slice(&groups.rows);
        index[dst_at..dst_at + tk].copy_from_slice(&groups.pos);
        let mut end = 0i64;
        for (e, &c) in groups.counts.iter().enumerate() {
            end += c as i64;
            let b = end.to_le_bytes();
            index[gl_at + 2 * e] = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            index[gl_at + 2 * e + 1] = i32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        }
        let (counts, starts) = (groups.counts, groups.starts);
        let mut bufs = std::mem::take(&mut self.moe);
        let r = self.moe_ffn_grouped(
            &mut bufs,
            (&x, &weights, out),
            (gate_up, down),
            (&counts, &starts),
            (&index, dst_at, gl_at, k, ff),
            (pf, lf),
        );
        self.moe = bufs;
        r
    }

    #[allow(clippy::type_complexity)]
    fn moe_ffn_grouped(
        &mut self,
        bufs: &mut MoeBufs,
        (x, weights, out): (
            &View<'_, AscendBuffer>,
            &View<'_, AscendBuffer>,
            ViewMut<'_, AscendBuffer>,
        ),
        (gate_up, down): (&[AscendMatrix], &[AscendMatrix]),
        (counts, starts): (&[usize], &[usize]),
        (index, dst_at, gl_at, k, ff): (&[i32], usize, usize, usize, usize),
        (pf, lf): (
            npu_ffi::aclnn::ops::sig::aclnnMoeFinalizeRoutingV2GetWorkspaceSize,
            npu_ffi::aclnn::ops::sig::aclnnMoeFinalizeRoutingV2,
        ),
    ) -> Result<(), BackendError> {
        let (xl, wl, ol) = (x.layout(), weights.layout(), out.layout());
        let (t, h) = (xl.rows(), xl.cols());
        let tk = t * k;
        // Nothing is queued here (the read-back synchronized): buffers grow and the indices go
        // up with plain copies.
        let bytes: Vec<u8> = index.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.fit(&mut bufs.idx, DType::I32, index.len())?
            .mem
            .upload(0, &bytes)
            .map_err(err)?;
        self.fit(&mut bufs.xs, DType::F16, tk * h)?;
        self.fit(&mut bufs.gu, DType::F16, tk * 2 * ff)?;
        self.fit(&mut bufs.act, DType::F16, tk * ff)?;
        self.fit(&mut bufs.y, DType::F16, tk * h)?;
        let (Some(idx), Some(xs), Some(gu), Some(act), Some(y)) = (
            bufs.idx.as_ref(),
            bufs.xs.as_mut(),
            bufs.gu.as_mut(),
            bufs.act.as_mut(),
            bufs.y.as_mut(),
        ) else {
            unreachable!("every buffer was just fitted");
        };
        self.pending = true;
        // 2. The grouped rows.
        gather(
            &mut self.ops,
            (&x.buf().mem, tview(DType::F16, xl)),
            (
                &idx.mem,
                TView::strided(tensor::DType::I32, &[tk as i64], &[1], 0),
            ),
            (
                &xs.mem,
                TView::contiguous(tensor::DType::F16, &[tk as i64, h as i64]),
            ),
        )?;
        let active: Vec<(usize, usize, usize)> = (0..counts.len())
            .filter(|&e| counts[e] > 0)
            .map(|e| (e, starts[e], counts[e]))
            .collect();
        let group_list = (
            &idx.mem,
            TView::strided(
                tensor::DType::I64,
                &[counts.len() as i64],
                &[1],
                (gl_at / 2) as i64,
            ),
        );
        let grouped = self.grouped_form(gate_up) && self.grouped_form(down);
        // 3. Gate and up: every expert in one GroupedMatmulV4 call, or each over its rows.
        if grouped {
            self.grouped_matmul(
                gate_up,
                (&xs.mem, tk, h),
                (&gu.mem, 2 * ff),
                group_list.clone(),
            )?;
        } else {
            let xv = View::rows(&*xs, tk, h)?;
            let mut gv = ViewMut::rows(gu, tk, 2 * ff)?;
            for &(e, s, n) in &active {
                self.op_matmul(xv.row_range(s, n)?, &gate_up[e], gv.row_range(s, n)?)?;
            }
        }
        // 4. SwiGLU over every grouped row at once.
        {
            let gv = View::rows(&*gu, tk, 2 * ff)?;
            self.op_swiglu(
                gv.col_range(0, ff)?,
                gv.col_range(ff, ff)?,
                ViewMut::rows(act, tk, ff)?,
            )?;
        }
        // 5. Down: one GroupedMatmulV4 call, or each expert over its rows.
        if grouped {
            self.grouped_matmul(down, (&act.mem, tk, ff), (&y.mem, h), group_list)?;
        } else {
            let av = View::rows(&*act, tk, ff)?;
            let mut yv = ViewMut::rows(y, tk, h)?;
            for &(e, s, n) in &active {
                self.op_matmul(av.row_range(s, n)?, &down[e], yv.row_range(s, n)?)?;
            }
        }
        // 6. The weights in f16.
        self.scratch.ensure(&self.dev, "moe_w16", tk * 2)?;
        let w16v = TView::contiguous(tensor::DType::F16, &[t as i64, k as i64]);
        let w16 = self.scratch.get("moe_w16");
        cast(
            &mut self.ops,
            (&weights.buf().mem, tview(DType::F32, wl)),
            (w16, w16v.clone()),
            npu_ffi::types::ACL_FLOAT16,
        )?;
        // 7. The weighted sum back in token order.
        self.ops
            .call(
                "aclnnMoeFinalizeRoutingV2",
                lf,
                &[
                    Arg::input(
                        "expandedX",
                        0,
                        &y.mem,
                        TView::contiguous(tensor::DType::F16, &[tk as i64, h as i64]),
                    ),
                    Arg::input(
                        "expandedRowIdx",
                        1,
                        &idx.mem,
                        TView::strided(tensor::DType::I32, &[tk as i64], &[1], dst_at as i64),
                    ),
                    Arg::input("scalesOptional", 5, w16, w16v),
                    Arg::output("out", 0, &out.buf().mem, tview(DType::F16, ol)),
                ],
                &[2],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher; x1, x2,
                // bias and expertIdx are absent (null); dropPadMode 2 = drop-less, row order.
                Box::new(move |ts, _, w, e| unsafe {
                    pf(
                        ts[0].raw(),
                        ts[1].raw(),
                        std::ptr::null(),
                        std::ptr::null(),
                        std::ptr::null(),
                        ts[2].raw(),
                        std::ptr::null(),
                        2,
                        ts[3].raw(),
                        w,
                        e,
                    )
                }),
            )
            .map_err(err)
    }
    /// Whether one GroupedMatmulV4 call can take `mats` (one projection of every expert): the
    /// f16 (`Half`) form, at most [`GMM_MAX_LIST`] experts, and the operator present. Its page
    /// takes quantized weights (A16W8 / A16W4) only as one stacked (E, K, N) tensor with
    /// per-channel scales (A16W8), while this backend keeps each expert apart with a scale per
    /// 32 inputs: those experts stay one call each.
    fn grouped_form(&self, mats: &[AscendMatrix]) -> bool {
        let api = self.dev.acl.api.ops;
        api.aclnnGroupedMatmulV4GetWorkspaceSize.is_some()
            && api.aclnnGroupedMatmulV4.is_some()
            && mats.len() <= GMM_MAX_LIST
            && mats
                .iter()
                .all(|m| matches!(m.form, MatrixForm::Half { .. }) && m.half == tensor::DType::F16)
    }

    /// `y = x · W_e` for each expert's group of rows in one GroupedMatmulV4 call: x one f16
    /// (rows, k) tensor, the experts' (k, n) weights a list (each its (n, k) storage seen
    /// transposed), y one (rows, n) tensor; groupType 0 (m-axis), splitItem 3 (one out tensor),
    /// groupListType 0 (`group_list` the cumulative row counts, one per expert), actType 0.
    fn grouped_matmul(
        &mut self,
        mats: &[AscendMatrix],
        (xm, rows, kin): (&Mem, usize, usize),
        (ym, n): (&Mem, usize),
        (gm, gv): (&Mem, TView),
    ) -> Result<(), BackendError> {
        let api = self.dev.acl.api.ops;
        let (Some(prep), Some(launch)) = (
            api.aclnnGroupedMatmulV4GetWorkspaceSize,
            api.aclnnGroupedMatmulV4,
        ) else {
            return Err(self.missing("grouped expert matmuls (aclnnGroupedMatmulV4)"));
        };
        let acl = self.dev.acl;
        let f16 = tensor::DType::F16;
        let t = |m: &Mem, v: TView| tensor::Tensor::new(acl, m, v).map_err(err);
        let xl = tensor::TensorList::new(
            acl,
            vec![t(xm, TView::contiguous(f16, &[rows as i64, kin as i64]))?],
        )
        .map_err(err)?;
        let mut ws = Vec::with_capacity(mats.len());
        for m in mats {
            let MatrixForm::Half { data } = &m.form else {
                unreachable!("grouped_form checked every expert is Half");
            };
            ws.push(t(data, m.weight_view())?);
        }
        let wl = tensor::TensorList::new(acl, ws).map_err(err)?;
        let yl = tensor::TensorList::new(
            acl,
            vec![t(ym, TView::contiguous(f16, &[rows as i64, n as i64]))?],
        )
        .map_err(err)?;
        let g = t(gm, gv)?;
        let detail = format!(
            "x=({rows},{kin}) weight={}x({kin},{n})T out=({rows},{n}) groupType=0 splitItem=3 \
             groupListType=0",
            mats.len()
        );
        let null = std::ptr::null::<npu_ffi::types::aclTensorList>();
        self.ops
            .runner
            .call(
                "aclnnGroupedMatmulV4",
                detail,
                // SAFETY (closure): live lists and group-list tensor (held across the call),
                // null optionals, and the runner's out-pointers.
                |w, e| unsafe {
                    prep(
                        xl.raw(),
                        wl.raw(),
                        null,
                        null,
                        null,
                        null,
                        null,
                        null,
                        g.raw(),
                        null,
                        null,
                        null,
                        3,
                        0,
                        0,
                        0,
                        yl.raw() as *mut _,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        w,
                        e,
                    )
                },
                launch,
            )
            .map_err(err)
    }
}

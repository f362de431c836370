//! The routed experts' SwiGLU FFN ([`Capability::Moe`](npu_backend::Capability::Moe)) as
//! documented aclnn calls on the agent's stream, the tokens grouped by expert on the device:
//!
//! `moe_ffn(x, ids, weights, gate_up, down, ff, out)`:
//! 1. MoeInitRoutingV2(x, ids, activeNum 0, expertCapacity 0, expertNum E, dropPadMode 0,
//!    expertTokensCountOrCumsumFlag 1): the dropless mode. expandedXOut holds the t·k rows
//!    grouped by expert (`expandedXOut[i] = x[sortedRowIdx[i] / k]`), expandedRowIdxOut maps
//!    token r's slot j (`r·k + j`) to its grouped row, and expertTokensCountOrCumsumOut (INT32)
//!    holds each expert's cumulative row count. Nothing comes back to the host.
//! 2. Gate and up of every expert in one GroupedMatmulV4 call when every expert takes the same
//!    grouped form (below): groupType 0 (m-axis), the grouped rows as one x, one out,
//!    groupListType 0 with the cumulative counts cast to INT64 (aclnnCast; the operator's
//!    groupListOptional is INT64), and the weights in one of two shapes:
//!    - one 3-D tensor (E, K, N), seen transposed over the (E, n, k) stack (`moe_ops::stack`)
//!      the experts were loaded into (`load_experts`; the page's "单单单" row: at most 1024
//!      groups, no 128-tensor list). Every expert count a model has (DeepSeek-V3/R1's 256, Kimi
//!      K2's 384) is one call per projection;
//!    - or a list, each expert's own (n, k) storage seen transposed, for experts loaded apart
//!      (`load_matrix`), at most 128 (GMM_MAX_LIST, "最多128个tensor").
//!
//!    The grouped forms:
//!    - f16 (`MatrixForm::Half`): the non-quantized scenario. A stack is f16 unless every
//!      expert is Q4_0: Q8_0 and Q4_1 experts are dequantized at load, like K-quants (the page
//!      takes INT8 weights per channel only, not with a scale per 32 inputs, and per-group INT4
//!      symmetric only), at 16 bits a weight instead of 8.5 (Q8_0) or 5 (Q4_1).
//!    - Q4_0 (`MatrixForm::Quant`, INT4, no offset): the A16W4 antiquant scenario per group
//!      (symmetric, G = k/32, group length 32, even as a transposed INT4 weight needs): the INT4
//!      values are the file's quants (q − 8) and each scale the file's block scale, as
//!      WeightQuantBatchMatmulV2 takes them. The scales are held (n, k/32) for that operator;
//!      the grouped call takes them `[g, G, n]` (a stack's contiguous (E, k/32, n) copy, written
//!      at load) or, in a list, `[G_i, n_i]` each (a contiguous (k/32, n) tensor copied once per
//!      matrix on first use, aclnnInplaceCopy from the transposed view, and kept with it).
//!
//!    Otherwise (experts loaded apart that are Q8_0 or Q4_1, or more than 128 of them; more
//!    than 1024 experts, which `load_experts` loads apart; bf16 activations; mixed forms) the
//!    experts' row counts are read back (one synchronization, E INT32 values — the ids stay on
//!    the device) and each expert with rows runs over its rows (the backend's `matmul`). More
//!    than 1024 experts are not split into calls of 1024: each call's group list must start at
//!    its x's first row and end at its last, and where a chunk's rows start only the device
//!    knows.
//! 3. SwiGlu over all grouped rows in one call.
//! 4. Down, the same way.
//! 5. Cast: the routing weights to f16 (MoeFinalizeRoutingV2's scales must have expandedX's type
//!    unless expandedX is BFLOAT16).
//! 6. MoeFinalizeRoutingV2(expandedX = expert outputs, expandedRowIdx, scales = weights,
//!    dropPadMode 2): `out[r] = Σ_j w[r][j] · y[expandedRowIdx[r·k + j]]`, the slots in order
//!    (row order, as MoeInitRoutingV2 writes the map).
//!
//! An expert id outside `[0, E)` is MoeInitRoutingV2's fault at run time (reported at the next
//! synchronization); `moe_route` writes ids in range.

use npu_backend::moe::check_expert_shapes;
use npu_backend::{
    Backend, BackendError, DType, DeviceBuffer as _, HostSliceMut, Readback, View, ViewMut,
};

use super::super::layer_ops::{bad, copy, dense, tview, want_f16};
use super::super::objects::{zeroed, AscendBuffer, AscendMatrix, MatrixForm};
use super::super::{err, AscendBackend};
use super::cast;
use super::stack::{stack_of, GMM_MAX_GROUPS};
use crate::memory::DeviceBuffer as Mem;
use crate::reuse::Arg;
use crate::tensor::{self, View as TView};

/// Where a second INT32 array starts in the index buffer: 32-byte aligned.
const ALIGN_I32: usize = 8;
/// The most weight tensors GroupedMatmulV4 takes in a list ("最多128个tensor").
const GMM_MAX_LIST: usize = 128;

/// The device buffers of `moe_ffn`, grown on demand and kept across layers and steps.
#[derive(Default)]
pub(in crate::backend) struct MoeBufs {
    /// INT32 words: expandedRowIdx (t·k), the INT32 cumulative counts (E), the INT64 ones (2·E
    /// words), each 32-byte aligned.
    idx: Option<AscendBuffer>,
    xs: Option<AscendBuffer>,
    gu: Option<AscendBuffer>,
    act: Option<AscendBuffer>,
    y: Option<AscendBuffer>,
}

/// How one projection of every expert runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grouped {
    /// One GroupedMatmulV4 call, f16 weights.
    Half,
    /// One GroupedMatmulV4 call, INT4 weights with a symmetric scale per 32 inputs.
    Int4,
    /// One call per expert with rows.
    PerExpert,
}

/// The layout of the index buffer, in INT32 words.
struct IndexLayout {
    rows: usize,
    counts: usize,
    counts64: usize,
    words: usize,
}

impl IndexLayout {
    fn new(tk: usize, experts: usize) -> Self {
        let counts = tk.next_multiple_of(ALIGN_I32);
        let counts64 = (counts + experts).next_multiple_of(ALIGN_I32);
        Self {
            rows: 0,
            counts,
            counts64,
            words: counts64 + 2 * experts,
        }
    }
}

impl AscendBackend {
    /// `slot` holding at least `len` values of `dtype` (a smaller one is replaced and retired:
    /// queued work may still use it, so it is freed at the next synchronization).
    fn fit_buf<'a>(
        &mut self,
        slot: &'a mut Option<AscendBuffer>,
        dtype: DType,
        len: usize,
    ) -> Result<&'a mut AscendBuffer, BackendError> {
        if slot.as_ref().is_none_or(|b| b.len() < len) {
            if let Some(old) = slot.take() {
                self.retired_bufs.push(old);
            }
            *slot = Some(AscendBuffer::new(
                &self.dev,
                dtype,
                len.max(1).next_power_of_two(),
            )?);
        }
        Ok(slot.as_mut().expect("just filled"))
    }

    /// Which form one GroupedMatmulV4 call can take `mats` (one projection of every expert) in:
    /// every expert f16, or every expert symmetric INT4 with f16 scales; at most
    /// [`GMM_MAX_GROUPS`] experts of one stack (the single 3-D weight) or [`GMM_MAX_LIST`]
    /// loaded apart (a weight list), and the operator present.
    fn grouped_kind(&self, mats: &[AscendMatrix]) -> Grouped {
        let api = self.dev.acl.api.ops;
        let most = match stack_of(mats) {
            Some(_) => GMM_MAX_GROUPS,
            None => GMM_MAX_LIST,
        };
        if api.aclnnGroupedMatmulV4GetWorkspaceSize.is_none()
            || api.aclnnGroupedMatmulV4.is_none()
            || mats.len() > most
            || mats.iter().any(|m| m.half != tensor::DType::F16)
        {
            return Grouped::PerExpert;
        }
        if mats
            .iter()
            .all(|m| matches!(m.form, MatrixForm::Half { .. }))
        {
            return Grouped::Half;
        }
        let int4 = |m: &AscendMatrix| {
            matches!(
                m.form,
                MatrixForm::Quant {
                    int4: true,
                    offset: None,
                    ..
                }
            ) && m.k.is_multiple_of(crate::weights::GROUP)
        };
        if mats.iter().all(int4) {
            return Grouped::Int4;
        }
        Grouped::PerExpert
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend) fn op_moe_ffn(
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
        if api.aclnnMoeInitRoutingV2GetWorkspaceSize.is_none()
            || api.aclnnMoeInitRoutingV2.is_none()
        {
            return Err(self.missing("grouping tokens by expert (aclnnMoeInitRoutingV2)"));
        }
        if api.aclnnMoeFinalizeRoutingV2GetWorkspaceSize.is_none()
            || api.aclnnMoeFinalizeRoutingV2.is_none()
        {
            return Err(self.missing("the experts' weighted sum (aclnnMoeFinalizeRoutingV2)"));
        }
        let mut bufs = std::mem::take(&mut self.moe);
        let r = self.moe_ffn_in(&mut bufs, (&x, &ids, &weights, out), (gate_up, down), ff);
        self.moe = bufs;
        r
    }

    fn moe_ffn_in(
        &mut self,
        bufs: &mut MoeBufs,
        (x, ids, weights, out): (
            &View<'_, AscendBuffer>,
            &View<'_, AscendBuffer>,
            &View<'_, AscendBuffer>,
            ViewMut<'_, AscendBuffer>,
        ),
        (gate_up, down): (&[AscendMatrix], &[AscendMatrix]),
        ff: usize,
    ) -> Result<(), BackendError> {
        let (xl, il, wl, ol) = (x.layout(), ids.layout(), weights.layout(), out.layout());
        let (t, h, k) = (xl.rows(), xl.cols(), il.cols());
        let (ne, tk) = (gate_up.len(), t * k);
        let at = IndexLayout::new(tk, ne);
        self.fit_buf(&mut bufs.idx, DType::I32, at.words)?;
        self.fit_buf(&mut bufs.xs, DType::F16, tk * h)?;
        self.fit_buf(&mut bufs.gu, DType::F16, tk * 2 * ff)?;
        self.fit_buf(&mut bufs.act, DType::F16, tk * ff)?;
        self.fit_buf(&mut bufs.y, DType::F16, tk * h)?;
        let (Some(idx), Some(xs), Some(gu), Some(act), Some(y)) = (
            bufs.idx.as_mut(),
            bufs.xs.as_mut(),
            bufs.gu.as_mut(),
            bufs.act.as_mut(),
            bufs.y.as_mut(),
        ) else {
            unreachable!("every buffer was just fitted");
        };
        self.pending = true;
        let i32v =
            |at: usize, n: usize| TView::strided(tensor::DType::I32, &[n as i64], &[1], at as i64);
        let rows_v = i32v(at.rows, tk);
        let counts_v = i32v(at.counts, ne);
        // 1. The grouped rows, the row map and the cumulative counts.
        self.init_routing(
            (&x.buf().mem, tview(DType::F16, xl)),
            (&ids.buf().mem, tview(DType::I32, il)),
            ne,
            (
                &xs.mem,
                TView::contiguous(tensor::DType::F16, &[tk as i64, h as i64]),
            ),
            (&idx.mem, rows_v.clone()),
            (&idx.mem, counts_v.clone()),
        )?;
        let kinds = (self.grouped_kind(gate_up), self.grouped_kind(down));
        let group_list = (
            &idx.mem,
            TView::strided(
                tensor::DType::I64,
                &[ne as i64],
                &[1],
                (at.counts64 / 2) as i64,
            ),
        );
        // The row ranges of each expert, read back only when some projection runs per expert.
        let mut ranges: Vec<(usize, usize, usize)> = Vec::new();
        if kinds.0 == Grouped::PerExpert || kinds.1 == Grouped::PerExpert {
            let mut ends = vec![0i32; ne];
            let cv = View::rows(&*idx, 1, at.words)?.col_range(at.counts, ne)?;
            self.read_back(&mut [Readback {
                src: cv,
                dst: HostSliceMut::I32(&mut ends),
            }])?;
            let mut start = 0usize;
            for (e, &end) in ends.iter().enumerate() {
                let end = end as usize;
                if end > start {
                    ranges.push((e, start, end - start));
                }
                start = end;
            }
            self.pending = true;
        }
        if kinds.0 != Grouped::PerExpert || kinds.1 != Grouped::PerExpert {
            cast(
                &mut self.ops,
                (&idx.mem, counts_v),
                (group_list.0, group_list.1.clone()),
                npu_ffi::types::ACL_INT64,
            )?;
        }
        // 2. Gate and up.
        match kinds.0 {
            Grouped::PerExpert => {
                let xv = View::rows(&*xs, tk, h)?;
                let mut gv = ViewMut::rows(gu, tk, 2 * ff)?;
                for &(e, s, n) in &ranges {
                    self.op_matmul(xv.row_range(s, n)?, &gate_up[e], gv.row_range(s, n)?)?;
                }
            }
            kind => self.grouped_matmul(
                gate_up,
                kind,
                (&xs.mem, tk, h),
                (&gu.mem, 2 * ff),
                group_list.clone(),
            )?,
        }
        // 3. SwiGLU over every grouped row at once.
        {
            let gv = View::rows(&*gu, tk, 2 * ff)?;
            self.op_swiglu(
                gv.col_range(0, ff)?,
                gv.col_range(ff, ff)?,
                ViewMut::rows(act, tk, ff)?,
            )?;
        }
        // 4. Down.
        match kinds.1 {
            Grouped::PerExpert => {
                let av = View::rows(&*act, tk, ff)?;
                let mut yv = ViewMut::rows(y, tk, h)?;
                for &(e, s, n) in &ranges {
                    self.op_matmul(av.row_range(s, n)?, &down[e], yv.row_range(s, n)?)?;
                }
            }
            kind => self.grouped_matmul(down, kind, (&act.mem, tk, ff), (&y.mem, h), group_list)?,
        }
        // 5. The weights in f16.
        self.scratch.ensure(&self.dev, "moe_w16", tk * 2)?;
        let w16v = TView::contiguous(tensor::DType::F16, &[t as i64, k as i64]);
        let w16 = self.scratch.get("moe_w16");
        cast(
            &mut self.ops,
            (&weights.buf().mem, tview(DType::F32, wl)),
            (w16, w16v.clone()),
            npu_ffi::types::ACL_FLOAT16,
        )?;
        // 6. The weighted sum back in token order.
        let api = self.dev.acl.api.ops;
        let (Some(pf), Some(lf)) = (
            api.aclnnMoeFinalizeRoutingV2GetWorkspaceSize,
            api.aclnnMoeFinalizeRoutingV2,
        ) else {
            return Err(self.missing("the experts' weighted sum (aclnnMoeFinalizeRoutingV2)"));
        };
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
                    Arg::input("expandedRowIdx", 1, &idx.mem, rows_v),
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

    /// MoeInitRoutingV2 in the dropless mode with the cumulative counts (flag 1).
    fn init_routing(
        &mut self,
        x: (&Mem, TView),
        ids: (&Mem, TView),
        experts: usize,
        expanded: (&Mem, TView),
        rows: (&Mem, TView),
        counts: (&Mem, TView),
    ) -> Result<(), BackendError> {
        let api = self.dev.acl.api.ops;
        let (Some(prep), Some(launch)) = (
            api.aclnnMoeInitRoutingV2GetWorkspaceSize,
            api.aclnnMoeInitRoutingV2,
        ) else {
            return Err(self.missing("grouping tokens by expert (aclnnMoeInitRoutingV2)"));
        };
        let ne = experts as i64;
        self.ops
            .call(
                "aclnnMoeInitRoutingV2",
                launch,
                &[
                    Arg::input("x", 0, x.0, x.1),
                    Arg::input("expertIdx", 1, ids.0, ids.1),
                    Arg::output("expandedXOut", 0, expanded.0, expanded.1),
                    Arg::output("expandedRowIdxOut", 1, rows.0, rows.1),
                    Arg::output("expertTokensCountOrCumsumOut", 2, counts.0, counts.1),
                ],
                &[ne],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher; activeNum 0
                // and expertCapacity 0 (dropless), dropPadMode 0, the cumulative counts (flag 1),
                // no capacity counts (false, null).
                Box::new(move |ts, _, w, e| unsafe {
                    prep(
                        ts[0].raw(),
                        ts[1].raw(),
                        0,
                        0,
                        ne,
                        0,
                        1,
                        false,
                        ts[2].raw(),
                        ts[3].raw(),
                        ts[4].raw(),
                        std::ptr::null(),
                        w,
                        e,
                    )
                }),
            )
            .map_err(err)
    }

    /// The contiguous (k/32, n) scales of the symmetric INT4 matrix `m`, copied from its
    /// (n, k/32) storage on first use.
    fn grouped_scale<'m>(&mut self, m: &'m AscendMatrix) -> Result<&'m Mem, BackendError> {
        if let Some(s) = m.grouped_scale.get() {
            return Ok(s);
        }
        let MatrixForm::Quant { scale, .. } = &m.form else {
            unreachable!("grouped_kind checked every expert is Quant");
        };
        let g = m.k / crate::weights::GROUP;
        let mem = zeroed(&self.dev, g * m.n * 2, "an expert's grouped scales")?;
        self.pending = true;
        copy(
            &mut self.ops,
            &mem,
            TView::contiguous(m.half, &[g as i64, m.n as i64]),
            scale,
            m.group_view(),
        )?;
        Ok(m.grouped_scale.get_or_init(|| mem))
    }

    /// `y = x · W_e` for each expert's group of rows in one GroupedMatmulV4 call: x one f16
    /// (rows, k) tensor, the experts' weights one (E, k, n) tensor over their stack or a list
    /// of (k, n) ones (each seen transposed over (n, k) storage), y one (rows, n) tensor;
    /// groupType 0 (m-axis), splitItem 3 (one out tensor), groupListType 0 (`group_list` the
    /// cumulative row counts, one per expert), actType 0. INT4 weights come with their
    /// per-group scales as antiquantScaleOptional (`[E, k/32, n]` or `[k/32, n]` each; no
    /// offset).
    fn grouped_matmul(
        &mut self,
        mats: &[AscendMatrix],
        kind: Grouped,
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
        let stack = stack_of(mats);
        let mut scales = Vec::new();
        if kind == Grouped::Int4 && stack.is_none() {
            for m in mats {
                scales.push(self.grouped_scale(m)?);
            }
        }
        let acl = self.dev.acl;
        let f16 = tensor::DType::F16;
        let t = |m: &Mem, v: TView| tensor::Tensor::new(acl, m, v).map_err(err);
        let xl = tensor::TensorList::new(
            acl,
            vec![t(xm, TView::contiguous(f16, &[rows as i64, kin as i64]))?],
        )
        .map_err(err)?;
        let (e, ki, ni) = (mats.len() as i64, kin as i64, n as i64);
        let mut ws = Vec::with_capacity(mats.len());
        match stack {
            // The single (E, K, N) weight over the (E, n, k) stack.
            Some(s) => {
                let dt = match kind {
                    Grouped::Int4 => tensor::DType::I4,
                    _ => f16,
                };
                let v = TView::strided(dt, &[e, ki, ni], &[ni * ki, 1, ki], 0);
                ws.push(t(&s.weight, v)?);
            }
            None => {
                for m in mats {
                    let data = match &m.form {
                        MatrixForm::Half { data } => data,
                        MatrixForm::Quant { weight, .. } => weight,
                    };
                    ws.push(t(data, m.weight_view())?);
                }
            }
        }
        let wl = tensor::TensorList::new(acl, ws).map_err(err)?;
        let kg = (kin / crate::weights::GROUP) as i64;
        let sl = match (kind, stack.and_then(|s| s.scale.as_ref())) {
            (Grouped::Int4, Some(sm)) => {
                let v = TView::contiguous(f16, &[e, kg, ni]);
                Some(tensor::TensorList::new(acl, vec![t(sm, v)?]).map_err(err)?)
            }
            (Grouped::Int4, None) => {
                let mut ss = Vec::with_capacity(mats.len());
                for (m, s) in mats.iter().zip(&scales) {
                    let g = (m.k / crate::weights::GROUP) as i64;
                    ss.push(t(s, TView::contiguous(m.half, &[g, m.n as i64]))?);
                }
                Some(tensor::TensorList::new(acl, ss).map_err(err)?)
            }
            _ => None,
        };
        let yl = tensor::TensorList::new(
            acl,
            vec![t(ym, TView::contiguous(f16, &[rows as i64, n as i64]))?],
        )
        .map_err(err)?;
        let g = t(gm, gv)?;
        let detail = format!(
            "x=({rows},{kin}) weight={} {} out=({rows},{n}) groupType=0 splitItem=3 \
             groupListType=0",
            match stack {
                Some(_) => format!("({e},{kin},{n})T single"),
                None => format!("{e}x({kin},{n})T list"),
            },
            match kind {
                Grouped::Int4 => "INT4 antiquantScale per 32",
                _ => "f16",
            }
        );
        let null = std::ptr::null::<npu_ffi::types::aclTensorList>();
        let scale_raw = sl.as_ref().map_or(null, |l| l.raw());
        self.pending = true;
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
                        scale_raw,
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

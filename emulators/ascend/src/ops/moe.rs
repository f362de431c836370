//! The mixture-of-experts operators, with the rules of their aclnn pages (ops-transformer
//! `moe/moe_gating_top_k_softmax_v2/docs/aclnnMoeGatingTopKSoftmaxV2.md` and
//! `moe/moe_finalize_routing_v2/docs/aclnnMoeFinalizeRoutingV2.md`):
//!
//! - MoeGatingTopKSoftmaxV2(x, finishedOptional, k, renorm, outputSoftmaxResultFlag, yOut,
//!   expertIdxOut, softmaxResultOutOptional): x FLOAT16, BFLOAT16 or FLOAT32, 2-D or 3-D, ND;
//!   yOut of x's type and expertIdxOut INT32, both x's shape with the last axis k; `0 <= k <=
//!   E` (x's last axis) and `k <= 1024`; renorm 0 (softmax, then the top k of it) or 1 (the top k
//!   of x, then softmax over them); softmaxResultOutOptional FLOAT32 of x's shape, written only
//!   with renorm 0 and the flag set. Null x, yOut or expertIdxOut: ACLNN_ERR_PARAM_NULLPTR; a data
//!   type or format outside the table: ACLNN_ERR_PARAM_INVALID; shapes that disagree, k or renorm
//!   out of range, a softmax output of another type: ACLNN_ERR_INNER_TILING_ERROR (the page's
//!   return-code table). The outputs are × in the page's non-contiguous column
//!   ([`super::contiguity`]). The kernel computes in f32 (16-bit x widened); the top k is in
//!   descending order, equal values to the lower expert index (the page does not say how ties
//!   fall; the lower index is what a stable sort gives and what the reference expects — a
//!   hardware check is owed). finishedOptional is not emulated (refused).
//! - MoeFinalizeRoutingV2(expandedX, expandedRowIdx, x1Optional, x2Optional, biasOptional,
//!   scalesOptional, expertIdxOptional, dropPadMode, out): `out[i] = x1[i] + x2[i] + Σ_k
//!   scales[i,k]·(expandedX[expandedRowIdx[p(i,k)]] + bias[expertIdx[i,k]])` with `p(i,k) = i +
//!   k·NUM_ROWS` (dropPadMode 0, column order, aclnnMoeInitRouting's output) or `i·K + k` (2, row
//!   order, aclnnMoeInitRoutingV2's). expandedX FLOAT16, BFLOAT16 or FLOAT32 `(NUM_ROWS·K, H)`;
//!   expandedRowIdx INT32 `(NUM_ROWS·K)` with values in `[0, NUM_ROWS·K − 1]`; x1, x2 and bias
//!   of expandedX's type, x1/x2 out's shape, bias `(E, H)` and then expertIdx INT32 `(NUM_ROWS,
//!   K)` required; scales `(NUM_ROWS, K)` of expandedX's type (FLOAT32 also with BFLOAT16
//!   expandedX, the documented mixed mode); no scales means K = 1; x2 without x1 refused; out of
//!   expandedX's type `(NUM_ROWS, H)`, contiguous. dropPadMode in [0, 3]; the drop-pad modes (1,
//!   3: `(E, C, H)` expandedX) are not emulated (refused). The sum runs in f32 in k order and is
//!   rounded once into out. An index out of range at run time is the kernel's fault
//!   (ACL_ERROR_RT_AICORE_EXCEPTION, as Embedding's).

use npu_ffi::types::*;

use super::contiguity;
use super::{dtype_in, invalid, kernel_common, nd, prepare, read, read_f32, write, Io, Kernel};
use crate::state::*;
use crate::view::{DType, View};

const FLOATS: &[DType] = &[DType::F16, DType::Bf16, DType::F32];
/// "k不大于1024".
const MAX_K: i64 = 1024;

fn tiling<T>(op: &str, msg: impl std::fmt::Display) -> Result<T, Fail> {
    fail(ACLNN_ERR_INNER_TILING_ERROR, format!("{op}: {msg}"))
}

fn required(op: &str, what: &str, h: *const aclTensor) -> Result<(), Fail> {
    if h.is_null() {
        return fail(ACLNN_ERR_PARAM_NULLPTR, format!("{op}: {what} is null"));
    }
    Ok(())
}

fn contiguous(op: &str, args: &[(&str, &View)]) -> Result<(), Fail> {
    contiguity::check(op, args)
}

// ---- MoeGatingTopKSoftmaxV2 -----------------------------------------------------------------

#[derive(Clone)]
struct GatingTopKSoftmax {
    io: Io,
    k: usize,
    renorm: bool,
    softmax_out: bool,
}

/// The indices of the `k` largest of `v`, largest first, equal values to the lower index.
fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Softmax in f32: the maximum subtracted, exponentials summed, each divided by the sum.
fn softmax(v: &[f32]) -> Vec<f32> {
    let max = v.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let e: Vec<f32> = v.iter().map(|&x| (x - max).exp()).collect();
    let s: f32 = e.iter().sum();
    e.iter().map(|&x| x / s).collect()
}

impl Kernel for GatingTopKSoftmax {
    kernel_common!("aclnnMoeGatingTopKSoftmaxV2");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let x = &self.io.ins[0];
        let e = *x.dims.last().expect("2-D or 3-D") as usize;
        let vals = read_f32(st, x)?;
        let rows = vals.len() / e.max(1);
        let k = self.k;
        let (mut y, mut ids) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k));
        let mut soft = Vec::new();
        for row in vals.chunks_exact(e.max(1)).take(rows) {
            if self.renorm {
                let pick = top_k(row, k);
                let chosen: Vec<f32> = pick.iter().map(|&i| row[i]).collect();
                y.extend(softmax(&chosen).into_iter().map(f64::from));
                ids.extend(pick.iter().map(|&i| i as f64));
            } else {
                let p = softmax(row);
                let pick = top_k(&p, k);
                y.extend(pick.iter().map(|&i| f64::from(p[i])));
                ids.extend(pick.iter().map(|&i| i as f64));
                if self.softmax_out {
                    soft.extend(p.iter().map(|&v| f64::from(v)));
                }
            }
        }
        write(st, &self.io.outs[0], &y)?;
        write(st, &self.io.outs[1], &ids)?;
        if self.softmax_out {
            write(st, &self.io.outs[2], &soft)?;
        }
        Ok(())
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aclnnMoeGatingTopKSoftmaxV2GetWorkspaceSize(
    x: *const aclTensor,
    finishedOptional: *const aclTensor,
    k: i64,
    renorm: i64,
    outputSoftmaxResultFlag: bool,
    yOut: *const aclTensor,
    expertIdxOut: *const aclTensor,
    softmaxResultOutOptional: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    const OP: &str = "aclnnMoeGatingTopKSoftmaxV2";
    prepare(OP, workspaceSize, executor, |st| {
        required(OP, "x", x)?;
        required(OP, "yOut", yOut)?;
        required(OP, "expertIdxOut", expertIdxOut)?;
        let xv = st.tensor(x, "x")?;
        let yv = st.tensor(yOut, "yOut")?;
        let iv = st.tensor(expertIdxOut, "expertIdxOut")?;
        let sv = st.opt_tensor(softmaxResultOutOptional, "softmaxResultOutOptional")?;
        if !finishedOptional.is_null() {
            return invalid(OP, "finishedOptional is not emulated (pass null)");
        }
        dtype_in(OP, "x", &xv, FLOATS)?;
        for (w, v) in [("x", &xv), ("yOut", &yv), ("expertIdxOut", &iv)] {
            nd(OP, w, v)?;
        }
        if yv.dtype != xv.dtype {
            return invalid(
                OP,
                format!(
                    "yOut is {} and x {}: yOut must have x's data type",
                    yv.dtype.name(),
                    xv.dtype.name()
                ),
            );
        }
        dtype_in(OP, "expertIdxOut", &iv, &[DType::I32])?;
        if !(2..=3).contains(&xv.rank()) {
            return tiling(
                OP,
                format!("x has {} dimensions; it must have 2 or 3", xv.rank()),
            );
        }
        let e = *xv.dims.last().expect("rank checked");
        if k < 0 || k > e || k > MAX_K {
            return tiling(
                OP,
                format!(
                    "k = {k} outside [0, {}] (x's last axis {e}, at most {MAX_K})",
                    e.min(MAX_K)
                ),
            );
        }
        if !(0..=1).contains(&renorm) {
            return tiling(OP, format!("renorm = {renorm}; only 0 and 1 are supported"));
        }
        let mut want = xv.dims.clone();
        *want.last_mut().expect("rank checked") = k;
        for (w, v) in [("yOut", &yv), ("expertIdxOut", &iv)] {
            if v.dims != want {
                return tiling(
                    OP,
                    format!(
                        "{w} shape {:?}; x {:?} with k = {k} needs {want:?}",
                        v.dims, xv.dims
                    ),
                );
            }
        }
        let softmax_out = renorm == 0 && outputSoftmaxResultFlag;
        let mut outs = vec![yv, iv];
        if let Some(s) = sv {
            if s.dtype != DType::F32 {
                return tiling(
                    OP,
                    format!(
                        "softmaxResultOutOptional is {}; it must be FLOAT32",
                        s.dtype.name()
                    ),
                );
            }
            nd(OP, "softmaxResultOutOptional", &s)?;
            if s.dims != xv.dims {
                return tiling(
                    OP,
                    format!(
                        "softmaxResultOutOptional shape {:?} differs from x {:?}",
                        s.dims, xv.dims
                    ),
                );
            }
            outs.push(s);
        } else if softmax_out {
            return fail(
                ACLNN_ERR_PARAM_NULLPTR,
                format!(
                    "{OP}: outputSoftmaxResultFlag with renorm 0 needs softmaxResultOutOptional"
                ),
            );
        }
        let mut args = vec![("yOut", &outs[0]), ("expertIdxOut", &outs[1])];
        if let Some(s) = outs.get(2) {
            args.push(("softmaxResultOutOptional", s));
        }
        contiguous(OP, &args)?;
        Ok(Box::new(GatingTopKSoftmax {
            io: Io {
                ins: vec![xv],
                outs,
            },
            k: k as usize,
            renorm: renorm == 1,
            softmax_out,
        }))
    })
}

// ---- MoeFinalizeRoutingV2 -------------------------------------------------------------------

#[derive(Clone)]
struct FinalizeRouting {
    /// ins: expandedX, expandedRowIdx, then (when given) x1, x2, bias, scales, expertIdx.
    io: Io,
    has: [bool; 5],
    /// dropPadMode 2: expandedRowIdx in row order.
    row_order: bool,
    rows: usize,
    k: usize,
    h: usize,
}

impl Kernel for FinalizeRouting {
    kernel_common!("aclnnMoeFinalizeRoutingV2");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let (rows, k, h) = (self.rows, self.k, self.h);
        let ex = read_f32(st, &self.io.ins[0])?;
        let idx = read(st, &self.io.ins[1])?;
        let mut opt = self.io.ins[2..].iter();
        let mut next = |present: bool| -> Result<Option<Vec<f32>>, Fail> {
            if present {
                let v = opt.next().expect("one view per present input");
                read_f32(st, v).map(Some)
            } else {
                Ok(None)
            }
        };
        let x1 = next(self.has[0])?;
        let x2 = next(self.has[1])?;
        let bias = next(self.has[2])?;
        let scales = next(self.has[3])?;
        let experts = next(self.has[4])?;
        let n_bias = bias.as_ref().map_or(0, |b| b.len() / h.max(1));
        let mut out = vec![0f64; rows * h];
        for i in 0..rows {
            let mut acc = vec![0f32; h];
            for src in [&x1, &x2].into_iter().flatten() {
                for (d, &v) in acc.iter_mut().zip(&src[i * h..(i + 1) * h]) {
                    *d += v;
                }
            }
            for kk in 0..k {
                let p = if self.row_order {
                    i * k + kk
                } else {
                    i + kk * rows
                };
                let r = idx[p] as i64;
                if r < 0 || r as usize >= rows * k {
                    return fail(
                        ACL_ERROR_RT_AICORE_EXCEPTION,
                        format!(
                            "aclnnMoeFinalizeRoutingV2: expandedRowIdx[{p}] = {r} outside [0, {})",
                            rows * k
                        ),
                    );
                }
                let s = scales.as_ref().map_or(1.0, |s| s[i * k + kk]);
                let row = &ex[r as usize * h..(r as usize + 1) * h];
                let b = match (&bias, &experts) {
                    (Some(b), Some(e)) => {
                        let e = e[i * k + kk] as i64;
                        if e < 0 || e as usize >= n_bias {
                            return fail(
                                ACL_ERROR_RT_AICORE_EXCEPTION,
                                format!(
                                    "aclnnMoeFinalizeRoutingV2: expertIdx {e} outside [0, {n_bias})"
                                ),
                            );
                        }
                        Some(&b[e as usize * h..(e as usize + 1) * h])
                    }
                    _ => None,
                };
                for (j, d) in acc.iter_mut().enumerate() {
                    let v = row[j] + b.map_or(0.0, |b| b[j]);
                    *d += s * v;
                }
            }
            for (o, &a) in out[i * h..(i + 1) * h].iter_mut().zip(&acc) {
                *o = f64::from(a);
            }
        }
        write(st, &self.io.outs[0], &out)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aclnnMoeFinalizeRoutingV2GetWorkspaceSize(
    expandedX: *const aclTensor,
    expandedRowIdx: *const aclTensor,
    x1Optional: *const aclTensor,
    x2Optional: *const aclTensor,
    biasOptional: *const aclTensor,
    scalesOptional: *const aclTensor,
    expertIdxOptional: *const aclTensor,
    dropPadMode: i64,
    out: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    const OP: &str = "aclnnMoeFinalizeRoutingV2";
    prepare(OP, workspaceSize, executor, |st| {
        required(OP, "expandedX", expandedX)?;
        required(OP, "expandedRowIdx", expandedRowIdx)?;
        required(OP, "out", out)?;
        let xv = st.tensor(expandedX, "expandedX")?;
        let rv = st.tensor(expandedRowIdx, "expandedRowIdx")?;
        let ov = st.tensor(out, "out")?;
        let x1 = st.opt_tensor(x1Optional, "x1Optional")?;
        let x2 = st.opt_tensor(x2Optional, "x2Optional")?;
        let bias = st.opt_tensor(biasOptional, "biasOptional")?;
        let scales = st.opt_tensor(scalesOptional, "scalesOptional")?;
        let experts = st.opt_tensor(expertIdxOptional, "expertIdxOptional")?;
        if !(0..=3).contains(&dropPadMode) {
            return invalid(OP, format!("dropPadMode {dropPadMode} outside [0, 3]"));
        }
        if dropPadMode == 1 || dropPadMode == 3 {
            return invalid(
                OP,
                format!(
                    "dropPadMode {dropPadMode} (drop pad, (E, C, H) expandedX) is not emulated"
                ),
            );
        }
        dtype_in(OP, "expandedX", &xv, FLOATS)?;
        dtype_in(OP, "expandedRowIdx", &rv, &[DType::I32])?;
        for (w, v) in [("expandedX", &xv), ("expandedRowIdx", &rv), ("out", &ov)] {
            nd(OP, w, v)?;
        }
        if ov.dtype != xv.dtype {
            return invalid(
                OP,
                format!(
                    "out is {} and expandedX {}: they must match",
                    ov.dtype.name(),
                    xv.dtype.name()
                ),
            );
        }
        for (w, v) in [
            ("x1Optional", &x1),
            ("x2Optional", &x2),
            ("biasOptional", &bias),
        ] {
            if let Some(v) = v {
                nd(OP, w, v)?;
                if v.dtype != xv.dtype {
                    return invalid(
                        OP,
                        format!(
                            "{w} is {}; it must be expandedX's {}",
                            v.dtype.name(),
                            xv.dtype.name()
                        ),
                    );
                }
            }
        }
        if let Some(s) = &scales {
            nd(OP, "scalesOptional", s)?;
            let mixed = xv.dtype == DType::Bf16 && s.dtype == DType::F32;
            if s.dtype != xv.dtype && !mixed {
                return invalid(
                    OP,
                    format!(
                        "scalesOptional is {} with {} expandedX: it must match (FLOAT32 only with BFLOAT16 expandedX)",
                        s.dtype.name(),
                        xv.dtype.name()
                    ),
                );
            }
        }
        if let Some(e) = &experts {
            nd(OP, "expertIdxOptional", e)?;
            dtype_in(OP, "expertIdxOptional", e, &[DType::I32])?;
        }
        if x2.is_some() && x1.is_none() {
            return invalid(OP, "x2Optional is given without x1Optional");
        }
        if bias.is_some() && experts.is_none() {
            return invalid(OP, "biasOptional needs expertIdxOptional");
        }
        if xv.rank() != 2 || ov.rank() != 2 || rv.rank() != 1 {
            return tiling(
                OP,
                format!(
                    "expandedX {:?}, expandedRowIdx {:?} and out {:?}: drop-less routing takes (NUM_ROWS*K, H), (NUM_ROWS*K) and (NUM_ROWS, H)",
                    xv.dims, rv.dims, ov.dims
                ),
            );
        }
        let (rows, h) = (ov.dims[0], ov.dims[1]);
        let k = match &scales {
            Some(s) if s.rank() == 2 && s.dims[0] == rows => s.dims[1],
            Some(s) => {
                return tiling(
                    OP,
                    format!("scalesOptional {:?} for {rows} rows: (NUM_ROWS, K)", s.dims),
                )
            }
            None => 1,
        };
        if xv.dims != [rows * k, h] || rv.dims != [rows * k] {
            return tiling(
                OP,
                format!(
                    "expandedX {:?} and expandedRowIdx {:?} for out {:?} with K = {k}",
                    xv.dims, rv.dims, ov.dims
                ),
            );
        }
        for (w, v) in [("x1Optional", &x1), ("x2Optional", &x2)] {
            if let Some(v) = v {
                if v.dims != ov.dims {
                    return tiling(
                        OP,
                        format!("{w} {:?} differs from out {:?}", v.dims, ov.dims),
                    );
                }
            }
        }
        if let (Some(b), Some(e)) = (&bias, &experts) {
            if b.rank() != 2 || b.dims[1] != h || b.dims[0] < k {
                return tiling(
                    OP,
                    format!("biasOptional {:?}: (E, {h}) with E >= K = {k}", b.dims),
                );
            }
            if e.dims != [rows, k] {
                return tiling(OP, format!("expertIdxOptional {:?}: ({rows}, {k})", e.dims));
            }
        }
        contiguous(OP, &[("out", &ov)])?;
        let has = [
            x1.is_some(),
            x2.is_some(),
            bias.is_some(),
            scales.is_some(),
            experts.is_some(),
        ];
        let mut ins = vec![xv, rv];
        ins.extend([x1, x2, bias, scales, experts].into_iter().flatten());
        Ok(Box::new(FinalizeRouting {
            io: Io {
                ins,
                outs: vec![ov],
            },
            has,
            row_order: dropPadMode == 2,
            rows: rows as usize,
            k: k as usize,
            h: h as usize,
        }))
    })
}

// The first phases have the prototypes the backend declares.
const _: () = {
    use npu_ffi::aclnn::ops::sig;
    let _: sig::aclnnMoeGatingTopKSoftmaxV2GetWorkspaceSize =
        aclnnMoeGatingTopKSoftmaxV2GetWorkspaceSize;
    let _: sig::aclnnMoeFinalizeRoutingV2GetWorkspaceSize =
        aclnnMoeFinalizeRoutingV2GetWorkspaceSize;
};

// ---- MoeGatingTopK --------------------------------------------------------------------------
//
// ops-transformer `moe/moe_gating_top_k/docs/aclnnMoeGatingTopK.md` (and the CANN 8.2-8.5
// "aclnnMoeGatingTopK" pages): x FLOAT16, BFLOAT16 or FLOAT32, 2-D (rows, E), ND, E <= 2048;
// biasOptional 1-D (E) of x's type; yOut of x's type and expertIdxOut INT32, both (rows, k);
// outOut FLOAT32 of x's shape (written when outFlag). Scores: normType 1 Sigmoid; normType 0
// SoftMax is documented only from CANN 8.5 (the 8.2-8.3 pages compute sigmoid alone), so the
// emulation refuses it on older emulated releases; normType 2 (SqrtSoftplus, newest pages only)
// is not emulated. The bias is added for the choice only; with groupCount > 1 each group is
// scored by its maximum (groupSelectMode 0) or the sum of its two best (1), the best kGroup
// groups kept (the others -inf); the top k of what remains (descending; equal values to the
// lower index, the page does not say); the chosen unbiased scores divided by their sum plus
// eps (always for sigmoid; for softmax only with renorm 1), times routedScalingFactor. Limits
// (ACLNN_ERR_INNER_TILING_ERROR): 1 <= k <= E / groupCount * kGroup, 1 <= kGroup <= groupCount,
// groupCount > 0 dividing E with E / groupCount > groupSelectMode, and E / groupCount rounded up
// to 32 times groupCount at most 2048; groupSelectMode 0 or 1, renorm 0 or 1. Computed in f32.

#[derive(Clone)]
struct GatingTopK {
    /// ins: x, then bias when given; outs: yOut, expertIdxOut, then outOut when outFlag.
    io: Io,
    has_bias: bool,
    k: usize,
    k_group: usize,
    groups: usize,
    top2: bool,
    sigmoid: bool,
    renorm: bool,
    norm_out: bool,
    scale: f64,
    eps: f64,
}

impl Kernel for GatingTopK {
    kernel_common!("aclnnMoeGatingTopK");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let x = &self.io.ins[0];
        let e = *x.dims.last().expect("2-D") as usize;
        let vals = read_f32(st, x)?;
        let bias = if self.has_bias {
            Some(read_f32(st, &self.io.ins[1])?)
        } else {
            None
        };
        let rows = vals.len() / e;
        let (k, per) = (self.k, e / self.groups);
        let (mut y, mut ids) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k));
        let mut norm = Vec::new();
        for row in vals.chunks_exact(e).take(rows) {
            let scores: Vec<f32> = if self.sigmoid {
                row.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect()
            } else {
                softmax(row)
            };
            let mut select: Vec<f32> = match &bias {
                Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => scores.clone(),
            };
            if self.groups > 1 {
                let score = |g: usize| {
                    let part = &select[g * per..(g + 1) * per];
                    let best = top_k(part, if self.top2 { 2 } else { 1 });
                    best.iter().map(|&i| part[i]).sum::<f32>()
                };
                let gs: Vec<f32> = (0..self.groups).map(score).collect();
                let keep = top_k(&gs, self.k_group);
                for g in 0..self.groups {
                    if !keep.contains(&g) {
                        select[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
                    }
                }
            }
            let pick = top_k(&select, k);
            let chosen: Vec<f32> = pick.iter().map(|&i| scores[i]).collect();
            let div = if self.sigmoid || self.renorm {
                chosen.iter().sum::<f32>() as f64 + self.eps
            } else {
                1.0
            };
            y.extend(
                chosen
                    .iter()
                    .map(|&v| (f64::from(v) / div * self.scale) as f32 as f64),
            );
            ids.extend(pick.iter().map(|&i| i as f64));
            if self.norm_out {
                norm.extend(scores.iter().map(|&v| f64::from(v)));
            }
        }
        write(st, &self.io.outs[0], &y)?;
        write(st, &self.io.outs[1], &ids)?;
        if self.norm_out {
            write(st, &self.io.outs[2], &norm)?;
        }
        Ok(())
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aclnnMoeGatingTopKGetWorkspaceSize(
    x: *const aclTensor,
    biasOptional: *const aclTensor,
    k: i64,
    kGroup: i64,
    groupCount: i64,
    groupSelectMode: i64,
    renorm: i64,
    normType: i64,
    outFlag: bool,
    routedScalingFactor: f64,
    eps: f64,
    yOut: *const aclTensor,
    expertIdxOut: *const aclTensor,
    outOut: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    const OP: &str = "aclnnMoeGatingTopK";
    prepare(OP, workspaceSize, executor, |st| {
        required(OP, "x", x)?;
        required(OP, "yOut", yOut)?;
        required(OP, "expertIdxOut", expertIdxOut)?;
        let xv = st.tensor(x, "x")?;
        let bv = st.opt_tensor(biasOptional, "biasOptional")?;
        let yv = st.tensor(yOut, "yOut")?;
        let iv = st.tensor(expertIdxOut, "expertIdxOut")?;
        let ov = st.opt_tensor(outOut, "outOut")?;
        dtype_in(OP, "x", &xv, FLOATS)?;
        for (w, v) in [("x", &xv), ("yOut", &yv), ("expertIdxOut", &iv)] {
            nd(OP, w, v)?;
        }
        if yv.dtype != xv.dtype {
            return invalid(
                OP,
                format!(
                    "yOut is {} and x {}: yOut must have x's data type",
                    yv.dtype.name(),
                    xv.dtype.name()
                ),
            );
        }
        dtype_in(OP, "expertIdxOut", &iv, &[DType::I32])?;
        if xv.rank() != 2 {
            return tiling(
                OP,
                format!("x has {} dimensions; it must have 2", xv.rank()),
            );
        }
        let (rows, e) = (xv.dims[0], xv.dims[1]);
        if rows == 0 || e == 0 {
            return tiling(OP, "an empty x (empty tensors are not supported)");
        }
        if e > 2048 {
            return tiling(
                OP,
                format!("{e} experts: x's last axis must be at most 2048"),
            );
        }
        if let Some(b) = &bv {
            nd(OP, "biasOptional", b)?;
            if b.dtype != xv.dtype {
                return invalid(
                    OP,
                    format!(
                        "biasOptional is {} and x {}: the bias must have x's data type",
                        b.dtype.name(),
                        xv.dtype.name()
                    ),
                );
            }
            if b.dims != [e] {
                return tiling(
                    OP,
                    format!("biasOptional shape {:?}; x's last axis needs [{e}]", b.dims),
                );
            }
        }
        match normType {
            1 => {}
            0 if crate::install::emulated_release_at_least(8, 5) => {}
            0 => {
                return tiling(
                    OP,
                    format!(
                        "normType 0 (SoftMax): CANN {}'s page documents sigmoid scores only \
                         (softmax from 8.5)",
                        crate::install::emulated_version()
                    ),
                )
            }
            2 => return invalid(OP, "normType 2 (SqrtSoftplus) is not emulated"),
            n => return tiling(OP, format!("normType {n}: 0, 1 or 2")),
        }
        if !(0..=1).contains(&groupSelectMode) {
            return tiling(OP, format!("groupSelectMode {groupSelectMode}: 0 or 1"));
        }
        if !(0..=1).contains(&renorm) {
            return tiling(OP, format!("renorm {renorm}: 0 or 1"));
        }
        if groupCount <= 0 || e % groupCount != 0 {
            return tiling(
                OP,
                format!("groupCount {groupCount} must be positive and divide {e} experts"),
            );
        }
        let per = e / groupCount;
        if per <= groupSelectMode {
            return tiling(
                OP,
                format!(
                    "{per} experts a group: more than groupSelectMode {groupSelectMode} needed"
                ),
            );
        }
        if (per + 31) / 32 * 32 * groupCount > 2048 {
            return tiling(
                OP,
                format!("{groupCount} groups of {per} experts, each aligned to 32: more than 2048"),
            );
        }
        if kGroup < 1 || kGroup > groupCount {
            return tiling(OP, format!("kGroup {kGroup} outside [1, {groupCount}]"));
        }
        if k < 1 || k > per * kGroup {
            return tiling(
                OP,
                format!(
                    "k {k} outside [1, {}] ({kGroup} groups of {per})",
                    per * kGroup
                ),
            );
        }
        for (w, v) in [("yOut", &yv), ("expertIdxOut", &iv)] {
            if v.dims != [rows, k] {
                return tiling(OP, format!("{w} shape {:?}; needs [{rows}, {k}]", v.dims));
            }
        }
        let mut outs = vec![yv, iv];
        if outFlag {
            let Some(o) = ov else {
                return fail(
                    ACLNN_ERR_PARAM_NULLPTR,
                    format!("{OP}: outFlag set without outOut"),
                );
            };
            dtype_in(OP, "outOut", &o, &[DType::F32])?;
            nd(OP, "outOut", &o)?;
            if o.dims != xv.dims {
                return tiling(
                    OP,
                    format!("outOut shape {:?} differs from x {:?}", o.dims, xv.dims),
                );
            }
            outs.push(o);
        }
        let mut args = vec![("yOut", &outs[0]), ("expertIdxOut", &outs[1])];
        if let Some(o) = outs.get(2) {
            args.push(("outOut", o));
        }
        contiguous(OP, &args)?;
        let mut ins = vec![xv];
        let has_bias = bv.is_some();
        ins.extend(bv);
        Ok(Box::new(GatingTopK {
            io: Io { ins, outs },
            has_bias,
            k: k as usize,
            k_group: kGroup as usize,
            groups: groupCount as usize,
            top2: groupSelectMode == 1,
            sigmoid: normType == 1,
            renorm: renorm == 1,
            norm_out: outFlag,
            scale: routedScalingFactor,
            eps,
        }))
    })
}

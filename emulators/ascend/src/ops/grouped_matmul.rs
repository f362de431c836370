//! GroupedMatmulV4, with the rules of its aclnn page (ops-transformer
//! `gmm/grouped_matmul/docs/aclnnGroupedMatmulV4.md`, Atlas A2/A3 columns), for the m-axis
//! grouping a mixture-of-experts layer uses, non-quantized or with antiquant (伪量化) weights:
//!
//! - `aclnnGroupedMatmulV4GetWorkspaceSize(x, weight, biasOptional, scaleOptional,
//!   offsetOptional, antiquantScaleOptional, antiquantOffsetOptional, perTokenScaleOptional,
//!   groupListOptional, activationInputOptional, activationQuantScaleOptional,
//!   activationQuantOffsetOptional, splitItem, groupType, groupListType, actType, out,
//!   activationFeatureOutOptional, dynQuantScaleOutOptional, workspaceSize, executor)`.
//! - Null x, weight or out: ACLNN_ERR_PARAM_NULLPTR. Lists of more than 128 tensors, data types
//!   outside the scenario's table, a groupList that is not a 1-D INT64 tensor, splitItem outside
//!   [0, 3], groupType outside {-1, 0, 2}, groupListType outside {0, 1, 2} (2 is not emulated),
//!   actType other than 0 (the non-quantized and the INT4 antiquant scenarios' only value),
//!   splitItem 2/3 with an out list longer than 1, a groupList whose length is not the weight
//!   list's, and the activation* parameters (nullptr only): ACLNN_ERR_PARAM_INVALID.
//! - Non-quantized scenario: x, weight and out all FLOAT16, all BFLOAT16 or all FLOAT32 (FLOAT32
//!   only with x, weight and out one tensor each: "仅x、weight、y都为单tensor场景支持").
//! - Antiquant scenario (`y = x · ((weight + antiquantOffset) · antiquantScale)`): x FLOAT16 with
//!   FLOAT16 antiquant parameters and out, or BFLOAT16 with BFLOAT16 ones; weight INT8 or INT4
//!   (one type across the list); antiquantScale (and antiquantOffset, when given) a list as long
//!   as the weight list, of the shapes the page's table gives: per channel `[n_i]` per weight
//!   tensor (`[g, n]` for one 3-D weight), per group `[G_i, n_i]` (`[g, G, n]`). INT8 takes per
//!   channel only; INT4 takes per group only symmetric (no antiquantOffset), with `G_i` dividing
//!   `k_i`, every group length `k_i / G_i` equal across the list, and that length even when the
//!   weight is transposed; an INT4 weight's last axis (N, or K when transposed) is even. The
//!   page's non-contiguous column is "-" for the antiquant parameters: the emulation asks them
//!   contiguous (the shapes the table writes), never looser than an unstated rule. Each weight
//!   value is dequantized into x's 16-bit type (as WeightQuantBatchMatmulV2's emulation does),
//!   products summed in f32.
//! - Emulated: groupType 0 with x and out single tensors (splitItem 2 or 3) and weight single
//!   (3-D (E, K, N), at most 1024 groups) or multi (2-D (K_i, N), at most 128, every N equal;
//!   a transposed weight — (K, N) with strides (1, K) — is allowed, uniformly across the list);
//!   x 2-D (M, K), out 2-D (M, N); every last dimension under 65536. Not emulated (refused):
//!   other groupTypes and list shapes, bias, and the quantized scenarios' parameters (scale,
//!   offset, perTokenScale).
//! - At run time, groupListType 0 must be a non-negative non-decreasing sequence ending at M,
//!   type 1 non-negative sizes summing to M (the A2/A3 rows of the groupType-0 table, single
//!   and multi weight: "最后一个值与x中tensor的第一维相等" / "数值的总和与x中tensor的第一维相等";
//!   fewer rows are the 910_95's "不大于", not emulated); otherwise the kernel faults
//!   (ACL_ERROR_RT_AICORE_EXCEPTION). Products are summed in f32 and rounded once into out.

use npu_ffi::types::*;

use super::{dtype_in, invalid, kernel_common, nd, prepare, read, read_f32, write, Io, Kernel};
use crate::state::*;
use crate::view::{DType, View};

const OP: &str = "aclnnGroupedMatmulV4";
/// "输入参数x、weight，输出参数out支持最多128个tensor".
const MAX_LIST: usize = 128;
/// groupListOptional's first dimension with a single weight tensor.
const MAX_GROUPS_SINGLE: i64 = 1024;
/// "x和weight中每一组tensor的最后一维大小都应小于65536".
const MAX_LAST: i64 = 65536;

/// The antiquant parameters of the groups: after groupList in `ins`, one (G, N) scale view per
/// group, then (when given) one offset view per group of the same shape.
#[derive(Clone, Copy)]
struct Antiquant {
    /// Inputs along K that share one scale (K for per channel).
    group_len: usize,
    has_offset: bool,
    bf16: bool,
}

#[derive(Clone)]
struct Grouped {
    /// ins: x, the weights (one view per group), groupList, then the antiquant views.
    io: Io,
    groups: usize,
    cumsum: bool,
    m: usize,
    k: usize,
    n: usize,
    anti: Option<Antiquant>,
}

impl Grouped {
    /// Group `e`'s (K, N) weight as f32, row-major: the 16-bit values, or the antiquant ones
    /// dequantized into x's 16-bit type.
    fn weight(&self, st: &State, e: usize) -> Result<Vec<f32>, Fail> {
        let mut w = read_f32(st, &self.io.ins[1 + e])?;
        let Some(a) = self.anti else {
            return Ok(w);
        };
        let (g, n) = (self.groups, self.n);
        let scale = read_f32(st, &self.io.ins[2 + g + e])?;
        let offset = match a.has_offset {
            true => Some(read_f32(st, &self.io.ins[2 + 2 * g + e])?),
            false => None,
        };
        for (kk, row) in w.chunks_exact_mut(n).enumerate() {
            let at = (kk / a.group_len) * n;
            for (j, v) in row.iter_mut().enumerate() {
                let off = offset.as_ref().map_or(0.0, |o| o[at + j]);
                let deq = (*v + off) * scale[at + j];
                *v = if a.bf16 {
                    half::bf16::from_f32(deq).to_f32()
                } else {
                    half::f16::from_f32(deq).to_f32()
                };
            }
        }
        Ok(w)
    }
}

impl Kernel for Grouped {
    kernel_common!("aclnnGroupedMatmulV4");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let (m, k, n, g) = (self.m, self.k, self.n, self.groups);
        let list = read(st, &self.io.ins[1 + g])?;
        let fault = |msg: String| fail(ACL_ERROR_RT_AICORE_EXCEPTION, format!("{OP}: {msg}"));
        let mut ends = Vec::with_capacity(g);
        let mut at = 0i64;
        for (i, &v) in list.iter().enumerate() {
            let v = v as i64;
            let end = if self.cumsum { v } else { at + v };
            if v < 0 || end < at {
                return fault(format!(
                    "groupListOptional[{i}] = {v}: {}",
                    if self.cumsum {
                        "a cumsum list must be non-negative and non-decreasing"
                    } else {
                        "group sizes must be non-negative"
                    }
                ));
            }
            at = end;
            ends.push(end as usize);
        }
        if at as usize != m {
            return fault(format!(
                "the groups cover {at} rows of x's {m} (the list must end at, or sum to, x's \
                 first dimension)"
            ));
        }
        let x = read_f32(st, &self.io.ins[0])?;
        let ov = &self.io.outs[0];
        // Every row lies in a group (checked above); out is read for its shape's values.
        let mut out = read(st, ov)?;
        let mut start = 0;
        for (e, &end) in ends.iter().enumerate() {
            if end == start {
                continue;
            }
            let w = self.weight(st, e)?; // (K, N) row-major
            for r in start..end {
                let xr = &x[r * k..(r + 1) * k];
                for j in 0..n {
                    let mut s = 0f32;
                    for (kk, &xv) in xr.iter().enumerate() {
                        s += xv * w[kk * n + j];
                    }
                    out[r * n + j] = f64::from(s);
                }
            }
            start = end;
        }
        write(st, ov, &out)
    }
}

/// One group's weight view of a single (E, K, N) tensor: group `e`'s (K, N).
fn slice3(w: &View, e: i64) -> View {
    let mut v = w.clone();
    v.offset += e * w.strides[0];
    v.dims.remove(0);
    v.strides.remove(0);
    v
}

/// `v` as a 2-D (G, N) view: a 1-D (N) per-channel view becomes (1, N).
fn as_groups(v: View) -> View {
    let mut v = v;
    if v.rank() == 1 {
        v.dims.insert(0, 1);
        v.strides.insert(0, v.dims[1]);
    }
    v
}

/// Checks the antiquant lists against the page's table for weights `ws` (as passed) split into
/// per-group (K, N) views `per_group`, and returns the kernel's parameters with one (G, N) scale
/// view per group, then one offset view per group when offsets are given.
fn antiquant_views(
    xv: &View,
    (ws, per_group): (&[View], &[View]),
    scales: &[View],
    offsets: Option<&[View]>,
    (k, n): (i64, i64),
) -> Result<(Antiquant, Vec<View>), Fail> {
    let single = ws.len() == 1 && ws[0].rank() == 3;
    let int4 = ws[0].dtype == DType::I4;
    for (what, l) in [
        ("antiquantScaleOptional", Some(scales)),
        ("antiquantOffsetOptional", offsets),
    ] {
        let Some(l) = l else { continue };
        if l.len() != ws.len() {
            return invalid(
                OP,
                format!(
                    "{what} lists {} tensors for {} weight tensors (the same length)",
                    l.len(),
                    ws.len()
                ),
            );
        }
        for (i, v) in l.iter().enumerate() {
            dtype_in(OP, what, v, &[xv.dtype])?;
            nd(OP, what, v)?;
            if !v.is_contiguous() {
                return invalid(
                    OP,
                    format!(
                        "{what}[{i}] {:?} with strides {:?}: the emulation takes the antiquant \
                         parameters contiguous (the page's non-contiguous column is \"-\")",
                        v.dims, v.strides
                    ),
                );
            }
        }
    }
    // Per channel: [n_i] each, or [g, n] for one 3-D weight; per group: [G_i, n_i], [g, G, n].
    let per_group_rank = if single { 3 } else { 2 };
    let pergroup = scales[0].rank() == per_group_rank;
    let g = per_group.len() as i64;
    let mut views = Vec::with_capacity(2 * per_group.len());
    let mut group_len = None;
    for (what, l) in [
        ("antiquantScaleOptional", Some(scales)),
        ("antiquantOffsetOptional", offsets),
    ] {
        let Some(l) = l else { continue };
        let per: Vec<View> = if single {
            let v = &l[0];
            let want_rank = if pergroup { 3 } else { 2 };
            if v.rank() != want_rank || v.dims[0] != g || v.dims[want_rank - 1] != n {
                return invalid(
                    OP,
                    format!(
                        "{what} {:?} for one (E, K, N) weight of {g} groups and N = {n}: [g, n] \
                         per channel or [g, G, n] per group",
                        v.dims
                    ),
                );
            }
            (0..g).map(|e| as_groups(slice3(v, e))).collect()
        } else {
            let mut per = Vec::with_capacity(l.len());
            for (i, v) in l.iter().enumerate() {
                let ok = match pergroup {
                    true => v.rank() == 2 && v.dims[1] == n,
                    false => v.rank() == 1 && v.dims[0] == n,
                };
                if !ok {
                    return invalid(
                        OP,
                        format!(
                            "{what}[{i}] {:?} for N = {n}: every tensor [n_i] per channel or \
                             [G_i, n_i] per group, as antiquantScaleOptional[0] {:?}",
                            v.dims, scales[0].dims
                        ),
                    );
                }
                per.push(as_groups(v.clone()));
            }
            per
        };
        for (i, v) in per.iter().enumerate() {
            let groups_k = v.dims[0];
            if groups_k <= 0 || k % groups_k != 0 {
                return invalid(
                    OP,
                    format!("{what} group {i}: G = {groups_k} does not divide K = {k}"),
                );
            }
            let len = k / groups_k;
            if *group_len.get_or_insert(len) != len {
                return invalid(
                    OP,
                    format!(
                        "{what} group {i}: per-group length {len} differs from the list's first \
                         (every k_i / G_i must be equal)"
                    ),
                );
            }
        }
        views.extend(per);
    }
    let group_len = group_len.unwrap_or(k);
    let weight = ws[0].dtype.name();
    if pergroup && !int4 {
        return invalid(
            OP,
            format!("{weight} weights take per-channel antiquant only (若weight的类型为INT8，仅支持perchannel模式)"),
        );
    }
    if pergroup && offsets.is_some() {
        return invalid(
            OP,
            "per-group INT4 antiquant is symmetric only: antiquantOffsetOptional must be null \
             (非对称量化支持perchannel模式)",
        );
    }
    let transposed = per_group[0].strides.first() == Some(&1) && k > 1;
    if int4 {
        let last = if transposed { k } else { n };
        if last % 2 != 0 {
            return invalid(
                OP,
                format!(
                    "INT4 weights need an even last axis (the weight's {}), got {last}",
                    if transposed { "K, transposed" } else { "N" }
                ),
            );
        }
        if pergroup && transposed && group_len % 2 != 0 {
            return invalid(
                OP,
                format!("a transposed INT4 weight needs an even per-group length, got {group_len}"),
            );
        }
    }
    Ok((
        Antiquant {
            group_len: group_len as usize,
            has_offset: offsets.is_some(),
            bf16: xv.dtype == DType::Bf16,
        },
        views,
    ))
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aclnnGroupedMatmulV4GetWorkspaceSize(
    x: *const aclTensorList,
    weight: *const aclTensorList,
    biasOptional: *const aclTensorList,
    scaleOptional: *const aclTensorList,
    offsetOptional: *const aclTensorList,
    antiquantScaleOptional: *const aclTensorList,
    antiquantOffsetOptional: *const aclTensorList,
    perTokenScaleOptional: *const aclTensorList,
    groupListOptional: *const aclTensor,
    activationInputOptional: *const aclTensorList,
    activationQuantScaleOptional: *const aclTensorList,
    activationQuantOffsetOptional: *const aclTensorList,
    splitItem: i64,
    groupType: i64,
    groupListType: i64,
    actType: i64,
    out: *mut aclTensorList,
    activationFeatureOutOptional: *mut aclTensorList,
    dynQuantScaleOutOptional: *mut aclTensorList,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare(OP, workspaceSize, executor, |st| {
        for (what, h) in [
            ("x", x as *const ()),
            ("weight", weight as *const ()),
            ("out", out as *const ()),
        ] {
            if h.is_null() {
                return fail(ACLNN_ERR_PARAM_NULLPTR, format!("{OP}: {what} is null"));
            }
        }
        for (what, h) in [
            (
                "activationInputOptional",
                activationInputOptional as *const (),
            ),
            (
                "activationQuantScaleOptional",
                activationQuantScaleOptional as *const (),
            ),
            (
                "activationQuantOffsetOptional",
                activationQuantOffsetOptional as *const (),
            ),
            (
                "activationFeatureOutOptional",
                activationFeatureOutOptional as *const (),
            ),
            (
                "dynQuantScaleOutOptional",
                dynQuantScaleOutOptional as *const (),
            ),
        ] {
            if !h.is_null() {
                return invalid(
                    OP,
                    format!("{what} must be nullptr (the page: 当前只支持传入nullptr)"),
                );
            }
        }
        let xs = st.tensor_list(x, "x")?;
        let ws = st.tensor_list(weight, "weight")?;
        let os = st.tensor_list(out, "out")?;
        for (what, l) in [("x", &xs), ("weight", &ws), ("out", &os)] {
            if l.is_empty() || l.len() > MAX_LIST {
                return invalid(
                    OP,
                    format!(
                        "{what} lists {} tensors; [1, {MAX_LIST}] supported",
                        l.len()
                    ),
                );
            }
        }
        if !(0..=3).contains(&splitItem) {
            return invalid(OP, format!("splitItem {splitItem} outside [0, 3]"));
        }
        if ![-1, 0, 2].contains(&groupType) {
            return invalid(OP, format!("groupType {groupType}: -1, 0 or 2"));
        }
        if !(0..=2).contains(&groupListType) {
            return invalid(OP, format!("groupListType {groupListType}: 0, 1 or 2"));
        }
        if groupListType == 2 {
            return invalid(
                OP,
                "groupListType 2 ([E, 2] index/size pairs) is for the quantized scenarios; the \
                 non-quantized one takes 0 or 1",
            );
        }
        if actType != 0 {
            return invalid(
                OP,
                format!("actType {actType}: the non-quantized scenario takes 0 only"),
            );
        }
        if splitItem >= 2 && os.len() != 1 {
            return invalid(
                OP,
                format!(
                    "splitItem {splitItem} with {} out tensors (must be 1)",
                    os.len()
                ),
            );
        }
        for (what, h) in [
            ("scaleOptional", scaleOptional),
            ("offsetOptional", offsetOptional),
            ("perTokenScaleOptional", perTokenScaleOptional),
        ] {
            if !h.is_null() {
                return invalid(
                    OP,
                    format!("{what}: the quantized scenarios are not emulated"),
                );
            }
        }
        if !biasOptional.is_null() {
            return invalid(OP, "biasOptional is not emulated (pass null)");
        }
        if antiquantScaleOptional.is_null() && !antiquantOffsetOptional.is_null() {
            return invalid(OP, "antiquantOffsetOptional without antiquantScaleOptional");
        }
        let anti_lists = match antiquantScaleOptional.is_null() {
            true => None,
            false => Some((
                st.tensor_list(antiquantScaleOptional, "antiquantScaleOptional")?,
                match antiquantOffsetOptional.is_null() {
                    true => None,
                    false => {
                        Some(st.tensor_list(antiquantOffsetOptional, "antiquantOffsetOptional")?)
                    }
                },
            )),
        };
        let xv = xs[0].clone();
        let ov = os[0].clone();
        dtype_in(OP, "x", &xv, &[DType::F16, DType::Bf16, DType::F32])?;
        for (i, w) in ws.iter().enumerate() {
            nd(OP, "weight", w)?;
            let ok = match anti_lists {
                None => w.dtype == xv.dtype,
                Some(_) => {
                    matches!(w.dtype, DType::I8 | DType::I4)
                        && w.dtype == ws[0].dtype
                        && matches!(xv.dtype, DType::F16 | DType::Bf16)
                }
            };
            if !ok {
                return invalid(
                    OP,
                    format!(
                        "weight[{i}] is {} with {} x: {}",
                        w.dtype.name(),
                        xv.dtype.name(),
                        match anti_lists {
                            None => "the non-quantized scenario takes one type",
                            Some(_) =>
                                "the antiquant scenario takes FLOAT16 or BFLOAT16 x with INT8 or \
                                 INT4 weights, one type across the list",
                        }
                    ),
                );
            }
        }
        nd(OP, "x", &xv)?;
        nd(OP, "out", &ov)?;
        if xv.dtype == DType::F32 && (ws.len() != 1 || ws[0].rank() != 3) {
            return invalid(
                OP,
                "FLOAT32 x, weight and out only as single tensors (仅x、weight、y都为单tensor场景\
                 支持): one 3-D weight",
            );
        }
        if ov.dtype != xv.dtype {
            return invalid(
                OP,
                format!("out is {} with {} x", ov.dtype.name(), xv.dtype.name()),
            );
        }
        if groupType != 0 || xs.len() != 1 || splitItem < 2 {
            return invalid(
                OP,
                format!(
                    "groupType {groupType} with {} x / {} weight / {} out tensors and splitItem \
                     {splitItem}: only m-axis grouping (0) of one x into one out (splitItem 2/3) \
                     is emulated",
                    xs.len(),
                    ws.len(),
                    os.len()
                ),
            );
        }
        if groupListOptional.is_null() {
            return fail(
                ACLNN_ERR_PARAM_NULLPTR,
                format!("{OP}: groupType 0 with a single x needs groupListOptional"),
            );
        }
        let gv = st.tensor(groupListOptional, "groupListOptional")?;
        dtype_in(OP, "groupListOptional", &gv, &[DType::I64])?;
        if gv.rank() != 1 {
            return invalid(
                OP,
                format!("groupListOptional has shape {:?}; 1-D expected", gv.dims),
            );
        }
        if xv.rank() != 2 || ov.rank() != 2 {
            return invalid(
                OP,
                format!("x {:?} and out {:?} must be 2-D", xv.dims, ov.dims),
            );
        }
        let (m, k) = (xv.dims[0], xv.dims[1]);
        let groups = gv.dims[0];
        let weights: Vec<View> = if ws.len() == 1 {
            let w = &ws[0];
            if w.rank() != 3 || w.dims[0] != groups {
                return invalid(
                    OP,
                    format!(
                        "a single weight {:?} with {groups} groups: (E, K, N) with E = {groups}",
                        w.dims
                    ),
                );
            }
            if groups > MAX_GROUPS_SINGLE {
                return invalid(OP, format!("{groups} groups; at most {MAX_GROUPS_SINGLE}"));
            }
            (0..groups).map(|e| slice3(w, e)).collect()
        } else {
            if groups != ws.len() as i64 {
                return invalid(
                    OP,
                    format!(
                        "groupListOptional of {groups} for {} weight tensors (one each)",
                        ws.len()
                    ),
                );
            }
            if let Some(w) = ws.iter().find(|w| w.rank() != 2) {
                return invalid(
                    OP,
                    format!("weight {:?}: a weight list holds 2-D tensors", w.dims),
                );
            }
            let t = |w: &View| w.strides[0] == 1 && w.dims[0] > 1;
            if ws.iter().any(|w| t(w) != t(&ws[0])) {
                return invalid(
                    OP,
                    "weights transposed and not in one list (must be uniform)",
                );
            }
            ws.clone()
        };
        let n = weights[0].dims[1];
        for (i, w) in weights.iter().enumerate() {
            if w.dims != [k, n] {
                return invalid(
                    OP,
                    format!(
                        "weight[{i}] {:?} for x {:?} and N = {n}: (K, N) each",
                        w.dims, xv.dims
                    ),
                );
            }
        }
        if ov.dims != [m, n] {
            return invalid(
                OP,
                format!("out {:?} for x {:?} and N = {n}", ov.dims, xv.dims),
            );
        }
        if k >= MAX_LAST || n >= MAX_LAST {
            return invalid(
                OP,
                format!("K = {k}, N = {n}: last dimensions must be under {MAX_LAST}"),
            );
        }
        let anti = match &anti_lists {
            Some((scales, offsets)) => Some(antiquant_views(
                &xv,
                (&ws, &weights),
                scales,
                offsets.as_deref(),
                (k, n),
            )?),
            None => None,
        };
        let mut ins = vec![xv.clone()];
        ins.extend(weights);
        ins.push(gv);
        let anti = anti.map(|(a, views)| {
            ins.extend(views);
            a
        });
        Ok(Box::new(Grouped {
            io: Io {
                ins,
                outs: vec![ov],
            },
            groups: groups as usize,
            cumsum: groupListType == 0,
            m: m as usize,
            k: k as usize,
            n: n as usize,
            anti,
        }))
    })
}

const _: () = {
    use npu_ffi::aclnn::ops::sig;
    let _: sig::aclnnGroupedMatmulV4GetWorkspaceSize = aclnnGroupedMatmulV4GetWorkspaceSize;
};

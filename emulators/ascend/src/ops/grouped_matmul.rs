//! GroupedMatmulV4, with the rules of its aclnn page (ops-transformer
//! `gmm/grouped_matmul/docs/aclnnGroupedMatmulV4.md`, Atlas A2/A3 columns), for the non-quantized
//! m-axis grouping a mixture-of-experts layer uses:
//!
//! - `aclnnGroupedMatmulV4GetWorkspaceSize(x, weight, biasOptional, scaleOptional,
//!   offsetOptional, antiquantScaleOptional, antiquantOffsetOptional, perTokenScaleOptional,
//!   groupListOptional, activationInputOptional, activationQuantScaleOptional,
//!   activationQuantOffsetOptional, splitItem, groupType, groupListType, actType, out,
//!   activationFeatureOutOptional, dynQuantScaleOutOptional, workspaceSize, executor)`.
//! - Null x, weight or out: ACLNN_ERR_PARAM_NULLPTR. Lists of more than 128 tensors, data types
//!   outside the non-quantized table (x, weight and out all FLOAT16, all BFLOAT16 or all
//!   FLOAT32), a groupList that is not a 1-D INT64 tensor, splitItem outside [0, 3], groupType
//!   outside {-1, 0, 2}, groupListType outside {0, 1, 2} (2 is the quantized scenarios' only),
//!   actType other than 0 (the non-quantized scenario's only value), splitItem 2/3 with an out
//!   list longer than 1, a groupList whose length is not the weight list's, and the
//!   activation* parameters (nullptr only): ACLNN_ERR_PARAM_INVALID.
//! - Emulated: groupType 0 with x and out single tensors (splitItem 2 or 3) and weight single
//!   (3-D (E, K, N), at most 1024 groups) or multi (2-D (K_i, N), at most 128, every N equal;
//!   a transposed weight — (K, N) with strides (1, K) — is allowed, uniformly across the list);
//!   x 2-D (M, K), out 2-D (M, N); every last dimension under 65536. Not emulated (refused):
//!   other groupTypes and list shapes, bias, and every quantization parameter (scale, offset,
//!   antiquant, perTokenScale).
//! - At run time, groupListType 0 must be a non-negative non-decreasing sequence ending at most
//!   at M, type 1 non-negative sizes summing to at most M; otherwise the kernel faults
//!   (ACL_ERROR_RT_AICORE_EXCEPTION). Rows of out past the groups are not written, as the page
//!   says ("groupListOptional中未指定的部分将不会参与更新"). Products are summed in f32 and rounded
//!   once into out.

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

#[derive(Clone)]
struct Grouped {
    /// ins: x, the weights (one view per group), groupList.
    io: Io,
    groups: usize,
    cumsum: bool,
    m: usize,
    k: usize,
    n: usize,
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
        if at as usize > m {
            return fault(format!("the groups cover {at} rows of x's {m}"));
        }
        let x = read_f32(st, &self.io.ins[0])?;
        let ov = &self.io.outs[0];
        // Rows past the groups keep what out holds.
        let mut out = read(st, ov)?;
        let mut start = 0;
        for (e, &end) in ends.iter().enumerate() {
            if end == start {
                continue;
            }
            let w = read_f32(st, &self.io.ins[1 + e])?; // (K, N) row-major
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
            ("antiquantScaleOptional", antiquantScaleOptional),
            ("antiquantOffsetOptional", antiquantOffsetOptional),
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
        let xv = xs[0].clone();
        let ov = os[0].clone();
        dtype_in(OP, "x", &xv, &[DType::F16, DType::Bf16, DType::F32])?;
        for (i, w) in ws.iter().enumerate() {
            nd(OP, "weight", w)?;
            if w.dtype != xv.dtype {
                return invalid(
                    OP,
                    format!(
                        "weight[{i}] is {} with {} x: the non-quantized scenario takes one type",
                        w.dtype.name(),
                        xv.dtype.name()
                    ),
                );
            }
        }
        nd(OP, "x", &xv)?;
        nd(OP, "out", &ov)?;
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
        let mut ins = vec![xv];
        ins.extend(weights);
        ins.push(gv);
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
        }))
    })
}

const _: () = {
    use npu_ffi::aclnn::ops::sig;
    let _: sig::aclnnGroupedMatmulV4GetWorkspaceSize = aclnnGroupedMatmulV4GetWorkspaceSize;
};

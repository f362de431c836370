//! MoeInitRoutingV2, with the rules of its aclnn page (ops-transformer
//! `moe/moe_init_routing_v2/docs/aclnnMoeInitRoutingV2.md`, Atlas A2/A3):
//!
//! - `aclnnMoeInitRoutingV2GetWorkspaceSize(x, expertIdx, activeNum, expertCapacity, expertNum,
//!   dropPadMode, expertTokensCountOrCumsumFlag, expertTokensBeforeCapacityFlag, expandedXOut,
//!   expandedRowIdxOut, expertTokensCountOrCumsumOut, expertTokensBeforeCapacityOut)`.
//! - The computation: the flattened expertIdx (`numRows·k` values) sorted by expert
//!   (`sortedExpertIdx, sortedRowIdx = keyValueSort(flatten(expertIdx))`);
//!   `expandedRowIdxOut[sortedRowIdx[i]] = i`; `expandedXOut[i] = x[sortedRowIdx[i] / k]`; the
//!   per-expert histogram of the sorted ids, cumulative (flag 1) or plain counts (flag 2), into
//!   expertTokensCountOrCumsumOut. The page does not say how equal expert ids order; the
//!   emulation keeps them in flattened-index order (a stable sort). Every consumer of the three
//!   outputs together (a grouped matmul over each expert's rows, then MoeFinalizeRoutingV2
//!   through expandedRowIdx) computes the same whatever that order is.
//! - Null x, expertIdx, expandedXOut or expandedRowIdxOut, or a flag asking for an output that is
//!   null: ACLNN_ERR_PARAM_NULLPTR. Data types or formats outside the table (x and expandedXOut
//!   FLOAT16, BFLOAT16 or FLOAT32 of one type; expertIdx, expandedRowIdxOut and both count
//!   outputs INT32; ND): ACLNN_ERR_PARAM_INVALID. The return-code table's tiling errors
//!   (ACLNN_ERR_INNER_TILING_ERROR): x or expertIdx not 2-D or of different first dimensions;
//!   activeNum, expertCapacity or expertNum negative; dropPadMode outside {0, 1},
//!   expertTokensCountOrCumsumFlag outside {0, 1, 2}; expertNum 0 with the count output asked
//!   for; and outputs of other shapes than the page's (expandedXOut `[numRows·k, h]`,
//!   expandedRowIdxOut `[numRows·k]`, the count output `[expertNum]`). The outputs are × in
//!   the non-contiguous column ([`super::contiguity`]).
//! - Emulated: the dropless mode (dropPadMode 0, activeNum 0). Not emulated (refused,
//!   ACLNN_ERR_PARAM_INVALID): the Active mode (activeNum > 0) and the Drop/Pad mode
//!   (dropPadMode 1, expertTokensBeforeCapacityOut).
//! - At run time an expert id outside `[0, expertNum − 1]` with the count output asked for, or a
//!   negative one, is the kernel's fault (ACL_ERROR_RT_AICORE_EXCEPTION, as Embedding's).

use npu_ffi::types::*;

use super::contiguity;
use super::{dtype_in, invalid, kernel_common, nd, prepare, read, write, Io, Kernel};
use crate::state::*;
use crate::view::DType;

const OP: &str = "aclnnMoeInitRoutingV2";
const FLOATS: &[DType] = &[DType::F16, DType::Bf16, DType::F32];

fn tiling<T>(msg: impl std::fmt::Display) -> Result<T, Fail> {
    fail(ACLNN_ERR_INNER_TILING_ERROR, format!("{OP}: {msg}"))
}

#[derive(Clone)]
struct InitRouting {
    /// ins: x, expertIdx; outs: expandedXOut, expandedRowIdxOut, then the count output if asked.
    io: Io,
    rows: usize,
    k: usize,
    h: usize,
    experts: usize,
    /// 0: no count output, 1: cumulative, 2: counts.
    count_flag: i64,
}

impl Kernel for InitRouting {
    kernel_common!("aclnnMoeInitRoutingV2");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let (rows, k, h) = (self.rows, self.k, self.h);
        let ids = read(st, &self.io.ins[1])?;
        let mut keyed = Vec::with_capacity(rows * k);
        for (p, &v) in ids.iter().enumerate() {
            let e = v as i64;
            let limit = if self.count_flag > 0 {
                self.experts as i64
            } else {
                i64::MAX
            };
            if e < 0 || e >= limit {
                return fail(
                    ACL_ERROR_RT_AICORE_EXCEPTION,
                    format!(
                        "{OP}: expertIdx[{p}] = {e} outside [0, {})",
                        if self.count_flag > 0 {
                            self.experts.to_string()
                        } else {
                            "∞".into()
                        }
                    ),
                );
            }
            keyed.push((e, p));
        }
        // Stable: equal ids keep their flattened order.
        keyed.sort_by_key(|&(e, _)| e);
        let x = read(st, &self.io.ins[0])?;
        let mut expanded = vec![0f64; rows * k * h];
        let mut row_idx = vec![0f64; rows * k];
        let mut counts = vec![0i64; self.experts];
        for (i, &(e, p)) in keyed.iter().enumerate() {
            row_idx[p] = i as f64;
            let src = p / k;
            expanded[i * h..(i + 1) * h].copy_from_slice(&x[src * h..(src + 1) * h]);
            if let Some(c) = counts.get_mut(e as usize) {
                *c += 1;
            }
        }
        write(st, &self.io.outs[0], &expanded)?;
        write(st, &self.io.outs[1], &row_idx)?;
        if self.count_flag > 0 {
            let mut acc = 0i64;
            let vals: Vec<f64> = counts
                .iter()
                .map(|&c| {
                    acc += c;
                    if self.count_flag == 1 {
                        acc as f64
                    } else {
                        c as f64
                    }
                })
                .collect();
            write(st, &self.io.outs[2], &vals)?;
        }
        Ok(())
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aclnnMoeInitRoutingV2GetWorkspaceSize(
    x: *const aclTensor,
    expertIdx: *const aclTensor,
    activeNum: i64,
    expertCapacity: i64,
    expertNum: i64,
    dropPadMode: i64,
    expertTokensCountOrCumsumFlag: i64,
    expertTokensBeforeCapacityFlag: bool,
    expandedXOut: *const aclTensor,
    expandedRowIdxOut: *const aclTensor,
    expertTokensCountOrCumsumOut: *const aclTensor,
    expertTokensBeforeCapacityOut: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare(OP, workspaceSize, executor, |st| {
        for (what, h) in [
            ("x", x),
            ("expertIdx", expertIdx),
            ("expandedXOut", expandedXOut),
            ("expandedRowIdxOut", expandedRowIdxOut),
        ] {
            if h.is_null() {
                return fail(ACLNN_ERR_PARAM_NULLPTR, format!("{OP}: {what} is null"));
            }
        }
        if expertTokensCountOrCumsumFlag > 0 && expertTokensCountOrCumsumOut.is_null() {
            return fail(
                ACLNN_ERR_PARAM_NULLPTR,
                format!(
                    "{OP}: expertTokensCountOrCumsumFlag {expertTokensCountOrCumsumFlag} with a \
                     null expertTokensCountOrCumsumOut"
                ),
            );
        }
        let xv = st.tensor(x, "x")?;
        let iv = st.tensor(expertIdx, "expertIdx")?;
        let ev = st.tensor(expandedXOut, "expandedXOut")?;
        let rv = st.tensor(expandedRowIdxOut, "expandedRowIdxOut")?;
        let cv = st.opt_tensor(expertTokensCountOrCumsumOut, "expertTokensCountOrCumsumOut")?;
        let bv = st.opt_tensor(
            expertTokensBeforeCapacityOut,
            "expertTokensBeforeCapacityOut",
        )?;
        dtype_in(OP, "x", &xv, FLOATS)?;
        dtype_in(OP, "expandedXOut", &ev, FLOATS)?;
        if ev.dtype != xv.dtype {
            return invalid(
                OP,
                format!(
                    "expandedXOut is {} and x {}: expandedXOut must have x's data type",
                    ev.dtype.name(),
                    xv.dtype.name()
                ),
            );
        }
        dtype_in(OP, "expertIdx", &iv, &[DType::I32])?;
        dtype_in(OP, "expandedRowIdxOut", &rv, &[DType::I32])?;
        for (w, v) in [
            ("expertTokensCountOrCumsumOut", &cv),
            ("expertTokensBeforeCapacityOut", &bv),
        ] {
            if let Some(v) = v {
                dtype_in(OP, w, v, &[DType::I32])?;
                nd(OP, w, v)?;
            }
        }
        for (w, v) in [
            ("x", &xv),
            ("expertIdx", &iv),
            ("expandedXOut", &ev),
            ("expandedRowIdxOut", &rv),
        ] {
            nd(OP, w, v)?;
        }
        if xv.rank() != 2 || iv.rank() != 2 || xv.dims[0] != iv.dims[0] {
            return tiling(format!(
                "x {:?} and expertIdx {:?} must be 2-D with one first dimension (numRows)",
                xv.dims, iv.dims
            ));
        }
        for (w, v) in [
            ("activeNum", activeNum),
            ("expertCapacity", expertCapacity),
            ("expertNum", expertNum),
        ] {
            if v < 0 {
                return tiling(format!("{w} = {v}; it must not be negative"));
            }
        }
        if !(0..=1).contains(&dropPadMode) {
            return tiling(format!("dropPadMode = {dropPadMode}; 0 or 1"));
        }
        if !(0..=2).contains(&expertTokensCountOrCumsumFlag) {
            return tiling(format!(
                "expertTokensCountOrCumsumFlag = {expertTokensCountOrCumsumFlag}; 0, 1 or 2"
            ));
        }
        if expertTokensCountOrCumsumFlag > 0 && expertNum == 0 {
            return tiling("expertNum = 0 with expertTokensCountOrCumsumOut asked for");
        }
        if dropPadMode == 1 && (expertCapacity == 0 || expertNum == 0) {
            return tiling(format!(
                "dropPadMode 1 with expertCapacity {expertCapacity} and expertNum {expertNum} \
                 (both must be positive)"
            ));
        }
        if dropPadMode == 1 || expertTokensBeforeCapacityFlag {
            return invalid(
                OP,
                "the Drop/Pad mode (dropPadMode 1, expertTokensBeforeCapacityOut) is not \
                 emulated",
            );
        }
        if activeNum > 0 {
            return invalid(
                OP,
                format!("the Active mode (activeNum {activeNum} > 0) is not emulated"),
            );
        }
        let (rows, h, k) = (xv.dims[0], xv.dims[1], iv.dims[1]);
        if ev.dims != [rows * k, h] {
            return tiling(format!(
                "expandedXOut {:?}; the dropless mode needs [numRows·k, h] = [{}, {h}]",
                ev.dims,
                rows * k
            ));
        }
        if rv.dims != [rows * k] {
            return tiling(format!(
                "expandedRowIdxOut {:?}; it must be [numRows·k] = [{}]",
                rv.dims,
                rows * k
            ));
        }
        let mut outs = vec![ev, rv];
        if expertTokensCountOrCumsumFlag > 0 {
            let c = cv.expect("checked non-null above");
            if c.dims != [expertNum] {
                return tiling(format!(
                    "expertTokensCountOrCumsumOut {:?}; it must be [expertNum] = [{expertNum}]",
                    c.dims
                ));
            }
            outs.push(c);
        }
        let mut layouts = vec![("expandedXOut", &outs[0]), ("expandedRowIdxOut", &outs[1])];
        if let Some(c) = outs.get(2) {
            layouts.push(("expertTokensCountOrCumsumOut", c));
        }
        contiguity::check(OP, &layouts)?;
        Ok(Box::new(InitRouting {
            io: Io {
                ins: vec![xv, iv],
                outs,
            },
            rows: rows as usize,
            k: k as usize,
            h: h as usize,
            experts: expertNum as usize,
            count_flag: expertTokensCountOrCumsumFlag,
        }))
    })
}

const _: () = {
    use npu_ffi::aclnn::ops::sig;
    let _: sig::aclnnMoeInitRoutingV2GetWorkspaceSize = aclnnMoeInitRoutingV2GetWorkspaceSize;
};

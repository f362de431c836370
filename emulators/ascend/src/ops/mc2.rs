//! MatmulAllReduce and WeightQuantMatmulAllReduce (below: WeightQuantBatchMatmulV2's product and
//! checks, then the same all-reduce). MatmulAllReduce, a matrix product fused with the
//! all-reduce after it (`output =
//! AllReduce(x1 @ x2 + bias)` over the HCCL communicator named `group`), as the operator page
//! documents it for Atlas A2 (not A3): x1 (m, k) or (b, s, k), contiguous; x2 (k, n),
//! contiguous or a transposed view of its last two axes; output x1's shape with n for k; x1, x2
//! and output one dtype, FLOAT16 or BFLOAT16, format ND; reduceOp "sum", commTurn 0,
//! streamMode 1; 1, 2, 4 or 8 ranks; `group` the `HcclGetCommName` of a live communicator
//! whose rank is on the calling context's device. Refused here as not emulated: a bias (the
//! backend passes none) and empty tensors (the page lets k = 0 return the bias and m/n = 0
//! return without running).
//!
//! Arithmetic: each rank's product exactly as `aclnnMatmul` computes it (f32 sums, rounded to
//! the dtype), then the sum over the ranks exactly as `HcclAllReduce` of those values does (the
//! ring order and per-hop rounding of `hccl.rs`), so the fused call gives the bits of the two
//! calls. The collective is queued on the communicator like an `HcclAllReduce` (its peers may
//! meet it with either form), runs in stream order, and is refused under stream capture.

use core::ffi::c_char;

use npu_ffi::hccl::{HCCL_DATA_TYPE_BFP16, HCCL_DATA_TYPE_FP16};
use npu_ffi::types::*;

use super::matmul::{checked_wqbmm, is_transposed_2d, product_by, Wqbmm};
use super::{dtype_in, invalid, kernel_common, nd, prepare, read_f32, write, Io, Kernel};
use crate::state::*;
use crate::view::{read_elem, write_elem, DType, View};

const OP: &str = "aclnnMatmulAllReduce";

/// The rank counts the page allows on Atlas A2.
const RANKS: [u32; 4] = [1, 2, 4, 8];

#[derive(Clone)]
struct MatmulAllReduce {
    io: Io,
    comm: u64,
    m: usize,
    k: usize,
}

impl Kernel for MatmulAllReduce {
    kernel_common!("aclnnMatmulAllReduce");
    fn communicator(&self) -> Option<u64> {
        Some(self.comm)
    }
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let (a, b, out) = (&self.io.ins[0], &self.io.ins[1], self.io.outs[0].clone());
        let x = read_f32(st, a)?;
        let vals = product_by(st, &x, b, self.m, self.k)?;
        reduce_into(st, self.comm, OP, &vals, out);
        Ok(())
    }
}

/// From inside a fused operator's stream task: `vals` (its product) rounded to `out`'s 16-bit
/// dtype as a matmul writes it, summed over the group as HcclAllReduce sums those values, into
/// `out`.
fn reduce_into(st: &mut State, comm: u64, op: &'static str, vals: &[f64], out: View) {
    let dt = out.dtype;
    let mut mine = vec![0u8; vals.len() * 2];
    for (i, &v) in vals.iter().enumerate() {
        write_elem(&mut mine, dt, i, v);
    }
    let hccl_dt = if dt == DType::F16 {
        HCCL_DATA_TYPE_FP16
    } else {
        HCCL_DATA_TYPE_BFP16
    };
    let count = vals.len() as u64;
    crate::hccl::all_reduce_then(
        st,
        comm,
        op,
        (hccl_dt, count),
        mine,
        Box::new(move |st, sum| {
            let vals: Vec<f64> = (0..count as usize)
                .map(|i| read_elem(&sum, dt, i))
                .collect();
            write(st, &out, &vals)
        }),
    );
}

/// Both operators' pages list Atlas A2 only: on an emulated Atlas A3 (`ASCEND_EMULATOR_SOC`
/// "Ascend910_93…") they are refused before anything else.
fn not_on_atlas_a3(op: &str) -> Result<(), Fail> {
    let soc = crate::rt::soc_name();
    if soc.starts_with("Ascend910_93") {
        return invalid(
            op,
            format!("not supported on {soc} (an Atlas A3: the page lists Atlas A2 only)"),
        );
    }
    Ok(())
}

/// The group arguments both operators take, checked as their pages state: reduceOp "sum",
/// commTurn 0, streamMode 1, `group` the name of a live communicator with a rank on the
/// calling context's device, of 1, 2, 4 or 8 ranks. Returns the communicator.
///
/// # Safety
/// `group` and `reduce_op` null or NUL-terminated.
unsafe fn group_of(
    st: &State,
    op: &'static str,
    group: *const c_char,
    reduce_op: *const c_char,
    comm_turn: i64,
    stream_mode: i64,
) -> Result<u64, Fail> {
    // SAFETY: null or NUL-terminated (the caller's contract).
    let r = unsafe { host_str(op, reduce_op, "reduceOp") }?;
    if r != "sum" {
        return invalid(op, format!("reduceOp \"{r}\": only \"sum\" is supported"));
    }
    if comm_turn != 0 {
        return invalid(op, format!("commTurn {comm_turn}: only 0 is supported"));
    }
    if stream_mode != 1 {
        return invalid(op, format!("streamMode {stream_mode}: only 1 is supported"));
    }
    // SAFETY: null or NUL-terminated (the caller's contract).
    let group = unsafe { host_str(op, group, "group") }?;
    let device = st.current_context()?.1.device;
    let Some((comm, ranks)) = crate::hccl::by_name(&group, device) else {
        return invalid(
            op,
            format!(
                "group \"{group}\" is not the HcclGetCommName of a live communicator with a rank on device {device}"
            ),
        );
    };
    if !RANKS.contains(&ranks) {
        return invalid(
            op,
            format!("a communicator of {ranks} ranks (Atlas A2: 1, 2, 4 or 8)"),
        );
    }
    Ok(comm)
}

/// A contiguous (b, s, k) or (m, k) view as (b·s or m, k).
fn as_rows(v: &View) -> View {
    let k = *v.dims.last().expect("2-D or 3-D");
    View {
        dims: vec![v.numel() as i64 / k.max(1), k],
        strides: vec![k, 1],
        ..v.clone()
    }
}

/// A host string argument, or why not.
///
/// # Safety
/// `p` is null or NUL-terminated.
unsafe fn host_str(op: &str, p: *const c_char, what: &str) -> Result<String, Fail> {
    if p.is_null() {
        return invalid(op, format!("{what} is null"));
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    Ok(unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned())
}

/// # Safety
/// `group` and `reduceOp` null or NUL-terminated; out-pointers valid (documented contract).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aclnnMatmulAllReduceGetWorkspaceSize(
    x1: *const aclTensor,
    x2: *const aclTensor,
    bias: *const aclTensor,
    group: *const c_char,
    reduceOp: *const c_char,
    commTurn: i64,
    streamMode: i64,
    output: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare(OP, workspaceSize, executor, |st| {
        not_on_atlas_a3(OP)?;
        if x1.is_null() || x2.is_null() || output.is_null() {
            return fail(
                ACLNN_ERR_PARAM_NULLPTR,
                format!("{OP}: x1, x2 and output must not be null"),
            );
        }
        let a = st.tensor(x1, "x1")?;
        let b = st.tensor(x2, "x2")?;
        let o = st.tensor(output, "output")?;
        if !bias.is_null() {
            return invalid(
                OP,
                "a bias is not implemented by this emulation (pass null)",
            );
        }
        for (w, v) in [("x1", &a), ("x2", &b), ("output", &o)] {
            dtype_in(OP, w, v, &[DType::F16, DType::Bf16])?;
            nd(OP, w, v)?;
        }
        if a.dtype != b.dtype || o.dtype != a.dtype {
            return invalid(OP, "x1, x2 and output must share one data type");
        }
        if !(2..=3).contains(&a.rank()) {
            return invalid(OP, format!("x1 is {:?}: 2-D or 3-D only", a.dims));
        }
        if b.rank() != 2 {
            return invalid(OP, format!("x2 is {:?}: 2-D only", b.dims));
        }
        if !a.is_contiguous() {
            return invalid(OP, "x1 must be contiguous");
        }
        if !b.is_contiguous() && !is_transposed_2d(&b) {
            return invalid(
                OP,
                "x2 must be contiguous or the transpose of its last two axes",
            );
        }
        let k = *a.dims.last().expect("2-D or 3-D");
        let mut want = a.dims.clone();
        *want.last_mut().expect("2-D or 3-D") = b.dims[1];
        if b.dims[0] != k || o.dims != want {
            return invalid(
                OP,
                format!(
                    "shapes x1 {:?} @ x2 {:?} -> output {:?} do not agree",
                    a.dims, b.dims, o.dims
                ),
            );
        }
        if a.numel() == 0 || b.numel() == 0 {
            return invalid(OP, "empty tensors are not implemented by this emulation");
        }
        if a.dims.iter().chain(&b.dims).any(|&d| d > i32::MAX as i64)
            || a.numel() as i64 / k > i32::MAX as i64
        {
            return invalid(OP, "m (b*s), k and n must each be at most INT32_MAX");
        }
        // SAFETY: null or NUL-terminated (the caller's contract).
        let comm = unsafe { group_of(st, OP, group, reduceOp, commTurn, streamMode) }?;
        Ok(Box::new(MatmulAllReduce {
            m: a.numel() / k as usize,
            k: k as usize,
            comm,
            io: Io {
                ins: vec![a, b],
                outs: vec![o],
            },
        }))
    })
}

// Compile-time check: the export has the declared prototype of npu-ffi.
const _: npu_ffi::aclnn::ops::sig::aclnnMatmulAllReduceGetWorkspaceSize =
    aclnnMatmulAllReduceGetWorkspaceSize;

// ---- WeightQuantMatmulAllReduce ---------------------------------------------------------------

const WQ_OP: &str = "aclnnWeightQuantMatmulAllReduce";

/// WeightQuantBatchMatmulV2's product (its kernel, over x1 and output seen as 2-D), then the
/// all-reduce.
#[derive(Clone)]
struct WqMatmulAllReduce {
    wq: Wqbmm,
    comm: u64,
}

impl Kernel for WqMatmulAllReduce {
    fn name(&self) -> &'static str {
        WQ_OP
    }
    fn io(&self) -> &Io {
        &self.wq.io
    }
    fn io_mut(&mut self) -> &mut Io {
        &mut self.wq.io
    }
    fn clone_box(&self) -> Box<dyn Kernel> {
        Box::new(self.clone())
    }
    fn communicator(&self) -> Option<u64> {
        Some(self.comm)
    }
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let vals = self.wq.product(st)?;
        reduce_into(st, self.comm, WQ_OP, &vals, self.wq.io.outs[0].clone());
        Ok(())
    }
}

/// WeightQuantMatmulAllReduce as its page documents it for Atlas A2: x1 (m, k) or (b, s, k)
/// contiguous, FLOAT16 or BFLOAT16; x2 (k, n) INT8 or INT4, contiguous or transposed, k and n in
/// [1, 65535]; antiquantScale and the optional antiquantOffset per tensor, per channel or per
/// group (antiquantGroupSize a multiple of 32 in [32, k-1]) in x1's type; output x1's shape with
/// n for k; the group arguments as MatmulAllReduce's. Not emulated (refused): bias, x3, and a
/// non-contiguous output.
///
/// # Safety
/// `group` and `reduceOp` null or NUL-terminated; out-pointers valid (documented contract).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aclnnWeightQuantMatmulAllReduceGetWorkspaceSize(
    x1: *const aclTensor,
    x2: *const aclTensor,
    bias: *const aclTensor,
    antiquantScale: *const aclTensor,
    antiquantOffset: *const aclTensor,
    x3: *const aclTensor,
    group: *const c_char,
    reduceOp: *const c_char,
    commTurn: i64,
    streamMode: i64,
    antiquantGroupSize: i64,
    output: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare(WQ_OP, workspaceSize, executor, |st| {
        not_on_atlas_a3(WQ_OP)?;
        if x1.is_null() || x2.is_null() || antiquantScale.is_null() || output.is_null() {
            return fail(
                ACLNN_ERR_PARAM_NULLPTR,
                format!("{WQ_OP}: x1, x2, antiquantScale and output must not be null"),
            );
        }
        let a = st.tensor(x1, "x1")?;
        let w = st.tensor(x2, "x2")?;
        let s = st.tensor(antiquantScale, "antiquantScale")?;
        let off = st.opt_tensor(antiquantOffset, "antiquantOffset")?;
        let o = st.tensor(output, "output")?;
        if !bias.is_null() || !x3.is_null() {
            return invalid(
                WQ_OP,
                "bias and x3 are not implemented by this emulation (pass null)",
            );
        }
        if !(2..=3).contains(&a.rank()) || o.rank() != a.rank() {
            return invalid(
                WQ_OP,
                format!(
                    "x1 {:?} must be 2-D or 3-D and output {:?} of its rank",
                    a.dims, o.dims
                ),
            );
        }
        if !a.is_contiguous() || !o.is_contiguous() {
            return invalid(
                WQ_OP,
                "x1 must be contiguous (and a non-contiguous output is not emulated)",
            );
        }
        if a.dims[..a.rank() - 1] != o.dims[..o.rank() - 1] {
            return invalid(
                WQ_OP,
                format!("x1 {:?} and output {:?} differ in rows", a.dims, o.dims),
            );
        }
        if a.numel() == 0 || o.numel() == 0 {
            return invalid(WQ_OP, "empty tensors are not implemented by this emulation");
        }
        if o.dtype != a.dtype || s.dtype != a.dtype {
            return invalid(
                WQ_OP,
                "x1, antiquantScale and output must share one data type",
            );
        }
        // SAFETY: null or NUL-terminated (the caller's contract).
        let comm = unsafe { group_of(st, WQ_OP, group, reduceOp, commTurn, streamMode) }?;
        let group_size = antiquantGroupSize;
        let wq = checked_wqbmm(WQ_OP, as_rows(&a), w, s, off, None, as_rows(&o), group_size)?;
        Ok(Box::new(WqMatmulAllReduce { wq, comm }))
    })
}

// Compile-time check: the export has the declared prototype of npu-ffi.
const _: npu_ffi::aclnn::ops::sig::aclnnWeightQuantMatmulAllReduceGetWorkspaceSize =
    aclnnWeightQuantMatmulAllReduceGetWorkspaceSize;

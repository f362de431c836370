//! MatmulAllReduce, a matrix product fused with the all-reduce after it (`output =
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

use super::matmul::{is_transposed_2d, product_by};
use super::{dtype_in, invalid, kernel_common, nd, prepare, read_f32, write, Io, Kernel};
use crate::state::*;
use crate::view::{read_elem, write_elem, DType};

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
        let dt = out.dtype;
        // The product rounded to the dtype, as aclnnMatmul writes it.
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
            self.comm,
            OP,
            (hccl_dt, count),
            mine,
            Box::new(move |st, sum| {
                let vals: Vec<f64> = (0..count as usize)
                    .map(|i| read_elem(&sum, dt, i))
                    .collect();
                write(st, &out, &vals)
            }),
        );
        Ok(())
    }
}

/// A host string argument, or why not.
///
/// # Safety
/// `p` is null or NUL-terminated.
unsafe fn host_str(p: *const c_char, what: &str) -> Result<String, Fail> {
    if p.is_null() {
        return invalid(OP, format!("{what} is null"));
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
        let op = unsafe { host_str(reduceOp, "reduceOp") }?;
        if op != "sum" {
            return invalid(OP, format!("reduceOp \"{op}\": only \"sum\" is supported"));
        }
        if commTurn != 0 {
            return invalid(OP, format!("commTurn {commTurn}: only 0 is supported"));
        }
        if streamMode != 1 {
            return invalid(OP, format!("streamMode {streamMode}: only 1 is supported"));
        }
        // SAFETY: null or NUL-terminated (the caller's contract).
        let group = unsafe { host_str(group, "group") }?;
        let device = st.current_context()?.1.device;
        let Some((comm, ranks)) = crate::hccl::by_name(&group, device) else {
            return invalid(
                OP,
                format!(
                    "group \"{group}\" is not the HcclGetCommName of a live communicator with a rank on device {device}"
                ),
            );
        };
        if !RANKS.contains(&ranks) {
            return invalid(
                OP,
                format!("a communicator of {ranks} ranks (Atlas A2: 1, 2, 4 or 8)"),
            );
        }
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

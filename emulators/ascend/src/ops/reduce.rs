//! Row-wise operators of a greedy pick on the device: NanToNum (NaN and ±inf replaced by given
//! values), LogSoftmax along a dimension, and Gather (`out[..i..] = self[..index[..i..]..]` along
//! one dimension, torch.gather's rule), with the shape and dtype rules of their aclnn pages.

use npu_ffi::types::*;

use super::{dtype_in, invalid, kernel_common, nd, prepare, read, write, Io, Kernel};
use crate::state::*;
use crate::view::DType;

const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::Bf16];

fn dim_of(op: &str, dim: i64, rank: usize) -> Result<usize, Fail> {
    let r = rank as i64;
    if r == 0 || dim < -r || dim >= r {
        return invalid(op, format!("dim {dim} outside [-{r}, {}]", r - 1));
    }
    Ok(dim.rem_euclid(r) as usize)
}

// ---- NanToNum -------------------------------------------------------------------------------

#[derive(Clone)]
struct NanToNum {
    io: Io,
    nan: f64,
    posinf: f64,
    neginf: f64,
}

impl Kernel for NanToNum {
    kernel_common!("aclnnNanToNum");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let x: Vec<f64> = read(st, &self.io.ins[0])?
            .into_iter()
            .map(|v| {
                if v.is_nan() {
                    self.nan
                } else if v == f64::INFINITY {
                    self.posinf
                } else if v == f64::NEG_INFINITY {
                    self.neginf
                } else {
                    v
                }
            })
            .collect();
        write(st, &self.io.outs[0], &x)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnNanToNumGetWorkspaceSize(
    self_: *const aclTensor,
    nan: f32,
    posinf: f32,
    neginf: f32,
    out: *mut aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnNanToNum", workspaceSize, executor, |st| {
        let op = "aclnnNanToNum";
        let x = st.tensor(self_, "self")?;
        let o = st.tensor(out, "out")?;
        let allowed = [
            DType::F16,
            DType::F32,
            DType::Bf16,
            DType::I8,
            DType::I32,
            DType::I64,
            DType::U8,
            DType::Bool,
        ];
        dtype_in(op, "self", &x, &allowed)?;
        nd(op, "self", &x)?;
        nd(op, "out", &o)?;
        if o.dtype != x.dtype || o.dims != x.dims {
            return invalid(
                op,
                format!(
                    "out {} must match self {}",
                    o.shape_string(),
                    x.shape_string()
                ),
            );
        }
        Ok(Box::new(NanToNum {
            io: Io {
                ins: vec![x],
                outs: vec![o],
            },
            nan: nan as f64,
            posinf: posinf as f64,
            neginf: neginf as f64,
        }))
    })
}

// ---- LogSoftmax -----------------------------------------------------------------------------

#[derive(Clone)]
struct LogSoftmax {
    io: Io,
    dim: usize,
}

impl Kernel for LogSoftmax {
    kernel_common!("aclnnLogSoftmax");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let x = &self.io.ins[0];
        let v = read(st, x)?;
        let len = x.dims[self.dim] as usize;
        let inner: usize = x.dims[self.dim + 1..].iter().map(|&d| d as usize).product();
        let outer: usize = x.dims[..self.dim].iter().map(|&d| d as usize).product();
        let mut out = vec![0.0f64; v.len()];
        for o in 0..outer {
            for i in 0..inner {
                let at = |k: usize| (o * len + k) * inner + i;
                let mx = (0..len).map(|k| v[at(k)]).fold(f64::NEG_INFINITY, f64::max);
                // The stable form every kernel uses: (x − max) − ln Σ exp(x − max).
                let ls = (0..len).map(|k| (v[at(k)] - mx).exp()).sum::<f64>().ln();
                for k in 0..len {
                    out[at(k)] = (v[at(k)] - mx) - ls;
                }
            }
        }
        write(st, &self.io.outs[0], &out)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnLogSoftmaxGetWorkspaceSize(
    self_: *const aclTensor,
    dim: i64,
    out: *mut aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnLogSoftmax", workspaceSize, executor, |st| {
        let op = "aclnnLogSoftmax";
        let x = st.tensor(self_, "self")?;
        let o = st.tensor(out, "out")?;
        dtype_in(op, "self", &x, FLOATS)?;
        dtype_in(op, "out", &o, FLOATS)?;
        nd(op, "self", &x)?;
        if o.dims != x.dims {
            return invalid(
                op,
                format!("out shape {:?} differs from self {:?}", o.dims, x.dims),
            );
        }
        let dim = dim_of(op, dim, x.rank())?;
        Ok(Box::new(LogSoftmax {
            io: Io {
                ins: vec![x],
                outs: vec![o],
            },
            dim,
        }))
    })
}

// ---- Gather ---------------------------------------------------------------------------------

#[derive(Clone)]
struct Gather {
    io: Io,
    dim: usize,
}

impl Kernel for Gather {
    kernel_common!("aclnnGather");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let (x, idx) = (&self.io.ins[0], &self.io.ins[1]);
        let v = read(st, x)?;
        let index = read(st, idx)?;
        let rank = x.rank();
        // Row-major strides of the dense copy of self.
        let mut xs = vec![1usize; rank];
        for a in (0..rank.saturating_sub(1)).rev() {
            xs[a] = xs[a + 1] * x.dims[a + 1] as usize;
        }
        let mut out = Vec::with_capacity(index.len());
        let mut pos = vec![0usize; rank];
        for &ix in &index {
            let ix = ix as i64;
            if ix < 0 || ix >= x.dims[self.dim] {
                return fail(
                    ACL_ERROR_RT_AICORE_EXCEPTION,
                    format!("aclnnGather: index {ix} outside [0, {})", x.dims[self.dim]),
                );
            }
            let flat: usize = (0..rank)
                .map(|a| if a == self.dim { ix as usize } else { pos[a] } * xs[a])
                .sum();
            out.push(v[flat]);
            for a in (0..rank).rev() {
                pos[a] += 1;
                if (pos[a] as i64) < idx.dims[a] {
                    break;
                }
                pos[a] = 0;
            }
        }
        write(st, &self.io.outs[0], &out)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnGatherGetWorkspaceSize(
    self_: *const aclTensor,
    dim: i64,
    index: *const aclTensor,
    out: *mut aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnGather", workspaceSize, executor, |st| {
        let op = "aclnnGather";
        let x = st.tensor(self_, "self")?;
        let i = st.tensor(index, "index")?;
        let o = st.tensor(out, "out")?;
        dtype_in(op, "index", &i, &[DType::I32, DType::I64])?;
        if o.dtype != x.dtype {
            return invalid(op, "out must have self's data type");
        }
        let d = dim_of(op, dim, x.rank())?;
        if i.rank() != x.rank()
            || (0..x.rank()).any(|a| a != d && i.dims[a] > x.dims[a])
            || o.dims != i.dims
        {
            return invalid(
                op,
                format!(
                    "index {:?} must have self {:?}'s rank and no larger dimension off dim {d}, and out {:?} index's shape",
                    i.dims, x.dims, o.dims
                ),
            );
        }
        Ok(Box::new(Gather {
            io: Io {
                ins: vec![x, i],
                outs: vec![o],
            },
            dim: d,
        }))
    })
}

const _: () = {
    use npu_ffi::aclnn::ops::sig;
    let _: sig::aclnnNanToNumGetWorkspaceSize = aclnnNanToNumGetWorkspaceSize;
    let _: sig::aclnnLogSoftmaxGetWorkspaceSize = aclnnLogSoftmaxGetWorkspaceSize;
    let _: sig::aclnnGatherGetWorkspaceSize = aclnnGatherGetWorkspaceSize;
};

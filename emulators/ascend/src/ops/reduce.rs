//! Row-wise operators: NanToNum (NaN and ±inf replaced by given values), LogSoftmax along a
//! dimension and Gather (`out[..i..] = self[..index[..i..]..]` along one dimension, torch.gather's
//! rule) for a greedy pick on the device; Mul (broadcast, with type promotion) and DynamicQuant
//! (per-row symmetric INT8 quantization: scale = max|x| / 127, y = round(x / scale)) for 8-bit
//! activations. Shape and dtype rules are those of their aclnn pages.

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

// ---- Mul ------------------------------------------------------------------------------------

#[derive(Clone)]
struct Mul {
    io: Io,
}

impl Kernel for Mul {
    kernel_common!("aclnnMul");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let out = &self.io.outs[0];
        let a = read(
            st,
            &super::elementwise::broadcast_to(self.name(), &self.io.ins[0], &out.dims)?,
        )?;
        let b = read(
            st,
            &super::elementwise::broadcast_to(self.name(), &self.io.ins[1], &out.dims)?,
        )?;
        let r: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x * y).collect();
        write(st, out, &r)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnMulGetWorkspaceSize(
    self_: *const aclTensor,
    other: *const aclTensor,
    out: *mut aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnMul", workspaceSize, executor, |st| {
        let op = "aclnnMul";
        let a = st.tensor(self_, "self")?;
        let b = st.tensor(other, "other")?;
        let o = st.tensor(out, "out")?;
        let numeric = [
            DType::F32,
            DType::F16,
            DType::Bf16,
            DType::I32,
            DType::I64,
            DType::I8,
            DType::U8,
        ];
        for (w, v) in [("self", &a), ("other", &b), ("out", &o)] {
            dtype_in(op, w, v, &numeric)?;
            nd(op, w, v)?;
        }
        // Type promotion: a float operand makes the result float; out must hold it.
        if (a.dtype.is_float() || b.dtype.is_float()) && !o.dtype.is_float() {
            return invalid(
                op,
                format!(
                    "{} x {} promotes to a float type; out is {}",
                    a.dtype.name(),
                    b.dtype.name(),
                    o.dtype.name()
                ),
            );
        }
        let shape = super::elementwise::broadcast_shape(op, &a.dims, &b.dims)?;
        if shape != o.dims {
            return invalid(
                op,
                format!(
                    "out shape {:?} is not the broadcast shape {shape:?}",
                    o.dims
                ),
            );
        }
        Ok(Box::new(Mul {
            io: Io {
                ins: vec![a, b],
                outs: vec![o],
            },
        }))
    })
}

// ---- DynamicQuant ---------------------------------------------------------------------------

#[derive(Clone)]
struct DynamicQuant {
    io: Io,
}

impl Kernel for DynamicQuant {
    kernel_common!("aclnnDynamicQuant");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let x = &self.io.ins[0];
        let vals: Vec<f32> = read(st, x)?.into_iter().map(|v| v as f32).collect();
        let len = *x.dims.last().expect("rank checked") as usize;
        let mut y = Vec::with_capacity(vals.len());
        let mut scales = Vec::with_capacity(vals.len() / len.max(1));
        for row in vals.chunks(len) {
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 127.0;
            scales.push(scale as f64);
            for &v in row {
                // Round half to even, as the vector unit's default rounding does.
                let q = if scale == 0.0 {
                    0.0
                } else {
                    (v / scale).round_ties_even().clamp(-127.0, 127.0)
                };
                y.push(q as f64);
            }
        }
        write(st, &self.io.outs[0], &y)?;
        write(st, &self.io.outs[1], &scales)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnDynamicQuantGetWorkspaceSize(
    x: *const aclTensor,
    smoothScalesOptional: *const aclTensor,
    yOut: *const aclTensor,
    scaleOut: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnDynamicQuant", workspaceSize, executor, |st| {
        let op = "aclnnDynamicQuant";
        let xv = st.tensor(x, "x")?;
        let y = st.tensor(yOut, "yOut")?;
        let s = st.tensor(scaleOut, "scaleOut")?;
        if !smoothScalesOptional.is_null() {
            return invalid(
                op,
                "smoothScalesOptional is not implemented by this emulation (pass nullptr)",
            );
        }
        dtype_in(op, "x", &xv, &[DType::F16, DType::Bf16])?;
        dtype_in(op, "yOut", &y, &[DType::I8])?;
        dtype_in(op, "scaleOut", &s, &[DType::F32])?;
        if !(2..=8).contains(&xv.rank()) {
            return invalid(
                op,
                format!("x must have 2 to 8 dimensions, got {:?}", xv.dims),
            );
        }
        if y.dims != xv.dims || s.dims[..] != xv.dims[..xv.rank() - 1] {
            return invalid(
                op,
                format!(
                    "yOut {:?} must be x's shape {:?} and scaleOut {:?} x's shape without its last dimension",
                    y.dims, xv.dims, s.dims
                ),
            );
        }
        if !y.is_contiguous() || !s.is_contiguous() {
            return invalid(op, "yOut and scaleOut must be contiguous");
        }
        Ok(Box::new(DynamicQuant {
            io: Io {
                ins: vec![xv],
                outs: vec![y, s],
            },
        }))
    })
}

const _: () = {
    use npu_ffi::aclnn::ops::sig;
    let _: sig::aclnnMulGetWorkspaceSize = aclnnMulGetWorkspaceSize;
    let _: sig::aclnnDynamicQuantGetWorkspaceSize = aclnnDynamicQuantGetWorkspaceSize;
};

//! Element-wise and row-wise operators: Add, InplaceAdd, Cast, InplaceCopy, RmsNorm, SwiGlu, Embedding,
//! ArgMax, ApplyRotaryPosEmb (half rotation, q and k in place, D = 128 only) and RotaryPositionEmbedding
//! (half and interleave modes), with the shape and dtype rules of their aclnn documentation.

use npu_ffi::types::*;

use super::{dtype_in, invalid, kernel_common, nd, prepare, read, write, Io, Kernel};
use crate::state::*;
use crate::view::{DType, View};

const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::Bf16];
/// The AI core's unified buffer (Atlas A2/A3), against which ApplyRotaryPosEmb's page bounds the
/// head count.
const UB_BYTES: i64 = 192 * 1024;
const NUMERIC: &[DType] = &[
    DType::F32,
    DType::F16,
    DType::Bf16,
    DType::I32,
    DType::I64,
    DType::I8,
    DType::U8,
];

pub(crate) fn broadcast_shape(op: &str, a: &[i64], b: &[i64]) -> Result<Vec<i64>, Fail> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let x = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let y = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (x, y) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return invalid(op, format!("shapes {a:?} and {b:?} do not broadcast")),
        };
    }
    Ok(out)
}

/// `v` seen with shape `dims` (broadcast dimensions get stride 0).
pub(crate) fn broadcast_to(op: &str, v: &View, dims: &[i64]) -> Result<View, Fail> {
    if v.rank() > dims.len() {
        return invalid(
            op,
            format!("shape {:?} does not broadcast to {dims:?}", v.dims),
        );
    }
    let lead = dims.len() - v.rank();
    let mut strides = vec![0; dims.len()];
    for i in lead..dims.len() {
        let d = v.dims[i - lead];
        strides[i] = if d == dims[i] {
            v.strides[i - lead]
        } else if d == 1 {
            0
        } else {
            return invalid(
                op,
                format!("shape {:?} does not broadcast to {dims:?}", v.dims),
            );
        };
    }
    Ok(View {
        dims: dims.to_vec(),
        strides,
        ..v.clone()
    })
}

// ---- Add / InplaceAdd -----------------------------------------------------------------------

#[derive(Clone)]
struct Add {
    io: Io,
    alpha: f64,
    inplace: bool,
}

impl Kernel for Add {
    fn name(&self) -> &'static str {
        if self.inplace {
            "aclnnInplaceAdd"
        } else {
            "aclnnAdd"
        }
    }
    fn io(&self) -> &Io {
        &self.io
    }
    fn io_mut(&mut self) -> &mut Io {
        &mut self.io
    }
    fn clone_box(&self) -> Box<dyn Kernel> {
        Box::new(self.clone())
    }
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let out = &self.io.outs[0];
        let (a, b) = if self.inplace {
            (out, &self.io.ins[0])
        } else {
            (&self.io.ins[0], &self.io.ins[1])
        };
        let a = read(st, &broadcast_to(self.name(), a, &out.dims)?)?;
        let b = read(st, &broadcast_to(self.name(), b, &out.dims)?)?;
        let r: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x + self.alpha * y).collect();
        write(st, out, &r)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnAddGetWorkspaceSize(
    self_: *const aclTensor,
    other: *const aclTensor,
    alpha: *const aclScalar,
    out: *mut aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnAdd", workspaceSize, executor, |st| {
        let op = "aclnnAdd";
        let a = st.tensor(self_, "self")?;
        let b = st.tensor(other, "other")?;
        let o = st.tensor(out, "out")?;
        let alpha = st.scalar(alpha, "alpha")?;
        for (w, v) in [("self", &a), ("other", &b), ("out", &o)] {
            dtype_in(op, w, v, NUMERIC)?;
            nd(op, w, v)?;
        }
        if a.dtype != b.dtype || a.dtype != o.dtype {
            return invalid(
                op,
                format!(
                    "self {}, other {}, out {}: this emulation needs one dtype",
                    a.dtype.name(),
                    b.dtype.name(),
                    o.dtype.name()
                ),
            );
        }
        let shape = broadcast_shape(op, &a.dims, &b.dims)?;
        if shape != o.dims {
            return invalid(
                op,
                format!(
                    "out shape {:?} is not the broadcast shape {shape:?}",
                    o.dims
                ),
            );
        }
        Ok(Box::new(Add {
            io: Io {
                ins: vec![a, b],
                outs: vec![o],
            },
            alpha,
            inplace: false,
        }))
    })
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnInplaceAddGetWorkspaceSize(
    selfRef: *const aclTensor,
    other: *const aclTensor,
    alpha: *const aclScalar,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnInplaceAdd", workspaceSize, executor, |st| {
        let op = "aclnnInplaceAdd";
        let a = st.tensor(selfRef, "selfRef")?;
        let b = st.tensor(other, "other")?;
        let alpha = st.scalar(alpha, "alpha")?;
        for (w, v) in [("selfRef", &a), ("other", &b)] {
            dtype_in(op, w, v, NUMERIC)?;
            nd(op, w, v)?;
        }
        if a.dtype != b.dtype {
            return invalid(
                op,
                format!(
                    "selfRef {} and other {}: this emulation needs one dtype",
                    a.dtype.name(),
                    b.dtype.name()
                ),
            );
        }
        if broadcast_shape(op, &a.dims, &b.dims)? != a.dims {
            return invalid(
                op,
                format!("other {:?} must broadcast to selfRef {:?}", b.dims, a.dims),
            );
        }
        Ok(Box::new(Add {
            io: Io {
                ins: vec![b],
                outs: vec![a],
            },
            alpha,
            inplace: true,
        }))
    })
}

// ---- Cast -----------------------------------------------------------------------------------

#[derive(Clone)]
struct Cast {
    io: Io,
}

impl Kernel for Cast {
    kernel_common!("aclnnCast");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let mut x = read(st, &self.io.ins[0])?;
        if !self.io.outs[0].dtype.is_float() {
            x.iter_mut().for_each(|v| *v = v.trunc());
        }
        write(st, &self.io.outs[0], &x)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnCastGetWorkspaceSize(
    self_: *const aclTensor,
    dtype: aclDataType,
    out: *mut aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnCast", workspaceSize, executor, |st| {
        let op = "aclnnCast";
        let a = st.tensor(self_, "self")?;
        let o = st.tensor(out, "out")?;
        let allowed = [
            DType::F32,
            DType::F16,
            DType::Bf16,
            DType::I32,
            DType::I64,
            DType::I8,
            DType::U8,
            DType::Bool,
        ];
        dtype_in(op, "self", &a, &allowed)?;
        dtype_in(op, "out", &o, &allowed)?;
        if DType::from_acl(dtype) != Some(o.dtype) {
            return invalid(
                op,
                format!("dtype {dtype} differs from out's {}", o.dtype.name()),
            );
        }
        if a.dims != o.dims {
            return invalid(
                op,
                format!("out shape {:?} differs from self {:?}", o.dims, a.dims),
            );
        }
        Ok(Box::new(Cast {
            io: Io {
                ins: vec![a],
                outs: vec![o],
            },
        }))
    })
}

// ---- InplaceCopy ----------------------------------------------------------------------------

#[derive(Clone)]
struct InplaceCopy {
    io: Io,
}

impl Kernel for InplaceCopy {
    kernel_common!("aclnnInplaceCopy");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let dst = &self.io.outs[0];
        let mut x = read(st, &broadcast_to(self.name(), &self.io.ins[0], &dst.dims)?)?;
        if !dst.dtype.is_float() {
            x.iter_mut().for_each(|v| *v = v.trunc());
        }
        write(st, dst, &x)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnInplaceCopyGetWorkspaceSize(
    selfRef: *mut aclTensor,
    src: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnInplaceCopy", workspaceSize, executor, |st| {
        let op = "aclnnInplaceCopy";
        let d = st.tensor(selfRef, "selfRef")?;
        let s = st.tensor(src, "src")?;
        let allowed = [
            DType::F32,
            DType::F16,
            DType::Bf16,
            DType::I32,
            DType::I64,
            DType::I8,
            DType::U8,
            DType::Bool,
        ];
        dtype_in(op, "selfRef", &d, &allowed)?;
        dtype_in(op, "src", &s, &allowed)?;
        nd(op, "selfRef", &d)?;
        nd(op, "src", &s)?;
        if broadcast_shape(op, &d.dims, &s.dims)? != d.dims {
            return invalid(
                op,
                format!(
                    "src {:?} does not broadcast to selfRef {:?}",
                    s.dims, d.dims
                ),
            );
        }
        // Overlapping source and destination memory gives undefined results on the device.
        let (da, db) = (d.addr, d.addr + d.storage_bytes());
        let (sa, sb) = (s.addr, s.addr + s.storage_bytes());
        let same = d.addr == s.addr && d.key() == s.key();
        if da < sb && sa < db && !same {
            let overlap = {
                let mut dst_pos = std::collections::HashSet::new();
                d.for_each_position(|p| {
                    dst_pos.insert(p);
                });
                let mut hit = false;
                if d.dtype == s.dtype && d.addr == s.addr {
                    s.for_each_position(|p| hit |= dst_pos.contains(&p));
                } else {
                    hit = true;
                }
                hit
            };
            if overlap {
                return invalid(
                    op,
                    "src and selfRef overlap in memory (the result would be undefined)",
                );
            }
        }
        Ok(Box::new(InplaceCopy {
            io: Io {
                ins: vec![s],
                outs: vec![d],
            },
        }))
    })
}

// ---- RmsNorm --------------------------------------------------------------------------------

#[derive(Clone)]
struct RmsNorm {
    io: Io,
    eps: f64,
}

impl Kernel for RmsNorm {
    kernel_common!("aclnnRmsNorm");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let x = read(st, &self.io.ins[0])?;
        let g = read(st, &self.io.ins[1])?;
        let n = g.len();
        let mut y = vec![0.0; x.len()];
        let mut rstd = Vec::with_capacity(x.len() / n.max(1));
        for (xr, yr) in x.chunks(n).zip(y.chunks_mut(n)) {
            let ms = xr
                .iter()
                .map(|v| (*v as f32 as f64) * (*v as f32 as f64))
                .sum::<f64>()
                / n as f64;
            let r = 1.0 / (ms + self.eps).sqrt();
            for i in 0..n {
                yr[i] = xr[i] * r * g[i];
            }
            rstd.push(r);
        }
        write(st, &self.io.outs[0], &y)?;
        write(st, &self.io.outs[1], &rstd)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnRmsNormGetWorkspaceSize(
    x: *const aclTensor,
    gamma: *const aclTensor,
    epsilon: f64,
    yOut: *const aclTensor,
    rstdOut: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnRmsNorm", workspaceSize, executor, |st| {
        let op = "aclnnRmsNorm";
        let x = st.tensor(x, "x")?;
        let g = st.tensor(gamma, "gamma")?;
        let y = st.tensor(yOut, "yOut")?;
        let r = st.tensor(rstdOut, "rstdOut")?;
        for (w, v) in [("x", &x), ("gamma", &g), ("yOut", &y), ("rstdOut", &r)] {
            nd(op, w, v)?;
        }
        // An f32 gamma with 16-bit x is listed as a combination only by the pages of CANN 8.5
        // and later; the 8.x pages before list each parameter's types alone (and a caller saw
        // 8.x refuse the mix), so older emulated releases refuse it.
        let mixed = crate::install::emulated_release_at_least(8, 5);
        let ok = matches!(
            (x.dtype, g.dtype, y.dtype, r.dtype),
            (DType::F16, DType::F16, DType::F16, DType::F32)
                | (DType::Bf16, DType::Bf16, DType::Bf16, DType::F32)
                | (DType::F32, DType::F32, DType::F32, DType::F32)
        ) || (mixed
            && matches!(
                (x.dtype, g.dtype, y.dtype, r.dtype),
                (DType::F16, DType::F32, DType::F16, DType::F32)
                    | (DType::Bf16, DType::F32, DType::Bf16, DType::F32)
            ));
        if !ok {
            return invalid(
                op,
                format!(
                    "dtypes x {} gamma {} yOut {} rstdOut {} are not a documented combination \
                     (in CANN {})",
                    x.dtype.name(),
                    g.dtype.name(),
                    y.dtype.name(),
                    r.dtype.name(),
                    crate::install::emulated_version()
                ),
            );
        }
        let gn = g.rank();
        if gn == 0 || gn > x.rank() || x.dims[x.rank() - gn..] != g.dims[..] {
            return invalid(
                op,
                format!(
                    "gamma shape {:?} must equal the trailing dimensions of x {:?}",
                    g.dims, x.dims
                ),
            );
        }
        if y.dims != x.dims {
            return invalid(
                op,
                format!("yOut shape {:?} differs from x {:?}", y.dims, x.dims),
            );
        }
        let mut rd = x.dims.clone();
        let rk = rd.len();
        rd[rk - gn..].iter_mut().for_each(|d| *d = 1);
        if r.dims != rd {
            return invalid(op, format!("rstdOut shape {:?} must be {rd:?}", r.dims));
        }
        if epsilon.is_nan() || epsilon <= 0.0 {
            return invalid(op, format!("epsilon {epsilon} must be positive"));
        }
        Ok(Box::new(RmsNorm {
            io: Io {
                ins: vec![x, g],
                outs: vec![y, r],
            },
            eps: epsilon,
        }))
    })
}

// ---- SwiGlu ---------------------------------------------------------------------------------

#[derive(Clone)]
struct SwiGlu {
    io: Io,
    dim: usize,
}

impl Kernel for SwiGlu {
    kernel_common!("aclnnSwiGlu");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let x = &self.io.ins[0];
        let half = x.dims[self.dim] / 2;
        let (mut a, mut b) = (x.clone(), x.clone());
        a.dims[self.dim] = half;
        b.dims[self.dim] = half;
        b.offset += half * x.strides[self.dim];
        let (a, b) = (read(st, &a)?, read(st, &b)?);
        let out: Vec<f64> = a
            .iter()
            .zip(&b)
            .map(|(a, b)| a / (1.0 + (-a).exp()) * b)
            .collect();
        write(st, &self.io.outs[0], &out)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnSwiGluGetWorkspaceSize(
    x: *const aclTensor,
    dim: i64,
    out: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnSwiGlu", workspaceSize, executor, |st| {
        let op = "aclnnSwiGlu";
        let x = st.tensor(x, "x")?;
        let o = st.tensor(out, "out")?;
        dtype_in(op, "x", &x, FLOATS)?;
        if o.dtype != x.dtype {
            return invalid(op, "out must have x's data type");
        }
        super::contiguity::check(op, &[("x", &x), ("out", &o)])?;
        let r = x.rank() as i64;
        if r == 0 || dim < -r || dim >= r {
            return invalid(op, format!("dim {dim} outside [-{r}, {}]", r - 1));
        }
        let d = dim.rem_euclid(r) as usize;
        if x.dims[d] % 2 != 0 {
            return invalid(op, format!("x dimension {d} ({}) must be even", x.dims[d]));
        }
        let mut od = x.dims.clone();
        od[d] /= 2;
        if o.dims != od {
            return invalid(op, format!("out shape {:?} must be {od:?}", o.dims));
        }
        Ok(Box::new(SwiGlu {
            io: Io {
                ins: vec![x],
                outs: vec![o],
            },
            dim: d,
        }))
    })
}

// ---- Embedding ------------------------------------------------------------------------------

#[derive(Clone)]
struct Embedding {
    io: Io,
}

impl Kernel for Embedding {
    kernel_common!("aclnnEmbedding");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let (w, idx, out) = (&self.io.ins[0], &self.io.ins[1], &self.io.outs[0]);
        let ids = read(st, idx)?;
        let (rows, n) = (w.dims[0], w.dims[1]);
        let mut vals = Vec::with_capacity(ids.len() * n as usize);
        for &i in &ids {
            let i = i as i64;
            if i < 0 || i >= rows {
                return fail(
                    ACL_ERROR_RT_AICORE_EXCEPTION,
                    format!("aclnnEmbedding: index {i} outside [0, {rows})"),
                );
            }
            let mut row = w.clone();
            row.dims = vec![n];
            row.strides = vec![w.strides[1]];
            row.offset = w.offset + i * w.strides[0];
            vals.extend(read(st, &row)?);
        }
        write(st, out, &vals)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnEmbeddingGetWorkspaceSize(
    weight: *const aclTensor,
    indices: *const aclTensor,
    out: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnEmbedding", workspaceSize, executor, |st| {
        let op = "aclnnEmbedding";
        let w = st.tensor(weight, "weight")?;
        let i = st.tensor(indices, "indices")?;
        let o = st.tensor(out, "out")?;
        if w.rank() != 2 {
            return invalid(op, format!("weight must be 2-D, got {:?}", w.dims));
        }
        dtype_in(
            op,
            "weight",
            &w,
            &[
                DType::F32,
                DType::F16,
                DType::Bf16,
                DType::I32,
                DType::I64,
                DType::I8,
                DType::U8,
            ],
        )?;
        dtype_in(op, "indices", &i, &[DType::I32, DType::I64])?;
        if o.dtype != w.dtype {
            return invalid(op, "out must have weight's data type");
        }
        let mut od = i.dims.clone();
        od.push(w.dims[1]);
        if o.dims != od {
            return invalid(
                op,
                format!(
                    "out shape {:?} must be indices shape + [embedding dim] = {od:?}",
                    o.dims
                ),
            );
        }
        Ok(Box::new(Embedding {
            io: Io {
                ins: vec![w, i],
                outs: vec![o],
            },
        }))
    })
}

// ---- ArgMax ---------------------------------------------------------------------------------

#[derive(Clone)]
struct ArgMax {
    io: Io,
    dim: usize,
}

impl Kernel for ArgMax {
    kernel_common!("aclnnArgMax");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let x = &self.io.ins[0];
        let vals = read(st, x)?;
        let inner: i64 = x.dims[self.dim + 1..].iter().product();
        let len = x.dims[self.dim];
        let outer: i64 = x.dims[..self.dim].iter().product();
        let mut res = Vec::new();
        for o in 0..outer {
            for i in 0..inner {
                let mut best = (f64::NEG_INFINITY, 0i64);
                for k in 0..len {
                    let v = vals[((o * len + k) * inner + i) as usize];
                    if v > best.0 || (v.is_nan() && !best.0.is_nan()) {
                        best = (v, k);
                    }
                }
                res.push(best.1 as f64);
            }
        }
        write(st, &self.io.outs[0], &res)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnArgMaxGetWorkspaceSize(
    self_: *const aclTensor,
    dim: i64,
    keepdim: bool,
    out: *mut aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnArgMax", workspaceSize, executor, |st| {
        let op = "aclnnArgMax";
        let x = st.tensor(self_, "self")?;
        let o = st.tensor(out, "out")?;
        dtype_in(
            op,
            "self",
            &x,
            &[DType::F32, DType::F16, DType::Bf16, DType::I32, DType::I64],
        )?;
        dtype_in(op, "out", &o, &[DType::I64])?;
        let r = x.rank() as i64;
        if r == 0 || dim < -r || dim >= r {
            return invalid(op, format!("dim {dim} outside [-{r}, {}]", r - 1));
        }
        let d = dim.rem_euclid(r) as usize;
        let mut od = x.dims.clone();
        if keepdim {
            od[d] = 1;
        } else {
            od.remove(d);
        }
        if o.dims != od {
            return invalid(op, format!("out shape {:?} must be {od:?}", o.dims));
        }
        Ok(Box::new(ArgMax {
            io: Io {
                ins: vec![x],
                outs: vec![o],
            },
            dim: d,
        }))
    })
}

// ---- rotary position embedding ----------------------------------------------------------------

/// Rotates `x` rows of length `d`: half mode `[-x2, x1]`, interleave mode pairs `(-x1, x0)`.
fn rotate(x: &[f64], cos: &[f64], sin: &[f64], d: usize, interleave: bool) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    for (r, row) in x.chunks(d).enumerate() {
        for i in 0..d {
            let rot = if interleave {
                if i % 2 == 0 {
                    -row[i + 1]
                } else {
                    row[i - 1]
                }
            } else if i < d / 2 {
                -row[i + d / 2]
            } else {
                row[i - d / 2]
            };
            let k = r * d + i;
            out[k] = row[i] * cos[k] + rot * sin[k];
        }
    }
    out
}

#[derive(Clone)]
struct ApplyRope {
    io: Io,
}

impl Kernel for ApplyRope {
    kernel_common!("aclnnApplyRotaryPosEmb");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let (cos, sin) = (&self.io.ins[0], &self.io.ins[1]);
        for t in &self.io.outs {
            let x = read(st, t)?;
            let c = read(st, &broadcast_to(self.name(), cos, &t.dims)?)?;
            let s = read(st, &broadcast_to(self.name(), sin, &t.dims)?)?;
            let y = rotate(&x, &c, &s, t.dims[3] as usize, false);
            write(st, t, &y)?;
        }
        Ok(())
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnApplyRotaryPosEmbGetWorkspaceSize(
    queryRef: *mut aclTensor,
    keyRef: *mut aclTensor,
    cos: *const aclTensor,
    sin: *const aclTensor,
    layout: i64,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnApplyRotaryPosEmb", workspaceSize, executor, |st| {
        let op = "aclnnApplyRotaryPosEmb";
        let q = st.tensor(queryRef, "queryRef")?;
        let k = st.tensor(keyRef, "keyRef")?;
        let c = st.tensor(cos, "cos")?;
        let s = st.tensor(sin, "sin")?;
        if layout != 1 {
            return invalid(op, format!("layout {layout} is not supported (1 = BSND)"));
        }
        for (w, v) in [("queryRef", &q), ("keyRef", &k), ("cos", &c), ("sin", &s)] {
            dtype_in(op, w, v, FLOATS)?;
            if v.rank() != 4 {
                return invalid(op, format!("{w} must be 4-D (BSND), got {:?}", v.dims));
            }
            if v.dtype != q.dtype {
                return invalid(op, "queryRef, keyRef, cos and sin must share one data type");
            }
        }
        let (b, s_, d) = (q.dims[0], q.dims[1], q.dims[3]);
        if k.dims[0] != b || k.dims[1] != s_ || k.dims[3] != d || d % 2 != 0 {
            return invalid(
                op,
                format!(
                    "queryRef {:?} and keyRef {:?} must share B, S and an even D",
                    q.dims, k.dims
                ),
            );
        }
        // The page: the last dimension D of queryRef, keyRef, cos and sin must equal 128.
        if d != 128 {
            return invalid(op, format!("D = {d}: queryRef, keyRef, cos and sin must have a last dimension of exactly 128"));
        }
        // The page's UB bound: (q_n + k_n) heads of 128 (with the 16/32-bit staging it lists)
        // must fit the AI core's unified buffer (192 KiB on Atlas A2/A3).
        let (cast, cast_size, dtype_size) = match q.dtype {
            DType::Bf16 => (1, 4, 2),
            DType::F16 => (0, 2, 2),
            _ => (0, 4, 4),
        };
        let heads = q.dims[2] + k.dims[2];
        let ub = heads * 128 * cast_size * 5 + 128 * dtype_size * 4 + cast * 128 * 4 * 2;
        if ub > UB_BYTES {
            return invalid(op, format!("q_n + k_n = {heads} heads need {ub} bytes of unified buffer; more than the {UB_BYTES} there are"));
        }
        for (w, v) in [("cos", &c), ("sin", &s)] {
            if v.dims != [b, s_, 1, d] {
                return invalid(
                    op,
                    format!(
                        "{w} shape {:?} must be (B, S, 1, D) = {:?}",
                        v.dims,
                        [b, s_, 1, d]
                    ),
                );
            }
        }
        Ok(Box::new(ApplyRope {
            io: Io {
                ins: vec![c, s],
                outs: vec![q, k],
            },
        }))
    })
}

#[derive(Clone)]
struct Rope {
    io: Io,
    interleave: bool,
}

impl Kernel for Rope {
    kernel_common!("aclnnRotaryPositionEmbedding");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let x = &self.io.ins[0];
        let xs = read(st, x)?;
        let c = read(st, &broadcast_to(self.name(), &self.io.ins[1], &x.dims)?)?;
        let s = read(st, &broadcast_to(self.name(), &self.io.ins[2], &x.dims)?)?;
        let y = rotate(&xs, &c, &s, x.dims[3] as usize, self.interleave);
        write(st, &self.io.outs[0], &y)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnRotaryPositionEmbeddingGetWorkspaceSize(
    x: *const aclTensor,
    cos: *const aclTensor,
    sin: *const aclTensor,
    mode: i64,
    out: *mut aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare(
        "aclnnRotaryPositionEmbedding",
        workspaceSize,
        executor,
        |st| {
            let op = "aclnnRotaryPositionEmbedding";
            let x = st.tensor(x, "x")?;
            let c = st.tensor(cos, "cos")?;
            let s = st.tensor(sin, "sin")?;
            let o = st.tensor(out, "out")?;
            for (w, v) in [("x", &x), ("cos", &c), ("sin", &s), ("out", &o)] {
                dtype_in(op, w, v, FLOATS)?;
                if v.rank() != 4 {
                    return invalid(op, format!("{w} must be 4-D, got {:?}", v.dims));
                }
                if v.dtype != x.dtype {
                    return invalid(op, "x, cos, sin and out must share one data type");
                }
            }
            super::contiguity::check(op, &[("x", &x), ("cos", &c), ("sin", &s), ("out", &o)])?;
            let interleave = match mode {
            0 => false,
            1 => true,
            2 | 3 => return invalid(op, format!("mode {mode} (quarter / interleave-half) is not implemented by this emulation")),
            _ => return invalid(op, format!("mode {mode} is not documented (0 half, 1 interleave, 2 quarter, 3 interleave-half)")),
        };
            let d = x.dims[3];
            if d % 2 != 0 || d >= 896 {
                return invalid(op, format!("D = {d} must be even and below 896"));
            }
            if o.dims != x.dims || c.dims != s.dims {
                return invalid(
                    op,
                    format!(
                        "out {:?} must equal x {:?}, and cos {:?} must equal sin {:?}",
                        o.dims, x.dims, c.dims, s.dims
                    ),
                );
            }
            if c.dims[3] != d || (0..3).any(|i| c.dims[i] != 1 && c.dims[i] != x.dims[i]) {
                return invalid(
                    op,
                    format!("cos/sin shape {:?} does not fit x {:?}", c.dims, x.dims),
                );
            }
            Ok(Box::new(Rope {
                io: Io {
                    ins: vec![x, c, s],
                    outs: vec![o],
                },
                interleave,
            }))
        },
    )
}

const _: () = {
    use npu_ffi::aclnn::ops::sig;
    let _: sig::aclnnAddGetWorkspaceSize = aclnnAddGetWorkspaceSize;
    let _: sig::aclnnInplaceAddGetWorkspaceSize = aclnnInplaceAddGetWorkspaceSize;
    let _: sig::aclnnCastGetWorkspaceSize = aclnnCastGetWorkspaceSize;
    let _: sig::aclnnInplaceCopyGetWorkspaceSize = aclnnInplaceCopyGetWorkspaceSize;
    let _: sig::aclnnRmsNormGetWorkspaceSize = aclnnRmsNormGetWorkspaceSize;
    let _: sig::aclnnSwiGluGetWorkspaceSize = aclnnSwiGluGetWorkspaceSize;
    let _: sig::aclnnEmbeddingGetWorkspaceSize = aclnnEmbeddingGetWorkspaceSize;
    let _: sig::aclnnArgMaxGetWorkspaceSize = aclnnArgMaxGetWorkspaceSize;
    let _: sig::aclnnApplyRotaryPosEmbGetWorkspaceSize = aclnnApplyRotaryPosEmbGetWorkspaceSize;
    let _: sig::aclnnRotaryPositionEmbeddingGetWorkspaceSize =
        aclnnRotaryPositionEmbeddingGetWorkspaceSize;
};

//! AddRmsNorm: a residual add folded into the RmsNorm after it (`xOut = x1 + x2`, `yOut` the
//! RmsNorm of `xOut` times `gamma`, `rstdOut` the reciprocal RMS of each row), with the rules of
//! its aclnn page (ops-nn `norm/add_rms_norm/docs/aclnnAddRmsNorm.md`; the 8.x pages at
//! hiascend.com) for the CANN releases the backend supports:
//!
//! - x1, x2, gamma, yOut, rstdOut and xOut non-null (the 8.x pages list no null output);
//! - x1 FLOAT32, FLOAT16 or BFLOAT16; x2, gamma, yOut and xOut of x1's type; rstdOut FLOAT32;
//! - 1–8 dimensions, format ND; x2, yOut and xOut of x1's shape; gamma the trailing dimensions
//!   of x1 (the normalised ones); rstdOut x1's shape with those dimensions 1;
//! - no empty tensor, no non-contiguous x1, x2, yOut or xOut (the 8.2 and 8.3 pages: "不支持非连续
//!   的Tensor, 不支持空Tensor"); epsilon not negative (the tiling refuses `epsilon < 0`);
//! - no output sharing memory with an input or another output, except the pairing of
//!   aclnnInplaceAddRmsNorm, whose documented in-place form (x1 becomes the norm, x2 the sum) runs
//!   the same tiling and kernels (ops-nn `add_rms_norm_tiling.cpp` registers Tiling4AddRmsNorm for
//!   both): `xOut` exactly `x2` and/or `yOut` exactly `x1`. Any other overlap is refused: the
//!   kernel for rows wider than its unified-buffer tile (split D) reads x1 and x2 again after
//!   writing a part of its outputs.
//!
//! The maths is the kernel's: the sum is rounded to the tensors' type before it is normalised
//! (FLOAT16 adds in FLOAT16; BFLOAT16 adds in FLOAT32 and casts back "for precision"), then the
//! norm is RmsNorm's, as the emulated aclnnRmsNorm computes it over the rounded sum.

use npu_ffi::types::*;

use super::{dtype_in, invalid, kernel_common, nd, prepare, read, write, Io, Kernel};
use crate::state::*;
use crate::view::{DType, View};

const OP: &str = "aclnnAddRmsNorm";
const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::Bf16];

#[derive(Clone)]
struct AddRmsNorm {
    io: Io,
    eps: f64,
}

impl Kernel for AddRmsNorm {
    kernel_common!("aclnnAddRmsNorm");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let x1 = read(st, &self.io.ins[0])?;
        let x2 = read(st, &self.io.ins[1])?;
        let g = read(st, &self.io.ins[2])?;
        let (y_out, rstd_out, x_out) = (&self.io.outs[0], &self.io.outs[1], &self.io.outs[2]);
        let sum: Vec<f64> = x1.iter().zip(&x2).map(|(a, b)| a + b).collect();
        // xOut first (it may be x2 itself, read above); the norm reads the stored, rounded sum.
        write(st, x_out, &sum)?;
        let x = read(st, x_out)?;
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
        write(st, y_out, &y)?;
        write(st, rstd_out, &rstd)
    }
}

/// The byte range `[start, end)` a view touches (empty views touch nothing).
fn touched(v: &View) -> Option<(u64, u64)> {
    let size = v.dtype.bits().div_ceil(8).max(1);
    let first = v.offset;
    let last = v.max_elem()?;
    Some((
        v.addr + first as u64 * size,
        v.addr + (last as u64 + 1) * size,
    ))
}

fn overlap(a: &View, b: &View) -> bool {
    match (touched(a), touched(b)) {
        (Some((a0, a1)), Some((b0, b1))) => a0 < b1 && b0 < a1,
        _ => false,
    }
}

/// The same tensor: storage, offset, shape, strides and type.
fn same(a: &View, b: &View) -> bool {
    a.addr == b.addr
        && a.offset == b.offset
        && a.dims == b.dims
        && a.strides == b.strides
        && a.dtype == b.dtype
}

/// Refuses outputs that overlap an input or each other, but for the in-place pairing of
/// aclnnInplaceAddRmsNorm (`xOut` exactly `x2`, `yOut` exactly `x1`).
fn check_aliasing(ins: &[(&str, &View)], outs: &[(&str, &View)]) -> Result<(), Fail> {
    const ALLOWED: &[(&str, &str)] = &[("xOut", "x2"), ("yOut", "x1")];
    for (i, (on, o)) in outs.iter().enumerate() {
        for (n, v) in ins {
            if overlap(o, v) && !(ALLOWED.contains(&(*on, *n)) && same(o, v)) {
                return invalid(
                    OP,
                    format!(
                        "{on} shares memory with {n}; only the in-place pairing of \
                         aclnnInplaceAddRmsNorm (xOut exactly x2, yOut exactly x1) is documented"
                    ),
                );
            }
        }
        for (n, v) in &outs[i + 1..] {
            if overlap(o, v) {
                return invalid(OP, format!("outputs {on} and {n} share memory"));
            }
        }
    }
    Ok(())
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aclnnAddRmsNormGetWorkspaceSize(
    x1: *const aclTensor,
    x2: *const aclTensor,
    gamma: *const aclTensor,
    epsilon: f64,
    yOut: *const aclTensor,
    rstdOut: *const aclTensor,
    xOut: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare(OP, workspaceSize, executor, |st| {
        let a = st.tensor(x1, "x1")?;
        let b = st.tensor(x2, "x2")?;
        let g = st.tensor(gamma, "gamma")?;
        let y = st.tensor(yOut, "yOut")?;
        let r = st.tensor(rstdOut, "rstdOut")?;
        let x = st.tensor(xOut, "xOut")?;
        let all = [
            ("x1", &a),
            ("x2", &b),
            ("gamma", &g),
            ("yOut", &y),
            ("rstdOut", &r),
            ("xOut", &x),
        ];
        for (w, v) in all {
            nd(OP, w, v)?;
            if v.rank() == 0 || v.rank() > 8 {
                return invalid(OP, format!("{w} has {} dimensions (1 to 8)", v.rank()));
            }
            if v.numel() == 0 {
                return invalid(OP, format!("{w} {:?} is empty (not supported)", v.dims));
            }
        }
        dtype_in(OP, "x1", &a, FLOATS)?;
        for (w, v) in [("x2", &b), ("gamma", &g), ("yOut", &y), ("xOut", &x)] {
            if v.dtype != a.dtype {
                return invalid(
                    OP,
                    format!(
                        "{w} is {} and x1 {}: they must have one data type",
                        v.dtype.name(),
                        a.dtype.name()
                    ),
                );
            }
        }
        dtype_in(OP, "rstdOut", &r, &[DType::F32])?;
        for (w, v) in [("x2", &b), ("yOut", &y), ("xOut", &x)] {
            if v.dims != a.dims {
                return invalid(
                    OP,
                    format!("{w} shape {:?} differs from x1 {:?}", v.dims, a.dims),
                );
            }
        }
        let gn = g.rank();
        if gn > a.rank() || a.dims[a.rank() - gn..] != g.dims[..] {
            return invalid(
                OP,
                format!(
                    "gamma shape {:?} must equal the trailing dimensions of x1 {:?}",
                    g.dims, a.dims
                ),
            );
        }
        let mut rd = a.dims.clone();
        let rk = rd.len();
        rd[rk - gn..].iter_mut().for_each(|d| *d = 1);
        if r.dims != rd {
            return invalid(OP, format!("rstdOut shape {:?} must be {rd:?}", r.dims));
        }
        for (w, v) in [("x1", &a), ("x2", &b), ("yOut", &y), ("xOut", &x)] {
            if !v.is_contiguous() {
                return invalid(
                    OP,
                    format!(
                        "{w} {:?} with strides {:?} is not contiguous; the page says {w} does \
                         not support non-contiguous tensors",
                        v.dims, v.strides
                    ),
                );
            }
        }
        if epsilon.is_nan() || epsilon < 0.0 {
            return invalid(OP, format!("epsilon {epsilon} must not be negative"));
        }
        check_aliasing(
            &[("x1", &a), ("x2", &b), ("gamma", &g)],
            &[("yOut", &y), ("rstdOut", &r), ("xOut", &x)],
        )?;
        Ok(Box::new(AddRmsNorm {
            io: Io {
                ins: vec![a, b, g],
                outs: vec![y, r, x],
            },
            eps: epsilon,
        }))
    })
}

const _: () = {
    use npu_ffi::aclnn::ops::sig;
    let _: sig::aclnnAddRmsNormGetWorkspaceSize = aclnnAddRmsNormGetWorkspaceSize;
};

#[cfg(test)]
mod tests {
    use super::*;

    fn view(addr: u64, offset: i64, dims: &[i64]) -> View {
        let mut strides = vec![1i64; dims.len()];
        for i in (0..dims.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * dims[i + 1];
        }
        View {
            dims: dims.to_vec(),
            strides,
            offset,
            dtype: DType::F16,
            format: ACL_FORMAT_ND,
            storage_dims: vec![1 << 20],
            addr,
        }
    }

    #[test]
    fn only_the_in_place_pairing_may_share_memory() {
        let (x1, x2) = (view(0x1000, 0, &[2, 8]), view(0x2000, 0, &[2, 8]));
        let g = view(0x3000, 0, &[8]);
        let r = view(0x4000, 0, &[2, 1]);
        let y = view(0x5000, 0, &[2, 8]);
        let ins = [("x1", &x1), ("x2", &x2), ("gamma", &g)];
        // xOut exactly x2 (the residual updated in place): the documented pairing.
        check_aliasing(&ins, &[("yOut", &y), ("rstdOut", &r), ("xOut", &x2)]).unwrap();
        // xOut exactly x1: not the pairing (split-D would re-read x1 after writing it).
        let e = check_aliasing(&ins, &[("yOut", &y), ("rstdOut", &r), ("xOut", &x1)]);
        assert_eq!(e.unwrap_err().code, ACLNN_ERR_PARAM_INVALID);
        // A partial overlap of x2 (one row further on).
        let shifted = view(0x2000, 8, &[2, 8]);
        assert!(
            check_aliasing(&ins, &[("yOut", &y), ("rstdOut", &r), ("xOut", &shifted)]).is_err()
        );
        // yOut on xOut.
        let x = view(0x6000, 0, &[2, 8]);
        assert!(check_aliasing(&ins, &[("yOut", &x), ("rstdOut", &r), ("xOut", &x)]).is_err());
        // Separate outputs.
        check_aliasing(&ins, &[("yOut", &y), ("rstdOut", &r), ("xOut", &x)]).unwrap();
    }
}

//! The operators of the newer model families: GeluV2 (GELU, `approximate` 0 = erf, 1 = tanh),
//! InplaceMul (`selfRef *= other`, other broadcast to selfRef) and InplaceMuls (`selfRef *=`
//! a host scalar), with the rules of their aclnn pages:
//!
//! - GeluV2: x and y FLOAT, FLOAT16 or BFLOAT16, one data type and one shape, ND; `approximate`
//!   0 or 1 (the page documents no other value). The kernel casts 16-bit inputs to f32, computes
//!   the tanh form as `x / (1 + exp(-sqrt(8/pi)·(x + 0.044715·x³)))` and rounds the result back
//!   (round to nearest), which is what this emulation does.
//! - InplaceMul: selfRef and other of the documented numeric types; other broadcasts to selfRef
//!   and the broadcast shape is selfRef's; the promoted type must convert to selfRef's (a float
//!   operand into an integer selfRef does not); at most 8 dimensions.
//! - InplaceMuls: selfRef of the documented types, at most 8 dimensions, ND; a float scalar
//!   promotes an integer selfRef to a float type that cannot be stored back into it (refused);
//!   the scalar keeps its f32 value ("other参数对于float无精度损失").

use npu_ffi::types::*;

use super::elementwise::{broadcast_shape, broadcast_to};
use super::{dtype_in, invalid, kernel_common, nd, prepare, read, read_f32, write, Io, Kernel};
use crate::state::*;
use crate::view::DType;

const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::Bf16];
/// The documented types of Mul/Muls the emulation can hold (DOUBLE, INT16 and the complex
/// types are documented too but not emulated).
const MUL_TYPES: &[DType] = &[
    DType::F32,
    DType::F16,
    DType::Bf16,
    DType::I32,
    DType::I64,
    DType::I8,
    DType::U8,
    DType::Bool,
];
/// "shape维度不高于8维".
const MAX_RANK: usize = 8;

fn rank_at_most_8(op: &str, what: &str, dims: &[i64]) -> Result<(), Fail> {
    if dims.len() > MAX_RANK {
        return invalid(
            op,
            format!(
                "{what} has {} dimensions {dims:?}; at most {MAX_RANK}",
                dims.len()
            ),
        );
    }
    Ok(())
}

// ---- GeluV2 ---------------------------------------------------------------------------------

/// GELU's tanh form as the kernel computes it, in f32.
pub(crate) fn gelu_tanh_device(x: f32) -> f32 {
    const NEG_SQRT_EIGHT_OVER_PI: f32 = -1.595_769 * 0.044_715;
    const TANH_APPROX_FACTOR: f32 = 1.0 / 0.044_715;
    let cub = x * x * x + TANH_APPROX_FACTOR * x;
    x / (1.0 + (cub * NEG_SQRT_EIGHT_OVER_PI).exp())
}

/// erf(x) in f64: its Taylor series below |x| = 2.5, erfc's continued fraction above (error far
/// below f32's resolution).
fn erf(x: f64) -> f64 {
    let s = x.signum();
    let a = x.abs();
    if a > 6.0 {
        return s;
    }
    let r = if a < 2.5 {
        // Σ (−1)ⁿ a^(2n+1) / (n! (2n + 1)): terms fall below 1e-17 of the sum by n = 60.
        let (mut term, mut sum) = (a, a);
        let x2 = a * a;
        for n in 1..80 {
            let n = n as f64;
            term *= -x2 / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc(a) = exp(-a²)/sqrt(pi) · 1/(a + 1/2/(a + 1/(a + 3/2/(a + ...)))).
        let mut f = a;
        for k in (1..60).rev() {
            f = a + (k as f64 / 2.0) / f;
        }
        1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * f)
    };
    s * r
}

#[derive(Clone)]
struct GeluV2 {
    io: Io,
    tanh: bool,
}

impl Kernel for GeluV2 {
    kernel_common!("aclnnGeluV2");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let x = read_f32(st, &self.io.ins[0])?;
        let y: Vec<f64> = x
            .iter()
            .map(|&v| {
                if self.tanh {
                    gelu_tanh_device(v) as f64
                } else {
                    (0.5 * v as f64 * (1.0 + erf(v as f64 / std::f64::consts::SQRT_2))) as f32
                        as f64
                }
            })
            .collect();
        write(st, &self.io.outs[0], &y)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnGeluV2GetWorkspaceSize(
    x: *const aclTensor,
    approximate: i64,
    y: *mut aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnGeluV2", workspaceSize, executor, |st| {
        let op = "aclnnGeluV2";
        let xv = st.tensor(x, "x")?;
        let yv = st.tensor(y, "y")?;
        dtype_in(op, "x", &xv, FLOATS)?;
        nd(op, "x", &xv)?;
        nd(op, "y", &yv)?;
        if yv.dtype != xv.dtype {
            return invalid(
                op,
                format!(
                    "y is {} and x {}: they must have one data type",
                    yv.dtype.name(),
                    xv.dtype.name()
                ),
            );
        }
        if yv.dims != xv.dims {
            return invalid(
                op,
                format!("y shape {:?} differs from x {:?}", yv.dims, xv.dims),
            );
        }
        let tanh = match approximate {
            0 => false,
            1 => true,
            a => {
                return invalid(
                    op,
                    format!("approximate {a} is not documented (0 = none, 1 = tanh)"),
                )
            }
        };
        Ok(Box::new(GeluV2 {
            io: Io {
                ins: vec![xv],
                outs: vec![yv],
            },
            tanh,
        }))
    })
}

// ---- InplaceMul / InplaceMuls -----------------------------------------------------------------

#[derive(Clone)]
struct InplaceMul {
    io: Io,
    /// InplaceMuls' scalar; None: InplaceMul's tensor (ins[0]).
    scalar: Option<f64>,
}

impl Kernel for InplaceMul {
    fn name(&self) -> &'static str {
        if self.scalar.is_some() {
            "aclnnInplaceMuls"
        } else {
            "aclnnInplaceMul"
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
        let a = read(st, out)?;
        let r: Vec<f64> = match self.scalar {
            Some(s) => a.iter().map(|x| x * s).collect(),
            None => {
                let b = read(st, &broadcast_to(self.name(), &self.io.ins[0], &out.dims)?)?;
                a.iter().zip(&b).map(|(x, y)| x * y).collect()
            }
        };
        let r: Vec<f64> = if out.dtype.is_float() {
            r
        } else {
            r.iter().map(|v| v.trunc()).collect()
        };
        write(st, out, &r)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnInplaceMulGetWorkspaceSize(
    selfRef: *mut aclTensor,
    other: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnInplaceMul", workspaceSize, executor, |st| {
        let op = "aclnnInplaceMul";
        let a = st.tensor(selfRef, "selfRef")?;
        let b = st.tensor(other, "other")?;
        for (w, v) in [("selfRef", &a), ("other", &b)] {
            dtype_in(op, w, v, MUL_TYPES)?;
            nd(op, w, v)?;
            rank_at_most_8(op, w, &v.dims)?;
        }
        if b.dtype.is_float() && !a.dtype.is_float() {
            return invalid(
                op,
                format!(
                    "{} x {} promotes to a float type, which cannot be stored into selfRef ({})",
                    a.dtype.name(),
                    b.dtype.name(),
                    a.dtype.name()
                ),
            );
        }
        if broadcast_shape(op, &a.dims, &b.dims)? != a.dims {
            return invalid(
                op,
                format!(
                    "other {:?} must broadcast to selfRef {:?} (the broadcast shape must be selfRef's)",
                    b.dims, a.dims
                ),
            );
        }
        Ok(Box::new(InplaceMul {
            io: Io {
                ins: vec![b],
                outs: vec![a],
            },
            scalar: None,
        }))
    })
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnInplaceMulsGetWorkspaceSize(
    selfRef: *mut aclTensor,
    other: *const aclScalar,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnInplaceMuls", workspaceSize, executor, |st| {
        let op = "aclnnInplaceMuls";
        let a = st.tensor(selfRef, "selfRef")?;
        let (s, float) = st.typed_scalar(other, "other")?;
        dtype_in(op, "selfRef", &a, MUL_TYPES)?;
        nd(op, "selfRef", &a)?;
        rank_at_most_8(op, "selfRef", &a.dims)?;
        if float && !a.dtype.is_float() {
            return invalid(
                op,
                format!(
                    "a float scalar promotes {} selfRef to a float type, which cannot be stored back into it",
                    a.dtype.name()
                ),
            );
        }
        Ok(Box::new(InplaceMul {
            io: Io {
                ins: vec![],
                outs: vec![a],
            },
            scalar: Some(s),
        }))
    })
}

const _: () = {
    use npu_ffi::aclnn::ops::sig;
    let _: sig::aclnnGeluV2GetWorkspaceSize = aclnnGeluV2GetWorkspaceSize;
    let _: sig::aclnnInplaceMulGetWorkspaceSize = aclnnInplaceMulGetWorkspaceSize;
    let _: sig::aclnnInplaceMulsGetWorkspaceSize = aclnnInplaceMulsGetWorkspaceSize;
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.0, 0.999_977_909_503_001_4),
            (-1.5, -0.966_105_146_475_310_7),
        ] {
            assert!((erf(x) - want).abs() < 1e-12, "erf({x}) = {}", erf(x));
        }
    }

    #[test]
    fn gelu_tanh_saturates_as_ggml_cuts_off() {
        // Rounded to f16, as a FLOAT16 y holds it: 0 at or below -10 (-1.2e-37 before the
        // rounding), the gate itself at or above 10.
        let f16 = |x: f32| half::f16::from_f32(x).to_f32();
        assert_eq!(f16(gelu_tanh_device(-10.0)), 0.0);
        assert_eq!(gelu_tanh_device(-30.0), 0.0);
        assert_eq!(f16(gelu_tanh_device(10.0)), 10.0);
        assert_eq!(gelu_tanh_device(30.0), 30.0);
        let ggml = |x: f32| 0.5 * x * (1.0 + (0.797_884_6 * x * (1.0 + 0.044_715 * x * x)).tanh());
        for i in -900..900 {
            let x = i as f32 / 100.0;
            let (a, b) = (gelu_tanh_device(x), ggml(x));
            assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{x}: {a} vs {b}");
        }
    }
}

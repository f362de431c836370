//! CPU compute kernels with run-time instruction-set dispatch: quantized and f32 matrix products,
//! paged attention, and the element-wise ops of a Llama layer. Each SIMD path has a scalar twin
//! it is tested against.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_avx2;
#[cfg(target_arch = "x86_64")]
mod attention_avx512;
pub mod elementwise;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod matmul;
pub mod quantize;
pub mod scan;
pub mod vecmath;

use std::sync::OnceLock;

use crate::threadpool::PoolError;

/// The instruction set a kernel runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// ARMv8 NEON (baseline on aarch64).
    Neon,
    /// ARMv8 NEON with the dot-product extension (sdot).
    NeonDot,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL with VNNI (vpdpbusd).
    Avx512Vnni,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Neon => "neon",
            Self::NeonDot => "neon-dotprod",
            Self::Avx2 => "avx2",
            Self::Avx512Vnni => "avx512-vnni",
        }
    }

    /// Every instruction set this machine can run, best first.
    pub fn available() -> Vec<Isa> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512vnni")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                v.push(Isa::Avx512Vnni);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                v.push(Isa::Avx2);
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("dotprod") {
                v.push(Isa::NeonDot);
            }
            if std::arch::is_aarch64_feature_detected!("neon") {
                v.push(Isa::Neon);
            }
        }
        v.push(Isa::Scalar);
        v
    }

    /// `self` when this machine can run it, else `Scalar`. Every dispatch goes through this, so a
    /// caller naming an instruction set the CPU lacks gets the scalar kernel, never an illegal
    /// instruction.
    #[inline]
    pub fn checked(self) -> Isa {
        static AVAILABLE: OnceLock<Vec<Isa>> = OnceLock::new();
        if AVAILABLE.get_or_init(Isa::available).contains(&self) {
            self
        } else {
            Isa::Scalar
        }
    }

    /// The instruction set kernels use: the best available, or `NPU_SERVING_ISA` (scalar, avx2,
    /// avx512-vnni, neon, neon-dotprod) when it names an available one.
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let avail = Isa::available();
            if let Ok(want) = std::env::var("NPU_SERVING_ISA") {
                if let Some(isa) = avail.iter().find(|i| i.name() == want) {
                    return *isa;
                }
                tracing::warn!(
                    "NPU_SERVING_ISA={want} is not available here (available: {:?}); using {}",
                    avail.iter().map(|i| i.name()).collect::<Vec<_>>(),
                    avail[0].name()
                );
            }
            avail[0]
        })
    }
}

/// A kernel setting read from the environment that holds a value it does not take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?} is not a value it takes: {expected}")]
pub struct BadSetting {
    pub var: &'static str,
    pub value: String,
    pub expected: &'static str,
}

/// `NPU_SERVING_AMX`: whether the AMX tiles may be used where the CPU has them (unset: yes).
/// `0` turns them off, `1` keeps them on; anything else is refused.
pub fn amx_setting() -> Result<bool, BadSetting> {
    parse_amx_setting(std::env::var("NPU_SERVING_AMX").ok().as_deref())
}

fn parse_amx_setting(value: Option<&str>) -> Result<bool, BadSetting> {
    match value {
        None | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(v) => Err(BadSetting {
            var: "NPU_SERVING_AMX",
            value: v.to_string(),
            expected: "0 (AMX tiles off) or 1 (on where the CPU has them)",
        }),
    }
}

/// Every kernel setting of the environment, checked once at start so a typo is refused by name
/// instead of silently changing which kernels run.
pub fn check_settings() -> Result<(), BadSetting> {
    amx_setting()?;
    matmul::prefetch_setting()?;
    Ok(())
}

/// The engine the kernels run: the instruction set, with `+amx` where the packed matmul uses
/// the AMX tiles (for logs and the start line).
pub fn engine_name(isa: Isa) -> String {
    #[cfg(target_arch = "x86_64")]
    if isa.checked() == Isa::Avx512Vnni && matmul::amx::available() {
        return format!("{}+amx", isa.name());
    }
    isa.name().to_string()
}

/// Why a kernel call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The arguments do not describe buffers of the sizes the operation needs.
    #[error("{op}: {message}")]
    BadShape { op: &'static str, message: String },
    /// A task of the parallel call panicked (its output is garbage).
    #[error(transparent)]
    Pool(#[from] PoolError),
}

impl From<KernelError> for npu_backend::BackendError {
    fn from(e: KernelError) -> Self {
        match e {
            KernelError::BadShape { op, message } => Self::BadArgument { op, message },
            KernelError::Pool(p) => Self::Device {
                backend: "cpu",
                message: p.to_string(),
            },
        }
    }
}

/// Corrupts one output value of a SIMD kernel when the check program's fault is on (only with the
/// `fault-injection` feature; otherwise nothing).
#[inline(always)]
fn inject_fault(isa: Isa, v: Option<&mut f32>) {
    #[cfg(feature = "fault-injection")]
    fault::apply(isa, v);
    #[cfg(not(feature = "fault-injection"))]
    let _ = (isa, v);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_amx_setting_takes_0_and_1_and_refuses_the_rest_by_name() {
        assert_eq!(parse_amx_setting(None), Ok(true));
        assert_eq!(parse_amx_setting(Some("1")), Ok(true));
        assert_eq!(parse_amx_setting(Some("0")), Ok(false));
        for bad in ["", "off", "true", "2", " 0"] {
            let e = parse_amx_setting(Some(bad)).unwrap_err();
            assert!(e.to_string().starts_with("NPU_SERVING_AMX="), "{e}");
            assert!(e.to_string().contains("0 (AMX tiles off)"), "{e}");
        }
    }
}

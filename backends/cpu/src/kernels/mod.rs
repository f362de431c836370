//! CPU compute kernels with run-time instruction-set dispatch: quantized and f32 matrix products,
//! paged attention, and the element-wise ops of a Llama layer. Each SIMD path has a scalar twin
//! it is tested against.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_avx512;
pub mod elementwise;
pub mod matmul;
pub mod quantize;
pub mod vecmath;

use std::sync::OnceLock;

/// The instruction set a kernel runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
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
        }
        v.push(Isa::Scalar);
        v
    }

    /// The instruction set kernels use: the best available, or `NPU_SERVING_ISA` (scalar, avx2,
    /// avx512-vnni, neon-dotprod) when it names an available one.
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

/// A raw output pointer that parallel tasks write disjoint parts of.
#[derive(Clone, Copy)]
pub struct SharedOut(pub *mut f32);
// SAFETY: users guarantee tasks write disjoint elements and the buffer outlives the job.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer (a method, so closures capture the whole Sync wrapper).
    #[inline]
    pub fn ptr(&self) -> *mut f32 {
        self.0
    }

    /// Rows `r` of a row-major matrix with `cols` columns.
    ///
    /// # Safety
    /// The rows must lie inside the buffer, and no one else may access them meanwhile.
    #[inline]
    pub unsafe fn rows<'a>(&self, r: std::ops::Range<usize>, cols: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(r.start * cols), (r.end - r.start) * cols)
    }
}

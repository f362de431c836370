//! The backend conformance suite, written once for every device: each op of the `Backend` trait
//! (`ops`), a whole model step, and the model-level greedy check (`model`), run on a backend
//! under test and compared with the CPU backend forced to the scalar instruction set, the
//! reference. A backend plugs in with one line, a `Candidate` built from its constructor; the
//! suite's own test (`agent/tests/conformance.rs`) lists the candidates compiled in and present
//! and fails on any check that does not pass. `faulty` holds a backend that is wrong on purpose,
//! to prove the suite can fail. `collective` checks the collectives of tensor parallelism on two
//! ranks of a backend, and one model step split over them.
//!
//! Comparisons are in units of the reference output's RMS, plus, for data movement and
//! elementwise ops on f16/bf16 devices, the rounding those formats make on each value: a check
//! passes when every value's absolute difference is at most
//! `tolerance * rms(reference) + roundings * unit * |reference value|`. Tolerances by the
//! device's activation dtype (`Tolerance::for_dtype`, `Tolerance::bound`):
//!
//! | class | what | f32 | f16 | bf16 |
//! |---|---|---|---|---|
//! | exact | data movement: upload/read back, embed, gather, KV block copies | 1e-6 | 1e-3 + 1 rounding | 8e-3 + 1 rounding |
//! | elementwise | rms_norm, add, add_bias, rope, swiglu | 1e-5 | 2e-3 + 3 roundings | 1.6e-2 + 3 roundings |
//! | reduction | matmul, attention | 6e-2 | 8e-2 | 1.2e-1 |
//! | step | a whole model step's logits | 1.5e-1 | 2e-1 | 3e-1 |
//!
//! f16 and bf16 are calibrated on their rounding: rounding to f16 moves a value `v` by at most
//! 2^-11 x |v| (bf16: 2^-8 x |v|), the `unit` above. Data movement rounds once (on upload, or
//! when the device stores a looked-up row); elementwise ops round their input, their output and
//! at most one intermediate; the RMS term covers values near zero. The bound is per value because
//! outputs such as embedding rows and normalized rows peak at 8-12x their RMS, so a bound in RMS
//! units alone would have to be that much looser for every value. Measured on the CUDA kernels'
//! emulation and the Ascend emulation with f16 activations: embedding rows within 4.6e-4 x |v|
//! (one rounding), rms_norm within 3.5e-4 x |v|.
//!
//! Reductions are looser because valid arithmetic differs there: the reference quantizes matmul
//! activations to 8 bits per 32-value block and rounds attention queries and probabilities
//! through f16, as llama.cpp does; a device may keep them in f16 or f32. The CPU backend's
//! f32-reference mode does exactly that: its matmuls land at up to 3.7e-2 and its step logits at
//! 7.8e-2 (the suite's test checks that these tolerances admit it). A whole step compounds such
//! differences over every layer, so its logits are checked loosely and, more strictly, by the
//! greedy checks (`model::check_greedy`): top-1 tokens must equal the reference's wherever the
//! reference is decided, greedy generation must give the CPU backend's tokens and llama.cpp's up
//! to each prompt's first near-tie (a top-1/top-2 gap below 0.15 for either: the product's rule,
//! a backend that changes decided tokens is a bug), and teacher-forced top-1 tokens must equal
//! the CPU backend's wherever neither gap is a near-tie.

pub mod collective;
pub mod faulty;
pub mod model;
pub mod ops;

use npu_backend::{Backend, BackendError, DType};
use npu_backend_cpu::kernels::Isa;
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::GgufFile;

/// How a check's output may differ from the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Exact,
    Elementwise,
    Reduction,
    Step,
}

/// Tolerances (in units of the reference's RMS) for one activation dtype, and its rounding unit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    pub exact: f64,
    pub elementwise: f64,
    pub reduction: f64,
    pub step: f64,
    /// Relative error of one rounding to the activation dtype (0 for f32: nothing is rounded).
    pub rounding: f64,
}

/// What one check allows: `rms` units of the reference's RMS plus `rel` times each value's
/// magnitude.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bound {
    pub rms: f64,
    pub rel: f64,
}

impl Tolerance {
    pub fn for_dtype(dtype: DType) -> Self {
        match dtype {
            DType::F32 | DType::I32 => Self {
                exact: 1e-6,
                elementwise: 1e-5,
                reduction: 6e-2,
                step: 1.5e-1,
                rounding: 0.0,
            },
            DType::F16 => Self {
                exact: 1e-3,
                elementwise: 2e-3,
                reduction: 8e-2,
                step: 2e-1,
                rounding: 1.0 / 2048.0,
            },
            DType::BF16 => Self {
                exact: 8e-3,
                elementwise: 1.6e-2,
                reduction: 1.2e-1,
                step: 3e-1,
                rounding: 1.0 / 256.0,
            },
        }
    }

    /// The RMS part of a class's bound.
    pub fn of(&self, class: Class) -> f64 {
        match class {
            Class::Exact => self.exact,
            Class::Elementwise => self.elementwise,
            Class::Reduction => self.reduction,
            Class::Step => self.step,
        }
    }

    /// A class's whole bound: its RMS part and the roundings it allows per value.
    pub fn bound(&self, class: Class) -> Bound {
        let roundings = match class {
            Class::Exact => 1.0,
            Class::Elementwise => 3.0,
            Class::Reduction | Class::Step => 0.0,
        };
        Bound {
            rms: self.of(class),
            rel: roundings * self.rounding,
        }
    }
}

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    /// Largest difference from the reference in units of its RMS (None when not comparable).
    pub error: Option<f64>,
    pub tolerance: Option<f64>,
    /// Why it failed, or what was not provided.
    pub note: String,
}

/// Everything the suite found about one backend.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub backend: String,
    pub checks: Vec<Check>,
}

impl Report {
    pub fn new(backend: impl Into<String>) -> Self {
        Self {
            backend: backend.into(),
            checks: Vec::new(),
        }
    }

    pub fn failures(&self) -> Vec<&Check> {
        self.checks.iter().filter(|c| !c.passed).collect()
    }

    /// Records a check that passed or failed on its own terms.
    pub fn verdict(&mut self, name: impl Into<String>, passed: bool, note: impl Into<String>) {
        self.checks.push(Check {
            name: name.into(),
            passed,
            error: None,
            tolerance: None,
            note: note.into(),
        });
    }

    /// Records an error of the backend under test as a failed check.
    pub fn error(&mut self, name: impl Into<String>, e: &dyn std::fmt::Display) {
        self.verdict(name, false, format!("error: {e}"));
    }

    /// Compares `got` with `want` (the reference) within `tol` RMS units.
    pub fn compare(&mut self, name: impl Into<String>, got: &[f32], want: &[f32], tol: f64) {
        self.compare_within(name, got, want, Bound { rms: tol, rel: 0.0 });
    }

    /// Compares `got` with `want` (the reference): every value within `b.rms` units of the
    /// reference's RMS plus `b.rel` times its own magnitude. The error shown is the worst value's
    /// difference scaled so that its bound reads as `b.rms` (plain RMS units when `b.rel` is 0).
    pub fn compare_within(&mut self, name: impl Into<String>, got: &[f32], want: &[f32], b: Bound) {
        let name = name.into();
        if got.len() != want.len() {
            self.verdict(
                name,
                false,
                format!("{} values, the reference has {}", got.len(), want.len()),
            );
            return;
        }
        let rms = (want.iter().map(|&v| (v as f64).powi(2)).sum::<f64>()
            / want.len().max(1) as f64)
            .sqrt()
            .max(1e-30);
        let mut worst = (0.0f64, 0usize);
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let d = if g.is_nan() || w.is_nan() {
                if g.is_nan() && w.is_nan() {
                    0.0
                } else {
                    f64::INFINITY
                }
            } else {
                (g as f64 - w as f64).abs()
            };
            let allowed = b.rms * rms + b.rel * (w as f64).abs();
            let e = if allowed > 0.0 {
                d / allowed * b.rms
            } else {
                d / rms
            };
            if e > worst.0 || (e.is_nan() && !worst.0.is_nan()) {
                worst = (e, i);
            }
        }
        let error = worst.0;
        let passed = error <= b.rms;
        let note = if passed {
            String::new()
        } else {
            format!(
                "value {} is {} where the reference has {}",
                worst.1, got[worst.1], want[worst.1]
            )
        };
        self.checks.push(Check {
            name,
            passed,
            error: Some(error),
            tolerance: Some(b.rms),
            note,
        });
    }

    /// A table of the checks, one per line.
    pub fn render(&self) -> String {
        let mut s = format!("conformance of {}:\n", self.backend);
        for c in &self.checks {
            let figures = match (c.error, c.tolerance) {
                (Some(e), Some(t)) => format!("{e:9.2e} of {t:7.1e}"),
                _ => format!("{:>20}", ""),
            };
            s.push_str(&format!(
                "  {:<6} {:<40} {figures}  {}\n",
                if c.passed { "ok" } else { "FAILED" },
                c.name,
                c.note
            ));
        }
        s
    }
}

/// The reference: the CPU backend with the scalar instruction set.
pub fn reference() -> CpuBackend {
    CpuBackend::with_isa(
        CpuConfig {
            threads: 2,
            f32_reference: false,
        },
        Isa::Scalar,
    )
}

/// The CPU backend as it serves (the best instruction set of this machine, which gives the
/// scalar reference's outputs bit for bit): the greedy checks' CPU side, where speed matters.
pub fn cpu_as_served() -> CpuBackend {
    CpuBackend::new(CpuConfig {
        threads: 2,
        f32_reference: false,
    })
}

/// Runs the whole suite on the backends `make` builds (it is called once per part: ops, model
/// step, greedy), against the reference.
pub fn run_suite<B: Backend>(
    name: &str,
    make: &dyn Fn() -> Result<B, BackendError>,
    file: &GgufFile,
    refs: &[model::GreedyRef],
) -> Report {
    let mut report = Report::new(name);
    match make() {
        Ok(mut dev) => ops::check_ops(&mut dev, &mut reference(), file, &mut report),
        Err(e) => report.error("construct the backend", &e),
    }
    match make() {
        Ok(dev) => model::check_step(dev, reference(), file, &mut report),
        Err(e) => report.error("construct the backend", &e),
    }
    match make() {
        Ok(dev) => model::check_greedy(dev, cpu_as_served(), file, refs, &mut report),
        Err(e) => report.error("construct the backend", &e),
    }
    report
}

/// Runs the whole suite on one backend.
type SuiteRun = Box<dyn Fn(&GgufFile, &[model::GreedyRef]) -> Report>;

/// One backend the suite runs on: a name and a way to run the suite on it. Later backends plug
/// in with `Candidate::new("cuda:0", || CudaBackend::new(0))`.
pub struct Candidate {
    pub name: String,
    run: SuiteRun,
}

impl Candidate {
    pub fn new<B: Backend + 'static>(
        name: impl Into<String>,
        make: impl Fn() -> Result<B, BackendError> + 'static,
    ) -> Self {
        let name = name.into();
        let label = name.clone();
        Self {
            name,
            run: Box::new(move |file, refs| run_suite(&label, &make, file, refs)),
        }
    }

    pub fn run(&self, file: &GgufFile, refs: &[model::GreedyRef]) -> Report {
        (self.run)(file, refs)
    }
}

/// The CPU backend under every instruction set: candidates for those this machine runs, and a
/// line for each one it cannot (with the reason), so a skipped one is never reported as passed.
pub fn cpu_candidates() -> (Vec<Candidate>, Vec<String>) {
    let available = Isa::available();
    let mut run = Vec::new();
    let mut skipped = Vec::new();
    let all = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::NeonDot];
    for isa in all {
        if !available.contains(&isa) {
            skipped.push(format!(
                "cpu {}: skipped, this CPU (or target) does not have it",
                isa.name()
            ));
            continue;
        }
        let amx = isa == Isa::Avx512Vnni && amx_in_use();
        let name = if amx {
            format!("cpu {} with AMX tiles", isa.name())
        } else {
            format!("cpu {}", isa.name())
        };
        run.push(Candidate::new(name, move || {
            Ok(CpuBackend::with_isa(
                CpuConfig {
                    threads: 2,
                    f32_reference: false,
                },
                isa,
            ))
        }));
    }
    if !amx_in_use() {
        skipped
            .push("cpu amx: skipped, this CPU has no AMX-INT8 tiles (or NPU_SERVING_AMX=0)".into());
    }
    (run, skipped)
}

fn amx_in_use() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        npu_backend_cpu::kernels::matmul::amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

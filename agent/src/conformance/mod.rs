//! The backend conformance suite, written once for every device: each op of the `Backend` trait
//! (`ops`), a whole model step, and the model-level greedy check (`model`), run on a backend
//! under test and compared with the CPU backend forced to the scalar instruction set, the
//! reference. A backend plugs in with one line, a `Candidate` built from its constructor; the
//! suite's own test (`agent/tests/conformance.rs`) lists the candidates compiled in and present
//! and fails on any check that does not pass. `faulty` holds a backend that is wrong on purpose,
//! to prove the suite can fail.
//!
//! Comparisons are in units of the reference output's RMS: a check passes when the largest
//! absolute difference is at most `tolerance * rms(reference)`. Tolerances by the device's
//! activation dtype (`Tolerance::for_dtype`):
//!
//! | class | what | f32 | f16 | bf16 |
//! |---|---|---|---|---|
//! | exact | data movement: upload/read back, embed, gather, KV block copies | 1e-6 | 2e-3 | 1.6e-2 |
//! | elementwise | rms_norm, add, add_bias, rope, swiglu | 1e-5 | 4e-3 | 3e-2 |
//! | reduction | matmul, attention | 6e-2 | 8e-2 | 1.2e-1 |
//! | step | a whole model step's logits | 1.5e-1 | 2e-1 | 3e-1 |
//!
//! f16 and bf16 are calibrated on their rounding: one rounding to f16 moves a value `v` by at most
//! 2^-11 x |v| (bf16: 2^-8 x |v|), so in units of the RMS it moves the worst value by at most
//! 2^-11 x peak/RMS. The op cases' outputs peak at about 4x their RMS, so data movement (one
//! rounding, on upload) gets 4 x 2^-11 ~ 2e-3 and elementwise ops (the input's rounding and the
//! output's, plus f32 arithmetic between) 8 x 2^-11 ~ 4e-3; bf16 the same counts of 2^-8 with
//! some room (1.6e-2, 3e-2). Reductions are looser
//! because valid arithmetic differs there: the reference quantizes matmul activations to 8 bits
//! per 32-value block and rounds attention queries and probabilities through f16, as llama.cpp
//! does; a device may keep them in f16 or f32. The CPU backend's f32-reference mode does exactly
//! that: its matmuls land at up to 3.7e-2 and its step logits at 7.8e-2 (the suite's test checks
//! that these tolerances admit it). A whole step compounds such differences over every layer, so
//! its logits are checked loosely and, more strictly, by the greedy checks: top-1 tokens must
//! equal the reference's wherever the reference is decided, and greedy generation must equal
//! llama.cpp's up to each prompt's first near-tie (the product's rule: a backend that changes
//! tokens is a bug). The f32-reference mode does not meet that last one (one prompt differs
//! before its near-tie), so it is no candidate: a device that computes in plain f32 would have
//! to quantize activations as llama.cpp does to conform.

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

/// Tolerances (in units of the reference's RMS) for one activation dtype.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    pub exact: f64,
    pub elementwise: f64,
    pub reduction: f64,
    pub step: f64,
}

impl Tolerance {
    pub fn for_dtype(dtype: DType) -> Self {
        match dtype {
            DType::F32 | DType::I32 => Self {
                exact: 1e-6,
                elementwise: 1e-5,
                reduction: 6e-2,
                step: 1.5e-1,
            },
            DType::F16 => Self {
                exact: 2e-3,
                elementwise: 4e-3,
                reduction: 8e-2,
                step: 2e-1,
            },
            DType::BF16 => Self {
                exact: 1.6e-2,
                elementwise: 3e-2,
                reduction: 1.2e-1,
                step: 3e-1,
            },
        }
    }

    pub fn of(&self, class: Class) -> f64 {
        match class {
            Class::Exact => self.exact,
            Class::Elementwise => self.elementwise,
            Class::Reduction => self.reduction,
            Class::Step => self.step,
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
            if d > worst.0 || (d.is_nan() && !worst.0.is_nan()) {
                worst = (d, i);
            }
        }
        let error = worst.0 / rms;
        let passed = error <= tol;
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
            tolerance: Some(tol),
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

//! The backend conformance suite (`npu_agent::conformance`) on every backend this build has and
//! this machine can run: the CPU backend under each instruction set. Skipped ones are printed
//! with the reason, never counted as passed. Later backends plug in with one line in `candidates`. Run with `--nocapture` to see
//! every check's error against its tolerance.

mod common;

use npu_agent::conformance::faulty::{Fault, Faulty};
use npu_agent::conformance::model::GreedyRef;
use npu_agent::conformance::{self, ops, Candidate, Report};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::GgufFile;

/// Every backend to check: the CPU ones, then one line per device backend compiled in, e.g.
/// `#[cfg(feature = "cuda")] run.push(Candidate::new("cuda:0", || CudaBackend::new(0)));`
/// (a constructor that fails because the device is absent is reported, not skipped silently).
fn candidates() -> (Vec<Candidate>, Vec<String>) {
    let (run, skipped) = conformance::cpu_candidates();
    (run, skipped)
}

fn greedy_refs() -> Vec<GreedyRef> {
    common::refs()
        .into_iter()
        .map(|r| GreedyRef {
            prompt_ids: r.prompt_ids,
            output_ids: r.output_ids,
            first_near_tie: r.first_near_tie,
        })
        .collect()
}

fn model() -> GgufFile {
    GgufFile::open(common::model_path()).expect("the default model")
}

#[test]
fn every_backend_present_conforms() {
    let file = model();
    let refs = greedy_refs();
    let (run, skipped) = candidates();
    for s in &skipped {
        eprintln!("{s}");
    }
    assert!(!run.is_empty());
    let mut failed = Vec::new();
    for c in &run {
        let report = c.run(&file, &refs);
        eprintln!("{}", report.render());
        assert!(
            report.checks.len() >= 25,
            "{}: only {} checks ran",
            c.name,
            report.checks.len()
        );
        if !report.failures().is_empty() {
            failed.push(c.name.clone());
        }
    }
    assert!(
        failed.is_empty(),
        "{failed:?} failed conformance (tables above)"
    );
}

fn cpu() -> CpuBackend {
    CpuBackend::new(CpuConfig {
        threads: 2,
        f32_reference: false,
    })
}

/// A backend with any one op wrong fails the suite on that op.
#[test]
fn a_deliberately_wrong_op_fails_the_suite() {
    let file = model();
    let expected = ops::reference_outputs(&file);
    for fault in Fault::ALL {
        let mut dev = Faulty {
            inner: cpu(),
            fault,
        };
        let mut report = Report::new(format!("{fault:?}"));
        ops::check_ops_against(&mut dev, &expected, &file, &mut report);
        let failed = report.failures();
        assert!(
            failed
                .iter()
                .any(|c| fault.check_names().iter().any(|n| c.name.contains(n))),
            "a faulty {fault:?} was not caught:\n{}",
            report.render()
        );
    }
    // The same wrapper without a fault in play passes the op checks, so the failures above come
    // from the faults.
    let mut honest = Faulty {
        inner: cpu(),
        fault: Fault::Upload,
    };
    let mut report = Report::new("honest");
    let mut cpu_alone = cpu();
    ops::check_ops_against(&mut cpu_alone, &expected, &file, &mut report);
    assert!(report.failures().is_empty(), "{}", report.render());
    // A whole model step catches a wrong op too.
    honest.fault = Fault::Rope;
    let mut report = Report::new("faulty rope, model step");
    conformance::model::check_step(honest, conformance::reference(), &file, &mut report);
    assert!(
        !report.failures().is_empty(),
        "a faulty rope passed a whole step:\n{}",
        report.render()
    );
}

/// The op and step tolerances admit valid arithmetic other than the reference's: the CPU
/// backend's f32-reference mode (weights dequantized to f32, activations not quantized) passes
/// every op and the whole-step logits.
#[test]
fn tolerances_admit_other_valid_arithmetic() {
    let file = model();
    let f32_reference = || {
        CpuBackend::new(CpuConfig {
            threads: 2,
            f32_reference: true,
        })
    };
    let mut report = Report::new("cpu f32-reference");
    ops::check_ops(
        &mut f32_reference(),
        &mut conformance::reference(),
        &file,
        &mut report,
    );
    conformance::model::check_step(
        f32_reference(),
        conformance::reference(),
        &file,
        &mut report,
    );
    eprintln!("{}", report.render());
    assert!(report.failures().is_empty(), "{}", report.render());
    // It computes differently: the comparisons are not trivially exact.
    assert!(report
        .checks
        .iter()
        .any(|c| c.error.is_some_and(|e| e > 1e-3)));
}

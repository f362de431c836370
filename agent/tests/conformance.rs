//! The backend conformance suite (`npu_agent::conformance`) on every backend this build has and
//! this machine can run: the CPU backend under each instruction set; with the `cuda` feature, the
//! CUDA backend on a GPU (when one is present) and on the CPU emulation of its kernels; with the
//! `ascend` feature, the Ascend backend over the CANN install `ASCEND_HOME_PATH` names (in CI the
//! strict emulation that `scripts/ascend-emulator.sh` builds). Skipped ones are printed with the
//! reason, never counted as passed. Run with `--nocapture` to see every check's error against
//! its tolerance.

mod common;

use npu_agent::conformance::faulty::{Fault, Faulty};
use npu_agent::conformance::model::GreedyRef;
use npu_agent::conformance::{self, ops, Candidate, Report};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::GgufFile;

/// Every backend to check (a constructor that fails because the device is absent makes a skip
/// line with its reason; any other failure is a failed check).
/// `NPU_SERVING_CONFORMANCE_ONLY=WORD` keeps only the backends whose name contains WORD (the
/// others are listed as skipped): scripts/npu-check.sh runs the Ascend backend alone this way.
fn candidates() -> (Vec<Candidate>, Vec<String>) {
    let (mut run, mut skipped) = conformance::cpu_candidates();
    cuda_candidates(&mut run, &mut skipped);
    ascend_candidates(&mut run, &mut skipped);
    if let Some(only) = std::env::var("NPU_SERVING_CONFORMANCE_ONLY")
        .ok()
        .filter(|w| !w.is_empty())
    {
        let (keep, drop): (Vec<_>, Vec<_>) = run.into_iter().partition(|c| c.name.contains(&only));
        skipped.extend(drop.into_iter().map(|c| {
            format!(
                "{}: skipped, not asked for (NPU_SERVING_CONFORMANCE_ONLY={only})",
                c.name
            )
        }));
        run = keep;
    }
    (run, skipped)
}

#[cfg(not(feature = "cuda"))]
fn cuda_candidates(_: &mut Vec<Candidate>, skipped: &mut Vec<String>) {
    skipped.push("cuda: skipped, built without the `cuda` feature".into());
}

/// CUDA device 0 when this machine has one, and always the emulation of the kernels (f32
/// activations, the default, and f16).
#[cfg(feature = "cuda")]
fn cuda_candidates(run: &mut Vec<Candidate>, skipped: &mut Vec<String>) {
    use npu_backend::{BackendError, DType};
    use npu_backend_cuda::{CudaBackend, CudaConfig};
    match CudaBackend::new(0, CudaConfig::default()) {
        Ok(_) => run.push(Candidate::new("cuda:0 (GPU)", || {
            CudaBackend::new(0, CudaConfig::default())
        })),
        Err(e @ (BackendError::MissingLibrary { .. } | BackendError::Device { .. })) => skipped
            .push(format!(
                "cuda:0 (GPU): skipped, no usable CUDA device here: {e}"
            )),
        Err(e) => panic!("opening CUDA device 0 failed for another reason than its absence: {e}"),
    }
    for dt in [DType::F32, DType::F16] {
        let cfg = CudaConfig {
            act_dtype: dt,
            kernel_cache: None,
            ..CudaConfig::default()
        };
        run.push(Candidate::new(
            format!("cuda emulated kernels ({} activations)", dt.name()),
            move || CudaBackend::emulated(cfg.clone()),
        ));
    }
}

#[cfg(not(feature = "ascend"))]
fn ascend_candidates(_: &mut Vec<Candidate>, skipped: &mut Vec<String>) {
    skipped.push("ascend: skipped, built without the `ascend` feature".into());
}

/// The Ascend backend on device 0 of the CANN install `ASCEND_HOME_PATH` names (the emulation
/// in CI: `ASCEND_HOME_PATH=$(scripts/ascend-emulator.sh)`).
#[cfg(feature = "ascend")]
fn ascend_candidates(run: &mut Vec<Candidate>, skipped: &mut Vec<String>) {
    use npu_backend_ascend::{AscendBackend, AscendConfig};
    let Some(root) = std::env::var_os("ASCEND_HOME_PATH") else {
        skipped.push(
            "ascend: skipped, ASCEND_HOME_PATH is not set (source CANN's set_env.sh, or point it \
             at the emulation: ASCEND_HOME_PATH=$(scripts/ascend-emulator.sh))"
                .into(),
        );
        return;
    };
    let emulated = std::path::Path::new(&root).join("EMULATION.txt").is_file();
    let name = if emulated {
        "ascend:0 (CANN emulation)"
    } else {
        "ascend:0 (CANN)"
    };
    run.push(Candidate::new(name, || {
        AscendBackend::new(AscendConfig::default())
    }));
}

fn greedy_refs() -> Vec<GreedyRef> {
    common::refs()
        .into_iter()
        .map(|r| GreedyRef {
            prompt_ids: r.prompt_ids,
            output_ids: r.output_ids,
            first_near_tie: r.first_near_tie,
            gaps: r.gaps.iter().map(|&g| g as f32).collect(),
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

/// With each of a few ops made wrong in turn, the backend `make` builds fails the op checks on
/// that op.
#[allow(dead_code)]
fn catches_faults<B: npu_backend::Backend>(
    name: &str,
    make: impl Fn() -> B,
    file: &GgufFile,
    expected: &[Result<Vec<ops::Output>, npu_backend::BackendError>],
) {
    for fault in [
        Fault::Matmul,
        Fault::Rope,
        Fault::Attention,
        Fault::ArgmaxRows,
    ] {
        let mut dev = Faulty {
            inner: make(),
            fault,
        };
        let mut report = Report::new(format!("{name}, faulty {fault:?}"));
        ops::check_ops_against(&mut dev, expected, file, &mut report);
        assert!(
            report
                .failures()
                .iter()
                .any(|c| fault.check_names().iter().any(|n| c.name.contains(n))),
            "{name}: a faulty {fault:?} was not caught:\n{}",
            report.render()
        );
    }
}

/// Device backends with one op made wrong fail the suite on that op too (their tolerances are
/// looser than the CPU's, never loose enough to pass a wrong result).
#[test]
fn a_deliberately_wrong_op_on_a_device_backend_fails_the_suite() {
    let file = model();
    let expected = ops::reference_outputs(&file);
    let _ = &expected;
    #[cfg(feature = "cuda")]
    {
        use npu_backend::DType;
        use npu_backend_cuda::{CudaBackend, CudaConfig};
        let make = || {
            let cfg = CudaConfig {
                act_dtype: DType::F16,
                kernel_cache: None,
                ..CudaConfig::default()
            };
            CudaBackend::emulated(cfg).expect("the CUDA emulation builds")
        };
        catches_faults("cuda emulated kernels (f16)", make, &file, &expected);
    }
    #[cfg(not(feature = "cuda"))]
    eprintln!("cuda: skipped, built without the `cuda` feature");
    #[cfg(feature = "ascend")]
    if std::env::var_os("ASCEND_HOME_PATH").is_some() {
        use npu_backend_ascend::{AscendBackend, AscendConfig};
        let make = || AscendBackend::new(AscendConfig::default()).expect("CANN loads");
        catches_faults("ascend", make, &file, &expected);
    } else {
        eprintln!("ascend: skipped, ASCEND_HOME_PATH is not set");
    }
    #[cfg(not(feature = "ascend"))]
    eprintln!("ascend: skipped, built without the `ascend` feature");
}

/// A deliberately wrong synchronisation on the CUDA emulation: the backend's reads queue their
/// device→host copies (`cuMemcpyDtoHAsync` into the pinned read buffer) but skip the stream
/// synchronization before the host reads that buffer, as a read path that forgot
/// `cuStreamSynchronize` (`EmuGpu::skip_read_synchronization`). The emulation runs queued work
/// only when the stream is synchronized, so every read sees stale bytes (the buffer's poison, or
/// an earlier read's) and the op checks fail.
///
/// On the emulation before stream ordering (up to commit b3808fe) every copy and kernel ran at
/// its call, so a read that skipped its synchronization still saw the new values and this
/// wrong use passed unseen; that emulation has no switch to skip the synchronization, so this
/// test cannot run against it — `backends/cuda/tests/emulation_sync.rs` shows the same
/// difference on both (it fails on the old emulation and passes on the new one).
#[cfg(feature = "cuda")]
#[test]
fn a_cuda_backend_whose_reads_skip_the_stream_synchronization_fails_the_suite() {
    use npu_backend::DType;
    use npu_backend_cuda::{CudaBackend, CudaConfig};
    let file = model();
    let expected = ops::reference_outputs(&file);
    let cfg = CudaConfig {
        act_dtype: DType::F16,
        kernel_cache: None,
        ..CudaConfig::default()
    };
    let mut b = CudaBackend::emulated(cfg).expect("the CUDA emulation builds");
    b.emulation()
        .expect("the emulated backend")
        .skip_read_synchronization(true);
    let mut report = Report::new("cuda emulated kernels (f16), reads without synchronization");
    ops::check_ops_against(&mut b, &expected, &file, &mut report);
    let failed: Vec<&str> = report.failures().iter().map(|c| c.name.as_str()).collect();
    for op in ["matmul", "rope", "attention", "rms_norm"] {
        assert!(
            failed.iter().any(|n| n.contains(op)),
            "reads that skip the synchronization passed the {op} checks:\n{}",
            report.render()
        );
    }
}

/// The collectives of tensor parallelism on two ranks of the CPU backend (the staged
/// collective through a group's shared memory), and one model step split over them against the
/// reference; a collective that leaves out the other rank's part fails.
#[test]
fn collectives_conform_and_a_wrong_one_fails() {
    use npu_agent::conformance::collective::{check_collectives, staged};
    use npu_backend::{BackendError, HostCollective, HostStaged};
    let file = model();
    let mut report = Report::new("cpu, 2 ranks");
    check_collectives(
        (cpu(), cpu()),
        &staged,
        conformance::reference(),
        &file,
        &mut report,
    );
    eprintln!("{}", report.render());
    assert!(report.checks.len() >= 9, "{}", report.render());
    assert!(report.failures().is_empty(), "{}", report.render());

    /// Sums nothing: each rank keeps its own part.
    struct Alone(npu_agent::tp::ShmCollective);
    impl HostCollective for Alone {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn size(&self) -> usize {
            self.0.size()
        }
        fn describe(&self) -> String {
            "a collective that leaves the other rank out".into()
        }
        fn all_reduce_sum(&mut self, x: &mut [f32]) -> Result<(), BackendError> {
            let mut scratch = x.to_vec();
            self.0.all_reduce_sum(&mut scratch)
        }
        fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), BackendError> {
            self.0.all_gather(mine, out)
        }
        fn gather_to_root(
            &mut self,
            mine: &[f32],
            out: Option<&mut [f32]>,
        ) -> Result<(), BackendError> {
            self.0.gather_to_root(mine, out)
        }
    }
    let wrong =
        |m, _: &mut CpuBackend| -> Result<Box<dyn npu_backend::Collective<CpuBackend>>, String> {
            Ok(Box::new(HostStaged::new(Alone(
                npu_agent::tp::ShmCollective::from_member(m),
            ))))
        };
    let mut report = Report::new("cpu, 2 ranks, wrong all-reduce");
    check_collectives(
        (cpu(), cpu()),
        &wrong,
        conformance::reference(),
        &file,
        &mut report,
    );
    let failed: Vec<&str> = report.failures().iter().map(|c| c.name.as_str()).collect();
    assert!(
        failed.iter().any(|n| n.starts_with("all_reduce_sum"))
            && failed.iter().any(|n| n.starts_with("model step")),
        "a wrong all-reduce was not caught:\n{}",
        report.render()
    );
}

/// The staged collectives and a split model step over the CUDA backend on the CPU emulation of
/// its kernels (f32 and f16 activations): any backend runs tensor parallelism through host
/// memory until it has a collective library of its own.
#[cfg(feature = "cuda")]
#[test]
fn collectives_conform_over_the_emulated_cuda_backend() {
    use npu_agent::conformance::collective::{check_collectives, staged};
    use npu_backend::DType;
    use npu_backend_cuda::{CudaBackend, CudaConfig};
    let file = model();
    for dt in [DType::F32, DType::F16] {
        let cfg = CudaConfig {
            act_dtype: dt,
            kernel_cache: None,
            ..CudaConfig::default()
        };
        let make = || CudaBackend::emulated(cfg.clone()).expect("the emulated CUDA backend");
        let mut report = Report::new(format!("cuda emulated ({}), 2 ranks", dt.name()));
        check_collectives(
            (make(), make()),
            &staged,
            conformance::reference(),
            &file,
            &mut report,
        );
        eprintln!("{}", report.render());
        assert!(report.failures().is_empty(), "{}", report.render());
    }
}

/// The staged collectives and a model step split over two ranks of the Ascend backend, two
/// devices of the CANN install `ASCEND_HOME_PATH` names (in CI the strict emulation).
#[cfg(feature = "ascend")]
#[test]
fn collectives_conform_over_the_ascend_backend() {
    use npu_agent::conformance::collective::{check_collectives, staged};
    use npu_backend_ascend::{AscendBackend, AscendConfig};
    if std::env::var_os("ASCEND_HOME_PATH").is_none() {
        eprintln!("ascend: skipped, ASCEND_HOME_PATH is not set");
        return;
    }
    let file = model();
    let make = |device: u32| {
        AscendBackend::new(AscendConfig {
            start_device_id: device,
            ..AscendConfig::default()
        })
        .expect("an Ascend device")
    };
    let mut report = Report::new("ascend, 2 ranks (devices 0 and 1)");
    check_collectives(
        (make(0), make(1)),
        &staged,
        conformance::reference(),
        &file,
        &mut report,
    );
    eprintln!("{}", report.render());
    assert!(report.failures().is_empty(), "{}", report.render());
}

/// Launches of aclnn operator `name` so far in this process, as the Ascend emulation counts
/// them (its emulation-only `ascendEmulatorLaunchCount`, in the library the backend loaded).
#[cfg(feature = "ascend")]
fn emulated_launches(name: &std::ffi::CStr) -> u64 {
    let root = std::env::var_os("ASCEND_HOME_PATH").expect("the emulation's install");
    let path = std::path::Path::new(&root).join("lib64/libascendcl.so");
    // SAFETY: the emulation's library (already loaded by the backend: one state); the symbol
    // has this prototype and `name` is NUL-terminated.
    unsafe {
        let lib = libloading::Library::new(path).expect("the emulation's libascendcl.so");
        let f: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char) -> u64> = lib
            .get(b"ascendEmulatorLaunchCount\0")
            .expect("the emulation's launch counter");
        f(name.as_ptr())
    }
}

/// HCCL's collectives (on the strict emulation in CI: `libhccl.so` of the CANN install
/// `ASCEND_HOME_PATH` names) over two ranks of the Ascend backend, devices 2 and 3: the same
/// checks and model step as the staged ones, the collective naming HCCL; and the negative case,
/// ranks calling different collectives, each failing with HCCL's error naming both calls.
#[cfg(feature = "ascend")]
#[test]
fn hccl_collectives_conform_over_the_ascend_backend() {
    use npu_agent::conformance::collective::{check_collectives, check_mismatch, hccl};
    use npu_backend_ascend::{AscendBackend, AscendConfig};
    if std::env::var_os("ASCEND_HOME_PATH").is_none() {
        eprintln!("ascend: skipped, ASCEND_HOME_PATH is not set");
        return;
    }
    let file = model();
    let make = |device: u32| {
        AscendBackend::new(AscendConfig {
            start_device_id: device,
            ..AscendConfig::default()
        })
        .expect("an Ascend device")
    };
    let (mut a, mut b) = (make(2), make(3));
    let mut report = Report::new("ascend, HCCL, 2 ranks (devices 2 and 3)");
    check_mismatch(
        (&mut a, &mut b),
        &hccl,
        &["HcclAllReduce", "HcclAllGather", "HCCL_E_PARA"],
        std::time::Duration::from_secs(30),
        &mut report,
    );
    let launches = || emulated_launches(c"aclnnMatmulAllReduce");
    let before = launches();
    let wq_before = emulated_launches(c"aclnnWeightQuantMatmulAllReduce");
    check_collectives((a, b), &hccl, conformance::reference(), &file, &mut report);
    // The default model's products are quantized (Q4_1: WeightQuantBatchMatmulV2's form):
    // aclnnWeightQuantMatmulAllReduce in the model step.
    let matmul = launches() - before;
    let quantized = emulated_launches(c"aclnnWeightQuantMatmulAllReduce") - wq_before;
    // A synthetic Qwen3 of f16 weights: its attention output and FFN down products run as
    // aclnnMatmulAllReduce on both ranks, in every layer.
    let donor = model();
    let bytes = npu_gguf::synth::synth_model(
        npu_gguf::synth::Family::Qwen3,
        1,
        npu_gguf::GgmlType::F16,
        &donor,
    )
    .unwrap();
    // A file: the model's loader maps its weights from the path.
    let path = std::env::temp_dir().join(format!("npu-hccl-qwen3-f16-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let qwen3 = GgufFile::open(&path).unwrap();
    let before = launches();
    check_collectives(
        (make(4), make(5)),
        &hccl,
        conformance::reference(),
        &qwen3,
        &mut report,
    );
    let dense = launches() - before;
    let _ = std::fs::remove_file(&path);
    eprintln!("{}", report.render());
    // The collective says the product checks ran fused, on both ranks, both times.
    for r in 0..2 {
        let name =
            format!("matmul_all_reduce_sum, rank {r}: the bits of matmul then all_reduce_sum");
        let fused = report
            .checks
            .iter()
            .filter(|c| c.name == name && c.passed && c.note == "fused (one operator)")
            .count();
        assert_eq!(fused, 2, "{}", report.render());
    }
    let q4_layers = npu_model::ModelConfig::from_gguf(&file).unwrap().n_layers as u64;
    assert_eq!(
        matmul, 2,
        "aclnnMatmulAllReduce launches with Q4_1 weights: the product checks"
    );
    assert_eq!(
        quantized,
        2 * 2 * q4_layers,
        "aclnnWeightQuantMatmulAllReduce launches with Q4_1 weights: 2 per layer on each of 2 ranks"
    );
    let layers = npu_model::ModelConfig::from_gguf(&qwen3).unwrap().n_layers as u64;
    assert_eq!(
        dense,
        2 + 2 * 2 * layers,
        "aclnnMatmulAllReduce launches with f16 weights: 2 product checks and 2 per layer on \
         each of 2 ranks"
    );
    assert!(
        report
            .checks
            .iter()
            .any(|c| c.name == "the collective says what carries it" && c.note.contains("HCCL")),
        "{}",
        report.render()
    );
    assert!(report.checks.len() >= 12, "{}", report.render());
    assert!(report.failures().is_empty(), "{}", report.render());
}

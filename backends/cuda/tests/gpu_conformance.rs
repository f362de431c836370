//! The conformance cases (tests/common/conformance.rs: every op in f32, f16 and bf16
//! activations and each matmul mode) and the greedy fidelity check of the default model, on a
//! real CUDA GPU. Without a usable GPU every case is reported SKIPPED with the reason, never as
//! passed (this target has its own harness for that reason).
//!
//! `NPU_SERVING_CUDA_DEVICE` picks the device (default 0). The fidelity check needs the default
//! model on the machine (`NPU_SERVING_MODEL`, else the model cache): a GPU machine without
//! network (the GPU check kit's) reports it SKIPPED, and scripts/gpu-check.sh checks fidelity on
//! random-weight models it makes there instead. Built with the emulation (test builds are),
//! `NPU_SERVING_CUDA_EMULATION=1` runs it all on the CPU emulation of the kernels (the kit's dry
//! run).

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use common::conformance::CASES;
use npu_backend::{Backend, DType};
use npu_backend_cuda::{CudaBackend, CudaConfig, MatmulMode};

fn device() -> usize {
    std::env::var("NPU_SERVING_CUDA_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn on_gpu(dt: DType, matmul: MatmulMode) -> Option<CudaBackend> {
    let cfg = CudaConfig {
        act_dtype: dt,
        matmul,
        gemv_max_rows: 8,
        ..CudaConfig::default()
    };
    Some(CudaBackend::new(device(), cfg).expect("the GPU opened before"))
}

fn main() {
    let fidelity = "default_model_greedy_tokens_match_llama_cpp";
    let total = CASES.len() + 1;
    let probe = catch_unwind(|| CudaBackend::new(device(), CudaConfig::default()));
    let b = match probe {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            for (name, _) in CASES {
                println!("test {name} ... SKIPPED");
            }
            println!("test {fidelity} ... SKIPPED");
            println!(
                "\ngpu_conformance: 0 passed; 0 failed; {total} SKIPPED: no usable CUDA GPU here: {e}"
            );
            return;
        }
        Err(_) => {
            println!("gpu_conformance: FAILED: opening the CUDA device panicked");
            std::process::exit(1);
        }
    };
    println!("running on {}", b.describe());
    println!(
        "each case runs f32, f16 and bf16 activations (and each matmul mode where it applies)"
    );
    drop(b);
    let mut failed = Vec::new();
    for (name, case) in CASES {
        let r = catch_unwind(AssertUnwindSafe(|| case(&on_gpu)));
        println!(
            "test {name} ... {}",
            if r.is_ok() { "ok" } else { "FAILED" }
        );
        if r.is_err() {
            failed.push(*name);
        }
    }
    let env = npu_gguf::store::StoreEnv::from_process();
    let model = env
        .npu_serving_model
        .clone()
        .or_else(|| env.default_model_path().ok())
        .filter(|p| p.is_file());
    let mut skipped = 0;
    match model {
        None => {
            skipped += 1;
            println!(
                "test {fidelity} ... SKIPPED: the default model is not on this machine (set \
                 NPU_SERVING_MODEL; nothing is fetched here)"
            );
        }
        Some(path) => {
            let r = catch_unwind(AssertUnwindSafe(|| {
                let mut b = on_gpu(DType::F32, MatmulMode::Quantized).unwrap();
                common::llama::check_greedy_fidelity(&mut b, &path, 32)
            }));
            match &r {
                Ok((same, all)) => {
                    println!("test {fidelity} ... ok ({same} of {all} tokens as llama.cpp)")
                }
                Err(_) => {
                    println!("test {fidelity} ... FAILED");
                    failed.push(fidelity);
                }
            }
        }
    }
    println!(
        "\ngpu_conformance: {} passed; {} failed; {skipped} skipped",
        total - failed.len() - skipped,
        failed.len()
    );
    if !failed.is_empty() {
        println!("failed: {failed:?}");
        std::process::exit(1);
    }
}

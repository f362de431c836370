//! The conformance cases (tests/common/conformance.rs) and the greedy fidelity check of the
//! default model, on a real CUDA GPU. Without a usable GPU every case is reported SKIPPED with
//! the reason, never as passed (this target has its own harness for that reason).
//!
//! `NPU_SERVING_CUDA_DEVICE` picks the device (default 0).

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
    let r = catch_unwind(AssertUnwindSafe(|| {
        let path = npu_gguf::store::resolve_model(None).expect("the default model");
        let mut b = on_gpu(DType::F32, MatmulMode::Quantized).unwrap();
        common::llama::check_greedy_fidelity(&mut b, &path, 32)
    }));
    match &r {
        Ok((same, all)) => println!("test {fidelity} ... ok ({same} of {all} tokens as llama.cpp)"),
        Err(_) => {
            println!("test {fidelity} ... FAILED");
            failed.push(fidelity);
        }
    }
    println!(
        "\ngpu_conformance: {} passed; {} failed; 0 skipped",
        total - failed.len(),
        failed.len()
    );
    if !failed.is_empty() {
        println!("failed: {failed:?}");
        std::process::exit(1);
    }
}

//! The default model (SmolLM2-135M-Instruct Q4_1) run end to end on the CUDA backend, in its
//! default configuration (f32 activations, quantized matmuls), over the CPU EMULATION of its
//! kernels: three prompts batched, prefill in chunks of 4 mixed with decodes, 16 greedy tokens
//! each, compared with llama.cpp's tokens up to each prompt's first near tie (steps 14, 13 and
//! none). An emulation run, not a GPU run; tests/gpu_conformance.rs runs 32 tokens on a GPU.

mod common;

use npu_backend::DType;
use npu_backend_cuda::MatmulMode;

#[test]
fn default_model_greedy_tokens_match_llama_cpp_on_the_emulation() {
    let Some(mut b) = common::emulated(DType::F32, MatmulMode::Quantized) else {
        return;
    };
    let path = npu_gguf::store::resolve_model(None).expect("the default model");
    let started = std::time::Instant::now();
    let (same, total) = common::llama::check_greedy_fidelity(&mut b, &path, 16);
    eprintln!(
        "emulation: {same} of {total} greedy tokens as llama.cpp ({:.0} s)",
        started.elapsed().as_secs_f64()
    );
}

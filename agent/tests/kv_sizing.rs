//! The KV pool sized from free device memory (`ModelOptions::kv_memory_fraction`), with the real
//! default model: the pool takes the fraction of the memory left after the weights and step
//! buffers, in whole blocks, at most `num_blocks`; the model still computes the reference
//! tokens on it. On the CUDA backend's emulation (a bounded, tracked device space) the count is
//! checked exactly; on the CPU backend (free memory is the host's, which moves) within bounds.

mod common;

use common::model_path;
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, SeqSpan, StepInputs};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::GgufFile;

/// "The capital of France is" and llama.cpp's first greedy token.
const PROMPT_IDS: [u32; 5] = [504, 3575, 282, 4649, 314];
const FIRST_TOKEN: u32 = 7042;

fn options(num_blocks: usize, fraction: Option<f64>) -> ModelOptions {
    ModelOptions {
        max_tokens: 16,
        max_logit_rows: 1,
        num_blocks,
        block_size: 16,
        kv_memory_fraction: fraction,
    }
}

/// The greedy token after the prompt, its KV in block `block` (the pool's last, to show the
/// whole pool is addressable).
fn first_token<B: Backend>(model: &mut Model<B>, block: u32) -> u32 {
    let n = PROMPT_IDS.len();
    let inputs = StepInputs {
        tokens: PROMPT_IDS.to_vec(),
        positions: (0..n as u32).collect(),
        slot_mapping: (0..n as u32).map(|p| block * 16 + p).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: n as u32,
            start_pos: 0,
        }],
        block_tables: vec![block],
        max_blocks: 1,
        logit_rows: vec![n as u32 - 1],
    };
    let mut out = StepOutput::default();
    model.forward(&inputs, true, &mut out).unwrap();
    if out.picked_on_device {
        return out.ids[0] as u32;
    }
    let row = &out.logits[..model.cfg.vocab];
    let best = row
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap();
    best.0 as u32
}

#[test]
fn cpu_pool_from_free_memory_is_capped_and_computes_the_reference() {
    let path = model_path();
    let file = GgufFile::open(&path).unwrap();
    let cpu = || {
        CpuBackend::new(CpuConfig {
            threads: 0,
            f32_reference: false,
        })
    };
    // Half the host's free memory is far more than 50 blocks: the cap binds.
    let mut model = Model::load(&file, cpu(), options(50, Some(0.5))).unwrap();
    assert_eq!(model.opts.num_blocks, 50);
    assert_eq!(model.opts.kv_memory_fraction, Some(0.5));
    assert_eq!(first_token(&mut model, 49), FIRST_TOKEN);
    let block_bytes = model.backend().kv_block_bytes() as f64;
    let free = model.backend().mem_info().unwrap().free as f64;
    drop(model);

    // A fraction sized for about 12 blocks of what is free now: free memory moves (this test's
    // own allocations, other processes), so within a factor of two.
    let fraction = 12.0 * block_bytes / free;
    let model = Model::load(&file, cpu(), options(usize::MAX, Some(fraction))).unwrap();
    assert!(
        (6..=24).contains(&model.opts.num_blocks),
        "{} blocks from a fraction sized for 12",
        model.opts.num_blocks
    );
    drop(model);

    // Not one block: refused, naming the setting.
    let e = Model::load(&file, cpu(), options(usize::MAX, Some(1e-15)))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("npu_serving.kv_cache_memory_fraction"), "{e}");
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_emulation_pool_is_the_fraction_of_what_the_weights_left_in_whole_blocks() {
    use npu_backend_cuda::{CudaBackend, CudaConfig};
    let file = GgufFile::open(model_path()).unwrap();
    let cfg = CudaConfig {
        kernel_cache: None,
        ..CudaConfig::default()
    };
    let backend = match CudaBackend::emulated(cfg) {
        Ok(b) => b,
        Err(e) if e.to_string().contains("could not run the C++ compiler") => {
            eprintln!("SKIPPED (no C++ compiler for the CUDA emulation): {e}");
            return;
        }
        Err(e) => panic!("the CUDA emulation: {e}"),
    };
    let fraction = 0.25;
    let mut model = Model::load(&file, backend, options(1 << 20, Some(fraction))).unwrap();
    let blocks = model.opts.num_blocks as u64;
    let block_bytes = model.backend().kv_block_bytes() as u64;
    assert_eq!(block_bytes, 30 * 2 * 16 * 3 * 64 * 2);
    // The emulated device tracks every allocation: what was free before the pool is what is
    // free now plus the pool.
    let free_now = model.backend().mem_info().unwrap().free;
    let free_before = free_now + blocks * block_bytes;
    let want = (free_before as f64 * fraction).floor() as u64 / block_bytes;
    assert_eq!(blocks, want, "free before the pool: {free_before} bytes");
    assert!(blocks > 1000, "{blocks}");
    let last = blocks as u32 - 1;
    assert_eq!(first_token(&mut model, last), FIRST_TOKEN);
}

/// The int8 KV cache (`kv_cache_dtype: int8`) on the CUDA backend's emulation: the pool sized
/// from the same fraction holds its int8 blocks (the CPU backend's block bytes, 0.52 of f16's
/// for this model), so 1.94x the tokens an f16 pool would, and the model computes llama.cpp's
/// first token with its prompt's KV in the pool's last block.
#[cfg(feature = "cuda")]
#[test]
fn cuda_emulation_int8_pool_holds_1_9x_the_tokens_of_f16() {
    use npu_backend::KvDtype;
    use npu_backend_cuda::{CudaBackend, CudaConfig};
    let file = GgufFile::open(model_path()).unwrap();
    let cfg = CudaConfig {
        kernel_cache: None,
        ..CudaConfig::default()
    };
    let mut backend = match CudaBackend::emulated(cfg) {
        Ok(b) => b,
        Err(e) if e.to_string().contains("could not run the C++ compiler") => {
            eprintln!("SKIPPED (no C++ compiler for the CUDA emulation): {e}");
            return;
        }
        Err(e) => panic!("the CUDA emulation: {e}"),
    };
    backend.set_kv_dtype(KvDtype::Int8).unwrap();
    let fraction = 0.25;
    let mut model = Model::load(&file, backend, options(1 << 20, Some(fraction))).unwrap();
    let blocks = model.opts.num_blocks as u64;
    let block_bytes = model.backend().kv_block_bytes() as u64;
    // 30 layers of int8 K and V (3 KV heads of 64, 16 slots), then one f16 scale per token,
    // KV head, K or V, and layer.
    assert_eq!(block_bytes, 30 * 2 * 16 * 3 * 64 + 30 * 2 * 16 * 3 * 2);
    let free_now = model.backend().mem_info().unwrap().free;
    let free_before = free_now + blocks * block_bytes;
    let budget = (free_before as f64 * fraction).floor() as u64;
    assert_eq!(
        blocks,
        budget / block_bytes,
        "free before the pool: {free_before}"
    );
    let f16_blocks = budget / (30 * 2 * 16 * 3 * 64 * 2);
    let ratio = blocks as f64 / f16_blocks as f64;
    assert!(
        (1.93..1.95).contains(&ratio),
        "{blocks} int8 blocks, {f16_blocks} f16: {ratio}"
    );
    let last = blocks as u32 - 1;
    assert_eq!(first_token(&mut model, last), FIRST_TOKEN);
}

//! The CUDA backend's folded launches (`CudaConfig::fuse`: the residual add folded into the next
//! RMS norm, rope and the KV write in one kernel (with Qwen3's per-head Q/K norms), and the 8-bit activations of a quantized
//! product written by the kernel producing its input; and `fold_gemv`: the RMS norms, residual
//! adds, SwiGLU, and rope with the KV write folded into the quantized GEMVs beside them) change no bit of a model's answers: tiny
//! random-weight llama, llama3 and qwen3 models (Q8_0; qwen3 with its per-head Q/K norms), run
//! by the agent's own model on the CPU emulation of the kernels with the folds on and off, give
//! the same greedy ids and log-probabilities and the same logits bit for bit, in the launches
//! pinned below. Built with the `cuda` and `ascend` features (the emulations' shared test
//! helpers).

#![cfg(all(feature = "cuda", feature = "ascend"))]

mod common;

use common::devices::cuda;
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, SeqSpan, StepInputs};
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};

fn options() -> ModelOptions {
    ModelOptions {
        max_tokens: 64,
        max_logit_rows: 1,
        num_blocks: 8,
        block_size: 16,
        kv_memory_fraction: None,
    }
}

/// The step feeding `new` tokens of one sequence after `start` cached ones (slot = position).
fn seq_step(new: &[u32], start: usize) -> StepInputs {
    let max_blocks = 8;
    StepInputs {
        tokens: new.to_vec(),
        positions: (start..start + new.len()).map(|p| p as u32).collect(),
        slot_mapping: (start..start + new.len()).map(|p| p as u32).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: new.len() as u32,
            start_pos: start as u32,
        }],
        block_tables: (0..max_blocks as u32).collect(),
        max_blocks,
        logit_rows: vec![new.len() as u32 - 1],
    }
}

/// What a run gives: each greedy step's id and log-probability bits, each logit step's logits'
/// bits, and the launches of each single-token greedy step.
#[derive(Debug, PartialEq)]
struct Run {
    picks: Vec<(i32, u32)>,
    logits: Vec<Vec<u32>>,
    decode_launches: Vec<u64>,
}

/// A prompt in one step, then 6 greedy single-token steps; then the same again asking for
/// logits (the host's pick) along the greedy tokens. `fold_gemv`: the folds into the GEMVs too
/// (`NPU_SERVING_CUDA_FUSE=2`; without them, `1`).
fn run(file: &GgufFile, fuse: bool, fold_gemv: bool, fold_rope: bool) -> Run {
    let mut b = cuda();
    b.set_fuse(fuse);
    b.set_fold_gemv(fold_gemv);
    b.set_fold_rope(fold_rope);
    let mut m = Model::load(file, b, options()).unwrap();
    let prompt = [1u32, 15, 27, 3, 99];
    let mut out = StepOutput::default();
    let mut r = Run {
        picks: Vec::new(),
        logits: Vec::new(),
        decode_launches: Vec::new(),
    };
    let (mut pos, mut next) = (0, prompt.to_vec());
    let mut tokens = Vec::new();
    for _ in 0..7 {
        let before = m.backend().op_counts().unwrap().launches;
        m.forward(&seq_step(&next, pos), true, &mut out).unwrap();
        assert!(
            out.picked_on_device,
            "the CUDA backend picks greedy tokens itself"
        );
        if next.len() == 1 {
            r.decode_launches
                .push(m.backend().op_counts().unwrap().launches - before);
        }
        pos += next.len();
        r.picks.push((out.ids[0], out.logprobs[0].to_bits()));
        next = vec![out.ids[0] as u32];
        tokens.push(out.ids[0] as u32);
    }
    // Logits along the same tokens, in a second sequence's blocks (positions from 0 again).
    let (mut pos, mut next) = (0, prompt.to_vec());
    for &t in &tokens[..3] {
        let mut s = seq_step(&next, pos);
        s.slot_mapping.iter_mut().for_each(|x| *x += 64);
        s.block_tables = (4..12).map(|b| b % 8).collect();
        m.forward(&s, false, &mut out).unwrap();
        r.logits
            .push(out.logits.iter().map(|v| v.to_bits()).collect());
        pos += next.len();
        next = vec![t];
    }
    r
}

/// `launches`: a single-token step's launches, folded (with the GEMV folds, and without them)
/// and one op a launch; `roped`: with the rope fold too (`NPU_SERVING_CUDA_FUSE=3`).
fn check(family: Family, roped: u64, launches: (u64, u64, u64)) {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let bytes = synth::synth_model(family, 1, GgmlType::Q8_0, &donor).unwrap();
    let path = std::env::temp_dir().join(format!(
        "npu-cuda-fused-{}-{}.gguf",
        family.name(),
        std::process::id()
    ));
    std::fs::write(&path, bytes).unwrap();
    let file = GgufFile::open(&path).unwrap();
    let with_rope = run(&file, true, true, true);
    let folded = run(&file, true, true, false);
    let elementwise = run(&file, true, false, false);
    let plain = run(&file, false, false, false);
    let _ = std::fs::remove_file(&path);
    let name = family.name();
    assert_eq!(
        with_rope.picks, plain.picks,
        "{name}: greedy ids or log-probabilities (rope fold)"
    );
    assert!(
        with_rope.logits == plain.logits,
        "{name}: logits differ with the rope fold"
    );
    assert!(
        with_rope.decode_launches.iter().all(|&x| x == roped),
        "{name}: decode launches with the rope fold {:?}, expected {roped}",
        with_rope.decode_launches
    );
    assert_eq!(
        folded.picks, plain.picks,
        "{name}: greedy ids or log-probabilities"
    );
    assert_eq!(
        elementwise.picks, plain.picks,
        "{name}: greedy ids or log-probabilities (no GEMV folds)"
    );
    assert!(
        folded.logits == plain.logits,
        "{name}: logits differ when the launches are folded"
    );
    assert!(
        elementwise.logits == plain.logits,
        "{name}: logits differ when the launches are folded (no GEMV folds)"
    );
    eprintln!(
        "{name}: decode launches a step, folded {:?}, without the GEMV folds {:?}, one op a \
         launch {:?}",
        folded.decode_launches, elementwise.decode_launches, plain.decode_launches
    );
    let all = |v: &[u64], n: u64| v.iter().all(|&x| x == n);
    assert!(
        all(&folded.decode_launches, launches.0)
            && all(&elementwise.decode_launches, launches.1)
            && all(&plain.decode_launches, launches.2),
        "{name}: decode launches {:?} folded, {:?} without the GEMV folds and {:?} one op a \
         launch, expected {launches:?}",
        folded.decode_launches,
        elementwise.decode_launches,
        plain.decode_launches
    );
}

/// Launches of a single-token step, one op a launch: 16 a layer (18 with Qwen3's two head
/// norms) and 7 outside the layers. Folded by default: 6 a layer, the rope fold's 5 below and
/// `rope_kv_write` (Qwen3: `norm_rope_kv_write`) apart. With the rope fold
/// (`NPU_SERVING_CUDA_FUSE=3`): 5 a layer — Q/K/V GEMV with the attention norm
/// before it and rope and the KV write after it (Qwen3: its head norms first), attention, output
/// GEMV with the residual add, gate/up GEMV with the FFN norm and SwiGLU, down GEMV with the
/// residual add (backends/cuda/src/fold.rs) — where the head size is a multiple of 32 (llama3, qwen3: 32) and the
/// attention kernel writes the output projection's 8-bit activations, one more where it is not
/// (llama: 16, so `quantize_q8` runs for that product); 5 outside (embedding,
/// logit-row gather, the head's GEMV with the final norm folded in, argmax and its
/// log-probability). Without the GEMV folds (`NPU_SERVING_CUDA_FUSE=1`): 9 a layer (10 for
/// llama), the last layer's residual add alone, and 6 outside (the final norm apart, writing
/// the head's 8-bit activations).
#[test]
fn folded_cuda_launches_answer_as_the_unfolded_ones() {
    check(
        Family::Llama,
        2 * 6 + 5,
        (2 * 7 + 5, 2 * 10 + 1 + 6, 2 * 16 + 7),
    );
    check(
        Family::Llama3,
        3 * 5 + 5,
        (3 * 6 + 5, 3 * 9 + 1 + 6, 3 * 16 + 7),
    );
    check(
        Family::Qwen3,
        3 * 5 + 5,
        (3 * 6 + 5, 3 * 9 + 1 + 6, 3 * 18 + 7),
    );
}

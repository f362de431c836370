//! A whole model's prefill on the int8 tensor cores, over the CPU EMULATION of the kernels: a
//! small random-weight Llama with Q8_0 matrices (hidden 128, feed-forward 1056 = 33 blocks of 32,
//! so the down projection has more blocks a row than a warp has lanes and the others fewer),
//! two prompts prefilled in one step of 115 rows (the tiled GEMM `gemm_tiled_*`: a full and a
//! ragged 64-row tile, output counts not multiples of 64), then decode steps of 2 rows (the
//! GEMV). With the tensor cores on and off (`int8_mma`, as `NPU_SERVING_CUDA_MMA`), every step's
//! greedy tokens and logits must be the same bits. Not a GPU run.

mod common;

use common::llama::Llama;
use npu_backend::{SeqSpan, StepInputs};
use npu_backend_cuda::{CudaBackend, CudaConfig};
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};

fn backend(int8_mma: bool) -> Option<CudaBackend> {
    let cfg = CudaConfig {
        int8_mma,
        gemv_max_rows: 8,
        kernel_cache: None,
        lib_dirs: Vec::new(),
        ..CudaConfig::default()
    };
    match CudaBackend::emulated(cfg) {
        Ok(b) => Some(b),
        Err(e) if e.to_string().contains("could not run the C++ compiler") => {
            eprintln!("SKIPPED (no C++ compiler for the CUDA emulation): {e}");
            None
        }
        Err(e) => panic!("the CUDA emulation failed to build: {e}"),
    }
}

const BLOCK: usize = 16;
const BLOCKS_PER_SEQ: usize = 8;

/// What a run gave: every step's logit rows, each sequence's tokens, the kernels launched.
struct Run {
    logits: Vec<Vec<f32>>,
    tokens: Vec<Vec<u32>>,
    launched: Vec<String>,
}

/// Prefill of `prompts` in one step, then `decodes` steps of one token each.
fn run(f: &GgufFile, int8_mma: bool, prompts: &[Vec<u32>], decodes: usize) -> Option<Run> {
    let mut b = backend(int8_mma)?;
    let n_seqs = prompts.len();
    let mut m = Llama::load(f, &mut b, 128, n_seqs, n_seqs * BLOCKS_PER_SEQ, BLOCK);
    common::take_launches(&b);
    let mut all: Vec<Vec<u32>> = prompts.to_vec();
    let mut done = vec![0usize; n_seqs];
    let mut logits = Vec::new();
    for _ in 0..=decodes {
        let mut s = StepInputs {
            max_blocks: BLOCKS_PER_SEQ,
            ..Default::default()
        };
        for (i, seq) in all.iter().enumerate() {
            let table: Vec<u32> = (0..BLOCKS_PER_SEQ)
                .map(|j| (i * BLOCKS_PER_SEQ + j) as u32)
                .collect();
            s.seqs.push(SeqSpan {
                q_row: s.tokens.len() as u32,
                n_q: (seq.len() - done[i]) as u32,
                start_pos: done[i] as u32,
            });
            for (p, &tok) in seq.iter().enumerate().skip(done[i]) {
                s.tokens.push(tok);
                s.positions.push(p as u32);
                s.slot_mapping
                    .push(table[p / BLOCK] * BLOCK as u32 + (p % BLOCK) as u32);
            }
            s.block_tables.extend(&table);
            s.logit_rows.push(s.tokens.len() as u32 - 1);
            done[i] = seq.len();
        }
        let ids = m.step(&mut b, &s);
        logits.push(m.last_logits.clone());
        for (seq, id) in all.iter_mut().zip(ids) {
            seq.push(id);
        }
    }
    let launched = common::take_launches(&b).unwrap_or_default();
    Some(Run {
        logits,
        tokens: all,
        launched,
    })
}

#[test]
fn prefill_on_the_tiled_tensor_core_gemm_keeps_the_gemvs_tokens_and_logits() {
    let donor =
        GgufFile::open(npu_gguf::store::resolve_model(None).expect("the default model")).unwrap();
    let mut shape = Family::Llama.shape();
    shape.hidden = 128;
    shape.heads = 4;
    shape.head_dim = 32;
    shape.ff = 1056;
    let bytes = synth::synth_model_shaped(Family::Llama, shape, 5, GgmlType::Q8_0, &donor).unwrap();
    let path = std::env::temp_dir().join(format!("npu-prefill-mma-{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let prompt = |len: usize, seed: u32| -> Vec<u32> {
        (0..len as u32)
            .map(|i| 100 + (i * 7919 + seed * 104_729) % 20_000)
            .collect()
    };
    let prompts = vec![prompt(70, 1), prompt(45, 2)];
    let Some(on) = run(&f, true, &prompts, 3) else {
        return;
    };
    let off = run(&f, false, &prompts, 3).unwrap();
    let (on_launched, off_launched) = (&on.launched, &off.launched);
    let _ = std::fs::remove_file(&path);
    // The prefill (115 rows) took the tiled GEMM for its Q8_0 matrices, and only with it on.
    assert!(
        on_launched.iter().any(|l| l == "gemm_tiled_q8_0_f32"),
        "{on_launched:?}"
    );
    assert!(
        !off_launched.iter().any(|l| l.starts_with("gemm_")),
        "{off_launched:?}"
    );
    assert_eq!(on.tokens, off.tokens, "greedy tokens");
    for (step, (a, b)) in on.logits.iter().zip(&off.logits).enumerate() {
        assert_eq!(a.len(), b.len());
        assert!(
            a.iter().all(|v| v.is_finite()),
            "step {step}: logits not finite"
        );
        let first = a[0];
        assert!(
            a.iter().any(|&v| v != first),
            "step {step}: constant logits"
        );
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(
                x.to_bits(),
                y.to_bits(),
                "step {step} logit {i}: {x} with the tensor cores, {y} with the GEMV"
            );
        }
    }
}

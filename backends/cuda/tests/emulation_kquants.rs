//! A whole model with Q4_K matrices over the CPU EMULATION of the kernels: a small random-weight
//! Llama (hidden 256, feed-forward 512: every matrix's inputs whole Q4_K blocks) run with its
//! K-quants dequantized to F16 (the default) and with them packed
//! (`NPU_SERVING_CUDA_KQUANTS=packed`: the packed Q4_K GEMV). A prefill of two prompts (more
//! than 8 rows: the GEMV looped) then decode steps; the greedy tokens must be the same (also
//! with every fold asked for, which packed K-quants decline), and the packed run must launch
//! the packed GEMV and no F16 one for the Q4_K matrices. And a prefill of 70 rows through the
//! tiled tensor-core GEMM for packed Q4_K gives the logit bits of the same steps on the GEMV
//! (int8 `mma` off). Not a GPU run.

mod common;

use common::llama::Llama;
use npu_backend::{SeqSpan, StepInputs};
use npu_backend_cuda::{CudaBackend, CudaConfig, KQuants};
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};

/// `fuse4`: every fold on (`NPU_SERVING_CUDA_FUSE=4`), which packed K-quants must decline;
/// `mma`: the int8 tensor-core GEMMs allowed (`NPU_SERVING_CUDA_MMA`).
fn backend(kquants: KQuants, fuse4: bool, mma: bool) -> Option<CudaBackend> {
    let cfg = CudaConfig {
        kquants,
        int8_mma: mma,
        fold_rope: fuse4,
        fold_ffn: fuse4,
        fold_attn_out: fuse4,
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
const BLOCKS_PER_SEQ: usize = 4;

/// What a run gives: the greedy tokens, the kernels launched, every step's logits.
type Run = (Vec<Vec<u32>>, Vec<String>, Vec<Vec<f32>>);

/// Greedy tokens after a prefill of `prompts` and `decodes` steps, the kernels launched and
/// the logits of each step.
fn run(
    f: &GgufFile,
    (kquants, fuse4, mma): (KQuants, bool, bool),
    prompts: &[Vec<u32>],
    decodes: usize,
) -> Option<Run> {
    let mut b = backend(kquants, fuse4, mma)?;
    let n_seqs = prompts.len();
    let mut m = Llama::load(f, &mut b, 128, n_seqs, n_seqs * BLOCKS_PER_SEQ, BLOCK);
    let mut logits = Vec::new();
    common::take_launches(&b);
    let mut all: Vec<Vec<u32>> = prompts.to_vec();
    let mut done = vec![0usize; n_seqs];
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
    Some((all, launched, logits))
}

/// The small Q4_K Llama written to a temporary file (`tag` names it); returns its path.
fn q4k_model(tag: &str) -> std::path::PathBuf {
    let donor =
        GgufFile::open(npu_gguf::store::resolve_model(None).expect("the default model")).unwrap();
    let mut shape = Family::Llama.shape();
    shape.hidden = 256;
    shape.heads = 8;
    shape.head_dim = 32;
    shape.ff = 512;
    let bytes = synth::synth_model_shaped(Family::Llama, shape, 9, GgmlType::Q4K, &donor).unwrap();
    let path = std::env::temp_dir().join(format!("npu-kquants-{tag}-{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    path
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 100 + (i * 7919 + seed * 104_729) % 20_000)
        .collect()
}

#[test]
fn packed_q4k_model_keeps_the_f16_paths_greedy_tokens() {
    let path = q4k_model("gemv");
    let f = GgufFile::open(&path).unwrap();
    let prompts = vec![prompt(9, 1), prompt(6, 2)];
    let Some((f16_tokens, f16_launched, _)) = run(&f, (KQuants::F16, false, true), &prompts, 4)
    else {
        return;
    };
    let (packed_tokens, packed_launched, _) =
        run(&f, (KQuants::Packed, false, true), &prompts, 4).unwrap();
    let (fuse4_tokens, _, _) = run(&f, (KQuants::Packed, true, true), &prompts, 4).unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(
        packed_launched.iter().any(|l| l == "gemv_q4_k_r8_f32"),
        "{packed_launched:?}"
    );
    assert!(
        !f16_launched.iter().any(|l| l.starts_with("gemv_q4_k")),
        "{f16_launched:?}"
    );
    assert_eq!(packed_tokens, f16_tokens, "greedy tokens");
    assert_eq!(
        fuse4_tokens, packed_tokens,
        "greedy tokens with every fold asked for"
    );
}

/// A prefill of 70 rows (two prompts of 40 and 30 tokens) takes the tiled tensor-core GEMM for
/// the packed Q4_K matrices (`gemm_tiled_q4_k_*`, from 33 rows); with the int8 `mma` paths off
/// (`NPU_SERVING_CUDA_MMA=0`) the same steps run the packed GEMV 8 rows a launch. Every step's
/// logits (the prefill's and 3 decode steps') must be the same bits, so the greedy tokens too.
#[test]
fn tiled_q4k_prefill_gives_the_gemvs_logit_bits() {
    let path = q4k_model("tiled");
    let f = GgufFile::open(&path).unwrap();
    let prompts = vec![prompt(40, 3), prompt(30, 4)];
    let Some((tiled_tokens, tiled_launched, tiled_logits)) =
        run(&f, (KQuants::Packed, false, true), &prompts, 3)
    else {
        return;
    };
    let (gemv_tokens, gemv_launched, gemv_logits) =
        run(&f, (KQuants::Packed, false, false), &prompts, 3).unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(
        tiled_launched.iter().any(|l| l == "gemm_tiled_q4_k_f32"),
        "{tiled_launched:?}"
    );
    assert!(
        !gemv_launched.iter().any(|l| l.starts_with("gemm_tiled")),
        "{gemv_launched:?}"
    );
    assert_eq!(tiled_logits.len(), gemv_logits.len());
    for (step, (t, g)) in tiled_logits.iter().zip(&gemv_logits).enumerate() {
        assert_eq!(t.len(), g.len());
        for (i, (a, b)) in t.iter().zip(g).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "step {step} logit {i}: {a} with the tiled GEMM, {b} with the GEMV"
            );
        }
    }
    assert_eq!(tiled_tokens, gemv_tokens, "greedy tokens");
}

//! A whole model with Q4_K matrices over the CPU EMULATION of the kernels: a small random-weight
//! Llama (hidden 256, feed-forward 512: every matrix's inputs whole Q4_K blocks) run with its
//! K-quants dequantized to F16 (the default) and with them packed
//! (`NPU_SERVING_CUDA_KQUANTS=packed`: the packed Q4_K GEMV). A prefill of two prompts (more
//! than 8 rows: the GEMV looped) then decode steps; the greedy tokens must be the same (also
//! with every fold asked for, which packed K-quants decline), and the packed run must launch
//! the packed GEMV and no F16 one for the Q4_K matrices. Not a GPU run.

mod common;

use common::llama::Llama;
use npu_backend::{SeqSpan, StepInputs};
use npu_backend_cuda::{CudaBackend, CudaConfig, KQuants};
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};

/// `fuse4`: every fold on (`NPU_SERVING_CUDA_FUSE=4`), which packed K-quants must decline.
fn backend(kquants: KQuants, fuse4: bool) -> Option<CudaBackend> {
    let cfg = CudaConfig {
        kquants,
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

/// Greedy tokens after a prefill of `prompts` and `decodes` steps, and the kernels launched.
fn run(
    f: &GgufFile,
    kquants: KQuants,
    fuse4: bool,
    prompts: &[Vec<u32>],
    decodes: usize,
) -> Option<(Vec<Vec<u32>>, Vec<String>)> {
    let mut b = backend(kquants, fuse4)?;
    let n_seqs = prompts.len();
    let mut m = Llama::load(f, &mut b, 64, n_seqs, n_seqs * BLOCKS_PER_SEQ, BLOCK);
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
        for (seq, id) in all.iter_mut().zip(ids) {
            seq.push(id);
        }
    }
    let launched = common::take_launches(&b).unwrap_or_default();
    Some((all, launched))
}

#[test]
fn packed_q4k_model_keeps_the_f16_paths_greedy_tokens() {
    let donor =
        GgufFile::open(npu_gguf::store::resolve_model(None).expect("the default model")).unwrap();
    let mut shape = Family::Llama.shape();
    shape.hidden = 256;
    shape.heads = 8;
    shape.head_dim = 32;
    shape.ff = 512;
    let bytes = synth::synth_model_shaped(Family::Llama, shape, 9, GgmlType::Q4K, &donor).unwrap();
    let path = std::env::temp_dir().join(format!("npu-kquants-{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let prompt = |len: usize, seed: u32| -> Vec<u32> {
        (0..len as u32)
            .map(|i| 100 + (i * 7919 + seed * 104_729) % 20_000)
            .collect()
    };
    let prompts = vec![prompt(9, 1), prompt(6, 2)];
    let Some((f16_tokens, f16_launched)) = run(&f, KQuants::F16, false, &prompts, 4) else {
        return;
    };
    let (packed_tokens, packed_launched) = run(&f, KQuants::Packed, false, &prompts, 4).unwrap();
    let (fuse4_tokens, _) = run(&f, KQuants::Packed, true, &prompts, 4).unwrap();
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

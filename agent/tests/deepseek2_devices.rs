//! The deepseek2 family (multi-head latent attention over a paged cache of latents, sigmoid
//! expert scores with a selection bias, group-limited choice and a routed scale, a shared expert,
//! a dense leading layer, YaRN) on the device backends' emulations: its tiny random-weight model
//! (regenerated from the seed in tests/data/family_deepseek2.jsonl, sha256 checked) run by the
//! agent's own model on the CUDA backend over the CPU emulation of its kernels (f32 activations,
//! quantized matmuls: `common::devices::cuda`), greedy tokens against llama.cpp's up to each
//! prompt's first near-tie (the product's 0.15 with f32 activations), with the prompt in one
//! step and in chunks of 2 tokens (prefill chunks after cached positions); the latent cache, its
//! attention and the scored routing run on the device (`attention_latent`, `kv_write_latent`,
//! `moe_route_scored` kernels). The Ascend backend has no latent attention yet: the model is
//! refused at load naming it. Built with the `cuda` and `ascend` features (the shared device
//! helpers need both).

#![cfg(all(feature = "cuda", feature = "ascend"))]

mod common;

use std::path::PathBuf;

use common::devices::{ascend, cuda};
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, SeqSpan, StepInputs};
use npu_backend_cuda::CudaBackend;
use npu_gguf::synth::{self, Family};
use npu_gguf::GgufFile;
use serde_json::Value;

struct Ref {
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
    first_near_tie: Option<usize>,
}

/// The first index of the largest value (as the device's greedy pick breaks ties).
fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b })
}

/// deepseek2's references and its model regenerated into a temporary file.
fn deepseek2() -> (Vec<Ref>, PathBuf) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/family_deepseek2.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let lines: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids = |v: &Value, k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let refs = lines
        .iter()
        .map(|v| Ref {
            prompt_ids: ids(v, "prompt_ids"),
            output_ids: ids(v, "output_ids"),
            first_near_tie: v["first_near_tie"].as_u64().map(|x| x as usize),
        })
        .collect();
    let v = &lines[0];
    let donor = GgufFile::open(common::model_path()).unwrap();
    let ty = synth::weight_type(v["weight_type"].as_str().unwrap()).unwrap();
    let bytes =
        synth::synth_model(Family::Deepseek2, v["seed"].as_u64().unwrap(), ty, &donor).unwrap();
    assert_eq!(
        synth::sha256_hex(&bytes),
        v["model_sha256"].as_str().unwrap(),
        "deepseek2: the regenerated model is not the file llama.cpp ran"
    );
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file =
        std::env::temp_dir().join(format!("npu-deepseek2-dev-{}-{n}.gguf", std::process::id()));
    std::fs::write(&file, bytes).unwrap();
    (refs, file)
}

fn options() -> ModelOptions {
    ModelOptions {
        max_tokens: 128,
        max_logit_rows: 1,
        num_blocks: 16,
        block_size: 16,
        kv_memory_fraction: None,
    }
}

/// The step that feeds `new` tokens of one sequence after `start` cached ones. The sequence's
/// blocks are numbered backwards from the pool's end (block i of the sequence is block 15 - i),
/// so that its context is not one run of slots.
fn seq_step(new: &[u32], start: usize) -> StepInputs {
    let (max_blocks, bs) = (16u32, 16u32);
    let table: Vec<u32> = (0..max_blocks).map(|i| max_blocks - 1 - i).collect();
    let slot = |p: usize| table[p / bs as usize] * bs + (p as u32 % bs);
    StepInputs {
        tokens: new.to_vec(),
        positions: (start..start + new.len()).map(|p| p as u32).collect(),
        slot_mapping: (start..start + new.len()).map(slot).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: new.len() as u32,
            start_pos: start as u32,
        }],
        block_tables: table,
        max_blocks: max_blocks as usize,
        logit_rows: vec![new.len() as u32 - 1],
    }
}

/// `n` greedy tokens of one sequence: the prompt in chunks of `chunk` tokens, then one token a
/// step.
fn greedy<B: Backend>(m: &mut Model<B>, prompt: &[u32], chunk: usize, n: usize) -> Vec<u32> {
    let mut out = StepOutput::default();
    let mut got = Vec::new();
    let mut pos = 0;
    for c in prompt.chunks(chunk) {
        m.forward(&seq_step(c, pos), true, &mut out).unwrap();
        pos += c.len();
    }
    while got.len() < n {
        let id = if out.picked_on_device {
            out.ids[0] as u32
        } else {
            argmax(&out.logits) as u32
        };
        got.push(id);
        if got.len() == n {
            break;
        }
        m.forward(&seq_step(&[id], pos), true, &mut out).unwrap();
        pos += 1;
    }
    got
}

/// Kernels the emulated device launched since the last call (and forgets them).
fn launched(m: &Model<CudaBackend>) -> Vec<String> {
    let emu = m.backend().emulation().expect("the CUDA emulation");
    let l = emu.launched();
    emu.clear_launched();
    l
}

#[test]
fn deepseek2_on_the_cuda_emulation() {
    let (refs, path) = deepseek2();
    let f = GgufFile::open(&path).unwrap();
    let mut m = Model::load(&f, cuda(), options()).unwrap();
    launched(&m);
    for chunk in [usize::MAX, 2] {
        for (i, r) in refs.iter().enumerate() {
            let n = r.first_near_tie.unwrap_or(r.output_ids.len());
            assert!(n > 0, "prompt {i}: llama.cpp's first step is a near-tie");
            let got = greedy(&mut m, &r.prompt_ids, chunk, n);
            assert_eq!(
                got,
                r.output_ids[..n],
                "deepseek2 on cuda, prompt {i} in chunks of {chunk}: differs from llama.cpp \
                 before its first near-tie"
            );
            eprintln!(
                "deepseek2 on cuda, prompt {i} in chunks of {}: {n} greedy tokens as llama.cpp's",
                chunk.min(r.prompt_ids.len())
            );
        }
    }
    // The latent cache, its attention and the scored routing ran as the device's kernels.
    let l = launched(&m);
    for k in [
        "kv_write_latent_f32",
        "attention_latent_f32",
        "moe_route_scored_f32",
    ] {
        assert!(l.iter().any(|n| n == k), "{k} never launched");
    }
    for k in ["kv_write_f32", "attention_f32", "moe_route_f32"] {
        assert!(!l.iter().any(|n| n == k), "{k} launched for deepseek2");
    }
    let _ = std::fs::remove_file(path);
}

/// The Ascend backend has no latent attention (nor scored routing) yet: refused at load, by name.
#[test]
fn deepseek2_is_refused_on_ascend_by_name() {
    let (_, path) = deepseek2();
    let f = GgufFile::open(&path).unwrap();
    let b = ascend();
    if b.supports(npu_backend::Capability::LatentAttention) {
        eprintln!("the Ascend backend reports latent attention: nothing refused to check");
        let _ = std::fs::remove_file(path);
        return;
    }
    let e = Model::load(&f, b, options()).err().unwrap().to_string();
    assert!(
        e.contains("deepseek2") && e.contains("latent attention"),
        "{e}"
    );
    let _ = std::fs::remove_file(path);
}

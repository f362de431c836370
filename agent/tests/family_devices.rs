//! The model families on the device backends' emulations: each family's tiny random-weight model
//! (regenerated from the seed in tests/data/family_<family>.jsonl, sha256 checked) run by the
//! agent's own model on the CUDA backend over the CPU emulation of its kernels and on the Ascend
//! backend over the strict CANN emulation, greedy tokens against llama.cpp's up to each prompt's
//! first near-tie (and the gemma3 prompt runs past its 8-token sliding window; qwen3moe routes
//! its tokens through the CUDA backend's device routing and per-expert groups, and on Ascend
//! through MoeGatingTopKSoftmaxV2 and MoeFinalizeRoutingV2 around one GroupedMatmulV4 per
//! projection over its experts' stacks; gemma3 runs on Ascend in bf16, chosen at load as its
//! hidden states outgrow f16). What a backend cannot run is refused at load by name: Gemma 3 on
//! Ascend when f16 is imposed. Built with the `cuda` and `ascend` features.
//!
//! A near-tie is a step where llama.cpp's top-1/top-2 logit gap is below a margin. With f32
//! activations (the CUDA backend here) the margin is the product's 0.15. With f16 activations (the
//! Ascend backend's for every family but gemma3) it scales with the logits, as f16's resolution does: these random
//! models' logits are 170 to 253, where one f16 step is 0.125, and the Ascend emulation's logits
//! lose up to 0.65 of a llama.cpp gap (0.0032 of the top logit) teacher-forced along llama.cpp's
//! tokens — with RmsNorm's gamma in f32 or in f16 alike. See `f16_margin`; with bf16
//! activations (gemma3 on Ascend) the margin is 8 units of bf16's rounding error instead
//! (`bf16_margin`), both in `common::devices`.

#![cfg(all(feature = "cuda", feature = "ascend"))]

mod common;

use std::path::PathBuf;

use common::devices::{act_margin, ascend, cuda};
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::DType;
use npu_backend::{Backend, SeqSpan, StepInputs};
use npu_backend_ascend::{Acl, AscendBackend, AscendConfig};
use npu_gguf::synth::{self, Family};
use npu_gguf::GgufFile;
use serde_json::Value;

struct Ref {
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
    /// llama.cpp's top-1/top-2 logit gap at each step.
    gaps: Vec<f32>,
    first_near_tie: Option<usize>,
}

/// The first index of the largest value (as the device's greedy pick breaks ties).
fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b })
}

/// The family's references and its model regenerated into a temporary file.
fn family(name: &str) -> (Vec<Ref>, PathBuf) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(format!("family_{name}.jsonl"));
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
            gaps: v["top1_top2_logit_gap"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect(),
            first_near_tie: v["first_near_tie"].as_u64().map(|x| x as usize),
        })
        .collect();
    let v = &lines[0];
    let donor = GgufFile::open(common::model_path()).unwrap();
    let ty = synth::weight_type(v["weight_type"].as_str().unwrap()).unwrap();
    let bytes = synth::synth_model(
        Family::from_name(name).unwrap(),
        v["seed"].as_u64().unwrap(),
        ty,
        &donor,
    )
    .unwrap();
    assert_eq!(
        synth::sha256_hex(&bytes),
        v["model_sha256"].as_str().unwrap(),
        "{name}: the regenerated model is not the file llama.cpp ran"
    );
    // One file per call: tests run in parallel threads and map their files.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = std::env::temp_dir().join(format!(
        "npu-family-dev-{name}-{}-{n}.gguf",
        std::process::id()
    ));
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

/// The step that feeds `new` tokens of one sequence after `start` cached ones (slot = position).
fn seq_step(new: &[u32], start: usize) -> StepInputs {
    let max_blocks = 16;
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

/// `n` greedy tokens of one sequence: the prompt in one step, then one token a step.
fn greedy<B: Backend>(m: &mut Model<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut out = StepOutput::default();
    let mut got = Vec::new();
    let mut pos = 0;
    let mut next = prompt.to_vec();
    while got.len() < n {
        m.forward(&seq_step(&next, pos), true, &mut out).unwrap();
        pos += next.len();
        let id = if out.picked_on_device {
            out.ids[0] as u32
        } else {
            argmax(&out.logits) as u32
        };
        got.push(id);
        next = vec![id];
    }
    got
}

/// The logits of each step fed llama.cpp's tokens (teacher forcing), stepped as [`greedy`] steps:
/// the prompt in one step, then one of `tokens` a step, so that while the greedy tokens equal
/// llama.cpp's both compute the same steps.
fn teacher_forced<B: Backend>(m: &mut Model<B>, prompt: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut out = StepOutput::default();
    let mut rows = Vec::new();
    let mut pos = 0;
    let mut next = prompt.to_vec();
    for &t in tokens {
        m.forward(&seq_step(&next, pos), false, &mut out).unwrap();
        assert!(!out.picked_on_device, "logits were asked for");
        pos += next.len();
        rows.push(std::mem::take(&mut out.logits));
        next = vec![t];
    }
    rows
}

fn check<B: Backend>(name: &str, device: &str, mut load: impl FnMut(&GgufFile) -> Model<B>) {
    let (refs, path) = family(name);
    let f = GgufFile::open(&path).unwrap();
    let mut m = load(&f);
    for (i, r) in refs.iter().enumerate() {
        let n = r.first_near_tie.unwrap_or(r.output_ids.len());
        let got = greedy(&mut m, &r.prompt_ids, n);
        assert_eq!(
            got,
            r.output_ids[..n],
            "{name} on {device}, prompt {i}: differs from llama.cpp before its first near-tie"
        );
    }
    let _ = std::fs::remove_file(path);
}

/// [`check`] for a backend with 16-bit activations, near-ties judged by the margin of its
/// activation type ([`act_margin`]) of the device's own logits: greedy tokens (picked on the device) equal llama.cpp's up to the first
/// near-tie, and teacher-forced along llama.cpp's tokens the device's top-1 is llama.cpp's token
/// at every step that is not a near-tie (past the first one too).
fn check_f16<B: Backend>(name: &str, device: &str, mut load: impl FnMut(&GgufFile) -> Model<B>) {
    let (refs, path) = family(name);
    let f = GgufFile::open(&path).unwrap();
    let mut m = load(&f);
    for (i, r) in refs.iter().enumerate() {
        let rows = teacher_forced(&mut m, &r.prompt_ids, &r.output_ids);
        let act = m.backend().act_dtype();
        let margins: Vec<f32> = rows.iter().map(|row| act_margin(act, row)).collect();
        let decided: Vec<usize> = (0..rows.len())
            .filter(|&s| r.gaps[s] >= margins[s])
            .collect();
        let n = (0..rows.len())
            .find(|&s| r.gaps[s] < margins[s])
            .unwrap_or(rows.len());
        let got = greedy(&mut m, &r.prompt_ids, n);
        assert_eq!(
            got,
            r.output_ids[..n],
            "{name} on {device}, prompt {i}: differs from llama.cpp before its first near-tie \
             (step {n}, margins {margins:?})"
        );
        let wrong: Vec<String> = decided
            .iter()
            .filter(|&&s| argmax(&rows[s]) != r.output_ids[s] as usize)
            .map(|&s| {
                let row = &rows[s];
                format!(
                    "step {s}: top-1 {} ({}), llama.cpp's {} ({}), llama.cpp's gap {}, margin {}",
                    argmax(row),
                    row[argmax(row)],
                    r.output_ids[s],
                    row[r.output_ids[s] as usize],
                    r.gaps[s],
                    margins[s]
                )
            })
            .collect();
        assert!(
            wrong.is_empty(),
            "{name} on {device}, prompt {i}: teacher-forced top-1 differs from llama.cpp's where \
             it is decided: {wrong:?}"
        );
        eprintln!(
            "{name} on {device}, prompt {i}: {n} greedy tokens as llama.cpp's (first near-tie \
             at {n}); teacher-forced top-1 as llama.cpp's at all {} decided steps of {}",
            decided.len(),
            rows.len()
        );
    }
    let _ = std::fs::remove_file(path);
}

#[test]
fn families_on_the_cuda_emulation() {
    for name in ["llama", "llama3", "qwen2", "qwen3", "qwen3moe", "gemma3"] {
        check(name, "cuda", |f| Model::load(f, cuda(), options()).unwrap());
    }
}

#[test]
fn families_on_the_ascend_emulation() {
    for name in ["llama", "llama3", "qwen2", "qwen3", "qwen3moe", "gemma3"] {
        check_f16(name, "ascend", |f| {
            let m = Model::load(f, ascend(), options()).unwrap();
            let want = if name == "gemma3" {
                DType::BF16
            } else {
                DType::F16
            };
            assert_eq!(m.backend().act_dtype(), want, "{name}'s activations");
            m
        });
    }
}

/// Gemma 3 on Ascend with f16 imposed (`AscendConfig::activations`): refused at load, by name.
#[test]
fn what_a_device_cannot_run_is_refused_by_name() {
    let (_, gemma) = family("gemma3");
    let f = GgufFile::open(&gemma).unwrap();
    let acl = Acl::init(&npu_ffi::SearchPaths::root(&common::devices::cann_root())).unwrap();
    let f16_only = AscendBackend::with_runtime(
        acl,
        AscendConfig {
            activations: Some(DType::F16),
            ..AscendConfig::default()
        },
    )
    .unwrap();
    let e = Model::load(&f, f16_only, options())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("gemma3") && e.contains("f16"), "{e}");
    let _ = std::fs::remove_file(gemma);
}

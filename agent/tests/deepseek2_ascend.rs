//! The deepseek2 family on the Ascend backend over the strict CANN emulation
//! (`common::devices::ascend`, f16 activations): its tiny random-weight model (regenerated from
//! the seed in tests/data/family_deepseek2.jsonl, sha256 checked: latent attention, sigmoid
//! expert scores with a selection bias, 2 of 4 groups and a routed scale, a shared expert, a
//! dense leading layer, YaRN) run by the agent's own model, the latent pool written by
//! ScatterNdUpdate and attended by FusedInferAttentionScoreV2 (one KV head of the whole row),
//! the routing by MoeGatingTopK. Greedy tokens equal llama.cpp's up to each prompt's first step
//! within the f16 margin (`act_margin` of the device's own logits), with the prompt in one step
//! and in chunks of 2 (prefill chunks after cached positions); teacher-forced along llama.cpp's
//! tokens, the device's top-1 is llama.cpp's token at every step beyond that margin. A second file
//! at DeepSeek's own latent widths (512 + 64, 32 heads: FusedInferAttentionScoreV3's MLA form;
//! and 16, V2-Lite's count, padded to 32 on the device) is checked against the CPU backend the
//! same way. Nothing here ran on an NPU. Built with the `cuda` and `ascend` features (the shared device helpers need
//! both).

#![cfg(all(feature = "cuda", feature = "ascend"))]

mod common;

use std::path::PathBuf;

use common::devices::{act_margin, ascend};
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, Capability, SeqSpan, StepInputs};
use npu_gguf::synth::{self, Family};
use npu_gguf::GgufFile;
use serde_json::Value;

struct Ref {
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
    /// llama.cpp's top-1/top-2 logit gap at each step.
    gaps: Vec<f32>,
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
            gaps: v["top1_top2_logit_gap"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect(),
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
    let file = std::env::temp_dir().join(format!(
        "npu-deepseek2-ascend-{}-{n}.gguf",
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

/// The step that feeds `new` tokens of one sequence after `start` cached ones, in blocks of `bs`.
/// The sequence's blocks are numbered backwards from the pool's end (block i of the sequence is
/// block 15 - i of 16), so that its context is not one run of slots.
fn seq_step(new: &[u32], start: usize, bs: usize) -> StepInputs {
    let (max_blocks, bs) = (16u32, bs as u32);
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
/// step (blocks of `bs`).
fn greedy<B: Backend>(
    m: &mut Model<B>,
    prompt: &[u32],
    chunk: usize,
    n: usize,
    bs: usize,
) -> Vec<u32> {
    let mut out = StepOutput::default();
    let mut got = Vec::new();
    let mut pos = 0;
    for c in prompt.chunks(chunk) {
        m.forward(&seq_step(c, pos, bs), true, &mut out).unwrap();
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
        m.forward(&seq_step(&[id], pos, bs), true, &mut out)
            .unwrap();
        pos += 1;
    }
    got
}

/// The logits of each step fed llama.cpp's tokens (teacher forcing), stepped as [`greedy`] steps
/// with the prompt in one step.
fn teacher_forced<B: Backend>(
    m: &mut Model<B>,
    prompt: &[u32],
    tokens: &[u32],
    bs: usize,
) -> Vec<Vec<f32>> {
    let mut out = StepOutput::default();
    let mut rows = Vec::new();
    let mut pos = 0;
    let mut next = prompt.to_vec();
    for &t in tokens {
        m.forward(&seq_step(&next, pos, bs), false, &mut out)
            .unwrap();
        pos += next.len();
        rows.push(std::mem::take(&mut out.logits));
        next = vec![t];
    }
    rows
}

#[test]
fn deepseek2_on_the_ascend_emulation() {
    let (refs, path) = deepseek2();
    let f = GgufFile::open(&path).unwrap();
    let b = ascend();
    assert!(b.supports(Capability::LatentAttention) && b.supports(Capability::ScoredRouting));
    let act = b.act_dtype();
    let mut m = Model::load(&f, b, options()).unwrap();
    for (i, r) in refs.iter().enumerate() {
        let rows = teacher_forced(&mut m, &r.prompt_ids, &r.output_ids, 16);
        let margins: Vec<f32> = rows.iter().map(|row| act_margin(act, row)).collect();
        let n = (0..rows.len())
            .find(|&s| r.gaps[s] < margins[s])
            .unwrap_or(rows.len());
        for chunk in [usize::MAX, 2] {
            let got = greedy(&mut m, &r.prompt_ids, chunk, n, 16);
            assert_eq!(
                got,
                r.output_ids[..n],
                "deepseek2 on ascend ({}), prompt {i} in chunks of {chunk}: differs from \
                 llama.cpp before its first near-tie (step {n})",
                act.name()
            );
        }
        let decided: Vec<usize> = (0..rows.len())
            .filter(|&s| r.gaps[s] >= margins[s])
            .collect();
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
            "deepseek2 on ascend ({}), prompt {i}: teacher-forced top-1 differs from llama.cpp's \
             at decided steps {wrong:?}",
            act.name()
        );
        eprintln!(
            "deepseek2 on ascend ({}), prompt {i}: {n} greedy tokens as llama.cpp's (whole \
             prompt and chunks of 2); teacher-forced top-1 as llama.cpp's at all {} decided \
             steps of {}",
            act.name(),
            decided.len(),
            rows.len()
        );
    }
    let _ = std::fs::remove_file(path);
}

/// A deepseek2 model at DeepSeek-V3's latent widths (kv_lora_rank 512, a rope part of 64: cache
/// rows of 576) with `heads` heads, every other size tiny, regenerated from a seed into a
/// temporary file.
fn deepseek2_mla_widths(heads: usize) -> PathBuf {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let base = Family::Deepseek2.shape();
    let shape = synth::Shape {
        heads,
        head_dim: 512 + 64,
        layers: 2,
        mla: Some(synth::SynthMla {
            q_lora_rank: 32,
            kv_lora_rank: 512,
            qk_nope: 16,
            qk_rope: 64,
            v_head_dim: 16,
        }),
        ..base
    };
    let bytes =
        synth::synth_model_shaped(Family::Deepseek2, shape, 5, npu_gguf::GgmlType::F16, &donor)
            .unwrap();
    let file = std::env::temp_dir().join(format!(
        "npu-deepseek2-mla-ascend-{heads}-{}.gguf",
        std::process::id()
    ));
    std::fs::write(&file, bytes).unwrap();
    file
}

/// The gap between the two largest values of a row.
fn top_gap(row: &[f32]) -> f32 {
    let top = argmax(row);
    let second = (0..row.len())
        .filter(|&i| i != top)
        .fold(f32::NEG_INFINITY, |m, i| m.max(row[i]));
    row[top] - second
}

/// DeepSeek's own latent widths on the Ascend emulation (FusedInferAttentionScoreV3's MLA form,
/// every step token-wise) against the CPU backend: the CPU backend's greedy tokens, teacher-forced
/// on both; every device logit lies within the f16 margin of the device's logits (`act_margin`)
/// of the CPU backend's; up to the first step the CPU backend decides by less than that margin,
/// the device's greedy tokens are the CPU backend's, with the prompt in one step and in chunks of
/// 2 and blocks of 16 and 128, and its top-1 is the CPU backend's token at every step decided
/// beyond it.
#[test]
fn deepseek2_at_deepseeks_latent_widths_on_the_ascend_emulation_equals_the_cpu_backend() {
    at_mla_widths(32);
}

/// The same with 16 heads (DeepSeek-V2-Lite's count, which the MLA form does not take: padded
/// on the device to 32 zero-query heads, only the real heads' outputs kept).
#[test]
fn deepseek2_with_v2_lites_16_heads_padded_on_the_ascend_emulation_equals_the_cpu_backend() {
    at_mla_widths(16);
}

fn at_mla_widths(heads: usize) {
    let (refs, ref_path) = deepseek2();
    let _ = std::fs::remove_file(ref_path);
    let path = deepseek2_mla_widths(heads);
    let f = GgufFile::open(&path).unwrap();
    let steps = 12;
    let cpu = npu_backend_cpu::CpuBackend::new(npu_backend_cpu::CpuConfig {
        threads: 0,
        f32_reference: false,
    });
    let mut c = Model::load(&f, cpu, options()).unwrap();
    for block_size in [16usize, 128] {
        let b = ascend();
        let act = b.act_dtype();
        let opts = ModelOptions {
            block_size,
            ..options()
        };
        let mut m = Model::load(&f, b, opts).unwrap();
        for (i, r) in refs.iter().enumerate() {
            let want = greedy(&mut c, &r.prompt_ids, usize::MAX, steps, 16);
            let cpu_rows = teacher_forced(&mut c, &r.prompt_ids, &want, 16);
            let rows = teacher_forced(&mut m, &r.prompt_ids, &want, block_size);
            let margins: Vec<f32> = rows.iter().map(|row| act_margin(act, row)).collect();
            let n = (0..rows.len())
                .find(|&s| top_gap(&cpu_rows[s]) < margins[s])
                .unwrap_or(rows.len());
            // Every teacher-forced logit within the f16 margin of the CPU backend's.
            for (st, (row, want_row)) in rows.iter().zip(&cpu_rows).enumerate() {
                let diff = row
                    .iter()
                    .zip(want_row)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    diff < margins[st],
                    "deepseek2 at 512 + 64, {heads} heads, on ascend, blocks of {block_size}, \
                     prompt {i}, step {st}: a logit {diff} from the CPU backend's (margin {})",
                    margins[st]
                );
            }
            for chunk in [usize::MAX, 2] {
                let got = greedy(&mut m, &r.prompt_ids, chunk, n, block_size);
                assert_eq!(
                    got,
                    want[..n],
                    "deepseek2 at 512 + 64, {heads} heads, on ascend, blocks of {block_size}, \
                     prompt {i} in chunks of {chunk}: differs from the CPU backend before its \
                     first near-tie (step {n})"
                );
            }
            let wrong: Vec<usize> = (0..rows.len())
                .filter(|&s| top_gap(&cpu_rows[s]) >= margins[s])
                .filter(|&s| argmax(&rows[s]) != want[s] as usize)
                .collect();
            assert!(
                wrong.is_empty(),
                "deepseek2 at 512 + 64, {heads} heads, on ascend, blocks of {block_size}, \
                 prompt {i}: top-1 differs from the CPU backend's at decided steps {wrong:?}"
            );
            eprintln!(
                "deepseek2 at 512 + 64, {heads} heads, on ascend, blocks of {block_size}, \
                 prompt {i}: {n} of {steps} greedy tokens as the CPU backend's (whole prompt \
                 and chunks of 2)"
            );
        }
    }
    let _ = std::fs::remove_file(path);
}

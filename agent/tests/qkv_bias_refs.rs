//! Q/K/V biases on a family other than Qwen2, against llama.cpp: llama.cpp reads
//! `attn_{q,k,v}.bias` on every family (each optional) and adds them after the projections, and
//! so does the engine. The random-weight Qwen2 model of `npu_gguf::synth` (seed 1, f32, the
//! default model's tokenizer; the file `npu-serving synth-model --arch qwen2 --seed 1` writes) is
//! relabelled as a Llama model (same tensors; keys renamed from `qwen2.` to `llama.`), once with
//! its three biases and once with only its K bias; llama.cpp's greedy tokens for each (llama-server
//! 0.5.0-dev, build 1, commit 0c1e570 of llama-cpp-python 0.3.36's vendored tree, temperature 0,
//! 24 tokens, 2026-11-29) must be the engine's: every step, none of them a near-tie (the smallest
//! top-1/top-2 gap was 0.13 with the three biases and 0.06 with the K bias only; the engine took
//! llama.cpp's token at each).

mod common;

use std::path::PathBuf;

use common::engine_config;
use npu_agent::engine::AgentEngine;
use npu_agent::inproc::{self, Arrival};
use npu_gguf::synth::{self, Family};
use npu_gguf::writer::{GgufWriter, TensorSpec};
use npu_gguf::{GgmlType, GgufFile};
use npu_protocol::SamplingParams;
use npu_scheduler::GenerateRequest;

const QWEN2_SEED1_SHA256: &str = "746c2d3c727e97807a3e13bc8d3a3d0041e84476fc1a39146fe3b385884798bc";
/// "The quick brown fox jumps over the lazy dog and then", as llama.cpp tokenizes it.
const PROMPT: [u32; 11] = [
    504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 284, 965,
];
const LLAMA_CPP_ALL_BIASES: [u32; 24] = [
    48875, 21364, 13409, 31530, 23921, 17255, 3295, 28775, 10509, 40120, 29489, 41692, 33938,
    24724, 20658, 30266, 43945, 105, 31207, 32047, 43276, 13310, 48902, 5887,
];
const LLAMA_CPP_K_BIAS_ONLY: [u32; 24] = [
    38575, 27907, 28067, 14875, 32461, 18159, 29581, 16385, 5208, 46297, 19856, 34855, 16714,
    10834, 1359, 13408, 40053, 12124, 1900, 14335, 37557, 44712, 26504, 12124,
];

/// A written model file, removed when dropped.
struct TempModel(PathBuf);

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The Qwen2 model relabelled as a Llama model, without the tensors `drop` names.
fn llama_with_biases(tag: &str, drop: &[&str]) -> TempModel {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let bytes = synth::synth_model(Family::Qwen2, 1, GgmlType::F32, &donor).unwrap();
    assert_eq!(
        synth::sha256_hex(&bytes),
        QWEN2_SEED1_SHA256,
        "the Qwen2 model of seed 1 is not the file llama.cpp ran: the generator (or the donor) \
         changed"
    );
    let q = GgufFile::from_bytes("qwen2.gguf", &bytes).unwrap();
    let mut w = GgufWriter::new();
    for key in q.keys() {
        let v = q.get(key).unwrap().clone();
        match key.as_str() {
            "general.architecture" => {
                w.add_meta(key.clone(), npu_gguf::MetaValue::String("llama".into()));
            }
            "general.alignment" => {}
            _ => {
                let key = match key.strip_prefix("qwen2.") {
                    Some(rest) => format!("llama.{rest}"),
                    None => key.clone(),
                };
                w.add_meta(key, v);
            }
        }
    }
    for t in q.tensors() {
        if drop.iter().any(|d| t.name.ends_with(d)) {
            continue;
        }
        w.add_tensor_spec(TensorSpec {
            name: t.name.clone(),
            dims: t.dims.clone(),
            type_id: t.ty.id(),
            data: q.tensor_data(t).to_vec(),
            offset: None,
        });
    }
    let path = std::env::temp_dir().join(format!("npu-qkv-bias-{tag}-{}.gguf", std::process::id()));
    w.write_to(&path).unwrap();
    TempModel(path)
}

fn greedy_tokens(model: &TempModel) -> Vec<u32> {
    let f = GgufFile::open(&model.0).unwrap();
    let mc = npu_model::ModelConfig::from_gguf(&f).unwrap();
    assert_eq!(mc.arch.name(), "llama");
    assert!(mc.qkv_bias, "the biases are read");
    let mut cfg = engine_config(2, 16);
    cfg.model_path = model.0.clone();
    let mut eng = AgentEngine::load(&cfg).expect("loading the relabelled model");
    let arrival = Arrival {
        request: GenerateRequest {
            id: 0,
            prompt_ids: PROMPT.to_vec(),
            params: SamplingParams::greedy(),
            max_new_tokens: 24,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            speculative: false,
        },
        at_step: 0,
    };
    let (out, _) = inproc::run(
        &mut eng,
        inproc::scheduler_config(&cfg),
        &[arrival],
        &mut |_, _| {},
    )
    .unwrap();
    out[0].token_ids()
}

#[test]
fn llama_with_qkv_biases_matches_llama_cpp() {
    let model = llama_with_biases("all", &[]);
    assert_eq!(greedy_tokens(&model), LLAMA_CPP_ALL_BIASES);
}

#[test]
fn llama_with_a_k_bias_only_matches_llama_cpp() {
    let model = llama_with_biases("k", &["attn_q.bias", "attn_v.bias"]);
    assert_eq!(greedy_tokens(&model), LLAMA_CPP_K_BIAS_ONLY);
}

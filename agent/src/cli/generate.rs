//! `npu-serving generate`: tokenize a prompt, generate on the in-process engine under the real
//! scheduler (greedy by default, or sampled), stream the text to stdout, or print one JSON object
//! with the ids, the text and the measured prefill/decode speeds.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use npu_protocol::SamplingParams;
use serde::Serialize;

use super::DeviceArgs;
use crate::engine::{AgentEngine, AgentEngineConfig};
use crate::inproc::{self, Arrival};
use npu_scheduler::GenerateRequest;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The prompt text (used as is: no chat template).
    #[arg(long)]
    pub prompt: String,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the sampler's random stream.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// GGUF model file, Hugging Face model directory, or ORG/NAME in the local Hugging Face
    /// cache (default: the default model, fetched when absent).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Quantize float weight matrices while loading: q8_0, q4_k, q4_0 or none (a Hugging Face
    /// directory's bf16/f16 weights, as `npu_serving.quantize`).
    #[arg(long)]
    pub quantize: Option<String>,
    /// Compute threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: u32,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Print one JSON object: prompt_ids, output_ids, output_text, prefill_tok_s, decode_tok_s.
    #[arg(long)]
    pub json: bool,
    /// Decode steps captured as device graphs and replayed (`npu_serving.graph_capture`):
    /// auto (where the backend can; the default, as the server's) or off.
    #[arg(long, default_value_t = npu_protocol::agent::GraphCapture::Auto)]
    pub graph_capture: npu_protocol::agent::GraphCapture,
}

#[derive(Debug, Serialize)]
struct GenerateReport {
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
    output_text: String,
    prefill_tok_s: f64,
    decode_tok_s: f64,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.max_tokens > 0, "--max-tokens must be at least 1");
    anyhow::ensure!(
        args.temperature >= 0.0 && args.temperature.is_finite(),
        "--temperature must be >= 0 (got {})",
        args.temperature
    );
    anyhow::ensure!(
        args.top_p > 0.0 && args.top_p <= 1.0,
        "--top-p must be in (0, 1] (got {})",
        args.top_p
    );
    let model_path = npu_model::resolve_model(args.model.as_deref())?;
    let tok = crate::engine::model_tokenizer(&model_path).context("building the tokenizer")?;
    let prompt_ids = tok.encode(&args.prompt)?;
    anyhow::ensure!(!prompt_ids.is_empty(), "the prompt is empty");
    let block_size = 16u32;
    let total = prompt_ids.len() + args.max_tokens;
    let blocks = total.div_ceil(block_size as usize) as u32;
    // One sequence (`max_slots: 1`): captured step graphs pad nothing and keep no block.
    let pool = blocks;
    let engine_cfg = AgentEngineConfig {
        device: args.device.device,
        device_id: args.device.device_id,
        model_path,
        num_blocks: pool,
        block_size,
        max_slots: 1,
        max_tokens_per_step: 512,
        max_blocks_per_seq: blocks,
        threads: args.threads,
        swap_space_mb: 0,
        long_context: None,
        handoff: None,
        kv_memory_fraction: None,
        tensor_parallel: None,
        quantize: args.quantize.clone(),
        kv_cache_dtype: Default::default(),
        graph_capture: args.graph_capture,
    };
    let mut engine = AgentEngine::load(&engine_cfg)?;
    let ctx = engine.facts().context_length as usize;
    if total > ctx {
        tracing::warn!("{total} tokens exceed the model's trained context of {ctx}");
    }
    let params = SamplingParams {
        do_sample: args.temperature > 0.0,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        ..SamplingParams::default()
    };
    let request = GenerateRequest {
        id: 0,
        prompt_ids: prompt_ids.clone(),
        params,
        max_new_tokens: args.max_tokens as u32,
        stop: Vec::new(),
        stop_token_ids: if args.ignore_eos {
            Vec::new()
        } else {
            tok.eos_ids().to_vec()
        },
        ignore_eos: args.ignore_eos,
        speculative: true,
    };
    let mut stream = tok.decode_stream(true);
    let mut stdout = std::io::stdout();
    let json = args.json;
    let (out, timing) = inproc::run(
        &mut engine,
        inproc::scheduler_config(&engine_cfg),
        &[Arrival {
            request,
            at_step: 0,
        }],
        &mut |_, t| {
            if !json {
                let piece = stream.push(t.token);
                let _ = stdout.write_all(piece.as_bytes());
                let _ = stdout.flush();
            }
        },
    )?;
    let output_ids = out[0].token_ids();
    let prefill_tok_s = timing.prefill_tokens as f64 / timing.prefill.as_secs_f64().max(1e-9);
    let decode_tok_s = timing.decode_tokens as f64 / timing.decode.as_secs_f64().max(1e-9);
    if json {
        let report = GenerateReport {
            output_text: tok.decode(&output_ids, true),
            prompt_ids,
            output_ids,
            prefill_tok_s,
            decode_tok_s,
        };
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let rest = stream.flush();
        print!("{rest}");
        println!();
        eprintln!(
            "[{} prompt tokens at {prefill_tok_s:.1} tok/s, {} generated at {decode_tok_s:.1} tok/s, {}]",
            prompt_ids.len(),
            output_ids.len(),
            engine.facts().backend
        );
    }
    Ok(())
}

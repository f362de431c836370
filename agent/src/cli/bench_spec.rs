//! `npu-serving bench-spec`: what n-gram speculative decoding gains on this machine. The same
//! prompt (by default an edit of a small code file, whose answer repeats its input) is decoded
//! by `batch` identical requests with speculation off and on, in the same process; it prints
//! decode tokens per second of each (medians over `--repeats` runs), their ratio, the drafted
//! and kept tokens, and whether the tokens were identical (they must be: a mismatch is an
//! error).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use npu_protocol::SamplingParams;
use serde::Serialize;

use super::DeviceArgs;
use crate::engine::{AgentEngine, AgentEngineConfig};
use crate::inproc::{self, Arrival};
use npu_gguf::GgufFile;
use npu_scheduler::{GenerateRequest, SpeculativeConfig};
use npu_tokenizer::Tokenizer;

/// The default prompt: rename a field in a small Rust file and print it again.
const EDIT_PROMPT: &str = concat!(
    "Rename the field `ignore_eos` to `keep_going` in this Rust file and print the whole file \
     again, unchanged otherwise.\n\n```rust\n",
    include_str!("../../../scheduler/src/types.rs"),
    "```\n\nHere is the whole file with the field renamed:\n\n```rust\n"
);

#[derive(Debug, Args)]
pub struct BenchSpecArgs {
    /// GGUF model file (default: the default model, fetched when absent).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A file whose text is the prompt (default: an edit of a small code file).
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Numbers of concurrent requests to measure.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 32])]
    pub batches: Vec<usize>,
    /// Runs of each setting; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Most tokens drafted per sequence and step.
    #[arg(long, default_value_t = SpeculativeConfig::default().num_speculative_tokens)]
    pub num_speculative_tokens: usize,
    /// Draft only while at most this many sequences decode (default: the configured default;
    /// set it to the batch to measure what verifying costs there).
    #[arg(long, default_value_t = SpeculativeConfig::default().max_batch)]
    pub max_batch: usize,
    /// Compute threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: u32,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct BatchReport {
    batch: usize,
    decode_tok_s_off: f64,
    decode_tok_s_on: f64,
    ratio: f64,
    drafted_tokens: u64,
    accepted_tokens: u64,
    identical_tokens: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    prompt_tokens: usize,
    max_tokens: usize,
    num_speculative_tokens: usize,
    max_batch: usize,
    batches: Vec<BatchReport>,
}

pub fn run(args: BenchSpecArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.max_tokens > 0, "--max-tokens must be at least 1");
    anyhow::ensure!(args.repeats > 0, "--repeats must be at least 1");
    anyhow::ensure!(
        args.batches.iter().all(|&b| b > 0),
        "--batches must all be at least 1"
    );
    let spec = SpeculativeConfig {
        num_speculative_tokens: args.num_speculative_tokens,
        max_batch: args.max_batch,
        ..SpeculativeConfig::default()
    };
    spec.validate()?;
    let model_path = npu_gguf::store::resolve_model(args.model.as_deref())?;
    let gguf = GgufFile::open(&model_path)?;
    let tok = Tokenizer::for_model(&gguf, &model_path).context("building the tokenizer")?;
    let text = match &args.prompt_file {
        Some(p) => {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?
        }
        None => EDIT_PROMPT.to_string(),
    };
    let prompt_ids = tok.encode(&text)?;
    anyhow::ensure!(!prompt_ids.is_empty(), "the prompt is empty");
    drop(gguf);

    let max_batch = *args.batches.iter().max().unwrap_or(&1);
    let block_size = 16u32;
    let per_seq = (prompt_ids.len() + args.max_tokens + MAX_DRAFT_SLACK).div_ceil(16) as u32;
    let engine_cfg = AgentEngineConfig {
        device: args.device.device,
        device_id: args.device.device_id,
        model_path: model_path.clone(),
        num_blocks: per_seq * max_batch as u32,
        block_size,
        max_slots: max_batch as u32,
        max_tokens_per_step: 512,
        max_blocks_per_seq: per_seq,
        threads: args.threads,
        swap_space_mb: 0,
        long_context: None,
        handoff: None,
        kv_memory_fraction: None,
        tensor_parallel: None,
        quantize: None,
        kv_cache_dtype: Default::default(),
        graph_capture: Default::default(),
    };
    let mut engine = AgentEngine::load(&engine_cfg)?;
    let mut report = Report {
        model: model_path.display().to_string(),
        prompt_tokens: prompt_ids.len(),
        max_tokens: args.max_tokens,
        num_speculative_tokens: spec.num_speculative_tokens,
        max_batch: spec.max_batch,
        batches: Vec::new(),
    };
    if !args.json {
        println!(
            "prompt {} tokens, {} new tokens per request, drafts of up to {} tokens while at most \
             {} sequences decode ({})",
            prompt_ids.len(),
            args.max_tokens,
            spec.num_speculative_tokens,
            spec.max_batch,
            engine.facts().backend
        );
        println!("batch  off tok/s   on tok/s  ratio  drafted    kept  identical");
    }
    for &batch in &args.batches {
        let arrivals: Vec<Arrival> = (0..batch)
            .map(|i| Arrival {
                request: GenerateRequest {
                    id: i as u64,
                    prompt_ids: prompt_ids.clone(),
                    params: SamplingParams::greedy(),
                    max_new_tokens: args.max_tokens as u32,
                    stop: Vec::new(),
                    stop_token_ids: Vec::new(),
                    ignore_eos: true,
                    speculative: true,
                },
                at_step: 0,
            })
            .collect();
        let mut off = Vec::new();
        let mut on = Vec::new();
        let mut identical = true;
        let (mut drafted, mut accepted) = (0, 0);
        for _ in 0..args.repeats {
            // Alternate, so that a machine getting slower or faster affects both alike.
            let mut cfg = inproc::scheduler_config(&engine_cfg);
            let (a, ta) = inproc::run(&mut engine, cfg.clone(), &arrivals, &mut |_, _| {})?;
            cfg.speculative = Some(spec);
            let (b, tb) = inproc::run(&mut engine, cfg, &arrivals, &mut |_, _| {})?;
            identical &= a
                .iter()
                .zip(&b)
                .all(|(x, y)| x.token_ids() == y.token_ids());
            off.push(ta.decode_tokens as f64 / ta.decode.as_secs_f64());
            on.push(tb.decode_tokens as f64 / tb.decode.as_secs_f64());
            drafted = tb.drafted_tokens;
            accepted = tb.accepted_tokens;
        }
        let (off, on) = (median(off), median(on));
        let row = BatchReport {
            batch,
            decode_tok_s_off: off,
            decode_tok_s_on: on,
            ratio: on / off,
            drafted_tokens: drafted,
            accepted_tokens: accepted,
            identical_tokens: identical,
        };
        if !args.json {
            println!(
                "{batch:>5} {off:>10.1} {on:>10.1} {:>6.2} {drafted:>8} {accepted:>7}  {}",
                row.ratio,
                if identical { "yes" } else { "NO" }
            );
        }
        report.batches.push(row);
        anyhow::ensure!(
            identical,
            "batch {batch}: the tokens differ with speculative decoding on (a bug)"
        );
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// Room past the last token a sequence's table needs for the drafts of its last steps.
const MAX_DRAFT_SLACK: usize = npu_protocol::MAX_DRAFT_TOKENS;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

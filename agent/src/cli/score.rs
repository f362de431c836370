//! `npu-serving score`: teacher-forced fidelity check. Feeds the prompt followed by the given
//! continuation in one pass and reports, for every continuation position, the model's top-1 token,
//! the gap between its two best logits, and the log-probability of the given token.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use serde::Serialize;

use std::sync::Arc;

use super::DeviceArgs;
use crate::device::{DeviceModel, DeviceSpec};
use crate::model::{ModelOptions, StepOutput};
use npu_backend::{SeqSpan, StepInputs};
use npu_backend_cpu::threadpool::ThreadPool;
use npu_gguf::GgufFile;
use npu_tokenizer::Tokenizer;

#[derive(Debug, Args)]
pub struct ScoreArgs {
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Token ids of the continuation, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub continuation_ids: Vec<u32>,
    /// GGUF model file (default: the default model, fetched when absent).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: u32,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Print JSON (`{"positions": [{"top1_id", "gap", "logprob"}, ...]}`) instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct ScoredPosition {
    pub top1_id: u32,
    /// Logit of the best token minus that of the runner-up.
    pub gap: f32,
    /// Log-probability of the given continuation token at this position.
    pub logprob: f32,
}

#[derive(Debug, Serialize)]
struct ScoreReport {
    prompt_ids: Vec<u32>,
    positions: Vec<ScoredPosition>,
}

/// Scores `continuation` after `prompt` (token ids) with the model at `model_path` on `device`,
/// in one step whose logit rows are every continuation position.
pub fn score_ids(
    model_path: &std::path::Path,
    device: DeviceArgs,
    threads: u32,
    prompt: &[u32],
    continuation: &[u32],
) -> anyhow::Result<Vec<ScoredPosition>> {
    anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
    anyhow::ensure!(!continuation.is_empty(), "no continuation ids given");
    let gguf = GgufFile::open(model_path)?;
    let tokens: Vec<u32> = prompt.iter().chain(continuation).copied().collect();
    let n = tokens.len();
    let block_size = 16usize;
    let blocks = n.div_ceil(block_size);
    let threads = match threads {
        0 => ThreadPool::available_threads(),
        t => t as usize,
    };
    let pool = Arc::new(ThreadPool::new(threads));
    let mut model = DeviceModel::load(
        &gguf,
        DeviceSpec {
            kind: device.device,
            device_id: device.device_id,
        },
        &pool,
        ModelOptions {
            max_tokens: n,
            max_logit_rows: continuation.len(),
            num_blocks: blocks,
            block_size,
            kv_memory_fraction: None,
        },
    )?;
    let vocab = model.config().vocab;
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        anyhow::bail!("token id {bad} is beyond the vocabulary ({vocab})");
    }
    // One sequence from position 0 on blocks 0.. in order: built here, complete by construction
    // (the token ids were checked just above).
    let step = StepInputs {
        positions: (0..n as u32).collect(),
        slot_mapping: (0..n as u32).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: n as u32,
            start_pos: 0,
        }],
        block_tables: (0..blocks as u32).collect(),
        max_blocks: blocks,
        logit_rows: (prompt.len() as u32 - 1..n as u32 - 1).collect(),
        tokens,
    };
    let mut out = StepOutput::default();
    model.forward(&step, false, &mut out)?;
    let logits = out.logits;
    Ok(continuation
        .iter()
        .enumerate()
        .map(|(i, &want)| {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let (mut best, mut second) = (0usize, usize::MAX);
            for (j, &v) in row.iter().enumerate().skip(1) {
                if v > row[best] {
                    second = best;
                    best = j;
                } else if second == usize::MAX || v > row[second] {
                    second = j;
                }
            }
            let max = row[best] as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            ScoredPosition {
                top1_id: best as u32,
                gap: row[best] - row[second],
                logprob: (row[want as usize] as f64 - lse) as f32,
            }
        })
        .collect())
}

pub fn run(args: ScoreArgs) -> anyhow::Result<()> {
    let model_path = npu_gguf::store::resolve_model(args.model.as_deref())?;
    let gguf = GgufFile::open(&model_path)?;
    let tok = Tokenizer::for_model(&gguf, &model_path).context("building the tokenizer")?;
    let prompt_ids = tok.encode(&args.prompt)?;
    drop(gguf);
    let positions = score_ids(
        &model_path,
        args.device,
        args.threads,
        &prompt_ids,
        &args.continuation_ids,
    )?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&ScoreReport {
                prompt_ids,
                positions
            })?
        );
    } else {
        println!(
            "{:>4} {:>8} {:>8} {:>8} {:>10}",
            "pos", "given", "top1", "gap", "logprob"
        );
        for (i, (p, id)) in positions.iter().zip(&args.continuation_ids).enumerate() {
            println!(
                "{i:>4} {id:>8} {:>8} {:>8.4} {:>10.4}",
                p.top1_id, p.gap, p.logprob
            );
        }
    }
    Ok(())
}

//! `npu-serving bench-model`: the engine's raw speed on this machine — prefill at 128 and 512
//! prompt tokens, decode at batch 1..64 (128 tokens of context each), decode time per token at long
//! contexts, and peak memory — with the same engine, step plans and paged KV the server uses.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use npu_protocol::SamplingParams;
use serde::Serialize;

use crate::engine::{AgentEngine, AgentEngineConfig};
use crate::local::{LocalRequest, LocalRunner};

#[derive(Debug, Args)]
pub struct BenchModelArgs {
    /// GGUF model file (default: the default model, fetched when absent).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: u32,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Decode steps measured per batch size.
    #[arg(long, default_value_t = 32)]
    pub decode_steps: usize,
    /// Skip the 1k/4k/8k long-context decode measurements.
    #[arg(long)]
    pub skip_long: bool,
    /// Skip the prefill measurements.
    #[arg(long)]
    pub skip_prefill: bool,
    /// Decode batch sizes to measure (subset of 1,4,8,16,32,64).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 4, 8, 16, 32, 64])]
    pub batches: Vec<usize>,
}

#[derive(Debug, Serialize, Default)]
pub struct BenchModelReport {
    pub prefill_tok_s_128: f64,
    pub prefill_tok_s_512: f64,
    pub decode_tok_s_b1: f64,
    pub decode_tok_s_b4: f64,
    pub decode_tok_s_b8: f64,
    pub decode_tok_s_b16: f64,
    pub decode_tok_s_b32: f64,
    pub decode_tok_s_b64: f64,
    pub decode_ms_per_token_ctx1024: Option<f64>,
    pub decode_ms_per_token_ctx4096: Option<f64>,
    pub decode_ms_per_token_ctx8192: Option<f64>,
    pub peak_rss_mb: f64,
    pub backend: String,
    pub threads: u32,
}

/// SplitMix64: reproducible synthetic prompts.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn prompt(rng: &mut SplitMix, n: usize, vocab: u32) -> Vec<u32> {
    // Ordinary token ids, away from the special tokens at the start of the vocabulary.
    (0..n)
        .map(|_| 100 + (rng.next() % (vocab as u64 - 100)) as u32)
        .collect()
}

fn req(p: Vec<u32>, n: usize) -> LocalRequest {
    LocalRequest {
        prompt: p,
        params: SamplingParams::greedy(),
        max_new_tokens: n,
        stop_ids: Vec::new(),
        start_delay_steps: 0,
    }
}

/// Peak resident set size of this process in MiB (Linux; 0 elsewhere).
pub fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

pub fn run(args: BenchModelArgs) -> anyhow::Result<()> {
    let model_path = npu_gguf::store::resolve_model(args.model.as_deref())?;
    let long = !args.skip_long;
    let cfg = AgentEngineConfig {
        model_path,
        num_blocks: if long { 1200 } else { 800 },
        block_size: 16,
        max_slots: 64,
        max_tokens_per_step: 512,
        max_blocks_per_seq: 600,
        threads: args.threads,
    };
    let mut engine = AgentEngine::load(&cfg).context("loading the model")?;
    let vocab = engine.facts().vocab_size;
    let mut rng = SplitMix(42);
    let mut rep = BenchModelReport {
        backend: engine.facts().backend.clone(),
        // The thread count actually used (0 asks for all cores).
        threads: if args.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
        } else {
            args.threads
        },
        ..Default::default()
    };
    let say = |s: &str| {
        if !args.json {
            eprintln!("{s}");
        }
    };
    // Warm-up: touch every weight once.
    LocalRunner::new(&mut engine).run(&[req(prompt(&mut rng, 32, vocab), 4)])?;

    let prefills: &mut [(usize, &mut f64)] = if args.skip_prefill {
        &mut []
    } else {
        &mut [
            (128usize, &mut rep.prefill_tok_s_128),
            (512, &mut rep.prefill_tok_s_512),
        ]
    };
    for (n, slot) in prefills.iter_mut() {
        let n = *n;
        let mut runs = Vec::new();
        for _ in 0..5 {
            let (_, t) =
                LocalRunner::new(&mut engine).run(&[req(prompt(&mut rng, n, vocab), 1)])?;
            runs.push(t.prefill_tokens as f64 / t.prefill.as_secs_f64());
        }
        runs.sort_by(f64::total_cmp);
        let median = runs[runs.len() / 2];
        **slot = median;
        say(&format!(
            "prefill {n:>4} tokens: {median:8.1} tok/s (median of 5)"
        ));
    }

    let batches: [(usize, &mut f64); 6] = [
        (1, &mut rep.decode_tok_s_b1),
        (4, &mut rep.decode_tok_s_b4),
        (8, &mut rep.decode_tok_s_b8),
        (16, &mut rep.decode_tok_s_b16),
        (32, &mut rep.decode_tok_s_b32),
        (64, &mut rep.decode_tok_s_b64),
    ];
    for (b, slot) in batches {
        if !args.batches.contains(&b) {
            continue;
        }
        let steps = if b == 1 {
            args.decode_steps.max(128)
        } else {
            args.decode_steps
        };
        let reqs: Vec<LocalRequest> = (0..b)
            .map(|_| req(prompt(&mut rng, 128, vocab), steps + 1))
            .collect();
        let (_, t) = LocalRunner::new(&mut engine).run(&reqs)?;
        *slot = t
            .median_decode_tok_s(b)
            .unwrap_or(t.decode_tokens as f64 / t.decode.as_secs_f64());
        say(&format!(
            "decode batch {b:>2}: {:8.1} tok/s aggregate",
            *slot
        ));
    }

    if long {
        let ctxs: [(usize, &mut Option<f64>); 3] = [
            (1024, &mut rep.decode_ms_per_token_ctx1024),
            (4096, &mut rep.decode_ms_per_token_ctx4096),
            (8192, &mut rep.decode_ms_per_token_ctx8192),
        ];
        for (ctx, slot) in ctxs {
            let t0 = Instant::now();
            let (_, t) =
                LocalRunner::new(&mut engine).run(&[req(prompt(&mut rng, ctx, vocab), 17)])?;
            let ms = 1000.0
                / t.median_decode_tok_s(1)
                    .unwrap_or(t.decode_tokens.max(1) as f64 / t.decode.as_secs_f64());
            *slot = Some(ms);
            say(&format!(
                "decode at {ctx:>4} context: {ms:7.2} ms/token (prefill {:.1}s)",
                (t0.elapsed() - t.decode).as_secs_f64()
            ));
        }
    }
    rep.peak_rss_mb = peak_rss_mb();
    if args.json {
        println!("{}", serde_json::to_string(&rep)?);
    } else {
        println!("backend            {}", rep.backend);
        println!("prefill 128        {:8.1} tok/s", rep.prefill_tok_s_128);
        println!("prefill 512        {:8.1} tok/s", rep.prefill_tok_s_512);
        for (b, v) in [
            (1, rep.decode_tok_s_b1),
            (4, rep.decode_tok_s_b4),
            (8, rep.decode_tok_s_b8),
            (16, rep.decode_tok_s_b16),
            (32, rep.decode_tok_s_b32),
            (64, rep.decode_tok_s_b64),
        ] {
            println!("decode batch {b:<5} {v:8.1} tok/s");
        }
        for (c, v) in [
            (1024, rep.decode_ms_per_token_ctx1024),
            (4096, rep.decode_ms_per_token_ctx4096),
            (8192, rep.decode_ms_per_token_ctx8192),
        ] {
            if let Some(v) = v {
                println!("decode ctx {c:<7} {v:8.2} ms/token");
            }
        }
        println!("peak RSS           {:8.1} MiB", rep.peak_rss_mb);
    }
    Ok(())
}

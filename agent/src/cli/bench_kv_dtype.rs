//! `npu-serving bench-model --kv-cache-dtype f16,int8`: batch-1 decode time per token at long
//! contexts (`--kv-contexts`, 8k and 32k tokens by default), one engine per KV cache dtype in
//! the same process, measured alternately (`--kv-rounds` rounds, the best of them reported):
//! each engine prefills the context once (the prefix cache keeps it for the later rounds) and
//! every round decodes `--decode-steps` tokens after it (median step).

use std::time::Instant;

use anyhow::Context;
use serde::Serialize;

use super::bench_model::{greedy, peak_rss_mb, prompt, BenchModelArgs, SplitMix};
use crate::engine::{AgentEngine, AgentEngineConfig};
use crate::inproc;

/// One dtype at one context.
#[derive(Debug, Serialize)]
pub struct KvDtypeRun {
    pub kv_cache_dtype: String,
    pub context: usize,
    /// Median decode step of each round, ms per token.
    pub rounds_ms_per_token: Vec<f64>,
    /// The best round.
    pub decode_ms_per_token: f64,
    pub prefill_s: f64,
    pub kv_block_bytes: u64,
    /// Greedy tokens of the first round (the dtypes' outputs compared on the same prompt).
    pub tokens: Vec<u32>,
}

#[derive(Debug, Serialize, Default)]
pub struct KvDtypeReport {
    pub runs: Vec<KvDtypeRun>,
    /// Per context: the first dtype's best ms per token over the second's.
    pub speedup: Vec<(usize, f64)>,
    /// Per context: how many leading greedy tokens the two dtypes share (of `decode_steps`).
    pub same_leading_tokens: Vec<(usize, usize)>,
    pub backend: String,
    pub peak_rss_mb: f64,
    pub wall_s: f64,
}

pub fn run(args: &BenchModelArgs) -> anyhow::Result<()> {
    let t_start = Instant::now();
    let dtypes = &args.kv_cache_dtype;
    let rounds = args.kv_rounds.max(1);
    let steps = args.decode_steps.max(8);
    let model_path = npu_model::resolve_model(args.model.as_deref())?;
    let longest = args.kv_contexts.iter().copied().max().unwrap_or(0);
    let blocks = ((longest + steps + 2).div_ceil(16) + 2) as u32;
    let mut rep = KvDtypeReport::default();
    let say = |s: &str| {
        if !args.json {
            eprintln!("{s}");
        }
    };
    let mut rng = SplitMix(17);
    for &ctx in &args.kv_contexts {
        let mut engines = Vec::new();
        for &dtype in dtypes {
            let cfg = AgentEngineConfig {
                device: args.device.device,
                device_id: args.device.device_id,
                model_path: model_path.clone(),
                num_blocks: blocks,
                block_size: 16,
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
                kv_cache_dtype: dtype,
                graph_capture: Default::default(),
            };
            let engine = AgentEngine::load(&cfg)
                .with_context(|| format!("loading the model, kv_cache_dtype {}", dtype.name()))?;
            rep.backend = engine.facts().backend.clone();
            engines.push((dtype, cfg, engine, Vec::new(), 0.0, Vec::new()));
        }
        let vocab = engines[0].2.facts().vocab_size;
        let p = prompt(&mut rng, ctx, vocab);
        for round in 0..rounds {
            for (dtype, cfg, engine, times, prefill_s, tokens) in engines.iter_mut() {
                let mut sc = inproc::scheduler_config(cfg);
                sc.prefix_cache = true;
                let t0 = Instant::now();
                let (out, t) = inproc::run(
                    engine,
                    sc,
                    &greedy(vec![p.clone()], steps + 1),
                    &mut |_, _| {},
                )?;
                let ms = 1000.0
                    / t.median_decode_tok_s(1)
                        .unwrap_or(t.decode_tokens.max(1) as f64 / t.decode.as_secs_f64());
                if round == 0 {
                    *prefill_s = (t0.elapsed() - t.decode).as_secs_f64();
                    *tokens = out[0].token_ids();
                }
                times.push(ms);
                say(&format!(
                    "context {ctx:>6}, kv {:>4}, round {round}: decode {ms:7.2} ms/token{}",
                    dtype.name(),
                    if round == 0 {
                        format!(" (prefill {:.1} s)", *prefill_s)
                    } else {
                        String::new()
                    }
                ));
            }
        }
        for (dtype, _, engine, times, prefill_s, tokens) in &engines {
            rep.runs.push(KvDtypeRun {
                kv_cache_dtype: dtype.name().into(),
                context: ctx,
                decode_ms_per_token: times.iter().copied().fold(f64::INFINITY, f64::min),
                rounds_ms_per_token: times.clone(),
                prefill_s: *prefill_s,
                kv_block_bytes: engine.kv_block_bytes() as u64,
                tokens: tokens.clone(),
            });
        }
        if let [a, b] = &rep.runs[rep.runs.len() - engines.len()..] {
            rep.speedup
                .push((ctx, a.decode_ms_per_token / b.decode_ms_per_token));
            let same = a
                .tokens
                .iter()
                .zip(&b.tokens)
                .take_while(|(x, y)| x == y)
                .count();
            rep.same_leading_tokens.push((ctx, same));
        }
    }
    rep.peak_rss_mb = peak_rss_mb();
    rep.wall_s = t_start.elapsed().as_secs_f64();
    if args.json {
        println!("{}", serde_json::to_string(&rep)?);
    } else {
        println!("backend {}", rep.backend);
        for r in &rep.runs {
            println!(
                "context {:>6}  kv {:>4}  decode {:7.2} ms/token (best of {:?})  block {} B",
                r.context,
                r.kv_cache_dtype,
                r.decode_ms_per_token,
                r.rounds_ms_per_token,
                r.kv_block_bytes
            );
        }
        for (ctx, s) in &rep.speedup {
            println!(
                "context {ctx:>6}  {} / {} ms per token: {s:.2}x",
                dtypes[0].name(),
                dtypes[1].name()
            );
        }
        for (ctx, n) in &rep.same_leading_tokens {
            println!(
                "context {ctx:>6}  same leading greedy tokens: {n} of {}",
                steps + 1
            );
        }
    }
    Ok(())
}

//! `npu-serving bench-model --kv-cache-dtype f16,int8`: batch-1 decode time per token at long
//! contexts (`--kv-contexts`, 8k and 32k tokens by default), one engine per KV cache dtype in
//! the same process, one after the other at each context. Each engine runs `--kv-rounds`
//! requests with the same prompt in one scheduler, one after another: the first prefills the
//! context, the prefix cache gives it to the later ones (a 32k prefill takes minutes, its
//! decode steps tens of milliseconds), and every round decodes `--decode-steps` tokens after
//! it (its median step; the median round is reported, and the best).

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
    /// The median round.
    pub decode_ms_per_token: f64,
    /// The best round.
    pub best_ms_per_token: f64,
    /// Prefill time of the run (the first round's; the later ones take the prefix cache's).
    pub prefill_s: f64,
    /// Prompt tokens computed over the rounds (the context once, and a block's worth a later
    /// round, when the prefix cache took the prompt).
    pub prefill_tokens: usize,
    pub kv_block_bytes: u64,
    /// Greedy tokens of the first round (the dtypes' outputs compared on the same prompt).
    pub tokens: Vec<u32>,
}

#[derive(Debug, Serialize, Default)]
pub struct KvDtypeReport {
    pub runs: Vec<KvDtypeRun>,
    /// Per context: the first dtype's median ms per token over the second's.
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
            engines.push((dtype, cfg, engine, Vec::new(), (0.0, 0), Vec::new()));
        }
        let vocab = engines[0].2.facts().vocab_size;
        let p = prompt(&mut rng, ctx, vocab);
        // Each round arrives after the one before has finished (prefill chunks, decode steps
        // and a margin), so it finds the prompt's blocks in the prefix cache.
        let gap = ctx.div_ceil(512) + steps + 8;
        let mut arrivals = greedy(vec![p.clone(); rounds], steps + 1);
        for (i, a) in arrivals.iter_mut().enumerate() {
            a.at_step = i * gap;
        }
        for (dtype, cfg, engine, times, (prefill_s, prefill_tokens), tokens) in engines.iter_mut() {
            let mut sc = inproc::scheduler_config(cfg);
            sc.prefix_cache = true;
            let (out, t) = inproc::run(engine, sc, &arrivals, &mut |_, _| {})?;
            *prefill_s = t.prefill.as_secs_f64();
            *prefill_tokens = t.prefill_tokens;
            *tokens = out[0].token_ids();
            // The decode-only steps in order: `steps` a round (each round's first token comes
            // from its prefill step).
            let ms: Vec<f64> = t
                .decode_steps
                .iter()
                .map(|(d, _)| d.as_secs_f64() * 1e3)
                .collect();
            for (round, chunk) in ms.chunks(steps).enumerate() {
                let mut c = chunk.to_vec();
                c.sort_by(f64::total_cmp);
                let med = c[c.len() / 2];
                times.push(med);
                say(&format!(
                    "context {ctx:>6}, kv {:>4}, round {round}: decode {med:7.2} ms/token",
                    dtype.name()
                ));
            }
            say(&format!(
                "context {ctx:>6}, kv {:>4}: prefill of every round {:.1} s, {} prompt tokens",
                dtype.name(),
                *prefill_s,
                *prefill_tokens
            ));
        }
        for (dtype, _, engine, times, (prefill_s, prefill_tokens), tokens) in &engines {
            let mut sorted = times.clone();
            sorted.sort_by(f64::total_cmp);
            rep.runs.push(KvDtypeRun {
                kv_cache_dtype: dtype.name().into(),
                context: ctx,
                decode_ms_per_token: sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN),
                best_ms_per_token: sorted.first().copied().unwrap_or(f64::NAN),
                rounds_ms_per_token: times.clone(),
                prefill_s: *prefill_s,
                prefill_tokens: *prefill_tokens,
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
                "context {:>6}  kv {:>4}  decode {:7.2} ms/token median, {:7.2} best (rounds {:?})  \
                 block {} B",
                r.context,
                r.kv_cache_dtype,
                r.decode_ms_per_token,
                r.best_ms_per_token,
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

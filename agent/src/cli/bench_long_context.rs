//! `npu-serving bench-model --long-context`: long-context mode's decode time per token at long
//! contexts (4k, 32k and 64k tokens by default) on a fixed device KV budget, with the device KV
//! bytes the sequences held at most, the host bytes of their memory units, and how long the
//! (bounded-chunk) prefill to each context took. Same engine, scheduler and step plans as the
//! server; the KV pool is exactly one sequence's budget, so the device holds no more.

use std::time::Instant;

use anyhow::Context;
use npu_protocol::LongContextConfig;
use serde::Serialize;

use super::bench_model::{greedy, peak_rss_mb, prompt, BenchModelArgs, SplitMix};
use crate::engine::{AgentEngine, AgentEngineConfig};
use crate::inproc;

#[derive(Debug, Serialize, Default)]
pub struct LongContextReport {
    pub decode_ms_per_token_ctx4096: Option<f64>,
    pub decode_ms_per_token_ctx32768: Option<f64>,
    pub decode_ms_per_token_ctx65536: Option<f64>,
    /// Every measured context: (tokens, decode ms per token, prefill seconds).
    pub contexts: Vec<ContextRun>,
    /// The most device KV bytes the sequences held at once (blocks x block bytes).
    pub kv_device_bytes_peak: u64,
    /// The configured budget: `device_blocks` x block bytes.
    pub kv_device_bytes_budget: u64,
    /// Host bytes of memory units of the longest context (K, V and representative sums).
    pub kv_host_bytes_longest: u64,
    pub long_context: LongContextSummary,
    pub wall_s: f64,
    pub peak_rss_mb: f64,
    pub backend: String,
}

#[derive(Debug, Serialize)]
pub struct ContextRun {
    pub tokens: usize,
    pub decode_ms_per_token: f64,
    pub prefill_s: f64,
    pub layer_blocks_offloaded: u64,
    pub layer_blocks_loaded: u64,
}

#[derive(Debug, Serialize, Default)]
pub struct LongContextSummary {
    pub initial_blocks: u32,
    pub local_blocks: u32,
    pub topk_blocks: u32,
    pub representative_keys: u32,
    pub device_blocks: u32,
    pub block_size: u32,
}

/// Decode steps measured per context (the median step is reported).
const DECODE_STEPS: usize = 32;

pub fn run(args: &BenchModelArgs) -> anyhow::Result<()> {
    let t_start = Instant::now();
    let model_path = npu_gguf::store::resolve_model(args.model.as_deref())?;
    let lc = LongContextConfig::default();
    let block_size = 16;
    let cfg = AgentEngineConfig {
        device: args.device.device,
        device_id: args.device.device_id,
        model_path,
        num_blocks: lc.device_blocks,
        block_size,
        max_slots: 1,
        max_tokens_per_step: 512,
        max_blocks_per_seq: lc.device_blocks,
        threads: args.threads,
        swap_space_mb: 0,
        long_context: Some(lc),
        handoff: None,
        kv_memory_fraction: None,
        tensor_parallel: None,
        quantize: None,
        kv_cache_dtype: args.kv_cache_dtype[0],
        graph_capture: Default::default(),
    };
    let mut rep = LongContextReport {
        long_context: LongContextSummary {
            initial_blocks: lc.initial_blocks,
            local_blocks: lc.local_blocks,
            topk_blocks: lc.topk_blocks,
            representative_keys: lc.representative_keys,
            device_blocks: lc.device_blocks,
            block_size,
        },
        ..Default::default()
    };
    let say = |s: &str| {
        if !args.json {
            eprintln!("{s}");
        }
    };
    let mut rng = SplitMix(7);
    let mut peak_blocks = 0;
    for &ctx in &args.contexts {
        // A fresh engine per context: the counters and host memory are this run's.
        let mut engine = AgentEngine::load(&cfg).context("loading the model")?;
        rep.backend = engine.facts().backend.clone();
        let vocab = engine.facts().vocab_size;
        let t0 = Instant::now();
        let (_, t) = inproc::run(
            &mut engine,
            inproc::scheduler_config(&cfg),
            &greedy(vec![prompt(&mut rng, ctx, vocab)], DECODE_STEPS + 1),
            &mut |_, _| {},
        )?;
        let ms = 1000.0
            / t.median_decode_tok_s(1)
                .unwrap_or(t.decode_tokens.max(1) as f64 / t.decode.as_secs_f64());
        let prefill_s = (t0.elapsed() - t.decode).as_secs_f64();
        let stats = engine.long_context_stats().unwrap_or_default();
        peak_blocks = peak_blocks.max(t.peak_blocks_used);
        rep.kv_device_bytes_budget = u64::from(lc.device_blocks) * engine.kv_block_bytes() as u64;
        rep.kv_device_bytes_peak = peak_blocks as u64 * engine.kv_block_bytes() as u64;
        // Units of the longest context, counted from what was offloaded (the slot is forgotten
        // when the run ends).
        let layer_block = 2
            * 2
            * block_size as u64
            * u64::from(engine.facts().n_kv_heads)
            * u64::from(engine.facts().head_dim)
            + 4 * u64::from(engine.facts().n_kv_heads) * u64::from(engine.facts().head_dim);
        rep.kv_host_bytes_longest = rep
            .kv_host_bytes_longest
            .max(stats.layer_blocks_offloaded * layer_block);
        match ctx {
            4096 => rep.decode_ms_per_token_ctx4096 = Some(ms),
            32768 => rep.decode_ms_per_token_ctx32768 = Some(ms),
            65536 => rep.decode_ms_per_token_ctx65536 = Some(ms),
            _ => {}
        }
        say(&format!(
            "long context {ctx:>6}: decode {ms:7.2} ms/token, prefill {prefill_s:6.1} s, \
             {} layer blocks offloaded, {} loaded",
            stats.layer_blocks_offloaded, stats.layer_blocks_loaded
        ));
        rep.contexts.push(ContextRun {
            tokens: ctx,
            decode_ms_per_token: ms,
            prefill_s,
            layer_blocks_offloaded: stats.layer_blocks_offloaded,
            layer_blocks_loaded: stats.layer_blocks_loaded,
        });
    }
    rep.wall_s = t_start.elapsed().as_secs_f64();
    rep.peak_rss_mb = peak_rss_mb();
    if args.json {
        println!("{}", serde_json::to_string(&rep)?);
    } else {
        println!(
            "device KV peak {} bytes of a {} byte budget; host memory of the longest context {} \
             bytes; {:.0} s in all",
            rep.kv_device_bytes_peak,
            rep.kv_device_bytes_budget,
            rep.kv_host_bytes_longest,
            rep.wall_s
        );
    }
    Ok(())
}

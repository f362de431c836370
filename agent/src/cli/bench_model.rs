//! `npu-serving bench-model`: the engine's raw speed on this machine — prefill at 128 and 512
//! prompt tokens, decode at batch 1..64 (128 tokens of context each), decode time per token at long
//! contexts, KV block copy bandwidth each way, and peak memory — with the same engine,
//! scheduler, step plans and paged KV the server uses, on the device `--device` names; beside
//! them, the batch-1 weight-read GB/s and prefill GOP/s against this machine's measured memory
//! bandwidth and int8 peak (`npu_backend_cpu::roofline`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use npu_protocol::SamplingParams;
use serde::Serialize;

use super::DeviceArgs;
use crate::engine::{AgentEngine, AgentEngineConfig};
use crate::inproc::{self, Arrival, RunOutput, RunTiming};
use npu_backend_cpu::kernels::Isa;
use npu_backend_cpu::roofline;
use npu_backend_cpu::threadpool::ThreadPool;
use npu_protocol::agent::{DeviceKind, GraphCapture, KvCacheDtype};
use npu_scheduler::GenerateRequest;

#[derive(Debug, Args)]
pub struct BenchModelArgs {
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
    /// Long-context mode instead: decode time per token at 4k, 32k and 64k context on a bounded
    /// device KV budget (`bench_long_context`).
    #[arg(long)]
    pub long_context: bool,
    /// Contexts (tokens) that `--long-context` measures.
    #[arg(long, value_delimiter = ',', default_values_t = vec![4096, 32768, 65536])]
    pub contexts: Vec<usize>,
    /// Decode batch sizes to measure (subset of 1,4,8,16,32,64).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 4, 8, 16, 32, 64])]
    pub batches: Vec<usize>,
    /// Skip measuring this machine's memory read bandwidth and int8 dot-product peak.
    #[arg(long)]
    pub skip_roofline: bool,
    /// Instead of the rest: batch-1 decode (`--decode-steps`, at least 24) with the CPU matmul's
    /// prefetch distance switched between A and B blocks every step, and the two medians (a
    /// same-run comparison; `--device cpu` only).
    #[arg(long, value_delimiter = ',', value_name = "A,B")]
    pub alternate_prefetch: Option<Vec<usize>>,
    /// Also measure the prefill of one prompt of each of these lengths (tokens, from 1 to 9,500),
    /// median of 3: time to first token on long prompts, where attention grows with the square
    /// of the length (e.g. 2048,4096,8192).
    #[arg(long, value_delimiter = ',', value_name = "TOKENS")]
    pub long_prompts: Vec<usize>,
    /// Batch-1 decode steps whose device work is counted (kernel launches on CUDA, aclnn
    /// launches and first phases on Ascend; averaged, after a warm-up step; 0: not counted). The
    /// CPU backend does not count.
    #[arg(long, default_value_t = 8)]
    pub count_steps: usize,
    /// Only count: load, warm up, count `--count-steps` decode steps and the weight bytes, print
    /// them, skip every timing.
    #[arg(long)]
    pub counts_only: bool,
    /// Instead of the rest: batch-1 decode in N rounds of 16 steps, the memory read bandwidth
    /// measured before each, and the share of it the decode reads per round (the probe and the
    /// steps a fraction of a second apart; `--device cpu` only).
    #[arg(long, value_name = "N")]
    pub bandwidth_rounds: Option<usize>,
    /// What the KV pool stores: auto (f16), f16 or int8. Two of them (e.g. `f16,int8`): instead
    /// of the rest, batch-1 decode at `--kv-contexts` with one engine per dtype, one after the
    /// other, `--kv-rounds` rounds on one prefill, the median round of each and their ratio
    /// (`bench_kv_dtype`).
    #[arg(long, value_delimiter = ',', default_values_t = vec![KvCacheDtype::Auto])]
    pub kv_cache_dtype: Vec<KvCacheDtype>,
    /// Contexts (tokens) the `--kv-cache-dtype A,B` comparison decodes at.
    #[arg(long, value_delimiter = ',', default_values_t = vec![8192, 32768])]
    pub kv_contexts: Vec<usize>,
    /// Rounds of the `--kv-cache-dtype A,B` comparison (the median and the best are reported,
    /// the prefill computed once per engine); also the rounds
    /// of `--lora-adapters`.
    #[arg(long, default_value_t = 2)]
    pub kv_rounds: usize,
    /// Instead of the rest: decode with this many random LoRA adapters (rank `--lora-rank`) over
    /// the largest of `--batches` streams against the base model alone, same run
    /// (`bench_lora`; CPU).
    #[arg(long, value_name = "N")]
    pub lora_adapters: Option<usize>,
    /// Instead of the rest: an MoE model over two tensor-parallel ranks in this process, once per
    /// way of splitting its routed experts (share_each_expert, whole_experts), beside one engine
    /// with both ranks' threads; decode at `--batches`, `--kv-rounds` rounds taking turns, and
    /// the same-run ratio whole/share (`bench_moe_tp`; CPU, `--threads` per rank).
    #[arg(long)]
    pub moe_tp_layouts: bool,
    /// Rank of the `--lora-adapters` adapters.
    #[arg(long, default_value_t = 16)]
    pub lora_rank: usize,
    /// With `--lora-adapters N`: only write the N adapters this bench times (PEFT directories
    /// `adapter0` .. `adapterN-1` for the model) into this directory and exit, for a served
    /// run (`scripts/bench-lora-served.sh`).
    #[arg(long, value_name = "DIR", requires = "lora_adapters")]
    pub lora_write_to: Option<std::path::PathBuf>,
    /// Decode steps captured as device graphs and replayed (`npu_serving.graph_capture`):
    /// auto (where the backend can; the default, as the server's) or off.
    #[arg(long, default_value_t = GraphCapture::Auto)]
    pub graph_capture: GraphCapture,
}

/// The longest prompt `--long-prompts` takes: what one sequence's blocks hold in this bench's
/// KV pool (600 blocks of 16 tokens), less room for the decoded token.
pub const MAX_LONG_PROMPT: usize = 9_500;

/// One `--long-prompts` measurement.
#[derive(Debug, Serialize, Clone, Copy)]
pub struct PrefillAt {
    pub tokens: usize,
    /// Prompt tokens per second of prefill (median of 3).
    pub tok_s: f64,
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
    /// Bytes of one KV block (every layer's K and V, contiguous: one copy per block).
    pub kv_block_bytes: u64,
    /// Whole-block copies, one block per call as swaps and host-tier hits do, GB/s (1e9 B/s).
    pub kv_block_copy_d2h_gb_s: f64,
    pub kv_block_copy_h2d_gb_s: f64,
    pub peak_rss_mb: f64,
    pub backend: String,
    pub threads: u32,
    /// Bytes of weight matrices one decode step reads (the device's format), where known.
    pub weight_bytes_per_step: Option<u64>,
    /// Weight bytes read per second at the batch-1 decode rate (GB/s = 10^9 B/s).
    pub decode_b1_weight_gb_s: Option<f64>,
    /// This machine's measured memory read bandwidth (all threads, a buffer far beyond the L3;
    /// the better of plain reads and reads asking for lines ahead, as the matmul kernels do).
    pub mem_read_gb_s: Option<f64>,
    /// Weight-matmul operations per second (a multiply-add is 2) in the 512-token prefill.
    pub prefill_gop_s: Option<f64>,
    /// This machine's measured int8 dot-product peak (AVX-512 VNNI on registers, all threads).
    pub vnni_peak_gop_s: Option<f64>,
    /// This machine's measured AMX int8 tile peak (all threads); null where the tiles cannot be
    /// used (no AMX, or `NPU_SERVING_AMX=0`).
    pub amx_int8_peak_gop_s: Option<f64>,
    /// `--long-prompts`: prefill rate per prompt length (empty unless asked for).
    pub prefill_long: Vec<PrefillAt>,
    /// Batch-1 decode steps counted for the fields below (`--count-steps`; 0 where the backend
    /// does not count: the CPU).
    pub counted_decode_steps: usize,
    /// Kernel launches per batch-1 decode step (CUDA: kernels, a cuBLAS GEMM counted as one;
    /// Ascend: aclnn operator launches), the mean over the counted steps; null where the backend
    /// does not count.
    pub launches_per_decode_step: Option<f64>,
    /// `launches_per_decode_step` over the model's layers (the embedding, final norm, output head
    /// and greedy pick included in the numerator).
    pub launches_per_layer: Option<f64>,
    /// Ascend: aclnn first phases (`…GetWorkspaceSize`) per decode step; 0 on CUDA.
    pub first_phases_per_decode_step: Option<f64>,
    /// Graph replays per decode step (`--graph-capture auto` on a backend that captures: 1,
    /// every counted step one replay; else 0).
    pub graph_replays_per_decode_step: Option<f64>,
    /// Bytes of weight matrices a batch-1 decode step reads, as loaded on the device (every
    /// matrix of every layer and the output head; every expert of an MoE layer).
    pub weight_bytes_per_decode_step: Option<u64>,
    /// The same matrices' bytes in the model file (as stored there).
    pub file_weight_bytes: Option<u64>,
}

/// What the device did in batch-1 decode steps (`count_decode`).
#[derive(Debug, Serialize, Clone, Copy, Default, PartialEq)]
pub struct DecodeCounts {
    /// Decode steps counted.
    pub steps: usize,
    pub launches_per_step: f64,
    /// The fewest and most launches of one counted step.
    pub min_launches: u64,
    pub max_launches: u64,
    pub first_phases_per_step: f64,
    pub graph_replays_per_step: f64,
    pub launches_per_layer: f64,
}

/// Counts the device work of `steps` batch-1 decode steps (after one uncounted decode step) of
/// one random 32-token prompt (from `seed`): only steps that carry one generated token of the one
/// sequence are counted, so the prefill is not. `None` when the backend does not count (the CPU).
pub fn count_decode(
    engine: &mut AgentEngine,
    cfg: &AgentEngineConfig,
    steps: usize,
    seed: u64,
) -> anyhow::Result<Option<DecodeCounts>> {
    if steps == 0 || engine.device_model().op_counts().is_none() {
        return Ok(None);
    }
    let vocab = engine.facts().vocab_size;
    let layers = engine.facts().n_layers.max(1) as f64;
    // Prefill (samples the first token), one warm-up decode step, then `steps` counted.
    let reqs = greedy(vec![prompt(&mut SplitMix(seed), 32, vocab)], steps + 2);
    let mut seen = 0usize;
    let mut per_step: Vec<npu_backend::OpCounts> = Vec::with_capacity(steps);
    inproc::run_steps(
        &mut |plan| {
            let decode = plan.seqs.len() == 1
                && plan
                    .seqs
                    .iter()
                    .all(|s| s.tokens.len() == 1 && s.n_prompt_tokens == 0 && s.sample);
            let before = engine.device_model().op_counts().unwrap_or_default();
            let r = engine.step(plan);
            let after = engine.device_model().op_counts().unwrap_or_default();
            if decode {
                seen += 1;
                if seen > 1 {
                    per_step.push(npu_backend::OpCounts {
                        launches: after.launches - before.launches,
                        first_phases: after.first_phases - before.first_phases,
                        graph_replays: after.graph_replays - before.graph_replays,
                    });
                }
            }
            r
        },
        inproc::scheduler_config(cfg),
        &reqs,
        &mut |_, _| {},
    )?;
    if per_step.is_empty() {
        anyhow::bail!("no batch-1 decode step was counted (asked for {steps})");
    }
    let n = per_step.len() as f64;
    let mean =
        |f: fn(&npu_backend::OpCounts) -> u64| per_step.iter().map(f).sum::<u64>() as f64 / n;
    let launches = mean(|c| c.launches);
    Ok(Some(DecodeCounts {
        steps: per_step.len(),
        launches_per_step: launches,
        min_launches: per_step.iter().map(|c| c.launches).min().unwrap_or(0),
        max_launches: per_step.iter().map(|c| c.launches).max().unwrap_or(0),
        first_phases_per_step: mean(|c| c.first_phases),
        graph_replays_per_step: mean(|c| c.graph_replays),
        launches_per_layer: launches / layers,
    }))
}

/// Bytes, as the model file stores them, of the weight matrices `weight_bytes_per_step` counts:
/// every tensor of two or more dimensions but the token embedding, which counts only as the
/// output head of a file without `output.weight` (tied embeddings).
pub fn file_weight_bytes(path: &std::path::Path) -> anyhow::Result<u64> {
    let ck = npu_model::Checkpoint::open(path)?;
    let names = ck.tensor_names();
    let tied = !names.iter().any(|n| n == "output.weight");
    Ok(names
        .iter()
        .filter_map(|n| ck.stored_info(n))
        .filter(|t| t.dims.iter().filter(|&&d| d > 1).count() >= 2)
        .filter(|t| t.name != "token_embd.weight" || tied)
        .map(|t| t.n_bytes)
        .sum())
}

/// Fills the report's counting fields: `--count-steps` decode steps and the weight bytes.
fn counts(
    args: &BenchModelArgs,
    engine: &mut AgentEngine,
    cfg: &AgentEngineConfig,
    rng: &mut SplitMix,
    rep: &mut BenchModelReport,
) -> anyhow::Result<()> {
    if let Some(c) = count_decode(engine, cfg, args.count_steps, rng.next())? {
        rep.counted_decode_steps = c.steps;
        rep.launches_per_decode_step = Some(c.launches_per_step);
        rep.launches_per_layer = Some(c.launches_per_layer);
        rep.first_phases_per_decode_step = Some(c.first_phases_per_step);
        rep.graph_replays_per_decode_step = Some(c.graph_replays_per_step);
    }
    rep.weight_bytes_per_decode_step = engine.device_model().weight_bytes_per_step();
    rep.weight_bytes_per_step = rep.weight_bytes_per_decode_step;
    rep.file_weight_bytes = Some(file_weight_bytes(&cfg.model_path)?);
    Ok(())
}

fn print_counts(rep: &BenchModelReport) {
    if let Some(l) = rep.launches_per_decode_step {
        println!(
            "decode b1 launches {l:8.1} per step, {:.1} per layer, {:.1} first phases, {:.0} graph \
             replays (mean of {} steps)",
            rep.launches_per_layer.unwrap_or(0.0),
            rep.first_phases_per_decode_step.unwrap_or(0.0),
            rep.graph_replays_per_decode_step.unwrap_or(0.0),
            rep.counted_decode_steps
        );
    }
    if let (Some(d), Some(f)) = (rep.weight_bytes_per_decode_step, rep.file_weight_bytes) {
        println!(
            "weights b1 step    {:8.1} MB on the device, {:.1} MB in the file ({:+.2}%)",
            d as f64 / 1e6,
            f as f64 / 1e6,
            100.0 * (d as f64 - f as f64) / (f as f64).max(1.0)
        );
    }
}

/// SplitMix64: reproducible synthetic prompts.
pub(crate) struct SplitMix(pub u64);

impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

pub(crate) fn prompt(rng: &mut SplitMix, n: usize, vocab: u32) -> Vec<u32> {
    // Ordinary token ids, away from the special tokens at the start of the vocabulary.
    (0..n)
        .map(|_| 100 + (rng.next() % (vocab as u64 - 100)) as u32)
        .collect()
}

/// Greedy requests with these prompts, `n` tokens each, all arriving at once (never stopping
/// early: benchmarks run every token).
pub(crate) fn greedy(prompts: Vec<Vec<u32>>, n: usize) -> Vec<Arrival> {
    prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| Arrival {
            request: GenerateRequest {
                id: i as u64,
                prompt_ids: p,
                params: SamplingParams::greedy(),
                max_new_tokens: n as u32,
                stop: Vec::new(),
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                speculative: true,
            },
            at_step: 0,
        })
        .collect()
}

/// Runs the requests on the engine under the real scheduler.
fn run_all(
    engine: &mut AgentEngine,
    cfg: &AgentEngineConfig,
    reqs: &[Arrival],
) -> anyhow::Result<(Vec<RunOutput>, RunTiming)> {
    Ok(inproc::run(
        engine,
        inproc::scheduler_config(cfg),
        reqs,
        &mut |_, _| {},
    )?)
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
    match args.kv_cache_dtype.len() {
        1 => {}
        2 => return super::bench_kv_dtype::run(&args),
        n => anyhow::bail!("--kv-cache-dtype takes one dtype, or two to compare (got {n})"),
    }
    if args.long_context {
        return super::bench_long_context::run(&args);
    }
    if args.moe_tp_layouts {
        return super::bench_moe_tp::run(&args);
    }
    if let Some(n) = args.lora_adapters {
        return super::bench_lora::run(&args, n);
    }
    let alternate = match &args.alternate_prefetch {
        Some(pair) => {
            if args.device.device != DeviceKind::Cpu {
                anyhow::bail!(
                    "--alternate-prefetch tunes the CPU backend's matmul: use --device cpu"
                );
            }
            Some(super::bench_prefetch::check_pair(pair)?)
        }
        None => None,
    };
    let bandwidth_rounds = match args.bandwidth_rounds {
        Some(n) => {
            if args.device.device != DeviceKind::Cpu {
                anyhow::bail!(
                    "--bandwidth-rounds compares decode with this host's memory: use --device cpu"
                );
            }
            Some(super::bench_bandwidth::check_rounds(n)?)
        }
        None => None,
    };
    if let Some(&bad) = args
        .long_prompts
        .iter()
        .find(|&&n| !(1..=MAX_LONG_PROMPT).contains(&n))
    {
        anyhow::bail!(
            "--long-prompts takes prompt lengths from 1 to {MAX_LONG_PROMPT} tokens (got {bad})"
        );
    }
    let model_path = npu_model::resolve_model(args.model.as_deref())?;
    let long = !args.skip_long;
    let cfg = AgentEngineConfig {
        device: args.device.device,
        device_id: args.device.device_id,
        model_path,
        num_blocks: if long { 1200 } else { 800 },
        block_size: 16,
        max_slots: 64,
        max_tokens_per_step: 512,
        max_blocks_per_seq: 600,
        threads: args.threads,
        swap_space_mb: 0,
        long_context: None,
        handoff: None,
        kv_memory_fraction: None,
        tensor_parallel: None,
        quantize: args.quantize.clone(),
        kv_cache_dtype: args.kv_cache_dtype[0],
        graph_capture: args.graph_capture,
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
    if args.counts_only {
        // Warm-up, then the counts alone.
        run_all(
            &mut engine,
            &cfg,
            &greedy(vec![prompt(&mut rng, 32, vocab)], 4),
        )?;
        counts(&args, &mut engine, &cfg, &mut rng, &mut rep)?;
        rep.peak_rss_mb = peak_rss_mb();
        if args.json {
            println!("{}", serde_json::to_string(&rep)?);
        } else {
            println!("backend            {}", rep.backend);
            print_counts(&rep);
        }
        return Ok(());
    }
    let copy = engine
        .measure_kv_copy(256)
        .context("measuring KV block copies")?;
    rep.kv_block_bytes = engine.facts().kv.block_bytes;
    rep.kv_block_copy_d2h_gb_s = copy.d2h_bytes_per_s / 1e9;
    rep.kv_block_copy_h2d_gb_s = copy.h2d_bytes_per_s / 1e9;
    say(&format!(
        "KV block copy ({} B per block): device->host {:.2} GB/s, host->device {:.2} GB/s",
        rep.kv_block_bytes, rep.kv_block_copy_d2h_gb_s, rep.kv_block_copy_h2d_gb_s
    ));
    // Warm-up: touch every weight once.
    run_all(
        &mut engine,
        &cfg,
        &greedy(vec![prompt(&mut rng, 32, vocab)], 4),
    )?;
    if let Some(n) = bandwidth_rounds {
        let r =
            super::bench_bandwidth::rounds(&mut engine, &cfg, n, rep.threads as usize, &mut rng)?;
        if args.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            super::bench_bandwidth::print(&r);
        }
        return Ok(());
    }
    if let Some(pair) = alternate {
        let r =
            super::bench_prefetch::alternate(&mut engine, &cfg, pair, args.decode_steps, &mut rng)?;
        if args.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            println!(
                "batch-1 decode, prefetch {} / {} blocks alternated every step: {:.3} / {:.3} ms \
                 per step (medians of {} / {}): {} blocks runs {:.3}x as fast as {}",
                r.prefetch_blocks[0],
                r.prefetch_blocks[1],
                r.ms_per_step[0],
                r.ms_per_step[1],
                r.steps[0],
                r.steps[1],
                r.prefetch_blocks[1],
                r.speed_ratio_b_over_a,
                r.prefetch_blocks[0]
            );
        }
        return Ok(());
    }

    counts(&args, &mut engine, &cfg, &mut rng, &mut rep)?;

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
        let median = median_prefill(&mut engine, &cfg, &mut rng, n, 5)?;
        **slot = median;
        say(&format!(
            "prefill {n:>4} tokens: {median:8.1} tok/s (median of 5)"
        ));
    }

    for &n in &args.long_prompts {
        let tok_s = median_prefill(&mut engine, &cfg, &mut rng, n, 3)?;
        rep.prefill_long.push(PrefillAt { tokens: n, tok_s });
        say(&format!(
            "prefill {n:>4} tokens: {tok_s:8.1} tok/s (median of 3)"
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
        let prompts = (0..b).map(|_| prompt(&mut rng, 128, vocab)).collect();
        let (_, t) = run_all(&mut engine, &cfg, &greedy(prompts, steps + 1))?;
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
            let (_, t) = run_all(
                &mut engine,
                &cfg,
                &greedy(vec![prompt(&mut rng, ctx, vocab)], 17),
            )?;
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
    // Peak memory of the engine's runs, before the bandwidth measurement's buffer.
    rep.peak_rss_mb = peak_rss_mb();
    roofline(&args, &engine, &mut rep)?;
    if args.json {
        println!("{}", serde_json::to_string(&rep)?);
    } else {
        println!("backend            {}", rep.backend);
        println!("prefill 128        {:8.1} tok/s", rep.prefill_tok_s_128);
        println!("prefill 512        {:8.1} tok/s", rep.prefill_tok_s_512);
        for p in &rep.prefill_long {
            println!("prefill {:<10} {:8.1} tok/s", p.tokens, p.tok_s);
        }
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
        println!(
            "KV block copy      {:8.2} GB/s device->host, {:.2} GB/s host->device ({} B blocks)",
            rep.kv_block_copy_d2h_gb_s, rep.kv_block_copy_h2d_gb_s, rep.kv_block_bytes
        );
        print_roofline(&rep);
        print_counts(&rep);
        println!("peak RSS           {:8.1} MiB", rep.peak_rss_mb);
    }
    Ok(())
}

/// The median prefill rate (prompt tokens/s) of `runs` fresh random prompts of `n` tokens.
fn median_prefill(
    engine: &mut AgentEngine,
    cfg: &AgentEngineConfig,
    rng: &mut SplitMix,
    n: usize,
    runs: usize,
) -> anyhow::Result<f64> {
    let vocab = engine.facts().vocab_size;
    let mut rates = Vec::with_capacity(runs);
    for _ in 0..runs {
        let (_, t) = run_all(engine, cfg, &greedy(vec![prompt(rng, n, vocab)], 1))?;
        rates.push(t.prefill_tokens as f64 / t.prefill.as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[rates.len() / 2])
}

/// The achieved rates beside this machine's measured limits: weight bytes read per second in
/// batch-1 decode against the memory read bandwidth, prefill matmul GOP/s against the int8 peak.
fn roofline(
    args: &BenchModelArgs,
    engine: &AgentEngine,
    rep: &mut BenchModelReport,
) -> anyhow::Result<()> {
    let model = engine.device_model();
    rep.weight_bytes_per_step = model.weight_bytes_per_step();
    if rep.decode_tok_s_b1 > 0.0 {
        rep.decode_b1_weight_gb_s = rep
            .weight_bytes_per_step
            .map(|b| b as f64 * rep.decode_tok_s_b1 / 1e9);
    }
    if rep.prefill_tok_s_512 > 0.0 {
        // One 512-token prompt: every token through the layers, one row through the head.
        let (layers, head) = model.matmul_macs_per_token();
        let ops = 2.0 * (512.0 * layers as f64 + head as f64);
        rep.prefill_gop_s = Some(ops / (512.0 / rep.prefill_tok_s_512) / 1e9);
    }
    if args.skip_roofline || engine.facts().backend.split_whitespace().next() != Some("cpu") {
        return Ok(());
    }
    let pool = ThreadPool::new(rep.threads as usize);
    rep.mem_read_gb_s = roofline::read_bandwidth_gb_s(&pool, roofline::READ_BYTES)?;
    rep.vnni_peak_gop_s = roofline::int8_peak_gop_s(&pool, Isa::active())?;
    rep.amx_int8_peak_gop_s = roofline::amx_int8_peak_gop_s(&pool)?;
    Ok(())
}

fn print_roofline(rep: &BenchModelReport) {
    let show = |v: Option<f64>| v.map_or("       -".to_string(), |v| format!("{v:8.1}"));
    let pct = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!(" ({:.0}% of it)", 100.0 * a / b),
        _ => String::new(),
    };
    if let Some(b) = rep.weight_bytes_per_step {
        println!(
            "weights per step   {:8.1} MB (every weight matrix, read once per decode step)",
            b as f64 / 1e6
        );
    }
    println!(
        "decode b1 weights  {} GB/s read, memory read {} GB/s{}",
        show(rep.decode_b1_weight_gb_s),
        show(rep.mem_read_gb_s),
        pct(rep.decode_b1_weight_gb_s, rep.mem_read_gb_s)
    );
    println!(
        "prefill 512 matmul {} GOP/s, int8 VNNI peak {} GOP/s{}",
        show(rep.prefill_gop_s),
        show(rep.vnni_peak_gop_s),
        pct(rep.prefill_gop_s, rep.vnni_peak_gop_s)
    );
    let amx = rep
        .amx_int8_peak_gop_s
        .map_or("     none (no usable AMX tiles)".to_string(), |v| {
            format!("{v:8.1} GOP/s")
        });
    println!(
        "                   int8 AMX peak  {amx}; of the best engine here{}",
        pct(
            rep.prefill_gop_s,
            [rep.vnni_peak_gop_s, rep.amx_int8_peak_gop_s]
                .into_iter()
                .flatten()
                .reduce(f64::max)
        )
    );
}

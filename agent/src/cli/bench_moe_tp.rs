//! `npu-serving bench-model --moe-tp-layouts`: an MoE model over a tensor-parallel group of two
//! ranks in this process (`tp::LocalGroup`), once per way of splitting its routed experts
//! (`npu_serving.moe_tensor_parallel`: share_each_expert, whole_experts), beside one engine with
//! the ranks' threads together. Decode at each of `--batches` (128-token prompts), the three
//! configs taking turns (in the reverse order every other round) for `--kv-rounds` rounds (best
//! round of each reported); prints each
//! rate, the same-run ratio whole/share per batch (of the best rounds, and the median of each
//! round's ratio: the two layouts ran back to back), and each layout's expert-weight bytes per
//! rank.
//! The group's ranks log, when dropped, their time in collectives and at the barriers (the
//! load balance of a layout shows as the lighter rank's waiting).

use std::time::Instant;

use anyhow::{bail, Context};
use npu_model::shard::{shard_split, ExpertSplit};
use npu_protocol::agent::DeviceKind;
use serde::Serialize;

use super::bench_model::{greedy, peak_rss_mb, prompt, BenchModelArgs, SplitMix};
use crate::engine::{AgentEngine, AgentEngineConfig};
use crate::inproc::{self, Arrival, RunTiming};
use crate::tp::LocalGroup;

/// One config at one batch size.
#[derive(Debug, Serialize)]
pub struct MoeTpRun {
    /// `one engine`, `share_each_expert` or `whole_experts`.
    pub config: String,
    pub batch: usize,
    /// Aggregate decode tok/s of each round (median step).
    pub rounds_tok_s: Vec<f64>,
    /// The best round.
    pub decode_tok_s: f64,
}

/// What one rank of a layout holds of the routed experts.
#[derive(Debug, Serialize)]
pub struct MoeTpShard {
    pub layout: String,
    pub rank: usize,
    /// Experts held (all of them, or a range of whole experts).
    pub experts: usize,
    /// Columns of each held expert.
    pub expert_ff: usize,
    /// Routed-expert weight bytes this rank holds (all MoE layers; the file's types).
    pub expert_bytes: u64,
}

#[derive(Debug, Serialize, Default)]
pub struct MoeTpReport {
    pub model: String,
    pub backend: String,
    pub threads_per_rank: u32,
    pub runs: Vec<MoeTpRun>,
    pub shards: Vec<MoeTpShard>,
    /// Per batch: whole_experts' best tok/s over share_each_expert's.
    pub whole_over_share: Vec<(usize, f64)>,
    /// Per batch: the median over rounds of that round's whole_experts / share_each_expert.
    pub whole_over_share_round_median: Vec<(usize, f64)>,
    pub peak_rss_mb: f64,
    pub wall_s: f64,
}

/// Routed-expert bytes a rank holds: for `experts` experts, `ff` rows of gate and up and `ff`
/// columns of down (whole blocks), in every layer that has expert tensors.
fn expert_bytes(f: &npu_model::Checkpoint, layers: usize, experts: usize, ff: usize) -> u64 {
    let mut total = 0u64;
    for i in 0..layers {
        for (name, rows, cols) in [
            ("ffn_gate_exps", ff, None),
            ("ffn_up_exps", ff, None),
            ("ffn_down_exps", 0, Some(ff)),
        ] {
            let Some(t) = f.tensor_info(&format!("blk.{i}.{name}.weight")) else {
                continue;
            };
            // ggml order: [cols, rows, experts].
            let (tc, tr) = (t.dims[0] as usize, t.dims[1] as usize);
            let rows = rows.min(tr);
            let bytes = match cols {
                None => t.ty.row_bytes(tc).unwrap_or(0) * rows,
                Some(c) => t.ty.row_bytes(c).unwrap_or(0) * tr,
            };
            total += (bytes * experts) as u64;
        }
    }
    total
}

/// Greedy decode of `b` 128-token prompts for `steps` tokens; aggregate tok/s (median step).
fn decode(
    step: &mut dyn FnMut(
        &npu_protocol::StepPlan,
    ) -> Result<npu_protocol::StepResult, crate::engine::EngineError>,
    cfg: &AgentEngineConfig,
    reqs: &[Arrival],
    b: usize,
) -> anyhow::Result<f64> {
    let (_, t): (_, RunTiming) =
        inproc::run_steps(step, inproc::scheduler_config(cfg), reqs, &mut |_, _| {})?;
    Ok(t.median_decode_tok_s(b)
        .unwrap_or(t.decode_tokens as f64 / t.decode.as_secs_f64()))
}

pub fn run(args: &BenchModelArgs) -> anyhow::Result<()> {
    let t_start = Instant::now();
    if args.device.device != DeviceKind::Cpu {
        bail!(
            "--moe-tp-layouts runs a group of two ranks in this process on the CPU (whole \
             experts per rank is built on the CPU backend only): use --device cpu"
        );
    }
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get()) as u32;
    let per_rank = if args.threads == 0 {
        (cores / 2).max(1)
    } else {
        args.threads
    };
    let model_path = npu_model::resolve_model(args.model.as_deref())?;
    let mut cfg = AgentEngineConfig {
        device: DeviceKind::Cpu,
        device_id: 0,
        model_path: model_path.clone(),
        num_blocks: 800,
        block_size: 16,
        max_slots: 64,
        max_tokens_per_step: 512,
        max_blocks_per_seq: 600,
        threads: per_rank,
        swap_space_mb: 0,
        long_context: None,
        handoff: None,
        kv_memory_fraction: None,
        tensor_parallel: None,
        quantize: args.quantize.clone(),
        kv_cache_dtype: args.kv_cache_dtype[0],
        graph_capture: Default::default(),
    };
    let file = crate::engine::open_checkpoint(&cfg)?;
    let mc = file.config().map_err(crate::model::ModelError::from)?;
    if mc.moe.is_none() {
        bail!(
            "--moe-tp-layouts compares the ways of splitting routed experts: {} has none",
            model_path.display()
        );
    }
    let say = |s: &str| {
        if !args.json {
            eprintln!("{s}");
        }
    };
    let mut rep = MoeTpReport {
        model: model_path.display().to_string(),
        threads_per_rank: per_rank,
        ..Default::default()
    };
    let layouts = [ExpertSplit::ShareEachExpert, ExpertSplit::WholeExperts];
    for split in layouts {
        for rank in 0..2 {
            let s = shard_split(&mc, Some(&file), 2, rank, split)
                .with_context(|| format!("{} over two ranks", split.name()))?;
            rep.shards.push(MoeTpShard {
                layout: split.name().into(),
                rank,
                experts: s.experts.len(),
                expert_ff: s.expert_ff.len(),
                expert_bytes: expert_bytes(&file, mc.n_layers, s.experts.len(), s.expert_ff.len()),
            });
        }
    }
    drop(file);
    let mut groups = Vec::new();
    for split in layouts {
        let g = LocalGroup::load_split(&cfg, 2, split)
            .with_context(|| format!("loading two ranks, {}", split.name()))?;
        groups.push((split.name().to_string(), g));
    }
    cfg.threads = per_rank * 2;
    let mut one = AgentEngine::load(&cfg).context("loading one engine")?;
    rep.backend = one.facts().backend.clone();
    let vocab = one.facts().vocab_size;
    let names: Vec<String> = std::iter::once(format!("one engine, {} threads", cfg.threads))
        .chain(groups.iter().map(|(n, _)| n.clone()))
        .collect();
    let mut best: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); args.batches.len()]; names.len()];
    let mut rng = SplitMix(11);
    for round in 0..args.kv_rounds.max(1) {
        for (bi, &b) in args.batches.iter().enumerate() {
            let steps = if b == 1 {
                args.decode_steps.max(64)
            } else {
                args.decode_steps
            };
            let prompts: Vec<Vec<u32>> = (0..b).map(|_| prompt(&mut rng, 128, vocab)).collect();
            let reqs = greedy(prompts, steps + 1);
            // Odd rounds take the configs in the reverse order (neither always runs first).
            let order: Vec<usize> = match round % 2 {
                0 => (0..names.len()).collect(),
                _ => (0..names.len()).rev().collect(),
            };
            for ci in order {
                let name = &names[ci];
                let tok_s = match ci {
                    0 => decode(&mut |p| one.step(p), &cfg, &reqs, b)?,
                    _ => {
                        let g = &mut groups[ci - 1].1;
                        decode(&mut |p| g.step(p), &cfg, &reqs, b)?
                    }
                };
                best[ci][bi].push(tok_s);
                say(&format!(
                    "round {round}, batch {b:>2}, {name:<24}: {tok_s:8.1} tok/s"
                ));
            }
        }
    }
    for (ci, name) in names.iter().enumerate() {
        for (bi, &b) in args.batches.iter().enumerate() {
            let rounds = best[ci][bi].clone();
            rep.runs.push(MoeTpRun {
                config: name.clone(),
                batch: b,
                decode_tok_s: rounds.iter().copied().fold(0.0, f64::max),
                rounds_tok_s: rounds,
            });
        }
    }
    for &b in &args.batches {
        let run = |c: &str| rep.runs.iter().find(|r| r.config == c && r.batch == b);
        let (Some(w), Some(s)) = (run("whole_experts"), run("share_each_expert")) else {
            continue;
        };
        rep.whole_over_share
            .push((b, w.decode_tok_s / s.decode_tok_s));
        let mut ratios: Vec<f64> = w
            .rounds_tok_s
            .iter()
            .zip(&s.rounds_tok_s)
            .map(|(w, s)| w / s)
            .collect();
        ratios.sort_by(f64::total_cmp);
        rep.whole_over_share_round_median
            .push((b, ratios[ratios.len() / 2]));
    }
    drop(groups);
    rep.peak_rss_mb = peak_rss_mb();
    rep.wall_s = t_start.elapsed().as_secs_f64();
    if args.json {
        println!("{}", serde_json::to_string(&rep)?);
        return Ok(());
    }
    println!("model {}  backend {}", rep.model, rep.backend);
    println!("two ranks of {per_rank} thread(s) each, in one process, on {cores} cores");
    for s in &rep.shards {
        println!(
            "{:<17} rank {}: {:>3} experts x {:>4} columns, {:.1} MB of expert weights",
            s.layout,
            s.rank,
            s.experts,
            s.expert_ff,
            s.expert_bytes as f64 / 1e6
        );
    }
    for r in &rep.runs {
        println!(
            "batch {:>2}  {:<24} decode {:8.1} tok/s (best of {:.1?})",
            r.batch, r.config, r.decode_tok_s, r.rounds_tok_s
        );
    }
    for ((b, x), (_, m)) in rep
        .whole_over_share
        .iter()
        .zip(&rep.whole_over_share_round_median)
    {
        println!(
            "batch {b:>2}  whole_experts / share_each_expert, same run: {x:.3}x of the best \
             rounds, {m:.3}x the median round"
        );
    }
    Ok(())
}

//! `npu-serving bench-model --bandwidth-rounds N`: batch-1 decode in rounds of steps, each round
//! right after a measurement of the memory read bandwidth, in one process. The share of the
//! bandwidth that decode reaches (weight bytes a step over the step time, against the probe)
//! is taken per round, from a probe and steps a fraction of a second apart: on this VM-shared kind
//! of machine the memory speed moves by a third within minutes, so a probe taken once at the
//! end of a run (`mem_read_gb_s`) can be a different machine from the decode it is compared
//! with (66% and 99% "of the bandwidth" for one file, two runs apart). CPU backend only.

use std::time::Duration;

use anyhow::{bail, Context};
use npu_backend_cpu::roofline::{ReadProbe, READ_BYTES, READ_PASSES};
use npu_backend_cpu::threadpool::ThreadPool;
use serde::Serialize;

use super::bench_model::{greedy, prompt, SplitMix};
use crate::engine::{AgentEngine, AgentEngineConfig};
use crate::inproc;

/// Decode steps left out at the start (the first touches of the context).
const WARM_STEPS: usize = 4;

/// Decode steps per round; each round's step time is their median.
pub const STEPS_PER_ROUND: usize = 16;

/// The most rounds `--bandwidth-rounds` takes.
pub const MAX_ROUNDS: usize = 64;

/// One round: the probe, then its steps.
#[derive(Debug, Serialize, Clone, Copy)]
pub struct BandwidthRound {
    /// Memory read bandwidth measured just before the round's steps (GB/s = 10^9 B/s).
    pub probe_gb_s: f64,
    /// Median batch-1 decode step time of the round, milliseconds.
    pub ms_per_step: f64,
    /// Weight bytes a step over that time, GB/s.
    pub weight_gb_s: f64,
    /// `weight_gb_s / probe_gb_s`.
    pub share: f64,
}

/// What the rounds measured.
#[derive(Debug, Serialize)]
pub struct BandwidthReport {
    /// Bytes of weight matrices one decode step reads.
    pub weight_bytes_per_step: u64,
    pub steps_per_round: usize,
    pub rounds: Vec<BandwidthRound>,
    /// The median of the rounds' shares (and the lowest and highest).
    pub median_share: f64,
    pub min_share: f64,
    pub max_share: f64,
}

/// Checks `--bandwidth-rounds`.
pub fn check_rounds(rounds: usize) -> anyhow::Result<usize> {
    if !(1..=MAX_ROUNDS).contains(&rounds) {
        bail!("--bandwidth-rounds takes 1 to {MAX_ROUNDS} rounds (got {rounds})");
    }
    Ok(rounds)
}

/// Runs one greedy batch-1 request through `rounds` rounds of `STEPS_PER_ROUND` decode steps,
/// measuring the read bandwidth on a pool of `threads` threads before each round, as plain
/// `bench-model` does once (the same buffer size and passes; ~60 ms at 70 GB/s).
pub(crate) fn rounds(
    engine: &mut AgentEngine,
    cfg: &AgentEngineConfig,
    rounds: usize,
    threads: usize,
    rng: &mut SplitMix,
) -> anyhow::Result<BandwidthReport> {
    let Some(weight_bytes) = engine.device_model().weight_bytes_per_step() else {
        bail!("--bandwidth-rounds needs the weight bytes a step reads, which this model does not report");
    };
    let probe = ReadProbe::new(READ_BYTES)
        .context("allocating the read-bandwidth probe's buffer (256 MiB)")?;
    let pool = ThreadPool::new(threads);
    let vocab = engine.facts().vocab_size;
    let steps = WARM_STEPS + rounds * STEPS_PER_ROUND;
    let reqs = greedy(vec![prompt(rng, 128, vocab)], steps + 1);
    // After token `c` (the prefill step made token 1) comes decode-step entry `c - 1`: entry `e`
    // opens round `(e - WARM_STEPS) / STEPS_PER_ROUND` when `e - WARM_STEPS` is a multiple of it.
    let mut tokens = 0usize;
    let mut probes: Vec<f64> = Vec::with_capacity(rounds);
    let mut probe_error = None;
    let run = inproc::run(engine, inproc::scheduler_config(cfg), &reqs, &mut |_, _| {
        tokens += 1;
        let next = tokens - 1;
        if next >= WARM_STEPS
            && (next - WARM_STEPS).is_multiple_of(STEPS_PER_ROUND)
            && probes.len() < rounds
        {
            match probe.gb_s(&pool, READ_PASSES) {
                Ok(v) => probes.push(v),
                Err(e) => probe_error = Some(e),
            }
        }
    });
    let (_, timing) = run?;
    if let Some(e) = probe_error {
        return Err(e).context("measuring the read bandwidth between decode steps");
    }
    if timing.decode_steps.len() != steps
        || timing.decode_steps.iter().any(|s| s.1 != 1)
        || probes.len() != rounds
    {
        bail!(
            "the rounds need one token per decode step after one prefill step: {} decode steps \
             (wanted {steps}), {} probes (wanted {rounds})",
            timing.decode_steps.len(),
            probes.len()
        );
    }
    let mut out = Vec::with_capacity(rounds);
    for (r, &probe_gb_s) in probes.iter().enumerate() {
        let at = WARM_STEPS + r * STEPS_PER_ROUND;
        let mut times: Vec<Duration> = timing.decode_steps[at..at + STEPS_PER_ROUND]
            .iter()
            .map(|s| s.0)
            .collect();
        times.sort();
        let s = times[times.len() / 2].as_secs_f64();
        let weight_gb_s = weight_bytes as f64 / s / 1e9;
        out.push(BandwidthRound {
            probe_gb_s,
            ms_per_step: s * 1e3,
            weight_gb_s,
            share: weight_gb_s / probe_gb_s,
        });
    }
    let mut shares: Vec<f64> = out.iter().map(|r| r.share).collect();
    shares.sort_by(f64::total_cmp);
    Ok(BandwidthReport {
        weight_bytes_per_step: weight_bytes,
        steps_per_round: STEPS_PER_ROUND,
        median_share: shares[shares.len() / 2],
        min_share: shares[0],
        max_share: shares[shares.len() - 1],
        rounds: out,
    })
}

/// The rounds as a table.
pub fn print(r: &BandwidthReport) {
    println!(
        "batch-1 decode in rounds of {} steps, each after a read-bandwidth probe ({:.1} MB of \
         weights a step):",
        r.steps_per_round,
        r.weight_bytes_per_step as f64 / 1e6
    );
    println!("round  probe GB/s  ms/step  weights GB/s  share");
    for (i, x) in r.rounds.iter().enumerate() {
        println!(
            "{:5}  {:10.1}  {:7.2}  {:12.1}  {:4.0}%",
            i + 1,
            x.probe_gb_s,
            x.ms_per_step,
            x.weight_gb_s,
            100.0 * x.share
        );
    }
    println!(
        "share of the bandwidth measured beside it: median {:.0}% of {} rounds (lowest {:.0}%, \
         highest {:.0}%)",
        100.0 * r.median_share,
        r.rounds.len(),
        100.0 * r.min_share,
        100.0 * r.max_share
    );
}

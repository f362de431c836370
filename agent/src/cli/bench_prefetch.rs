//! `npu-serving bench-model --alternate-prefetch A,B`: batch-1 decode with the CPU matmul's
//! prefetch distance switched between A and B blocks every step, in one process. This VM-shared
//! kind of machine moves between memory speeds every few minutes, by far more than a tuning
//! changes; steps alternated within one run see the same memory, so the ratio of the two medians
//! is the distance's own effect (two processes alternated could not tell 3% from noise). It
//! changes no result: the distance only decides which bytes are asked for early.

use std::time::Duration;

use anyhow::bail;
use npu_backend_cpu::kernels::matmul::{prefetch_blocks, set_prefetch_blocks, MAX_PREFETCH_BLOCKS};
use serde::Serialize;

use super::bench_model::{greedy, prompt, SplitMix};
use crate::engine::{AgentEngine, AgentEngineConfig};
use crate::inproc;

/// Steps at the start of the run left out of both medians (the first touches of the context).
const WARM_STEPS: usize = 4;

/// What the alternation measured.
#[derive(Debug, Serialize)]
pub struct PrefetchReport {
    /// The two distances, in blocks of 32 values across a group's 16 rows.
    pub prefetch_blocks: [usize; 2],
    /// Median decode step time with each, in milliseconds.
    pub ms_per_step: [f64; 2],
    /// Steps measured with each.
    pub steps: [usize; 2],
    /// How much faster B ran than A: A's median step time over B's (above 1: B is faster).
    pub speed_ratio_b_over_a: f64,
}

/// Checks the pair `--alternate-prefetch` was given.
pub fn check_pair(pair: &[usize]) -> anyhow::Result<[usize; 2]> {
    match pair {
        &[a, b]
            if (1..=MAX_PREFETCH_BLOCKS).contains(&a) && (1..=MAX_PREFETCH_BLOCKS).contains(&b) =>
        {
            Ok([a, b])
        }
        _ => bail!(
            "--alternate-prefetch takes two distances in blocks from 1 to {MAX_PREFETCH_BLOCKS}, \
             as A,B (got {pair:?})"
        ),
    }
}

/// Runs one greedy batch-1 request of `steps` decode steps, distance A on even steps and B on
/// odd ones, and restores the distance in force before.
pub(crate) fn alternate(
    engine: &mut AgentEngine,
    cfg: &AgentEngineConfig,
    pair: [usize; 2],
    steps: usize,
    rng: &mut SplitMix,
) -> anyhow::Result<PrefetchReport> {
    let before = prefetch_blocks();
    let vocab = engine.facts().vocab_size;
    let steps = steps.max(2 * WARM_STEPS + 16);
    let reqs = greedy(vec![prompt(rng, 128, vocab)], steps + 1);
    // Token `c` (counting from 1) arrives after the step that made it; decode step `c` runs next,
    // with A when `c` is odd. The prefill step made token 1, so decode step `c` is entry `c - 1`
    // of the timing's decode steps: A on even entries.
    let mut tokens = 0usize;
    set_prefetch_blocks(pair[0]);
    let run = inproc::run(engine, inproc::scheduler_config(cfg), &reqs, &mut |_, _| {
        tokens += 1;
        set_prefetch_blocks(pair[(tokens + 1) % 2]);
    });
    set_prefetch_blocks(before);
    let (_, timing) = run?;
    if timing.decode_steps.len() + 1 != tokens || timing.decode_steps.iter().any(|s| s.1 != 1) {
        bail!(
            "the alternation needs one token per decode step after one prefill step: {} tokens, \
             {} decode steps",
            tokens,
            timing.decode_steps.len()
        );
    }
    let mut times: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for (i, &(dt, _)) in timing.decode_steps.iter().enumerate().skip(WARM_STEPS) {
        times[i % 2].push(dt);
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64() * 1e3
    };
    let ms = [median(&mut times[0]), median(&mut times[1])];
    Ok(PrefetchReport {
        prefetch_blocks: pair,
        ms_per_step: ms,
        steps: [times[0].len(), times[1].len()],
        speed_ratio_b_over_a: ms[0] / ms[1],
    })
}

//! Sampler: turns one sequence's logits into the next token, its log-probability and the top-n
//! alternatives. Owns penalties (via `history`), greedy/temperature/top-k/top-p/min-p sampling
//! and the seeded, batch-independent random draw; scratch buffers are reused across calls.

mod history;
mod rng;
mod truncation;

pub use history::{apply_penalties, TokenCounts, TokenHistory};
pub use rng::{random_u64, uniform_f64};

use npu_protocol::{SamplingParams, TokenLogprob, MAX_TOP_N};
use thiserror::Error;

use truncation::{draw_token, Truncation};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SamplerError {
    #[error("cannot sample from empty logits (vocabulary size 0)")]
    EmptyLogits,
    #[error("vocabulary of {0} tokens does not fit token ids in u32")]
    VocabTooLarge(usize),
}

/// What one sampling call produces for a sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOutput {
    /// The chosen token and its log-probability under the raw (unpenalised) distribution.
    pub token: TokenLogprob,
    /// The `params.top_n` most likely raw tokens (at most `MAX_TOP_N`), best first.
    pub top: Vec<TokenLogprob>,
}

/// A sampler with reusable scratch buffers; keep one per agent (or per thread).
#[derive(Debug, Default)]
pub struct Sampler {
    /// Candidate token ids of the sampling path.
    candidates: Vec<u32>,
    /// Temperature weights, indexed by token id (valid for candidates only).
    weights: Vec<f64>,
    /// Raw logits of the tokens that penalties changed, to report raw log-probabilities.
    saved_raw: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sample the next token of one sequence.
    ///
    /// `logits` (vocab-sized) is used as scratch and left penalised. `gen_index` is the index of
    /// the token being generated (0 for the first generated token); together with
    /// `params.seed` it alone determines the random draw, so recomputing a request gives the
    /// same tokens whatever else is in the batch. NaN logits count as -inf, +inf as `f32::MAX`;
    /// when no logit is finite the distribution is uniform.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        params: &SamplingParams,
        history: &TokenHistory,
        gen_index: u64,
    ) -> Result<SampleOutput, SamplerError> {
        let vocab = logits.len();
        if vocab == 0 {
            return Err(SamplerError::EmptyLogits);
        }
        if u32::try_from(vocab).is_err() {
            return Err(SamplerError::VocabTooLarge(vocab));
        }
        let log_norm = sanitize_and_log_norm(logits);
        let top = top_n(logits, params.top_n as usize, log_norm);

        self.saved_raw.clear();
        let saved = &mut self.saved_raw;
        history::penalize(logits, params, history, |t, old| saved.push((t, old)));

        let token = match Truncation::from_params(params, vocab) {
            None => fast_argmax(logits),
            Some(t) => {
                let u = uniform_f64(params.seed, gen_index);
                draw_token(logits, &t, u, &mut self.candidates, &mut self.weights)
            }
        };
        let raw = self
            .saved_raw
            .iter()
            .find(|&&(t, _)| t == token)
            .map_or(logits[token as usize], |&(_, old)| old);
        Ok(SampleOutput {
            token: TokenLogprob {
                token,
                logprob: logprob(raw, log_norm),
            },
            top,
        })
    }
}

/// `sanitize`, then `log_sum_exp`, compiled for the widest vector unit present (the scans over
/// the vocabulary are a visible part of a decode step). Same results on every path.
fn sanitize_and_log_norm(logits: &mut [f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { sanitize_and_log_norm_avx512(logits) };
    }
    sanitize(logits);
    log_sum_exp(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sanitize_and_log_norm_avx512(logits: &mut [f32]) -> f64 {
    sanitize(logits);
    log_sum_exp(logits)
}

/// `argmax`, compiled for the widest vector unit present.
fn fast_argmax(logits: &[f32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { argmax_avx512(logits) };
    }
    argmax(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn argmax_avx512(logits: &[f32]) -> u32 {
    argmax(logits)
}

/// NaN -> -inf, +inf -> f32::MAX; if nothing is finite, make every logit 0 (uniform).
#[inline(always)]
fn sanitize(logits: &mut [f32]) {
    let mut any_finite = false;
    for x in logits.iter_mut() {
        let v = *x;
        let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
        let v = if v == f32::INFINITY { f32::MAX } else { v };
        *x = v;
        any_finite |= v != f32::NEG_INFINITY;
    }
    if !any_finite {
        logits.fill(0.0);
    }
}

/// Lanes of the vectorizable scans.
const SCAN_LANES: usize = 16;

/// log(sum(exp(logits))), max-subtracted and summed in f64. Needs NaN-free logits with a finite
/// maximum.
#[inline(always)]
fn log_sum_exp(logits: &[f32]) -> f64 {
    // Lane-wise maximum with plain comparisons (no NaN here), so it vectorizes.
    let mut lane_max = [f32::NEG_INFINITY; SCAN_LANES];
    let mut chunks = logits.chunks_exact(SCAN_LANES);
    for c in &mut chunks {
        for j in 0..SCAN_LANES {
            lane_max[j] = if c[j] > lane_max[j] {
                c[j]
            } else {
                lane_max[j]
            };
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(lane_max.iter())
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    // A polynomial exp and eight f64 partial sums.
    let mut lanes = [0f64; 8];
    let mut chunks = logits.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            lanes[j] += npu_backend_cpu::kernels::vecmath::exp_approx(c[j] - max) as f64;
        }
    }
    let mut sum: f64 = lanes.iter().sum();
    for &x in chunks.remainder() {
        sum += npu_backend_cpu::kernels::vecmath::exp_approx(x - max) as f64;
    }
    max as f64 + sum.ln()
}

fn logprob(logit: f32, log_norm: f64) -> f32 {
    (logit as f64 - log_norm) as f32
}

/// The best token, lowest id on ties (NaN-free logits). Lane-wise bests with strict comparisons
/// keep each lane's lowest id; the lanes are then merged the same way.
#[inline(always)]
fn argmax(logits: &[f32]) -> u32 {
    let mut best_v = [f32::NEG_INFINITY; SCAN_LANES];
    let mut best_i = [0u32; SCAN_LANES];
    let mut chunks = logits.chunks_exact(SCAN_LANES);
    let mut base = 0u32;
    for c in &mut chunks {
        for j in 0..SCAN_LANES {
            let better = c[j] > best_v[j];
            best_v[j] = if better { c[j] } else { best_v[j] };
            best_i[j] = if better { base + j as u32 } else { best_i[j] };
        }
        base += SCAN_LANES as u32;
    }
    let (mut v, mut i) = (f32::NEG_INFINITY, 0u32);
    let full = base as usize;
    for (&bv, &bi) in best_v.iter().zip(&best_i) {
        if bv > v || (bv == v && bi < i) {
            (v, i) = (bv, bi);
        }
    }
    for (k, &x) in chunks.remainder().iter().enumerate() {
        if x > v {
            (v, i) = (x, (full + k) as u32);
        }
    }
    // All -inf: the lowest id, like a plain scan.
    if v == f32::NEG_INFINITY {
        return 0;
    }
    i
}

/// The `n` (clamped to MAX_TOP_N) best tokens, best first, lowest id first on ties. One pass with
/// a small sorted list: most tokens fail the comparison with its last entry.
fn top_n(logits: &[f32], n: usize, log_norm: f64) -> Vec<TokenLogprob> {
    let n = n.min(MAX_TOP_N).min(logits.len());
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return Vec::new();
    }
    for (i, &x) in logits.iter().enumerate() {
        if best.len() == n && x <= best[n - 1].1 {
            continue;
        }
        // Ids arrive ascending, so an equal logit already in the list keeps its place ahead.
        let pos = best.partition_point(|&(_, y)| y >= x);
        best.insert(pos, (i as u32, x));
        best.truncate(n);
    }
    best.into_iter()
        .map(|(token, x)| TokenLogprob {
            token,
            logprob: logprob(x, log_norm),
        })
        .collect()
}

#[cfg(test)]
mod tests;

//! Sampler: turns one sequence's logits into the next token, its log-probability and the top-n
//! alternatives. Owns penalties (via `history`), greedy/temperature/top-k/top-p/min-p sampling
//! and the seeded, batch-independent random draw; scratch buffers are reused across calls.

mod history;
mod rng;
mod truncation;

pub use history::{apply_penalties, has_penalties, TokenCounts, TokenHistory};
pub use rng::{random_u64, uniform_f64};

use npu_protocol::{SamplingParams, TokenLogprob, MAX_TOP_N};
use thiserror::Error;

use npu_backend_cpu::kernels::scan::{fast_argmax, logprob, sanitize_and_log_norm};
use truncation::{draw_token, Truncation};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SamplerError {
    #[error("cannot sample from empty logits (vocabulary size 0)")]
    EmptyLogits,
    #[error("vocabulary of {0} tokens does not fit token ids in u32")]
    VocabTooLarge(usize),
    #[error("the request's token mask allows no token of the vocabulary")]
    EmptyMask,
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

/// True when `Sampler::sample` answers with the argmax of the raw logits, its raw
/// log-probability and no alternatives (greedy, no penalty, no logit bias, no top-n): exactly what a backend's
/// device pick (`argmax_rows` with `argmax_logprob_rows`) computes, so such rows need no logits
/// read back.
pub fn is_plain_greedy(params: &SamplingParams) -> bool {
    params.top_n == 0
        && params.logit_bias.is_empty()
        && Truncation::from_params(params, usize::MAX).is_none()
        && !has_penalties(params)
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
        self.sample_masked(logits, params, history, gen_index, None)
    }

    /// As `sample`, restricted to the tokens a token mask allows (bit `t % 32` of word `t / 32`;
    /// tokens past the words are not allowed): a constrained request's grammar. The mask is
    /// applied last, after penalties and logit_bias; reported log-probabilities stay the raw
    /// model's. A mask that allows no token is an error.
    pub fn sample_masked(
        &mut self,
        logits: &mut [f32],
        params: &SamplingParams,
        history: &TokenHistory,
        gen_index: u64,
        mask: Option<&[u32]>,
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
        // logit_bias after the penalties. The first saved value of a token is its raw logit.
        for &(t, bias) in &params.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                self.saved_raw.push((t, *l));
                *l += bias;
            }
        }

        if let Some(words) = mask {
            if !apply_mask(logits, words) {
                return Err(SamplerError::EmptyMask);
            }
        }
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

/// Sets the logit of every token `words` does not allow to minus infinity, 32 tokens a word
/// (whole words allowed or banned at once; a grammar's masks are mostly one or the other);
/// whether any token is allowed. The raw logits of banned tokens are not needed for the report:
/// only allowed tokens are picked.
fn apply_mask(logits: &mut [f32], words: &[u32]) -> bool {
    let mut any = false;
    for (i, chunk) in logits.chunks_mut(32).enumerate() {
        match words.get(i).copied().unwrap_or(0) {
            u32::MAX => any = true,
            0 => chunk.fill(f32::NEG_INFINITY),
            w => {
                for (b, l) in chunk.iter_mut().enumerate() {
                    if w & (1 << b) == 0 {
                        *l = f32::NEG_INFINITY;
                    } else {
                        any = true;
                    }
                }
            }
        }
    }
    any
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

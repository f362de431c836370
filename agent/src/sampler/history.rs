//! Per-slot token history (sparse counts of prompt and generated tokens) and the logit penalties
//! computed from it: CTRL-style repetition penalty over prompt+generated tokens, OpenAI-style
//! presence and frequency penalties over generated tokens. Cost is O(distinct tokens seen).

use std::collections::HashMap;

use npu_protocol::SamplingParams;

/// How often one token id occurred in a request's prompt and in its generated text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenCounts {
    pub prompt: u32,
    pub generated: u32,
}

/// The tokens a request slot has seen so far, as sparse counts (no vocab-sized storage).
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    counts: HashMap<u32, TokenCounts>,
    n_prompt: u64,
    n_generated: u64,
}

impl TokenHistory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Record prompt tokens (a whole prompt or one prefill chunk of it).
    pub fn push_prompt(&mut self, tokens: &[u32]) {
        for &t in tokens {
            let c = self.counts.entry(t).or_default();
            c.prompt = c.prompt.saturating_add(1);
        }
        self.n_prompt += tokens.len() as u64;
    }

    /// Record one generated token.
    pub fn push_generated(&mut self, token: u32) {
        let c = self.counts.entry(token).or_default();
        c.generated = c.generated.saturating_add(1);
        self.n_generated += 1;
    }

    /// Forget everything (the slot is reused for another request); keeps the allocation.
    pub fn clear(&mut self) {
        self.counts.clear();
        self.n_prompt = 0;
        self.n_generated = 0;
    }

    /// Prompt tokens recorded.
    pub fn n_prompt(&self) -> u64 {
        self.n_prompt
    }

    /// Generated tokens recorded.
    pub fn n_generated(&self) -> u64 {
        self.n_generated
    }

    /// Distinct token ids recorded.
    pub fn n_distinct(&self) -> usize {
        self.counts.len()
    }

    /// Counts of one token id (zero when never seen).
    pub fn counts(&self, token: u32) -> TokenCounts {
        self.counts.get(&token).copied().unwrap_or_default()
    }

    /// Every distinct token seen with its counts, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, TokenCounts)> + '_ {
        self.counts.iter().map(|(&t, &c)| (t, c))
    }
}

/// The penalty settings that actually change something (invalid values count as disabled).
#[derive(Debug, Clone, Copy)]
struct ActivePenalties {
    repetition: Option<f32>,
    presence: f32,
    frequency: f32,
}

/// Whether `params` change any logit (repetition, presence or frequency penalty).
pub fn has_penalties(params: &SamplingParams) -> bool {
    ActivePenalties::from_params(params).is_some()
}

impl ActivePenalties {
    fn from_params(params: &SamplingParams) -> Option<Self> {
        let rp = params.repetition_penalty;
        let repetition = (rp.is_finite() && rp > 0.0 && rp != 1.0).then_some(rp);
        let finite_or_zero = |x: f32| if x.is_finite() { x } else { 0.0 };
        let presence = finite_or_zero(params.presence_penalty);
        let frequency = finite_or_zero(params.frequency_penalty);
        if repetition.is_none() && presence == 0.0 && frequency == 0.0 {
            None
        } else {
            Some(Self {
                repetition,
                presence,
                frequency,
            })
        }
    }
}

/// Apply the penalties of `params` to `logits` in place.
///
/// - repetition (CTRL style) for every token in prompt or generated text: a positive logit is
///   divided by the penalty, a negative one multiplied by it;
/// - then presence and frequency (OpenAI style) for generated tokens:
///   `logit -= presence + frequency * count`.
///
/// A non-finite or non-positive repetition penalty and non-finite presence/frequency penalties
/// are treated as disabled. Token ids outside `logits` are ignored. Results are kept within
/// `[-inf, f32::MAX]` so later softmax arithmetic stays finite.
pub fn apply_penalties(logits: &mut [f32], params: &SamplingParams, history: &TokenHistory) {
    penalize(logits, params, history, |_, _| {});
}

/// Like [`apply_penalties`], calling `before_change(token, old_logit)` for every changed token.
pub(crate) fn penalize(
    logits: &mut [f32],
    params: &SamplingParams,
    history: &TokenHistory,
    mut before_change: impl FnMut(u32, f32),
) {
    let Some(p) = ActivePenalties::from_params(params) else {
        return;
    };
    for (token, counts) in history.iter() {
        let Some(slot) = logits.get_mut(token as usize) else {
            continue;
        };
        let old = *slot;
        let mut x = old;
        if let Some(rp) = p.repetition {
            x = if x > 0.0 { x / rp } else { x * rp };
        }
        if counts.generated > 0 {
            x -= p.presence + p.frequency * counts.generated as f32;
        }
        let x = if x.is_nan() {
            f32::NEG_INFINITY
        } else {
            x.min(f32::MAX)
        };
        if x != old {
            before_change(token, old);
            *slot = x;
        }
    }
}

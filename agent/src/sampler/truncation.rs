//! The sampling path after penalties: temperature, top-k, top-p and min-p truncation of the
//! candidate set, and the seeded draw. Uses partial selection (never a full sort of the vocab
//! unless top-p needs nearly all of it) and buffers owned by the caller for reuse.

use std::cmp::Ordering;

/// Truncation settings, already validated (see [`Truncation::from_params`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Truncation {
    /// 1 / temperature, finite and > 0.
    pub inv_temperature: f32,
    /// Keep at most this many tokens; `None` keeps all.
    pub top_k: Option<usize>,
    /// Keep the smallest most-likely set with at least this mass; `None` disables.
    pub top_p: Option<f64>,
    /// Keep tokens with probability >= min_p * top probability; `None` disables.
    pub min_p: Option<f64>,
}

impl Truncation {
    /// Settings for a sampled (non-greedy) request, or `None` when the request must be greedy
    /// (temperature too small, not finite, or <= 0).
    pub fn from_params(params: &npu_protocol::SamplingParams, vocab: usize) -> Option<Self> {
        if params.is_greedy() || !params.temperature.is_finite() {
            return None;
        }
        let inv_temperature = 1.0 / params.temperature;
        if !inv_temperature.is_finite() || inv_temperature <= 0.0 {
            return None;
        }
        let top_k = match params.top_k as usize {
            0 => None,
            k if k >= vocab => None,
            k => Some(k),
        };
        let p = params.top_p as f64;
        // NaN and p >= 1 disable; p <= 0 keeps only the most likely token (mass >= p is reached at once).
        let top_p = (p < 1.0).then_some(p.max(0.0));
        let m = params.min_p as f64;
        let min_p = (m > 0.0).then_some(m.min(1.0));
        Some(Self {
            inv_temperature,
            top_k,
            top_p,
            min_p,
        })
    }
}

/// Descending by logit, then ascending by token id (a total, deterministic order).
fn by_logit_desc(logits: &[f32]) -> impl Fn(&u32, &u32) -> Ordering + '_ {
    move |&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    }
}

/// Sort `cands[from..]` so that its first `upto - from` entries are the best of that range, in
/// order (partial selection, then a sort of the selected part only).
fn sort_prefix(cands: &mut [u32], from: usize, upto: usize, logits: &[f32]) {
    let rest = &mut cands[from..];
    let take = upto - from;
    let cmp = by_logit_desc(logits);
    if take < rest.len() {
        rest.select_nth_unstable_by(take - 1, &cmp);
    }
    rest[..take].sort_unstable_by(&cmp);
}

/// Choose one token from `logits` (already penalised and free of NaN, with at least one token)
/// under `t`, using the uniform number `u` in [0, 1).
///
/// `cands` and `weights` are scratch buffers; `weights` is indexed by token id. The candidate
/// order used for the draw is canonical (by id, or by logit then id), so the result depends only
/// on the logits, the settings and `u`.
pub(crate) fn draw_token(
    logits: &[f32],
    t: &Truncation,
    u: f64,
    cands: &mut Vec<u32>,
    weights: &mut Vec<f64>,
) -> u32 {
    let vocab = logits.len();
    cands.clear();
    cands.extend(0..vocab as u32);
    weights.resize(vocab, 0.0);

    // top-k: the k best, sorted best first.
    let mut sorted_len = 0;
    if let Some(k) = t.top_k {
        sort_prefix(cands, 0, k, logits);
        cands.truncate(k);
        sorted_len = k;
    }

    // Temperature weights relative to the best candidate: the best has weight exactly 1.
    let max_logit = if sorted_len > 0 {
        logits[cands[0] as usize]
    } else {
        logits.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    };
    let mut total = 0.0f64;
    for &c in cands.iter() {
        let w = ((logits[c as usize] - max_logit) * t.inv_temperature).exp() as f64;
        weights[c as usize] = w;
        total += w;
    }

    // top-p: the smallest best-first prefix reaching the mass; sort only as far as needed.
    if let Some(p) = t.top_p {
        let target = p * total;
        let mut cum = 0.0f64;
        let mut i = 0;
        let mut keep = None;
        while keep.is_none() && i < cands.len() {
            if i == sorted_len {
                let grow = (sorted_len.max(16) * 4).min(cands.len());
                sort_prefix(cands, sorted_len, grow, logits);
                sorted_len = grow;
            }
            cum += weights[cands[i] as usize];
            i += 1;
            if cum >= target {
                keep = Some(i);
            }
        }
        cands.truncate(keep.unwrap_or(cands.len()));
        total = cum;
    }

    // min-p: the best candidate has weight 1, so the threshold is min_p itself.
    if let Some(m) = t.min_p {
        cands.retain(|&c| weights[c as usize] >= m);
        total = cands.iter().map(|&c| weights[c as usize]).sum();
    }

    // Inverse-CDF draw over the remaining candidates in their (canonical) order.
    let target = u * total;
    let mut cum = 0.0f64;
    let mut last_positive = cands.first().copied().unwrap_or(0);
    for &c in cands.iter() {
        let w = weights[c as usize];
        if w > 0.0 {
            cum += w;
            last_positive = c;
            if cum > target {
                return c;
            }
        }
    }
    // Rounding left the target at the very top of the mass: the last token with weight wins.
    last_positive
}

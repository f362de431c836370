//! Speculative decoding with n-gram (prompt-lookup) drafts: its settings, the draft itself (the
//! tokens that followed the latest earlier occurrence of the sequence's last few tokens, in its
//! prompt or its own output), and each request's record of how many drafts its agent kept,
//! which pauses drafting for a request whose drafts keep being rejected.
//!
//! Drafting changes only how many tokens a step yields, never which: the agent samples after
//! each draft exactly as it would one step at a time and keeps a draft only when it is what it
//! sampled (see `npu_protocol::SeqStep::n_draft`).

use npu_protocol::MAX_DRAFT_TOKENS;

use super::error::SchedError;

/// Settings of n-gram speculative decoding (`npu_serving.speculative`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeculativeConfig {
    /// Most tokens drafted for one sequence in one step (1..=`MAX_DRAFT_TOKENS`).
    pub num_speculative_tokens: usize,
    /// Longest suffix of the sequence looked up in its earlier tokens.
    pub prompt_lookup_max: usize,
    /// Shortest suffix looked up (a shorter match drafts nothing).
    pub prompt_lookup_min: usize,
    /// Sequences draft only in steps where at most this many decode, whatever the measured
    /// step cost says.
    pub max_batch: usize,
    /// A request drafts the `i`-th token ahead only while its estimated chance of keeping it
    /// (its per-draft acceptance to the power `i`) is above this and above the break-even
    /// share at the step's batch size, from the measured step cost ([`StepCost`]).
    pub min_acceptance: f64,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            num_speculative_tokens: 8,
            prompt_lookup_max: 4,
            prompt_lookup_min: 2,
            max_batch: 32,
            min_acceptance: 0.3,
        }
    }
}

/// Weight, in verified draft positions, of the prior (all requests' chance that a draft is
/// kept) in one request's estimate.
const PRIOR_WEIGHT: f64 = 2.0;
/// Weight kept by a request's older evidence at each of its decode steps: without drafting,
/// its estimate drifts back to the prior, so that it tries again.
const EVIDENCE_DECAY: f64 = 0.9;
/// Weight kept by the all-requests estimate at each verified step.
const GLOBAL_DECAY: f64 = 0.99;
/// The all-requests estimate before any draft was verified.
const INITIAL_PRIOR: f64 = 0.7;

impl SpeculativeConfig {
    /// Checks every setting; the error names it (as `speculative.<key>`).
    pub fn validate(&self) -> Result<(), SchedError> {
        let bad =
            |field: &'static str, reason: String| Err(SchedError::InvalidConfig { field, reason });
        if !(1..=MAX_DRAFT_TOKENS).contains(&self.num_speculative_tokens) {
            return bad(
                "speculative.num_speculative_tokens",
                format!(
                    "is {}, must be 1..={MAX_DRAFT_TOKENS}",
                    self.num_speculative_tokens
                ),
            );
        }
        if self.prompt_lookup_min < 1 || self.prompt_lookup_min > self.prompt_lookup_max {
            return bad(
                "speculative.prompt_lookup_min",
                format!(
                    "is {}, must be at least 1 and at most prompt_lookup_max ({})",
                    self.prompt_lookup_min, self.prompt_lookup_max
                ),
            );
        }
        if self.prompt_lookup_max > 64 {
            return bad(
                "speculative.prompt_lookup_max",
                format!("is {}, must be at most 64", self.prompt_lookup_max),
            );
        }
        if self.max_batch < 1 {
            return bad("speculative.max_batch", "is 0, must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.min_acceptance) {
            return bad(
                "speculative.min_acceptance",
                format!("is {}, must be within 0..=1", self.min_acceptance),
            );
        }
        Ok(())
    }
}

/// Up to `k` tokens that followed the latest earlier occurrence of the last `n` tokens of
/// `tokens`, for the longest `n` from `max_n` down to `min_n` that occurs; empty when none does.
pub fn ngram_draft(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 || min_n == 0 {
        return Vec::new();
    }
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Latest first: an occurrence at `p` ends before the suffix starts overlapping itself
        // at the very end (p + n < len leaves at least one token to draft).
        for p in (0..len - n).rev() {
            if &tokens[p..p + n] == suffix {
                let from = p + n;
                return tokens[from..(from + k).min(len)].to_vec();
            }
        }
    }
    Vec::new()
}

/// Decode step time against the rows it computes, fitted online by least squares with older
/// steps counting less: `time = fixed + per_row * rows`. A drafted row costs `per_row` and
/// saves a whole step's share of one sequence when kept, so at `batch` decoding sequences
/// drafting pays when more than `batch * per_row / (fixed + batch * per_row)` of the drafts are
/// kept ([`StepCost::break_even`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct StepCost {
    /// Decayed sums: weight, rows, time, rows², rows × time.
    n: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    samples: u64,
}

/// Weight kept by older steps at each new one.
const COST_DECAY: f64 = 0.99;
/// Steps observed before the fit is used.
const COST_MIN_SAMPLES: u64 = 16;

impl StepCost {
    /// One decode-only step of `rows` rows that took `us` microseconds of forward pass.
    pub fn observe(&mut self, rows: usize, us: u64) {
        if rows == 0 || us == 0 {
            return;
        }
        let (x, y) = (rows as f64, us as f64);
        self.n = COST_DECAY * self.n + 1.0;
        self.sx = COST_DECAY * self.sx + x;
        self.sy = COST_DECAY * self.sy + y;
        self.sxx = COST_DECAY * self.sxx + x * x;
        self.sxy = COST_DECAY * self.sxy + x * y;
        self.samples += 1;
    }

    /// (fixed, per-row) microseconds, once enough steps of different sizes were seen and the
    /// fit is meaningful (both positive).
    pub fn fit(&self) -> Option<(f64, f64)> {
        if self.samples < COST_MIN_SAMPLES {
            return None;
        }
        let mx = self.sx / self.n;
        let my = self.sy / self.n;
        let var = self.sxx / self.n - mx * mx;
        if var < 0.25 {
            return None;
        }
        let per_row = (self.sxy / self.n - mx * my) / var;
        let fixed = my - per_row * mx;
        (per_row > 0.0 && fixed > 0.0).then_some((fixed, per_row))
    }

    /// The kept share of drafts above which drafting pays at `batch` decoding sequences; None
    /// until the fit is known.
    pub fn break_even(&self, batch: usize) -> Option<f64> {
        let (fixed, per_row) = self.fit()?;
        let rows = batch.max(1) as f64 * per_row;
        Some(rows / (fixed + rows))
    }
}

/// How often drafts were kept: one request's, or all requests' together. A verified step that
/// drafted `k` tokens and kept `j` observed `j` kept draft positions and, when `j < k`, one
/// rejected one (those after it were not looked at); the chance that a draft is kept given the
/// ones before it were is estimated as kept / observed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct DraftRecord {
    kept: f64,
    observed: f64,
}

impl DraftRecord {
    /// The all-requests record before anything was verified.
    pub fn initial_prior() -> Self {
        Self {
            kept: INITIAL_PRIOR * PRIOR_WEIGHT,
            observed: PRIOR_WEIGHT,
        }
    }

    /// The estimated chance that a draft is kept.
    pub fn rate(&self) -> f64 {
        if self.observed > 0.0 {
            self.kept / self.observed
        } else {
            INITIAL_PRIOR
        }
    }

    /// This request's estimate: its evidence, with `prior` (all requests') counting as
    /// `PRIOR_WEIGHT` observations.
    pub fn rate_with(&self, prior: f64) -> f64 {
        (self.kept + PRIOR_WEIGHT * prior) / (self.observed + PRIOR_WEIGHT)
    }

    /// Adds a step that drafted `drafted` tokens and kept `kept`, older evidence weighing
    /// `decay`.
    fn add(&mut self, drafted: usize, kept: usize, decay: f64) {
        self.kept = decay * self.kept + kept as f64;
        self.observed = decay * self.observed + kept as f64 + f64::from(u8::from(kept < drafted));
    }

    /// A request's verified step.
    pub fn record(&mut self, drafted: usize, kept: usize) {
        self.add(drafted, kept, EVIDENCE_DECAY);
    }

    /// The all-requests record of a verified step.
    pub fn record_global(&mut self, drafted: usize, kept: usize) {
        self.add(drafted, kept, GLOBAL_DECAY);
    }

    /// A request's decode step without drafts: its evidence fades toward the prior.
    pub fn idle(&mut self) {
        self.add(0, 0, EVIDENCE_DECAY);
    }

    /// How many tokens to draft at most (up to `max`): while the chance of keeping the next
    /// one, `rate^i`, is above `threshold`.
    pub fn draft_len(&self, prior: f64, threshold: f64, max: usize) -> usize {
        let rate = self.rate_with(prior);
        let mut chance = rate;
        let mut k = 0;
        while k < max && chance > threshold {
            k += 1;
            chance *= rate;
        }
        k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_latest_match_drafts_what_followed_it() {
        // "1 2 3" occurs twice before the end; the latest is followed by 9 8.
        let t = [1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 7, 1, 2, 3];
        assert_eq!(ngram_draft(&t, 2, 4, 2), vec![9, 8]);
        assert_eq!(ngram_draft(&t, 2, 4, 8), vec![9, 8, 7, 1, 2, 3]);
        // A 4-gram "7 1 2 3" never occurred before: the 3-gram decides.
        assert_eq!(ngram_draft(&t, 4, 4, 3), Vec::<u32>::new());
        // Nothing repeats: no draft.
        assert!(ngram_draft(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        // A run of one token drafts more of it (the match may overlap the suffix).
        assert_eq!(ngram_draft(&[5, 7, 7, 7], 2, 2, 3), vec![7]);
        assert!(ngram_draft(&[], 1, 3, 4).is_empty());
        assert!(ngram_draft(&[1], 1, 3, 4).is_empty());
        assert!(ngram_draft(&t, 2, 4, 0).is_empty());
    }

    #[test]
    fn drafts_get_longer_while_kept_shorter_while_rejected_and_return_after_a_rest() {
        let prior = 0.7;
        let mut r = DraftRecord::default();
        // Nothing seen: the prior alone; 0.7^3 = 0.343 > 0.3, 0.7^4 = 0.24 is not.
        assert_eq!(r.draft_len(prior, 0.3, 8), 3);
        assert_eq!(r.draft_len(prior, 0.3, 2), 2);
        // Every draft kept: up to the most allowed.
        for _ in 0..4 {
            r.record(3, 3);
        }
        assert!(r.rate_with(prior) > 0.9);
        assert_eq!(r.draft_len(prior, 0.3, 8), 8);
        // A higher threshold (a large batch) asks more of the same record.
        assert!(r.draft_len(prior, 0.9, 8) < 8);
        // Rejected at once, step after step: shorter drafts, then none.
        let mut last = 8;
        let mut steps = 0;
        while r.draft_len(prior, 0.3, 8) > 0 {
            let k = r.draft_len(prior, 0.3, 8);
            assert!(k <= last, "drafts grew from {last} to {k} while rejected");
            last = k;
            r.record(k, 0);
            steps += 1;
            assert!(steps < 30, "still drafting after {steps} rejected steps");
        }
        // Steps without drafts let the estimate drift back to the prior: it tries again.
        let mut steps = 0;
        while r.draft_len(prior, 0.3, 8) == 0 {
            r.idle();
            steps += 1;
            assert!(steps < 100, "never tries again");
        }
        // Where all requests' drafts are mostly rejected and the batch is large (a high
        // threshold), resting does not bring drafting back.
        for _ in 0..100 {
            r.idle();
        }
        assert_eq!(r.draft_len(0.5, 0.8, 8), 0);
        // The all-requests record: kept over observed positions.
        let mut g = DraftRecord::initial_prior();
        assert!((g.rate() - INITIAL_PRIOR).abs() < 1e-12);
        for _ in 0..2000 {
            g.record_global(4, 1);
        }
        // One kept and one rejected position per step.
        assert!((g.rate() - 0.5).abs() < 1e-3, "{}", g.rate());
    }

    #[test]
    fn the_step_cost_fit_finds_fixed_and_per_row_time_and_the_break_even_share() {
        let mut c = StepCost::default();
        // 6 ms fixed, 2 ms a row; too few steps first, then steps of one size only.
        for _ in 0..COST_MIN_SAMPLES {
            c.observe(4, 14_000);
        }
        assert_eq!(c.fit(), None, "one size: no slope");
        for i in 0..40 {
            let rows = 1 + i % 9;
            c.observe(rows, 6_000 + 2_000 * rows as u64);
        }
        let (fixed, per_row) = c.fit().unwrap();
        assert!((fixed - 6_000.0).abs() < 1.0 && (per_row - 2_000.0).abs() < 0.1);
        // One sequence: 2 / (6 + 2) of the drafts must be kept; eight: 16 / 22.
        assert!((c.break_even(1).unwrap() - 0.25).abs() < 1e-6);
        assert!((c.break_even(8).unwrap() - 16.0 / 22.0).abs() < 1e-6);
        // Time that does not grow with rows gives no fit (drafting is free or the data noise).
        let mut flat = StepCost::default();
        for i in 0..40 {
            flat.observe(1 + i % 5, 10_000 - 10 * i as u64);
        }
        assert_eq!(flat.break_even(1), None);
    }

    #[test]
    fn settings_out_of_range_name_their_key() {
        for (cfg, key) in [
            (
                SpeculativeConfig {
                    num_speculative_tokens: 0,
                    ..Default::default()
                },
                "num_speculative_tokens",
            ),
            (
                SpeculativeConfig {
                    num_speculative_tokens: MAX_DRAFT_TOKENS + 1,
                    ..Default::default()
                },
                "num_speculative_tokens",
            ),
            (
                SpeculativeConfig {
                    prompt_lookup_min: 5,
                    prompt_lookup_max: 4,
                    ..Default::default()
                },
                "prompt_lookup_min",
            ),
            (
                SpeculativeConfig {
                    max_batch: 0,
                    ..Default::default()
                },
                "max_batch",
            ),
            (
                SpeculativeConfig {
                    min_acceptance: 1.5,
                    ..Default::default()
                },
                "min_acceptance",
            ),
        ] {
            let e = cfg.validate().expect_err(key).to_string();
            assert!(e.contains(key), "{e}");
        }
        SpeculativeConfig::default().validate().unwrap();
    }
}

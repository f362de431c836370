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
    /// Sequences draft only in steps where at most this many decode: past it, verifying drafts
    /// costs the batch more than the kept ones save.
    pub max_batch: usize,
    /// A request whose kept share of drafted tokens (a moving average over its steps) falls
    /// below this stops drafting for a while (`PAUSE_TOKENS`, doubling each time).
    pub min_acceptance: f64,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            num_speculative_tokens: 8,
            prompt_lookup_max: 4,
            prompt_lookup_min: 2,
            max_batch: 4,
            min_acceptance: 0.3,
        }
    }
}

/// Generated tokens a request goes without drafting after its first pause (then twice as many,
/// up to `MAX_PAUSE_TOKENS`).
pub const PAUSE_TOKENS: usize = 16;
const MAX_PAUSE_TOKENS: usize = 1024;
/// Weight of the newest step in a request's moving acceptance average.
const ACCEPTANCE_WEIGHT: f64 = 0.3;

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

/// One request's drafting record.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct DraftRecord {
    /// Moving average of the share of drafted tokens the agent kept.
    acceptance: f64,
    /// No drafts until the request has generated this many tokens.
    paused_until: usize,
    /// Pauses so far (each twice as long as the one before).
    pauses: u32,
}

impl Default for DraftRecord {
    fn default() -> Self {
        Self {
            acceptance: 1.0,
            paused_until: 0,
            pauses: 0,
        }
    }
}

impl DraftRecord {
    /// Whether the request drafts now, having generated `generated` tokens.
    pub fn active(&self, generated: usize) -> bool {
        generated >= self.paused_until
    }

    /// Records a step that verified `drafted` tokens and kept `kept`; pauses drafting when the
    /// average falls below `min_acceptance` (the average starts afresh after the pause).
    pub fn record(&mut self, drafted: usize, kept: usize, generated: usize, min_acceptance: f64) {
        if drafted == 0 {
            return;
        }
        let share = kept as f64 / drafted as f64;
        self.acceptance = (1.0 - ACCEPTANCE_WEIGHT) * self.acceptance + ACCEPTANCE_WEIGHT * share;
        if self.acceptance < min_acceptance {
            let pause = (PAUSE_TOKENS << self.pauses.min(16)).min(MAX_PAUSE_TOKENS);
            self.paused_until = generated + pause;
            self.pauses += 1;
            self.acceptance = 1.0;
        }
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
    fn a_request_whose_drafts_are_rejected_pauses_longer_each_time() {
        let mut r = DraftRecord::default();
        assert!(r.active(0));
        r.record(8, 8, 9, 0.3);
        assert!(r.active(9));
        // Three rejected steps bring 1.0 down to 0.343, the fourth below 0.3.
        for g in 10..13 {
            r.record(8, 0, g, 0.3);
            assert!(r.active(g), "{g}");
        }
        r.record(8, 0, 13, 0.3);
        assert!(!r.active(13));
        assert!(!r.active(13 + PAUSE_TOKENS - 1));
        assert!(r.active(13 + PAUSE_TOKENS));
        for g in 40..44 {
            r.record(4, 0, g, 0.3);
        }
        assert!(!r.active(43 + 2 * PAUSE_TOKENS - 1));
        assert!(r.active(43 + 2 * PAUSE_TOKENS));
        // Nothing drafted records nothing.
        let before = r;
        r.record(0, 0, 100, 0.3);
        assert_eq!(r, before);
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

//! Per-request records and the metric arithmetic of a run: percentiles, TTFT, TPOT, ITL, E2E,
//! throughputs and goodput.
//!
//! Definitions (all times measured on the client with `Instant`):
//! - send time: just before the request's TCP connection is opened.
//! - TTFT (time to first token) = arrival of the first chunk carrying non-empty generated text
//!   − send time.
//! - E2E (end-to-end latency) = arrival of the response's last byte − send time.
//! - TPOT (time per output token) = (E2E − TTFT) / (output_tokens − 1), only for requests with
//!   more than one output token.
//! - ITL (inter-token latency) = the gaps between arrivals of consecutive non-empty chunks of one
//!   request; the distribution pools the gaps of all completed requests.
//! - output_tokens = token count of the full response text with the model's tokenizer.
//! - request throughput = completed / duration; output throughput = Σ output_tokens / duration;
//!   total token throughput = Σ (prompt_tokens + output_tokens) / duration, over completed
//!   requests; duration = first send to last completion ("Exec Time").
//! - goodput = completed requests that meet every given SLO (TTFT ≤ --slo-ttft-ms,
//!   TPOT ≤ --slo-tpot-ms; a one-token request has no TPOT and meets the TPOT SLO) / duration.
//!   With no SLO given every completed request counts.
//! - Percentiles: linear interpolation between closest ranks (numpy's default): for sorted
//!   values v[0..n], the p-th percentile is at rank r = p/100·(n−1), value
//!   v[⌊r⌋] + (r − ⌊r⌋)·(v[⌊r⌋+1] − v[⌊r⌋]). The median is the 50th percentile.
//! - std is the population standard deviation (divide by n).

use std::collections::BTreeMap;

use serde::Serialize;

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Position in the run (0-based, in send order).
    pub index: usize,
    pub prompt: String,
    pub prompt_tokens: usize,
    pub max_new_tokens: usize,
    /// When the request was sent, seconds after the run started.
    pub send_offset_s: f64,
    pub success: bool,
    /// Why the request failed (None when it succeeded).
    pub error: Option<String>,
    /// The generated text (the server's full text when it sends one).
    pub resp_text: String,
    /// Token count of `resp_text` with the model's tokenizer.
    pub output_tokens: usize,
    /// Time to first token, seconds (None if no text arrived).
    pub ttft_s: Option<f64>,
    /// Send to last byte, seconds.
    pub e2e_s: f64,
    /// Arrival of every non-empty text chunk, seconds after send.
    pub chunk_times_s: Vec<f64>,
    /// Token counts the server reported, if it did (OpenAI usage).
    pub server_completion_tokens: Option<u64>,
}

impl RequestRecord {
    /// TPOT in seconds, for successful requests with more than one output token.
    pub fn tpot_s(&self) -> Option<f64> {
        match self.ttft_s {
            Some(ttft) if self.success && self.output_tokens > 1 => {
                Some((self.e2e_s - ttft) / (self.output_tokens - 1) as f64)
            }
            _ => None,
        }
    }
}

/// Gaps between consecutive chunk arrival times.
pub fn itl_gaps(chunk_times: &[f64]) -> Vec<f64> {
    chunk_times.windows(2).map(|w| w[1] - w[0]).collect()
}

/// The p-th percentile (0..=100) of ascending `sorted` values by linear interpolation between
/// closest ranks. NaN for an empty slice.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let rank = (p.clamp(0.0, 100.0) / 100.0) * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = (lo + 1).min(n - 1);
            let frac = rank - lo as f64;
            sorted[lo] + frac * (sorted[hi] - sorted[lo])
        }
    }
}

/// Summary statistics of one latency, in the unit of the input values.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    pub count: usize,
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    pub p90: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
}

/// Statistics of `values` (None when empty).
pub fn stats(values: &[f64]) -> Option<Stats> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    Some(Stats {
        count: v.len(),
        mean,
        median: percentile(&v, 50.0),
        std: var.sqrt(),
        p90: percentile(&v, 90.0),
        p99: percentile(&v, 99.0),
        min: v[0],
        max: v[v.len() - 1],
    })
}

/// Service-level objectives for goodput.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

impl Slo {
    /// Whether a completed request meets every given objective.
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        if !r.success {
            return false;
        }
        let ttft_ok = match (self.ttft_ms, r.ttft_s) {
            (None, _) => true,
            (Some(limit), Some(t)) => t * 1e3 <= limit,
            (Some(_), None) => false,
        };
        let tpot_ok = match (self.tpot_ms, r.tpot_s()) {
            (Some(limit), Some(t)) => t * 1e3 <= limit,
            _ => true,
        };
        ttft_ok && tpot_ok
    }
}

/// The measured outcome of one run at one rate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Target request rate X.
    pub qps: f64,
    pub num_requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// Failure reasons and how often each occurred.
    pub failure_reasons: BTreeMap<String, usize>,
    /// First send to last completion, seconds.
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens per second.
    pub output_throughput: f64,
    /// Prompt + output tokens per second.
    pub total_token_throughput: f64,
    pub ttft_ms: Option<Stats>,
    pub tpot_ms: Option<Stats>,
    pub itl_ms: Option<Stats>,
    pub e2e_ms: Option<Stats>,
    pub slo_ttft_ms: Option<f64>,
    pub slo_tpot_ms: Option<f64>,
    /// Completed requests meeting every SLO.
    pub good_requests: usize,
    /// good_requests per second.
    pub goodput: f64,
}

/// Computes a run's summary from its records.
pub fn summarize(records: &[RequestRecord], duration_s: f64, qps: f64, slo: Slo) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
    let mut failure_reasons = BTreeMap::new();
    for r in records.iter().filter(|r| !r.success) {
        let reason = r.error.as_deref().unwrap_or("unknown");
        *failure_reasons
            .entry(crate::api::clip(reason, 160).to_string())
            .or_insert(0) += 1;
    }
    let ms = |xs: Vec<f64>| stats(&xs.into_iter().map(|x| x * 1e3).collect::<Vec<_>>());
    let ttft = ms(ok.iter().filter_map(|r| r.ttft_s).collect());
    let tpot = ms(ok.iter().filter_map(|r| r.tpot_s()).collect());
    let itl = ms(ok.iter().flat_map(|r| itl_gaps(&r.chunk_times_s)).collect());
    let e2e = ms(ok.iter().map(|r| r.e2e_s).collect());
    let total_input_tokens: usize = ok.iter().map(|r| r.prompt_tokens).sum();
    let total_output_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
    let good_requests = ok.iter().filter(|r| slo.met_by(r)).count();
    let per_s = |x: f64| {
        if duration_s > 0.0 {
            x / duration_s
        } else {
            0.0
        }
    };
    Summary {
        qps,
        num_requests: records.len(),
        completed: ok.len(),
        failed: records.len() - ok.len(),
        failure_reasons,
        duration_s,
        total_input_tokens,
        total_output_tokens,
        request_throughput: per_s(ok.len() as f64),
        output_throughput: per_s(total_output_tokens as f64),
        total_token_throughput: per_s((total_input_tokens + total_output_tokens) as f64),
        ttft_ms: ttft,
        tpot_ms: tpot,
        itl_ms: itl,
        e2e_ms: e2e,
        slo_ttft_ms: slo.ttft_ms,
        slo_tpot_ms: slo.tpot_ms,
        good_requests,
        goodput: per_s(good_requests as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    fn rec(ttft: f64, e2e: f64, out: usize, chunks: &[f64]) -> RequestRecord {
        RequestRecord {
            index: 0,
            prompt: "p".into(),
            prompt_tokens: 10,
            max_new_tokens: out,
            send_offset_s: 0.0,
            success: true,
            error: None,
            resp_text: "x".into(),
            output_tokens: out,
            ttft_s: Some(ttft),
            e2e_s: e2e,
            chunk_times_s: chunks.to_vec(),
            server_completion_tokens: None,
        }
    }

    #[test]
    fn percentile_linear_interpolation_by_hand() {
        let v = [1.0, 2.0, 3.0, 4.0, 10.0];
        // rank = p/100 * 4
        assert!(close(percentile(&v, 50.0), 3.0));
        assert!(close(percentile(&v, 90.0), 7.6)); // rank 3.6: 4 + 0.6*6
        assert!(close(percentile(&v, 99.0), 9.76)); // rank 3.96: 4 + 0.96*6
        assert!(close(percentile(&v, 25.0), 2.0));
        assert!(close(percentile(&v, 0.0), 1.0));
        assert!(close(percentile(&v, 100.0), 10.0));
        assert!(close(percentile(&[5.0], 99.0), 5.0));
        assert!(percentile(&[], 50.0).is_nan());
        // Even count: the median is the mean of the middle two.
        assert!(close(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.5));
    }

    #[test]
    fn stats_by_hand() {
        let s = stats(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!(s.count, 4);
        assert!(close(s.mean, 2.5));
        assert!(close(s.median, 2.5));
        // population variance = (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
        assert!(close(s.std, 1.25f64.sqrt()));
        assert!(close(s.p90, 3.7)); // rank 2.7: 3 + 0.7
        assert!(close(s.p99, 3.97)); // rank 2.97
        assert!(close(s.min, 1.0) && close(s.max, 4.0));
        assert!(stats(&[]).is_none());
    }

    #[test]
    fn itl_from_chunk_timestamps() {
        let gaps = itl_gaps(&[0.10, 0.15, 0.30, 0.31]);
        let want = [0.05, 0.15, 0.01];
        assert_eq!(gaps.len(), 3);
        for (g, w) in gaps.iter().zip(want) {
            assert!(close(*g, w), "{g} vs {w}");
        }
        assert!(itl_gaps(&[0.2]).is_empty());
    }

    #[test]
    fn tpot_by_hand() {
        // 5 tokens, first after 0.2 s, last byte at 1.0 s: (1.0 - 0.2) / 4 = 0.2 s.
        assert!(close(rec(0.2, 1.0, 5, &[]).tpot_s().unwrap(), 0.2));
        assert_eq!(rec(0.2, 1.0, 1, &[]).tpot_s(), None);
        let mut failed = rec(0.2, 1.0, 5, &[]);
        failed.success = false;
        assert_eq!(failed.tpot_s(), None);
    }

    #[test]
    fn goodput_counts_requests_meeting_every_slo() {
        let records = vec![
            rec(0.1, 0.5, 5, &[0.1, 0.2, 0.3, 0.4, 0.5]), // ttft 100 ms, tpot 100 ms
            rec(0.3, 0.7, 5, &[0.3, 0.4, 0.5, 0.6, 0.7]), // ttft 300 ms, tpot 100 ms
            rec(0.1, 1.3, 5, &[0.1, 0.4, 0.7, 1.0, 1.3]), // ttft 100 ms, tpot 300 ms
            rec(0.1, 0.1, 1, &[0.1]),                     // one token: no TPOT
        ];
        let slo = Slo {
            ttft_ms: Some(200.0),
            tpot_ms: Some(150.0),
        };
        let s = summarize(&records, 2.0, 2.0, slo);
        assert_eq!(s.good_requests, 2); // the first and the one-token request
        assert!(close(s.goodput, 1.0));
        let only_ttft = summarize(
            &records,
            2.0,
            2.0,
            Slo {
                ttft_ms: Some(200.0),
                tpot_ms: None,
            },
        );
        assert_eq!(only_ttft.good_requests, 3);
        let none = summarize(&records, 2.0, 2.0, Slo::default());
        assert_eq!(none.good_requests, 4);
        assert!(close(none.goodput, none.request_throughput));
    }

    #[test]
    fn summary_by_hand() {
        let mut failed = rec(0.0, 0.05, 0, &[]);
        failed.success = false;
        failed.ttft_s = None;
        failed.error = Some("HTTP 503: busy".into());
        let records = vec![
            rec(0.1, 0.4, 4, &[0.1, 0.2, 0.3, 0.4]),
            rec(0.2, 0.8, 3, &[0.2, 0.5, 0.8]),
            failed,
        ];
        let s = summarize(&records, 2.0, 1.5, Slo::default());
        assert_eq!((s.num_requests, s.completed, s.failed), (3, 2, 1));
        assert_eq!(s.failure_reasons.get("HTTP 503: busy"), Some(&1));
        assert_eq!(s.total_input_tokens, 20);
        assert_eq!(s.total_output_tokens, 7);
        assert!(close(s.request_throughput, 1.0));
        assert!(close(s.output_throughput, 3.5));
        assert!(close(s.total_token_throughput, 13.5));
        let ttft = s.ttft_ms.unwrap();
        assert!(close(ttft.mean, 150.0) && close(ttft.median, 150.0));
        // TPOT: (0.4-0.1)/3 = 0.1 s, (0.8-0.2)/2 = 0.3 s.
        let tpot = s.tpot_ms.unwrap();
        assert!(close(tpot.mean, 200.0));
        assert!(close(tpot.std, 100.0));
        // ITL pooled: 100, 100, 100, 300, 300 ms.
        let itl = s.itl_ms.unwrap();
        assert_eq!(itl.count, 5);
        assert!(close(itl.mean, 180.0));
        assert!(close(itl.median, 100.0));
        assert!(close(itl.p90, 300.0));
        let e2e = s.e2e_ms.unwrap();
        assert!(close(e2e.mean, 600.0));
    }
}

//! Prometheus metrics: latency histograms measured in the HTTP layer (time to first token,
//! inter-token latency, end-to-end) and by the engine (step time), lock-free counters, and the
//! hand-written text exposition of `/metrics` (with the engine's live counters).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::engine::EngineStats;

/// Upper bounds (seconds) of latency buckets: 1 ms .. 120 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 20.0, 30.0, 60.0, 120.0,
];

/// A fixed-bucket histogram that any thread can observe into without locks.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (not cumulative) counts; the last one is +Inf.
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self.bounds.partition_point(|&b| b < secs);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    pub fn sum(&self) -> Duration {
        Duration::from_nanos(self.sum_ns.load(Ordering::Relaxed))
    }

    pub(crate) fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c.load(Ordering::Relaxed);
            match self.bounds.get(i) {
                Some(b) => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
                }
                None => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
                }
            }
        }
        let _ = writeln!(out, "{name}_sum {}", self.sum().as_secs_f64());
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}

/// Everything the server measures itself; shared (`Arc`) by the HTTP loop, the API handlers
/// and the engine (which observes `step_time`).
#[derive(Debug)]
pub struct Metrics {
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_latency: Histogram,
    /// One engine step (plan sent to result received); the engine observes into it.
    pub step_time: Histogram,
    pub http_requests_total: AtomicU64,
    pub http_responses_2xx: AtomicU64,
    pub http_responses_4xx: AtomicU64,
    pub http_responses_5xx: AtomicU64,
    /// Generation requests refused with 429 because the queue was full.
    pub rejected_queue_full_total: AtomicU64,
    /// Requests aborted because their client went away.
    pub client_aborts_total: AtomicU64,
    /// Generation requests the HTTP side has submitted and not yet seen finish.
    pub inflight: AtomicU64,
    pub connections_open: AtomicU64,
    /// Each wake from sleep (every agent awake again); the engine observes into it.
    pub wake_duration: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            time_to_first_token: Histogram::new(LATENCY_BUCKETS),
            inter_token_latency: Histogram::new(LATENCY_BUCKETS),
            e2e_latency: Histogram::new(LATENCY_BUCKETS),
            step_time: Histogram::new(LATENCY_BUCKETS),
            http_requests_total: AtomicU64::new(0),
            http_responses_2xx: AtomicU64::new(0),
            http_responses_4xx: AtomicU64::new(0),
            http_responses_5xx: AtomicU64::new(0),
            rejected_queue_full_total: AtomicU64::new(0),
            client_aborts_total: AtomicU64::new(0),
            inflight: AtomicU64::new(0),
            connections_open: AtomicU64::new(0),
            wake_duration: Histogram::new(LATENCY_BUCKETS),
        }
    }
}

/// vLLM's names for the gauges an llm-d endpoint picker reads in its default configuration
/// (`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, 0..1),
/// labelled `model_name` as vLLM labels them, appended beside ours.
pub fn render_vllm_aliases(out: &mut String, stats: &EngineStats, model_name: &str) {
    let g = EngineStats::get;
    let used = g(&stats.kv_blocks_used) as f64;
    let total = g(&stats.kv_blocks_total) as f64;
    let usage = if total > 0.0 { used / total } else { 0.0 };
    let label = model_name
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    for (name, help, value) in [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches (alias of npu_serving_requests_running).",
            g(&stats.running) as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed (alias of npu_serving_requests_waiting).",
            g(&stats.waiting) as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 1 means 100 percent (alias of npu_serving_kv_cache_usage_perc).",
            usage,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{model_name=\"{label}\"}} {value:?}"
        );
    }
}

impl Metrics {
    /// Counts a response by its status class.
    pub fn count_response(&self, status: u16) {
        let c = match status {
            200..=299 => &self.http_responses_2xx,
            400..=499 => &self.http_responses_4xx,
            500..=599 => &self.http_responses_5xx,
            _ => return,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self, stats: &EngineStats) -> String {
        let g = EngineStats::get;
        let mut out = String::with_capacity(8 * 1024);
        // The share of KV blocks in use, 0..1 (what a Kubernetes inference gateway's endpoint
        // picker reads as KV cache utilization).
        let used = g(&stats.kv_blocks_used) as f64;
        let total = g(&stats.kv_blocks_total) as f64;
        let usage = if total > 0.0 { used / total } else { 0.0 };
        let _ = writeln!(
            out,
            "# HELP npu_serving_kv_cache_usage_perc Fraction of KV cache blocks in use (0 to 1).\n\
             # TYPE npu_serving_kv_cache_usage_perc gauge\nnpu_serving_kv_cache_usage_perc {usage}"
        );
        let gauges: [(&str, &str, u64); 12] = [
            (
                "npu_serving_requests_running",
                "Requests being prefilled or decoded.",
                g(&stats.running),
            ),
            (
                "npu_serving_requests_waiting",
                "Requests waiting to be admitted.",
                g(&stats.waiting),
            ),
            (
                "npu_serving_requests_inflight",
                "Generation requests the HTTP side is serving.",
                self.inflight.load(Ordering::Relaxed),
            ),
            (
                "npu_serving_kv_blocks_used",
                "KV cache blocks in use (all agents).",
                g(&stats.kv_blocks_used),
            ),
            (
                "npu_serving_kv_blocks_total",
                "KV cache blocks in total (all agents).",
                g(&stats.kv_blocks_total),
            ),
            (
                "npu_serving_agents_up",
                "Agents that are up.",
                g(&stats.agents_up),
            ),
            (
                "npu_serving_agents_total",
                "Agents configured.",
                g(&stats.agents_total),
            ),
            (
                "npu_serving_groups_up",
                "Model replicas up: tensor-parallel groups with every rank up (agents without \
                 tensor parallelism).",
                g(&stats.groups_up),
            ),
            (
                "npu_serving_groups_total",
                "Model replicas configured: agents / npu_serving.tensor_parallel_size.",
                g(&stats.groups_total),
            ),
            (
                "npu_serving_ready",
                "1 when every agent is up and serving.",
                u64::from(stats.ready.load(Ordering::Relaxed)),
            ),
            (
                "npu_serving_draining",
                "1 while the server shuts down (running requests finish, new ones are refused).",
                u64::from(stats.draining.load(Ordering::Relaxed)),
            ),
            (
                "npu_serving_http_connections_open",
                "Open HTTP connections.",
                self.connections_open.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let counters: [(&str, &str, u64); 15] = [
            (
                "npu_serving_prompt_tokens_total",
                "Prompt tokens processed.",
                g(&stats.prompt_tokens_total),
            ),
            (
                "npu_serving_generation_tokens_total",
                "Tokens generated.",
                g(&stats.generated_tokens_total),
            ),
            (
                "npu_serving_requests_finished_total",
                "Requests finished by the engine.",
                g(&stats.requests_finished_total),
            ),
            (
                "npu_serving_preemptions_total",
                "Sequences preempted for lack of KV blocks.",
                g(&stats.preemptions_total),
            ),
            (
                "npu_serving_prefix_cache_queries_total",
                "Tokens of admitted requests looked up in the prefix cache.",
                g(&stats.prefix_cache_queried_tokens_total),
            ),
            (
                "npu_serving_prefix_cache_hits_total",
                "Tokens found in the prefix cache (their KV was reused, not computed).",
                g(&stats.prefix_cache_hit_tokens_total),
            ),
            (
                "npu_serving_spec_decode_num_draft_tokens_total",
                "Speculative decoding: tokens drafted (n-gram lookup) and verified by the agents.",
                g(&stats.spec_draft_tokens_total),
            ),
            (
                "npu_serving_spec_decode_num_accepted_tokens_total",
                "Speculative decoding: drafted tokens the agents kept (each saved a decode step).",
                g(&stats.spec_accepted_tokens_total),
            ),
            (
                "npu_serving_agent_restarts_total",
                "Agents restarted after a crash or hang.",
                g(&stats.agent_restarts_total),
            ),
            (
                "npu_serving_steps_total",
                "Engine steps run.",
                g(&stats.steps_total),
            ),
            (
                "npu_serving_http_requests_total",
                "HTTP requests received.",
                r(&self.http_requests_total),
            ),
            (
                "npu_serving_http_responses_4xx_total",
                "HTTP responses with a 4xx status.",
                r(&self.http_responses_4xx),
            ),
            (
                "npu_serving_http_responses_5xx_total",
                "HTTP responses with a 5xx status.",
                r(&self.http_responses_5xx),
            ),
            (
                "npu_serving_rejected_queue_full_total",
                "Requests refused with 429 (queue full).",
                r(&self.rejected_queue_full_total),
            ),
            (
                "npu_serving_client_aborts_total",
                "Requests aborted because the client went away.",
                r(&self.client_aborts_total),
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP npu_serving_http_responses_2xx_total HTTP responses with a 2xx status.\n# TYPE npu_serving_http_responses_2xx_total counter\nnpu_serving_http_responses_2xx_total {}",
            r(&self.http_responses_2xx)
        );
        crate::metrics_kv::render(&mut out, stats);
        crate::metrics_pd::render(&mut out, stats);
        crate::metrics_sleep::render(&mut out, stats, self);
        self.time_to_first_token.render(
            &mut out,
            "npu_serving_time_to_first_token_seconds",
            "From request arrival to its first generated token.",
        );
        self.inter_token_latency.render(
            &mut out,
            "npu_serving_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
        );
        self.e2e_latency.render(
            &mut out,
            "npu_serving_e2e_request_latency_seconds",
            "From request arrival to its last event.",
        );
        self.step_time.render(
            &mut out,
            "npu_serving_step_time_seconds",
            "One engine step, plan sent to result received.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_sum_counts() {
        let h = Histogram::new(&[0.01, 0.1, 1.0]);
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_secs(3));
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"0.01\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"0.1\"} 3\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"1\"} 3\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 4\n"), "{s}");
        assert!(s.contains("x_count 4\n"), "{s}");
        assert!(s.contains("x_sum 3.105\n"), "{s}");
    }

    #[test]
    fn exposition_has_engine_counters_and_types() {
        let m = Metrics::default();
        let stats = EngineStats::default();
        EngineStats::set(&stats.kv_blocks_total, 2048);
        EngineStats::add(&stats.preemptions_total, 3);
        m.step_time.observe(Duration::from_millis(20));
        let text = m.render(&stats);
        assert!(text.contains(
            "# TYPE npu_serving_kv_blocks_total gauge\nnpu_serving_kv_blocks_total 2048\n"
        ));
        assert!(text.contains("npu_serving_preemptions_total 3\n"));
        // 0..1 share of blocks in use, for gateways.
        EngineStats::set(&stats.kv_blocks_used, 512);
        EngineStats::add(&stats.prefix_cache_queried_tokens_total, 100);
        EngineStats::add(&stats.prefix_cache_hit_tokens_total, 64);
        EngineStats::add(&stats.spec_draft_tokens_total, 40);
        EngineStats::add(&stats.spec_accepted_tokens_total, 25);
        let text = m.render(&stats);
        assert!(
            text.contains("npu_serving_kv_cache_usage_perc 0.25\n"),
            "{text}"
        );
        assert!(text.contains("npu_serving_prefix_cache_queries_total 100\n"));
        assert!(text.contains("npu_serving_prefix_cache_hits_total 64\n"));
        assert!(text.contains("npu_serving_spec_decode_num_draft_tokens_total 40\n"));
        assert!(text.contains("npu_serving_spec_decode_num_accepted_tokens_total 25\n"));
        assert!(text.contains("npu_serving_step_time_seconds_count 1\n"));
        EngineStats::add(&stats.kv.preemptions_swap_total, 2);
        EngineStats::add(&stats.kv.prefix_hit_tokens_host_total, 16);
        EngineStats::add(&stats.kv.swap_in_bytes_total, 4096);
        let text = m.render(&stats);
        for want in [
            "npu_serving_preemptions_by_kind_total{kind=\"swap\"} 2\n",
            "npu_serving_preemptions_by_kind_total{kind=\"recompute\"} 1\n",
            "npu_serving_prefix_cache_hit_tokens_total{tier=\"device\"} 48\n",
            "npu_serving_prefix_cache_hit_tokens_total{tier=\"host\"} 16\n",
            "npu_serving_kv_swap_in_bytes_total 4096\n",
        ] {
            assert!(text.contains(want), "{want} in {text}");
        }
        // Every sample line belongs to a declared metric family.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = name
                .trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count");
            assert!(
                text.contains(&format!("# TYPE {family} "))
                    || text.contains(&format!("# TYPE {name} ")),
                "{line}"
            );
        }
    }

    #[test]
    fn vllm_aliases_carry_the_model_name() {
        let stats = EngineStats::default();
        stats.running.store(3, Ordering::Relaxed);
        stats.waiting.store(2, Ordering::Relaxed);
        stats.kv_blocks_used.store(1, Ordering::Relaxed);
        stats.kv_blocks_total.store(4, Ordering::Relaxed);
        let mut text = String::new();
        render_vllm_aliases(&mut text, &stats, "org/m\"1");
        assert!(
            text.contains("vllm:num_requests_running{model_name=\"org/m\\\"1\"} 3.0\n"),
            "{text}"
        );
        assert!(
            text.contains("vllm:num_requests_waiting{model_name=\"org/m\\\"1\"} 2.0\n"),
            "{text}"
        );
        assert!(
            text.contains("vllm:kv_cache_usage_perc{model_name=\"org/m\\\"1\"} 0.25\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE vllm:kv_cache_usage_perc gauge\n"),
            "{text}"
        );
    }
}

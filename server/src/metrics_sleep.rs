//! Sleep and wake in /metrics: whether (and how deeply) the model sleeps, how often it slept
//! and woke, how long waking took (a histogram, and the last wake), and the cold start that
//! waking is compared with.

use std::fmt::Write as _;

use crate::engine::EngineStats;
use crate::metrics::Metrics;

/// Appends the sleep families to `out`.
pub fn render(out: &mut String, stats: &EngineStats, metrics: &Metrics) {
    let s = &stats.sleep;
    let g = |v: &std::sync::atomic::AtomicU64| EngineStats::get(v);
    let level = g(&s.level);
    let lines: [(&str, &str, &str, f64); 6] = [
        (
            "npu_serving_sleeping",
            "gauge",
            "1 while the model sleeps (POST /sleep or the idle timeout), also while it falls \
             asleep or wakes.",
            f64::from(u8::from(level > 0)),
        ),
        (
            "npu_serving_sleep_level",
            "gauge",
            "The sleep level: 0 awake, 1 KV pools freed (weights kept), 2 weights and KV dropped.",
            level as f64,
        ),
        (
            "npu_serving_sleeps_total",
            "counter",
            "Times the model was put to sleep (by POST /sleep or the idle timeout).",
            g(&s.sleeps_total) as f64,
        ),
        (
            "npu_serving_idle_sleeps_total",
            "counter",
            "Of the sleeps, those npu_serving.sleep_idle_seconds started.",
            g(&s.idle_sleeps_total) as f64,
        ),
        (
            "npu_serving_wakes_total",
            "counter",
            "Times the model was woken (by POST /wake_up or a request arriving while asleep).",
            g(&s.wakes_total) as f64,
        ),
        (
            "npu_serving_last_wake_seconds",
            "gauge",
            "How long the last wake took (every agent awake again).",
            g(&s.last_wake_us) as f64 / 1e6,
        ),
    ];
    for (name, kind, help, v) in lines {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP npu_serving_cold_start_seconds The agents' start at server start (spawn to \
         handshake, model load included): what a wake is compared with.\n# TYPE \
         npu_serving_cold_start_seconds gauge\nnpu_serving_cold_start_seconds {}",
        g(&s.cold_start_us) as f64 / 1e6
    );
    metrics.wake_duration.render(
        out,
        "npu_serving_wake_duration_seconds",
        "How long each wake took (every agent awake again).",
    );
}

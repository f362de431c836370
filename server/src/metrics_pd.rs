//! Prefill/decode disaggregation's part of /metrics: requests, KV blocks and bytes handed over
//! (out of prefill agents, into decode agents), the handoff region's occupancy, and the prefill
//! tokens computed by agents of each role (zero on decode agents: nothing handed over is
//! recomputed).

use std::fmt::Write as _;

use crate::engine::EngineStats;

/// Appends the disaggregation families to `out`.
pub fn render(out: &mut String, stats: &EngineStats) {
    let g = |v: &std::sync::atomic::AtomicU64| EngineStats::get(v) as f64;
    let p = &stats.pd;
    let families = [
        (
            "npu_serving_kv_handoff_requests_total",
            "counter",
            "Requests whose KV was handed over from a prefill agent to a decode agent, by side.",
            [
                ("{side=\"out\"}", g(&p.handoff_out_requests_total)),
                ("{side=\"in\"}", g(&p.handoff_in_requests_total)),
            ],
        ),
        (
            "npu_serving_kv_handoff_blocks_total",
            "counter",
            "KV blocks copied out of prefill agents into the handoff region, and from it into \
             decode agents.",
            [
                ("{side=\"out\"}", g(&p.handoff_out_blocks_total)),
                ("{side=\"in\"}", g(&p.handoff_in_blocks_total)),
            ],
        ),
        (
            "npu_serving_kv_handoff_bytes_total",
            "counter",
            "Bytes of KV blocks handed over, by side.",
            [
                ("{side=\"out\"}", g(&p.handoff_out_bytes_total)),
                ("{side=\"in\"}", g(&p.handoff_in_bytes_total)),
            ],
        ),
        (
            "npu_serving_kv_handoff_region_blocks",
            "gauge",
            "Blocks of the KV handoff region (npu_serving.handoff_space_mb): all, and in use.",
            [
                ("{state=\"total\"}", g(&p.handoff_blocks_total)),
                ("{state=\"used\"}", g(&p.handoff_blocks_used)),
            ],
        ),
    ];
    for (name, kind, help, samples) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    }
    let name = "npu_serving_prefill_tokens_total";
    let _ = writeln!(
        out,
        "# HELP {name} Prefill tokens (prompts, and tokens computed again after a preemption or \
         recovery) computed by agents of each role.\n# TYPE {name} counter"
    );
    for (role, v) in [
        ("prefill", &p.prefill_tokens_prefill_agents_total),
        ("decode", &p.prefill_tokens_decode_agents_total),
        ("both", &p.prefill_tokens_both_agents_total),
    ] {
        let _ = writeln!(out, "{name}{{role=\"{role}\"}} {}", g(v));
    }
}

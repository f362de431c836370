//! The KV memory hierarchy's part of /metrics: swapping (blocks and bytes each way,
//! preemptions by kind), the prefix cache's hit tokens per tier, the host pool's occupancy,
//! and the host->device bytes of step inputs (the KV history itself never moves).

use std::fmt::Write as _;

use crate::engine::EngineStats;

fn family(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(&str, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, v) in samples {
        let _ = writeln!(out, "{name}{labels} {v}");
    }
}

/// Appends the KV families to `out`.
pub fn render(out: &mut String, stats: &EngineStats) {
    let g = |v: &std::sync::atomic::AtomicU64| EngineStats::get(v) as f64;
    let k = &stats.kv;
    let swaps = g(&k.preemptions_swap_total);
    let recomputes = (g(&stats.preemptions_total) - swaps).max(0.0);
    family(
        out,
        "npu_serving_preemptions_by_kind_total",
        "counter",
        "Sequences preempted for lack of KV blocks, by what happened to their KV.",
        &[
            ("{kind=\"swap\"}", swaps),
            ("{kind=\"recompute\"}", recomputes),
        ],
    );
    let hit_host = g(&k.prefix_hit_tokens_host_total);
    let hit_device = (g(&stats.prefix_cache_hit_tokens_total) - hit_host).max(0.0);
    family(
        out,
        "npu_serving_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens whose KV came from the prefix cache, by the tier it was found in.",
        &[
            ("{tier=\"device\"}", hit_device),
            ("{tier=\"host\"}", hit_host),
        ],
    );
    let counters = [
        (
            "npu_serving_kv_swap_out_blocks_total",
            "KV blocks of preempted sequences copied to the host pool.",
            g(&k.swap_out_blocks_total),
        ),
        (
            "npu_serving_kv_swap_out_bytes_total",
            "Bytes of KV blocks swapped out to the host pool.",
            g(&k.swap_out_bytes_total),
        ),
        (
            "npu_serving_kv_swap_in_blocks_total",
            "KV blocks of resumed sequences copied back from the host pool.",
            g(&k.swap_in_blocks_total),
        ),
        (
            "npu_serving_kv_swap_in_bytes_total",
            "Bytes of KV blocks swapped back in from the host pool.",
            g(&k.swap_in_bytes_total),
        ),
        (
            "npu_serving_kv_host_spilled_blocks_total",
            "Cached prefix blocks evicted from the device and kept in the host tier.",
            g(&k.host_spilled_blocks_total),
        ),
        (
            "npu_serving_kv_copy_seconds_total",
            "Agent time spent copying KV blocks between the device and host pools.",
            g(&k.copy_us_total) / 1e6,
        ),
        (
            "npu_serving_step_h2d_input_bytes_total",
            "Bytes of step inputs sent host to device (tokens, positions, slot mappings, \
             sequence spans, block tables, logit rows); KV history never moves.",
            g(&k.step_input_bytes_total),
        ),
    ];
    for (name, help, v) in counters {
        family(out, name, "counter", help, &[("", v)]);
    }
    let gauges = [
        (
            "npu_serving_kv_host_blocks_total",
            "Blocks of the agents' host KV pools (npu_serving.swap_space_mb).",
            g(&k.host_blocks_total),
        ),
        (
            "npu_serving_kv_host_blocks_cached",
            "Host KV blocks holding prefix-cache content spilled from the device.",
            g(&k.host_blocks_cached),
        ),
        (
            "npu_serving_kv_host_blocks_swapped",
            "Host KV blocks holding swapped-out sequences.",
            g(&k.host_blocks_swapped),
        ),
        (
            "npu_serving_last_step_h2d_input_bytes",
            "Host-to-device step input bytes of the last step.",
            g(&k.last_step_input_bytes),
        ),
        (
            "npu_serving_last_step_h2d_block_table_bytes",
            "Of the last step's input bytes, the block tables (4 bytes per entry and sequence; \
             one entry per block_size tokens of the longest context in the step).",
            g(&k.last_step_block_table_bytes),
        ),
    ];
    for (name, help, v) in gauges {
        family(out, name, "gauge", help, &[("", v)]);
    }
}

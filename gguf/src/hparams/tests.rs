//! Hyper-parameters of small written files: each family's hook, and damaged headers refused
//! with the key named before anything is sized by them.

use super::*;
use crate::writer::GgufWriter;
use crate::MetaValue;

fn file(arch: &str, extra: &[(&str, MetaValue)]) -> GgufFile {
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", MetaValue::String(arch.into()));
    let k = |s: &str| format!("{arch}.{s}");
    for (key, v) in [
        ("block_count", 6u32),
        ("embedding_length", 64),
        ("feed_forward_length", 128),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 2),
        ("vocab_size", 100),
    ] {
        if extra.iter().all(|(e, _)| *e != k(key)) {
            w.add_meta(k(key), MetaValue::U32(v));
        }
    }
    for (key, v) in extra {
        w.add_meta(key.to_string(), v.clone());
    }
    for i in 0..6 {
        w.add_f32_tensor(format!("blk.{i}.attn_norm.weight"), &[64], &[1.0; 64]);
    }
    let dir = std::env::temp_dir().join(format!("hparams-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("{arch}-{n}.gguf"));
    w.write_to(&path).unwrap();
    GgufFile::open(&path).unwrap()
}

#[test]
fn gemma3_layers_alternate_window_and_rope_base() {
    let f = file(
        "gemma3",
        &[
            ("gemma3.attention.sliding_window", MetaValue::U32(512)),
            ("gemma3.rope.freq_base", MetaValue::F32(1e6)),
        ],
    );
    let c = ModelConfig::from_gguf(&f).unwrap();
    assert!(c.qk_norm && c.post_norms && c.ffn_act == FfnAct::GeluTanh);
    assert_eq!(c.embed_scale, Some(8.0));
    for (il, l) in c.layers.iter().enumerate() {
        let global = il == 5;
        assert_eq!(l.window, (!global).then_some(512), "layer {il}");
        assert_eq!(
            l.rope.base,
            if global { 1e6 } else { 10_000.0 },
            "layer {il}"
        );
        assert_eq!(l.rope.style, RopeStyle::Halves);
    }
    // A per-layer pattern from the file.
    let flags = (0..6).map(|i| MetaValue::Bool(i % 2 == 0)).collect();
    let f = file(
        "gemma3",
        &[
            ("gemma3.attention.sliding_window", MetaValue::U32(8)),
            (
                "gemma3.attention.sliding_window_pattern",
                MetaValue::Array(flags),
            ),
        ],
    );
    let c = ModelConfig::from_gguf(&f).unwrap();
    let windows: Vec<_> = c.layers.iter().map(|l| l.window).collect();
    assert_eq!(windows, [Some(8), None, Some(8), None, Some(8), None]);
}

#[test]
fn damaged_headers_are_refused_naming_the_key() {
    let e = ModelConfig::from_gguf(&file(
        "llama",
        &[("llama.block_count", MetaValue::U32(1 << 30))],
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("block_count"), "{e}");
    let e = ModelConfig::from_gguf(&file("llama", &[("llama.block_count", MetaValue::U32(0))]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("0 layers"), "{e}");
    let e = ModelConfig::from_gguf(&file("gemma4", &[]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("gemma4") && e.contains("gemma3"), "{e}");
    let e = ModelConfig::from_gguf(&file(
        "qwen3moe",
        &[("qwen3moe.expert_count", MetaValue::U32(4))],
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("qwen3moe.expert_used_count"), "{e}");
}

/// A Qwen3-MoE file's dense `feed_forward_length` sizes nothing when no layer has a dense FFN
/// (a damaged value once sized the step buffers by it).
#[test]
fn moe_dense_width_without_dense_tensors_sizes_nothing() {
    let f = file(
        "qwen3moe",
        &[
            ("qwen3moe.feed_forward_length", MetaValue::U32(1 << 30)),
            ("qwen3moe.expert_count", MetaValue::U32(4)),
            ("qwen3moe.expert_used_count", MetaValue::U32(2)),
            ("qwen3moe.expert_feed_forward_length", MetaValue::U32(32)),
        ],
    );
    let c = ModelConfig::from_gguf(&f).unwrap();
    assert_eq!(c.ff, 0);
    assert_eq!(c.ffn_width(), 32);
}

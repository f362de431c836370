//! Hyper-parameters of small written files: each family's hook; damaged headers refused with the
//! key named before anything is sized by them; keys and tensors that change the maths and that
//! the engine does not apply refused by name; Q/K/V biases applied on every family.

use super::*;
use npu_gguf::writer::GgufWriter;
use npu_gguf::MetaValue;

/// A file of `arch` with six layers (64 wide, 4 heads of 16, 2 KV heads), `extra` keys (which
/// replace the defaults of the same name; `false` as the value of a default key removes it) and
/// `tensors` (small f32 vectors, beside every layer's attention norm).
fn file_with(arch: &str, extra: &[(&str, MetaValue)], tensors: &[(&str, usize)]) -> GgufFile {
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", MetaValue::String(arch.into()));
    let k = |s: &str| format!("{arch}.{s}");
    let defaults = [
        ("block_count", MetaValue::U32(6)),
        ("embedding_length", MetaValue::U32(64)),
        ("feed_forward_length", MetaValue::U32(128)),
        ("attention.head_count", MetaValue::U32(4)),
        ("attention.head_count_kv", MetaValue::U32(2)),
        ("vocab_size", MetaValue::U32(100)),
        ("attention.layer_norm_rms_epsilon", MetaValue::F32(1e-6)),
    ];
    for (key, v) in &defaults {
        if extra.iter().all(|(e, _)| *e != k(key)) {
            w.add_meta(k(key), v.clone());
        }
    }
    for (key, v) in extra {
        let removes = *v == MetaValue::Bool(false) && defaults.iter().any(|(d, _)| k(d) == *key);
        if !removes {
            w.add_meta(key.to_string(), v.clone());
        }
    }
    for i in 0..6 {
        w.add_f32_tensor(format!("blk.{i}.attn_norm.weight"), &[64], &[1.0; 64]);
    }
    for &(name, n) in tensors {
        w.add_f32_tensor(name, &[n as u64], &vec![1.0; n]);
    }
    GgufFile::from_bytes(&format!("{arch}.gguf"), &w.to_bytes().unwrap()).unwrap()
}

fn file(arch: &str, extra: &[(&str, MetaValue)]) -> GgufFile {
    file_with(arch, extra, &[])
}

fn cfg(arch: &str, extra: &[(&str, MetaValue)]) -> Result<ModelConfig, String> {
    ModelConfig::from_gguf(&file(arch, extra)).map_err(|e| e.to_string())
}

/// The error of a file that must be refused; it must contain each of `needles`.
fn refused(f: &GgufFile, needles: &[&str]) -> String {
    let e = match ModelConfig::from_gguf(f) {
        Ok(c) => panic!("expected a refusal, loaded {c:?}"),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(e.contains(n), "{n:?} not in: {e}");
    }
    e
}

/// Keys of a file beside the defaults.
type Keys<'a> = &'a [(&'a str, MetaValue)];

const QWEN3MOE: [(&str, MetaValue); 3] = [
    ("qwen3moe.expert_count", MetaValue::U32(4)),
    ("qwen3moe.expert_used_count", MetaValue::U32(2)),
    ("qwen3moe.expert_feed_forward_length", MetaValue::U32(32)),
];

fn with(
    base: &[(&'static str, MetaValue)],
    more: &[(&'static str, MetaValue)],
) -> Vec<(&'static str, MetaValue)> {
    base.iter().chain(more).cloned().collect()
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
    let e = cfg("llama", &[("llama.block_count", MetaValue::U32(1 << 30))]).unwrap_err();
    assert!(e.contains("llama.block_count"), "{e}");
    let e = cfg("llama", &[("llama.block_count", MetaValue::U32(0))]).unwrap_err();
    assert!(e.contains("llama.block_count = 0"), "{e}");
    let e = cfg("gemma4", &[]).unwrap_err();
    assert!(e.contains("gemma4") && e.contains("gemma3"), "{e}");
    let e = cfg("qwen3moe", &[("qwen3moe.expert_count", MetaValue::U32(4))]).unwrap_err();
    assert!(e.contains("qwen3moe.expert_used_count"), "{e}");
}

/// Every size is bounded where it is read, and the error names the key.
#[test]
fn hyper_parameters_are_bounded_where_read() {
    let cases: &[(&str, Keys, &str)] = &[
        (
            "llama",
            &[("llama.embedding_length", MetaValue::U32(0))],
            "llama.embedding_length = 0",
        ),
        (
            "llama",
            &[("llama.embedding_length", MetaValue::U64(1 << 40))],
            "llama.embedding_length",
        ),
        (
            "llama",
            &[("llama.feed_forward_length", MetaValue::U32(0))],
            "llama.feed_forward_length",
        ),
        (
            "llama",
            &[("llama.feed_forward_length", MetaValue::U64(1 << 33))],
            "llama.feed_forward_length",
        ),
        (
            "llama",
            &[("llama.attention.head_count", MetaValue::U32(0))],
            "llama.attention.head_count",
        ),
        (
            "llama",
            &[("llama.attention.head_count", MetaValue::U32(1 << 20))],
            "llama.attention.head_count",
        ),
        (
            "llama",
            &[("llama.attention.head_count_kv", MetaValue::U32(8))],
            "llama.attention.head_count_kv = 8",
        ),
        (
            "llama",
            &[("llama.attention.head_count_kv", MetaValue::U32(0))],
            "llama.attention.head_count_kv = 0",
        ),
        (
            "llama",
            &[("llama.attention.head_count_kv", MetaValue::U32(3))],
            "cannot be grouped",
        ),
        (
            "qwen3",
            &[("qwen3.attention.key_length", MetaValue::U32(1 << 20))],
            "qwen3.attention.key_length",
        ),
        (
            "qwen3",
            &[("qwen3.attention.key_length", MetaValue::U32(15))],
            "must be even",
        ),
        (
            "llama",
            &[("llama.vocab_size", MetaValue::U32(0))],
            "llama.vocab_size",
        ),
        (
            "llama",
            &[("llama.vocab_size", MetaValue::U64(1 << 40))],
            "llama.vocab_size",
        ),
        (
            "llama",
            &[("llama.context_length", MetaValue::U32(0))],
            "llama.context_length",
        ),
        (
            "llama",
            &[("llama.context_length", MetaValue::U64(1 << 40))],
            "llama.context_length",
        ),
        (
            "llama",
            &[(
                "llama.attention.layer_norm_rms_epsilon",
                MetaValue::F32(0.0),
            )],
            "llama.attention.layer_norm_rms_epsilon",
        ),
        (
            "llama",
            &[(
                "llama.attention.layer_norm_rms_epsilon",
                MetaValue::F32(f32::NAN),
            )],
            "llama.attention.layer_norm_rms_epsilon",
        ),
        (
            "llama",
            &[(
                "llama.attention.layer_norm_rms_epsilon",
                MetaValue::F32(-1e-5),
            )],
            "llama.attention.layer_norm_rms_epsilon",
        ),
        (
            "llama",
            &[(
                "llama.attention.layer_norm_rms_epsilon",
                MetaValue::F32(2.0),
            )],
            "llama.attention.layer_norm_rms_epsilon",
        ),
        // Required, as llama.cpp requires it (a default would be a guess).
        (
            "qwen2",
            &[(
                "qwen2.attention.layer_norm_rms_epsilon",
                MetaValue::Bool(false),
            )],
            "qwen2.attention.layer_norm_rms_epsilon",
        ),
        (
            "llama",
            &[("llama.rope.freq_base", MetaValue::F32(0.0))],
            "llama.rope.freq_base",
        ),
        (
            "llama",
            &[("llama.rope.freq_base", MetaValue::F32(f32::INFINITY))],
            "llama.rope.freq_base",
        ),
        (
            "gemma3",
            &[
                ("gemma3.attention.sliding_window", MetaValue::U32(512)),
                ("gemma3.rope.freq_base_swa", MetaValue::F32(-1.0)),
            ],
            "gemma3.rope.freq_base_swa",
        ),
        (
            "gemma3",
            &[("gemma3.attention.sliding_window", MetaValue::U64(1 << 40))],
            "gemma3.attention.sliding_window",
        ),
        // A key of the wrong type is an error, not absent (which would put a default there).
        (
            "llama",
            &[("llama.block_count", MetaValue::String("6".into()))],
            "llama.block_count",
        ),
        (
            "llama",
            &[("llama.rope.freq_base", MetaValue::String("1e4".into()))],
            "llama.rope.freq_base",
        ),
        (
            "llama",
            &[("llama.attention.head_count_kv", MetaValue::F32(2.0))],
            "llama.attention.head_count_kv",
        ),
        (
            "llama",
            &[("llama.rope.scaling.type", MetaValue::U32(1))],
            "llama.rope.scaling.type",
        ),
        // Per-layer arrays: one value for every layer only.
        (
            "llama",
            &[(
                "llama.attention.head_count_kv",
                MetaValue::Array(vec![MetaValue::U32(2); 5]),
            )],
            "5 per-layer values for 6 layers",
        ),
        (
            "llama",
            &[(
                "llama.feed_forward_length",
                MetaValue::Array((0..6).map(|i| MetaValue::U32(128 + 32 * (i % 2))).collect()),
            )],
            "llama.feed_forward_length differs between layers",
        ),
        (
            "qwen3moe",
            &[
                ("qwen3moe.expert_count", MetaValue::U32(4096)),
                ("qwen3moe.expert_used_count", MetaValue::U32(2)),
            ],
            "qwen3moe.expert_count = 4096",
        ),
        (
            "qwen3moe",
            &[
                ("qwen3moe.expert_count", MetaValue::U32(4)),
                ("qwen3moe.expert_used_count", MetaValue::U32(5)),
            ],
            "qwen3moe.expert_used_count = 5",
        ),
        (
            "qwen3moe",
            &[
                ("qwen3moe.expert_count", MetaValue::U32(4)),
                ("qwen3moe.expert_used_count", MetaValue::U32(2)),
                (
                    "qwen3moe.expert_feed_forward_length",
                    MetaValue::U64(1 << 40),
                ),
            ],
            "qwen3moe.expert_feed_forward_length",
        ),
    ];
    for (arch, extra, needle) in cases {
        let e = cfg(arch, extra)
            .map(|c| format!("loaded: {c:?}"))
            .unwrap_err();
        assert!(
            e.contains(needle),
            "{arch} {extra:?}: {needle:?} not in: {e}"
        );
    }
    // A uniform per-layer array is the one value.
    let c = cfg(
        "llama",
        &[(
            "llama.attention.head_count_kv",
            MetaValue::Array(vec![MetaValue::U32(1); 6]),
        )],
    )
    .unwrap();
    assert_eq!(c.n_kv_heads, 1);
}

/// A Qwen3-MoE file's dense `feed_forward_length` sizes nothing when no layer has a dense FFN
/// (a damaged value once sized the step buffers by it).
#[test]
fn moe_dense_width_without_dense_tensors_sizes_nothing() {
    let c = cfg(
        "qwen3moe",
        &with(
            &QWEN3MOE,
            &[("qwen3moe.feed_forward_length", MetaValue::U32(1 << 20))],
        ),
    )
    .unwrap();
    assert_eq!(c.ff, 0);
    assert_eq!(c.ffn_width(), 32);
}

/// Rope scaling as llama.cpp reads it: no type means linear (the factor applies), "none" never
/// scales, the older `rope.scale_linear` is the factor too; YaRN, LongRoPE and unknown types are
/// refused naming the key.
#[test]
fn rope_scaling_is_linear_or_refused() {
    let scale = |extra: &[(&str, MetaValue)]| cfg("llama", extra).unwrap().rope.freq_scale;
    assert_eq!(scale(&[]), 1.0);
    let linear = MetaValue::String("linear".into());
    assert_eq!(
        scale(&[
            ("llama.rope.scaling.type", linear.clone()),
            ("llama.rope.scaling.factor", MetaValue::F32(4.0)),
        ]),
        0.25
    );
    assert_eq!(
        scale(&[("llama.rope.scaling.factor", MetaValue::F32(8.0))]),
        0.125
    );
    assert_eq!(
        scale(&[("llama.rope.scale_linear", MetaValue::F32(2.0))]),
        0.5
    );
    assert_eq!(
        scale(&[
            ("llama.rope.scaling.type", MetaValue::String("none".into())),
            ("llama.rope.scaling.factor", MetaValue::F32(4.0)),
        ]),
        1.0
    );
    assert_eq!(
        scale(&[("llama.rope.scaling.factor", MetaValue::F32(0.0))]),
        1.0
    );
    // Gemma 3's global layers are scaled, its local layers not.
    let c = cfg(
        "gemma3",
        &[
            ("gemma3.attention.sliding_window", MetaValue::U32(512)),
            ("gemma3.rope.scaling.type", linear),
            ("gemma3.rope.scaling.factor", MetaValue::F32(8.0)),
        ],
    )
    .unwrap();
    assert_eq!(c.layers[5].rope.freq_scale, 0.125);
    assert_eq!(c.layers[0].rope.freq_scale, 1.0);
    for (ty, needle) in [
        ("yarn", "YaRN"),
        ("longrope", "LongRoPE"),
        ("llama3", "no such rope scaling type"),
    ] {
        let e = cfg(
            "qwen3",
            &[
                ("qwen3.rope.scaling.type", MetaValue::String(ty.into())),
                ("qwen3.rope.scaling.factor", MetaValue::F32(4.0)),
            ],
        )
        .unwrap_err();
        assert!(
            e.contains("qwen3.rope.scaling.type") && e.contains(needle),
            "{e}"
        );
    }
    let e = cfg(
        "llama",
        &[("llama.rope.scaling.factor", MetaValue::F32(-2.0))],
    )
    .unwrap_err();
    assert!(e.contains("llama.rope.scaling.factor = -2"), "{e}");
}

/// Keys that change the maths and that the engine does not apply stop the load naming them;
/// at their neutral value they pass.
#[test]
fn keys_that_change_the_maths_are_refused_by_name() {
    let cases: &[(&str, &str, MetaValue, &str)] = &[
        (
            "qwen2",
            "qwen2.rope.scaling.yarn_beta_fast",
            MetaValue::F32(32.0),
            "YaRN",
        ),
        (
            "qwen2",
            "qwen2.rope.scaling.yarn_ext_factor",
            MetaValue::F32(1.0),
            "YaRN",
        ),
        (
            "qwen2",
            "qwen2.rope.scaling.yarn_log_multiplier",
            MetaValue::F32(0.1),
            "YaRN",
        ),
        (
            "llama",
            "llama.rope.scaling.attn_factor",
            MetaValue::F32(1.2),
            "cos/sin",
        ),
        (
            "llama",
            "llama.rope.scaling.alpha",
            MetaValue::F32(1000.0),
            "NTK",
        ),
        (
            "llama",
            "llama.attention.scale",
            MetaValue::F32(0.5),
            "scales attention scores",
        ),
        (
            "gemma3",
            "gemma3.attn_logit_softcapping",
            MetaValue::F32(50.0),
            "soft-capping",
        ),
        (
            "gemma3",
            "gemma3.final_logit_softcapping",
            MetaValue::F32(30.0),
            "soft-capping",
        ),
        (
            "llama",
            "llama.final_logit_softcapping",
            MetaValue::F32(30.0),
            "soft-capping",
        ),
        (
            "qwen3",
            "qwen3.attention.clamp_kqv",
            MetaValue::F32(8.0),
            "clamping",
        ),
        (
            "llama",
            "llama.attention.max_alibi_bias",
            MetaValue::F32(8.0),
            "ALiBi",
        ),
        (
            "llama",
            "llama.attention.causal",
            MetaValue::Bool(false),
            "non-causal",
        ),
        (
            "llama",
            "llama.expert_count",
            MetaValue::U32(8),
            "routed experts",
        ),
        (
            "llama",
            "llama.nextn_predict_layers",
            MetaValue::U32(1),
            "next-token prediction",
        ),
        (
            "qwen2",
            "qwen2.attention.sliding_window",
            MetaValue::U32(4096),
            "sliding-window",
        ),
        ("llama", "llama.logit_scale", MetaValue::F32(8.0), "Granite"),
        (
            "llama",
            "llama.embedding_scale",
            MetaValue::F32(12.0),
            "Granite",
        ),
        (
            "qwen2",
            "qwen2.rope.dimension_sections",
            MetaValue::Array(vec![MetaValue::I32(16), MetaValue::I32(24)]),
            "M-RoPE",
        ),
        (
            "gemma3",
            "gemma3.attention.key_length_swa",
            MetaValue::U32(32),
            "sliding-window layers",
        ),
        (
            "llama",
            "llama.use_parallel_residual",
            MetaValue::Bool(true),
            "parallel",
        ),
        (
            "llama",
            "llama.some_future_key",
            MetaValue::U32(1),
            "does not know this key",
        ),
    ];
    for (arch, key, v, needle) in cases {
        let e = cfg(arch, &[(key, v.clone())])
            .map(|c| format!("loaded: {c:?}"))
            .unwrap_err();
        assert!(
            e.contains(key) && e.contains(needle),
            "{key}: {needle:?} not in: {e}"
        );
    }
    // Qwen3-MoE's routing: what llama.cpp's qwen3moe graph does, or refused.
    let moe_cases: &[(&str, MetaValue, &str)] = &[
        ("qwen3moe.expert_gating_func", MetaValue::U32(2), "softmax"),
        (
            "qwen3moe.expert_weights_scale",
            MetaValue::F32(2.5),
            "scaling",
        ),
        (
            "qwen3moe.expert_weights_norm",
            MetaValue::Bool(false),
            "renormalises",
        ),
        (
            "qwen3moe.expert_group_count",
            MetaValue::U32(4),
            "group-limited",
        ),
        (
            "qwen3moe.expert_shared_feed_forward_length",
            MetaValue::U32(64),
            "shared experts",
        ),
        (
            "qwen3moe.leading_dense_block_count",
            MetaValue::U32(1),
            "dense leading",
        ),
    ];
    for (key, v, needle) in moe_cases {
        let e = cfg("qwen3moe", &with(&QWEN3MOE, &[(key, v.clone())]))
            .map(|c| format!("loaded: {c:?}"))
            .unwrap_err();
        assert!(
            e.contains(key) && e.contains(needle),
            "{key}: {needle:?} not in: {e}"
        );
    }
    // Neutral values, harmless keys and keys outside the family's namespace pass.
    let f32v = MetaValue::F32;
    for (arch, key, v) in [
        ("llama", "llama.rope.scaling.attn_factor", f32v(1.0)),
        ("llama", "llama.attention.scale", f32v(0.25)),
        ("llama", "llama.attention.causal", MetaValue::Bool(true)),
        ("llama", "llama.expert_count", MetaValue::U32(0)),
        ("llama", "llama.final_logit_softcapping", f32v(0.0)),
        ("gemma3", "gemma3.final_logit_softcapping", f32v(0.0)),
        (
            "gemma3",
            "gemma3.attention.key_length_swa",
            MetaValue::U32(16),
        ),
        (
            "llama",
            "llama.rope.scaling.finetuned",
            MetaValue::Bool(true),
        ),
        (
            "llama",
            "llama.rope.scaling.original_context_length",
            MetaValue::U32(8192),
        ),
        ("llama", "llama.attention.layer_norm_epsilon", f32v(1e-5)),
        (
            "llama",
            "llama.tensor_data_layout",
            MetaValue::String("Meta AI original pth".into()),
        ),
        ("qwen2", "qwen2.pooling_type", MetaValue::U32(1)),
        ("qwen2", "qwen2.rope.dimension_count", MetaValue::U32(16)),
        ("llama", "general.some_note", MetaValue::String("x".into())),
        (
            "llama",
            "tokenizer.ggml.add_bos_token",
            MetaValue::Bool(true),
        ),
        ("llama", "qwen2.attention.clamp_kqv", f32v(8.0)),
    ] {
        cfg(arch, &[(key, v.clone())]).unwrap_or_else(|e| panic!("{key} = {v:?}: {e}"));
    }
    for (key, v) in [
        ("qwen3moe.expert_gating_func", MetaValue::U32(1)),
        ("qwen3moe.expert_weights_norm", MetaValue::Bool(true)),
        ("qwen3moe.expert_weights_scale", f32v(1.0)),
        ("qwen3moe.expert_group_count", MetaValue::U32(1)),
        ("qwen3moe.expert_group_used_count", MetaValue::U32(1)),
    ] {
        cfg("qwen3moe", &with(&QWEN3MOE, &[(key, v.clone())]))
            .unwrap_or_else(|e| panic!("{key} = {v:?}: {e}"));
    }
}

/// llama.cpp's graphs rotate whole heads (llama's loader refuses another count, qwen2/qwen3
/// assert it); partial rotation is refused on every family, Gemma 3's included.
#[test]
fn partial_rotary_dimensions_are_refused() {
    for arch in ["llama", "qwen2", "qwen3", "gemma3"] {
        let key = format!("{arch}.rope.dimension_count");
        let e = cfg(arch, &[(&key, MetaValue::U32(8))]).unwrap_err();
        assert!(
            e.contains(&format!("{key} = 8")) && e.contains("whole heads"),
            "{e}"
        );
    }
}

/// Tensors a file carries that the engine does not use stop the load naming the tensor and
/// the family.
#[test]
fn unused_tensors_are_refused_by_name() {
    let cases: &[(&str, Keys, (&str, usize), &str)] = &[
        (
            "llama",
            &[],
            ("blk.2.attn_output.bias", 64),
            "attention output bias",
        ),
        ("qwen2", &[], ("output.bias", 100), "output bias"),
        (
            "llama",
            &[],
            ("blk.0.ffn_up.bias", 128),
            "feed-forward bias",
        ),
        (
            "llama",
            &[],
            ("blk.1.ffn_down.bias", 64),
            "feed-forward bias",
        ),
        ("qwen3", &[], ("blk.0.attn_qkv.weight", 64), "fused Q/K/V"),
        (
            "qwen2",
            &[],
            ("rope_freqs.weight", 8),
            "rope frequency factors",
        ),
        (
            "qwen3",
            &[],
            ("rope_freqs.weight", 8),
            "rope frequency factors",
        ),
        (
            "gemma3",
            &[],
            ("rope_freqs.weight", 8),
            "rope frequency factors",
        ),
        (
            "qwen3moe",
            &QWEN3MOE,
            ("rope_freqs.weight", 8),
            "rope frequency factors",
        ),
        ("llama", &[], ("rope_factors_long.weight", 8), "LongRoPE"),
        (
            "llama",
            &[],
            ("blk.6.attn_norm.weight", 64),
            "beyond llama.block_count = 6",
        ),
        (
            "llama",
            &[],
            ("blk.x.attn_norm.weight", 64),
            "not used by the engine's llama model",
        ),
        (
            "llama",
            &[],
            ("cls.output.weight", 64),
            "not used by the engine's llama model",
        ),
        (
            "llama",
            &[],
            ("blk.0.attn_q_norm.weight", 16),
            "per-head Q/K norm",
        ),
        (
            "qwen2",
            &[],
            ("blk.0.post_ffw_norm.weight", 64),
            "post-attention/post-FFN norm",
        ),
        (
            "qwen3moe",
            &QWEN3MOE,
            ("blk.0.ffn_gate.weight", 64),
            "dense feed-forward",
        ),
        (
            "llama",
            &[],
            ("blk.0.ffn_gate_exps.weight", 64),
            "runs no experts",
        ),
        (
            "gemma3",
            &[],
            ("blk.0.attn_output.bias", 64),
            "attention output bias",
        ),
    ];
    for (arch, extra, (name, n), needle) in cases {
        let e = refused(
            &file_with(arch, extra, &[(name, *n)]),
            &[
                &format!("tensor {name:?}"),
                needle,
                &format!("{arch} model"),
            ],
        );
        assert!(e.starts_with("unsupported model"), "{e}");
    }
    // Llama's graph applies rope frequency factors (Llama 3).
    let c = ModelConfig::from_gguf(&file_with("llama", &[], &[("rope_freqs.weight", 8)])).unwrap();
    assert_eq!(c.rope.factors.map(<[f32]>::len), Some(8));
}

/// Q/K/V biases are applied wherever a file has them, as llama.cpp's `create_tensor_qkv` reads
/// them for every family (each optional): Qwen2 without them runs without them.
#[test]
fn qkv_biases_are_read_where_present_on_every_family() {
    for (arch, extra) in [
        ("llama", &[][..]),
        ("qwen2", &[][..]),
        ("qwen3", &[][..]),
        ("qwen3moe", &QWEN3MOE[..]),
        ("gemma3", &[][..]),
    ] {
        let c = ModelConfig::from_gguf(&file_with(arch, extra, &[])).unwrap();
        assert!(!c.qkv_bias, "{arch} without biases");
        let c =
            ModelConfig::from_gguf(&file_with(arch, extra, &[("blk.3.attn_k.bias", 32)])).unwrap();
        assert!(c.qkv_bias, "{arch} with a K bias");
    }
}

/// Values are shown in messages as the file has them.
#[test]
fn messages_show_values() {
    use super::read::show;
    assert_eq!(show(&MetaValue::F32(30.0)), "30");
    assert_eq!(show(&MetaValue::Bool(false)), "false");
    assert_eq!(show(&MetaValue::String("yarn".into())), "\"yarn\"");
    assert_eq!(show(&MetaValue::I32(-3)), "-3");
    let long = MetaValue::Array((0..10).map(MetaValue::U32).collect());
    assert_eq!(show(&long), "[0, 1, 2, 3, 4, 5, 6, 7, ... (10 values)]");
}

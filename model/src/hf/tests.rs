//! `config.json` to the model description: each family's keys, both rope schemas of
//! transformers (4.x `rope_theta` + `rope_scaling`, 5.x `rope_parameters`), and the refusal of
//! what the engine does not apply.

use serde_json::{json, Value};

use super::config::model_config;
use crate::{Arch, FfnAct, RopeStyle};

fn base(model_type: &str) -> Value {
    json!({
        "model_type": model_type,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu"
    })
}

fn with(mut v: Value, key: &str, x: Value) -> Value {
    v[key] = x;
    v
}

fn refused(v: &Value, needles: &[&str]) {
    let e = match model_config(v) {
        Ok(c) => panic!("accepted: {c:?}"),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(e.contains(n), "{e:?} does not say {n:?}");
    }
}

#[test]
fn families_map_to_their_description() {
    let c = model_config(&base("llama")).unwrap();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(c.rope.style, RopeStyle::Interleaved);
    assert_eq!((c.head_dim, c.n_kv_heads, c.ff), (32, 2, 512));
    let c = model_config(&base("qwen2")).unwrap();
    assert_eq!((c.arch, c.rope.style), (Arch::Qwen2, RopeStyle::Halves));
    let c = model_config(&base("qwen3")).unwrap();
    assert!(c.qk_norm);
    let mut moe = base("qwen3_moe");
    moe["num_experts"] = 8.into();
    moe["num_experts_per_tok"] = 2.into();
    moe["moe_intermediate_size"] = 64.into();
    let c = model_config(&moe).unwrap();
    let m = c.moe.unwrap();
    assert_eq!(
        (m.n_experts, m.n_used, m.expert_ff, m.norm_top_k),
        (8, 2, 64, false)
    );
    assert_eq!(c.ff, 0);
    moe["norm_topk_prob"] = true.into();
    assert!(model_config(&moe).unwrap().moe.unwrap().norm_top_k);
    moe["decoder_sparse_step"] = 2.into();
    refused(&moe, &["decoder_sparse_step"]);
}

#[test]
fn gemma3_reads_its_layer_pattern_bases_and_scale() {
    let mut g = with(base("gemma3_text"), "hidden_act", json!(null));
    g["hidden_activation"] = "gelu_pytorch_tanh".into();
    g["head_dim"] = 64.into();
    g["query_pre_attn_scalar"] = 64.into();
    g["sliding_window"] = 16.into();
    g["rope_local_base_freq"] = 10000.0.into();
    g["rope_theta"] = 1e6.into();
    g["layer_types"] = json!([
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention"
    ]);
    let c = model_config(&g).unwrap();
    assert_eq!(c.ffn_act, FfnAct::GeluTanh);
    assert_eq!(c.attn_scale, 0.125);
    assert_eq!(c.layers[0].window, Some(16));
    assert_eq!(c.layers[0].rope.base, 10000.0);
    assert_eq!(c.layers[3].window, None);
    assert_eq!(c.layers[3].rope.base, 1e6);
    assert_eq!(c.embed_scale, Some(16.0));
    // The multimodal checkpoint is named as such.
    refused(&base("gemma3"), &["gemma3_text", "multimodal"]);
}

#[test]
fn llama3_rope_scaling_gives_frequency_factors() {
    let v = with(
        base("llama"),
        "rope_scaling",
        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    );
    let c = model_config(&v).unwrap();
    let f = c.rope.factors.expect("factors");
    assert_eq!(f.len(), 16);
    assert_eq!(f[0], 1.0);
    assert_eq!(f[15], 8.0);
    assert_eq!(c.rope.freq_scale, 1.0);
    // transformers 5.x's rope_parameters say the same.
    let mut v5 = base("llama");
    v5.as_object_mut().unwrap().remove("rope_theta");
    v5["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 128});
    assert_eq!(model_config(&v5).unwrap(), c);
    // Linear scaling scales positions.
    let v = with(
        base("qwen2"),
        "rope_scaling",
        json!({"type": "linear", "factor": 4.0}),
    );
    assert_eq!(model_config(&v).unwrap().rope.freq_scale, 0.25);
    // Llama 3 factors on another family are refused.
    let v = with(
        base("qwen2"),
        "rope_scaling",
        json!({"rope_type": "llama3", "factor": 8.0}),
    );
    refused(&v, &["rope_scaling.rope_type", "llama3"]);
}

#[test]
fn keys_that_change_the_maths_are_refused_by_name() {
    for (k, x, needle) in [
        (
            "rope_scaling",
            json!({"rope_type": "yarn", "factor": 4.0}),
            "YaRN",
        ),
        (
            "rope_scaling",
            json!({"rope_type": "dynamic", "factor": 2.0}),
            "dynamic",
        ),
        ("final_logit_softcapping", json!(30.0), "soft-capping"),
        ("attn_logit_softcapping", json!(50.0), "soft-capping"),
        ("mlp_bias", json!(true), "feed-forward biases"),
        ("partial_rotary_factor", json!(0.5), "partial rotary"),
        ("hidden_act", json!("gelu"), "silu"),
        ("use_sliding_window", json!(true), "sliding-window"),
        ("kv_lora_rank", json!(512), "MLA"),
        ("pretraining_tp", json!(2), "pretraining_tp"),
    ] {
        refused(&with(base("qwen2"), k, x), &[k, needle]);
    }
    // Neutral values pass.
    for (k, x) in [
        ("final_logit_softcapping", json!(null)),
        ("mlp_bias", json!(false)),
        ("pretraining_tp", json!(1)),
        ("partial_rotary_factor", json!(1.0)),
    ] {
        model_config(&with(base("qwen2"), k, x)).unwrap();
    }
}

#[test]
fn sizes_are_bounded_and_required_keys_named() {
    let mut v = base("llama");
    v.as_object_mut().unwrap().remove("rms_norm_eps");
    refused(&v, &["rms_norm_eps", "missing"]);
    refused(
        &with(base("llama"), "num_hidden_layers", json!(100000)),
        &["num_hidden_layers"],
    );
    refused(
        &with(base("llama"), "num_key_value_heads", json!(3)),
        &["num_key_value_heads"],
    );
    refused(
        &with(base("llama"), "hidden_size", json!("256")),
        &["hidden_size", "integer"],
    );
    refused(
        &with(base("falcon"), "x", json!(1)),
        &["falcon", "supported"],
    );
    refused(&json!([1, 2]), &["object"]);
}

#[test]
fn mistral_sliding_window_caps_the_context() {
    let v = with(base("mistral"), "sliding_window", json!(1024));
    let c = model_config(&v).unwrap();
    assert_eq!((c.arch, c.context_length), (Arch::Llama, 1024));
    let v = with(base("mistral"), "sliding_window", json!(null));
    assert_eq!(model_config(&v).unwrap().context_length, 4096);
}

/// DeepSeek-V3's own config.json (its published values, FP8 block quantization included).
fn deepseek_v3() -> Value {
    json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "ep_size": 1,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 3,
        "norm_topk_prob": true,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": false,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"
        },
        "attention_bias": false,
        "quantization_config": {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128]
        }
    })
}

#[test]
fn deepseek_v3_and_v2_lite_configs_read_as_their_conversions() {
    let c = model_config(&deepseek_v3()).unwrap();
    assert_eq!(c.arch, Arch::Deepseek2);
    let (mla, moe) = (c.mla.unwrap(), c.moe.unwrap());
    assert_eq!(
        (
            mla.q_lora_rank,
            mla.kv_lora_rank,
            mla.qk_nope,
            mla.qk_rope,
            mla.v_head_dim
        ),
        (1536, 512, 128, 64, 128)
    );
    assert_eq!((c.n_kv_heads, c.head_dim, c.rope.dims), (1, 576, 64));
    assert_eq!(c.rope.style, RopeStyle::Interleaved);
    assert_eq!(
        (
            moe.n_experts,
            moe.n_used,
            moe.expert_ff,
            moe.shared_ff,
            moe.dense_lead
        ),
        (256, 8, 2048, 2048, 3)
    );
    assert_eq!(
        (moe.groups, moe.weights_scale, moe.norm_top_k),
        (Some((8, 4)), 2.5, true)
    );
    assert_eq!(moe.gating, crate::Gating::Sigmoid);
    // YaRN: mscale = 1 + 0.1 ln 40, squared into the scale over sqrt(192).
    let m = 1.0 + 0.1 * 40f32.ln();
    assert!(
        (c.attn_scale - m * m / 192f32.sqrt()).abs() < 1e-6,
        "{}",
        c.attn_scale
    );
    let f = c.rope.factors.unwrap();
    assert_eq!(f.len(), 32);
    assert_eq!(f[0], 1.0);
    assert!((f[31] - 40.0).abs() < 1e-3, "{f:?}");

    // DeepSeek-V2-Lite: a full query, softmax, no groups, mscale 0.707 for both.
    let mut lite = deepseek_v3();
    for (k, v) in [
        ("model_type", json!("deepseek_v2")),
        ("num_hidden_layers", json!(27)),
        ("q_lora_rank", Value::Null),
        ("scoring_func", json!("softmax")),
        ("topk_method", json!("greedy")),
        ("n_group", json!(1)),
        ("topk_group", json!(1)),
        ("routed_scaling_factor", json!(1.0)),
        ("norm_topk_prob", json!(false)),
        ("first_k_dense_replace", json!(1)),
    ] {
        lite[k] = v;
    }
    lite["rope_scaling"]["mscale"] = json!(0.707);
    lite["rope_scaling"]["mscale_all_dim"] = json!(0.707);
    let c = model_config(&lite).unwrap();
    let moe = c.moe.unwrap();
    assert_eq!(c.mla.unwrap().q_lora_rank, 0);
    assert_eq!((moe.gating, moe.groups), (crate::Gating::Softmax, None));

    // Kimi K2's YaRN betas (1, 1) are not what llama.cpp's deepseek2 runs (32, 1).
    let mut kimi = deepseek_v3();
    kimi["model_type"] = json!("kimi_k2");
    kimi["rope_scaling"]["beta_fast"] = json!(1.0);
    refused(&kimi, &["rope_scaling.beta_fast = 1"]);
    // DeepSeek-V2 (group_limited_greedy scores a group by its best expert).
    let mut v2 = lite.clone();
    v2["topk_method"] = json!("group_limited_greedy");
    v2["n_group"] = json!(8);
    v2["topk_group"] = json!(3);
    refused(&v2, &["topk_method", "group_limited_greedy"]);
    // MLA keys on another family stay refused.
    refused(
        &with(base("qwen2"), "kv_lora_rank", json!(512)),
        &["kv_lora_rank"],
    );
}

//! DeepSeek-V2/V3 (and Kimi K2, a DeepSeek-V3 under its own `model_type`) `config.json` to the
//! model description: the description the GGUF reader (`gguf::deepseek2`) builds from
//! `convert_hf_to_gguf.py`'s conversion of the same directory, key for key as the converter
//! reads it (kv_lora_rank 512 when absent, rms_norm_eps 1e-6, the routed scale, the groups,
//! the scoring function, the leading dense layers, YaRN through the same `yarn_scaling`).
//!
//! Refused by name, because transformers' reading of the key differs from the maths the engine
//! (and llama.cpp on the converted file) applies: `topk_method` `greedy` or
//! `group_limited_greedy` with `n_group` > 1 (the first ignores the groups, the second scores a
//! group by its best expert, not its best two), `moe_layer_freq` other than 1, a DeepSeek-V2
//! that both renormalises and scales (its code scales only when it does not renormalise), an
//! unknown `scoring_func` (or none on DeepSeek-V3, where transformers routes by sigmoid and the
//! converter by softmax), `rope_interleave: false`, `attention_bias: true`, YaRN whose rotated
//! part is scaled (`mscale` != `mscale_all_dim`, `attention_factor` != 1, no `mscale_all_dim`)
//! or whose betas are not 32 and 1, and a missing `q_lora_rank` (transformers defaults to 1536,
//! the converter writes none; `null` is a full query projection).

use serde_json::Value;

use super::config::{inconsistent, positive, rope_params, unsupported, within, Config};
use crate::gguf::deepseek2::{yarn_get_mscale, yarn_scaling};
use crate::gguf::read::{
    MAX_CONTEXT, MAX_EMBEDDING, MAX_EXPERTS, MAX_FF, MAX_HEADS, MAX_HEAD_DIM, MAX_LAYERS, MAX_VOCAB,
};
use crate::{
    intern_factors, Arch, FfnAct, Gating, HparamsError, LayerSpec, MlaSpec, ModelConfig, MoeSpec,
    Rope, RopeStyle,
};

/// `MATHS_KEYS` this family reads itself.
pub(super) const READS: &[&str] = &[
    "kv_lora_rank",
    "q_lora_rank",
    "first_k_dense_replace",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "n_shared_experts",
    "rope_interleave",
];

/// The converter's default latent width (`hparams.get("kv_lora_rank", 512)`).
const DEFAULT_KV_LORA_RANK: u64 = 512;
/// The converter's default norm epsilon.
const DEFAULT_RMS_EPS: f64 = 1e-6;

/// The model description of a DeepSeek `config.json` (`check_maths_keys` already ran).
pub(super) fn model_config(c: &Config) -> Result<ModelConfig, HparamsError> {
    let model_type = c.string("model_type")?.unwrap_or("deepseek_v3");
    let v2 = model_type == "deepseek_v2";
    let n_layers = c.req_uint("num_hidden_layers", 1, MAX_LAYERS)?;
    let hidden = c.req_uint("hidden_size", 1, MAX_EMBEDDING)?;
    let n_heads = c.req_uint("num_attention_heads", 1, MAX_HEADS)?;
    // kv_b_proj holds every head's key and value up-projections (transformers splits it per
    // attention head; its key/value head count is the attention head count).
    if let Some(kv) = c.uint("num_key_value_heads")? {
        if kv != n_heads as u64 {
            return Err(unsupported(format!(
                "num_key_value_heads = {kv} differs from num_attention_heads = {n_heads}: \
                 DeepSeek's kv_b_proj up-projects the latent for every attention head"
            )));
        }
    }
    for (key, bad) in [("attention_bias", true), ("rope_interleave", false)] {
        if c.boolean(key)? == Some(bad) {
            let why = if bad {
                "biases on the attention projections are not applied"
            } else {
                "DeepSeek's rope pairs adjacent dimensions (rope_interleave); the other \
                 pairing is not implemented"
            };
            return Err(unsupported(format!("{key} = {bad}: {why}")));
        }
    }
    // MLA's shape.
    let kv_lora_rank = match c.uint("kv_lora_rank")? {
        Some(v) => within("kv_lora_rank", v, 1, MAX_HEAD_DIM)?,
        None => DEFAULT_KV_LORA_RANK as usize,
    };
    let q_lora_rank = match c.get("q_lora_rank") {
        Some(_) => c.req_uint("q_lora_rank", 1, MAX_EMBEDDING)?,
        None if c.has("q_lora_rank") => 0,
        None => {
            return Err(inconsistent(
                "the required key q_lora_rank is missing (null: a full query projection; \
                 transformers would assume 1536, the converter writes none)"
                    .into(),
            ))
        }
    };
    let qk_rope = c.req_uint("qk_rope_head_dim", 2, MAX_HEAD_DIM)?;
    let qk_nope = c.req_uint("qk_nope_head_dim", 1, MAX_HEAD_DIM)?;
    let v_head_dim = c.req_uint("v_head_dim", 1, MAX_HEAD_DIM)?;
    if !qk_rope.is_multiple_of(2) {
        return Err(inconsistent(format!(
            "qk_rope_head_dim = {qk_rope} must be even"
        )));
    }
    if let Some(hd) = c.uint("head_dim")? {
        // transformers' DeepseekV3Config sets head_dim to the rotated width.
        if hd != qk_rope as u64 {
            return Err(inconsistent(format!(
                "head_dim = {hd} is not qk_rope_head_dim = {qk_rope} (DeepSeek's heads are \
                 qk_nope_head_dim + qk_rope_head_dim wide and its head_dim the rotated part)"
            )));
        }
    }
    let mla = MlaSpec {
        q_lora_rank,
        kv_lora_rank,
        qk_nope,
        qk_rope,
        v_head_dim,
    };
    let k_mla = qk_nope + qk_rope;
    let vocab = c.req_uint("vocab_size", 1, MAX_VOCAB)?;
    let context_length = match c.uint("max_position_embeddings")? {
        Some(v) => within("max_position_embeddings", v, 1, MAX_CONTEXT)?,
        None => 2048,
    };
    let eps_key = "rms_norm_eps";
    let eps = c.float(eps_key)?.unwrap_or(DEFAULT_RMS_EPS);
    let rms_eps = positive(eps_key, eps)?;
    if rms_eps >= 1.0 {
        return Err(inconsistent(format!("{eps_key} = {eps} must be below 1")));
    }
    let moe = experts(c, v2, n_layers)?;
    let ff = match c.uint("intermediate_size")? {
        Some(v) => within("intermediate_size", v, 0, MAX_FF)?,
        None => 0,
    };
    if moe.dense_lead > 0 && ff == 0 {
        return Err(inconsistent(format!(
            "first_k_dense_replace = {} dense layers, but intermediate_size is 0 or absent",
            moe.dense_lead
        )));
    }
    // Rope: adjacent pairs over the rotated part, YaRN as frequency factors.
    let p = rope_params(c, "full_attention")?;
    let base = positive("rope_theta", p.theta.unwrap_or(10_000.0))?;
    let mut rope = Rope::plain(RopeStyle::Interleaved, qk_rope, base, 1.0);
    let mut mscale = 1.0f32;
    if let Some((factors, m)) = yarn(c, &p, qk_rope, base)? {
        rope.factors = Some(intern_factors(&factors));
        mscale = m;
    }
    let name = c
        .string("_name_or_path")?
        .filter(|s| !s.is_empty())
        .unwrap_or(Arch::Deepseek2.name())
        .to_string();
    Ok(ModelConfig {
        arch: Arch::Deepseek2,
        name,
        n_layers,
        hidden,
        n_heads,
        // The converter writes one KV head: attention over the shared latent is multi-query,
        // each cache row the latent and the rotated key.
        n_kv_heads: 1,
        head_dim: mla.cache_row(),
        ff,
        vocab,
        context_length,
        rms_eps,
        rope,
        qkv_bias: false,
        qk_norm: false,
        post_norms: false,
        embed_scale: None,
        ffn_act: FfnAct::Silu,
        attn_scale: mscale * mscale / (k_mla as f32).sqrt(),
        layers: vec![LayerSpec { rope, window: None }; n_layers],
        moe: Some(moe),
        mla: Some(mla),
        wide_activations: false,
    })
}

/// The routed and shared experts, their gating and routing.
fn experts(c: &Config, v2: bool, n_layers: usize) -> Result<MoeSpec, HparamsError> {
    let n_experts = c.req_uint("n_routed_experts", 1, MAX_EXPERTS)?;
    let n_used = c.req_uint("num_experts_per_tok", 1, n_experts as u64)?;
    // As the converter: moe_intermediate_size, else intermediate_size.
    let expert_ff = match c.uint("moe_intermediate_size")? {
        Some(v) => within("moe_intermediate_size", v, 1, MAX_FF)?,
        None => c.req_uint("intermediate_size", 1, MAX_FF)?,
    };
    let n_shared = match c.uint("n_shared_experts")? {
        Some(v) => within("n_shared_experts", v, 0, MAX_EXPERTS)?,
        None => 0,
    };
    let dense_lead = match c.uint("first_k_dense_replace")? {
        Some(v) => within("first_k_dense_replace", v, 0, n_layers as u64)?,
        None => 0,
    };
    if let Some(f) = c.uint("moe_layer_freq")? {
        if f != 1 {
            return Err(unsupported(format!(
                "moe_layer_freq = {f}: experts on every {f}th layer only are not implemented \
                 (llama.cpp's deepseek2 puts them on every layer after the dense ones)"
            )));
        }
    }
    let norm_top_k = c.boolean("norm_topk_prob")?.unwrap_or(false);
    let weights_scale = match c.float("routed_scaling_factor")? {
        // The converter writes any value; llama.cpp scales by any but 0 and 1.
        Some(v) if v != 0.0 => positive("routed_scaling_factor", v)?,
        _ => 1.0,
    };
    if v2 && norm_top_k && weights_scale != 1.0 {
        return Err(unsupported(format!(
            "model_type deepseek_v2 with norm_topk_prob = true and routed_scaling_factor = \
             {weights_scale}: DeepSeek-V2 scales the weights only when it does not renormalise \
             them, the engine (as llama.cpp) does both"
        )));
    }
    let gating = match c.string("scoring_func")? {
        Some("softmax") => Gating::Softmax,
        Some("sigmoid") => Gating::Sigmoid,
        None if v2 => Gating::Softmax,
        None => {
            return Err(unsupported(
                "scoring_func is absent: transformers' DeepSeek-V3 routes by sigmoid, \
                 convert_hf_to_gguf.py's conversion by softmax; the config must say which"
                    .into(),
            ))
        }
        Some(other) => {
            return Err(unsupported(format!(
                "scoring_func = {other:?}: only softmax and sigmoid gating are implemented"
            )))
        }
    };
    let groups = match c.uint("n_group")?.unwrap_or(0) {
        0 | 1 => None,
        g => {
            let g = within("n_group", g, 2, n_experts as u64 - 1)?;
            let used = c.req_uint("topk_group", 1, g as u64 - 1)?;
            if !n_experts.is_multiple_of(g) {
                return Err(inconsistent(format!(
                    "n_group = {g} groups do not divide n_routed_experts = {n_experts}"
                )));
            }
            Some((g, used))
        }
    };
    match c.string("topk_method")? {
        None | Some("noaux_tc") => {}
        Some(m @ ("greedy" | "group_limited_greedy")) => {
            if let Some((g, _)) = groups {
                let why = if m == "greedy" {
                    "chooses among all experts, ignoring the groups"
                } else {
                    "scores each group by its best expert"
                };
                return Err(unsupported(format!(
                    "topk_method = {m:?} with n_group = {g}: it {why}, while the engine (as \
                     llama.cpp) scores each group by its best two and chooses within the best \
                     topk_group"
                )));
            }
        }
        Some(other) => {
            return Err(unsupported(format!(
                "topk_method = {other:?}: the engine routes as noaux_tc, greedy and (without \
                 groups) group_limited_greedy"
            )))
        }
    }
    Ok(MoeSpec {
        n_experts,
        n_used,
        expert_ff,
        norm_top_k,
        gating,
        weights_scale,
        groups,
        // Set from the tensors (`e_score_correction_bias`).
        selection_bias: false,
        shared_ff: expert_ff * n_shared,
        dense_lead,
    })
}

/// YaRN's frequency factors and attention multiplier (`None`: no scaling), from
/// `rope_scaling` as the converter writes it into the GGUF (factor and mscale_all_dim through
/// f32, as the file stores them) and refused where transformers would scale the rotated part.
fn yarn(
    c: &Config,
    p: &super::config::RopeParams,
    dims: usize,
    base: f32,
) -> Result<Option<(Vec<f32>, f32)>, HparamsError> {
    let Some(s) = p.scaling else {
        return Ok(None);
    };
    let key = &p.key;
    let ty = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .filter(|v| !v.is_null());
    let ty = match ty {
        None => "default",
        Some(v) => v
            .as_str()
            .ok_or_else(|| inconsistent(format!("{key}.rope_type = {v} is not a string")))?,
    };
    let num = |k: &str| -> Result<Option<f64>, HparamsError> {
        match s.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| inconsistent(format!("{key}.{k} = {v} is not a number"))),
        }
    };
    match ty {
        "default" => return Ok(None),
        "yarn" => {}
        other => {
            return Err(unsupported(format!(
                "{key}.rope_type = {other:?}: DeepSeek runs YaRN scaling or none"
            )))
        }
    }
    let factor = num("factor")?
        .ok_or_else(|| inconsistent(format!("{key}.factor is required by rope_type \"yarn\"")))?
        as f32;
    if !(factor.is_finite() && factor > 1.0) {
        return Err(unsupported(format!(
            "{key}.factor = {factor}: YaRN is implemented for factors above 1"
        )));
    }
    for (k, want) in [
        ("beta_fast", 32.0),
        ("beta_slow", 1.0),
        ("extrapolation_factor", 1.0),
    ] {
        if let Some(v) = num(k)? {
            if v != want {
                return Err(unsupported(format!(
                    "{key}.{k} = {v}: YaRN is implemented with {k} = {want} (llama.cpp's \
                     deepseek2 reads no other)"
                )));
            }
        }
    }
    if s.get("truncate") == Some(&Value::Bool(false)) {
        return Err(unsupported(format!(
            "{key}.truncate = false: YaRN's correction range is implemented rounded outwards"
        )));
    }
    let orig_key = format!("{key}.original_max_position_embeddings");
    let orig = match s
        .get("original_max_position_embeddings")
        .filter(|v| !v.is_null())
    {
        Some(v) => v.as_u64().ok_or_else(|| {
            inconsistent(format!("{orig_key} = {v} is not a non-negative integer"))
        })?,
        None => c.uint("original_max_position_embeddings")?.ok_or_else(|| {
            inconsistent(format!(
                "{orig_key} is required by rope_type \"yarn\" (as the converter requires it)"
            ))
        })?,
    };
    let n_ctx_orig = within(&orig_key, orig, 1, MAX_CONTEXT)?;
    let mscale_all_dim = num("mscale_all_dim")?.unwrap_or(0.0);
    let mscale = num("mscale")?.unwrap_or(0.0);
    let attention_factor = match num("attention_factor")? {
        Some(v) => Some(v),
        None => num("attn_factor")?,
    };
    // transformers' magnitude of the rotated part: attention_factor, else the ratio of the
    // two mscales when both are given, else YaRN's default.
    let f = factor;
    let hf_magnitude = match attention_factor {
        Some(a) => a as f32,
        None if mscale != 0.0 && mscale_all_dim != 0.0 => {
            yarn_get_mscale(f, mscale as f32) / yarn_get_mscale(f, mscale_all_dim as f32)
        }
        None => yarn_get_mscale(f, 1.0),
    };
    // The converter stores 0.1 * mscale_all_dim as an f32; llama.cpp divides the 0.1 out.
    let log_mul = (0.1 * mscale_all_dim) as f32 / 0.1;
    let llama_magnitude = if log_mul != 0.0 {
        attention_factor.unwrap_or(1.0) as f32
    } else {
        yarn_get_mscale(f, 1.0) * attention_factor.unwrap_or(1.0) as f32
    };
    if hf_magnitude != 1.0 || llama_magnitude != 1.0 {
        return Err(unsupported(format!(
            "{key}: YaRN scaling the rotated part's cos/sin by {hf_magnitude} (mscale = \
             {mscale}, mscale_all_dim = {mscale_all_dim}, attention_factor = \
             {attention_factor:?}) is not implemented; the engine runs DeepSeek's \
             mscale == mscale_all_dim"
        )));
    }
    let y = yarn_scaling(dims, base, factor, n_ctx_orig, log_mul, 1.0);
    Ok(Some((y.factors, y.mscale)))
}

//! The Hugging Face twin of a deepseek2 GGUF: DeepSeek's `config.json` (DeepSeek-V3's schema,
//! or DeepSeek-V2's where its maths is the file's: softmax, no groups, no correction bias) and
//! its layers in DeepSeek's module names, such that `convert_hf_to_gguf.py` gives the file
//! back: `kv_b_proj` joined from `attn_k_b` (transposed back) and `attn_v_b` as the converter
//! splits it, the experts one module each, the shared experts, `e_score_correction_bias`;
//! YaRN as `rope_scaling` with `mscale == mscale_all_dim` (the file's `yarn_log_multiplier`
//! times ten, refused unless the converter's `0.1 * mscale_all_dim` gives the same f32 back).

use std::collections::BTreeMap;

use npu_gguf::{GgmlType, GgufFile};
use npu_model::{Gating, MlaSpec, ModelConfig, MoeSpec};
use serde_json::{json, Value};

use super::tensors::{experts, tensor_f32, Out};
use super::{json_f32, meta_err, tensor_err, HfDtype, HfTwinError, Hp};

/// What a deepseek2 file adds to the shared hyper-parameters.
#[derive(Debug, Clone)]
pub(super) struct Deepseek {
    mla: MlaSpec,
    moe: MoeSpec,
    /// `rope_scaling`, or `Value::Null`.
    rope_scaling: Value,
}

/// The file's latent attention, experts and YaRN (read as the engine reads the file).
pub(super) fn read(g: &GgufFile) -> Result<Deepseek, HfTwinError> {
    let cfg = ModelConfig::from_gguf(g).map_err(|e| meta_err("deepseek2", e.to_string()))?;
    let (Some(mla), Some(moe)) = (cfg.mla, cfg.moe) else {
        return Err(meta_err("deepseek2", "no latent attention or experts read"));
    };
    if moe.n_experts == 0 || moe.shared_ff % moe.expert_ff != 0 {
        return Err(meta_err(
            "deepseek2.expert_shared_count",
            format!(
                "shared width {} is not a whole number of {}-wide experts",
                moe.shared_ff, moe.expert_ff
            ),
        ));
    }
    let key = |k: &str| format!("deepseek2.{k}");
    let rope_scaling = match g.get_str(&key("rope.scaling.type")) {
        None | Some("none") => Value::Null,
        Some("yarn") => {
            let num = |k: &str| {
                g.get_f64(&key(k))
                    .map(|v| v as f32)
                    .ok_or_else(|| meta_err(&key(k), "missing or not a number"))
            };
            let factor = num("rope.scaling.factor")?;
            let orig = g
                .get_u64(&key("rope.scaling.original_context_length"))
                .ok_or_else(|| meta_err(&key("rope.scaling.original_context_length"), "missing"))?;
            let stored = num("rope.scaling.yarn_log_multiplier")?;
            let m = mscale_all_dim(stored)?;
            json!({
                "type": "yarn",
                "factor": json_f32(factor),
                "original_max_position_embeddings": orig,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": m,
                "mscale_all_dim": m,
            })
        }
        Some(other) => {
            return Err(meta_err(
                &key("rope.scaling.type"),
                format!("{other:?}: only YaRN has a DeepSeek config.json form"),
            ))
        }
    };
    Ok(Deepseek {
        mla,
        moe,
        rope_scaling,
    })
}

/// `mscale_all_dim` whose `0.1 * m` (the converter's, in f64, stored as f32) is `stored`: the
/// shortest decimal of `stored / 0.1`.
fn mscale_all_dim(stored: f32) -> Result<Value, HfTwinError> {
    let m: f64 = format!("{}", (stored as f64 / 0.1) as f32)
        .parse()
        .expect("a float's own display parses");
    if ((0.1 * m) as f32).to_bits() != stored.to_bits() {
        return Err(meta_err(
            "deepseek2.rope.scaling.yarn_log_multiplier",
            format!("{stored} is not 0.1 * mscale_all_dim in f32 for mscale_all_dim {m}"),
        ));
    }
    Ok(json!(m))
}

/// DeepSeek's keys of `config.json` (over the shared ones `c` holds).
pub(super) fn config(c: &mut BTreeMap<&str, Value>, hp: &Hp, d: &Deepseek) {
    let (mla, moe) = (d.mla, d.moe);
    // DeepSeek-V2's code scales the weights only when it does not renormalise them, and routes
    // greedily without a correction bias: its schema only where that is the file's maths.
    let v2 = moe.gating == Gating::Softmax
        && moe.groups.is_none()
        && !moe.selection_bias
        && (moe.weights_scale == 1.0 || !moe.norm_top_k);
    let (class, model_type) = if v2 {
        ("DeepseekV2ForCausalLM", "deepseek_v2")
    } else {
        ("DeepseekV3ForCausalLM", "deepseek_v3")
    };
    c.insert("architectures", json!([class]));
    c.insert("model_type", json!(model_type));
    // DeepSeek's heads are qk_nope + qk_rope wide; its kv_b_proj up-projects every head.
    c.remove("head_dim");
    c.insert("num_key_value_heads", json!(hp.heads));
    c.insert("hidden_act", json!("silu"));
    c.insert("attention_bias", json!(false));
    c.insert(
        "q_lora_rank",
        match mla.q_lora_rank {
            0 => Value::Null,
            r => json!(r),
        },
    );
    c.insert("kv_lora_rank", json!(mla.kv_lora_rank));
    c.insert("qk_nope_head_dim", json!(mla.qk_nope));
    c.insert("qk_rope_head_dim", json!(mla.qk_rope));
    c.insert("v_head_dim", json!(mla.v_head_dim));
    c.insert("n_routed_experts", json!(moe.n_experts));
    c.insert("num_experts_per_tok", json!(moe.n_used));
    c.insert("moe_intermediate_size", json!(moe.expert_ff));
    c.insert("n_shared_experts", json!(moe.shared_ff / moe.expert_ff));
    c.insert("first_k_dense_replace", json!(moe.dense_lead));
    c.insert("moe_layer_freq", json!(1));
    c.insert("norm_topk_prob", json!(moe.norm_top_k));
    c.insert("routed_scaling_factor", json_f32(moe.weights_scale));
    let scoring = match moe.gating {
        Gating::Softmax => "softmax",
        Gating::Sigmoid => "sigmoid",
    };
    c.insert("scoring_func", json!(scoring));
    let (groups, used) = moe.groups.unwrap_or((1, 1));
    c.insert("n_group", json!(groups));
    c.insert("topk_group", json!(used));
    c.insert("topk_method", json!(if v2 { "greedy" } else { "noaux_tc" }));
    c.insert("num_nextn_predict_layers", json!(0));
    c.insert("ep_size", json!(1));
    c.insert("aux_loss_alpha", json!(0.001));
    c.insert("seq_aux", json!(true));
    c.insert("rope_scaling", d.rope_scaling.clone());
}

/// One tensor as it is, `[out, in]` (f32 tensors stay f32).
fn put(
    g: &GgufFile,
    gguf: &str,
    hf: String,
    dtype: HfDtype,
    used: &mut Vec<String>,
    out: &mut Vec<Out>,
) -> Result<(), HfTwinError> {
    let info = g
        .tensor_info(gguf)
        .ok_or_else(|| tensor_err(gguf, "missing"))?;
    let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
    let dtype = if info.ty == GgmlType::F32 {
        HfDtype::F32
    } else {
        dtype
    };
    out.push(Out {
        name: hf,
        dtype,
        shape,
        data: dtype.encode(&tensor_f32(g, gguf)?),
    });
    used.push(gguf.to_string());
    Ok(())
}

/// DeepSeek's `kv_b_proj` (`[heads * (nope + v), latent]`) from `attn_k_b`
/// (`[heads, latent, nope]`) and `attn_v_b` (`[heads, v, latent]`).
fn kv_b(g: &GgufFile, i: usize, hp: &Hp, mla: MlaSpec) -> Result<Vec<f32>, HfTwinError> {
    let (kn, vn) = (
        format!("blk.{i}.attn_k_b.weight"),
        format!("blk.{i}.attn_v_b.weight"),
    );
    let (heads, nope, v, latent) = (hp.heads, mla.qk_nope, mla.v_head_dim, mla.kv_lora_rank);
    let k = tensor_f32(g, &kn)?;
    let vb = tensor_f32(g, &vn)?;
    if k.len() != heads * latent * nope || vb.len() != heads * v * latent {
        return Err(tensor_err(
            &kn,
            format!("{} and {} values for {heads} heads", k.len(), vb.len()),
        ));
    }
    let per = nope + v;
    let mut kv = vec![0f32; heads * per * latent];
    for h in 0..heads {
        for r in 0..nope {
            for c in 0..latent {
                kv[(h * per + r) * latent + c] = k[(h * latent + c) * nope + r];
            }
        }
        let rows = (h * per + nope) * latent..(h + 1) * per * latent;
        kv[rows].copy_from_slice(&vb[h * v * latent..(h + 1) * v * latent]);
    }
    Ok(kv)
}

/// One deepseek2 layer in DeepSeek's module names.
pub(super) fn layer(
    g: &GgufFile,
    hp: &Hp,
    d: &Deepseek,
    i: usize,
    dtype: HfDtype,
    used: &mut Vec<String>,
    out: &mut Vec<Out>,
) -> Result<(), HfTwinError> {
    let gn = |t: &str| format!("blk.{i}.{t}");
    let hn = |t: &str| format!("model.layers.{i}.{t}");
    let (mla, moe) = (d.mla, d.moe);
    let mut plain = |gguf: &str, hf: &str| put(g, &gn(gguf), hn(hf), dtype, used, out);
    plain("attn_norm.weight", "input_layernorm.weight")?;
    if mla.q_lora_rank > 0 {
        plain("attn_q_a.weight", "self_attn.q_a_proj.weight")?;
        plain("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight")?;
        plain("attn_q_b.weight", "self_attn.q_b_proj.weight")?;
    } else {
        plain("attn_q.weight", "self_attn.q_proj.weight")?;
    }
    plain(
        "attn_kv_a_mqa.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
    )?;
    plain("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight")?;
    plain("attn_output.weight", "self_attn.o_proj.weight")?;
    plain("ffn_norm.weight", "post_attention_layernorm.weight")?;
    if i < moe.dense_lead {
        for t in ["gate", "up", "down"] {
            plain(&format!("ffn_{t}.weight"), &format!("mlp.{t}_proj.weight"))?;
        }
    } else {
        plain("ffn_gate_inp.weight", "mlp.gate.weight")?;
        if moe.selection_bias {
            plain("exp_probs_b.bias", "mlp.gate.e_score_correction_bias")?;
        }
        if moe.shared_ff > 0 {
            for t in ["gate", "up", "down"] {
                plain(
                    &format!("ffn_{t}_shexp.weight"),
                    &format!("mlp.shared_experts.{t}_proj.weight"),
                )?;
            }
        }
    }
    let kb_type = g
        .tensor_info(&gn("attn_k_b.weight"))
        .ok_or_else(|| tensor_err(&gn("attn_k_b.weight"), "missing"))?
        .ty;
    let kv_dtype = if kb_type == GgmlType::F32 {
        HfDtype::F32
    } else {
        dtype
    };
    let kv = kv_b(g, i, hp, mla)?;
    out.push(Out {
        name: hn("self_attn.kv_b_proj.weight"),
        dtype: kv_dtype,
        shape: vec![hp.heads * (mla.qk_nope + mla.v_head_dim), mla.kv_lora_rank],
        data: kv_dtype.encode(&kv),
    });
    used.push(gn("attn_k_b.weight"));
    used.push(gn("attn_v_b.weight"));
    if i >= moe.dense_lead {
        experts(g, hp, i, dtype, used, out)?;
    }
    Ok(())
}

//! The tensors a family's model uses, and the refusal of any other a file carries: a tensor the
//! engine would not read could change the maths (llama.cpp applies an attention output bias, an
//! output bias, FFN biases, a fused Q/K/V projection where a file has them), so it stops the load
//! naming it. No tensor is allowed through unread: llama.cpp's loader, too, refuses a file with
//! tensors its graph does not create.
//!
//! What is applied where present: Q/K/V biases (`attn_{q,k,v}.bias`) on every family, as
//! llama.cpp's `create_tensor_qkv` reads them for all of these (each one optional; a missing
//! one adds zeros); `output.weight` (else the embedding is the head); Llama's `rope_freqs.weight`.
//! `agent/src/model/weights.rs` reads exactly these and checks that it read every tensor.

use crate::{Arch, HparamsError, ModelConfig};
use npu_gguf::GgufFile;

/// The Q/K/V bias tensors of a layer, each optional.
pub const QKV_BIASES: [&str; 3] = ["attn_q.bias", "attn_k.bias", "attn_v.bias"];

/// Refuses the first tensor the model does not use, and notes whether the file has Q/K/V
/// biases (`cfg.qkv_bias`).
pub(super) fn check(f: &GgufFile, cfg: &mut ModelConfig) -> Result<(), HparamsError> {
    check_names(f.tensors().iter().map(|t| t.name.as_str()), cfg)
}

/// [`check`] over tensor names in GGUF's naming (a directory's, once mapped).
pub(crate) fn check_names<'a>(
    names: impl Iterator<Item = &'a str>,
    cfg: &mut ModelConfig,
) -> Result<(), HparamsError> {
    let arch = cfg.arch.name();
    let mut qkv_bias = false;
    let mut selection_bias = false;
    for name in names {
        let why = match name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((layer, rest)) => match layer.parse::<usize>() {
                Ok(il) if il < cfg.n_layers && cfg.mla.is_some() => {
                    if rest == "exp_probs_b.bias" {
                        selection_bias = true;
                    }
                    mla_layer_tensor(cfg, il, rest)
                }
                Ok(il) if il < cfg.n_layers => {
                    if QKV_BIASES.contains(&rest) {
                        qkv_bias = true;
                    }
                    layer_tensor(cfg, rest)
                }
                Ok(il) => Some(format!(
                    "of layer {il}, beyond {arch}.block_count = {}",
                    cfg.n_layers
                )),
                Err(_) => Some(unknown(arch)),
            },
            None => global_tensor(cfg, name),
        };
        if let Some(why) = why {
            return Err(HparamsError::Unsupported(format!(
                "{arch} model: tensor {name:?} is {why}"
            )));
        }
    }
    cfg.qkv_bias = qkv_bias;
    if let Some(m) = cfg.moe.as_mut() {
        m.selection_bias = selection_bias;
    }
    Ok(())
}

/// Why a layer's tensor of a latent-attention model (deepseek2) is not used (None: it is), as
/// llama.cpp's deepseek2 creates them: the query through its low-rank pair or whole, the
/// latent's projection and norm, the split key/value up-projections, a dense FFN in the
/// leading layers and experts (with an optional selection bias and the shared experts) after.
fn mla_layer_tensor(cfg: &ModelConfig, il: usize, rest: &str) -> Option<String> {
    let (Some(mla), Some(moe)) = (cfg.mla, cfg.moe) else {
        return Some(unknown(cfg.arch.name()));
    };
    let lora_q = mla.q_lora_rank > 0;
    let experts = moe.is_moe_layer(il);
    let used = match rest {
        "attn_norm.weight"
        | "attn_kv_a_mqa.weight"
        | "attn_kv_a_norm.weight"
        | "attn_k_b.weight"
        | "attn_v_b.weight"
        | "attn_output.weight"
        | "ffn_norm.weight" => true,
        "attn_q_a.weight" | "attn_q_a_norm.weight" | "attn_q_b.weight" => lora_q,
        "attn_q.weight" => !lora_q,
        "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight" => !experts,
        "ffn_gate_inp.weight"
        | "ffn_gate_exps.weight"
        | "ffn_up_exps.weight"
        | "ffn_down_exps.weight"
        | "exp_probs_b.bias" => experts,
        "ffn_gate_shexp.weight" | "ffn_up_shexp.weight" | "ffn_down_shexp.weight" => {
            experts && moe.shared_ff > 0
        }
        _ => false,
    };
    if used {
        return None;
    }
    Some(match rest {
        "attn_kv_b.weight" => "the unsplit key/value up-projection of an older conversion; the \
                               engine runs latent attention from attn_k_b and attn_v_b"
            .into(),
        "ffn_gate_up_exps.weight" => "a fused gate/up expert tensor, which the engine does \
                                      not read"
            .into(),
        _ => format!(
            "not created by llama.cpp's deepseek2 for layer {il} of this file (query rank {}, \
             {} leading dense layers, {} shared FFN width), so not used by the engine",
            mla.q_lora_rank, moe.dense_lead, moe.shared_ff
        ),
    })
}

fn unknown(arch: &str) -> String {
    format!(
        "not used by the engine's {arch} model, and it may change the maths (llama.cpp's loader \
         refuses a tensor its graph does not create, too)"
    )
}

/// Why a tensor outside the layers is not used (None: it is).
fn global_tensor(cfg: &ModelConfig, name: &str) -> Option<String> {
    let arch = cfg.arch.name();
    match name {
        "token_embd.weight" | "output_norm.weight" | "output.weight" => None,
        "rope_freqs.weight" if matches!(cfg.arch, Arch::Llama | Arch::Mistral) => None,
        "rope_freqs.weight" => Some(format!(
            "rope frequency factors, which llama.cpp's {arch} graph does not apply (it passes \
             none to its rope); the engine does not guess"
        )),
        "rope_factors_long.weight" | "rope_factors_short.weight" => {
            Some("a LongRoPE factor table; LongRoPE is not implemented".into())
        }
        "output.bias" => Some("an output bias, which the engine does not apply".into()),
        _ => Some(unknown(arch)),
    }
}

/// Why a layer's tensor (`rest`: its name after `blk.N.`) is not used (None: it is).
fn layer_tensor(cfg: &ModelConfig, rest: &str) -> Option<String> {
    let arch = cfg.arch.name();
    let used = match rest {
        "attn_norm.weight" | "attn_q.weight" | "attn_k.weight" | "attn_v.weight"
        | "attn_output.weight" | "ffn_norm.weight" => true,
        _ if QKV_BIASES.contains(&rest) => true,
        "attn_q_norm.weight" | "attn_k_norm.weight" => cfg.qk_norm,
        "post_attention_norm.weight" | "post_ffw_norm.weight" => cfg.post_norms,
        "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight" => cfg.moe.is_none(),
        "ffn_gate_inp.weight"
        | "ffn_gate_exps.weight"
        | "ffn_up_exps.weight"
        | "ffn_down_exps.weight" => cfg.moe.is_some(),
        _ => false,
    };
    if used {
        return None;
    }
    Some(match rest {
        "attn_output.bias" => "an attention output bias, which the engine does not apply".into(),
        "ffn_gate.bias" | "ffn_up.bias" | "ffn_down.bias" => {
            "a feed-forward bias, which the engine does not apply".into()
        }
        "attn_qkv.weight" | "attn_qkv.bias" => "part of a fused Q/K/V projection, which the \
                                                 engine does not read (it reads attn_q, attn_k \
                                                 and attn_v)"
            .into(),
        "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight" => format!(
            "a dense feed-forward weight in a {arch} model, whose every layer is routed experts"
        ),
        "ffn_gate_inp.weight"
        | "ffn_gate_exps.weight"
        | "ffn_up_exps.weight"
        | "ffn_down_exps.weight" => {
            format!("an expert weight, and the {arch} architecture runs no experts (qwen3moe does)")
        }
        "attn_q_norm.weight" | "attn_k_norm.weight" => {
            format!("a per-head Q/K norm, which llama.cpp's {arch} graph does not apply")
        }
        "post_attention_norm.weight" | "post_ffw_norm.weight" => {
            format!("a post-attention/post-FFN norm, which llama.cpp's {arch} graph does not apply")
        }
        _ => unknown(arch),
    })
}

//! The keys of a family's namespace (`{arch}.*`) that the engine knows, and the refusal of the
//! others: a key that changes the maths and that the engine does not apply stops the load naming
//! it, never run wrong. Each key is one of:
//!
//! - read where the model is built (`hparams.rs`, `family.rs`), bounded there;
//! - without effect on the logits (the training context's bookkeeping, pooling of embeddings,
//!   a LayerNorm epsilon these RMS-normed families never use);
//! - taken at its neutral value only (no soft-capping, no extra scale, causal attention, ...):
//!   another value means a computation the engine does not do, so it is refused, also where
//!   llama.cpp's graph for the family would ignore the key (the file then means a model neither
//!   computes);
//! - unknown: refused, since it may change the maths.
//!
//! Keys outside the namespace (`general.*`, `tokenizer.*`, `quantize.*`, `split.*`, ...) name,
//! describe or tokenize; they are not hyper-parameters of the forward pass and pass.

use super::read::show;
use crate::{Arch, HparamsError, ModelConfig};
use npu_gguf::{GgufFile, MetaValue};

/// Refuses the first key of the family's namespace that the engine does not apply.
pub(super) fn check(f: &GgufFile, cfg: &ModelConfig) -> Result<(), HparamsError> {
    let arch = cfg.arch.name();
    let prefix = format!("{arch}.");
    for key in f.keys() {
        let Some(name) = key.strip_prefix(&prefix) else {
            continue;
        };
        let v = f.get(key).expect("a listed key");
        check_key(cfg, key, name, v, f)?;
    }
    Ok(())
}

fn check_key(
    cfg: &ModelConfig,
    key: &str,
    name: &str,
    v: &MetaValue,
    f: &GgufFile,
) -> Result<(), HparamsError> {
    let arch = cfg.arch.name();
    let moe = cfg.arch == Arch::Qwen3Moe;
    let gemma3 = cfg.arch == Arch::Gemma3;
    let deepseek2 = cfg.arch == Arch::Deepseek2;
    let refuse = |why: &str| {
        Err(HparamsError::Unsupported(format!(
            "{key} = {}: {why}",
            show(v)
        )))
    };
    // Refused unless every value of `v` is one of `neutral`.
    let neutral = |neutral: &[f64], why: &str| {
        if is_neutral(v, neutral) {
            Ok(())
        } else {
            refuse(why)
        }
    };
    match name {
        // Read (and bounded) where the model is built.
        "block_count"
        | "embedding_length"
        | "feed_forward_length"
        | "attention.head_count"
        | "attention.head_count_kv"
        | "attention.key_length"
        | "attention.value_length"
        | "vocab_size"
        | "context_length"
        | "attention.layer_norm_rms_epsilon"
        | "rope.dimension_count"
        | "rope.freq_base"
        | "rope.scaling.type"
        | "rope.scaling.factor"
        | "rope.scale_linear" => Ok(()),
        "expert_count" | "expert_used_count" | "expert_feed_forward_length" if moe => Ok(()),
        // Read by the deepseek2 hook (`deepseek2.rs`).
        "expert_count"
        | "expert_used_count"
        | "expert_feed_forward_length"
        | "expert_shared_count"
        | "expert_weights_scale"
        | "expert_weights_norm"
        | "expert_gating_func"
        | "expert_group_count"
        | "expert_group_used_count"
        | "leading_dense_block_count"
        | "attention.q_lora_rank"
        | "attention.kv_lora_rank"
        | "attention.key_length_mla"
        | "attention.value_length_mla"
        | "rope.scaling.yarn_log_multiplier"
        | "rope.scaling.attn_factor"
            if deepseek2 =>
        {
            Ok(())
        }
        "expert_shared_feed_forward_length" if deepseek2 => {
            let shared = cfg.moe.map_or(0, |m| m.shared_ff);
            neutral(
                &[shared as f64],
                &format!(
                    "llama.cpp's deepseek2 runs shared experts {shared} wide \
                     (expert_feed_forward_length * expert_shared_count)"
                ),
            )
        }
        "rope.scaling.yarn_beta_fast" if deepseek2 => neutral(
            &[32.0],
            "llama.cpp's deepseek2 turns YaRN with beta_fast 32 whatever the file says",
        ),
        "rope.scaling.yarn_beta_slow" if deepseek2 => neutral(
            &[1.0],
            "llama.cpp's deepseek2 turns YaRN with beta_slow 1 whatever the file says",
        ),
        "attention.sliding_window"
        | "attention.sliding_window_pattern"
        | "rope.freq_base_swa"
        | "final_logit_softcapping"
            if gemma3 =>
        {
            Ok(())
        }

        // No effect on the logits: the original context of YaRN (refused with YaRN), the
        // fine-tuning flag of rope scaling, embedding pooling, LayerNorm's epsilon (these
        // families use RMS norms only), the old converter's note of its weight permutation.
        "rope.scaling.original_context_length"
        | "rope.scaling.finetuned"
        | "pooling_type"
        | "attention.layer_norm_epsilon"
        | "tensor_data_layout" => Ok(()),

        // Neutral values only.
        "expert_count" | "expert_used_count" => neutral(
            &[0.0],
            &format!("routed experts are not run on the {arch} architecture (qwen3moe runs them)"),
        ),
        "expert_group_count" => neutral(
            &[0.0, 1.0],
            "group-limited expert routing is not implemented",
        ),
        "expert_group_used_count" => {
            // Meaningful only with several groups (refused above).
            let groups = f.get(&format!("{arch}.expert_group_count"));
            if groups.is_none_or(|g| is_neutral(g, &[0.0, 1.0])) {
                Ok(())
            } else {
                refuse("group-limited expert routing is not implemented")
            }
        }
        "expert_shared_count" | "expert_shared_feed_forward_length" => {
            neutral(&[0.0], "shared experts are not implemented")
        }
        "expert_weights_scale" => neutral(
            &[0.0, 1.0],
            "scaling the routed experts' weights is not implemented",
        ),
        // llama.cpp's qwen3moe always renormalises the chosen experts' weights, as the engine.
        "expert_weights_norm" if moe => neutral(
            &[1.0],
            "the engine renormalises the chosen experts' weights, as llama.cpp's qwen3moe does",
        ),
        // 1: softmax (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX), what the qwen3moe
        // graph uses whatever the file says.
        "expert_gating_func" if moe => neutral(
            &[1.0],
            "the engine gates experts by softmax (1), as llama.cpp's qwen3moe graph does",
        ),
        "leading_dense_block_count" | "nextn_predict_layers" => neutral(
            &[0.0],
            "layers other than the family's block (dense leading layers, next-token prediction \
             layers) are not implemented",
        ),
        "rope.scaling.attn_factor" => neutral(
            &[1.0],
            "scaling the rope's cos/sin (and so the attention scores) is not implemented",
        ),
        "rope.scaling.alpha" => neutral(&[0.0], "NTK-alpha rope scaling is not implemented"),
        "rope.scaling.yarn_ext_factor"
        | "rope.scaling.yarn_attn_factor"
        | "rope.scaling.yarn_beta_fast"
        | "rope.scaling.yarn_beta_slow"
        | "rope.scaling.yarn_log_multiplier" => {
            refuse("YaRN rope scaling is not implemented, so its parameters are not applied")
        }
        "rope.dimension_sections" => {
            neutral(&[0.0], "multi-section (M-RoPE) rotation is not implemented")
        }
        "rope.dimension_count_swa" | "attention.key_length_swa" | "attention.value_length_swa" => {
            neutral(
                &[cfg.head_dim as f64],
                &format!(
                    "sliding-window layers with a head width other than {} are not implemented",
                    cfg.head_dim
                ),
            )
        }
        "attention.scale" => {
            let want = cfg.attn_scale as f64;
            match v.as_f64() {
                Some(x) if x == 0.0 || (x - want).abs() <= 1e-6 * want => Ok(()),
                _ => refuse(&format!(
                    "the engine scales attention scores by {want} (1/sqrt of the head width), \
                     as llama.cpp's {arch} graph does"
                )),
            }
        }
        "attn_logit_softcapping" => {
            neutral(&[0.0], "attention logit soft-capping is not implemented")
        }
        "final_logit_softcapping" => neutral(&[0.0], "final logit soft-capping is not implemented"),
        "router_logit_softcapping" => {
            neutral(&[0.0], "router logit soft-capping is not implemented")
        }
        "attention.clamp_kqv" => neutral(&[0.0], "clamping Q/K/V is not implemented"),
        "attention.max_alibi_bias" => neutral(&[0.0], "ALiBi attention is not implemented"),
        "attention.causal" => neutral(&[1.0], "non-causal attention is not implemented"),
        "attention.sliding_window" => neutral(
            &[0.0],
            &format!(
                "sliding-window attention is not run on the {arch} architecture (every \
                 position is attended, as llama.cpp's {arch} graph does)"
            ),
        ),
        "logit_scale" | "residual_scale" | "embedding_scale" => neutral(
            &[0.0, 1.0],
            "Granite-style logit, residual and embedding scales are not implemented",
        ),
        "swiglu_clamp_exp" | "swiglu_clamp_shexp" => {
            neutral(&[0.0], "clamping the SwiGLU activation is not implemented")
        }
        "use_parallel_residual" => neutral(&[0.0], "parallel residuals are not implemented"),
        _ => refuse(&format!(
            "the engine does not know this key of the {arch} architecture, and it may change \
             the maths"
        )),
    }
}

/// Whether `v` (a number, a bool as 0/1, or an array of them) holds only values of `neutral`.
fn is_neutral(v: &MetaValue, neutral: &[f64]) -> bool {
    match v {
        MetaValue::Array(a) => a.iter().all(|x| is_neutral(x, neutral)),
        MetaValue::Bool(b) => neutral.contains(&f64::from(u8::from(*b))),
        MetaValue::String(_) => false,
        _ => v.as_f64().is_some_and(|x| neutral.contains(&x)),
    }
}

//! Hugging Face tensor names to the GGUF names the loader reads, per family, with what the
//! conversion does to the values on the way (as `convert_hf_to_gguf.py` does it): Llama's Q/K
//! rows permuted so its rope pairs adjacent dimensions, Gemma's norm weights stored minus one,
//! Qwen3-MoE's per-expert matrices stacked into one tensor per layer.

use crate::Arch;

/// What a tensor's values go through between the directory and the loader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fix {
    None,
    /// Output rows regrouped per head from halves to adjacent pairs (`heads` heads).
    Permute {
        heads: usize,
    },
    /// Gemma's RMS norms scale by `1 + w`: 1 added in f32.
    AddOne,
}

/// Where one HF tensor goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub gguf: String,
    pub fix: Fix,
    /// The expert index of a per-expert matrix (stacked into `gguf`).
    pub expert: Option<usize>,
}

/// Tensors a directory may carry that the forward pass does not compute with: the rope's
/// inverse frequencies (transformers recomputes them from the config) and an FP8 KV cache's
/// scales (the engine keeps K and V in f16/f32, so nothing is scaled).
pub(crate) fn ignored(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
        || name.ends_with(".self_attn.k_scale")
        || name.ends_with(".self_attn.v_scale")
}

/// The GGUF name of an HF weight (`None`: not a tensor of this family).
pub(crate) fn target(arch: Arch, name: &str, n_heads: usize, n_kv_heads: usize) -> Option<Target> {
    let plain = |g: &str| Target {
        gguf: g.to_string(),
        fix: Fix::None,
        expert: None,
    };
    let gemma = arch == Arch::Gemma3;
    let norm_fix = if gemma { Fix::AddOne } else { Fix::None };
    match name {
        "model.embed_tokens.weight" => return Some(plain("token_embd.weight")),
        "lm_head.weight" => return Some(plain("output.weight")),
        "model.norm.weight" => {
            return Some(Target {
                gguf: "output_norm.weight".into(),
                fix: norm_fix,
                expert: None,
            })
        }
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let il: usize = layer.parse().ok()?;
    if layer != il.to_string() {
        return None;
    }
    let llama = matches!(arch, Arch::Llama | Arch::Mistral);
    let t = |g: &str, fix: Fix| {
        Some(Target {
            gguf: format!("blk.{il}.{g}"),
            fix,
            expert: None,
        })
    };
    let permute = |heads: usize| {
        if llama {
            Fix::Permute { heads }
        } else {
            Fix::None
        }
    };
    match rest {
        "input_layernorm.weight" => t("attn_norm.weight", norm_fix),
        "post_attention_layernorm.weight" if gemma => t("post_attention_norm.weight", norm_fix),
        "post_attention_layernorm.weight" => t("ffn_norm.weight", Fix::None),
        "pre_feedforward_layernorm.weight" if gemma => t("ffn_norm.weight", norm_fix),
        "post_feedforward_layernorm.weight" if gemma => t("post_ffw_norm.weight", norm_fix),
        "self_attn.q_proj.weight" => t("attn_q.weight", permute(n_heads)),
        "self_attn.k_proj.weight" => t("attn_k.weight", permute(n_kv_heads)),
        "self_attn.v_proj.weight" => t("attn_v.weight", Fix::None),
        "self_attn.o_proj.weight" => t("attn_output.weight", Fix::None),
        "self_attn.q_proj.bias" => t("attn_q.bias", permute(n_heads)),
        "self_attn.k_proj.bias" => t("attn_k.bias", permute(n_kv_heads)),
        "self_attn.v_proj.bias" => t("attn_v.bias", Fix::None),
        "self_attn.o_proj.bias" => t("attn_output.bias", Fix::None),
        "self_attn.q_norm.weight" => t("attn_q_norm.weight", norm_fix),
        "self_attn.k_norm.weight" => t("attn_k_norm.weight", norm_fix),
        "mlp.gate_proj.weight" => t("ffn_gate.weight", Fix::None),
        "mlp.up_proj.weight" => t("ffn_up.weight", Fix::None),
        "mlp.down_proj.weight" => t("ffn_down.weight", Fix::None),
        "mlp.gate_proj.bias" => t("ffn_gate.bias", Fix::None),
        "mlp.up_proj.bias" => t("ffn_up.bias", Fix::None),
        "mlp.down_proj.bias" => t("ffn_down.bias", Fix::None),
        "mlp.gate.weight" if arch == Arch::Qwen3Moe => t("ffn_gate_inp.weight", Fix::None),
        _ => {
            let rest = rest.strip_prefix("mlp.experts.")?;
            let (e, which) = rest.split_once('.')?;
            let e: usize = e.parse().ok()?;
            let g = match which {
                "gate_proj.weight" => "ffn_gate_exps.weight",
                "up_proj.weight" => "ffn_up_exps.weight",
                "down_proj.weight" => "ffn_down_exps.weight",
                _ => return None,
            };
            Some(Target {
                gguf: format!("blk.{il}.{g}"),
                fix: Fix::None,
                expert: Some(e),
            })
        }
    }
}

/// `convert_hf_to_gguf.py`'s `LlamaModel.permute`: a projection's output rows, per head, from
/// (half, pair) order to (pair, half): row `h*d + 2*i + j` of the result is row
/// `h*d + j*d/2 + i` of the input (`d` rows a head). `row_bytes` is one row's size.
pub(crate) fn permute_rows(data: &[u8], heads: usize, row_bytes: usize) -> Option<Vec<u8>> {
    let rows = data.len().checked_div(row_bytes)?;
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return None;
    }
    let d = rows / heads;
    let mut out = Vec::with_capacity(data.len());
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let src = h * d + j * (d / 2) + i;
                out.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_matches_the_converter_on_a_small_case() {
        // 2 heads of 4 rows: per head (0,1,2,3) becomes (0,2,1,3).
        let rows: Vec<u8> = (0..8).collect();
        assert_eq!(
            permute_rows(&rows, 2, 1).unwrap(),
            vec![0, 2, 1, 3, 4, 6, 5, 7]
        );
        assert!(permute_rows(&rows, 3, 1).is_none());
    }

    #[test]
    fn names_map_per_family() {
        let t = target(
            Arch::Gemma3,
            "model.layers.3.post_attention_layernorm.weight",
            4,
            1,
        );
        assert_eq!(t.unwrap().gguf, "blk.3.post_attention_norm.weight");
        let t = target(
            Arch::Qwen2,
            "model.layers.3.post_attention_layernorm.weight",
            4,
            1,
        );
        assert_eq!(t.unwrap().gguf, "blk.3.ffn_norm.weight");
        let t = target(Arch::Llama, "model.layers.0.self_attn.k_proj.weight", 4, 2).unwrap();
        assert_eq!(t.fix, Fix::Permute { heads: 2 });
        let t = target(
            Arch::Qwen3Moe,
            "model.layers.1.mlp.experts.7.up_proj.weight",
            4,
            2,
        );
        assert_eq!(t.unwrap().expert, Some(7));
        assert!(target(Arch::Llama, "model.layers.01.mlp.up_proj.weight", 4, 2).is_none());
        assert!(target(Arch::Llama, "model.vision_tower.weight", 4, 2).is_none());
    }
}

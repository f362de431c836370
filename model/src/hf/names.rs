//! Hugging Face tensor names to the GGUF names the loader reads, per family, with what the
//! conversion does to the values on the way (as `convert_hf_to_gguf.py` does it): Llama's Q/K
//! rows permuted so its rope pairs adjacent dimensions, Gemma's norm weights stored minus one,
//! Qwen3-MoE's and DeepSeek's per-expert matrices stacked into one tensor per layer, DeepSeek's
//! `kv_b_proj` split into the per-head key and value up-projections (`attn_k_b` transposed,
//! `attn_v_b`) as its conversion for latent attention splits it.

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
    /// DeepSeek's `kv_b_proj` (`[heads * (nope + v), latent]`): each head's first `nope` rows,
    /// transposed (`attn_k_b`, `[heads, latent, nope]`).
    KeyUp,
    /// Each head's last `v` rows of `kv_b_proj` (`attn_v_b`, `[heads, v, latent]`).
    ValueUp,
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

/// The index of a `model.layers.N.` tensor's layer.
pub(crate) fn layer_of(name: &str) -> Option<usize> {
    let (layer, _) = name.strip_prefix("model.layers.")?.split_once('.')?;
    layer.parse().ok()
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
        "mlp.gate.weight" if matches!(arch, Arch::Qwen3Moe | Arch::Deepseek2) => {
            t("ffn_gate_inp.weight", Fix::None)
        }
        _ if arch == Arch::Deepseek2 && deepseek(rest).is_some() => {
            let (g, fix) = deepseek(rest)?;
            t(g, fix)
        }
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

/// DeepSeek's own layer tensors (after `model.layers.N.`): latent attention, the correction
/// bias and the shared experts. `kv_b_proj` maps to its key half here; the loader adds the value
/// half (`value_twin`).
fn deepseek(rest: &str) -> Option<(&'static str, Fix)> {
    Some(match rest {
        "self_attn.q_a_proj.weight" => ("attn_q_a.weight", Fix::None),
        "self_attn.q_a_layernorm.weight" => ("attn_q_a_norm.weight", Fix::None),
        "self_attn.q_b_proj.weight" => ("attn_q_b.weight", Fix::None),
        "self_attn.kv_a_proj_with_mqa.weight" => ("attn_kv_a_mqa.weight", Fix::None),
        "self_attn.kv_a_layernorm.weight" => ("attn_kv_a_norm.weight", Fix::None),
        "self_attn.kv_b_proj.weight" => ("attn_k_b.weight", Fix::KeyUp),
        "mlp.gate.e_score_correction_bias" => ("exp_probs_b.bias", Fix::None),
        "mlp.shared_experts.gate_proj.weight" => ("ffn_gate_shexp.weight", Fix::None),
        "mlp.shared_experts.up_proj.weight" => ("ffn_up_shexp.weight", Fix::None),
        "mlp.shared_experts.down_proj.weight" => ("ffn_down_shexp.weight", Fix::None),
        _ => return None,
    })
}

/// The value half of a `kv_b_proj` target (`attn_v_b` beside `attn_k_b`).
pub(crate) fn value_twin(t: &Target) -> Option<Target> {
    if t.fix != Fix::KeyUp {
        return None;
    }
    Some(Target {
        gguf: t.gguf.replace("attn_k_b.weight", "attn_v_b.weight"),
        fix: Fix::ValueUp,
        expert: None,
    })
}

/// One half of DeepSeek's `kv_b_proj` (`heads * (nope + v)` rows of `latent` elements of
/// `elem` bytes), as its conversion splits it: the key half transposed per head
/// (`[heads, latent, nope]`), or the value half as it is (`[heads, v, latent]`).
pub(crate) fn split_kv_b(
    data: &[u8],
    elem: usize,
    (heads, nope, v, latent): (usize, usize, usize, usize),
    fix: Fix,
) -> Option<Vec<u8>> {
    let per = nope + v;
    if data.len() != heads * per * latent * elem {
        return None;
    }
    let at = |row: usize, col: usize| &data[(row * latent + col) * elem..][..elem];
    let mut out = Vec::with_capacity(heads * latent * per * elem);
    for h in 0..heads {
        match fix {
            Fix::KeyUp => {
                for c in 0..latent {
                    for r in 0..nope {
                        out.extend_from_slice(at(h * per + r, c));
                    }
                }
            }
            Fix::ValueUp => {
                let rows = (h * per + nope) * latent * elem..(h + 1) * per * latent * elem;
                out.extend_from_slice(&data[rows]);
            }
            _ => return None,
        }
    }
    Some(out)
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
        let kb = target(
            Arch::Deepseek2,
            "model.layers.2.self_attn.kv_b_proj.weight",
            4,
            4,
        );
        let kb = kb.unwrap();
        assert_eq!(
            (kb.gguf.as_str(), kb.fix),
            ("blk.2.attn_k_b.weight", Fix::KeyUp)
        );
        assert_eq!(value_twin(&kb).unwrap().gguf, "blk.2.attn_v_b.weight");
        assert!(target(
            Arch::Qwen3,
            "model.layers.0.self_attn.kv_b_proj.weight",
            4,
            4
        )
        .is_none());
        assert_eq!(layer_of("model.layers.61.eh_proj.weight"), Some(61));
    }

    #[test]
    fn kv_b_splits_as_the_converter_splits_it() {
        // 1 head, nope 2, v 1, latent 3: rows k0 k1 v0 of 3 values each.
        let kv: Vec<u8> = (0..9).collect();
        // The key half transposed: [latent, nope].
        assert_eq!(
            split_kv_b(&kv, 1, (1, 2, 1, 3), Fix::KeyUp).unwrap(),
            vec![0, 3, 1, 4, 2, 5]
        );
        assert_eq!(
            split_kv_b(&kv, 1, (1, 2, 1, 3), Fix::ValueUp).unwrap(),
            vec![6, 7, 8]
        );
        assert!(split_kv_b(&kv, 1, (2, 2, 1, 3), Fix::KeyUp).is_none());
    }
}

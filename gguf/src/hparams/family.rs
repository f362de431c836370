//! The per-family hook of the hyper-parameter reader: what each architecture changes on top of
//! the shared Llama-shaped block, following llama.cpp's reading of the same GGUF keys (so a file
//! means here what it means there).

use super::{Arch, FfnAct, HparamsError, LayerSpec, ModelConfig, MoeSpec, RopeStyle};
use crate::GgufFile;

/// Gemma 3: every sixth layer attends globally, the others through the sliding window
/// (llama.cpp's `set_swa_pattern(6)`: layer il is local when `il % 6 < 5`).
const GEMMA3_SWA_PATTERN: usize = 6;
/// Gemma 3's local layers turn at their own base, unscaled.
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;

pub(super) fn adjust(f: &GgufFile, cfg: &mut ModelConfig) -> Result<(), HparamsError> {
    let arch = cfg.arch.name();
    let key = |k: &str| format!("{arch}.{k}");
    match cfg.arch {
        Arch::Llama | Arch::Mistral => {}
        Arch::Qwen2 => {
            cfg.qkv_bias = true;
            set_style(cfg, RopeStyle::Halves);
        }
        Arch::Qwen3 => {
            cfg.qk_norm = true;
            set_style(cfg, RopeStyle::Halves);
        }
        Arch::Qwen3Moe => {
            cfg.qk_norm = true;
            set_style(cfg, RopeStyle::Halves);
            let req =
                |k: &str| -> Result<usize, HparamsError> { Ok(f.require_u64(&key(k))? as usize) };
            let n_used = req("expert_used_count")?;
            let moe = MoeSpec {
                n_experts: req("expert_count")?,
                n_used,
                // As llama.cpp: the key, else the dense width shared among the used experts.
                expert_ff: match f.get_u64(&key("expert_feed_forward_length")) {
                    Some(v) => v as usize,
                    None => cfg.ff.checked_div(n_used).unwrap_or(0),
                },
                // llama.cpp's qwen3moe always renormalises the chosen experts' weights.
                norm_top_k: true,
            };
            if moe.n_experts == 0 || moe.n_used == 0 || moe.n_used > moe.n_experts {
                return Err(HparamsError::Inconsistent(format!(
                    "{} = {} experts used of {} = {}",
                    key("expert_used_count"),
                    moe.n_used,
                    key("expert_count"),
                    moe.n_experts
                )));
            }
            if moe.expert_ff == 0 {
                return Err(HparamsError::Inconsistent(format!(
                    "{} is 0",
                    key("expert_feed_forward_length")
                )));
            }
            cfg.moe = Some(moe);
        }
        Arch::Gemma3 => gemma3(f, cfg)?,
    }
    Ok(())
}

fn set_style(cfg: &mut ModelConfig, style: RopeStyle) {
    cfg.rope.style = style;
    for l in &mut cfg.layers {
        l.rope.style = style;
    }
}

fn gemma3(f: &GgufFile, cfg: &mut ModelConfig) -> Result<(), HparamsError> {
    let key = |k: &str| format!("gemma3.{k}");
    set_style(cfg, RopeStyle::Halves);
    cfg.qk_norm = true;
    cfg.post_norms = true;
    cfg.ffn_act = FfnAct::GeluTanh;
    cfg.embed_scale = Some((cfg.hidden as f32).sqrt());
    // Gemma 3 270M's residual stream passes 65504 by its ninth layer (seen over the Ascend
    // emulation's f16 activations: every token became id 0).
    cfg.wide_activations = true;
    // As llama.cpp: the 27B model (62 layers) scales by the hidden size per head, the others
    // by the key length.
    cfg.attn_scale = if cfg.n_layers == 62 {
        1.0 / ((cfg.hidden / cfg.n_heads) as f32).sqrt()
    } else {
        1.0 / (cfg.head_dim as f32).sqrt()
    };
    if let Some(cap) = f.get_f64(&key("final_logit_softcapping")) {
        if cap != 0.0 {
            return Err(HparamsError::Unsupported(format!(
                "{} = {cap} (final logit soft-capping is not implemented)",
                key("final_logit_softcapping")
            )));
        }
    }
    let window = f
        .get_u64(&key("attention.sliding_window"))
        .filter(|&w| w > 0);
    if let Some(w) = window {
        let w = u32::try_from(w).map_err(|_| {
            HparamsError::Inconsistent(format!(
                "{} = {w} is too large",
                key("attention.sliding_window")
            ))
        })?;
        let local_base = f
            .get_f64(&key("rope.freq_base_swa"))
            .map_or(GEMMA3_LOCAL_ROPE_BASE, |b| b as f32);
        let global = cfg.rope;
        let mut local = global;
        local.base = local_base;
        local.freq_scale = 1.0;
        local.factors = None;
        let local_layers = swa_layers(f, &key("attention.sliding_window_pattern"), cfg.n_layers)?;
        for (l, is_local) in cfg.layers.iter_mut().zip(local_layers) {
            *l = if is_local {
                LayerSpec {
                    rope: local,
                    window: Some(w),
                }
            } else {
                LayerSpec {
                    rope: global,
                    window: None,
                }
            };
        }
    }
    Ok(())
}

/// Which layers attend through the sliding window: the file's `sliding_window_pattern` (one
/// bool per layer, or a period n whose last layer is global), else every sixth layer global.
fn swa_layers(f: &GgufFile, key: &str, n_layers: usize) -> Result<Vec<bool>, HparamsError> {
    let period = |n: usize| -> Result<Vec<bool>, HparamsError> {
        if n == 0 {
            return Err(HparamsError::Inconsistent(format!("{key} = 0")));
        }
        Ok((0..n_layers).map(|il| il % n < n - 1).collect())
    };
    match f.get(key) {
        None => period(GEMMA3_SWA_PATTERN),
        Some(v) => {
            if let Some(n) = v.as_u64() {
                return period(n as usize);
            }
            let flags: Option<Vec<bool>> = v
                .as_array()
                .map(|a| a.iter().map(crate::MetaValue::as_bool).collect())
                .and_then(|f: Option<Vec<bool>>| f);
            match flags {
                Some(flags) if flags.len() == n_layers => Ok(flags),
                _ => Err(HparamsError::Inconsistent(format!(
                    "{key} must be a period or one bool per layer ({n_layers})"
                ))),
            }
        }
    }
}

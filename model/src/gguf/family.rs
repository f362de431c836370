//! The per-family hook of the hyper-parameter reader: what each architecture changes on top of
//! the shared Llama-shaped block, following llama.cpp's reading of the same GGUF keys (so a file
//! means here what it means there).

use super::read;
use crate::{Arch, FfnAct, HparamsError, LayerSpec, ModelConfig, MoeSpec, RopeStyle};
use npu_gguf::GgufFile;

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
        // Q/K/V biases are read where a file has them, on every family (`tensors`): llama.cpp
        // makes them optional everywhere, Qwen2's included.
        Arch::Qwen2 => set_style(cfg, RopeStyle::Halves),
        Arch::Qwen3 => {
            cfg.qk_norm = true;
            set_style(cfg, RopeStyle::Halves);
        }
        Arch::Qwen3Moe => {
            cfg.qk_norm = true;
            set_style(cfg, RopeStyle::Halves);
            let nl = Some(cfg.n_layers);
            let (count_key, used_key) = (key("expert_count"), key("expert_used_count"));
            let n_experts = read::within(
                &count_key,
                read::req_uint(f, &count_key, None)?,
                1,
                read::MAX_EXPERTS,
            )?;
            let n_used = read::req_uint(f, &used_key, nl)?;
            if n_used == 0 || n_used > n_experts as u64 {
                return Err(HparamsError::Inconsistent(format!(
                    "{used_key} = {n_used} experts used of {count_key} = {n_experts}"
                )));
            }
            let n_used = n_used as usize;
            let ff_key = key("expert_feed_forward_length");
            // As llama.cpp: the key, else the dense width shared among the used experts.
            let expert_ff = match read::uint(f, &ff_key, nl)? {
                Some(v) => read::within(&ff_key, v, 1, read::MAX_FF)?,
                None => cfg.ff / n_used,
            };
            if expert_ff == 0 {
                return Err(HparamsError::Inconsistent(format!(
                    "{ff_key} is absent and {} / {used_key} is 0",
                    key("feed_forward_length")
                )));
            }
            // llama.cpp's qwen3moe always renormalises the chosen experts' weights.
            cfg.moe = Some(MoeSpec::softmax_top_k(n_experts, n_used, expert_ff));
        }
        Arch::Gemma3 => gemma3(f, cfg)?,
        Arch::Deepseek2 => super::deepseek2::adjust(f, cfg)?,
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
    // llama.cpp's gemma3 graph soft-caps the logits when the file sets a cap; the engine does
    // not implement it.
    let cap_key = key("final_logit_softcapping");
    if let Some(cap) = read::float(f, &cap_key)? {
        if cap != 0.0 {
            return Err(HparamsError::Unsupported(format!(
                "{cap_key} = {cap}: final logit soft-capping is not implemented"
            )));
        }
    }
    let window_key = key("attention.sliding_window");
    let window = read::uint(f, &window_key, None)?.filter(|&w| w > 0);
    if let Some(w) = window {
        let w = read::within(&window_key, w, 1, u32::MAX as u64)? as u32;
        let base_key = key("rope.freq_base_swa");
        let local_base = match read::float(f, &base_key)? {
            Some(b) => read::positive(&base_key, b)?,
            None => GEMMA3_LOCAL_ROPE_BASE,
        };
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
            if let Some(n) = read::uint(f, key, None).ok().flatten() {
                return period(read::within(key, n, 0, read::MAX_LAYERS)?);
            }
            let flags: Option<Vec<bool>> = v.as_array().and_then(|a| {
                a.iter()
                    .map(|x| match x {
                        npu_gguf::MetaValue::Bool(b) => Some(*b),
                        _ => None,
                    })
                    .collect()
            });
            match flags {
                Some(flags) if flags.len() == n_layers => Ok(flags),
                _ => Err(HparamsError::Inconsistent(format!(
                    "{key} must be a period or one bool per layer ({n_layers})"
                ))),
            }
        }
    }
}

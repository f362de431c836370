//! The deepseek2 family hook: multi-head latent attention's shape, the routed and shared
//! experts with their gating, and YaRN rope scaling, read as llama.cpp's `deepseek2` model
//! reads them (`src/models/deepseek2.cpp`, the YaRN set-up of `llama-context.cpp`).
//!
//! YaRN is applied as per-pair frequency factors: each pair's angle is the extrapolated angle
//! times `freq_scale * (1 - ramp) + ramp` (ggml's `rope_yarn`), which equals dividing the
//! pair's frequency by the inverse of that multiplier, within f32 rounding. The magnitude ggml
//! gives the rotated part (`mscale`) is 1 for every DeepSeek configuration (llama.cpp cancels
//! it when the file carries `yarn_log_multiplier`); another magnitude is refused. The
//! attention scale takes YaRN's `mscale^2`, as llama.cpp's graph pre-scales `kq_scale`.

use super::read;
use crate::{intern_factors, Gating, HparamsError, MlaSpec, ModelConfig, MoeSpec, RopeStyle};
use npu_gguf::{GgufFile, MetaValue};

/// ggml's YaRN defaults (llama.cpp's deepseek2 reads no beta keys).
pub(crate) const YARN_BETA_FAST: f32 = 32.0;
pub(crate) const YARN_BETA_SLOW: f32 = 1.0;

pub(super) fn adjust(f: &GgufFile, cfg: &mut ModelConfig) -> Result<(), HparamsError> {
    let key = |k: &str| format!("deepseek2.{k}");
    let nl = Some(cfg.n_layers);
    let vocab = cfg.vocab;
    // llama.cpp's "lite" variants (DeepSeek-V2-Lite and kin, known by their layer count) have
    // a full query projection whatever the file says.
    let lite = matches!(cfg.n_layers, 26 | 27) || (cfg.n_layers == 48 && vocab == 128_256);
    let q_lora_rank = if lite {
        0
    } else {
        let k = key("attention.q_lora_rank");
        read::within(&k, read::req_uint(f, &k, None)?, 0, read::MAX_EMBEDDING)?
    };
    let kv_key = key("attention.kv_lora_rank");
    let kv_lora_rank = read::within(
        &kv_key,
        read::req_uint(f, &kv_key, None)?,
        1,
        read::MAX_HEAD_DIM,
    )?;
    let (k_mla_key, v_mla_key) = (
        key("attention.key_length_mla"),
        key("attention.value_length_mla"),
    );
    let (Some(k_mla), Some(v_mla)) = (
        read::uint(f, &k_mla_key, None)?,
        read::uint(f, &v_mla_key, None)?,
    ) else {
        return Err(HparamsError::Unsupported(format!(
            "a deepseek2 file without {k_mla_key} and {v_mla_key} (an older conversion with an \
             unsplit attn_kv_b): the engine runs latent attention only; convert the model again \
             with a current convert_hf_to_gguf.py"
        )));
    };
    let k_mla = read::within(&k_mla_key, k_mla, 2, read::MAX_HEAD_DIM)?;
    let v_head_dim = read::within(&v_mla_key, v_mla, 1, read::MAX_HEAD_DIM)?;
    let rot_key = key("rope.dimension_count");
    let qk_rope = read::within(
        &rot_key,
        read::req_uint(f, &rot_key, None)?,
        2,
        read::MAX_HEAD_DIM,
    )?;
    if !qk_rope.is_multiple_of(2) || qk_rope >= k_mla {
        return Err(HparamsError::Inconsistent(format!(
            "{rot_key} = {qk_rope} must be even and below {k_mla_key} = {k_mla}"
        )));
    }
    let mla = MlaSpec {
        q_lora_rank,
        kv_lora_rank,
        qk_nope: k_mla - qk_rope,
        qk_rope,
        v_head_dim,
    };
    // The cache row: the converter writes key_length = latent + rope, value_length = latent,
    // and one KV head (attention over the latents is multi-query).
    if cfg.head_dim != mla.cache_row() {
        return Err(HparamsError::Inconsistent(format!(
            "deepseek2.attention.key_length = {} is not {kv_key} + {rot_key} = {}",
            cfg.head_dim,
            mla.cache_row()
        )));
    }
    if let Some(v) = read::uint(f, &key("attention.value_length"), None)? {
        if v != kv_lora_rank as u64 {
            return Err(HparamsError::Inconsistent(format!(
                "deepseek2.attention.value_length = {v} is not {kv_key} = {kv_lora_rank}"
            )));
        }
    }
    if cfg.n_kv_heads != 1 {
        return Err(HparamsError::Unsupported(format!(
            "deepseek2.attention.head_count_kv = {}: latent attention shares one latent over \
             every head (the converter writes 1)",
            cfg.n_kv_heads
        )));
    }
    cfg.mla = Some(mla);

    // Experts.
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
    let ff_key = key("expert_feed_forward_length");
    let expert_ff = read::within(&ff_key, read::req_uint(f, &ff_key, nl)?, 1, read::MAX_FF)?;
    let shared_key = key("expert_shared_count");
    let n_shared = read::within(
        &shared_key,
        read::req_uint(f, &shared_key, None)?,
        0,
        read::MAX_EXPERTS,
    )?;
    let lead_key = key("leading_dense_block_count");
    let dense_lead = match read::uint(f, &lead_key, None)? {
        Some(v) => read::within(&lead_key, v, 0, cfg.n_layers as u64)?,
        None => 0,
    };
    if dense_lead > 0 && cfg.ff == 0 {
        return Err(HparamsError::Inconsistent(format!(
            "{lead_key} = {dense_lead} dense layers, but deepseek2.feed_forward_length is 0 or \
             absent"
        )));
    }
    let scale_key = key("expert_weights_scale");
    let weights_scale = match read::float(f, &scale_key)? {
        // llama.cpp scales by any value other than 0 and 1.
        Some(v) if v != 0.0 => read::positive(&scale_key, v)?,
        _ => 1.0,
    };
    let norm_top_k = flag(f, &key("expert_weights_norm"))?.unwrap_or(false);
    let gating_key = key("expert_gating_func");
    let gating = match read::uint(f, &gating_key, None)?.unwrap_or(0) {
        // Absent (0): softmax, except llama.cpp's GLM 4.7 Lite heuristic.
        0 if matches!(cfg.n_layers, 47 | 48) && vocab == 154_880 => Gating::Sigmoid,
        0 | 1 => Gating::Softmax,
        2 => Gating::Sigmoid,
        other => {
            return Err(HparamsError::Unsupported(format!(
                "{gating_key} = {other}: only softmax (1) and sigmoid (2) gating are implemented"
            )))
        }
    };
    let (groups_key, groups_used_key) = (key("expert_group_count"), key("expert_group_used_count"));
    let groups = match read::uint(f, &groups_key, None)?.unwrap_or(0) {
        0 | 1 => None,
        g => {
            let g = read::within(&groups_key, g, 2, n_experts as u64 - 1)?;
            let used = read::req_uint(f, &groups_used_key, None)?;
            if !n_experts.is_multiple_of(g) || used == 0 || used >= g as u64 {
                return Err(HparamsError::Inconsistent(format!(
                    "{groups_key} = {g} groups of {count_key} = {n_experts} experts with \
                     {groups_used_key} = {used} used: the groups must divide the experts and \
                     between 1 and {} of them be used",
                    g - 1
                )));
            }
            Some((g, used as usize))
        }
    };
    cfg.moe = Some(MoeSpec {
        n_experts,
        n_used: n_used as usize,
        expert_ff,
        norm_top_k,
        gating,
        weights_scale,
        groups,
        // Set from the tensors (`tensors`).
        selection_bias: false,
        shared_ff: expert_ff * n_shared,
        dense_lead,
    });

    // Rope: adjacent pairs (llama.cpp's NORM rope) over the qk_rope dimensions, YaRN as
    // frequency factors, and the attention scale with YaRN's mscale.
    let mut rope = cfg.rope;
    rope.style = RopeStyle::Interleaved;
    rope.dims = qk_rope;
    let mut mscale = 1.0f32;
    if let Some(yarn) = yarn(f, cfg, qk_rope, rope.base)? {
        rope.factors = Some(intern_factors(&yarn.factors));
        mscale = yarn.mscale;
    }
    rope.freq_scale = 1.0;
    cfg.rope = rope;
    for l in &mut cfg.layers {
        l.rope = rope;
    }
    cfg.attn_scale = mscale * mscale / (k_mla as f32).sqrt();
    Ok(())
}

/// A bool key (a GGUF bool, or an integer 0/1).
fn flag(f: &GgufFile, key: &str) -> Result<Option<bool>, HparamsError> {
    match f.get(key) {
        None => Ok(None),
        Some(MetaValue::Bool(b)) => Ok(Some(*b)),
        Some(_) => match read::uint(f, key, None)? {
            Some(0) => Ok(Some(false)),
            Some(1) => Ok(Some(true)),
            other => Err(HparamsError::Inconsistent(format!(
                "{key} = {other:?} must be a bool"
            ))),
        },
    }
}

pub(crate) struct Yarn {
    /// Per-pair frequency divisors.
    pub(crate) factors: Vec<f32>,
    /// The attention scale's multiplier (squared into it).
    pub(crate) mscale: f32,
}

/// YaRN's factors and mscale when the file scales its rope with YaRN (None without scaling);
/// linear and other scalings are refused.
fn yarn(
    f: &GgufFile,
    cfg: &ModelConfig,
    dims: usize,
    base: f32,
) -> Result<Option<Yarn>, HparamsError> {
    let key = |k: &str| format!("deepseek2.{k}");
    let type_key = key("rope.scaling.type");
    let factor_key = key("rope.scaling.factor");
    let factor = read::float(f, &factor_key)?.unwrap_or(0.0);
    let attn_factor_key = key("rope.scaling.attn_factor");
    let rope_attn_factor = read::float(f, &attn_factor_key)?.unwrap_or(1.0) as f32;
    let none = || {
        if rope_attn_factor != 1.0 {
            return Err(HparamsError::Unsupported(format!(
                "{attn_factor_key} = {rope_attn_factor}: scaling the rope's cos/sin is not \
                 implemented"
            )));
        }
        Ok(None)
    };
    match read::string(f, &type_key)? {
        Some("yarn") => {}
        Some("none") => return none(),
        None | Some("linear") if factor == 0.0 || factor == 1.0 => return none(),
        other => {
            return Err(HparamsError::Unsupported(format!(
                "{type_key} = {other:?} with {factor_key} = {factor}: deepseek2 runs YaRN \
                 scaling or none"
            )))
        }
    }
    let factor = factor as f32;
    if !(factor.is_finite() && factor > 1.0) {
        return Err(HparamsError::Unsupported(format!(
            "{factor_key} = {factor}: YaRN is implemented for factors above 1"
        )));
    }
    let orig_key = key("rope.scaling.original_context_length");
    let n_ctx_orig = match read::uint(f, &orig_key, None)? {
        Some(v) => read::within(&orig_key, v, 1, read::MAX_CONTEXT)?,
        None => cfg.context_length,
    };
    // The converter stores 0.1 * mscale_all_dim; llama.cpp divides the 0.1 back out.
    let log_mul =
        read::float(f, &key("rope.scaling.yarn_log_multiplier"))?.unwrap_or(0.0) as f32 / 0.1;
    // The rotated part's magnitude, as llama-context.cpp and ggml's rope_yarn compose it.
    let get_mscale = yarn_get_mscale;
    let ratio = if log_mul != 0.0 {
        let mscale = if log_mul != 1.0 { log_mul } else { 1.0 };
        get_mscale(factor, mscale) / get_mscale(factor, log_mul)
    } else {
        get_mscale(factor, 1.0)
    };
    let magnitude = ratio * rope_attn_factor;
    if magnitude != 1.0 {
        return Err(HparamsError::Unsupported(format!(
            "YaRN with a rotated-part magnitude of {magnitude} (no yarn_log_multiplier, or \
             {attn_factor_key} = {rope_attn_factor}): scaling the rope's cos/sin is not \
             implemented"
        )));
    }
    Ok(Some(yarn_scaling(
        dims, base, factor, n_ctx_orig, log_mul, magnitude,
    )))
}

/// YaRN's magnitude for a scale and an `mscale` (DeepSeek's `yarn_get_mscale`).
pub(crate) fn yarn_get_mscale(scale: f32, m: f32) -> f32 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// YaRN's per-pair frequency divisors and attention-scale multiplier for a rope of `dims`
/// rotated dimensions at `base`, scaled by `factor` over an original context of `n_ctx_orig`,
/// with the attention magnitude `log_mul` (mscale_all_dim) and the rotated part's magnitude
/// `magnitude` (1 wherever the engine runs YaRN): ggml's `rope_yarn` and llama-context.cpp's
/// composition, in f32. Both loaders (GGUF keys, config.json's `rope_scaling`) come here.
pub(crate) fn yarn_scaling(
    dims: usize,
    base: f32,
    factor: f32,
    n_ctx_orig: usize,
    log_mul: f32,
    magnitude: f32,
) -> Yarn {
    let freq_scale = 1.0 / factor;
    let mscale = magnitude * (1.0 + 0.1 * log_mul * (1.0 / freq_scale).ln());
    // ggml_rope_yarn_corr_dims.
    let corr_dim = |n_rot: f32| {
        dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let low = corr_dim(YARN_BETA_FAST).floor().max(0.0);
    let high = corr_dim(YARN_BETA_SLOW).ceil().min(dims as f32 - 1.0);
    let factors = (0..dims / 2)
        .map(|i| {
            let y = (i as f32 - low) / (high - low).max(0.001);
            let ramp_mix = 1.0 - y.clamp(0.0, 1.0);
            let multiplier = freq_scale * (1.0 - ramp_mix) + ramp_mix;
            1.0 / multiplier
        })
        .collect();
    Yarn { factors, mscale }
}

//! `config.json` to the model description, as transformers reads it, for every family the GGUF
//! reader runs: Llama (with Llama 3's `rope_scaling`), Mistral (llama.cpp converts it to
//! `llama`), Qwen2, Qwen3, Qwen3-MoE, Gemma 3 (`gemma3_text`) and DeepSeek-V2/V3 and Kimi K2
//! (`deepseek`, whose own reader this dispatches to). The result is the description
//! the GGUF reader builds from `convert_hf_to_gguf.py`'s conversion of the same directory.
//!
//! Every size is bounded where it is read, a key of the wrong type is an error naming it, and a
//! key that changes the maths and that the engine does not apply (`MATHS_KEYS`, the
//! `rope_scaling` types other than linear and llama3, soft-capping, ...) stops the load naming it.
//! Keys that only name, train or describe the model pass.

use serde_json::{Map, Value};

use crate::gguf::read::{
    MAX_CONTEXT, MAX_EMBEDDING, MAX_EXPERTS, MAX_FF, MAX_HEADS, MAX_HEAD_DIM, MAX_LAYERS, MAX_VOCAB,
};
use crate::{
    intern_factors, Arch, FfnAct, HparamsError, LayerSpec, ModelConfig, MoeSpec, Rope, RopeStyle,
};

/// Gemma 3's local layers turn at this base when the config does not say.
const GEMMA3_LOCAL_ROPE_BASE: f64 = 10_000.0;
/// Gemma 3's layer pattern when the config gives neither `layer_types` nor a pattern.
const GEMMA3_SWA_PATTERN: usize = 6;

/// The `config.json` of a directory, read strictly.
pub(crate) struct Config<'a> {
    obj: &'a Map<String, Value>,
}

pub(super) fn inconsistent(msg: String) -> HparamsError {
    HparamsError::Inconsistent(format!("config.json: {msg}"))
}

pub(super) fn unsupported(msg: String) -> HparamsError {
    HparamsError::Unsupported(format!("config.json: {msg}"))
}

impl<'a> Config<'a> {
    pub(crate) fn new(v: &'a Value) -> Result<Self, HparamsError> {
        let obj = v
            .as_object()
            .ok_or_else(|| inconsistent("is not a JSON object".into()))?;
        Ok(Self { obj })
    }

    /// Whether the key is written at all (`null` included).
    pub(super) fn has(&self, key: &str) -> bool {
        self.obj.contains_key(key)
    }

    pub(super) fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn uint(&self, key: &str) -> Result<Option<u64>, HparamsError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| inconsistent(format!("{key} = {v} is not a non-negative integer"))),
        }
    }

    pub(super) fn req_uint(&self, key: &str, lo: u64, hi: u64) -> Result<usize, HparamsError> {
        let v = self
            .uint(key)?
            .ok_or_else(|| inconsistent(format!("the required key {key} is missing")))?;
        within(key, v, lo, hi)
    }

    pub(super) fn float(&self, key: &str) -> Result<Option<f64>, HparamsError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| inconsistent(format!("{key} = {v} is not a number"))),
        }
    }

    pub(super) fn boolean(&self, key: &str) -> Result<Option<bool>, HparamsError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| inconsistent(format!("{key} = {v} is not true or false"))),
        }
    }

    pub(crate) fn string(&self, key: &str) -> Result<Option<&'a str>, HparamsError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| inconsistent(format!("{key} = {v} is not a string"))),
        }
    }

    pub(crate) fn tie_word_embeddings(&self, arch: Arch) -> Result<bool, HparamsError> {
        // transformers' defaults: Gemma 3 ties, the others do not.
        Ok(self
            .boolean("tie_word_embeddings")?
            .unwrap_or(arch == Arch::Gemma3))
    }
}

pub(super) fn within(key: &str, v: u64, lo: u64, hi: u64) -> Result<usize, HparamsError> {
    if v < lo || v > hi {
        return Err(inconsistent(format!("{key} = {v} is outside {lo}..={hi}")));
    }
    usize::try_from(v).map_err(|_| inconsistent(format!("{key} = {v} does not fit this machine")))
}

pub(super) fn positive(key: &str, v: f64) -> Result<f32, HparamsError> {
    let x = v as f32;
    if !(x.is_finite() && x > 0.0) {
        return Err(inconsistent(format!(
            "{key} = {v} must be a finite positive number"
        )));
    }
    Ok(x)
}

/// The family a config names (`model_type`, else the first of `architectures`).
pub(crate) fn arch(c: &Config) -> Result<Arch, HparamsError> {
    let model_type = c.string("model_type")?;
    let archs: Vec<&str> = match c.get("architectures") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        Some(v) => return Err(inconsistent(format!("architectures = {v} is not a list"))),
    };
    let by_type = |t: &str| match t {
        "llama" | "mistral" => Some(Arch::Llama),
        "qwen2" => Some(Arch::Qwen2),
        "qwen3" => Some(Arch::Qwen3),
        "qwen3_moe" => Some(Arch::Qwen3Moe),
        "gemma3_text" => Some(Arch::Gemma3),
        // Kimi K2 is a DeepSeek-V3 under its own model_type.
        "deepseek_v2" | "deepseek_v3" | "kimi_k2" => Some(Arch::Deepseek2),
        _ => None,
    };
    let by_class = |t: &str| match t {
        "LlamaForCausalLM" | "MistralForCausalLM" => Some(Arch::Llama),
        "Qwen2ForCausalLM" => Some(Arch::Qwen2),
        "Qwen3ForCausalLM" => Some(Arch::Qwen3),
        "Qwen3MoeForCausalLM" => Some(Arch::Qwen3Moe),
        "Gemma3ForCausalLM" => Some(Arch::Gemma3),
        "DeepseekV2ForCausalLM" | "DeepseekV3ForCausalLM" => Some(Arch::Deepseek2),
        _ => None,
    };
    let found = match model_type {
        Some(t) => by_type(t),
        None => archs.first().and_then(|a| by_class(a)),
    };
    found.ok_or_else(|| {
        let what = match (model_type, archs.first()) {
            (Some(t), _) => format!("model_type = {t:?}"),
            (None, Some(a)) => format!("architectures = [{a:?}]"),
            (None, None) => "neither model_type nor architectures is given".into(),
        };
        let hint = if model_type == Some("gemma3") {
            " (a multimodal Gemma 3 checkpoint: the engine runs the text model, gemma3_text)"
        } else {
            ""
        };
        unsupported(format!(
            "{what}{hint}; supported: llama, mistral, qwen2, qwen3, qwen3_moe, gemma3_text, \
             deepseek_v2, deepseek_v3, kimi_k2"
        ))
    })
}

/// The rope parameters: transformers 4.x's `rope_theta` + `rope_scaling`, or 5.x's
/// `rope_parameters` (per layer type for Gemma 3).
pub(super) struct RopeParams<'a> {
    pub(super) theta: Option<f64>,
    pub(super) scaling: Option<&'a Map<String, Value>>,
    /// Where `scaling` was read (for messages).
    pub(super) key: String,
}

pub(super) fn rope_params<'a>(
    c: &Config<'a>,
    layer_type: &str,
) -> Result<RopeParams<'a>, HparamsError> {
    if let Some(p) = c.get("rope_parameters") {
        let obj = p
            .as_object()
            .ok_or_else(|| inconsistent(format!("rope_parameters = {p} is not an object")))?;
        let (obj, key) = match obj.get(layer_type).and_then(Value::as_object) {
            Some(inner) => (inner, format!("rope_parameters.{layer_type}")),
            None => (obj, "rope_parameters".to_string()),
        };
        let theta =
            match obj.get("rope_theta") {
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_f64().ok_or_else(|| {
                    inconsistent(format!("{key}.rope_theta = {v} is not a number"))
                })?),
            };
        return Ok(RopeParams {
            theta,
            scaling: Some(obj),
            key,
        });
    }
    let scaling = match c.get("rope_scaling") {
        None => None,
        Some(Value::Object(o)) => Some(o),
        Some(v) => return Err(inconsistent(format!("rope_scaling = {v} is not an object"))),
    };
    Ok(RopeParams {
        theta: c.float("rope_theta")?,
        scaling,
        key: "rope_scaling".into(),
    })
}

/// The rope of `layer_type` layers: base, linear position scale and Llama 3 frequency factors.
fn rope(
    c: &Config,
    arch: Arch,
    head_dim: usize,
    layer_type: &str,
    default_base: f64,
) -> Result<Rope, HparamsError> {
    let p = rope_params(c, layer_type)?;
    let base = positive(
        &format!(
            "{}rope_theta",
            if p.key == "rope_scaling" {
                ""
            } else {
                "rope_parameters."
            }
        ),
        p.theta.unwrap_or(default_base),
    )?;
    let style = match arch {
        // The loader permutes Llama's Q/K rows as convert_hf_to_gguf.py does, so its rope pairs
        // adjacent dimensions as the GGUF file's.
        Arch::Llama | Arch::Mistral => RopeStyle::Interleaved,
        _ => RopeStyle::Halves,
    };
    let mut rope = Rope::plain(style, head_dim, base, 1.0);
    let Some(s) = p.scaling else {
        return Ok(rope);
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
    let num = |k: &str, default: Option<f64>| -> Result<f64, HparamsError> {
        match s.get(k).filter(|v| !v.is_null()) {
            Some(v) => v
                .as_f64()
                .ok_or_else(|| inconsistent(format!("{key}.{k} = {v} is not a number"))),
            None => default
                .ok_or_else(|| inconsistent(format!("{key}.{k} is required by rope_type {ty:?}"))),
        }
    };
    match ty {
        "default" => {}
        "linear" => {
            let factor = num("factor", None)?;
            rope.freq_scale = positive(&format!("{key}.factor"), 1.0 / factor)?;
        }
        "llama3" if matches!(arch, Arch::Llama | Arch::Mistral) => {
            let factor = num("factor", Some(8.0))?;
            let low = num("low_freq_factor", Some(1.0))?;
            let high = num("high_freq_factor", Some(4.0))?;
            let orig = num("original_max_position_embeddings", Some(8192.0))?;
            for (k, v) in [
                ("factor", factor),
                ("low_freq_factor", low),
                ("high_freq_factor", high),
                ("original_max_position_embeddings", orig),
            ] {
                positive(&format!("{key}.{k}"), v)?;
            }
            if high <= low {
                return Err(inconsistent(format!(
                    "{key}.high_freq_factor = {high} must exceed low_freq_factor = {low}"
                )));
            }
            let f = llama3_factors(head_dim, base, factor, low, high, orig);
            if f.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                return Err(inconsistent(format!(
                    "{key} gives a rope frequency factor that is not a positive finite number"
                )));
            }
            rope.factors = Some(intern_factors(&f));
        }
        other => {
            let why = match other {
                "yarn" => "YaRN rope scaling is not implemented",
                "dynamic" => "dynamic NTK rope scaling is not implemented",
                "longrope" | "su" => "LongRoPE rope scaling is not implemented",
                "llama3" => "Llama 3 frequency factors are applied on the llama family only",
                _ => "the engine knows no such rope scaling type",
            };
            return Err(unsupported(format!(
                "{key}.rope_type = {other:?}: {why} (supported: default, linear, llama3)"
            )));
        }
    }
    Ok(rope)
}

/// Llama 3's per-pair frequency divisors, as `convert_hf_to_gguf.py` computes them for the
/// `rope_freqs.weight` tensor it writes: the frequencies in f32 (torch), the bands compared and
/// blended in f32.
pub fn llama3_factors(
    head_dim: usize,
    base: f32,
    factor: f64,
    low: f64,
    high: f64,
    orig_ctx: f64,
) -> Vec<f32> {
    let (factor, low, high, orig) = (factor as f32, low as f32, high as f32, orig_ctx as f32);
    let low_wavelen = orig / low;
    let high_wavelen = orig / high;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf((2 * i) as f32 / head_dim as f32);
            let wavelen = (2.0 * std::f64::consts::PI) as f32 / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// Keys that change the maths, each taken at its neutral value only (`None`: absent, null or
/// false/0 is neutral; `Some(v)`: also `v`). Another value stops the load naming the key.
const MATHS_KEYS: &[(&str, Option<f64>, &str)] = &[
    (
        "attn_logit_softcapping",
        None,
        "attention logit soft-capping is not implemented",
    ),
    (
        "final_logit_softcapping",
        None,
        "final logit soft-capping is not implemented",
    ),
    ("mlp_bias", None, "feed-forward biases are not applied"),
    (
        "pretraining_tp",
        Some(1.0),
        "tensor-parallel pretraining slices (pretraining_tp > 1) are not implemented",
    ),
    (
        "partial_rotary_factor",
        Some(1.0),
        "partial rotary embedding is not implemented",
    ),
    (
        "attention_multiplier",
        None,
        "Granite-style attention multipliers are not implemented",
    ),
    (
        "logits_scaling",
        Some(1.0),
        "Granite-style logit scaling is not implemented",
    ),
    (
        "embedding_multiplier",
        Some(1.0),
        "Granite-style embedding multipliers are not implemented",
    ),
    (
        "residual_multiplier",
        Some(1.0),
        "Granite-style residual multipliers are not implemented",
    ),
    (
        "use_sliding_window",
        None,
        "sliding-window attention is not implemented on this family",
    ),
    (
        "shared_expert_intermediate_size",
        None,
        "shared experts are not implemented",
    ),
    (
        "n_shared_experts",
        None,
        "shared experts are not implemented",
    ),
    (
        "kv_lora_rank",
        None,
        "latent attention (MLA) is not implemented",
    ),
    (
        "q_lora_rank",
        None,
        "latent attention (MLA) is not implemented",
    ),
    (
        "first_k_dense_replace",
        None,
        "leading dense layers in a mixture-of-experts model are not implemented",
    ),
    (
        "routed_scaling_factor",
        Some(1.0),
        "scaling the routed experts' weights is not implemented",
    ),
    (
        "n_group",
        Some(1.0),
        "group-limited expert routing is not implemented",
    ),
    (
        "topk_group",
        Some(1.0),
        "group-limited expert routing is not implemented",
    ),
    (
        "use_qk_norm",
        None,
        "a Q/K norm this family does not have is not implemented",
    ),
    (
        "qk_layernorm",
        None,
        "a Q/K norm this family does not have is not implemented",
    ),
    (
        "rope_interleave",
        None,
        "interleaved rope on this family is not implemented",
    ),
    (
        "no_rope_layers",
        None,
        "layers without rope are not implemented",
    ),
    (
        "attention_chunk_size",
        None,
        "chunked attention is not implemented",
    ),
    ("clip_qkv", None, "clamping Q/K/V is not implemented"),
    ("alibi", None, "ALiBi attention is not implemented"),
    (
        "parallel_attn",
        None,
        "parallel residuals are not implemented",
    ),
    (
        "use_parallel_residual",
        None,
        "parallel residuals are not implemented",
    ),
    (
        "decoder_sparse_step",
        Some(1.0),
        "experts on some layers only are not implemented",
    ),
];

pub(super) fn check_maths_keys(c: &Config, arch: Arch) -> Result<(), HparamsError> {
    for &(key, ok, why) in MATHS_KEYS {
        // Keys the family reads itself.
        if arch == Arch::Qwen3Moe && key == "decoder_sparse_step" {
            let v = c.uint(key)?.unwrap_or(1);
            if v != 1 {
                return Err(unsupported(format!("{key} = {v}: {why}")));
            }
            continue;
        }
        if arch == Arch::Deepseek2 && super::deepseek::READS.contains(&key) {
            continue;
        }
        let Some(v) = c.get(key) else { continue };
        let neutral = match v {
            Value::Bool(b) => !b,
            Value::Number(n) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                x == 0.0 || ok == Some(x)
            }
            Value::Array(a) => a.is_empty(),
            _ => false,
        };
        if !neutral {
            return Err(unsupported(format!("{key} = {v}: {why}")));
        }
    }
    if let Some(act) = c.string("hidden_act")?.or(c.string("hidden_activation")?) {
        let want = match arch {
            Arch::Gemma3 => "gelu_pytorch_tanh",
            _ => "silu",
        };
        if act != want {
            return Err(unsupported(format!(
                "hidden_act = {act:?}: the engine's {} feed-forward block runs {want}",
                arch.name()
            )));
        }
    }
    if arch == Arch::Qwen3Moe {
        if let Some(v) = c.get("mlp_only_layers") {
            if !v.as_array().is_some_and(Vec::is_empty) {
                return Err(unsupported(format!(
                    "mlp_only_layers = {v}: dense layers in a mixture-of-experts model are not \
                     implemented"
                )));
            }
        }
    }
    if let Some(lt) = c.get("layer_types") {
        let types: Option<Vec<&str>> = lt
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect());
        let all_full = types.is_some_and(|t| t.iter().all(|x| *x == "full_attention"));
        if arch != Arch::Gemma3 && !all_full {
            return Err(unsupported(format!(
                "layer_types = {lt}: layers other than full attention are not implemented on \
                 the {} family",
                arch.name()
            )));
        }
    }
    Ok(())
}

/// The model description of a `config.json`.
pub(crate) fn model_config(v: &Value) -> Result<ModelConfig, HparamsError> {
    let c = Config::new(v)?;
    let arch = arch(&c)?;
    check_maths_keys(&c, arch)?;
    if arch == Arch::Deepseek2 {
        return super::deepseek::model_config(&c);
    }
    let n_layers = c.req_uint("num_hidden_layers", 1, MAX_LAYERS)?;
    let hidden = c.req_uint("hidden_size", 1, MAX_EMBEDDING)?;
    let n_heads = c.req_uint("num_attention_heads", 1, MAX_HEADS)?;
    let n_kv_heads = match c.uint("num_key_value_heads")? {
        Some(v) => within("num_key_value_heads", v, 1, n_heads as u64)?,
        None => n_heads,
    };
    if !n_heads.is_multiple_of(n_kv_heads) {
        return Err(inconsistent(format!(
            "num_attention_heads = {n_heads} cannot be grouped over num_key_value_heads = \
             {n_kv_heads}"
        )));
    }
    let head_dim = match c.uint("head_dim")? {
        Some(v) => within("head_dim", v, 1, MAX_HEAD_DIM)?,
        None => hidden / n_heads,
    };
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(inconsistent(format!(
            "head dimension {head_dim} (head_dim, else hidden_size / num_attention_heads) must \
             be even and non-zero"
        )));
    }
    let ff = match arch {
        Arch::Qwen3Moe => c.uint("intermediate_size")?.unwrap_or(0),
        _ => c.req_uint("intermediate_size", 1, MAX_FF)? as u64,
    };
    let ff = within("intermediate_size", ff, 0, MAX_FF)?;
    let vocab = c.req_uint("vocab_size", 1, MAX_VOCAB)?;
    let mut context_length = match c.uint("max_position_embeddings")? {
        Some(v) => within("max_position_embeddings", v, 1, MAX_CONTEXT)?,
        None => 2048,
    };
    // Mistral's sliding window: within it every position is attended, so a context no longer
    // than the window computes what transformers computes.
    if arch == Arch::Llama {
        if let Some(w) = c.uint("sliding_window")? {
            let w = within("sliding_window", w, 1, MAX_CONTEXT)?;
            if w < context_length {
                tracing::info!(
                    sliding_window = w,
                    max_position_embeddings = context_length,
                    "the context is capped at the sliding window (within it attention is whole)"
                );
                context_length = w;
            }
        }
    }
    let eps_key = "rms_norm_eps";
    let eps = c
        .float(eps_key)?
        .ok_or_else(|| inconsistent(format!("the required key {eps_key} is missing")))?;
    let rms_eps = positive(eps_key, eps)?;
    if rms_eps >= 1.0 {
        return Err(inconsistent(format!("{eps_key} = {eps} must be below 1")));
    }
    let rope = rope(&c, arch, head_dim, "full_attention", 10_000.0)?;
    let mut cfg = ModelConfig {
        arch,
        name: c
            .string("_name_or_path")?
            .filter(|s| !s.is_empty())
            .unwrap_or(arch.name())
            .to_string(),
        n_layers,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        ff,
        vocab,
        context_length,
        rms_eps,
        rope,
        qkv_bias: false,
        qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3),
        post_norms: arch == Arch::Gemma3,
        embed_scale: None,
        ffn_act: FfnAct::Silu,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        layers: vec![LayerSpec { rope, window: None }; n_layers],
        moe: None,
        mla: None,
        wide_activations: false,
    };
    match arch {
        Arch::Qwen3Moe => {
            let n_experts = c.req_uint("num_experts", 1, MAX_EXPERTS)?;
            let n_used = c.req_uint("num_experts_per_tok", 1, n_experts as u64)?;
            let expert_ff = c.req_uint("moe_intermediate_size", 1, MAX_FF)?;
            // transformers' default is false (then the chosen experts' softmax weights are used
            // as they are).
            let norm_top_k = c.boolean("norm_topk_prob")?.unwrap_or(false);
            cfg.moe = Some(MoeSpec {
                norm_top_k,
                ..MoeSpec::softmax_top_k(n_experts, n_used, expert_ff)
            });
            cfg.ff = 0;
        }
        Arch::Gemma3 => gemma3(&c, &mut cfg)?,
        _ => {}
    }
    Ok(cfg)
}

fn gemma3(c: &Config, cfg: &mut ModelConfig) -> Result<(), HparamsError> {
    cfg.ffn_act = FfnAct::GeluTanh;
    cfg.embed_scale = Some((cfg.hidden as f32).sqrt());
    cfg.wide_activations = true;
    let scalar = match c.float("query_pre_attn_scalar")? {
        Some(s) => positive("query_pre_attn_scalar", s)?,
        None => cfg.head_dim as f32,
    };
    cfg.attn_scale = 1.0 / scalar.sqrt();
    let local_base = match c.float("rope_local_base_freq")? {
        Some(b) => b,
        None => rope_params(c, "sliding_attention")?
            .theta
            .unwrap_or(GEMMA3_LOCAL_ROPE_BASE),
    };
    let mut local = Rope::plain(
        RopeStyle::Halves,
        cfg.head_dim,
        positive("rope_local_base_freq", local_base)?,
        1.0,
    );
    local.factors = None;
    let global = cfg.rope;
    let window = match c.uint("sliding_window")? {
        Some(w) if w > 0 => Some(within("sliding_window", w, 1, u32::MAX as u64)? as u32),
        _ => None,
    };
    let local_layers: Vec<bool> = match c.get("layer_types") {
        Some(lt) => {
            let types = lt
                .as_array()
                .filter(|a| a.len() == cfg.n_layers)
                .ok_or_else(|| {
                    inconsistent(format!(
                        "layer_types must list one type per layer ({})",
                        cfg.n_layers
                    ))
                })?;
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(unsupported(format!(
                        "layer_types holds {t}: the engine runs sliding_attention and \
                         full_attention layers"
                    ))),
                })
                .collect::<Result<_, _>>()?
        }
        None => {
            let n = match c.uint("sliding_window_pattern")? {
                Some(n) => within("sliding_window_pattern", n, 1, MAX_LAYERS)?,
                None => GEMMA3_SWA_PATTERN,
            };
            (0..cfg.n_layers).map(|il| il % n < n - 1).collect()
        }
    };
    for (l, is_local) in cfg.layers.iter_mut().zip(local_layers) {
        *l = match (is_local, window) {
            (true, Some(w)) => LayerSpec {
                rope: local,
                window: Some(w),
            },
            _ => LayerSpec {
                rope: global,
                window: None,
            },
        };
    }
    Ok(())
}

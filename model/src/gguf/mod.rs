//! The GGUF reader of the model description: hyper-parameters read from a file's metadata as
//! llama.cpp reads them, checked for consistency before any weight is touched. One reader of
//! what every family shares (the Llama-shaped block: heads, widths, rope), then a small
//! per-family hook for where it differs (`family`); every size is bounded where it is read
//! (`read`), and a key (`keys`) or a tensor (`tensors`) that changes the maths and that the
//! engine does not apply stops the load naming it.

use npu_gguf::{GgmlType, GgufError, GgufFile};

use crate::{intern_factors, Arch, FfnAct, HparamsError, LayerSpec, ModelConfig, Rope, RopeStyle};

pub(crate) mod deepseek2;
mod family;
mod keys;
pub(crate) mod read;
mod tensors;

pub(crate) use tensors::check_names as check_tensor_names;
pub use tensors::QKV_BIASES;
#[cfg(test)]
mod tests;

impl ModelConfig {
    /// The model a file describes, read as llama.cpp reads it. Refused, naming the key or the
    /// tensor: a key of the wrong type or out of bounds, a key that changes the maths which the
    /// engine does not apply (`keys`), and a tensor the engine would not use (`tensors`).
    pub fn from_gguf(f: &GgufFile) -> Result<Self, HparamsError> {
        let arch_name = read::string(f, "general.architecture")?.ok_or_else(|| {
            HparamsError::Gguf(GgufError::MissingKey("general.architecture".into()))
        })?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| {
            let names: Vec<&str> = Arch::ALL.iter().map(|a| a.name()).collect();
            HparamsError::Unsupported(format!(
                "architecture {arch_name:?} (supported: {})",
                names.join(", ")
            ))
        })?;
        let mut cfg = Self::shared(f, arch, arch_name)?;
        family::adjust(f, &mut cfg)?;
        keys::check(f, &cfg)?;
        tensors::check(f, &mut cfg)?;
        // Real MoE files carry a dense width even without dense FFN tensors; then it sizes
        // nothing (a damaged value would size step buffers no tensor backs).
        let dense_ffn = f
            .tensors()
            .iter()
            .any(|t| t.name.ends_with(".ffn_gate.weight"));
        if cfg.moe.is_some() && !dense_ffn {
            cfg.ff = 0;
        }
        cfg.check()?;
        Ok(cfg)
    }

    /// What every family reads the same way: the Llama-shaped block.
    fn shared(f: &GgufFile, arch: Arch, arch_name: &str) -> Result<Self, HparamsError> {
        use read::{float, req_uint, uint, within};
        let key = |k: &str| format!("{arch_name}.{k}");
        let n_layers = within(
            &key("block_count"),
            req_uint(f, &key("block_count"), None)?,
            1,
            read::MAX_LAYERS,
        )?;
        // Every layer has tensors of its own: a count beyond the file's tensors is a damaged
        // header (checked before anything is sized by it).
        if n_layers > f.tensors().len() {
            return Err(HparamsError::Inconsistent(format!(
                "{} = {n_layers} layers, but the file holds {} tensors",
                key("block_count"),
                f.tensors().len()
            )));
        }
        let nl = Some(n_layers);
        let hidden = within(
            &key("embedding_length"),
            req_uint(f, &key("embedding_length"), None)?,
            1,
            read::MAX_EMBEDDING,
        )?;
        let ff_key = key("feed_forward_length");
        let moe_family = matches!(arch, Arch::Qwen3Moe | Arch::Deepseek2);
        let ff = match moe_family {
            // A MoE file may have no dense FFN width (every layer's FFN is the experts').
            true => uint(f, &ff_key, nl)?.unwrap_or(0),
            false => req_uint(f, &ff_key, nl)?,
        };
        let ff = within(&ff_key, ff, u64::from(!moe_family), read::MAX_FF)?;
        let heads_key = key("attention.head_count");
        let n_heads = within(&heads_key, req_uint(f, &heads_key, nl)?, 1, read::MAX_HEADS)?;
        let kv_key = key("attention.head_count_kv");
        let n_kv_heads = match uint(f, &kv_key, nl)? {
            Some(v) => within(&kv_key, v, 1, n_heads as u64)?,
            None => n_heads,
        };
        if !n_heads.is_multiple_of(n_kv_heads) {
            return Err(HparamsError::Inconsistent(format!(
                "{heads_key} = {n_heads} attention heads cannot be grouped over {kv_key} = \
                 {n_kv_heads} KV heads"
            )));
        }
        let kl_key = key("attention.key_length");
        let head_dim = match uint(f, &kl_key, None)? {
            Some(v) => within(&kl_key, v, 1, read::MAX_HEAD_DIM)?,
            None => hidden / n_heads,
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(HparamsError::Inconsistent(format!(
                "head dimension {head_dim} ({kl_key}, else {} / {heads_key}) must be even and \
                 non-zero",
                key("embedding_length")
            )));
        }
        // deepseek2's value length is its latent's width (checked by its family hook).
        if let Some(v) =
            uint(f, &key("attention.value_length"), None)?.filter(|_| arch != Arch::Deepseek2)
        {
            if v != head_dim as u64 {
                return Err(HparamsError::Unsupported(format!(
                    "{} = {v} differs from the key length {head_dim}",
                    key("attention.value_length")
                )));
            }
        }
        let vocab_key = key("vocab_size");
        let vocab = match uint(f, &vocab_key, None)? {
            Some(v) => v,
            None => f
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array())
                .map(|a| a.len() as u64)
                .ok_or_else(|| HparamsError::Gguf(GgufError::MissingKey(vocab_key.clone())))?,
        };
        let vocab = within(&vocab_key, vocab, 1, read::MAX_VOCAB)?;
        let ctx_key = key("context_length");
        let context_length = match uint(f, &ctx_key, None)? {
            Some(v) => within(&ctx_key, v, 1, read::MAX_CONTEXT)?,
            None => 2048,
        };
        // Required, as llama.cpp requires it of every family here (a default would be a guess:
        // Llama uses 1e-5, Qwen 1e-6).
        let eps_key = key("attention.layer_norm_rms_epsilon");
        let eps = float(f, &eps_key)?
            .ok_or_else(|| HparamsError::Gguf(GgufError::MissingKey(eps_key.clone())))?;
        let rms_eps = read::positive(&eps_key, eps)?;
        if rms_eps >= 1.0 {
            return Err(HparamsError::Inconsistent(format!(
                "{eps_key} = {eps} must be below 1"
            )));
        }
        // Every family's llama.cpp graph rotates the whole head (llama's loader refuses another
        // count; qwen2/qwen3/qwen3moe assert n_rot == head_dim); Gemma 3's graph could rotate
        // part of it, which the engine does not implement.
        let rot_key = key("rope.dimension_count");
        // deepseek2 rotates a part of its own (read by its family hook).
        if let Some(v) = uint(f, &rot_key, None)?.filter(|_| arch != Arch::Deepseek2) {
            if v != head_dim as u64 {
                return Err(HparamsError::Unsupported(format!(
                    "{rot_key} = {v} rotates part of each {head_dim}-wide head; the engine \
                     rotates whole heads, as llama.cpp's {arch_name} graph does"
                )));
            }
        }
        let base_key = key("rope.freq_base");
        let base = match float(f, &base_key)? {
            Some(b) => read::positive(&base_key, b)?,
            None => 10000.0,
        };
        let rope = Rope {
            style: RopeStyle::Interleaved,
            dims: head_dim,
            base,
            // deepseek2's YaRN scaling becomes frequency factors (its family hook).
            freq_scale: match arch {
                Arch::Deepseek2 => 1.0,
                _ => rope_freq_scale(f, arch_name)?,
            },
            factors: match arch {
                // Only llama's graph passes frequency factors to its rope; on the other
                // families the tensor is refused (`tensors`).
                Arch::Llama | Arch::Mistral => rope_factors(f, head_dim)?,
                _ => None,
            },
        };
        Ok(Self {
            arch,
            name: f.get_str("general.name").unwrap_or(arch_name).to_string(),
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
            qk_norm: false,
            post_norms: false,
            embed_scale: None,
            ffn_act: FfnAct::Silu,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            layers: vec![LayerSpec { rope, window: None }; n_layers],
            moe: None,
            mla: None,
            wide_activations: false,
        })
    }
}

/// The rope's position scale, as llama.cpp sets it: `rope.scaling.type` absent or "linear"
/// scales positions by 1 / `rope.scaling.factor` (else the older `rope.scale_linear`; 0 or
/// absent: no scaling), "none" never scales; YaRN, LongRoPE and any other type are refused.
fn rope_freq_scale(f: &GgufFile, arch: &str) -> Result<f32, HparamsError> {
    let type_key = format!("{arch}.rope.scaling.type");
    let ty = read::string(f, &type_key)?;
    let factor_key = [
        format!("{arch}.rope.scaling.factor"),
        format!("{arch}.rope.scale_linear"),
    ]
    .into_iter()
    .find(|k| f.get(k).is_some());
    let factor = match &factor_key {
        Some(k) => {
            let v = read::float(f, k)?.unwrap_or(0.0);
            if !(v.is_finite() && v >= 0.0) {
                return Err(HparamsError::Inconsistent(format!(
                    "{k} = {v} must be a finite number, 0 or above"
                )));
            }
            v
        }
        None => 0.0,
    };
    match ty {
        Some("none") => Ok(1.0),
        None | Some("linear") if factor == 0.0 => Ok(1.0),
        None | Some("linear") => {
            read::positive(factor_key.as_deref().unwrap_or(&type_key), 1.0 / factor)
        }
        Some(other) => {
            let what = match other {
                "yarn" => "YaRN rope scaling is not implemented",
                "longrope" => "LongRoPE rope scaling is not implemented",
                _ => "llama.cpp knows no such rope scaling type",
            };
            Err(HparamsError::Unsupported(format!(
                "{type_key} = {other:?}: {what} (supported: none, linear; Llama 3's frequency \
                 factors come from the rope_freqs.weight tensor)"
            )))
        }
    }
}

/// Llama 3's per-pair rope frequency divisors, from the `rope_freqs.weight` tensor when the
/// file has one.
fn rope_factors(f: &GgufFile, rope_dims: usize) -> Result<Option<&'static [f32]>, HparamsError> {
    let Some(info) = f.tensor_info("rope_freqs.weight") else {
        return Ok(None);
    };
    let n = rope_dims / 2;
    if info.ty != GgmlType::F32 || info.n_elements() != n as u64 {
        return Err(HparamsError::Inconsistent(format!(
            "rope_freqs.weight is {} with {} values; expected f32 with {n} (rope dimensions / 2)",
            info.ty.name(),
            info.n_elements()
        )));
    }
    let (_, data) = f.tensor("rope_freqs.weight")?;
    let values: Vec<f32> = data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if values.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
        return Err(HparamsError::Inconsistent(
            "rope_freqs.weight holds a value that is not a positive finite number".into(),
        ));
    }
    Ok(Some(intern_factors(&values)))
}

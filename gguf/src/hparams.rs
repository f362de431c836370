//! Model hyper-parameters read from GGUF metadata for the Llama family (`llama`, `mistral`,
//! `qwen2`), checked for consistency before any weight is touched.

use thiserror::Error;

use crate::{GgufError, GgufFile};

/// Why a file's hyper-parameters cannot be used.
#[derive(Debug, Error)]
pub enum HparamsError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("inconsistent model: {0}")]
    Inconsistent(String),
}

/// How rotary embedding pairs up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): Llama/Mistral GGUF layout.
    Interleaved,
    /// Halves (i, i + d/2): Qwen2 / GPT-NeoX.
    Halves,
}

/// Rotary embedding parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub style: RopeStyle,
    /// Rotated dimensions per head (<= head_dim).
    pub dims: usize,
    pub base: f32,
    /// Position scale (linear rope scaling: 1 / factor).
    pub freq_scale: f32,
}

impl Rope {
    /// Cosines and sines for `pos`, `dims / 2` pairs each, into `cs` (len dims).
    pub fn angles(&self, pos: u32, cs: &mut [f32]) {
        let theta_scale = self.base.powf(-2.0 / self.dims as f32);
        let mut theta = pos as f32;
        for i in 0..self.dims / 2 {
            let t = self.freq_scale * theta;
            cs[2 * i] = t.cos();
            cs[2 * i + 1] = t.sin();
            theta *= theta_scale;
        }
    }
}

/// The architectures we run, and where they differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
        }
    }
    fn from_name(s: &str) -> Option<Self> {
        Some(match s {
            "llama" => Self::Llama,
            "mistral" => Self::Mistral,
            "qwen2" => Self::Qwen2,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub name: String,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ff: usize,
    pub vocab: usize,
    pub context_length: usize,
    pub rms_eps: f32,
    pub rope: Rope,
    /// Q/K/V projections carry bias vectors (Qwen2).
    pub qkv_bias: bool,
}

impl ModelConfig {
    pub fn from_gguf(f: &GgufFile) -> Result<Self, HparamsError> {
        let arch_name = f.get_str("general.architecture").ok_or_else(|| {
            HparamsError::Gguf(GgufError::MissingKey("general.architecture".into()))
        })?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| {
            HparamsError::Unsupported(format!(
                "architecture {arch_name:?} (supported: llama, mistral, qwen2)"
            ))
        })?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let req = |k: &str| -> Result<usize, HparamsError> { Ok(f.require_u64(&key(k))? as usize) };
        let n_layers = req("block_count")?;
        let hidden = req("embedding_length")?;
        let ff = req("feed_forward_length")?;
        let n_heads = req("attention.head_count")?;
        let n_kv_heads = f
            .get_u64(&key("attention.head_count_kv"))
            .map(|v| v as usize)
            .unwrap_or(n_heads);
        if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(HparamsError::Inconsistent(format!(
                "{n_heads} attention heads cannot be grouped over {n_kv_heads} KV heads"
            )));
        }
        let head_dim = f
            .get_u64(&key("attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(hidden / n_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(HparamsError::Inconsistent(format!(
                "head dimension {head_dim} must be even and non-zero"
            )));
        }
        let vocab = match f.get_u64(&key("vocab_size")) {
            Some(v) => v as usize,
            None => f
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array())
                .map(|a| a.len())
                .ok_or_else(|| HparamsError::Gguf(GgufError::MissingKey(key("vocab_size"))))?,
        };
        let context_length = f
            .get_u64(&key("context_length"))
            .map(|v| v as usize)
            .unwrap_or(2048);
        let rms_eps = f
            .get_f64(&key("attention.layer_norm_rms_epsilon"))
            .unwrap_or(1e-5) as f32;
        let rope_dims = f
            .get_u64(&key("rope.dimension_count"))
            .map(|v| v as usize)
            .unwrap_or(head_dim);
        if rope_dims > head_dim || !rope_dims.is_multiple_of(2) {
            return Err(HparamsError::Inconsistent(format!(
                "rope dimension count {rope_dims} does not fit head dimension {head_dim}"
            )));
        }
        let base = f.get_f64(&key("rope.freq_base")).unwrap_or(10000.0) as f32;
        let freq_scale = match f.get_str(&key("rope.scaling.type")) {
            None | Some("none") => 1.0,
            Some("linear") => {
                let factor = f.get_f64(&key("rope.scaling.factor")).unwrap_or(1.0) as f32;
                if factor > 0.0 {
                    1.0 / factor
                } else {
                    1.0
                }
            }
            Some(other) => {
                return Err(HparamsError::Unsupported(format!(
                    "rope scaling type {other:?} (supported: none, linear)"
                )))
            }
        };
        let style = match arch {
            Arch::Qwen2 => RopeStyle::Halves,
            Arch::Llama | Arch::Mistral => RopeStyle::Interleaved,
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
            rope: Rope {
                style,
                dims: rope_dims,
                base,
                freq_scale,
            },
            qkv_bias: arch == Arch::Qwen2,
        })
    }

    /// Width of a fused Q|K|V row.
    pub fn qkv_width(&self) -> usize {
        (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
    }

    /// Width of the attention output (n_heads * head_dim).
    pub fn attn_width(&self) -> usize {
        self.n_heads * self.head_dim
    }
}

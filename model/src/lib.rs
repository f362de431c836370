//! The model description the forward pass runs: hyper-parameters, which blocks a layer has, and
//! each layer's rope and attention window, as plain data. Two readers produce it, in one place
//! each, so the forward pass never learns which file a model came from: a GGUF file's metadata
//! (`gguf`, read as llama.cpp reads it) and a Hugging Face directory's `config.json` (`hf`, read
//! as transformers reads it). `checkpoint` hands either one's tensors to the loader under the
//! same names and layouts, and `shard` cuts the description for tensor parallelism.
//!
//! Nothing is run other than as the reference computes it: a key or a tensor that changes the
//! maths and that the engine does not apply stops the load naming it.

use std::sync::Mutex;

use thiserror::Error;

use npu_gguf::GgufError;

pub mod checkpoint;
pub mod gguf;
pub mod hf;
pub mod lora;
pub mod shard;

pub use checkpoint::{resolve_model, Checkpoint, LoadOptions};

pub use gguf::QKV_BIASES;

/// Why a file's hyper-parameters cannot be used.
#[derive(Debug, Error)]
pub enum HparamsError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Hf(#[from] npu_hf::HfError),
    #[error(transparent)]
    Store(#[from] npu_gguf::store::ModelStoreError),
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
    /// Halves (i, i + d/2): Qwen2/Qwen3/Gemma 3 (GPT-NeoX).
    Halves,
}

/// Rotary embedding parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub style: RopeStyle,
    /// Rotated dimensions per head (a model's whole head: `ModelConfig::from_gguf` refuses
    /// partial rotation).
    pub dims: usize,
    pub base: f32,
    /// Position scale (linear rope scaling: 1 / factor).
    pub freq_scale: f32,
    /// Per-pair frequency divisors (`dims / 2` values; Llama 3's `rope_freqs.weight`): pair i
    /// turns at `base^(-2i/dims) / factors[i]`. Interned for the life of the process (see
    /// [`intern_factors`]) so that a rope stays plain copyable data.
    pub factors: Option<&'static [f32]>,
}

impl Rope {
    /// A rope without frequency factors.
    pub fn plain(style: RopeStyle, dims: usize, base: f32, freq_scale: f32) -> Self {
        Self {
            style,
            dims,
            base,
            freq_scale,
            factors: None,
        }
    }

    /// Cosines and sines for `pos`, `dims / 2` pairs each, into `cs` (len dims).
    pub fn angles(&self, pos: u32, cs: &mut [f32]) {
        let theta_scale = self.base.powf(-2.0 / self.dims as f32);
        let mut theta = pos as f32;
        for i in 0..self.dims / 2 {
            let extrap = match self.factors {
                Some(f) => theta / f[i],
                None => theta,
            };
            let t = self.freq_scale * extrap;
            cs[2 * i] = t.cos();
            cs[2 * i + 1] = t.sin();
            theta *= theta_scale;
        }
    }

    /// The frequency divisor of pair `i` (1 without factors).
    pub fn factor(&self, i: usize) -> f32 {
        self.factors.map_or(1.0, |f| f[i])
    }
}

/// Interns a table of rope frequency factors: equal tables share one allocation, kept for the
/// life of the process (a model has one; a process loads a handful), so `Rope` stays `Copy`.
pub fn intern_factors(values: &[f32]) -> &'static [f32] {
    static TABLES: Mutex<Vec<&'static [f32]>> = Mutex::new(Vec::new());
    let mut tables = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(t) = tables.iter().find(|t| {
        t.len() == values.len()
            && t.iter()
                .zip(values)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }) {
        return t;
    }
    let t: &'static [f32] = Box::leak(values.to_vec().into_boxed_slice());
    tables.push(t);
    t
}

/// The architectures we run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Gemma3,
    /// DeepSeek-V2/V3-style: multi-head latent attention, shared and routed experts, dense
    /// leading layers.
    Deepseek2,
}

impl Arch {
    pub const ALL: [Arch; 7] = [
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Qwen3Moe,
        Self::Gemma3,
        Self::Deepseek2,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3moe",
            Self::Gemma3 => "gemma3",
            Self::Deepseek2 => "deepseek2",
        }
    }
    fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// The activation of the gated feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnAct {
    /// `silu(gate) * up` (Llama, Qwen).
    Silu,
    /// `gelu_tanh(gate) * up` (Gemma).
    GeluTanh,
}

/// How a router's logits become the experts' scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over the experts (Qwen3-MoE, DeepSeek-V2).
    Softmax,
    /// Each expert's sigmoid (DeepSeek-V3).
    Sigmoid,
}

/// A mixture-of-experts feed-forward block (Qwen3-MoE, DeepSeek).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    pub n_experts: usize,
    /// Experts each token is routed to.
    pub n_used: usize,
    /// Width of one expert's gate/up projections.
    pub expert_ff: usize,
    /// Whether the chosen experts' weights are renormalised to sum to one.
    pub norm_top_k: bool,
    pub gating: Gating,
    /// The chosen experts' weights are multiplied by this (DeepSeek's routed scaling factor;
    /// 1: none).
    pub weights_scale: f32,
    /// Group-limited routing (DeepSeek-V3): the experts form `.0` equal groups, each scored by
    /// the sum of its two best scores, and only the best `.1` groups' experts are chosen from.
    pub groups: Option<(usize, usize)>,
    /// Each MoE layer adds a per-expert bias to the scores it chooses by (`exp_probs_b.bias`,
    /// DeepSeek-V3's correction bias); the weights stay unbiased.
    pub selection_bias: bool,
    /// Width of the shared experts' FFN run beside the routed ones on every token (0: none).
    pub shared_ff: usize,
    /// The first layers have a dense FFN of width `ModelConfig::ff` instead of experts.
    pub dense_lead: usize,
}

impl MoeSpec {
    /// Qwen3-MoE's routing: the softmax's top k, renormalised, nothing else.
    pub fn softmax_top_k(n_experts: usize, n_used: usize, expert_ff: usize) -> Self {
        Self {
            n_experts,
            n_used,
            expert_ff,
            norm_top_k: true,
            gating: Gating::Softmax,
            weights_scale: 1.0,
            groups: None,
            selection_bias: false,
            shared_ff: 0,
            dense_lead: 0,
        }
    }

    /// Whether the routing is a plain softmax top k (what `moe_route` computes), with no
    /// sigmoid, bias, groups or scale.
    pub fn plain_softmax(&self) -> bool {
        self.gating == Gating::Softmax
            && self.weights_scale == 1.0
            && self.groups.is_none()
            && !self.selection_bias
    }

    /// Whether layer `il` runs experts (the others, the leading ones, are dense).
    pub fn is_moe_layer(&self, il: usize) -> bool {
        il >= self.dense_lead
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank
/// projection, keys and values from one shared latent of `kv_lora_rank` values plus a shared
/// `qk_rope`-wide rotated key. The paged cache stores the latent and the rotated key of each
/// token (a row of `kv_lora_rank + qk_rope`), and attention runs over them with the key and
/// value up-projections absorbed into the query and the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaSpec {
    /// Rank of the query's low-rank projection (0: a full query projection).
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    /// Per head: the query/key dimensions without rotation, and with it.
    pub qk_nope: usize,
    pub qk_rope: usize,
    /// Per head: the value dimensions.
    pub v_head_dim: usize,
}

impl MlaSpec {
    /// Width of one token's cache row (the latent, then the rotated key).
    pub fn cache_row(&self) -> usize {
        self.kv_lora_rank + self.qk_rope
    }
}

/// What differs between layers: the rope (Gemma 3's local layers turn at their own base) and
/// the attention window (`None`: every earlier position).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSpec {
    pub rope: Rope,
    pub window: Option<u32>,
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
    /// The model's main rope (global layers); `layers` holds each layer's own.
    pub rope: Rope,
    /// Q/K/V projections carry bias vectors (any family whose file has `attn_{q,k,v}.bias`;
    /// each optional, a missing one zeros).
    pub qkv_bias: bool,
    /// Each query and key head is RMS-normalised with its own weights before the rope (Qwen3,
    /// Gemma 3: `attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    /// The attention and FFN outputs are RMS-normalised before their residual adds (Gemma 3:
    /// `post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    /// Embedding rows are multiplied by this (Gemma: sqrt(hidden)).
    pub embed_scale: Option<f32>,
    pub ffn_act: FfnAct,
    /// Softmax scale of attention scores.
    pub attn_scale: f32,
    /// Every layer's rope and window (`n_layers` entries).
    pub layers: Vec<LayerSpec>,
    pub moe: Option<MoeSpec>,
    /// Multi-head latent attention (DeepSeek); then `n_kv_heads` is 1, `head_dim` is the cache
    /// row (`MlaSpec::cache_row`) and the rope turns `qk_rope` dimensions.
    pub mla: Option<MlaSpec>,
    /// Hidden states outgrow f16's range (Gemma 3's residual stream passes 65504): activations
    /// must be f32 or bf16.
    pub wide_activations: bool,
}

impl ModelConfig {
    fn check(&self) -> Result<(), HparamsError> {
        if self.n_layers == 0 {
            return Err(HparamsError::Inconsistent(
                "the file declares 0 layers".into(),
            ));
        }
        if self.hidden == 0 || self.vocab == 0 {
            return Err(HparamsError::Inconsistent(format!(
                "embedding length {} and vocabulary {} must be non-zero",
                self.hidden, self.vocab
            )));
        }
        if self.moe.is_none_or(|m| m.dense_lead > 0) && self.ff == 0 {
            return Err(HparamsError::Inconsistent(
                "feed_forward_length is 0".into(),
            ));
        }
        if self.layers.len() != self.n_layers {
            return Err(HparamsError::Inconsistent(format!(
                "{} layer specs for {} layers",
                self.layers.len(),
                self.n_layers
            )));
        }
        Ok(())
    }

    /// Width of a fused Q|K|V row (with latent attention: the query's unrotated and rotated
    /// parts of every head, then the new key's rotated part).
    pub fn qkv_width(&self) -> usize {
        match self.mla {
            None => (self.n_heads + 2 * self.n_kv_heads) * self.head_dim,
            Some(m) => self.n_heads * (m.qk_nope + m.qk_rope) + m.qk_rope,
        }
    }

    /// Width of the attention output (n_heads * head_dim; with latent attention, every head's
    /// value).
    pub fn attn_width(&self) -> usize {
        match self.mla {
            None => self.n_heads * self.head_dim,
            Some(m) => self.n_heads * m.v_head_dim,
        }
    }

    /// The widest FFN hidden activation of a layer (dense `ff`, one expert's, or the shared
    /// experts').
    pub fn ffn_width(&self) -> usize {
        self.moe
            .map_or(self.ff, |m| m.expert_ff.max(self.ff).max(m.shared_ff))
    }

    /// Whether any layer attends through a sliding window.
    pub fn has_sliding_window(&self) -> bool {
        self.layers.iter().any(|l| l.window.is_some())
    }
}

//! Tiny random-weight models of each supported family, written exactly in llama.cpp's GGUF
//! conventions (tensor names, shapes, metadata keys), with the tokenizer of a donor GGUF. They let
//! the engine be checked against llama.cpp for a family whose real weights cannot be fetched:
//! same family → same code paths, and a fixed seed → a byte-identical file.
//!
//! Conventions followed (llama.cpp `src/models/*.cpp`, `convert_hf_to_gguf.py`):
//! - 1-D tensors and every `*_norm.weight` are F32, as is the MoE router `ffn_gate_inp`; the
//!   other matrices take the chosen weight type.
//! - `llama3` is `general.architecture = llama` with a `rope_freqs.weight` tensor of head_dim/2
//!   per-dimension divisors of the rotary frequency (the converter's llama3 formula) and tied
//!   embeddings (no `output.weight`).
//! - `gemma3` stores its norm weights as `1 + w` (the converter adds the 1: llama.cpp multiplies
//!   by the stored value as is); no sliding-window pattern key, so llama.cpp's default pattern 6
//!   applies (layer `il` slides iff `il % 6 < 5`), hence 6 layers.
//!
//! Weights come from a splitmix64 stream per tensor (seeded by the seed and the tensor's name),
//! as uniform values: no transcendental function touches them, so the bytes do not depend on the
//! platform's libm. Scales are chosen so the layers matter (their residual contributions
//! outweigh the embedding) and the logits spread wide (a standard deviation near 50), which makes
//! most greedy steps clearly decided. Control tokens and tokens that are not whole UTF-8 text
//! get small output rows, so greedy decoding never picks them (see [`WEAK_ROW_SCALE`]).

use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::writer::GgufWriter;
use crate::{GgmlType, GgufFile, MetaValue};

#[derive(Debug, Error)]
pub enum SynthError {
    #[error(
        "unknown family {0:?} (known: llama, llama3, qwen2, qwen3, qwen3moe, gemma3, deepseek2)"
    )]
    UnknownFamily(String),
    #[error("llama.cpp has no \"mistral\" architecture (Mistral 7B converts to \"llama\"), so a mistral file would have no reference: use --arch llama")]
    Mistral,
    #[error("weight type {0} is not offered (f32, f16, q8_0, q4_k)")]
    WeightType(String),
    #[error("shape: {0}")]
    Shape(String),
    #[error("the donor model has no tokenizer.ggml.tokens")]
    NoTokenizer,
    #[error("writing the model: {0}")]
    Io(#[from] std::io::Error),
}

/// A model family as llama.cpp reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama 2 style: untied output, plain RoPE.
    Llama,
    /// Llama 3 style: `llama` with `rope_freqs.weight` and tied embeddings.
    Llama3,
    /// Q/K/V biases, NeoX RoPE.
    Qwen2,
    /// Per-head Q/K RMSNorm, head_dim * heads != hidden, NeoX RoPE, tied embeddings.
    Qwen3,
    /// Qwen3 attention with a top-k softmax-routed expert FFN.
    Qwen3Moe,
    /// Q/K norm, post-attention and post-FFN norms, GELU FFN, sliding-window layers.
    Gemma3,
    /// DeepSeek-V3 style: latent attention (low-rank query, split key/value up-projections),
    /// YaRN, a dense leading layer, sigmoid-gated group-limited experts with a selection bias,
    /// a routed scaling factor and a shared expert.
    Deepseek2,
}

impl Family {
    pub const ALL: [Family; 7] = [
        Family::Llama,
        Family::Llama3,
        Family::Qwen2,
        Family::Qwen3,
        Family::Qwen3Moe,
        Family::Gemma3,
        Family::Deepseek2,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Llama3 => "llama3",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3moe",
            Self::Gemma3 => "gemma3",
            Self::Deepseek2 => "deepseek2",
        }
    }

    pub fn from_name(s: &str) -> Result<Self, SynthError> {
        if s == "mistral" {
            return Err(SynthError::Mistral);
        }
        Self::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| SynthError::UnknownFamily(s.to_string()))
    }

    /// The `general.architecture` written.
    pub fn gguf_arch(self) -> &'static str {
        match self {
            Self::Llama | Self::Llama3 => "llama",
            other => other.name(),
        }
    }

    /// The model's shape and hyper-parameters.
    pub fn shape(self) -> Shape {
        let base = Shape {
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ff: 128,
            experts: 0,
            experts_used: 0,
            expert_ff: 0,
            sliding_window: 0,
            tied: false,
            qkv_bias: false,
            bias_half_width: 0.5,
            qk_norm: false,
            rope_factors: RopeFactors::None,
            rope_base: 10000.0,
            rms_eps: 1e-5,
            context_length: 4096,
            out_gain: 2.5,
            logit_scale: 1.0,
            mla: None,
            moe_extras: MoeExtras::NONE,
            yarn: None,
        };
        match self {
            Self::Llama => base,
            Self::Llama3 => Shape {
                layers: 3,
                heads: 2,
                kv_heads: 1,
                head_dim: 32,
                tied: true,
                rope_factors: RopeFactors::Formula,
                rope_base: 500000.0,
                context_length: 131072,
                ..base
            },
            Self::Qwen2 => Shape {
                qkv_bias: true,
                rope_base: 1000000.0,
                rms_eps: 1e-6,
                context_length: 32768,
                ..base
            },
            Self::Qwen3 => Shape {
                layers: 3,
                head_dim: 32,
                qk_norm: true,
                tied: true,
                rope_base: 1000000.0,
                rms_eps: 1e-6,
                context_length: 40960,
                ..base
            },
            Self::Qwen3Moe => Shape {
                qk_norm: true,
                experts: 8,
                experts_used: 2,
                expert_ff: 64,
                rope_base: 1000000.0,
                rms_eps: 1e-6,
                context_length: 40960,
                ..base
            },
            Self::Deepseek2 => Shape {
                layers: 3,
                heads: 8,
                kv_heads: 1,
                // The cache row: the latent and the rotated key.
                head_dim: 64 + 16,
                experts: 8,
                experts_used: 2,
                expert_ff: 32,
                rms_eps: 1e-6,
                // The original context 64, four times over by YaRN.
                context_length: 256,
                mla: Some(SynthMla {
                    q_lora_rank: 32,
                    kv_lora_rank: 64,
                    qk_nope: 32,
                    qk_rope: 16,
                    v_head_dim: 32,
                }),
                moe_extras: MoeExtras {
                    shared_experts: 1,
                    dense_lead: 1,
                    groups: (4, 2),
                    sigmoid: true,
                    selection_bias: true,
                    weights_scale: 2.5,
                },
                yarn: Some(SynthYarn {
                    factor: 4.0,
                    original_context: 64,
                    log_multiplier: 0.1,
                }),
                ..base
            },
            Self::Gemma3 => Shape {
                layers: 6,
                kv_heads: 1,
                qk_norm: true,
                tied: true,
                sliding_window: 8,
                rope_base: 1000000.0,
                rms_eps: 1e-6,
                context_length: 32768,
                ..base
            },
        }
    }
}

/// Sizes and switches of a synthetic model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Dense FFN width (for qwen3moe only the `feed_forward_length` key, as in real files).
    pub ff: usize,
    pub experts: usize,
    pub experts_used: usize,
    pub expert_ff: usize,
    /// 0: no sliding window.
    pub sliding_window: usize,
    /// No `output.weight`: the head is `token_embd.weight`.
    pub tied: bool,
    pub qkv_bias: bool,
    /// Half-width of the uniform Q/K/V bias values (when `qkv_bias`).
    pub bias_half_width: f32,
    pub qk_norm: bool,
    /// The `rope_freqs.weight` tensor written, if any.
    pub rope_factors: RopeFactors,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    /// Scale of the attention and FFN output projections over unit scale (the context
    /// outweighs the token's embedding in the residual stream).
    pub out_gain: f32,
    /// Multiplies the spread of the logits (the output matrix, or a tied model's output norm).
    pub logit_scale: f32,
    /// Latent attention (deepseek2 only); `head_dim` is then the cache row.
    pub mla: Option<SynthMla>,
    /// DeepSeek's additions to the experts.
    pub moe_extras: MoeExtras,
    /// YaRN rope scaling (deepseek2 only).
    pub yarn: Option<SynthYarn>,
}

/// The latent attention of a synthetic deepseek2 model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthMla {
    /// 0: a full query projection (`attn_q`).
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head_dim: usize,
}

/// DeepSeek's additions to the experts (all off for qwen3moe).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeExtras {
    pub shared_experts: usize,
    /// Leading layers with the dense FFN (`ff` wide).
    pub dense_lead: usize,
    /// (groups, groups used); (0, 0): no group-limited routing.
    pub groups: (usize, usize),
    /// Sigmoid gating (else softmax).
    pub sigmoid: bool,
    /// An `exp_probs_b.bias` per MoE layer.
    pub selection_bias: bool,
    /// `expert_weights_scale` (1: not written).
    pub weights_scale: f32,
}

impl MoeExtras {
    pub const NONE: Self = Self {
        shared_experts: 0,
        dense_lead: 0,
        groups: (0, 0),
        sigmoid: false,
        selection_bias: false,
        weights_scale: 1.0,
    };
}

/// YaRN scaling as the converter writes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthYarn {
    pub factor: f32,
    pub original_context: usize,
    /// `rope.scaling.yarn_log_multiplier` as stored (0.1 * mscale_all_dim).
    pub log_multiplier: f32,
}

/// Which Llama 3-style rotary frequency divisors a synthetic model carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeFactors {
    /// No `rope_freqs.weight`.
    None,
    /// As `convert_hf_to_gguf.py` writes them ([`synth_llama3_factors`]): 1, a smooth band,
    /// then the factor, monotone.
    Formula,
    /// The first four pairs 1, the others uniform in [0.5, 8), in no order (what a file may
    /// hold: llama.cpp divides each pair's frequency by whatever value is there).
    Arbitrary,
}

/// Parses a weight type name: f32, f16, q8_0 or q4_k.
pub fn weight_type(s: &str) -> Result<GgmlType, SynthError> {
    match s.to_ascii_lowercase().as_str() {
        "f32" => Ok(GgmlType::F32),
        "f16" => Ok(GgmlType::F16),
        "q8_0" => Ok(GgmlType::Q8_0),
        "q4_k" => Ok(GgmlType::Q4K),
        _ => Err(SynthError::WeightType(s.to_string())),
    }
}

/// Llama 3's rotary frequency divisors (`rope_freqs.weight`), as `convert_hf_to_gguf.py`
/// computes them: 1 for wavelengths below `orig_ctx / high`, `factor` above `orig_ctx / low`,
/// a smooth blend between.
pub fn llama3_rope_factors(
    head_dim: usize,
    base: f64,
    factor: f64,
    low: f64,
    high: f64,
    orig_ctx: f64,
) -> Vec<f32> {
    let low_wavelen = orig_ctx / low;
    let high_wavelen = orig_ctx / high;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor as f32
            } else {
                let smooth = (orig_ctx / wavelen - low) / (high - low);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect()
}

/// The Llama 3 factors of the synthetic `llama3` model: factor 8, low 1, high 4, and the
/// original context 8192 scaled down 64 times (to 128), so that at head_dim 32 the smooth band
/// and the factor-8 band fall on frequencies that turn within a test's first hundred positions.
pub fn synth_llama3_factors(head_dim: usize, base: f32) -> Vec<f32> {
    llama3_rope_factors(head_dim, base as f64, 8.0, 1.0, 4.0, 8192.0 / 64.0)
}

/// lowercase hex sha256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// splitmix64: the weight stream.
struct SplitMix(u64);

impl SplitMix {
    fn for_tensor(seed: u64, name: &str) -> Self {
        // FNV-1a of the name, mixed with the seed: each tensor has its own stream, so adding a
        // tensor does not change the others.
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        let mut s = SplitMix(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ h);
        s.next();
        s
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1), exactly representable.
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 * (2.0 / 16_777_216.0) - 1.0
    }
}

/// `n` values `center + U(-1, 1) * half_width`.
fn values(seed: u64, name: &str, n: usize, center: f32, half_width: f32) -> Vec<f32> {
    let mut r = SplitMix::for_tensor(seed, name);
    (0..n).map(|_| center + r.uniform() * half_width).collect()
}

/// Half-width of a uniform distribution of standard deviation `std`.
fn uniform_for_std(std: f32) -> f32 {
    std * 3f32.sqrt()
}

/// Encodes f32 values (rows of `row_len`) as `ty`.
fn encode(ty: GgmlType, v: &[f32]) -> Vec<u8> {
    match ty {
        GgmlType::F16 => v
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        GgmlType::Q8_0 => {
            // ggml's quantize_row_q8_0_ref: d = amax / 127, q = round(x / d).
            let mut out = Vec::with_capacity(v.len() / 32 * 34);
            for block in v.chunks_exact(32) {
                let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
                out.extend(block.iter().map(|&x| (x * id).round() as i8 as u8));
            }
            out
        }
        GgmlType::Q4K => v.chunks_exact(256).flat_map(q4_k_block).collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// One Q4_K block (256 values): per 32-value sub-block a scale and a minimum spanning its
/// values in 15 steps, both stored as 6-bit multiples of the f16 super-block `d` and `dmin`,
/// and the values as nibbles (`d * sc * q - dmin * m`, as ggml dequantizes them). A plain
/// min/max fit, not llama-quantize's search: the file is a valid Q4_K file either way, and both
/// engines run the same bytes.
fn q4_k_block(x: &[f32]) -> Vec<u8> {
    let mut scale = [0f32; 8];
    let mut min = [0f32; 8];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let lo = sub.iter().fold(0f32, |m, &v| m.min(v));
        let hi = sub.iter().fold(f32::MIN, |m, &v| m.max(v));
        scale[j] = (hi - lo) / 15.0;
        min[j] = -lo;
    }
    let d = half::f16::from_f32(scale.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
    let dmin = half::f16::from_f32(min.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
    let six = |v: f32, unit: f32| {
        if unit > 0.0 {
            (v / unit).round().clamp(0.0, 63.0) as u8
        } else {
            0
        }
    };
    let sc: Vec<u8> = scale.iter().map(|&v| six(v, d.to_f32())).collect();
    let mn: Vec<u8> = min.iter().map(|&v| six(v, dmin.to_f32())).collect();
    let mut scales = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            scales[j] = sc[j];
            scales[j + 4] = mn[j];
        } else {
            scales[j + 4] = (sc[j] & 0x0F) | ((mn[j] & 0x0F) << 4);
            scales[j - 4] |= (sc[j] >> 4) << 6;
            scales[j] |= (mn[j] >> 4) << 6;
        }
    }
    let q: Vec<u8> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let j = i / 32;
            let step = d.to_f32() * sc[j] as f32;
            if step > 0.0 {
                ((v + dmin.to_f32() * mn[j] as f32) / step)
                    .round()
                    .clamp(0.0, 15.0) as u8
            } else {
                0
            }
        })
        .collect();
    let mut out = Vec::with_capacity(144);
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&dmin.to_le_bytes());
    out.extend_from_slice(&scales);
    for pair in 0..4 {
        for l in 0..32 {
            out.push(q[pair * 64 + l] | (q[pair * 64 + 32 + l] << 4));
        }
    }
    out
}

/// Output rows of control tokens and of tokens that are not whole UTF-8 text are scaled down
/// this much, so greedy decoding never picks them: llama-server reports no probabilities for a
/// token that ends inside a UTF-8 character, and its `ignore_eos` bans end-of-generation tokens
/// (which the engine's does not).
pub const WEAK_ROW_SCALE: f32 = 0.25;

/// Which tokens of the donor's vocabulary are control tokens, or not valid UTF-8 on their own
/// (byte-level BPE pieces of a multi-byte character, SentencePiece byte tokens).
pub fn weak_tokens(donor: &GgufFile, vocab: usize) -> Vec<bool> {
    let types: Vec<i64> = donor
        .get("tokenizer.ggml.token_type")
        .and_then(MetaValue::as_array)
        .map(|a| a.iter().map(|t| t.as_i64().unwrap_or(1)).collect())
        .unwrap_or_default();
    let tokens = donor
        .get_str_array("tokenizer.ggml.tokens")
        .ok()
        .flatten()
        .unwrap_or_default();
    let byte_level = donor.get_str("tokenizer.ggml.model") == Some("gpt2");
    let unicode_to_byte = gpt2_unicode_to_byte();
    (0..vocab)
        .map(|i| {
            let ty = types.get(i).copied().unwrap_or(1);
            let text = tokens.get(i).copied().unwrap_or("");
            match ty {
                3 => true,
                6 => {
                    // "<0xNN>": a single byte, whole text only when ASCII.
                    u8::from_str_radix(text.trim_start_matches("<0x").trim_end_matches('>'), 16)
                        .map_or(true, |b| b >= 0x80)
                }
                _ if byte_level => {
                    let bytes: Vec<u8> = text
                        .chars()
                        .flat_map(|c| match unicode_to_byte.get(&c) {
                            Some(&b) => vec![b],
                            None => c.to_string().into_bytes(),
                        })
                        .collect();
                    std::str::from_utf8(&bytes).is_err()
                }
                _ => false,
            }
        })
        .collect()
}

/// GPT-2's byte-level alphabet, reversed: the printable bytes stand for themselves, the others
/// for U+0100 onwards in byte order.
fn gpt2_unicode_to_byte() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, 33..=126 | 161..=172 | 174..=255);
    let mut map = std::collections::HashMap::new();
    let mut n = 0u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            b as char
        } else {
            n += 1;
            char::from_u32(255 + n).expect("a valid char")
        };
        map.insert(c, b);
    }
    map
}

struct Builder {
    w: GgufWriter,
    seed: u64,
    ty: GgmlType,
}

impl Builder {
    fn meta(&mut self, key: &str, v: MetaValue) {
        self.w.add_meta(key, v);
    }

    /// A matrix (ggml dims, row length first) of the weight type, uniform of std `std`.
    fn matrix(&mut self, name: &str, dims: &[usize], std: f32) {
        let n = dims.iter().product();
        let v = values(self.seed, name, n, 0.0, uniform_for_std(std));
        self.tensor(name, self.ty, dims, &v);
    }

    /// A vocabulary matrix whose rows of `weak` tokens are scaled by [`WEAK_ROW_SCALE`].
    fn matrix_weak_rows(&mut self, name: &str, dims: &[usize], std: f32, weak: &[bool]) {
        let n = dims.iter().product();
        let mut v = values(self.seed, name, n, 0.0, uniform_for_std(std));
        for (row, &w) in v.chunks_exact_mut(dims[0]).zip(weak) {
            if w {
                row.iter_mut().for_each(|x| *x *= WEAK_ROW_SCALE);
            }
        }
        self.tensor(name, self.ty, dims, &v);
    }

    /// An F32 tensor of values `center ± half_width`.
    fn f32(&mut self, name: &str, dims: &[usize], center: f32, half_width: f32) {
        let n = dims.iter().product();
        let v = values(self.seed, name, n, center, half_width);
        self.tensor(name, GgmlType::F32, dims, &v);
    }

    fn tensor(&mut self, name: &str, ty: GgmlType, dims: &[usize], v: &[f32]) {
        let d: Vec<u64> = dims.iter().map(|&x| x as u64).collect();
        self.w.add_tensor(name, ty, &d, encode(ty, v));
    }
}

/// The GGUF bytes of `family`'s synthetic model with weights of type `ty` (F32, F16 or Q8_0)
/// drawn from `seed`, and the `tokenizer.*` metadata of `donor`.
pub fn synth_model(
    family: Family,
    seed: u64,
    ty: GgmlType,
    donor: &GgufFile,
) -> Result<Vec<u8>, SynthError> {
    synth_model_shaped(family, family.shape(), seed, ty, donor)
}

/// [`synth_model`] with another shape than the family's own (smaller files for fuzzing seeds);
/// `shape`'s switches (bias, norms, tying, rope factors) should stay the family's.
pub fn synth_model_shaped(
    family: Family,
    s: Shape,
    seed: u64,
    ty: GgmlType,
    donor: &GgufFile,
) -> Result<Vec<u8>, SynthError> {
    if !matches!(
        ty,
        GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0 | GgmlType::Q4K
    ) {
        return Err(SynthError::WeightType(ty.name().to_string()));
    }
    if family == Family::Deepseek2 && ty == GgmlType::Q4K {
        return Err(SynthError::Shape(
            "deepseek2's narrow up-projections hold no whole Q4_K blocks; use q8_0".into(),
        ));
    }
    // A matrix's rows must fill whole blocks of the type.
    let block = if ty == GgmlType::Q4K { 256 } else { 32 };
    let rows = [
        s.hidden,
        s.heads * s.head_dim,
        if s.experts > 0 { s.expert_ff } else { s.ff },
    ];
    if ty != GgmlType::F32 && ty != GgmlType::F16 && rows.iter().any(|r| r % block != 0) {
        return Err(SynthError::Shape(format!(
            "{} needs rows of whole {block}-value blocks; the shape's rows are {rows:?}",
            ty.name()
        )));
    }
    let vocab = donor
        .get("tokenizer.ggml.tokens")
        .and_then(MetaValue::as_array)
        .map(|a| a.len())
        .ok_or(SynthError::NoTokenizer)?;
    let arch = family.gguf_arch();
    let mut b = Builder {
        w: GgufWriter::new(),
        seed,
        ty,
    };
    let u32v = |x: usize| MetaValue::U32(x as u32);
    let k = |key: &str| format!("{arch}.{key}");

    b.meta("general.architecture", MetaValue::String(arch.into()));
    b.meta("general.type", MetaValue::String("model".into()));
    b.meta(
        "general.name",
        MetaValue::String(format!("synth-{}-seed{seed}", family.name())),
    );
    b.meta(&k("block_count"), u32v(s.layers));
    b.meta(&k("context_length"), u32v(s.context_length));
    b.meta(&k("embedding_length"), u32v(s.hidden));
    b.meta(&k("feed_forward_length"), u32v(s.ff));
    b.meta(&k("attention.head_count"), u32v(s.heads));
    b.meta(&k("attention.head_count_kv"), u32v(s.kv_heads));
    b.meta(&k("rope.freq_base"), MetaValue::F32(s.rope_base));
    b.meta(
        &k("attention.layer_norm_rms_epsilon"),
        MetaValue::F32(s.rms_eps),
    );
    if let Some(m) = s.mla {
        mla::mla_meta(&mut b, arch, &s, m, vocab);
    } else if matches!(family, Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3)
        || s.heads * s.head_dim != s.hidden
    {
        // Their converters write head_dim (it need not be hidden / heads).
        b.meta(&k("attention.key_length"), u32v(s.head_dim));
        b.meta(&k("attention.value_length"), u32v(s.head_dim));
    }
    if s.experts > 0 {
        b.meta(&k("expert_count"), u32v(s.experts));
        b.meta(&k("expert_used_count"), u32v(s.experts_used));
        b.meta(&k("expert_feed_forward_length"), u32v(s.expert_ff));
    }
    if s.sliding_window > 0 {
        b.meta(&k("attention.sliding_window"), u32v(s.sliding_window));
    }
    if arch == "llama" {
        // LlamaModel's converter adds these two.
        b.meta(&k("vocab_size"), u32v(vocab));
        b.meta(&k("rope.dimension_count"), u32v(s.head_dim));
    }
    let file_type = match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4K => 15,
        _ => 7,
    };
    b.meta("general.file_type", MetaValue::U32(file_type));
    b.meta("general.quantization_version", MetaValue::U32(2));
    for key in donor.keys() {
        if key.starts_with("tokenizer.") {
            b.meta(key, donor.get(key).expect("a listed key").clone());
        }
    }

    let h = s.hidden;
    let qd = s.heads * s.head_dim;
    let kvd = s.kv_heads * s.head_dim;
    let inv_sqrt = |n: usize| 1.0 / (n as f32).sqrt();
    // Gemma multiplies the embeddings by sqrt(hidden); tied models get their logit spread from
    // a large output norm instead of a large embedding.
    // Tied models: a small embedding (or the first layer's output would keep the input token on
    // top, and greedy decoding would repeat it) and a large output norm for the logit spread.
    let embd_std = match family {
        Family::Gemma3 => 0.2,
        _ if s.tied => 0.25,
        _ => 1.0,
    };
    let (out_norm_center, out_std) = if s.tied {
        (25.0 * s.logit_scale, 0.0)
    } else {
        (1.0, 6.0 * s.logit_scale)
    };
    let post_norm_center = 4.0;
    let out_gain = s.out_gain;

    let weak = weak_tokens(donor, vocab);
    b.matrix_weak_rows("token_embd.weight", &[h, vocab], embd_std, &weak);
    let factors = match s.rope_factors {
        RopeFactors::None => None,
        RopeFactors::Formula => Some(synth_llama3_factors(s.head_dim, s.rope_base)),
        RopeFactors::Arbitrary => {
            let mut f = values(seed, "rope_freqs.weight", s.head_dim / 2, 4.25, 3.75);
            f.iter_mut().take(4).for_each(|v| *v = 1.0);
            Some(f)
        }
    };
    if let Some(f) = factors {
        b.tensor("rope_freqs.weight", GgmlType::F32, &[s.head_dim / 2], &f);
    }
    for i in 0..s.layers {
        let n = |t: &str| format!("blk.{i}.{t}");
        if let Some(m) = s.mla {
            mla::mla_layer(&mut b, &s, m, i);
            continue;
        }
        b.f32(&n("attn_norm.weight"), &[h], 1.0, 0.2);
        b.matrix(&n("attn_q.weight"), &[h, qd], 1.5 * inv_sqrt(h));
        b.matrix(&n("attn_k.weight"), &[h, kvd], 1.5 * inv_sqrt(h));
        b.matrix(&n("attn_v.weight"), &[h, kvd], inv_sqrt(h));
        if s.qkv_bias {
            let w = s.bias_half_width;
            b.f32(&n("attn_q.bias"), &[qd], 0.0, w);
            b.f32(&n("attn_k.bias"), &[kvd], 0.0, w);
            b.f32(&n("attn_v.bias"), &[kvd], 0.0, w);
        }
        if s.qk_norm {
            b.f32(&n("attn_q_norm.weight"), &[s.head_dim], 1.2, 0.3);
            b.f32(&n("attn_k_norm.weight"), &[s.head_dim], 1.2, 0.3);
        }
        b.matrix(&n("attn_output.weight"), &[qd, h], out_gain * inv_sqrt(qd));
        if family == Family::Gemma3 {
            b.f32(
                &n("post_attention_norm.weight"),
                &[h],
                post_norm_center,
                0.5,
            );
        }
        b.f32(&n("ffn_norm.weight"), &[h], 1.0, 0.2);
        if s.experts > 0 {
            // The router stays F32 (the converter never quantizes it); a wide spread keeps
            // the top-k choice clear of ties.
            let name = n("ffn_gate_inp.weight");
            let v = values(
                seed,
                &name,
                h * s.experts,
                0.0,
                uniform_for_std(2.0 * inv_sqrt(h)),
            );
            b.tensor(&name, GgmlType::F32, &[h, s.experts], &v);
            let (e, eff) = (s.experts, s.expert_ff);
            b.matrix(&n("ffn_gate_exps.weight"), &[h, eff, e], inv_sqrt(h));
            b.matrix(&n("ffn_up_exps.weight"), &[h, eff, e], inv_sqrt(h));
            b.matrix(
                &n("ffn_down_exps.weight"),
                &[eff, h, e],
                out_gain * inv_sqrt(eff),
            );
        } else {
            b.matrix(&n("ffn_gate.weight"), &[h, s.ff], inv_sqrt(h));
            b.matrix(&n("ffn_up.weight"), &[h, s.ff], inv_sqrt(h));
            b.matrix(&n("ffn_down.weight"), &[s.ff, h], out_gain * inv_sqrt(s.ff));
        }
        if family == Family::Gemma3 {
            b.f32(&n("post_ffw_norm.weight"), &[h], post_norm_center, 0.5);
        }
    }
    b.f32(
        "output_norm.weight",
        &[h],
        out_norm_center,
        0.2 * out_norm_center,
    );
    if !s.tied {
        b.matrix_weak_rows("output.weight", &[h, vocab], out_std, &weak);
    }
    Ok(b.w.to_bytes()?)
}

mod mla;
pub mod sweep;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_factors_span_one_to_eight() {
        let f = synth_llama3_factors(32, 500000.0);
        assert_eq!(f.len(), 16);
        assert_eq!(f[0], 1.0);
        assert_eq!(f[15], 8.0);
        assert!(f.iter().any(|&x| x > 1.0 && x < 8.0), "{f:?}");
        assert!(f.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn real_llama3_factors_match_the_converter_bands() {
        // Llama 3.1 8B: head_dim 128, base 500000, original context 8192.
        let f = llama3_rope_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192.0);
        assert_eq!(f[0], 1.0);
        assert_eq!(f[63], 8.0);
        // Wavelengths below 8192 / 4 keep factor 1: 2π · 500000^(i/64) < 2048 for i <= 28.
        assert_eq!(f.iter().filter(|&&x| x == 1.0).count(), 29);
    }

    #[test]
    fn uniform_stream_is_in_range_and_fixed() {
        let mut r = SplitMix::for_tensor(1, "a");
        let v: Vec<f32> = (0..1000).map(|_| r.uniform()).collect();
        assert!(v.iter().all(|x| (-1.0..1.0).contains(x)));
        let mut r2 = SplitMix::for_tensor(1, "a");
        assert_eq!(r2.uniform(), v[0]);
        assert_ne!(SplitMix::for_tensor(1, "b").uniform(), v[0]);
    }

    #[test]
    fn q4_k_round_trips_within_a_step_of_its_sub_block() {
        let v = values(4, "t", 512, 0.1, 1.0);
        let bytes = encode(GgmlType::Q4K, &v);
        assert_eq!(bytes.len(), 2 * 144);
        let mut back = vec![0f32; 512];
        for (blk, out) in bytes.chunks_exact(144).zip(back.chunks_exact_mut(256)) {
            crate::quants::dequantize_row(GgmlType::Q4K, blk, out).unwrap();
        }
        for (sub, got) in v.chunks_exact(32).zip(back.chunks_exact(32)) {
            let lo = sub.iter().fold(0f32, |m, &x| m.min(x));
            let hi = sub.iter().fold(f32::MIN, |m, &x| m.max(x));
            // One quantization step of the sub-block, plus the 6-bit rounding of its scale
            // and minimum.
            let step = (hi - lo) / 15.0;
            for (a, b) in sub.iter().zip(got) {
                assert!((a - b).abs() <= step + 0.05, "{a} vs {b} (step {step})");
            }
        }
    }

    #[test]
    fn q8_0_round_trips_within_half_a_step() {
        let v = values(3, "t", 64, 0.0, 1.0);
        let bytes = encode(GgmlType::Q8_0, &v);
        let mut back = vec![0f32; 64];
        crate::quants::dequantize_row(GgmlType::Q8_0, &bytes, &mut back).unwrap();
        for (a, b) in v.iter().zip(&back) {
            assert!((a - b).abs() <= 1.0 / 127.0 * 0.5 + 1e-3, "{a} vs {b}");
        }
    }

    #[test]
    fn gpt2_alphabet_maps_back_to_bytes() {
        let m = gpt2_unicode_to_byte();
        assert_eq!(m.len(), 256);
        assert_eq!(m[&'\u{120}'], b' '); // "Ġ"
        assert_eq!(m[&'\u{10a}'], b'\n'); // "Ċ"
        assert_eq!(m[&'a'], b'a');
        assert_eq!(m[&'\u{c3}'], 0xc3); // "Ã": a lead byte alone is not whole UTF-8
    }

    #[test]
    fn mistral_is_refused_with_the_reason() {
        assert!(matches!(
            Family::from_name("mistral"),
            Err(SynthError::Mistral)
        ));
        assert_eq!(Family::from_name("qwen3moe").unwrap(), Family::Qwen3Moe);
    }
}

//! `synth-model --hf-dir`: the Hugging Face twin of a GGUF model (made for the fidelity sweep's
//! random-weight models): the directory transformers' `save_pretrained` would write for the
//! same model — `config.json` in the family's own transformers schema, safetensors weights in
//! Hugging Face names and layouts, `tokenizer.json`, `tokenizer_config.json` and
//! `generation_config.json` — such that llama.cpp's `convert_hf_to_gguf.py` turns it back into
//! the same model (`scripts/hf-refs.sh` checks that, tensor for tensor).
//!
//! What the converter does is undone here exactly: Llama's q/k rows are written in Hugging
//! Face's rotary order (the inverse of its `LlamaModel.permute`); Gemma's norm weights are
//! written minus one (it adds the one back; a value for which that is not exact in f32 is
//! refused); Gemma's embedding is written unscaled, as Hugging Face keeps it; Llama 3 rotary
//! factors become `rope_scaling` (factors no such formula yields are refused); Qwen3-MoE's
//! and DeepSeek's stacked experts are written one module per expert; DeepSeek's split
//! `attn_k_b`/`attn_v_b` are joined back into `kv_b_proj` (`deepseek`). Quantized GGUF tensors
//! are written dequantized (their f32 values), so the twin of a Q8_0/Q4_K model is a float model
//! of the same values, not the same file. In bf16 or f16 every value is rounded to nearest even
//! (norms included, as transformers saves a half-precision model): only an f32 twin is exact.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use npu_gguf::GgufFile;
use npu_hf::safetensors::Dtype;
use npu_hf::writer::{write_model, WriteTensor};
use serde_json::{json, Value};
use thiserror::Error;

/// The transformers release whose schema the files follow (and whose version they record).
const TRANSFORMERS_VERSION: &str = "4.57.6";

/// The element type of the written weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfDtype {
    F32,
    Bf16,
    F16,
}

impl HfDtype {
    pub fn from_name(s: &str) -> Result<Self, HfTwinError> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "f16" | "float16" => Ok(Self::F16),
            _ => Err(HfTwinError::Dtype(s.to_string())),
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::Bf16 => Dtype::BF16,
            Self::F16 => Dtype::F16,
        }
    }

    /// config.json's `torch_dtype`.
    fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::Bf16 => "bfloat16",
            Self::F16 => "float16",
        }
    }

    /// Little-endian bytes of `v` in this type (round to nearest even).
    fn encode(self, v: &[f32]) -> Vec<u8> {
        match self {
            Self::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Self::Bf16 => v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
            Self::F16 => v
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
        }
    }
}

#[derive(Debug, Error)]
pub enum HfTwinError {
    #[error("--hf-dtype {0:?} is not offered (f32, bf16, f16)")]
    Dtype(String),
    #[error("general.architecture {0:?} has no Hugging Face twin here (llama, qwen2, qwen3, qwen3moe, gemma3, deepseek2)")]
    Arch(String),
    #[error("metadata {key}: {problem}")]
    Meta { key: String, problem: String },
    #[error("tensor {name}: {problem}")]
    Tensor { name: String, problem: String },
    #[error("rope_freqs.weight cannot be written as a config.json rope_scaling: {0}")]
    RopeFactors(String),
    #[error("{name}[{index}]: Gemma's norm weight {value:e} (bits {bits:#010x}) does not round-trip through the Hugging Face form w - 1: in f32 (w - 1) + 1 = {back:e}, so convert_hf_to_gguf.py could not give the same value back")]
    GemmaNorm {
        name: String,
        index: usize,
        value: f32,
        bits: u32,
        back: f32,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error(transparent)]
    Hf(#[from] npu_hf::HfError),
    #[error("writing {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The families written, by how their transformers class is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Gemma3,
    Deepseek2,
}

/// The hyper-parameters read from the GGUF.
#[derive(Debug, Clone)]
struct Hp {
    arch: Arch,
    layers: usize,
    context: usize,
    hidden: usize,
    ff: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rope_base: f32,
    rms_eps: f32,
    experts: usize,
    experts_used: usize,
    expert_ff: usize,
    sliding_window: usize,
    vocab: usize,
    tied: bool,
    /// deepseek2's latent attention, experts and YaRN.
    deepseek: Option<deepseek::Deepseek>,
}

/// Writes `gguf`'s Hugging Face twin into `out_dir` (created when missing). `max_shard_bytes`
/// splits the weights into `model-0000K-of-0000N.safetensors` shards as `save_pretrained` does.
pub fn write_hf_twin(
    gguf: &GgufFile,
    out_dir: &Path,
    dtype: HfDtype,
    max_shard_bytes: Option<u64>,
) -> Result<(), HfTwinError> {
    let hp = read_hparams(gguf)?;
    let rope_scaling = rope_scaling(gguf, &hp)?;
    let tensors = hf_tensors(gguf, &hp, dtype)?;
    let config = config_json(gguf, &hp, dtype, rope_scaling);
    let tokenizer = tokenizer_json(gguf)?;
    let tok_config = tokenizer_config_json(gguf)?;

    let views: Vec<WriteTensor> = tensors
        .iter()
        .map(|t| WriteTensor {
            name: &t.name,
            dtype: t.dtype.safetensors(),
            shape: &t.shape,
            data: &t.data,
        })
        .collect();
    write_model(out_dir, &views, max_shard_bytes)?;
    write_json(&out_dir.join("config.json"), &sorted(config))?;
    // The tokenizers library writes tokenizer.json in its own field order.
    write_json(&out_dir.join("tokenizer.json"), &tokenizer)?;
    write_json(&out_dir.join("tokenizer_config.json"), &sorted(tok_config))?;
    write_json(
        &out_dir.join("generation_config.json"),
        &sorted(generation_config_json(gguf)),
    )?;
    Ok(())
}

/// `v` with every object's keys in sorted order, as transformers writes its config files
/// (`json.dumps(..., sort_keys=True)`), whatever order serde_json's maps keep.
fn sorted(v: Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<(String, Value)> = m.into_iter().collect();
            keys.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(keys.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Value::Array(a) => Value::Array(a.into_iter().map(sorted).collect()),
        other => other,
    }
}

fn write_json(path: &Path, v: &Value) -> Result<(), HfTwinError> {
    // Indented by two, with a final newline, as transformers writes them.
    let mut text = serde_json::to_string_pretty(v).expect("a JSON value always serializes");
    text.push('\n');
    std::fs::write(path, text).map_err(|source| HfTwinError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn meta_err(key: &str, problem: impl Into<String>) -> HfTwinError {
    HfTwinError::Meta {
        key: key.to_string(),
        problem: problem.into(),
    }
}

fn read_hparams(g: &GgufFile) -> Result<Hp, HfTwinError> {
    let arch_name = g
        .get_str("general.architecture")
        .ok_or_else(|| meta_err("general.architecture", "missing"))?;
    let arch = match arch_name {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        "qwen3moe" => Arch::Qwen3Moe,
        "gemma3" => Arch::Gemma3,
        "deepseek2" => Arch::Deepseek2,
        other => return Err(HfTwinError::Arch(other.to_string())),
    };
    let ds = arch == Arch::Deepseek2;
    // Keys that change the maths in ways these config schemas (as written here) do not carry.
    for key in [
        "rope.scaling.type",
        "rope.scaling.factor",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "attention.sliding_window_pattern",
        "rope.freq_base_swa",
        "expert_shared_count",
    ] {
        let k = format!("{arch_name}.{key}");
        // deepseek2's YaRN and shared experts have their config.json form (`deepseek`).
        let deepseek_reads = [
            "rope.scaling.type",
            "rope.scaling.factor",
            "expert_shared_count",
        ];
        if ds && deepseek_reads.contains(&key) {
            continue;
        }
        if g.get(&k).is_some() {
            return Err(meta_err(
                &k,
                "present: the twin writer does not express it in config.json",
            ));
        }
    }
    let key = |k: &str| format!("{arch_name}.{k}");
    let req = |k: &str| -> Result<usize, HfTwinError> {
        let k = key(k);
        g.get_u64(&k)
            .map(|v| v as usize)
            .ok_or_else(|| meta_err(&k, "missing or not an integer"))
    };
    let opt = |k: &str| g.get_u64(&key(k)).map(|v| v as usize);
    let float = |k: &str| -> Result<f32, HfTwinError> {
        let k = key(k);
        g.get_f64(&k)
            .map(|v| v as f32)
            .ok_or_else(|| meta_err(&k, "missing or not a number"))
    };
    let hidden = req("embedding_length")?;
    let heads = req("attention.head_count")?;
    if heads == 0 || (!hidden.is_multiple_of(heads) && opt("attention.key_length").is_none()) {
        return Err(meta_err(&key("attention.head_count"), format!("{heads}")));
    }
    let head_dim = opt("attention.key_length").unwrap_or(hidden / heads);
    // deepseek2's value length is its latent's width.
    if let Some(v) = opt("attention.value_length").filter(|_| !ds) {
        if v != head_dim {
            return Err(meta_err(
                &key("attention.value_length"),
                format!(
                    "{v} differs from key_length {head_dim}: no transformers class here has that"
                ),
            ));
        }
    }
    let embd = g
        .tensor_info("token_embd.weight")
        .ok_or_else(|| tensor_err("token_embd.weight", "missing"))?;
    let vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
    let hp = Hp {
        arch,
        layers: req("block_count")?,
        context: req("context_length")?,
        hidden,
        ff: req("feed_forward_length")?,
        heads,
        kv_heads: opt("attention.head_count_kv").unwrap_or(heads),
        head_dim,
        rope_base: float("rope.freq_base")?,
        rms_eps: float("attention.layer_norm_rms_epsilon")?,
        experts: opt("expert_count").unwrap_or(0),
        experts_used: opt("expert_used_count").unwrap_or(0),
        expert_ff: opt("expert_feed_forward_length").unwrap_or(0),
        sliding_window: opt("attention.sliding_window").unwrap_or(0),
        vocab,
        tied: g.tensor_info("output.weight").is_none(),
        deepseek: if ds { Some(deepseek::read(g)?) } else { None },
    };
    if hp.kv_heads == 0 || !hp.heads.is_multiple_of(hp.kv_heads) || !hp.head_dim.is_multiple_of(2) {
        return Err(meta_err(
            &key("attention.head_count_kv"),
            format!(
                "{} heads over {} KV heads of head_dim {}",
                hp.heads, hp.kv_heads, hp.head_dim
            ),
        ));
    }
    if matches!(arch, Arch::Qwen3Moe | Arch::Deepseek2) != (hp.experts > 0) {
        return Err(meta_err(
            &key("expert_count"),
            format!("{} experts on {arch_name}", hp.experts),
        ));
    }
    if arch == Arch::Gemma3 && hp.sliding_window == 0 {
        return Err(meta_err(
            &key("attention.sliding_window"),
            "missing: a Gemma 3 without sliding layers has no Gemma3TextConfig form",
        ));
    }
    Ok(hp)
}

fn tensor_err(name: &str, problem: impl Into<String>) -> HfTwinError {
    HfTwinError::Tensor {
        name: name.to_string(),
        problem: problem.into(),
    }
}

/// The Llama 3 `rope_scaling` whose factors `rope_freqs.weight` holds (the sweep's own
/// parameters, then Llama 3.1's), or `None` without the tensor.
fn rope_scaling(g: &GgufFile, hp: &Hp) -> Result<Option<Value>, HfTwinError> {
    let Some(info) = g.tensor_info("rope_freqs.weight") else {
        return Ok(None);
    };
    if hp.arch != Arch::Llama {
        return Err(HfTwinError::RopeFactors(format!(
            "only Llama 3's formula is expressible, and this is a {:?} model",
            hp.arch
        )));
    }
    let have = tensor_f32(g, "rope_freqs.weight")?;
    if have.len() != hp.head_dim / 2 || info.dims.len() != 1 {
        return Err(HfTwinError::RopeFactors(format!(
            "{} values for head_dim {}",
            have.len(),
            hp.head_dim
        )));
    }
    // (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings): the
    // sweep's (npu_gguf::synth::synth_llama3_factors), then Llama 3.1's.
    for (factor, low, high, orig) in [(8.0, 1.0, 4.0, 8192 / 64), (8.0, 1.0, 4.0, 8192)] {
        let want = npu_gguf::synth::llama3_rope_factors(
            hp.head_dim,
            hp.rope_base as f64,
            factor,
            low,
            high,
            orig as f64,
        );
        if want == have {
            return Ok(Some(json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            })));
        }
    }
    Err(HfTwinError::RopeFactors(format!(
        "its {} factors are not Llama 3's formula for any parameters tried (factor 8, low 1, \
         high 4, original context 128 or 8192): arbitrary factors have no config.json form",
        have.len()
    )))
}

/// A float written as the shortest decimal that gives back the same f32 (1e-6, not
/// 9.999999974752427e-7), as the original config.json would hold it.
fn json_f32(v: f32) -> Value {
    let shortest: f64 = format!("{v}")
        .parse()
        .expect("a float's own display parses");
    json!(shortest)
}

fn config_json(g: &GgufFile, hp: &Hp, dtype: HfDtype, rope_scaling: Option<Value>) -> Value {
    let mut c: BTreeMap<&str, Value> = BTreeMap::new();
    let (class, model_type) = match hp.arch {
        Arch::Llama => ("LlamaForCausalLM", "llama"),
        Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        Arch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        Arch::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
        Arch::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
        // Chosen by `deepseek::config`.
        Arch::Deepseek2 => ("DeepseekV3ForCausalLM", "deepseek_v3"),
    };
    c.insert("architectures", json!([class]));
    c.insert("model_type", json!(model_type));
    c.insert("vocab_size", json!(hp.vocab));
    c.insert("hidden_size", json!(hp.hidden));
    c.insert("intermediate_size", json!(hp.ff));
    c.insert("num_hidden_layers", json!(hp.layers));
    c.insert("num_attention_heads", json!(hp.heads));
    c.insert("num_key_value_heads", json!(hp.kv_heads));
    c.insert("head_dim", json!(hp.head_dim));
    c.insert("max_position_embeddings", json!(hp.context));
    c.insert("rms_norm_eps", json_f32(hp.rms_eps));
    c.insert("rope_theta", json_f32(hp.rope_base));
    c.insert("rope_scaling", rope_scaling.unwrap_or(Value::Null));
    c.insert("tie_word_embeddings", json!(hp.tied));
    c.insert("torch_dtype", json!(dtype.torch_name()));
    c.insert("transformers_version", json!(TRANSFORMERS_VERSION));
    c.insert("attention_dropout", json!(0.0));
    c.insert("initializer_range", json!(0.02));
    c.insert("use_cache", json!(true));
    let id = |k: &str| g.get_u64(k).map_or(Value::Null, |v| json!(v));
    c.insert("bos_token_id", id("tokenizer.ggml.bos_token_id"));
    c.insert("eos_token_id", id("tokenizer.ggml.eos_token_id"));
    if let Some(pad) = g.get_u64("tokenizer.ggml.padding_token_id") {
        c.insert("pad_token_id", json!(pad));
    }
    match hp.arch {
        Arch::Llama => {
            c.insert("hidden_act", json!("silu"));
            c.insert("attention_bias", json!(false));
            c.insert("mlp_bias", json!(false));
            c.insert("pretraining_tp", json!(1));
        }
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => {
            c.insert("hidden_act", json!("silu"));
            c.insert("use_sliding_window", json!(false));
            c.insert("sliding_window", Value::Null);
            c.insert("max_window_layers", json!(hp.layers));
            if hp.arch != Arch::Qwen2 {
                c.insert("attention_bias", json!(false));
            }
            if hp.arch == Arch::Qwen3Moe {
                c.insert("num_experts", json!(hp.experts));
                c.insert("num_experts_per_tok", json!(hp.experts_used));
                c.insert("moe_intermediate_size", json!(hp.expert_ff));
                c.insert("norm_topk_prob", json!(true));
                c.insert("decoder_sparse_step", json!(1));
                c.insert("mlp_only_layers", json!([]));
                c.insert("output_router_logits", json!(false));
                c.insert("router_aux_loss_coef", json!(0.001));
            }
        }
        Arch::Gemma3 => {
            // llama.cpp's Gemma 3 defaults, which the GGUF leaves implicit: every sixth layer
            // global, local layers' rotary base 10000, attention scaled by 1/sqrt(head_dim).
            let pattern = 6;
            let layer_types: Vec<&str> = (0..hp.layers)
                .map(|i| {
                    if (i + 1) % pattern == 0 {
                        "full_attention"
                    } else {
                        "sliding_attention"
                    }
                })
                .collect();
            c.insert("hidden_activation", json!("gelu_pytorch_tanh"));
            c.insert("sliding_window", json!(hp.sliding_window));
            c.insert("sliding_window_pattern", json!(pattern));
            c.insert("layer_types", json!(layer_types));
            c.insert("rope_local_base_freq", json!(10000.0));
            c.insert("query_pre_attn_scalar", json!(hp.head_dim));
            c.insert("final_logit_softcapping", Value::Null);
            c.insert("attn_logit_softcapping", Value::Null);
            c.insert("attention_bias", json!(false));
            c.insert("use_bidirectional_attention", json!(false));
        }
        Arch::Deepseek2 => {
            if let Some(d) = &hp.deepseek {
                deepseek::config(&mut c, hp, d);
            }
        }
    }
    json!(c)
}

fn generation_config_json(g: &GgufFile) -> Value {
    let mut c: BTreeMap<&str, Value> = BTreeMap::new();
    c.insert("_from_model_config", json!(true));
    for (hf, key) in [
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(v) = g.get_u64(key) {
            c.insert(hf, json!(v));
        }
    }
    c.insert("transformers_version", json!(TRANSFORMERS_VERSION));
    json!(c)
}

mod deepseek;
mod tensors;
mod tokenizer;
pub use tensors::{gemma_norm_minus_one, unpermute_rows};
use tensors::{hf_tensors, tensor_f32};
use tokenizer::{tokenizer_config_json, tokenizer_json};

#[cfg(test)]
mod tests;

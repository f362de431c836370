//! The Hugging Face directory reader of the model description: `config.json` to the description
//! (`config`; DeepSeek's in `deepseek`), the safetensors tensors to the GGUF names and layouts
//! the loader reads (`names`), and the quantized checkpoints' weights (`quant`: FP8 e4m3 with block or channel scales, int8
//! with per-channel scales as compressed-tensors and msmodelslim write them) widened to floats.
//!
//! A tensor the family does not use stops the load naming it (as for GGUF files), and so does a
//! quantization scheme the engine does not reproduce (static activation scales, packed int4).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use npu_gguf::{GgmlType, TensorInfo};
use npu_hf::{Dtype, Shards, TensorMeta};
use serde_json::Value;

use crate::{Arch, HparamsError, ModelConfig};

pub(crate) mod config;
mod deepseek;
pub(crate) mod names;
pub(crate) mod quant;
#[cfg(test)]
mod tests;

pub use config::llama3_factors;
use names::{Fix, Target};
use quant::Scheme;

/// One GGUF-named tensor of a directory: where its values come from and what they go through.
#[derive(Debug, Clone)]
struct Entry {
    /// The HF tensors (one, or one per expert in order).
    parts: Vec<TensorMeta>,
    fix: Fix,
    /// Scale (and offset) tensors of a quantized weight, per part.
    scales: Vec<Option<quant::Scales>>,
    /// The type the loader sees, and ggml dims.
    ty: GgmlType,
    dims: Vec<u64>,
}

/// The ggml dims of one half of DeepSeek's `kv_b_proj` (`[heads * (nope + v), latent]`, as
/// the config sizes it): the key half `{nope, latent, heads}`, the value half
/// `{latent, v, heads}`.
fn kv_b_dims(config: &ModelConfig, t: &TensorMeta, fix: Fix) -> Result<Vec<u64>, HparamsError> {
    let mla = config
        .mla
        .ok_or_else(|| inconsistent(format!("{}: kv_b_proj in a model without MLA", t.name)))?;
    let heads = config.n_heads;
    let want = [heads * (mla.qk_nope + mla.v_head_dim), mla.kv_lora_rank];
    if t.shape != want {
        return Err(inconsistent(format!(
            "{}: shape {:?}, while num_attention_heads * (qk_nope_head_dim + v_head_dim) and \
             kv_lora_rank give {want:?}",
            t.name, t.shape
        )));
    }
    let (h, l) = (heads as u64, mla.kv_lora_rank as u64);
    Ok(match fix {
        Fix::KeyUp => vec![mla.qk_nope as u64, l, h],
        _ => vec![l, mla.v_head_dim as u64, h],
    })
}

/// A Hugging Face model directory, read.
pub struct HfCheckpoint {
    dir: PathBuf,
    shards: Shards,
    config: ModelConfig,
    entries: BTreeMap<String, Entry>,
    /// What the weights are stored as, for the start-up note.
    summary: String,
}

fn unsupported(msg: String) -> HparamsError {
    HparamsError::Unsupported(msg)
}

fn inconsistent(msg: String) -> HparamsError {
    HparamsError::Inconsistent(msg)
}

/// The GGUF type a float safetensors dtype is handed over as (None: not a float dtype).
fn float_type(d: Dtype) -> Option<GgmlType> {
    match d {
        Dtype::F32 => Some(GgmlType::F32),
        Dtype::F16 => Some(GgmlType::F16),
        Dtype::BF16 => Some(GgmlType::BF16),
        _ => None,
    }
}

impl HfCheckpoint {
    /// Reads `config.json`, maps every tensor of the shards, and checks that the family uses
    /// each one.
    pub fn open(dir: &Path) -> Result<Self, HparamsError> {
        let cfg_json = npu_hf::read_json(dir, "config.json")?.ok_or_else(|| {
            inconsistent(format!(
                "{}: no config.json (a Hugging Face model directory has config.json, \
                 *.safetensors and tokenizer.json)",
                dir.display()
            ))
        })?;
        let mut config = config::model_config(&cfg_json)?;
        let scheme = Scheme::detect(dir, &cfg_json)?;
        let shards = Shards::open(dir)?;
        let arch = config.arch;
        let (nh, nkv) = (config.n_heads, config.n_kv_heads);
        // Side tensors of quantized weights, by the weight they belong to.
        let mut side: BTreeMap<String, BTreeMap<&'static str, TensorMeta>> = BTreeMap::new();
        let mut mapped: BTreeMap<String, (Target, TensorMeta)> = BTreeMap::new();
        let mut lm_head: Option<TensorMeta> = None;
        // DeepSeek's kv_b_proj gives two tensors: the second half's target.
        let mut twins: Vec<(Target, TensorMeta)> = Vec::new();
        let mut mtp_skipped = 0usize;
        for t in shards.tensors() {
            let name = t.name.as_str();
            if names::ignored(name) {
                continue;
            }
            // DeepSeek-V3's multi-token-prediction layers follow the model's own
            // (model.layers.61 of 61): skipped, as convert_hf_to_gguf.py skips them (the engine
            // does not draft with them).
            if arch == Arch::Deepseek2
                && names::layer_of(name).is_some_and(|il| il >= config.n_layers)
            {
                mtp_skipped += 1;
                continue;
            }
            if let Some((base, kind)) = quant::side_tensor(name) {
                side.entry(format!("{base}.weight"))
                    .or_default()
                    .insert(kind, t.clone());
                continue;
            }
            quant::refuse_static(name)?;
            if name == "lm_head.weight" {
                lm_head = Some(t.clone());
            }
            let target = names::target(arch, name, nh, nkv).ok_or_else(|| {
                unsupported(format!(
                    "{} model: tensor {name:?} is not used by the engine's {} model, and it may \
                     change the maths",
                    arch.name(),
                    arch.name()
                ))
            })?;
            if let Some(v) = names::value_twin(&target) {
                twins.push((v, t.clone()));
            }
            mapped.insert(name.to_string(), (target, t.clone()));
        }
        if mtp_skipped > 0 {
            tracing::info!(
                tensors = mtp_skipped,
                num_hidden_layers = config.n_layers,
                "the multi-token-prediction layers beyond num_hidden_layers are skipped, as \
                 convert_hf_to_gguf.py skips them"
            );
        }
        // Tied or untied output head, as transformers decides it.
        let tie = config::Config::new(&cfg_json)?.tie_word_embeddings(arch)?;
        if let Some(head) = &lm_head {
            if tie {
                let emb = mapped
                    .get("model.embed_tokens.weight")
                    .map(|(_, m)| m.clone())
                    .ok_or_else(|| inconsistent("model.embed_tokens.weight is missing".into()))?;
                if shards.data(head) != shards.data(&emb) {
                    return Err(unsupported(
                        "config.json: tie_word_embeddings = true, but lm_head.weight differs \
                         from model.embed_tokens.weight (transformers would use the embedding \
                         as the head)"
                            .into(),
                    ));
                }
                mapped.remove("lm_head.weight");
            }
        } else if !tie {
            return Err(inconsistent(
                "config.json: tie_word_embeddings = false, but the directory has no \
                 lm_head.weight"
                    .into(),
            ));
        }
        // Group by GGUF name.
        let mut groups: BTreeMap<String, Vec<(Target, TensorMeta)>> = BTreeMap::new();
        for (target, meta) in mapped.into_values().chain(twins) {
            groups
                .entry(target.gguf.clone())
                .or_default()
                .push((target, meta));
        }
        let mut entries = BTreeMap::new();
        let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
        // Side tensors read (kv_b_proj's by both halves).
        let mut side_used: Vec<String> = Vec::new();
        for (gguf, mut parts) in groups {
            parts.sort_by_key(|(t, _)| t.expert);
            let fix = parts[0].0.fix;
            if parts[0].0.expert.is_some() {
                let n = config.moe.map_or(0, |m| m.n_experts);
                let idx: Vec<Option<usize>> = parts.iter().map(|(t, _)| t.expert).collect();
                let want: Vec<Option<usize>> = (0..n).map(Some).collect();
                if idx != want {
                    return Err(inconsistent(format!(
                        "{gguf}: the directory holds experts {:?} of a layer; num_experts = {n} \
                         requires 0..{n}, each once",
                        idx.iter().flatten().collect::<Vec<_>>()
                    )));
                }
            }
            let mut scales = Vec::new();
            for (_, m) in &parts {
                let s = side.get(&m.name).cloned().unwrap_or_default();
                side_used.push(m.name.clone());
                scales.push(scheme.scales(m, s)?);
            }
            let first = &parts[0].1;
            for (_, m) in &parts[1..] {
                if m.dtype != first.dtype || m.shape != first.shape {
                    return Err(inconsistent(format!(
                        "{}: {} {:?}, while {} is {} {:?} (the experts of a layer share a shape)",
                        m.name, m.dtype, m.shape, first.name, first.dtype, first.shape
                    )));
                }
            }
            let mut dims: Vec<u64> = first.shape.iter().rev().map(|&d| d as u64).collect();
            if dims.is_empty() {
                dims.push(1);
            }
            if parts.len() > 1 || parts[0].0.expert.is_some() {
                dims.push(parts.len() as u64);
            }
            if matches!(fix, Fix::KeyUp | Fix::ValueUp) {
                dims = kv_b_dims(&config, first, fix)?;
            }
            let quantized = scales.iter().any(|s| s.is_some());
            let ty = match (fix, float_type(first.dtype)) {
                (Fix::AddOne, _) => GgmlType::F32,
                _ if quantized => GgmlType::BF16,
                (_, Some(t)) => t,
                (_, None) => {
                    return Err(unsupported(format!(
                        "tensor {:?} is {}, and no quantization scheme in config.json or \
                         quant_model_description.json says how to read it",
                        first.name, first.dtype
                    )))
                }
            };
            let kind = if quantized {
                format!("{} (widened to bf16)", first.dtype)
            } else {
                first.dtype.to_string()
            };
            *kinds.entry(kind).or_default() += 1;
            entries.insert(
                gguf,
                Entry {
                    parts: parts.into_iter().map(|(_, m)| m).collect(),
                    fix,
                    scales,
                    ty,
                    dims,
                },
            );
        }
        side.retain(|weight, _| !side_used.contains(weight));
        if let Some((weight, s)) = side.into_iter().next() {
            let kinds: Vec<&str> = s.keys().copied().collect();
            return Err(inconsistent(format!(
                "quantization tensors {kinds:?} of {weight:?}, which the directory does not hold"
            )));
        }
        // The tensors a family uses, as for GGUF files: a tensor the engine would not read
        // stops the load naming it.
        crate::gguf::check_tensor_names(entries.keys().map(String::as_str), &mut config)?;
        config.check()?;
        if config.moe.is_some() && !entries.keys().any(|n| n.ends_with(".ffn_gate.weight")) {
            config.ff = 0;
        }
        let summary = kinds
            .iter()
            .map(|(k, n)| format!("{n} {k}"))
            .collect::<Vec<_>>()
            .join(", ");
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            config,
            entries,
            summary: format!("{summary}{}", scheme.note()),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// What the weights are stored as (e.g. "290 BF16, 1 F32").
    pub fn summary(&self) -> &str {
        &self.summary
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn tensor_info(&self, name: &str) -> Option<TensorInfo> {
        let e = self.entries.get(name)?;
        let n: u64 = e.dims.iter().product();
        Some(TensorInfo {
            name: name.to_string(),
            dims: e.dims.clone(),
            ty: e.ty,
            offset: 0,
            n_bytes: e.ty.row_bytes(n as usize).unwrap_or(0) as u64,
        })
    }

    /// A tensor in the loader's layout: its mapped bytes where nothing changes them, else its
    /// values converted (permuted, shifted, widened).
    pub fn tensor(&self, name: &str) -> Result<(TensorInfo, Cow<'_, [u8]>), HparamsError> {
        let info = self.tensor_info(name).ok_or_else(|| {
            HparamsError::Gguf(npu_gguf::GgufError::MissingTensor(name.to_string()))
        })?;
        let e = &self.entries[name];
        let quantized = e.scales.iter().any(|s| s.is_some());
        if e.parts.len() == 1 && e.fix == Fix::None && !quantized {
            return Ok((info, Cow::Borrowed(self.shards.data(&e.parts[0]))));
        }
        let cols = e.dims[0] as usize;
        let kv_b = matches!(e.fix, Fix::KeyUp | Fix::ValueUp);
        if !quantized && e.fix != Fix::AddOne {
            // Bytes as they are: stacked, and rows permuted for Llama's Q/K.
            let mut raw = Vec::new();
            for p in &e.parts {
                raw.extend_from_slice(self.shards.data(p));
            }
            if let Fix::Permute { heads } = e.fix {
                let rb = cols * e.parts[0].dtype.size();
                raw = names::permute_rows(&raw, heads, rb).ok_or_else(|| {
                    inconsistent(format!(
                        "{}: {} rows cannot be regrouped over {heads} heads",
                        e.parts[0].name,
                        raw.len() / rb.max(1)
                    ))
                })?;
            }
            if kv_b {
                raw = self.split_kv_b(&raw, e.parts[0].dtype.size(), e)?;
            }
            return Ok((info, Cow::Owned(raw)));
        }
        // Values: dequantized or shifted in f32, then encoded as the loader's type.
        let mut values = Vec::new();
        for (p, s) in e.parts.iter().zip(&e.scales) {
            values.extend(quant::to_f32(
                p,
                self.shards.data(p),
                s.as_ref(),
                &self.shards,
            )?);
        }
        if let Fix::Permute { heads } = e.fix {
            let bytes: &[u8] = bytemuck::cast_slice(&values);
            let out = names::permute_rows(bytes, heads, cols * 4).ok_or_else(|| {
                inconsistent(format!(
                    "{}: rows cannot be regrouped over {heads} heads",
                    e.parts[0].name
                ))
            })?;
            values = out
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
        }
        if kv_b {
            let out = self.split_kv_b(bytemuck::cast_slice(&values), 4, e)?;
            values = out
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
        }
        if e.fix == Fix::AddOne {
            for v in &mut values {
                *v += 1.0;
            }
        }
        let bytes = match info.ty {
            GgmlType::F32 => bytemuck::cast_slice(&values).to_vec(),
            GgmlType::BF16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            other => {
                return Err(inconsistent(format!(
                    "{name}: no conversion to {}",
                    other.name()
                )))
            }
        };
        Ok((info, Cow::Owned(bytes)))
    }

    /// One half of DeepSeek's kv_b_proj, from its bytes (`elem` bytes a value).
    fn split_kv_b(&self, raw: &[u8], elem: usize, e: &Entry) -> Result<Vec<u8>, HparamsError> {
        let mla = self.config.mla.ok_or_else(|| {
            inconsistent(format!(
                "{}: kv_b_proj in a model without MLA",
                e.parts[0].name
            ))
        })?;
        let shape = (
            self.config.n_heads,
            mla.qk_nope,
            mla.v_head_dim,
            mla.kv_lora_rank,
        );
        names::split_kv_b(raw, elem, shape, e.fix).ok_or_else(|| {
            inconsistent(format!(
                "{}: {} bytes cannot be split as {shape:?} (heads, qk_nope_head_dim, \
                 v_head_dim, kv_lora_rank)",
                e.parts[0].name,
                raw.len()
            ))
        })
    }

    /// Lets the pages of a tensor's source go (after the loader copied it).
    pub fn release(&self, name: &str) {
        if let Some(e) = self.entries.get(name) {
            for p in &e.parts {
                self.shards.release(p);
            }
        }
    }

    /// Whether the config declares the family `arch` (for tools).
    pub fn arch(&self) -> Arch {
        self.config.arch
    }

    /// The directory's `config.json` and friends, as they are (for the tokenizer and the
    /// generation defaults).
    pub fn read_json(&self, file: &str) -> Result<Option<Value>, HparamsError> {
        Ok(npu_hf::read_json(&self.dir, file)?)
    }
}

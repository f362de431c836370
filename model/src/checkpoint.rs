//! A model's weights, whichever file they came from: a GGUF file or a Hugging Face directory,
//! both handed to the loader under GGUF's tensor names and layouts (ggml dims, row length
//! first), so the loader and the forward pass never learn which one it was. With
//! `LoadOptions::quantize`, float weight matrices (f32, f16, bf16, and widened FP8/int8) are
//! quantized into a GGML block format tensor by tensor as the loader asks for them, so no more
//! than one float tensor is held at a time.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use npu_gguf::{GgmlType, GgufFile, TensorInfo};

use crate::hf::HfCheckpoint;
use crate::{HparamsError, ModelConfig};

/// What `--model` (or `npu_serving.model_file`) names, as a path: a GGUF file or a model
/// directory as it is; a name of the model store (fetched when absent); `ORG/NAME[@REV]` from
/// the local Hugging Face cache (never downloaded); nothing: the default model.
pub fn resolve_model(requested: Option<&Path>) -> Result<PathBuf, HparamsError> {
    if let Some(p) = requested {
        if p.is_dir() {
            return Ok(p.to_path_buf());
        }
        let spec = p.to_str().unwrap_or("");
        let hub_like = !p.exists()
            && spec.split('/').count() == 2
            && !spec.starts_with(['.', '/', '~'])
            && !spec.ends_with(".gguf");
        if hub_like {
            return Ok(npu_hf::resolve_model(spec)?);
        }
    }
    Ok(npu_gguf::store::resolve_model(requested)?)
}

/// How a checkpoint is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Quantize float weight matrices into this format while loading (Q8_0, Q4_0 or Q4_K).
    pub quantize: Option<GgmlType>,
}

impl LoadOptions {
    /// Parses `npu_serving.quantize`'s value: q8_0, q4_k, q4_0 or none.
    pub fn parse_quantize(s: &str) -> Option<Option<GgmlType>> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "" => Some(None),
            "q8_0" => Some(Some(GgmlType::Q8_0)),
            "q4_0" => Some(Some(GgmlType::Q4_0)),
            "q4_k" => Some(Some(GgmlType::Q4K)),
            _ => None,
        }
    }
}

/// The tensors a quantize-at-load applies to: weight matrices (llama-quantize's `--pure`
/// choice), not norms, biases or the MoE router.
fn quantizable(name: &str) -> bool {
    const MATRICES: [&str; 19] = [
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
        "ffn_gate_exps.weight",
        "ffn_up_exps.weight",
        "ffn_down_exps.weight",
        "output.weight",
        // deepseek2's latent attention and shared experts.
        "attn_q_a.weight",
        "attn_q_b.weight",
        "attn_kv_a_mqa.weight",
        "attn_k_b.weight",
        "attn_v_b.weight",
        "ffn_gate_shexp.weight",
        "ffn_up_shexp.weight",
        "ffn_down_shexp.weight",
    ];
    name == "token_embd.weight"
        || MATRICES
            .iter()
            .any(|m| name.ends_with(&format!(".{m}")) || name == *m)
}

/// Where a checkpoint's tensors come from.
pub enum Source {
    Gguf(GgufFile),
    Hf(Box<HfCheckpoint>),
}

/// A model file or directory, opened, with how it is to be read.
pub struct Checkpoint {
    source: Source,
    opts: LoadOptions,
}

impl Checkpoint {
    /// A GGUF file, or a Hugging Face directory, read as stored.
    pub fn open(path: &Path) -> Result<Self, HparamsError> {
        Self::open_with(path, LoadOptions::default())
    }

    /// A GGUF file, or a Hugging Face directory, read under `opts`.
    pub fn open_with(path: &Path, opts: LoadOptions) -> Result<Self, HparamsError> {
        let source = if path.is_dir() {
            Source::Hf(Box::new(HfCheckpoint::open(path)?))
        } else {
            Source::Gguf(GgufFile::open(path)?)
        };
        Ok(Self { source, opts })
    }

    pub fn options(&self) -> LoadOptions {
        self.opts
    }

    /// The model description, as the file's reader builds it.
    pub fn config(&self) -> Result<ModelConfig, HparamsError> {
        match &self.source {
            Source::Gguf(f) => ModelConfig::from_gguf(f),
            Source::Hf(d) => Ok(d.config().clone()),
        }
    }

    pub fn path(&self) -> &Path {
        match &self.source {
            Source::Gguf(f) => f.path(),
            Source::Hf(d) => d.path(),
        }
    }

    /// The GGUF file, when the checkpoint is one (its metadata carries the tokenizer).
    pub fn as_gguf(&self) -> Option<&GgufFile> {
        match &self.source {
            Source::Gguf(f) => Some(f),
            Source::Hf(_) => None,
        }
    }

    /// What the weights are stored as, for the start-up log.
    pub fn describe(&self) -> String {
        match &self.source {
            Source::Gguf(f) => format!("GGUF file {}", f.path().display()),
            Source::Hf(d) => format!(
                "Hugging Face directory {} ({})",
                d.path().display(),
                d.summary()
            ),
        }
    }

    /// Every tensor name (GGUF naming).
    pub fn tensor_names(&self) -> Vec<String> {
        match &self.source {
            Source::Gguf(f) => f.tensors().iter().map(|t| t.name.clone()).collect(),
            Source::Hf(d) => d.tensor_names().map(str::to_string).collect(),
        }
    }

    /// A tensor's name, type and dims as the file holds it (before any quantize-at-load).
    pub fn stored_info(&self, name: &str) -> Option<TensorInfo> {
        match &self.source {
            Source::Gguf(f) => f.tensor_info(name).cloned(),
            Source::Hf(d) => d.tensor_info(name),
        }
    }

    /// The type a tensor is handed over as under `opts`: the quantize format where it applies
    /// (a float matrix whose rows fill whole blocks; Q4_K falls back to Q8_0 on rows of 32s).
    pub fn load_type(&self, name: &str) -> Option<GgmlType> {
        self.tensor_info(name).map(|i| i.ty)
    }

    /// A tensor's info under `opts` (type after quantize-at-load).
    pub fn tensor_info(&self, name: &str) -> Option<TensorInfo> {
        let mut info = self.stored_info(name)?;
        if let Some(ty) = target_type(name, &info, &self.opts) {
            info.ty = ty;
            info.n_bytes = ty.row_bytes(info.n_elements() as usize).unwrap_or(0) as u64;
        }
        Some(info)
    }

    /// A tensor's bytes in the loader's layout, quantized where `opts` says.
    pub fn tensor(&self, name: &str) -> Result<(TensorInfo, Cow<'_, [u8]>), HparamsError> {
        let (info, data) = match &self.source {
            Source::Gguf(f) => {
                let (i, d) = f.tensor(name)?;
                (i.clone(), Cow::Borrowed(d))
            }
            Source::Hf(d) => d.tensor(name)?,
        };
        let Some(ty) = target_type(name, &info, &self.opts) else {
            return Ok((info, data));
        };
        let cols = info.row_len();
        let n = info.n_elements() as usize;
        let rb = info.ty.row_bytes(cols).unwrap_or(0);
        let out_rb = ty.row_bytes(cols).unwrap_or(0);
        let rows = n / cols.max(1);
        if rb == 0 || out_rb == 0 || data.len() != rows * rb {
            return Err(HparamsError::Inconsistent(format!(
                "tensor {name}: {} bytes for {rows} rows of {cols} {} values",
                data.len(),
                info.ty.name()
            )));
        }
        // A chunk of rows at a time: no more than CHUNK rows are held in f32.
        const CHUNK: usize = 512;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut out = vec![0u8; rows * out_rb];
        let mut values = vec![0f32; CHUNK.min(rows) * cols];
        for (src, dst) in data.chunks(CHUNK * rb).zip(out.chunks_mut(CHUNK * out_rb)) {
            let k = src.len() / rb;
            let vals = &mut values[..k * cols];
            for (row, v) in src.chunks_exact(rb).zip(vals.chunks_exact_mut(cols)) {
                npu_gguf::quants::dequantize_row(info.ty, row, v)
                    .map_err(|e| HparamsError::Inconsistent(format!("tensor {name}: {e}")))?;
            }
            npu_gguf::quantize::quantize_rows(ty, vals, cols, dst, threads).map_err(|e| {
                HparamsError::Inconsistent(format!("quantizing tensor {name}: {e}"))
            })?;
        }
        drop(data);
        let out_bytes = out.len();
        let info = TensorInfo {
            ty,
            n_bytes: out_bytes as u64,
            ..info
        };
        Ok((info, Cow::Owned(out)))
    }

    /// Lets the mapped pages of a tensor go once the backend holds its copy.
    pub fn release(&self, name: &str) {
        if let Source::Hf(d) = &self.source {
            d.release(name);
        }
    }

    /// Opens the same checkpoint afresh (a mapping of its own).
    pub fn reopen(&self) -> Result<Self, HparamsError> {
        Self::open_with(&PathBuf::from(self.path()), self.opts)
    }

    /// Whether the model came from a Hugging Face directory.
    pub fn is_dir(&self) -> bool {
        matches!(self.source, Source::Hf(_))
    }

    /// The directory reader, when the checkpoint is one.
    pub fn as_dir(&self) -> Option<&HfCheckpoint> {
        match &self.source {
            Source::Hf(d) => Some(d),
            Source::Gguf(_) => None,
        }
    }
}

/// The quantize-at-load type of a tensor (None: handed over as stored).
fn target_type(name: &str, info: &TensorInfo, opts: &LoadOptions) -> Option<GgmlType> {
    let want = opts.quantize?;
    if !matches!(info.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
        || info.dims.len() < 2
        || !quantizable(name)
    {
        return None;
    }
    let cols = info.row_len();
    if cols.is_multiple_of(want.block_len()) {
        Some(want)
    } else if cols.is_multiple_of(GgmlType::Q8_0.block_len()) {
        Some(GgmlType::Q8_0)
    } else {
        None
    }
}

impl From<&GgufFile> for Checkpoint {
    /// The file read as stored (a clone shares its mapping).
    fn from(f: &GgufFile) -> Self {
        Self::from(f.clone())
    }
}

impl From<GgufFile> for Checkpoint {
    fn from(f: GgufFile) -> Self {
        Self {
            source: Source::Gguf(f),
            opts: LoadOptions::default(),
        }
    }
}

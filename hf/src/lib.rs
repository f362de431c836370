//! Hugging Face model directories as files: the safetensors shards (`safetensors`, with the
//! index that shards them), the JSON files a directory carries (`config.json`,
//! `generation_config.json`, ...), where a model named `ORG/NAME` lies in the local hub cache
//! (`hub`), and a writer of safetensors files for tools and tests (`writer`). What the files
//! mean as a model (hyper-parameters, tensor names) is `npu-model`'s business, not this crate's.
//!
//! Every failure is one [`HfError`], whose message names the file (and the tensor or key) and
//! what is wrong with it.

use std::path::{Path, PathBuf};

use thiserror::Error;

pub mod generation;
pub mod hub;
pub mod safetensors;
pub mod writer;

pub use generation::GenerationConfig;
pub use hub::{cache_dirs, resolve_model, resolve_model_in};
pub use safetensors::{parse, Dtype, Shards, TensorMeta};
pub use writer::{write_file, write_model, WriteTensor};

/// Everything that can go wrong reading or writing a Hugging Face model directory.
#[derive(Debug, Error)]
pub enum HfError {
    /// An operating-system call on a file failed (`op` says which: "reading", "mapping", ...).
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file that does not parse.
    #[error("{path}: invalid JSON at line {line}, column {column}: {message}")]
    Json {
        path: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
    /// A damaged safetensors file: `tensor` names the tensor when the fault is one tensor's.
    #[error("{file}: {}{what}", tensor_label(tensor))]
    Safetensors {
        file: String,
        tensor: Option<String>,
        what: String,
    },
    /// `model.safetensors.index.json` that disagrees with itself or with the shards it names.
    #[error("{path}: {what}")]
    Index { path: PathBuf, what: String },
    /// A model directory with no safetensors weights in the layouts this crate reads.
    #[error(
        "{dir}: no safetensors weights: looked for {looked_for}{}",
        present_label(present)
    )]
    NoWeights {
        dir: PathBuf,
        looked_for: String,
        present: Vec<String>,
    },
    /// `--model ORG/NAME` that is neither a path nor in any local hub cache.
    #[error("{}", not_found_message(spec, searched))]
    ModelNotFound { spec: String, searched: Vec<String> },
    /// A `--model` value that is not a path and not `ORG/NAME[@REVISION]`.
    #[error("model {spec:?}: {what}")]
    BadModelSpec { spec: String, what: String },
    /// A hub-cache snapshot (or a model directory) without its `config.json`.
    #[error("{dir}: no config.json in this model snapshot (an incomplete download? fetch it again with `huggingface-cli download`)")]
    NoConfig { dir: PathBuf },
    /// A value of `generation_config.json` of the wrong type or out of range.
    #[error("generation_config.json: {key:?}: {what}")]
    Generation { key: String, what: String },
    /// Tensors that cannot be written as given (sizes that disagree, duplicate names, ...).
    #[error("writing {path}: {what}")]
    Write { path: PathBuf, what: String },
}

fn tensor_label(tensor: &Option<String>) -> String {
    match tensor {
        Some(t) => format!("tensor {t:?}: "),
        None => String::new(),
    }
}

fn present_label(present: &[String]) -> String {
    if present.is_empty() {
        " (the directory has no *.safetensors file)".to_string()
    } else {
        format!(
            " (the directory has {}, but no file naming them as one model)",
            present.join(", ")
        )
    }
}

fn not_found_message(spec: &str, searched: &[String]) -> String {
    let mut s = format!(
        "model {spec:?} is not a file or directory, and is not in the local Hugging Face hub cache; looked in:"
    );
    if searched.is_empty() {
        s.push_str(" (no cache directory: neither $HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE, $HF_HOME nor $HOME is set)");
    }
    for d in searched {
        s.push_str("\n  ");
        s.push_str(d);
    }
    let repo = spec.split('@').next().unwrap_or(spec);
    s.push_str(&format!(
        "\nnothing is downloaded: run `huggingface-cli download {repo}` on a machine with network \
         access and copy its hub cache (~/.cache/huggingface/hub) here, or pass the model \
         directory's path as --model"
    ));
    s
}

impl HfError {
    pub(crate) fn io(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        HfError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Reads `dir/file` as JSON: `None` when the file does not exist; a file that does not parse
/// is an error naming it, the line and the column.
pub fn read_json(dir: &Path, file: &str) -> Result<Option<serde_json::Value>, HfError> {
    let path = dir.join(file);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(HfError::io("reading", &path, e)),
    };
    parse_json(&path, &text).map(Some)
}

/// Parses `bytes` as JSON, naming `path`, the line and the column when it does not parse.
pub(crate) fn parse_json(path: &Path, bytes: &[u8]) -> Result<serde_json::Value, HfError> {
    serde_json::from_slice(bytes).map_err(|e| HfError::Json {
        path: path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        message: json_message(&e),
    })
}

/// serde_json's message without its trailing " at line L column C" (the error carries those).
fn json_message(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

#[cfg(test)]
mod tests;

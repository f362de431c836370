//! A Llama-family model on a Backend: hyper-parameters (from `npu_model`), weights handed
//! to the device as the file stores them (`weights`), and the batched forward step over a paged
//! KV cache (`runner`), whose pool may be sized from free device memory (`kv_sizing`).

pub mod capabilities;
pub mod kv_sizing;
pub mod lora;
pub mod mla;
pub mod runner;
pub mod weights;

use thiserror::Error;

use npu_backend::BackendError;
use npu_gguf::GgufError;
use npu_model::HparamsError;

pub use npu_model::{Arch, ModelConfig};
pub use runner::{default_step_buckets, Model, ModelOptions, StepOutput};

#[derive(Debug, Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Hparams(#[from] HparamsError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("inconsistent model: {0}")]
    Inconsistent(String),
    #[error("bad model options: {0}")]
    BadOptions(String),
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    #[error("long-context mode: {0}")]
    LongContext(String),
    #[error(transparent)]
    Adapter(#[from] lora::AdapterError),
}

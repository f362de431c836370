//! A Llama-family model on a Backend: hyper-parameters (from `npu_gguf::hparams`), weights uploaded in the device's
//! layout (`weights`), and the batched forward step over a paged KV cache (`runner`).

pub mod runner;
pub mod weights;

use thiserror::Error;

use npu_backend::legacy::BackendError;
use npu_gguf::hparams::HparamsError;
use npu_gguf::GgufError;

pub use npu_gguf::hparams::{Arch, ModelConfig};
pub use runner::{Model, ModelOptions};

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
    #[error("bad step: {0}")]
    BadStep(String),
}

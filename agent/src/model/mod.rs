//! A Llama-family model on a Backend: hyper-parameters (`config`), weights uploaded in the device's
//! layout (`weights`), and the batched forward step over a paged KV cache (`runner`).

pub mod config;
pub mod runner;
pub mod weights;

use thiserror::Error;

use crate::backend::BackendError;
use crate::gguf::GgufError;

pub use config::{Arch, ModelConfig};
pub use runner::{Model, ModelOptions};

#[derive(Debug, Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("inconsistent model: {0}")]
    Inconsistent(String),
    #[error("bad step: {0}")]
    BadStep(String),
}

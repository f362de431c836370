//! LoRA adapters read from disk into host memory and checked against the base model they will
//! run on: PEFT directories (`adapter`) and llama.cpp's GGUF LoRA files (`gguf_adapter`). Here
//! (not in the agent) so that the server can check an adapter when it is listed or loaded, with
//! the same reader the agents use.

pub mod adapter;
pub mod gguf_adapter;

pub use adapter::{AdapterError, HostAdapter, LowRank, Target};

use std::path::Path;

/// Reads an adapter for a model of `cfg` with ranks up to `max_rank`: a GGUF LoRA file when
/// `path` is a file, else a PEFT directory.
pub fn read_adapter(
    path: &Path,
    cfg: &crate::ModelConfig,
    max_rank: usize,
) -> Result<HostAdapter, AdapterError> {
    if path.is_file() {
        gguf_adapter::read_gguf_lora(path, cfg, max_rank)
    } else {
        adapter::read_peft(path, cfg, max_rank)
    }
}

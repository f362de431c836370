//! npu-agent: the worker agent. It loads a GGUF model onto a `Backend`, runs batched Llama steps
//! with a paged KV cache, samples next tokens, and serves step plans from the server over shared
//! memory (`worker`). The local commands (`generate`, `score`, `bench-model`) live in `cli`.

pub mod cli;
pub mod engine;
pub mod local;
pub mod model;
pub mod sampler;
pub mod worker;

//! npu-agent: the worker agent's engine. It loads a GGUF model, tokenizes, runs batched Llama
//! steps with a paged KV cache on a `Backend`, and samples next tokens.

pub mod backend;
pub mod cli;
pub mod engine;
pub mod gguf;
pub mod kernels;
pub mod local;
pub mod model;
pub mod model_store;
pub mod quant;
pub mod sampler;
pub mod threadpool;
pub mod tokenizer;
pub mod worker;

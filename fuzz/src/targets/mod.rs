//! One module per target; each `run` is a [`crate::Harness`].

pub mod agent_link;
pub mod anthropic;
pub mod api;
pub mod chat;
pub mod config;
pub mod gguf;
pub mod http;
pub mod kv_subscriber;
pub mod responses;
pub mod safetensors;
pub mod tokenize;
pub mod tokenizer;

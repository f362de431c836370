//! npu-server: the serving process. YAML config, HTTP front ends (llm-serving and OpenAI APIs),
//! the engine loop (scheduler + paged block manager) and the agent processes it drives.

pub mod agents;
pub mod api;
pub mod auth;
pub mod config;
pub mod engine;
pub mod http;
pub mod kv_events;
pub mod lora;
pub mod metrics;
pub mod metrics_kv;
pub mod metrics_pd;
pub mod metrics_sleep;
pub mod models;
pub mod serve;

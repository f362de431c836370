//! The agent-side commands of the `npu-serving` binary that run a model in-process: `generate`,
//! `score` and `bench-model`.

pub mod bench_model;
pub mod generate;
pub mod score;

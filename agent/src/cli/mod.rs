//! The agent-side commands of the `npu-serving` binary that run a model in-process: `generate`,
//! `score` and `bench-model`. Each takes `--device` (and `--device-id`) like an agent's config.
//! `synth-model` writes the tiny random-weight models of the family fidelity tests (and, with
//! `--hf-dir`, their Hugging Face twins);
//! `bench-collective` times the all-reduce of tensor-parallel groups; `bench-spec` what
//! speculative decoding gains; `bench-model --bandwidth-rounds` how much of the memory bandwidth
//! batch-1 decode reads.

pub mod bench_bandwidth;
pub mod bench_collective;
pub mod bench_kv_dtype;
pub mod bench_long_context;
pub mod bench_lora;
pub mod bench_model;
pub mod bench_moe_tp;
pub mod bench_prefetch;
pub mod bench_spec;
pub mod generate;
pub mod score;
pub mod synth;
pub mod synth_hf;

use clap::Args;
use npu_protocol::agent::DeviceKind;

/// Which device a command runs the model on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Args)]
pub struct DeviceArgs {
    /// Device to run on: cpu, cuda or ascend (the last two need a build with that cargo
    /// feature).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// Which device of that kind.
    #[arg(long, default_value_t = 0)]
    pub device_id: u32,
}

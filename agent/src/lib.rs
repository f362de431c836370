//! npu-agent: the worker agent. It loads a GGUF model onto the device its config names
//! (`device`: the backends compiled in), reads each step plan once into the device's inputs
//! (`step_input`), runs batched Llama steps with a paged KV cache (`model`), samples next tokens
//! (`sampler`), moves KV blocks between the device pool and its host pool (`kv_host`), keeps
//! the host memory of long-context sequences (`long_context`), runs as one rank of a
//! tensor-parallel group (`tp`), and serves step plans from the server over shared memory
//! (`worker`). The local
//! commands (`generate`, `score`, `bench-model`) live in `cli` and run the real scheduler
//! in-process (`inproc`).

pub mod cli;
pub mod collectives;
pub mod conformance;
pub mod device;
pub mod engine;
mod engine_lora;
pub mod inproc;
pub mod kv_host;
pub mod long_context;
pub mod model;
pub mod sampler;
pub mod step_input;
pub mod tp;
pub mod worker;

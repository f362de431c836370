//! npu-backend-cuda: the CUDA implementation of the `npu_backend::Backend` trait.
//!
//! - `libs`: finds libcuda, libnvrtc and libcublas at run time before anything touches them, so
//!   a machine without CUDA gets `BackendError::MissingLibrary` naming what is missing.
//! - `kernels` + `kernels/*.cu`: the CUDA C kernels of a Llama step and of the newer families'
//!   ops (per-head Q/K norm, GELU gate, row scaling, sliding-window attention, rope frequency
//!   factors and per-layer bases, mixture-of-experts in `moe`, DeepSeek's scored routing and
//!   latent attention in `mla`, multi-LoRA's segmented low-rank product in `lora`: every
//!   `Capability`), compiled at run time by NVRTC
//!   (`nvrtc`, cached per architecture in memory and on disk).
//! - `gpu`: the seam under the backend (memory, copies, launches, one GEMM, one waiting read);
//!   `driver` implements it with cudarc on a real device, `emu` (feature `emulation`) on a CPU
//!   emulation of the same kernel sources.
//! - `backend` + `ops`: `CudaBackend`, the trait implementation: weights (`weights`), the paged
//!   KV pool (`kv`: f16, or int8 in the CPU backend's block bytes), step inputs in one
//!   host→device copy (`step`), and the ops (`attention`: KV writes and paged attention over
//!   either pool); `fused`: the row ops
//!   that take a neighbour's work (the residual add in the next norm, the activation quantizer
//!   in the kernel producing a quantized product's input).
//! - `offload`: sleep level 1 (`Backend::offload_weights`): every loaded weight copied to host
//!   memory and its device memory freed, then allocated and copied back, the model's handles
//!   unchanged.
//! - `graphs`: decode steps captured as CUDA graphs and replayed (`Backend::step_graphs`): one
//!   graph per batch bucket and table width, its inputs at fixed addresses, attention's split
//!   from the table width; the device records and replays (`driver::graph` with
//!   `cuStreamBeginCapture_v2`/`cuGraphLaunch` on a GPU, `emu::capture` on the emulation).
//!   Run on the emulation only. Measured on an H100 before graphs
//!   (docs/gpu-checks/2026-11-26-h100.md): a decode step of a 1B-class model is about 300
//!   launches and takes 1.85 ms a token at batch 1 against llama.cpp's 0.93 ms, with the
//!   kernels' own time close to the whole step, so graphs alone will not close that gap.

mod attention;
pub mod backend;
pub mod buffer;
pub mod config;
pub mod cublas;
mod driver;
#[cfg(feature = "emulation")]
pub mod emu;
pub mod fault;
mod fold;
mod fold_attn;
mod fold_ffn;
mod fused;
pub mod gpu;
mod graphs;
mod host_rows;
pub mod kernels;
mod kv;
pub mod libs;
mod lora;
mod matmul;
mod matmul_k;
mod mla;
mod moe;
pub mod nccl;
pub mod nvrtc;
mod offload;
mod open;
mod ops;
pub mod staging;
pub mod step;
pub mod weights;

pub use backend::{open_libraries, CudaBackend};
pub use buffer::CudaBuffer;
pub use config::{CudaConfig, KQuants, MatmulMode};
pub use matmul::GemvVariant;
pub use weights::{CudaEmbedding, CudaMatrix};

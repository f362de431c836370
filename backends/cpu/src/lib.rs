//! npu-backend-cpu: the CPU implementation of the `npu_backend::Backend` trait. It owns the CPU
//! kernels (`kernels`: quantized and f32 matmuls, paged attention, element-wise ops, with run-time
//! instruction-set dispatch), the weight and activation formats they read (`quant`), and the
//! fork-join thread pool they run on (`threadpool`), with the disjoint output tiles its tasks
//! write (`disjoint`), and the measured limits of the machine they run on (`roofline`).

mod backend;
pub mod disjoint;
pub mod kernels;
pub mod quant;
pub mod roofline;
pub mod threadpool;

pub use backend::{CpuBackend, CpuBuffer, CpuConfig, CpuEmbedding, KvRounding};

//! npu-backend-cuda: the CUDA backend.
pub mod kernels;
pub mod libs;
pub mod nvrtc;

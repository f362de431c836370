//! npu-ffi: raw C API declarations (CANN/ACL and aclnn, CUDA), loaded at run time.

//! npu-ffi: raw C API declarations loaded at run time — CANN's ACL runtime (`libascendcl`) and
//! aclnn (`libnnopbase`, `libopapi`, split `libopapi_*` packages) and HCCL (`libhccl`, [`hccl`]), written by hand from the
//! documented prototypes, resolved into function-pointer tables by [`loader::AscendApi`].
//!
//! Nothing here links CANN at build time: a machine without CANN builds and runs everything
//! else, and loading fails with an error naming the missing library and `set_env.sh`. When CANN's
//! headers are installed, `build.rs` regenerates the same declarations with bindgen and a test
//! compares the two (see `tests/bindgen_compare.rs`).

pub mod acl_rt;
pub mod aclnn;
pub mod hccl;
pub mod loader;
#[doc(hidden)]
pub mod table;
pub mod types;

pub use loader::{complete_environment, AscendApi, EnvCompletion, LoadError, SearchPaths};

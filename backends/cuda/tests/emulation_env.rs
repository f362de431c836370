//! `NPU_SERVING_CUDA_EMULATION=1` makes `CudaBackend::new` open the CPU emulation of the kernels
//! in a build with the `emulation` feature (this test target has it), so a whole model can be
//! run on the kernels through the agent's usual device path on a machine without a GPU. Its own
//! test binary: the variable is process-wide.

use npu_backend::{Backend, Capability};
use npu_backend_cuda::config::ENV_EMULATION;
use npu_backend_cuda::{CudaBackend, CudaConfig};

#[test]
fn the_variable_opens_the_emulation_and_only_when_it_is_1() {
    let cfg = CudaConfig {
        lib_dirs: Vec::new(),
        int8_mma: true,
        fuse: true,
        fold_gemv: true,
        fold_rope: false,
        kernel_cache: None,
        ..CudaConfig::default()
    };
    std::env::set_var(ENV_EMULATION, "0");
    if let Ok(b) = CudaBackend::new(0, cfg.clone()) {
        assert!(
            b.emulation().is_none(),
            "{}=0 opened the emulation",
            ENV_EMULATION
        );
    }
    std::env::set_var(ENV_EMULATION, "1");
    match CudaBackend::new(0, cfg) {
        Ok(b) => {
            assert!(b.emulation().is_some(), "{}", b.describe());
            assert!(b.describe().contains("emulation"), "{}", b.describe());
            assert!(b.supports(Capability::SlidingWindow));
        }
        Err(e) if e.to_string().contains("could not run the C++ compiler") => {
            eprintln!("SKIPPED (no C++ compiler for the CUDA emulation): {e}");
        }
        Err(e) => panic!("{e}"),
    }
}

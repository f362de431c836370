//! Opening a CUDA device where there is none: a clear error naming what is missing, never a
//! panic. On this project's CI machines there is no NVIDIA driver, so `libcuda.so` is missing;
//! on a machine with the driver but no GPU the error names the device instead.

use npu_backend::BackendError;
use npu_backend_cuda::{CudaBackend, CudaConfig};

fn driver_present() -> bool {
    npu_backend_cuda::libs::require_driver(&[]).is_ok()
}

#[test]
fn opening_a_device_without_cuda_names_the_missing_library() {
    let cfg = CudaConfig {
        lib_dirs: Vec::new(),
        int8_mma: true,
        fuse: true,
        fold_gemv: true,
        fold_rope: false,
        ..CudaConfig::default()
    };
    let result = std::panic::catch_unwind(|| CudaBackend::new(0, cfg.clone()));
    let result = result.expect("CudaBackend::new must not panic");
    match result {
        Ok(_) => {
            eprintln!("a CUDA device opened here: nothing to check for the no-CUDA path");
        }
        Err(BackendError::MissingLibrary { backend, message }) => {
            assert_eq!(backend, "cuda");
            assert!(!driver_present(), "libcuda loads, yet: {message}");
            assert!(message.contains("libcuda.so"), "{message}");
            assert!(message.contains("NVIDIA driver"), "{message}");
            let shown = BackendError::MissingLibrary { backend, message }.to_string();
            eprintln!("{shown}");
            assert!(
                shown.starts_with("cuda: a library it needs is missing"),
                "{shown}"
            );
        }
        Err(e) => {
            // The driver library loads but there is no usable device (or NVRTC/cuBLAS are
            // present too and the device failed): the message must still say what failed.
            assert!(driver_present(), "unexpected error without a driver: {e}");
            assert!(e.to_string().contains("cuda"), "{e}");
        }
    }
}

#[test]
fn a_device_id_beyond_the_machine_is_refused() {
    let r = std::panic::catch_unwind(|| CudaBackend::new(1000, CudaConfig::default()))
        .expect("CudaBackend::new must not panic");
    let e = r.err().expect("no machine has 1001 CUDA devices");
    let msg = e.to_string();
    assert!(
        msg.contains("libcuda.so") || msg.contains("no CUDA device 1000"),
        "{msg}"
    );
}

#[test]
fn a_directory_with_a_broken_library_is_not_a_crash() {
    // A file named like NVRTC that is not a library: found, fails to load, reported missing.
    let dir = std::env::temp_dir().join(format!("npu-cuda-broken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("libcuda.so.1"), b"not an ELF file").unwrap();
    let cfg = CudaConfig {
        lib_dirs: vec![dir.clone()],
        int8_mma: true,
        fuse: true,
        fold_gemv: true,
        fold_rope: false,
        ..CudaConfig::default()
    };
    let r = std::panic::catch_unwind(|| CudaBackend::new(0, cfg)).expect("no panic");
    if let Err(BackendError::MissingLibrary { message, .. }) = r {
        assert!(message.contains(&dir.display().to_string()), "{message}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

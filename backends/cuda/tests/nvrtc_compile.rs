//! Compiles every kernel with NVRTC for several GPU architectures. NVRTC needs no GPU and no
//! driver, only libnvrtc: found by the loader, in NPU_SERVING_CUDA_LIB_DIR, or from the PyPI
//! package nvidia-cuda-nvrtc-cu12 (scripts/test.sh installs it). Without it the test says why it
//! skipped.

use npu_backend_cuda::kernels::{kernel_names, program_source};
use npu_backend_cuda::libs::{self, CudaLib};
use npu_backend_cuda::nvrtc::{self, Target};

fn pip_nvrtc_dir() -> Option<std::path::PathBuf> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import nvidia.cuda_nvrtc as m; print(list(m.__path__)[0])",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = String::from_utf8(out.stdout).ok()?;
    Some(std::path::Path::new(dir.trim()).join("lib"))
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    let mut dirs = libs::default_search_dirs();
    dirs.extend(pip_nvrtc_dir());
    if let Err(why) = libs::require(&[CudaLib::Nvrtc], &dirs) {
        eprintln!("SKIPPED every_kernel_compiles_for_sm80_and_sm90: {why}");
        return;
    }
    let (major, minor) = nvrtc::version().unwrap();
    eprintln!("NVRTC {major}.{minor}");
    let src = program_source();
    let names = kernel_names();
    for (a, b) in [(8, 0), (9, 0)] {
        let ptx = nvrtc::compile_source(&src, Target::Ptx(a, b)).unwrap_or_else(|e| panic!("{e}"));
        let text = String::from_utf8_lossy(&ptx);
        for n in &names {
            assert!(
                text.contains(&format!(".entry {n}(")),
                "compute_{a}{b}: no entry point {n}"
            );
        }
        let cubin =
            nvrtc::compile_source(&src, Target::Cubin(a, b)).unwrap_or_else(|e| panic!("{e}"));
        assert!(cubin.starts_with(b"\x7fELF"), "sm_{a}{b}: not an ELF image");
    }
}

//! Builds the emulation library: the kernel program compiled as C++ against the shim
//! (emulation/cuda_shim.h), the scheduler (emulation/runtime.cpp) and one launch entry point per
//! kernel, with the system C++ compiler (`$CXX`, else `c++`). Cached by a hash of everything that
//! goes in, under `<cache>/cuda-emulation/`.

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::kernels;

const SHIM: &str = include_str!("../../emulation/cuda_shim.h");
const RUNTIME: &str = include_str!("../../emulation/runtime.cpp");
const LAUNCH: &str = include_str!("../../emulation/launch.h");
const DEVICE_MATH: &str = include_str!("../../emulation/device_math.h");
const FLAGS: [&str; 7] = [
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-shared",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-w",
];

fn kernels_cpp() -> String {
    let mut s = String::from("#include \"cuda_shim.h\"\n#include \"device_math.h\"\n");
    s.push_str(&kernels::program_source());
    s.push_str("\n#include \"launch.h\"\n");
    for n in kernels::kernel_names() {
        s.push_str(&format!("NPU_EMU_KERNEL({n})\n"));
    }
    s
}

fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

fn cache_dir() -> PathBuf {
    npu_gguf::store::StoreEnv::from_process()
        .cache_dir()
        .map(|d| d.join("cuda-emulation"))
        .unwrap_or_else(|_| std::env::temp_dir().join("npu-serving-cuda-emulation"))
}

/// The path of the built library (building it if needed).
pub fn library() -> Result<PathBuf, String> {
    let cpp = kernels_cpp();
    let cxx = compiler();
    let mut h = Sha256::new();
    for part in [
        SHIM,
        RUNTIME,
        LAUNCH,
        DEVICE_MATH,
        cpp.as_str(),
        cxx.as_str(),
    ] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    for f in FLAGS {
        h.update(f.as_bytes());
    }
    let key: String = h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = cache_dir();
    let lib = dir.join(format!("npu-cuda-emu-{key}.so"));
    if lib.is_file() {
        return Ok(lib);
    }
    let work = dir.join(format!("build-{key}-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let result = compile(&work, &cpp, &cxx, &lib);
    let _ = std::fs::remove_dir_all(&work);
    result.map(|_| lib)
}

fn compile(work: &Path, cpp: &str, cxx: &str, lib: &Path) -> Result<(), String> {
    for (name, text) in [
        ("cuda_shim.h", SHIM),
        ("runtime.cpp", RUNTIME),
        ("launch.h", LAUNCH),
        ("device_math.h", DEVICE_MATH),
        ("kernels.cpp", cpp),
    ] {
        std::fs::write(work.join(name), text).map_err(|e| format!("{name}: {e}"))?;
    }
    let tmp = work.join("lib.so");
    let out = Command::new(cxx)
        .args(FLAGS)
        .arg("-o")
        .arg(&tmp)
        .arg(work.join("runtime.cpp"))
        .arg(work.join("kernels.cpp"))
        .output()
        .map_err(|e| format!("could not run the C++ compiler `{cxx}` (set CXX): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the C++ compiler could not build the CUDA emulation:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    std::fs::rename(&tmp, lib).map_err(|e| format!("{}: {e}", lib.display()))
}

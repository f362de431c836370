//! Finding the CUDA libraries at run time, before cudarc touches them (cudarc panics when a
//! library it loads lazily is missing). A library is found by the loader's usual search
//! (`LD_LIBRARY_PATH`, the system paths), or, failing that, in the directories named by
//! `NPU_SERVING_CUDA_LIB_DIR` (colon-separated), `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64` and
//! `/usr/local/cuda/lib64`: a library found there is loaded once by its full path and kept, and
//! cudarc's later load by soname (`libnvrtc.so.12`, ...) then finds the loaded copy.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The libraries the backend loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLib {
    /// The driver API (`libcuda.so.1`, installed with the NVIDIA driver).
    Driver,
    /// The run-time compiler (`libnvrtc.so`).
    Nvrtc,
    /// cuBLAS (`libcublas.so`, with `libcublasLt.so`).
    Cublas,
}

impl CudaLib {
    pub const ALL: [CudaLib; 3] = [CudaLib::Driver, CudaLib::Nvrtc, CudaLib::Cublas];

    /// The library's name stem (`lib{stem}.so`).
    pub fn stem(self) -> &'static str {
        match self {
            CudaLib::Driver => "cuda",
            CudaLib::Nvrtc => "nvrtc",
            CudaLib::Cublas => "cublas",
        }
    }

    /// The file name a user would look for.
    pub fn file_name(self) -> &'static str {
        match self {
            CudaLib::Driver => "libcuda.so",
            CudaLib::Nvrtc => "libnvrtc.so",
            CudaLib::Cublas => "libcublas.so",
        }
    }

    /// What the library is and how to get it.
    pub fn how_to_get(self) -> &'static str {
        match self {
            CudaLib::Driver => {
                "libcuda.so is the NVIDIA driver's CUDA library and comes with the driver: \
                 without it this machine has no usable NVIDIA GPU (use `device: cpu`)"
            }
            CudaLib::Nvrtc => {
                "libnvrtc.so is NVRTC, the CUDA run-time compiler: install the CUDA toolkit 12.x \
                 or `pip install nvidia-cuda-nvrtc-cu12`"
            }
            CudaLib::Cublas => {
                "libcublas.so is cuBLAS: install the CUDA toolkit 12.x or \
                 `pip install nvidia-cublas-cu12`"
            }
        }
    }

    /// True when cudarc's own loader finds the library (by its usual names).
    fn loadable(self) -> bool {
        // SAFETY: these only try to dlopen the library by name (and drop it again); loading a
        // shared library runs its initialisers, which for the CUDA libraries is what any user of
        // them does.
        unsafe {
            match self {
                CudaLib::Driver => cudarc::driver::sys::is_culib_present(),
                CudaLib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
                CudaLib::Cublas => cudarc::cublas::sys::is_culib_present(),
            }
        }
    }
}

/// Libraries loaded by full path, kept loaded for the life of the process.
static PRELOADED: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());

/// The fallback directories searched when the loader does not find a library by name.
pub fn default_search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Ok(v) = std::env::var("NPU_SERVING_CUDA_LIB_DIR") {
        dirs.extend(v.split(':').filter(|s| !s.is_empty()).map(PathBuf::from));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            dirs.push(Path::new(&v).join("lib64"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs
}

/// Loads `lib` (and, for cuBLAS, cuBLASLt first) from the first of `dirs` holding it.
fn preload(lib: CudaLib, dirs: &[PathBuf]) -> bool {
    let stems: &[&str] = match lib {
        CudaLib::Cublas => &["cublasLt", "cublas"],
        _ => &[lib.stem()],
    };
    for dir in dirs {
        let Some(paths) = stems
            .iter()
            .map(|s| find_versioned(dir, s))
            .collect::<Option<Vec<_>>>()
        else {
            continue;
        };
        let mut kept = PRELOADED.lock().unwrap_or_else(|e| e.into_inner());
        let mut ok = true;
        for p in paths {
            // SAFETY: loading a CUDA library found in a CUDA library directory; see `loadable`.
            match unsafe { libloading::Library::new(&p) } {
                Ok(l) => kept.push(l),
                Err(e) => {
                    tracing::debug!("cuda: could not load {}: {e}", p.display());
                    ok = false;
                }
            }
        }
        if ok {
            return true;
        }
    }
    false
}

/// `lib{stem}.so`, or the newest `lib{stem}.so.N...` in `dir`.
fn find_versioned(dir: &Path, stem: &str) -> Option<PathBuf> {
    let plain = format!("lib{stem}.so");
    let exact = dir.join(&plain);
    if exact.is_file() {
        return Some(exact);
    }
    let prefix = format!("{plain}.");
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(&prefix))
        })
        .map(|e| e.path())
        .collect();
    found.sort();
    found.pop()
}

/// Makes every library in `libs` loadable (by name, or from `dirs`), or says which are missing
/// and how to get them.
pub fn require(libs: &[CudaLib], dirs: &[PathBuf]) -> Result<(), String> {
    let missing: Vec<CudaLib> = libs
        .iter()
        .copied()
        .filter(|&l| !(l.loadable() || (preload(l, dirs) && l.loadable())))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = missing.iter().map(|l| l.file_name()).collect();
    let names = match names.as_slice() {
        [one] => one.to_string(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
        [] => unreachable!(),
    };
    let searched = if dirs.is_empty() {
        String::new()
    } else {
        let d: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        format!(", then {}", d.join(", "))
    };
    let why: Vec<&str> = missing.iter().map(|l| l.how_to_get()).collect();
    Err(format!(
        "{names} not found (searched LD_LIBRARY_PATH and the system library paths{searched}). \
         {}. A library outside those paths is found through NPU_SERVING_CUDA_LIB_DIR.",
        why.join(". ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_versioned_names() {
        let dir = std::env::temp_dir().join(format!("npu-cuda-libs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libnvrtc.so.12"), b"").unwrap();
        std::fs::write(dir.join("libnvrtc-builtins.so.12.9"), b"").unwrap();
        assert_eq!(
            find_versioned(&dir, "nvrtc"),
            Some(dir.join("libnvrtc.so.12"))
        );
        assert_eq!(find_versioned(&dir, "cublas"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_library_is_named_with_how_to_get_it() {
        // An empty directory list and a library this test machine may or may not have: when
        // the driver library is absent the message must name it; when present, nothing fails.
        match require(&[CudaLib::Driver], &[]) {
            Ok(()) => assert!(CudaLib::Driver.loadable()),
            Err(msg) => {
                assert!(msg.contains("libcuda.so"), "{msg}");
                assert!(msg.contains("NVIDIA driver"), "{msg}");
            }
        }
    }
}

//! Finding the CUDA libraries at run time, for CUDA 13 and CUDA 12 from one build.
//!
//! - **The driver** (`libcuda.so.1`, installed with the NVIDIA driver) is reached through cudarc's
//!   driver bindings, which resolve each entry point by its versioned symbol name
//!   (`cuMemAlloc_v2`, `cuMemcpyHtoDAsync_v2`, ...): the ABI of CUDA 12.4, which every driver of
//!   CUDA 12.4 or later exports, CUDA 13's (580 and newer) included. It is found by the loader's
//!   usual search, or in the fallback directories below.
//! - **NVRTC** and **cuBLAS** are found by their sonames, CUDA 13's first (`libnvrtc.so.13`, then
//!   `libnvrtc.so.12`; `libcublas.so.13` with `libcublasLt.so.13`, then the `.so.12` pair), never
//!   newer than the driver supports (`max_major`, from `cuDriverGetVersion`): a CUDA 13 library
//!   does not run on a CUDA 12 driver. For each major in turn the loader's own search
//!   (`LD_LIBRARY_PATH`, `ld.so.cache`) is tried, then the directories of [`default_search_dirs`]:
//!   `NPU_SERVING_CUDA_LIB_DIR`, the pip wheels' `lib` directories in every Python
//!   site-packages found (`nvidia/cu13/lib` for CUDA 13's `nvidia-cuda-nvrtc` and
//!   `nvidia-cublas`; `nvidia/cuda_nvrtc/lib` and `nvidia/cublas/lib` for CUDA 12's
//!   `nvidia-cuda-nvrtc-cu12` and `nvidia-cublas-cu12`), and the toolkits' (`$CUDA_HOME`,
//!   `$CUDA_PATH`, `/usr/local/cuda`, `/usr/local/cuda-13.*`, `/usr/local/cuda-12.*`: `lib64` and
//!   `targets/<arch>-linux/lib`).
//! - A library found in a directory is loaded by its full path and kept loaded for the life of
//!   the process, together with what it opens by name later: NVRTC's `libnvrtc-builtins.so.M.m`
//!   from the same directory first (NVRTC dlopens it by name at the first compile, which fails
//!   with `NVRTC_ERROR_BUILTIN_OPERATION_FAILURE` when that directory is not on the loader's
//!   path), cuBLAS's `libcublasLt.so.M` before `libcublas.so.M` (its dependency).
//!
//! NVRTC and cuBLAS are bound here by their C entry points (`nvrtc::NvrtcApi`,
//! `cublas::CublasApi`), the few functions the backend calls, whose signatures are the same in
//! CUDA 12 and 13.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The CUDA majors whose NVRTC and cuBLAS this build loads, newest first.
pub const CUDA_MAJORS: [u32; 2] = [13, 12];

/// The libraries the backend loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLib {
    /// The driver API (`libcuda.so.1`, installed with the NVIDIA driver).
    Driver,
    /// The run-time compiler (`libnvrtc.so.13` or `.so.12`).
    Nvrtc,
    /// cuBLAS (`libcublas.so.13` or `.so.12`, with `libcublasLt`).
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

    /// The soname of this library for CUDA `major` (the driver's is `libcuda.so.1` for all).
    pub fn soname(self, major: u32) -> String {
        match self {
            CudaLib::Driver => "libcuda.so.1".into(),
            _ => format!("lib{}.so.{major}", self.stem()),
        }
    }

    /// The PyPI package that installs it for CUDA `major` (none for the driver).
    pub fn pip_package(self, major: u32) -> Option<&'static str> {
        match (self, major) {
            (CudaLib::Driver, _) => None,
            (CudaLib::Nvrtc, 13) => Some("nvidia-cuda-nvrtc"),
            (CudaLib::Nvrtc, _) => Some("nvidia-cuda-nvrtc-cu12"),
            (CudaLib::Cublas, 13) => Some("nvidia-cublas"),
            (CudaLib::Cublas, _) => Some("nvidia-cublas-cu12"),
        }
    }

    /// Where that package puts it, under a site-packages directory.
    pub fn wheel_dir(self, major: u32) -> Option<&'static str> {
        match (self, major) {
            (CudaLib::Driver, _) => None,
            (_, 13) => Some("nvidia/cu13/lib"),
            (CudaLib::Nvrtc, _) => Some("nvidia/cuda_nvrtc/lib"),
            (CudaLib::Cublas, _) => Some("nvidia/cublas/lib"),
        }
    }

    /// What the library is and how to get it, naming CUDA 13's and CUDA 12's packages.
    pub fn how_to_get(self) -> String {
        match self {
            CudaLib::Driver => "libcuda.so is the NVIDIA driver's CUDA library and comes with the \
                                driver: without it this machine has no usable NVIDIA GPU (use \
                                `device: cpu`)"
                .into(),
            CudaLib::Nvrtc | CudaLib::Cublas => {
                let what = if self == CudaLib::Nvrtc {
                    "NVRTC, the CUDA run-time compiler"
                } else {
                    "cuBLAS"
                };
                format!(
                    "{} ({}) comes with the CUDA toolkit, 13.x or 12.x, or from PyPI: `pip install \
                     {}` (CUDA 13, needs driver 580 or newer) or `pip install {}` (CUDA 12)",
                    self.file_name(),
                    what,
                    self.pip_package(13).unwrap_or_default(),
                    self.pip_package(12).unwrap_or_default(),
                )
            }
        }
    }

    /// True when cudarc's own loader finds the driver library by its usual names.
    fn driver_loadable() -> bool {
        // SAFETY: this only tries to dlopen the library by name (and drops it again); loading a
        // shared library runs its initialisers, which for the driver is what any user does.
        unsafe { cudarc::driver::sys::is_culib_present() }
    }
}

/// Where to look: the loader's own search (by soname), then directories in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Search {
    /// Try `dlopen(soname)` (LD_LIBRARY_PATH, ld.so.cache, the system paths) first.
    pub system: bool,
    pub dirs: Vec<PathBuf>,
}

impl Search {
    /// The loader's search, then `dirs`.
    pub fn with_dirs(dirs: Vec<PathBuf>) -> Self {
        Self { system: true, dirs }
    }

    /// Only `dirs` (tests, and tools that want one install).
    pub fn only(dirs: Vec<PathBuf>) -> Self {
        Self {
            system: false,
            dirs,
        }
    }

    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.system {
            parts.push("the loader's path (LD_LIBRARY_PATH, ld.so.cache)".to_string());
        }
        if !self.dirs.is_empty() {
            let d: Vec<String> = self.dirs.iter().map(|d| d.display().to_string()).collect();
            parts.push(d.join(", "));
        }
        if parts.is_empty() {
            "nowhere".into()
        } else {
            parts.join(", then ")
        }
    }
}

/// Libraries loaded by full path for the driver, kept for the life of the process.
static PRELOADED: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());

/// The site-packages (and dist-packages) directories of the Pythons this machine appears to
/// have: the active virtual environment or conda prefix, `PYTHONPATH`, the user's
/// `~/.local`, pyenv's versions, the prefixes of the `python3` directories on `PATH`, and the
/// system prefixes.
pub fn python_site_dirs() -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    let mut direct: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            prefixes.push(PathBuf::from(v));
        }
    }
    if let Some(v) = std::env::var_os("PYTHONPATH") {
        direct.extend(std::env::split_paths(&v));
    }
    if let Some(v) = std::env::var_os("PATH") {
        for bin in std::env::split_paths(&v) {
            if bin.join("python3").exists() {
                if let Some(p) = bin.parent() {
                    prefixes.push(p.to_path_buf());
                }
            }
        }
    }
    match std::env::var_os("PYTHONUSERBASE") {
        Some(v) => prefixes.push(PathBuf::from(v)),
        None => {
            if let Some(h) = std::env::var_os("HOME") {
                prefixes.push(Path::new(&h).join(".local"));
            }
        }
    }
    if let Some(h) = std::env::var_os("HOME") {
        let versions = Path::new(&h).join(".pyenv/versions");
        prefixes.extend(sorted_entries(&versions, |_| true).into_iter().rev());
    }
    for p in ["/usr/local", "/usr", "/opt/conda"] {
        prefixes.push(PathBuf::from(p));
    }
    let mut out = direct;
    for prefix in prefixes {
        let lib = prefix.join("lib");
        for py in sorted_entries(&lib, |n| n.starts_with("python3"))
            .into_iter()
            .rev()
        {
            for sub in ["site-packages", "dist-packages"] {
                out.push(py.join(sub));
            }
        }
    }
    out.retain(|d| d.is_dir());
    dedup(out)
}

/// The toolkits' library directories: `$CUDA_HOME`, `$CUDA_PATH`, `$CUDA_ROOT`,
/// `/usr/local/cuda`, then `/usr/local/cuda-13.*` and `/usr/local/cuda-12.*` (newest first),
/// each as `lib64` and `targets/<arch>-linux/lib`.
pub fn toolkit_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(v) = std::env::var_os(var) {
            roots.push(PathBuf::from(v));
        }
    }
    roots.push(PathBuf::from("/usr/local/cuda"));
    let mut versioned = sorted_entries(Path::new("/usr/local"), |n| {
        n.starts_with("cuda-13.") || n.starts_with("cuda-12.")
    });
    versioned.sort_by_key(|p| std::cmp::Reverse(version_key(p)));
    roots.extend(versioned);
    let target = match std::env::consts::ARCH {
        "aarch64" => "sbsa-linux",
        a => {
            return dedup(
                roots
                    .into_iter()
                    .flat_map(|r| [r.join("lib64"), r.join(format!("targets/{a}-linux/lib"))])
                    .collect(),
            )
        }
    };
    dedup(
        roots
            .into_iter()
            .flat_map(|r| [r.join("lib64"), r.join(format!("targets/{target}/lib"))])
            .collect(),
    )
}

/// The fallback directories, in the order they are searched: `NPU_SERVING_CUDA_LIB_DIR`
/// (colon-separated), the pip wheels' directories of CUDA 13 and 12 in every site-packages
/// found, then the toolkits' directories. Directories that do not exist are left out, except
/// those named by `NPU_SERVING_CUDA_LIB_DIR` (named in messages as given).
pub fn default_search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(v) = std::env::var_os("NPU_SERVING_CUDA_LIB_DIR") {
        dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
    }
    let mut found = Vec::new();
    for site in python_site_dirs() {
        for lib in [CudaLib::Nvrtc, CudaLib::Cublas] {
            for major in CUDA_MAJORS {
                if let Some(w) = lib.wheel_dir(major) {
                    found.push(site.join(w));
                }
            }
        }
    }
    found.extend(toolkit_dirs());
    found.retain(|d| d.is_dir());
    dirs.extend(found);
    dedup(dirs)
}

fn dedup(v: Vec<PathBuf>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for p in v {
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// The entries of `dir` whose file name passes `keep`, sorted by name.
fn sorted_entries(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(&keep))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// The numbers in a file name's version suffix, for ordering (`cuda-12.10` after `cuda-12.9`).
fn version_key(p: &Path) -> Vec<u64> {
    p.file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("")
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect()
}

/// The newest `lib{stem}.so.{major}.*` in `dir` (e.g. `libnvrtc-builtins.so.13.5`), skipping
/// the wheels' `.alt.` variants.
fn newest_with_prefix(dir: &Path, prefix: &str) -> Option<PathBuf> {
    let mut v = sorted_entries(dir, |n| n.starts_with(prefix) && !n.contains(".alt."));
    v.sort_by_key(|p| version_key(p));
    v.pop()
}

/// `lib{stem}.so`, or the newest `lib{stem}.so.N...` in `dir`.
fn find_versioned(dir: &Path, stem: &str) -> Option<PathBuf> {
    let plain = format!("lib{stem}.so");
    let exact = dir.join(&plain);
    if exact.is_file() {
        return Some(exact);
    }
    newest_with_prefix(dir, &format!("{plain}."))
}

/// NVRTC or cuBLAS, loaded: the libraries in load order (dependencies first, the library
/// itself last), kept loaded while this value lives.
pub struct Loaded {
    pub lib: CudaLib,
    /// The CUDA major of the soname it was found by.
    pub major: u32,
    /// What was opened: a soname (the loader's search) or a full path.
    pub opened: String,
    /// The directory it came from; `None` for the loader's own search.
    pub dir: Option<PathBuf>,
    /// Also loaded, first: the builtins library (NVRTC) or cuBLASLt, by full path.
    pub companions: Vec<PathBuf>,
    pub(crate) handles: Vec<libloading::Library>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("lib", &self.lib)
            .field("major", &self.major)
            .field("opened", &self.opened)
            .field("companions", &self.companions)
            .finish()
    }
}

impl Loaded {
    /// The library itself (the last one loaded).
    pub fn library(&self) -> &libloading::Library {
        self.handles.last().expect("a loaded library")
    }

    /// Where it came from, for messages.
    pub fn origin(&self) -> String {
        match &self.dir {
            Some(d) => format!("{} (from {})", self.opened, d.display()),
            None => format!("{} (the loader's search path)", self.opened),
        }
    }
}

/// What one CUDA install of a library holds in a directory, for a major.
fn present_in(lib: CudaLib, major: u32, dir: &Path) -> bool {
    dir.join(lib.soname(major)).is_file()
}

fn open(path: &Path) -> Result<libloading::Library, String> {
    // SAFETY: loading a CUDA library found where CUDA installs it; its initialisers are what
    // any user of it runs.
    unsafe { libloading::Library::new(path) }.map_err(|e| dl_error(&e))
}

/// A loader error with its causes (libloading's own text is only "dlopen failed").
pub fn dl_error(e: &libloading::Error) -> String {
    let mut s = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        s.push_str(&format!(": {c}"));
        cause = c.source();
    }
    s
}

/// Loads `lib` of CUDA `major` from `dir` with what it needs from there.
fn open_in_dir(lib: CudaLib, major: u32, dir: &Path) -> Result<Loaded, String> {
    let mut handles = Vec::new();
    let mut companions = Vec::new();
    match lib {
        CudaLib::Nvrtc => {
            // Optional: NVRTC of some installs finds it itself (the wheels' $ORIGIN run path);
            // when it is here, loading it first makes the first compile find it either way.
            if let Some(b) = newest_with_prefix(dir, &format!("libnvrtc-builtins.so.{major}.")) {
                handles.push(open(&b)?);
                companions.push(b);
            }
        }
        CudaLib::Cublas => {
            let lt = dir.join(format!("libcublasLt.so.{major}"));
            if !lt.is_file() {
                return Err(format!(
                    "{} is there but its dependency {} is not",
                    lib.soname(major),
                    lt.display()
                ));
            }
            handles.push(open(&lt)?);
            companions.push(lt);
        }
        CudaLib::Driver => {}
    }
    let main = dir.join(lib.soname(major));
    handles.push(open(&main)?);
    Ok(Loaded {
        lib,
        major,
        opened: main.display().to_string(),
        dir: Some(dir.to_path_buf()),
        companions,
        handles,
    })
}

/// Every install of `lib` that `search` can see, newest major first, without loading anything
/// from directories: `(major, directory or None for the loader's search)`. The loader's search
/// is probed with `dlopen` (loading the library when it is there).
pub fn find_all(lib: CudaLib, search: &Search) -> Vec<(u32, Option<PathBuf>)> {
    let mut out = Vec::new();
    for major in CUDA_MAJORS {
        if search.system && open(Path::new(&lib.soname(major))).is_ok() {
            out.push((major, None));
        }
        for d in &search.dirs {
            if present_in(lib, major, d) {
                out.push((major, Some(d.clone())));
            }
        }
    }
    out
}

/// Loads NVRTC or cuBLAS: the newest major this machine's driver can run (`max_major`; `None`:
/// no limit, e.g. NVRTC without a GPU), first by the loader's search, then from each directory.
/// The error names what was searched, what was found but not usable and why, and how to get
/// each major's library.
pub fn load(lib: CudaLib, search: &Search, max_major: Option<u32>) -> Result<Loaded, String> {
    assert!(lib != CudaLib::Driver, "the driver is loaded by cudarc");
    let mut too_new: Vec<(u32, String)> = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    for major in CUDA_MAJORS {
        let usable = max_major.is_none_or(|m| major <= m);
        if search.system && usable {
            match open(Path::new(&lib.soname(major))) {
                Ok(h) => {
                    return Ok(Loaded {
                        lib,
                        major,
                        opened: lib.soname(major),
                        dir: None,
                        companions: Vec::new(),
                        handles: vec![h],
                    })
                }
                Err(e) if !e.contains("No such file") && !e.contains("cannot open shared") => {
                    failed.push(format!("{}: {e}", lib.soname(major)))
                }
                Err(_) => {}
            }
        }
        for d in &search.dirs {
            if !present_in(lib, major, d) {
                continue;
            }
            if !usable {
                too_new.push((major, format!("{} in {}", lib.soname(major), d.display())));
                continue;
            }
            match open_in_dir(lib, major, d) {
                Ok(l) => return Ok(l),
                Err(e) => failed.push(format!("{} in {}: {e}", lib.soname(major), d.display())),
            }
        }
    }
    let names: Vec<String> = CUDA_MAJORS.iter().map(|&m| lib.soname(m)).collect();
    let mut msg = format!(
        "{} not found: looked for {} in {}",
        lib.file_name(),
        names.join(" then "),
        search.describe()
    );
    if let Some(&(newest, _)) = too_new.first() {
        let m = max_major.unwrap_or(0);
        let found: Vec<&str> = too_new.iter().map(|(_, s)| s.as_str()).collect();
        let fix = if CUDA_MAJORS.contains(&m) {
            format!(
                "install the CUDA {m} library (`pip install {}`, or the CUDA {m} toolkit) or a \
                 newer driver",
                lib.pip_package(m).unwrap_or_default()
            )
        } else {
            "this build needs a driver for CUDA 12 or 13 (525 or newer; 580 or newer for CUDA \
             13)"
            .to_string()
        };
        msg.push_str(&format!(
            ". Found {} (CUDA {newest}), but this machine's NVIDIA driver supports CUDA {m} at \
             most: {fix}",
            found.join(", ")
        ));
    }
    if !failed.is_empty() {
        msg.push_str(&format!(
            ". Found but could not load: {}",
            failed.join("; ")
        ));
    }
    Err(msg)
}

/// Makes the driver library loadable by cudarc (by name, or from `dirs`), or says it is missing
/// and how to get it.
pub fn require_driver(dirs: &[PathBuf]) -> Result<(), String> {
    if CudaLib::driver_loadable() {
        return Ok(());
    }
    for dir in dirs {
        let Some(p) = find_versioned(dir, "cuda") else {
            continue;
        };
        match open(&p) {
            Ok(l) => {
                PRELOADED.lock().unwrap_or_else(|e| e.into_inner()).push(l);
                if CudaLib::driver_loadable() {
                    return Ok(());
                }
            }
            Err(e) => tracing::debug!("cuda: could not load {}: {e}", p.display()),
        }
    }
    let searched = if dirs.is_empty() {
        String::new()
    } else {
        let d: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        format!(", then {}", d.join(", "))
    };
    Err(format!(
        "libcuda.so not found (searched LD_LIBRARY_PATH and the system library paths{searched}). \
         {}. A library outside those paths is found through NPU_SERVING_CUDA_LIB_DIR.",
        CudaLib::Driver.how_to_get()
    ))
}

/// The driver's CUDA version as (major, minor), e.g. (13, 0) for driver 580; the driver library
/// must be loadable (`require_driver`).
pub fn driver_version() -> Result<(u32, u32), String> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: one valid out-pointer; cuDriverGetVersion needs no cuInit.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuDriverGetVersion failed: {r:?}"));
    }
    Ok(split_version(v))
}

/// 13000 → (13, 0); 12040 → (12, 4).
pub fn split_version(v: i32) -> (u32, u32) {
    let v = v.max(0) as u32;
    (v / 1000, (v % 1000) / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("npu-cuda-libs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn finds_versioned_names() {
        let dir = tmp("versioned");
        std::fs::write(dir.join("libcuda.so.1"), b"").unwrap();
        std::fs::write(dir.join("libnvrtc-builtins.so.12.9"), b"").unwrap();
        std::fs::write(dir.join("libnvrtc-builtins.so.12.10"), b"").unwrap();
        std::fs::write(dir.join("libnvrtc-builtins.alt.so.12.9"), b"").unwrap();
        assert_eq!(find_versioned(&dir, "cuda"), Some(dir.join("libcuda.so.1")));
        assert_eq!(find_versioned(&dir, "cublas"), None);
        assert_eq!(
            newest_with_prefix(&dir, "libnvrtc-builtins.so.12."),
            Some(dir.join("libnvrtc-builtins.so.12.10"))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn versions_split_as_the_driver_reports_them() {
        assert_eq!(split_version(13000), (13, 0));
        assert_eq!(split_version(12040), (12, 4));
        assert_eq!(split_version(12090), (12, 9));
    }

    #[test]
    fn wheel_and_toolkit_layouts_are_searched() {
        // A site-packages with both majors' wheels, found through VIRTUAL_ENV-style prefixes
        // is covered by tests/cuda_versions.rs; here the names of each layout.
        assert_eq!(CudaLib::Nvrtc.wheel_dir(13), Some("nvidia/cu13/lib"));
        assert_eq!(CudaLib::Cublas.wheel_dir(13), Some("nvidia/cu13/lib"));
        assert_eq!(CudaLib::Nvrtc.wheel_dir(12), Some("nvidia/cuda_nvrtc/lib"));
        assert_eq!(CudaLib::Cublas.wheel_dir(12), Some("nvidia/cublas/lib"));
        assert_eq!(CudaLib::Nvrtc.soname(13), "libnvrtc.so.13");
        assert_eq!(CudaLib::Cublas.soname(12), "libcublas.so.12");
        for lib in [CudaLib::Nvrtc, CudaLib::Cublas] {
            let h = lib.how_to_get();
            for p in [lib.pip_package(13).unwrap(), lib.pip_package(12).unwrap()] {
                assert!(h.contains(&format!("pip install {p}`")), "{h}");
            }
            assert!(h.contains("13.x or 12.x"), "{h}");
        }
    }

    #[test]
    fn a_missing_driver_is_named_with_how_to_get_it() {
        // An empty directory list and a library this test machine may or may not have: when
        // the driver library is absent the message must name it; when present, nothing fails.
        match require_driver(&[]) {
            Ok(()) => assert!(CudaLib::driver_loadable()),
            Err(msg) => {
                assert!(msg.contains("libcuda.so"), "{msg}");
                assert!(msg.contains("NVIDIA driver"), "{msg}");
            }
        }
    }
}

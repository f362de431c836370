//! Run-time compilation of the kernel program with NVRTC (13.x or 12.x, bound here by its C
//! entry points, see `libs`), cached per architecture: in memory for the life of the process,
//! and on disk under `<cache>/cuda-kernels/` (the cache directory of the model store:
//! `$NPU_SERVING_CACHE`, else `~/.cache/npu-serving`), keyed by a hash of the source, the
//! options and the NVRTC version.
//!
//! The device's own architecture is compiled to a CUBIN (`sm_XY`: sm_80, sm_86, sm_89, sm_90,
//! ... loaded without JIT); an architecture newer than this NVRTC knows gets PTX for the newest
//! one it supports, which the driver compiles forward. The program needs no header: f16 and bf16
//! are converted with PTX `cvt` and bit arithmetic (kernels/common.cuh), and the vector types and
//! intrinsics it uses are NVRTC built-ins, so no include path is passed.
//!
//! Options: the architecture, `--std=c++17`, and `--fmad=false`: a product and a sum written
//! apart stay apart (rounded twice), as on the CPU reference and the emulation; the fused
//! multiply-adds the kernels want are written as `fmaf`.
//!
//! Needs only `libnvrtc` (no GPU, no driver): tests compile every kernel for several
//! architectures on machines without a GPU.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use crate::kernels;
use crate::libs::{self, CudaLib, Loaded, Search};

/// What NVRTC produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Machine code for `sm_{major}{minor}`.
    Cubin(u32, u32),
    /// PTX for `compute_{major}{minor}`.
    Ptx(u32, u32),
}

impl Target {
    fn option(self) -> String {
        match self {
            Target::Cubin(a, b) => format!("--gpu-architecture=sm_{a}{b}"),
            Target::Ptx(a, b) => format!("--gpu-architecture=compute_{a}{b}"),
        }
    }
    pub fn tag(self) -> String {
        match self {
            Target::Cubin(a, b) => format!("sm_{a}{b}.cubin"),
            Target::Ptx(a, b) => format!("compute_{a}{b}.ptx"),
        }
    }
}

/// A compiled kernel image: CUBIN bytes, or PTX text with a trailing NUL (as the driver wants).
#[derive(Debug, Clone)]
pub struct Image {
    pub target: Target,
    pub bytes: Arc<Vec<u8>>,
    /// Where it came from when it was not compiled by this call: the memory cache, or this
    /// file of the disk cache.
    pub cached: Option<Cached>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cached {
    Memory,
    Disk(PathBuf),
}

type Program = *mut c_void;
type Status = c_int;

/// NVRTC's entry points, from one loaded `libnvrtc.so.13` or `.so.12`.
pub struct NvrtcApi {
    loaded: Loaded,
    /// (major, minor) as `nvrtcVersion` reports it.
    pub version: (i32, i32),
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    create_program: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    destroy_program: unsafe extern "C" fn(*mut Program) -> Status,
    compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
    get_program_log_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    get_program_log: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    get_ptx_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    get_ptx: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    get_cubin_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    get_cubin: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    get_num_supported_archs: unsafe extern "C" fn(*mut c_int) -> Status,
    get_supported_archs: unsafe extern "C" fn(*mut c_int) -> Status,
}

impl std::fmt::Debug for NvrtcApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NVRTC {}.{} ({})",
            self.version.0,
            self.version.1,
            self.loaded.origin()
        )
    }
}

/// Looks `name` up in `lib` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the symbol's C function type.
unsafe fn sym<F: Copy>(lib: &libloading::Library, name: &str) -> Result<F, String> {
    // SAFETY: the caller names the symbol's type.
    unsafe { lib.get::<F>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("{name}: {}", crate::libs::dl_error(&e)))
}

impl NvrtcApi {
    /// Loads NVRTC as `libs::load` finds it (no newer than `max_major`) and binds its entry
    /// points.
    pub fn load(search: &Search, max_major: Option<u32>) -> Result<Self, String> {
        let loaded = libs::load(CudaLib::Nvrtc, search, max_major)?;
        Self::bind(loaded)
    }

    /// Binds the entry points of a loaded NVRTC.
    pub fn bind(loaded: Loaded) -> Result<Self, String> {
        let l = loaded.library();
        let what = |e: String| format!("{}: {e}", loaded.origin());
        // SAFETY: each type is the entry point's C signature (nvrtc.h, identical in CUDA 12 and
        // 13).
        let api = unsafe {
            let version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status =
                sym(l, "nvrtcVersion").map_err(what)?;
            let (mut a, mut b) = (0, 0);
            let r = version(&mut a, &mut b);
            if r != 0 {
                return Err(format!("{}: nvrtcVersion returned {r}", loaded.origin()));
            }
            Self {
                version: (a, b),
                get_error_string: sym(l, "nvrtcGetErrorString").map_err(what)?,
                create_program: sym(l, "nvrtcCreateProgram").map_err(what)?,
                destroy_program: sym(l, "nvrtcDestroyProgram").map_err(what)?,
                compile_program: sym(l, "nvrtcCompileProgram").map_err(what)?,
                get_program_log_size: sym(l, "nvrtcGetProgramLogSize").map_err(what)?,
                get_program_log: sym(l, "nvrtcGetProgramLog").map_err(what)?,
                get_ptx_size: sym(l, "nvrtcGetPTXSize").map_err(what)?,
                get_ptx: sym(l, "nvrtcGetPTX").map_err(what)?,
                get_cubin_size: sym(l, "nvrtcGetCUBINSize").map_err(what)?,
                get_cubin: sym(l, "nvrtcGetCUBIN").map_err(what)?,
                get_num_supported_archs: sym(l, "nvrtcGetNumSupportedArchs").map_err(what)?,
                get_supported_archs: sym(l, "nvrtcGetSupportedArchs").map_err(what)?,
                loaded,
            }
        };
        if api.version.0 as u32 != api.loaded.major {
            return Err(format!(
                "{} reports NVRTC {}.{}, not CUDA {}",
                api.loaded.origin(),
                api.version.0,
                api.version.1,
                api.loaded.major
            ));
        }
        Ok(api)
    }

    /// Where this NVRTC was loaded from.
    pub fn origin(&self) -> String {
        self.loaded.origin()
    }

    /// The companion libraries loaded with it (the builtins library).
    pub fn companions(&self) -> &[PathBuf] {
        &self.loaded.companions
    }

    fn status(&self, call: &str, r: Status) -> Result<(), String> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static string (or null) for any code.
        let s = unsafe { (self.get_error_string)(r) };
        let name = if s.is_null() {
            format!("error {r}")
        } else {
            // SAFETY: a NUL-terminated static string.
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        };
        Err(format!("{call}: {name}"))
    }

    /// The `sm_XY` architectures this NVRTC compiles for, as XY numbers (e.g. 80, 90).
    pub fn supported_archs(&self) -> Result<Vec<u32>, String> {
        let mut n: c_int = 0;
        // SAFETY: a valid out-pointer.
        self.status("nvrtcGetNumSupportedArchs", unsafe {
            (self.get_num_supported_archs)(&mut n)
        })?;
        let mut archs = vec![0 as c_int; n.max(0) as usize];
        // SAFETY: `archs` holds the number of entries NVRTC said it will write.
        self.status("nvrtcGetSupportedArchs", unsafe {
            (self.get_supported_archs)(archs.as_mut_ptr())
        })?;
        Ok(archs.into_iter().map(|a| a as u32).collect())
    }

    /// The target for a device of compute capability `major.minor`: its own CUBIN when this
    /// NVRTC knows the architecture, else PTX for the newest one below it.
    pub fn target_for(&self, major: u32, minor: u32) -> Result<Target, String> {
        target_among(&self.supported_archs()?, major, minor)
    }

    /// Compiles `source` for `target`; the error carries NVRTC's log.
    pub fn compile_source(&self, source: &str, target: Target) -> Result<Vec<u8>, String> {
        let src = CString::new(source).map_err(|_| "kernel source holds a NUL byte".to_string())?;
        let name = CString::new("npu_kernels.cu").unwrap();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: valid strings and an out-pointer; no headers.
        self.status("nvrtcCreateProgram", unsafe {
            (self.create_program)(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        })?;
        let opts: Vec<CString> = options(target)
            .into_iter()
            .map(|o| CString::new(o).unwrap())
            .collect();
        let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: `prog` is live (destroyed below, after its last use); the options outlive it.
        let compiled = unsafe { (self.compile_program)(prog, ptrs.len() as c_int, ptrs.as_ptr()) };
        let out = match self.status("nvrtcCompileProgram", compiled) {
            Ok(()) => self.fetch_output(prog, target),
            Err(e) => Err(format!(
                "NVRTC {}.{} ({}) could not compile the kernels ({e}):\n{}",
                self.version.0,
                self.version.1,
                self.origin(),
                self.log(prog)
            )),
        };
        // SAFETY: `prog` is not used after this.
        let _ = unsafe { (self.destroy_program)(&mut prog) };
        out
    }

    fn log(&self, prog: Program) -> String {
        let mut n = 0usize;
        // SAFETY: a live program and a valid out-pointer; the buffer holds the size reported.
        unsafe {
            if (self.get_program_log_size)(prog, &mut n) != 0 || n == 0 {
                return String::new();
            }
            let mut buf = vec![0u8; n];
            if (self.get_program_log)(prog, buf.as_mut_ptr() as *mut c_char) != 0 {
                return String::new();
            }
            c_bytes_to_string(&buf)
        }
    }

    fn fetch_output(&self, prog: Program, target: Target) -> Result<Vec<u8>, String> {
        let (size_fn, get_fn, what) = match target {
            Target::Ptx(..) => (self.get_ptx_size, self.get_ptx, "nvrtcGetPTX"),
            Target::Cubin(..) => (self.get_cubin_size, self.get_cubin, "nvrtcGetCUBIN"),
        };
        let mut size = 0usize;
        // SAFETY: `prog` compiled successfully; a valid out-pointer.
        self.status(what, unsafe { size_fn(prog, &mut size) })?;
        let mut bytes = vec![0u8; size];
        // SAFETY: `bytes` holds the size NVRTC reported.
        self.status(what, unsafe {
            get_fn(prog, bytes.as_mut_ptr() as *mut c_char)
        })?;
        if let Target::Ptx(..) = target {
            // PTX text for cuModuleLoadData: exactly one trailing NUL.
            while bytes.last() == Some(&0) {
                bytes.pop();
            }
            bytes.push(0);
        }
        Ok(bytes)
    }
}

fn c_bytes_to_string(v: &[u8]) -> String {
    let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

/// The target for compute capability `major.minor` among `archs` (XY numbers).
pub fn target_among(archs: &[u32], major: u32, minor: u32) -> Result<Target, String> {
    let want = major * 10 + minor;
    if archs.contains(&want) {
        return Ok(Target::Cubin(major, minor));
    }
    match archs.iter().copied().filter(|&a| a < want).max() {
        Some(a) => Ok(Target::Ptx(a / 10, a % 10)),
        None => Err(format!(
            "this NVRTC cannot compile for sm_{want} (it supports {archs:?})"
        )),
    }
}

/// NVRTC's options for the kernel program.
pub fn options(target: Target) -> Vec<String> {
    vec![
        target.option(),
        "--std=c++17".to_string(),
        "--fmad=false".to_string(),
    ]
}

/// The process's NVRTC, loaded once (see `libs::load`); later calls return the same library
/// while it satisfies `max_major`.
static API: Mutex<Option<Arc<NvrtcApi>>> = Mutex::new(None);

/// The process's NVRTC: loaded on first use from `search`, no newer than `max_major`.
pub fn api(search: &Search, max_major: Option<u32>) -> Result<Arc<NvrtcApi>, String> {
    let mut g = API.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(a) = g.as_ref() {
        if max_major.is_none_or(|m| a.version.0 as u32 <= m) {
            return Ok(a.clone());
        }
        return Err(format!(
            "NVRTC {}.{} is already loaded in this process ({}), but the driver supports CUDA {} \
             at most",
            a.version.0,
            a.version.1,
            a.origin(),
            max_major.unwrap_or(0)
        ));
    }
    let a = Arc::new(NvrtcApi::load(search, max_major)?);
    tracing::info!(
        "cuda: NVRTC {}.{} from {}",
        a.version.0,
        a.version.1,
        a.origin()
    );
    *g = Some(a.clone());
    Ok(a)
}

/// The disk cache directory for kernel images, if one can be named.
pub fn default_cache_dir() -> Option<PathBuf> {
    npu_gguf::store::StoreEnv::from_process()
        .cache_dir()
        .ok()
        .map(|d| d.join("cuda-kernels"))
}

static MEMORY: Mutex<Option<HashMap<String, Arc<Vec<u8>>>>> = Mutex::new(None);

/// The cache key of `source` compiled for `target` by NVRTC `version`.
pub fn cache_key(source: &str, target: Target, version: (i32, i32)) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    for o in options(target) {
        h.update(o.as_bytes());
        h.update([0]);
    }
    h.update(format!("nvrtc {}.{}", version.0, version.1).as_bytes());
    let digest = h.finalize();
    let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    format!("{hex}-{}", target.tag())
}

/// The kernel program compiled for `target`: from memory, else from `disk_dir`, else compiled
/// by `api` (and written to `disk_dir`, best effort).
pub fn kernel_image(
    api: &NvrtcApi,
    target: Target,
    disk_dir: Option<&Path>,
) -> Result<Image, String> {
    let source = kernels::program_source();
    image_with(
        &cache_key(&source, target, api.version),
        target,
        disk_dir,
        || api.compile_source(&source, target),
    )
}

/// `kernel_image` with the compiler given (tests use a stand-in).
pub fn image_with(
    key: &str,
    target: Target,
    disk_dir: Option<&Path>,
    compile: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<Image, String> {
    let mut mem = MEMORY.lock().unwrap_or_else(|e| e.into_inner());
    let map = mem.get_or_insert_with(HashMap::new);
    if let Some(bytes) = map.get(key) {
        return Ok(Image {
            target,
            bytes: bytes.clone(),
            cached: Some(Cached::Memory),
        });
    }
    let path = disk_dir.map(|d| d.join(key));
    let on_disk = path
        .as_ref()
        .and_then(|p| std::fs::read(p).ok().map(|b| (p.clone(), b)));
    let (bytes, cached) = match on_disk {
        Some((p, b)) if !b.is_empty() => (b, Some(Cached::Disk(p))),
        _ => {
            let started = std::time::Instant::now();
            let b = compile()?;
            tracing::info!(
                "cuda: compiled the kernels for {} in {:.1} s",
                target.tag(),
                started.elapsed().as_secs_f64()
            );
            if let (Some(p), Some(d)) = (&path, disk_dir) {
                let tmp = d.join(format!("{key}.{}.tmp", std::process::id()));
                let written = std::fs::create_dir_all(d)
                    .and_then(|_| std::fs::write(&tmp, &b))
                    .and_then(|_| std::fs::rename(&tmp, p));
                if let Err(e) = written {
                    tracing::debug!("cuda: kernel cache not written to {}: {e}", d.display());
                }
            }
            (b, None)
        }
    };
    let bytes = Arc::new(bytes);
    map.insert(key.to_string(), bytes.clone());
    Ok(Image {
        target,
        bytes,
        cached,
    })
}

/// Forgets a cached image that the driver refused: from memory and, when it came from there,
/// from the disk cache, so that the next `kernel_image` compiles afresh.
pub fn forget(key: &str, disk_dir: Option<&Path>) {
    let mut mem = MEMORY.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(map) = mem.as_mut() {
        map.remove(key);
    }
    if let Some(d) = disk_dir {
        let p = d.join(key);
        if p.exists() {
            match std::fs::remove_file(&p) {
                Ok(()) => tracing::warn!("cuda: removed the refused kernel image {}", p.display()),
                Err(e) => tracing::warn!("cuda: could not remove {}: {e}", p.display()),
            }
        }
    }
}

/// Loads a kernel image with `load`; when the image came from a cache and `load` refuses it,
/// forgets it and compiles once more (a cache written by another toolchain or a damaged file
/// must not stop the device from opening).
pub fn load_with_retry<M>(
    key: &str,
    target: Target,
    disk_dir: Option<&Path>,
    compile: &dyn Fn() -> Result<Vec<u8>, String>,
    load: &dyn Fn(&Image) -> Result<M, String>,
) -> Result<M, String> {
    let image = image_with(key, target, disk_dir, compile)?;
    match load(&image) {
        Ok(m) => Ok(m),
        Err(e) if image.cached.is_some() => {
            tracing::warn!(
                "cuda: the cached kernel image for {} was refused ({e}); compiling again",
                target.tag()
            );
            forget(key, disk_dir);
            let fresh = image_with(key, target, disk_dir, compile)?;
            load(&fresh)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_the_device_s_own_cubin_or_ptx_below() {
        let archs = [75, 80, 86, 87, 89, 90];
        assert_eq!(target_among(&archs, 8, 0).unwrap(), Target::Cubin(8, 0));
        assert_eq!(target_among(&archs, 8, 6).unwrap(), Target::Cubin(8, 6));
        assert_eq!(target_among(&archs, 8, 9).unwrap(), Target::Cubin(8, 9));
        assert_eq!(target_among(&archs, 9, 0).unwrap(), Target::Cubin(9, 0));
        assert_eq!(target_among(&archs, 12, 0).unwrap(), Target::Ptx(9, 0));
        assert!(target_among(&archs, 7, 0).is_err());
    }

    #[test]
    fn products_and_sums_are_not_contracted() {
        // Review finding 7: NVRTC contracts a*b + c into one FMA by default, which neither the
        // CPU reference nor the emulation (-ffp-contract=off) does.
        assert!(options(Target::Cubin(9, 0)).contains(&"--fmad=false".to_string()));
    }

    #[test]
    fn a_refused_cached_image_is_compiled_again_once() {
        let dir = std::env::temp_dir().join(format!("npu-cuda-kcache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let key = format!("test-refused-{}", std::process::id());
        let target = Target::Cubin(9, 0);
        // A stale image on disk (another toolchain's, or damaged).
        std::fs::write(dir.join(&key), b"stale").unwrap();
        let compiles = std::cell::Cell::new(0);
        let compile = || {
            compiles.set(compiles.get() + 1);
            Ok(b"fresh".to_vec())
        };
        let load = |img: &Image| {
            if img.bytes.as_slice() == b"fresh" {
                Ok(img.cached.clone())
            } else {
                Err("CUDA_ERROR_INVALID_IMAGE".to_string())
            }
        };
        let got = load_with_retry(&key, target, Some(&dir), &compile, &load).unwrap();
        assert_eq!(got, None, "the image that loaded was compiled afresh");
        assert_eq!(compiles.get(), 1);
        assert_eq!(std::fs::read(dir.join(&key)).unwrap(), b"fresh");
        // Next time it comes from memory, without compiling.
        let got = load_with_retry(&key, target, Some(&dir), &compile, &load).unwrap();
        assert_eq!(got, Some(Cached::Memory));
        assert_eq!(compiles.get(), 1);
        // A fresh image that fails is an error, not a loop.
        let key2 = format!("{key}-2");
        let bad = |_: &Image| -> Result<(), String> { Err("refused".into()) };
        assert!(load_with_retry(&key2, target, Some(&dir), &compile, &bad).is_err());
        assert_eq!(compiles.get(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

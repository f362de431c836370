//! Run-time compilation of the kernel program with NVRTC, cached per architecture: in memory for
//! the life of the process, and on disk under `<cache>/cuda-kernels/` (the cache directory of the
//! model store: `$NPU_SERVING_CACHE`, else `~/.cache/npu-serving`), keyed by a hash of the
//! source, the options and the NVRTC version.
//!
//! The device's own architecture is compiled to a CUBIN (`sm_XY`, loaded without JIT); an
//! architecture newer than this NVRTC knows gets PTX for the newest one it supports, which the
//! driver compiles forward.
//!
//! Needs only `libnvrtc` (no GPU, no driver): tests compile every kernel for several
//! architectures on machines without a GPU.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cudarc::nvrtc::{result, sys};
use sha2::{Digest, Sha256};

use crate::kernels;

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
    fn tag(self) -> String {
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
}

/// The NVRTC version (major, minor).
pub fn version() -> Result<(i32, i32), String> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// The `sm_XY` architectures this NVRTC compiles for, as XY numbers (e.g. 80, 90).
pub fn supported_archs() -> Result<Vec<u32>, String> {
    let mut n: c_int = 0;
    // SAFETY: a valid out-pointer.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(|e| format!("nvrtcGetNumSupportedArchs: {e:?}"))?;
    let mut archs = vec![0 as c_int; n.max(0) as usize];
    // SAFETY: `archs` holds the number of entries NVRTC said it will write.
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .map_err(|e| format!("nvrtcGetSupportedArchs: {e:?}"))?;
    Ok(archs.into_iter().map(|a| a as u32).collect())
}

/// The target for a device of compute capability `major.minor`.
pub fn target_for(major: u32, minor: u32) -> Result<Target, String> {
    let want = major * 10 + minor;
    let archs = supported_archs()?;
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

fn options(target: Target) -> Vec<String> {
    vec![target.option(), "--std=c++17".to_string()]
}

/// Compiles `source` for `target`; the error carries NVRTC's log.
pub fn compile_source(source: &str, target: Target) -> Result<Vec<u8>, String> {
    let src = CString::new(source).map_err(|_| "kernel source holds a NUL byte".to_string())?;
    let name = CString::new("npu_kernels.cu").unwrap();
    let prog = result::create_program(&src, Some(&name))
        .map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
    // SAFETY: `prog` is a live program (destroyed below, after its last use); the options are
    // plain strings.
    let compiled = unsafe { result::compile_program(prog, &options(target)) };
    let out = match compiled {
        Ok(()) => fetch_output(prog, target),
        Err(e) => {
            // SAFETY: as above.
            let log = unsafe { result::get_program_log(prog) }
                .map(|l| c_chars_to_string(&l))
                .unwrap_or_default();
            Err(format!(
                "NVRTC could not compile the kernels ({e:?}):\n{log}"
            ))
        }
    };
    // SAFETY: `prog` is not used after this.
    unsafe { result::destroy_program(prog) }.map_err(|e| format!("nvrtcDestroyProgram: {e:?}"))?;
    out
}

fn fetch_output(prog: sys::nvrtcProgram, target: Target) -> Result<Vec<u8>, String> {
    match target {
        Target::Ptx(..) => {
            // SAFETY: `prog` compiled successfully.
            let ptx =
                unsafe { result::get_ptx(prog) }.map_err(|e| format!("nvrtcGetPTX: {e:?}"))?;
            let mut bytes: Vec<u8> = ptx.iter().map(|&c| c as u8).collect();
            if bytes.last() != Some(&0) {
                bytes.push(0);
            }
            Ok(bytes)
        }
        Target::Cubin(..) => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled successfully; a valid out-pointer.
            unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut bytes = vec![0u8; size];
            // SAFETY: `bytes` holds the size NVRTC reported.
            unsafe { sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr() as *mut c_char) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
            Ok(bytes)
        }
    }
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The disk cache directory for kernel images, if one can be named.
pub fn default_cache_dir() -> Option<PathBuf> {
    npu_gguf::store::StoreEnv::from_process()
        .cache_dir()
        .ok()
        .map(|d| d.join("cuda-kernels"))
}

static MEMORY: Mutex<Option<HashMap<String, Arc<Vec<u8>>>>> = Mutex::new(None);

fn cache_key(source: &str, target: Target) -> Result<String, String> {
    let (major, minor) = version()?;
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    for o in options(target) {
        h.update(o.as_bytes());
        h.update([0]);
    }
    h.update(format!("nvrtc {major}.{minor}").as_bytes());
    let digest = h.finalize();
    let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{hex}-{}", target.tag()))
}

/// The kernel program compiled for `target`: from memory, else from `disk_dir`, else compiled
/// (and written to `disk_dir`, best effort).
pub fn kernel_image(target: Target, disk_dir: Option<&Path>) -> Result<Image, String> {
    let source = kernels::program_source();
    let key = cache_key(&source, target)?;
    let mut mem = MEMORY.lock().unwrap_or_else(|e| e.into_inner());
    let map = mem.get_or_insert_with(HashMap::new);
    if let Some(bytes) = map.get(&key) {
        return Ok(Image {
            target,
            bytes: bytes.clone(),
        });
    }
    let path = disk_dir.map(|d| d.join(&key));
    let cached = path.as_ref().and_then(|p| std::fs::read(p).ok());
    let bytes = match cached {
        Some(b) if !b.is_empty() => b,
        _ => {
            let started = std::time::Instant::now();
            let b = compile_source(&source, target)?;
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
            b
        }
    };
    let bytes = Arc::new(bytes);
    map.insert(key, bytes.clone());
    Ok(Image { target, bytes })
}

//! cuBLAS (13.x or 12.x) bound by the few C entry points the backend calls: handle creation and
//! destruction, binding a stream, `cublasGemmEx`, and the version. Their signatures and the enum
//! values used (operations, `cudaDataType`, `cublasComputeType_t`, the default algorithm) are
//! the same in CUDA 12 and 13.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Mutex};

use crate::libs::{self, CudaLib, Loaded, Search};

pub type Handle = *mut c_void;
type Status = c_int;

/// `cublasOperation_t`.
pub const OP_N: c_int = 0;
pub const OP_T: c_int = 1;
/// `cudaDataType` values.
pub const R_32F: c_int = 0;
pub const R_16F: c_int = 2;
pub const R_16BF: c_int = 14;
/// `CUBLAS_COMPUTE_32F`.
pub const COMPUTE_32F: c_int = 68;
/// `CUBLAS_GEMM_DEFAULT`.
pub const GEMM_DEFAULT: c_int = -1;

type GemmEx = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    *mut c_void,
    c_int,
    c_int,
    c_int,
    c_int,
) -> Status;

/// cuBLAS's entry points, from one loaded `libcublas.so.13` or `.so.12`.
pub struct CublasApi {
    loaded: Loaded,
    /// (major, minor, patch) from `cublasGetProperty`.
    pub version: (i32, i32, i32),
    create: unsafe extern "C" fn(*mut Handle) -> Status,
    destroy: unsafe extern "C" fn(Handle) -> Status,
    set_stream: unsafe extern "C" fn(Handle, *mut c_void) -> Status,
    gemm_ex: GemmEx,
    /// `cublasSetWorkspace_v2` (cuBLAS 11.2+): the handle's workspace, which GEMMs inside a
    /// stream capture need (the default one is allocated from a pool capture cannot record).
    set_workspace: Option<unsafe extern "C" fn(Handle, *mut c_void, usize) -> Status>,
    status_string: Option<unsafe extern "C" fn(Status) -> *const c_char>,
}

impl std::fmt::Debug for CublasApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cuBLAS {}.{}.{} ({})",
            self.version.0,
            self.version.1,
            self.version.2,
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

impl CublasApi {
    /// Loads cuBLAS as `libs::load` finds it (no newer than `max_major`) and binds it.
    pub fn load(search: &Search, max_major: Option<u32>) -> Result<Self, String> {
        Self::bind(libs::load(CudaLib::Cublas, search, max_major)?)
    }

    pub fn bind(loaded: Loaded) -> Result<Self, String> {
        let l = loaded.library();
        let what = |e: String| format!("{}: {e}", loaded.origin());
        // SAFETY: each type is the entry point's C signature (cublas_api.h, identical in CUDA 12
        // and 13).
        unsafe {
            let prop: unsafe extern "C" fn(c_int, *mut c_int) -> Status =
                sym(l, "cublasGetProperty").map_err(what)?;
            let mut v = [0 as c_int; 3];
            for (i, x) in v.iter_mut().enumerate() {
                if prop(i as c_int, x) != 0 {
                    return Err(format!("{}: cublasGetProperty failed", loaded.origin()));
                }
            }
            Ok(Self {
                version: (v[0], v[1], v[2]),
                create: sym(l, "cublasCreate_v2").map_err(what)?,
                destroy: sym(l, "cublasDestroy_v2").map_err(what)?,
                set_stream: sym(l, "cublasSetStream_v2").map_err(what)?,
                gemm_ex: sym(l, "cublasGemmEx").map_err(what)?,
                set_workspace: sym(l, "cublasSetWorkspace_v2").ok(),
                status_string: sym(l, "cublasGetStatusString").ok(),
                loaded,
            })
        }
    }

    pub fn origin(&self) -> String {
        self.loaded.origin()
    }

    fn status(&self, call: &str, r: Status) -> Result<(), String> {
        if r == 0 {
            return Ok(());
        }
        let name = self
            .status_string
            // SAFETY: a static string (or null) for any code.
            .map(|f| unsafe { f(r) })
            .filter(|p| !p.is_null())
            // SAFETY: NUL-terminated.
            .map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .unwrap_or_else(|| format!("status {r}"));
        Err(format!("{call}: {name}"))
    }

    /// A handle on the current context.
    pub fn create(&self) -> Result<Handle, String> {
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        self.status("cublasCreate", unsafe { (self.create)(&mut h) })?;
        Ok(h)
    }

    /// # Safety
    /// `h` came from `create` and is not used again.
    pub unsafe fn destroy(&self, h: Handle) -> Result<(), String> {
        // SAFETY: the caller's.
        self.status("cublasDestroy", unsafe { (self.destroy)(h) })
    }

    /// # Safety
    /// `h` is a live handle and `stream` a live stream of its context.
    pub unsafe fn set_stream(&self, h: Handle, stream: *mut c_void) -> Result<(), String> {
        // SAFETY: the caller's.
        self.status("cublasSetStream", unsafe { (self.set_stream)(h, stream) })
    }

    /// Whether `set_workspace` is there.
    pub fn has_set_workspace(&self) -> bool {
        self.set_workspace.is_some()
    }

    /// Gives the handle `bytes` of device memory at `ws` as its workspace (`cublasSetWorkspace`).
    ///
    /// # Safety
    /// `h` is a live handle; `ws` is device memory of at least `bytes` of its context that stays
    /// allocated while the handle (or a graph recorded with it) uses it.
    pub unsafe fn set_workspace(
        &self,
        h: Handle,
        ws: *mut c_void,
        bytes: usize,
    ) -> Result<(), String> {
        let f = self
            .set_workspace
            .ok_or_else(|| "cublasSetWorkspace_v2: not in this cuBLAS".to_string())?;
        // SAFETY: the caller's.
        self.status("cublasSetWorkspace", unsafe { f(h, ws, bytes) })
    }

    /// `cublasGemmEx` with f32 compute and the default algorithm.
    ///
    /// # Safety
    /// The handle is live; A, B and C are device ranges of the sizes the arguments imply;
    /// alpha and beta point to f32 values (the default host pointer mode).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_ex(
        &self,
        h: Handle,
        (transa, transb): (c_int, c_int),
        (m, n, k): (c_int, c_int, c_int),
        alpha: *const c_void,
        (a, a_type, lda): (*const c_void, c_int, c_int),
        (b, b_type, ldb): (*const c_void, c_int, c_int),
        beta: *const c_void,
        (c, c_type, ldc): (*mut c_void, c_int, c_int),
    ) -> Result<(), String> {
        // SAFETY: the caller's.
        let r = unsafe {
            (self.gemm_ex)(
                h,
                transa,
                transb,
                m,
                n,
                k,
                alpha,
                a,
                a_type,
                lda,
                b,
                b_type,
                ldb,
                beta,
                c,
                c_type,
                ldc,
                COMPUTE_32F,
                GEMM_DEFAULT,
            )
        };
        self.status("cublasGemmEx", r)
    }
}

static API: Mutex<Option<Arc<CublasApi>>> = Mutex::new(None);

/// The process's cuBLAS: loaded on first use from `search`, no newer than `max_major`.
pub fn api(search: &Search, max_major: Option<u32>) -> Result<Arc<CublasApi>, String> {
    let mut g = API.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(a) = g.as_ref() {
        if max_major.is_none_or(|m| a.version.0 as u32 <= m) {
            return Ok(a.clone());
        }
        return Err(format!(
            "cuBLAS {}.{} is already loaded in this process ({}), but the driver supports CUDA {} \
             at most",
            a.version.0,
            a.version.1,
            a.origin(),
            max_major.unwrap_or(0)
        ));
    }
    let a = Arc::new(CublasApi::load(search, max_major)?);
    tracing::info!(
        "cuda: cuBLAS {}.{}.{} from {}",
        a.version.0,
        a.version.1,
        a.version.2,
        a.origin()
    );
    *g = Some(a.clone());
    Ok(a)
}

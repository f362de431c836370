//! Tensor parallelism's collectives on NCCL (`npu_backend::Collective` for [`CudaBackend`]):
//! `ncclAllReduce` (`ncclSum`) in place and `ncclAllGather` on the backend's device buffers,
//! queued on the backend's own stream (no host synchronization added); `gather_to_host` is an
//! all-gather into a device scratch buffer that rank 0 reads back; `gather_host_to_root` goes
//! through the group's host collective (the values are on the host already).
//!
//! `libnccl.so.2` is loaded at run time (the loader's search, then the directories the other
//! CUDA libraries are looked for in, where pip's `nvidia-nccl-cu12`/`-cu13` put it under
//! `nvidia/nccl/lib`), from its documented C API (`nccl.h`: `ncclGetUniqueId`,
//! `ncclCommInitRank`, `ncclAllReduce`, `ncclAllGather`, `ncclCommDestroy`, `ncclCommAbort`,
//! `ncclGetErrorString`). Rank 0's 128-byte `ncclUniqueId` reaches the others through the
//! group's host collective (the agent's shared-memory region).
//!
//! **This has never run**: no GPU machine has run it and the CPU emulation of the kernels has
//! no NCCL (it is selected only on a real GPU when the library loads). It compiles in CI.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use npu_backend::{
    Backend, BackendError, Collective, DType, DeviceBuffer, HostCollective, HostSliceMut, Layout,
    Readback, View, ViewMut,
};

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;

pub type ncclResult_t = c_int;
pub type ncclDataType_t = c_int;
pub type ncclRedOp_t = c_int;
pub type ncclComm_t = *mut c_void;
pub type cudaStream_t = *mut c_void;

pub const NCCL_SUCCESS: ncclResult_t = 0;
pub const NCCL_INT32: ncclDataType_t = 2;
pub const NCCL_FLOAT16: ncclDataType_t = 6;
pub const NCCL_FLOAT32: ncclDataType_t = 7;
pub const NCCL_BFLOAT16: ncclDataType_t = 9;
pub const NCCL_SUM: ncclRedOp_t = 0;

/// `#define NCCL_UNIQUE_ID_BYTES 128`
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// `typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;`
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

const _: () = assert!(std::mem::size_of::<ncclUniqueId>() == NCCL_UNIQUE_ID_BYTES);

/// The NCCL entry points this backend calls.
#[allow(non_snake_case)]
pub struct NcclApi {
    pub ncclGetUniqueId: unsafe extern "C" fn(*mut ncclUniqueId) -> ncclResult_t,
    pub ncclCommInitRank:
        unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> ncclResult_t,
    pub ncclAllReduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub ncclAllGather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub ncclCommDestroy: unsafe extern "C" fn(ncclComm_t) -> ncclResult_t,
    pub ncclCommAbort: Option<unsafe extern "C" fn(ncclComm_t) -> ncclResult_t>,
    pub ncclGetErrorString: unsafe extern "C" fn(ncclResult_t) -> *const c_char,
}

/// `libnccl.so.2`, loaded and resolved; kept loaded for the life of the process.
pub struct Nccl {
    pub api: NcclApi,
    pub origin: String,
    _lib: libloading::Library,
}

const SONAME: &str = "libnccl.so.2";

fn candidates() -> Vec<PathBuf> {
    let mut c = vec![PathBuf::from(SONAME)];
    for d in crate::libs::default_search_dirs() {
        c.push(d.join(SONAME));
    }
    for site in crate::libs::python_site_dirs() {
        c.push(site.join("nvidia/nccl/lib").join(SONAME));
    }
    c
}

fn load() -> Result<Nccl, String> {
    let mut tried = Vec::new();
    for path in candidates() {
        if path.components().count() > 1 && !path.is_file() {
            continue;
        }
        // SAFETY: loading NCCL (by soname or from where CUDA's libraries are installed); its
        // initialisers are what any NCCL user runs.
        let lib = match unsafe { libloading::Library::new(&path) } {
            Ok(l) => l,
            Err(e) => {
                tried.push(format!("{}: {}", path.display(), crate::libs::dl_error(&e)));
                continue;
            }
        };
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is its prototype in nccl.h (the field's type).
                match unsafe { lib.get($name) } {
                    Ok(s) => *s,
                    Err(e) => {
                        return Err(format!(
                            "{}: {}: {}",
                            path.display(),
                            String::from_utf8_lossy($name),
                            crate::libs::dl_error(&e)
                        ))
                    }
                }
            };
        }
        let api = NcclApi {
            ncclGetUniqueId: sym!(b"ncclGetUniqueId\0"),
            ncclCommInitRank: sym!(b"ncclCommInitRank\0"),
            ncclAllReduce: sym!(b"ncclAllReduce\0"),
            ncclAllGather: sym!(b"ncclAllGather\0"),
            ncclCommDestroy: sym!(b"ncclCommDestroy\0"),
            // SAFETY: as above (ncclCommAbort, NCCL 2.4 and later).
            ncclCommAbort: unsafe { lib.get(b"ncclCommAbort\0") }.ok().map(|s| *s),
            ncclGetErrorString: sym!(b"ncclGetErrorString\0"),
        };
        return Ok(Nccl {
            api,
            origin: path.display().to_string(),
            _lib: lib,
        });
    }
    Err(format!(
        "{SONAME} not found (NCCL: `pip install nvidia-nccl-cu12` or the CUDA toolkit's NCCL); tried {}",
        if tried.is_empty() {
            "the loader's search path".to_string()
        } else {
            tried.join("; ")
        }
    ))
}

static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();

/// NCCL, loaded once per process (or why it could not be).
pub fn library() -> Result<&'static Nccl, String> {
    NCCL.get_or_init(load).as_ref().map_err(|e| e.clone())
}

fn failed(lib: &Nccl, call: &str, code: ncclResult_t) -> BackendError {
    // SAFETY: takes a result code, returns a static NUL-terminated string (or null).
    let p = unsafe { (lib.api.ncclGetErrorString)(code) };
    let text = if p.is_null() {
        String::new()
    } else {
        // SAFETY: non-null and NUL-terminated, owned by the library.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    };
    BackendError::Device {
        backend: crate::backend::NAME,
        message: format!("{call} failed with {code}: {text}"),
    }
}

/// The backend's stream, with its context current on this thread; the CPU emulation of the
/// kernels has none (no NCCL there).
fn stream(b: &CudaBackend) -> Result<cudaStream_t, BackendError> {
    b.gpu.raw_stream()?.ok_or_else(|| BackendError::Device {
        backend: crate::backend::NAME,
        message: "the CPU emulation of the CUDA kernels has no NCCL".into(),
    })
}

/// Rank 0's unique id (`ncclGetUniqueId`), to be handed to every rank.
pub fn unique_id(b: &mut CudaBackend) -> Result<[u8; NCCL_UNIQUE_ID_BYTES], BackendError> {
    let lib = library().map_err(|message| BackendError::MissingLibrary {
        backend: crate::backend::NAME,
        message,
    })?;
    stream(b)?;
    let mut id = ncclUniqueId {
        internal: [0; NCCL_UNIQUE_ID_BYTES],
    };
    // SAFETY: a valid out-pointer of the documented struct.
    let rc = unsafe { (lib.api.ncclGetUniqueId)(&mut id) };
    if rc != NCCL_SUCCESS {
        return Err(failed(lib, "ncclGetUniqueId", rc));
    }
    Ok(id.internal.map(|c| c as u8))
}

fn nccl_dtype(d: DType) -> ncclDataType_t {
    match d {
        DType::F32 => NCCL_FLOAT32,
        DType::F16 => NCCL_FLOAT16,
        DType::BF16 => NCCL_BFLOAT16,
        DType::I32 => NCCL_INT32,
    }
}

struct Comm {
    lib: &'static Nccl,
    raw: ncclComm_t,
}

impl Comm {
    fn destroy(&mut self, abort: bool) {
        if self.raw.is_null() {
            return;
        }
        let f = match (abort, self.lib.api.ncclCommAbort) {
            (true, Some(a)) => a,
            _ => self.lib.api.ncclCommDestroy,
        };
        // SAFETY: a live communicator, destroyed once (nulled below).
        let rc = unsafe { f(self.raw) };
        if rc != NCCL_SUCCESS {
            tracing::warn!("{}", failed(self.lib, "ncclCommDestroy", rc));
        }
        self.raw = std::ptr::null_mut();
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.destroy(false);
    }
}

/// One rank's NCCL communicator, with the group's host collective for host values.
pub struct NcclCollective<H: HostCollective> {
    comm: Comm,
    host: H,
    gathered: Option<CudaBuffer>,
}

// SAFETY: the communicator is used by one thread at a time (the model that owns it); NCCL
// communicators are not tied to a host thread.
unsafe impl<H: HostCollective> Send for NcclCollective<H> {}

fn contiguous(op: &'static str, l: Layout) -> Result<(), BackendError> {
    if l.is_contiguous() {
        Ok(())
    } else {
        Err(BackendError::BadArgument {
            op,
            message: format!("NCCL takes contiguous rows, not {l:?}"),
        })
    }
}

impl<H: HostCollective> NcclCollective<H> {
    /// `ncclCommInitRank` as rank `host.rank()` of `host.size()` from rank 0's unique id; a
    /// failure hands `host` back.
    pub fn join(
        b: &mut CudaBackend,
        id: &[u8; NCCL_UNIQUE_ID_BYTES],
        host: H,
    ) -> Result<Self, (BackendError, H)> {
        let lib = match library() {
            Ok(l) => l,
            Err(message) => {
                let e = BackendError::MissingLibrary {
                    backend: crate::backend::NAME,
                    message,
                };
                return Err((e, host));
            }
        };
        if let Err(e) = stream(b) {
            return Err((e, host));
        }
        let uid = ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the id by value as documented; the device's context is
        // current on this thread (`stream` bound it).
        let rc = unsafe {
            (lib.api.ncclCommInitRank)(&mut raw, host.size() as c_int, uid, host.rank() as c_int)
        };
        if rc != NCCL_SUCCESS {
            return Err((failed(lib, "ncclCommInitRank", rc), host));
        }
        Ok(Self {
            comm: Comm { lib, raw },
            host,
            gathered: None,
        })
    }

    pub fn host_mut(&mut self) -> &mut H {
        &mut self.host
    }

    /// Destroys the communicator and hands the host collective back.
    pub fn into_host(self) -> H {
        let Self { host, comm, .. } = self;
        drop(comm);
        host
    }

    fn live(&self) -> Result<(), BackendError> {
        if self.comm.raw.is_null() {
            return Err(npu_backend::collective::collective_error(
                "the NCCL communicator was aborted",
            ));
        }
        Ok(())
    }

    fn gather_raw(
        &mut self,
        b: &mut CudaBackend,
        x: View<'_, CudaBuffer>,
        out: &CudaBuffer,
        out_offset: usize,
    ) -> Result<(), BackendError> {
        self.live()?;
        let l = x.layout();
        contiguous("all_gather", l)?;
        b.own(x.buf(), "all_gather")?;
        b.own(out, "all_gather")?;
        b.device_wrote();
        let s = stream(b)?;
        // SAFETY: both ranges lie in live device buffers of this backend of the sizes the call
        // implies (checked by the callers); the stream and communicator are live.
        let rc = unsafe {
            (self.comm.lib.api.ncclAllGather)(
                x.buf().addr(l.offset()) as *const c_void,
                out.addr(out_offset) as *mut c_void,
                l.elements(),
                nccl_dtype(x.dtype()),
                self.comm.raw,
                s,
            )
        };
        if rc != NCCL_SUCCESS {
            return Err(failed(self.comm.lib, "ncclAllGather", rc));
        }
        Ok(())
    }
}

impl<H: HostCollective> Collective<CudaBackend> for NcclCollective<H> {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn size(&self) -> usize {
        self.host.size()
    }

    fn describe(&self) -> String {
        format!(
            "NCCL ({}), rank {} of {}, on the device's stream; host values through {}",
            self.comm.lib.origin,
            self.host.rank(),
            self.host.size(),
            self.host.describe()
        )
    }

    fn all_reduce_sum(
        &mut self,
        b: &mut CudaBackend,
        x: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.live()?;
        let l = x.layout();
        contiguous("all_reduce_sum", l)?;
        b.own(x.buf(), "all_reduce_sum")?;
        b.device_wrote();
        let s = stream(b)?;
        let p = x.buf().addr(l.offset());
        // SAFETY: `p` holds the view's elements in a live buffer of this backend; in place is
        // allowed; the stream and communicator are live.
        let rc = unsafe {
            (self.comm.lib.api.ncclAllReduce)(
                p as *const c_void,
                p as *mut c_void,
                l.elements(),
                nccl_dtype(x.dtype()),
                NCCL_SUM,
                self.comm.raw,
                s,
            )
        };
        if rc != NCCL_SUCCESS {
            return Err(failed(self.comm.lib, "ncclAllReduce", rc));
        }
        Ok(())
    }

    fn all_gather(
        &mut self,
        b: &mut CudaBackend,
        x: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        let ol = out.layout();
        if ol.elements() != x.layout().elements() * self.host.size()
            || ol.cols() != x.layout().cols()
            || !ol.is_contiguous()
            || out.dtype() != x.dtype()
        {
            return Err(BackendError::BadArgument {
                op: "all_gather",
                message: format!(
                    "{} ranks x {:?} do not fill {ol:?} contiguously",
                    self.host.size(),
                    x.layout()
                ),
            });
        }
        self.gather_raw(b, x, out.buf(), ol.offset())
    }

    fn gather_to_host(
        &mut self,
        b: &mut CudaBackend,
        x: View<'_, CudaBuffer>,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let l = x.layout();
        let n = l.elements() * self.host.size();
        if !self
            .gathered
            .as_ref()
            .is_some_and(|g| g.len() >= n && g.dtype() == x.dtype())
        {
            self.gathered = Some(b.alloc(x.dtype(), n.next_power_of_two())?);
        }
        let Some(g) = self.gathered.take() else {
            return Err(npu_backend::collective::collective_error(
                "no gather buffer",
            ));
        };
        let r = self.gather_raw(b, x, &g, 0).and_then(|()| {
            if self.host.rank() != 0 {
                return Ok(());
            }
            b.read_back(&mut [Readback {
                src: View::new(
                    &g,
                    Layout::contiguous(self.host.size() * l.rows(), l.cols()),
                )?,
                dst: HostSliceMut::F32(out),
            }])
        });
        self.gathered = Some(g);
        r
    }

    fn gather_host_to_root(
        &mut self,
        _b: &mut CudaBackend,
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let root = self.host.rank() == 0;
        self.host
            .gather_to_root(mine, if root { Some(out) } else { None })
    }

    /// Stops the host collective's waits and aborts the communicator (`ncclCommAbort`), which
    /// ends the other ranks' waits in NCCL's collectives.
    fn abort(&mut self) {
        self.host.abort();
        self.comm.destroy(true);
    }
}

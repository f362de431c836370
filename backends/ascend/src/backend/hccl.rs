//! Tensor parallelism's collectives on HCCL (`npu_backend::Collective` for [`AscendBackend`]):
//! `HcclAllReduce` (HCCL_REDUCE_SUM) in place and `HcclAllGather` on the backend's device
//! buffers, queued on the backend's own stream, so that no host synchronization is added;
//! `gather_to_host` is an all-gather into a device scratch buffer that rank 0 reads back (the
//! one host wait, which it needs anyway); `gather_host_to_root` (a few host values per rank)
//! goes through the group's host collective, as the values are on the host already.
//!
//! The communicator comes from the root info of rank 0 (`HcclGetRootInfo`, [`root_info`]),
//! which the caller hands to every other rank (the agent: through the group's shared-memory
//! region), and `HcclCommInitRootInfo` on each rank ([`HcclCollective::join`]).
//! `libhccl.so` is loaded on first use from the directories of the rest of CANN.
//!
//! Only the strict emulation (`emulators/ascend`) has run this; no Ascend hardware has.

use std::sync::OnceLock;

use npu_backend::{
    Backend, BackendError, Collective, DType, DeviceBuffer, HostCollective, HostSliceMut, Readback,
    View, ViewMut,
};
pub use npu_ffi::hccl::HCCL_ROOT_INFO_BYTES;
use npu_ffi::hccl::{self, HcclComm, HcclLibrary, HcclRootInfo};
use npu_ffi::SearchPaths;

use super::{AscendBackend, AscendBuffer, NAME};

static HCCL: OnceLock<Result<HcclLibrary, String>> = OnceLock::new();

/// `libhccl.so`, loaded once per process (or why it could not be).
pub fn library() -> Result<&'static HcclLibrary, String> {
    HCCL.get_or_init(|| HcclLibrary::load(&SearchPaths::from_env()).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| e.clone())
}

fn failed(lib: &HcclLibrary, b: &AscendBackend, call: &str, code: i32) -> BackendError {
    let acl = b.dev.acl.last_message();
    BackendError::Device {
        backend: NAME,
        message: format!(
            "{call} failed with {code} ({}): {}{}",
            hccl::result_name(code),
            lib.error_string(code),
            if acl.is_empty() {
                String::new()
            } else {
                format!(" — {acl}")
            }
        ),
    }
}

/// Rank 0's root info (`HcclGetRootInfo` on `b`'s device), to be handed to every rank.
pub fn root_info(b: &mut AscendBackend) -> Result<[u8; HCCL_ROOT_INFO_BYTES], BackendError> {
    let lib = library().map_err(|message| BackendError::MissingLibrary {
        backend: NAME,
        message,
    })?;
    b.bind()?;
    let mut info = HcclRootInfo::zeroed();
    // SAFETY: `info` is a valid HcclRootInfo the call fills.
    let rc = unsafe { (lib.api.HcclGetRootInfo)(&mut info) };
    if rc != hccl::HCCL_SUCCESS {
        return Err(failed(lib, b, "HcclGetRootInfo", rc));
    }
    Ok(info.as_bytes())
}

fn hccl_dtype(d: DType) -> hccl::HcclDataType {
    match d {
        DType::F32 => hccl::HCCL_DATA_TYPE_FP32,
        DType::F16 => hccl::HCCL_DATA_TYPE_FP16,
        DType::BF16 => hccl::HCCL_DATA_TYPE_BFP16,
        DType::I32 => hccl::HCCL_DATA_TYPE_INT32,
    }
}

/// The device address of a contiguous view's first element.
fn address(
    op: &'static str,
    buf: &AscendBuffer,
    layout: npu_backend::Layout,
    dtype: DType,
) -> Result<*mut core::ffi::c_void, BackendError> {
    if !layout.is_contiguous() {
        return Err(BackendError::BadArgument {
            op,
            message: format!("HCCL takes contiguous rows, not {layout:?}"),
        });
    }
    let es = dtype.size();
    buf.mem
        .range(layout.offset() * es, layout.elements() * es)
        .map_err(super::err)
}

/// `HcclGetCommName` of a live communicator, or None (a library without the call, or a failed
/// call: logged; the fused operators are then not used).
fn comm_name(lib: &HcclLibrary, comm: HcclComm) -> Option<std::ffi::CString> {
    let get = lib.api.HcclGetCommName?;
    let mut name = [0 as core::ffi::c_char; hccl::HCCL_COMM_NAME_MAX_LENGTH];
    // SAFETY: a live communicator and a buffer of the documented HCCL_COMM_NAME_MAX_LENGTH bytes.
    let rc = unsafe { get(comm, name.as_mut_ptr()) };
    if rc != hccl::HCCL_SUCCESS {
        tracing::warn!(
            "HcclGetCommName failed with {rc} ({}): matmul and all-reduce stay two calls",
            hccl::result_name(rc)
        );
        return None;
    }
    // The buffer's last byte is kept NUL: the name ends within it.
    name[hccl::HCCL_COMM_NAME_MAX_LENGTH - 1] = 0;
    // SAFETY: NUL-terminated within the buffer (above).
    Some(unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_owned())
}

/// A communicator handle, destroyed once when dropped (or aborted).
struct Comm {
    lib: &'static HcclLibrary,
    raw: HcclComm,
}

impl Comm {
    fn destroy(&mut self) {
        if self.raw.is_null() {
            return;
        }
        // SAFETY: the communicator is live and destroyed once (nulled below).
        let rc = unsafe { (self.lib.api.HcclCommDestroy)(self.raw) };
        if rc != hccl::HCCL_SUCCESS {
            tracing::warn!(
                "HcclCommDestroy failed with {rc} ({})",
                hccl::result_name(rc)
            );
        }
        self.raw = std::ptr::null_mut();
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.destroy();
    }
}

/// One rank's HCCL communicator, with the group's host collective for host values.
pub struct HcclCollective<H: HostCollective> {
    lib: &'static HcclLibrary,
    comm: Comm,
    host: H,
    /// The all-gather target of `gather_to_host`, grown on demand.
    gathered: Option<AscendBuffer>,
    emulated: bool,
    /// The communicator's name (`HcclGetCommName`), the `group` of aclnnMatmulAllReduce; None
    /// where the library has no such call (then `matmul_all_reduce_sum` runs the two calls).
    group: Option<std::ffi::CString>,
}

// SAFETY: the communicator handle is used by one thread at a time (the collective is owned by
// one model, which one thread drives); HCCL communicators are not tied to a host thread.
unsafe impl<H: HostCollective> Send for HcclCollective<H> {}

impl<H: HostCollective> HcclCollective<H> {
    /// `HcclCommInitRootInfo` as rank `host.rank()` of `host.size()` on `b`'s device, from rank
    /// 0's root info; returns when every rank has joined (HCCL's own timeout otherwise). A
    /// failure hands `host` back (the caller may run the group through it instead).
    pub fn join(
        b: &mut AscendBackend,
        root: &[u8; HCCL_ROOT_INFO_BYTES],
        host: H,
    ) -> Result<Self, (BackendError, H)> {
        let lib = match library() {
            Ok(l) => l,
            Err(message) => {
                return Err((
                    BackendError::MissingLibrary {
                        backend: NAME,
                        message,
                    },
                    host,
                ))
            }
        };
        let (rank, size) = (host.rank() as u32, host.size() as u32);
        if let Err(e) = b.bind() {
            return Err((e, host));
        }
        let info = HcclRootInfo::from_bytes(root);
        let mut comm: HcclComm = std::ptr::null_mut();
        // SAFETY: a root info of the documented size and a valid out-pointer for the handle.
        let rc = unsafe { (lib.api.HcclCommInitRootInfo)(size, &info, rank, &mut comm) };
        if rc != hccl::HCCL_SUCCESS {
            return Err((failed(lib, b, "HcclCommInitRootInfo", rc), host));
        }
        let group = comm_name(lib, comm);
        Ok(Self {
            lib,
            comm: Comm { lib, raw: comm },
            host,
            gathered: None,
            emulated: b.emulated,
            group,
        })
    }

    fn all_gather_raw(
        &mut self,
        b: &mut AscendBackend,
        x: View<'_, AscendBuffer>,
        out: &mut AscendBuffer,
        out_layout: npu_backend::Layout,
    ) -> Result<(), BackendError> {
        let l = x.layout();
        let send = address("all_gather", x.buf(), l, x.dtype())?;
        let recv = address("all_gather", out, out_layout, x.dtype())?;
        b.bind()?;
        b.picked = None;
        out.half = None;
        let stream = b.dev.stream();
        // SAFETY: both addresses lie in live device buffers of the sizes the call implies
        // (checked by `address`); the stream and communicator are live.
        let rc = unsafe {
            (self.lib.api.HcclAllGather)(
                send,
                recv,
                l.elements() as u64,
                hccl_dtype(x.dtype()),
                self.comm.raw,
                stream,
            )
        };
        b.pending = true;
        if rc != hccl::HCCL_SUCCESS {
            return Err(failed(self.lib, b, "HcclAllGather", rc));
        }
        Ok(())
    }
}

impl<H: HostCollective> HcclCollective<H> {
    /// The group's host collective.
    pub fn host_mut(&mut self) -> &mut H {
        &mut self.host
    }

    /// Destroys the communicator and hands the host collective back.
    pub fn into_host(self) -> H {
        let Self { host, comm, .. } = self;
        drop(comm);
        host
    }
}

impl<H: HostCollective> Collective<AscendBackend> for HcclCollective<H> {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn size(&self) -> usize {
        self.host.size()
    }

    fn describe(&self) -> String {
        format!(
            "HCCL ({}{}), rank {} of {}, on the device's stream; host values through {}",
            self.lib.path.display(),
            if self.emulated {
                ", the CANN emulation"
            } else {
                ""
            },
            self.host.rank(),
            self.host.size(),
            self.host.describe()
        )
    }

    fn all_reduce_sum(
        &mut self,
        b: &mut AscendBackend,
        mut x: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        if self.comm.raw.is_null() {
            return Err(npu_backend::collective::collective_error(
                "the HCCL communicator was aborted",
            ));
        }
        let l = x.layout();
        let dt = x.dtype();
        let p = address("all_reduce_sum", x.buf(), l, dt)?;
        b.bind()?;
        b.picked = None;
        x.buf_mut().half = None;
        let stream = b.dev.stream();
        // SAFETY: `p` lies in a live device buffer holding the view's elements (checked); in
        // place (send = recv) is allowed; the stream and communicator are live.
        let rc = unsafe {
            (self.lib.api.HcclAllReduce)(
                p,
                p,
                l.elements() as u64,
                hccl_dtype(dt),
                hccl::HCCL_REDUCE_SUM,
                self.comm.raw,
                stream,
            )
        };
        b.pending = true;
        if rc != hccl::HCCL_SUCCESS {
            return Err(failed(self.lib, b, "HcclAllReduce", rc));
        }
        Ok(())
    }

    /// One aclnnMatmulAllReduce where it takes the case (`mc2_ops`) and the group has 1, 2, 4
    /// or 8 ranks (its page's counts on Atlas A2), else aclnnMatmul then HcclAllReduce.
    fn matmul_all_reduce_sum(
        &mut self,
        b: &mut AscendBackend,
        x: View<'_, AscendBuffer>,
        w: &super::objects::AscendMatrix,
        mut out: ViewMut<'_, AscendBuffer>,
    ) -> Result<bool, BackendError> {
        if self.comm.raw.is_null() {
            return Err(npu_backend::collective::collective_error(
                "the HCCL communicator was aborted",
            ));
        }
        let fused = self.group.as_ref().filter(|_| {
            matches!(self.host.size(), 1 | 2 | 4 | 8) && b.fuses_matmul_all_reduce(&x, w, &out)
        });
        if let Some(group) = fused {
            b.op_matmul_all_reduce(x, w, out, group)?;
            return Ok(true);
        }
        let cols = out.layout().cols();
        b.matmul(x, w, out.col_range(0, cols)?)?;
        self.all_reduce_sum(b, out)?;
        Ok(false)
    }

    fn all_gather(
        &mut self,
        b: &mut AscendBackend,
        x: View<'_, AscendBuffer>,
        mut out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let want = x.layout().elements() * self.host.size();
        if out.layout().elements() != want
            || out.layout().cols() != x.layout().cols()
            || !out.layout().is_contiguous()
            || out.dtype() != x.dtype()
        {
            return Err(BackendError::BadArgument {
                op: "all_gather",
                message: format!(
                    "{} ranks x {:?} ({}) do not fill {:?} ({}) contiguously",
                    self.host.size(),
                    x.layout(),
                    x.dtype().name(),
                    out.layout(),
                    out.dtype().name()
                ),
            });
        }
        if self.comm.raw.is_null() {
            return Err(npu_backend::collective::collective_error(
                "the HCCL communicator was aborted",
            ));
        }
        let ol = out.layout();
        self.all_gather_raw(b, x, out.buf_mut(), ol)
    }

    fn gather_to_host(
        &mut self,
        b: &mut AscendBackend,
        x: View<'_, AscendBuffer>,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        if self.comm.raw.is_null() {
            return Err(npu_backend::collective::collective_error(
                "the HCCL communicator was aborted",
            ));
        }
        let l = x.layout();
        let n = l.elements() * self.host.size();
        let fits = self
            .gathered
            .as_ref()
            .is_some_and(|g| g.len() >= n && DeviceBuffer::dtype(g) == x.dtype());
        if !fits {
            // The old buffer's drop waits for queued work that may still use it.
            self.gathered = None;
            self.gathered = Some(b.alloc(x.dtype(), n.next_power_of_two())?);
        }
        let Some(mut g) = self.gathered.take() else {
            return Err(npu_backend::collective::collective_error(
                "no gather buffer",
            ));
        };
        let rows = self.host.size() * l.rows();
        let r = self.all_gather_raw(
            b,
            x,
            &mut g,
            npu_backend::Layout::contiguous(rows, l.cols()),
        );
        let r = r.and_then(|()| {
            if self.host.rank() != 0 {
                return Ok(());
            }
            if out.len() != n {
                return Err(BackendError::BadArgument {
                    op: "gather_to_host",
                    message: format!("{} values for {n} gathered", out.len()),
                });
            }
            b.read_back(&mut [Readback {
                src: View::new(&g, npu_backend::Layout::contiguous(rows, l.cols()))?,
                dst: HostSliceMut::F32(out),
            }])
        });
        self.gathered = Some(g);
        r
    }

    fn gather_host_to_root(
        &mut self,
        _b: &mut AscendBackend,
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let root = self.host.rank() == 0;
        self.host
            .gather_to_root(mine, if root { Some(out) } else { None })
    }

    /// Stops the host collective's waits and destroys the communicator: ranks waiting in a
    /// collective with this one fail (HCCL's own timeout bounds it on hardware).
    fn abort(&mut self) {
        self.host.abort();
        if !self.comm.raw.is_null() {
            self.comm.destroy();
        }
    }
}

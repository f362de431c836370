//! CUDA graphs on the real device: the stream's work recorded with `cuStreamBeginCapture_v2` /
//! `cuStreamEndCapture`, instantiated once (`cuGraphInstantiateWithFlags`) and replayed with
//! `cuGraphLaunch` (driver entry points of CUDA 10+, looked up in the loaded driver before
//! use, so a driver without them turns graphs off instead of panicking in cudarc).
//!
//! **Capture mode: `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`.** While this thread captures, the
//! driver refuses the calls the documentation calls potentially unsafe from it (a `cuMemAlloc`,
//! a synchronous copy), which catches a step op that would not be in the graph; other threads
//! (another backend instance in the process) are not affected, as they would be under
//! `GLOBAL`; `RELAXED` would let those calls through unrecorded. The backend begins and ends a
//! capture on one thread (the runner records a step within one call), as thread-local mode
//! requires of `cuStreamEndCapture`.
//!
//! What this seam refuses itself while capturing (and the capture is then invalid: ending it
//! fails): allocating (a `cuMemAllocAsync` would become a graph-owned allocation the backend
//! would keep as its own), freeing (done once the capture ends), a host→device copy (it stages
//! through a pinned buffer that a replay would read as it is then), a read and a
//! synchronization. cuBLAS gets a workspace of its own (`cublasSetWorkspace`) before the first
//! capture, so a GEMM recorded in a graph needs no allocation from cuBLAS's pool.
//!
//! A graph names device memory (the pointer parameters of its launches, its copies' ranges,
//! its GEMMs' operands); a free of memory a graph names marks it stale, and it is never
//! launched again (the backend captures anew).

use std::collections::HashMap;
use std::ffi::c_void;
use std::thread::ThreadId;

use cudarc::driver::{result as drv, sys as drv_sys};
use npu_backend::BackendError;

use super::{dev_err, CudaGpu};
use crate::gpu::{DevPtr, GraphId};

/// cuBLAS's workspace for captured GEMMs: 32 MiB, the size cuBLAS documents for Hopper (smaller
/// ones suffice before it).
const BLAS_WORKSPACE: usize = 32 << 20;

/// The driver entry points graphs need.
const ENTRY_POINTS: [&str; 7] = [
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuStreamIsCapturing",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
];

/// Whether the loaded driver exports every entry point graphs need.
pub(super) fn entry_points_present() -> bool {
    // SAFETY: the driver library was loaded (and checked) before the device opened; looking a
    // symbol up calls nothing.
    let lib = unsafe { drv_sys::culib() };
    ENTRY_POINTS.iter().all(|name| {
        // SAFETY: only the symbol's presence is read; it is never called through this type.
        unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok()
    })
}

struct Open {
    thread: ThreadId,
    named: Vec<DevPtr>,
    invalid: Option<String>,
    deferred_frees: Vec<(DevPtr, usize)>,
}

struct Exec {
    exec: drv_sys::CUgraphExec,
    named: Vec<DevPtr>,
    stale: bool,
}

/// The device's graphs.
#[derive(Default)]
pub(super) struct Graphs {
    /// The driver has the entry points (`entry_points_present`).
    pub(super) available: bool,
    open: Option<Open>,
    execs: HashMap<GraphId, Exec>,
    next: GraphId,
    /// cuBLAS's workspace (allocated at the first capture, freed with the device).
    blas_workspace: Option<DevPtr>,
}

// SAFETY: the executable-graph handles are owned by this value and used only under the
// device's lock.
unsafe impl Send for Graphs {}

impl Graphs {
    /// `available`: the driver has the entry points.
    pub(super) fn new(available: bool) -> Self {
        Self {
            available,
            ..Default::default()
        }
    }

    /// Whether cuBLAS has its own workspace (GEMMs may be captured).
    pub(super) fn blas_ready(&self) -> bool {
        self.blas_workspace.is_some()
    }

    /// While capturing: the recorded work names `ptrs`.
    pub(super) fn name(&mut self, ptrs: impl IntoIterator<Item = DevPtr>) {
        if let Some(o) = self.open.as_mut() {
            o.named.extend(ptrs.into_iter().filter(|&p| p != 0));
        }
    }

    pub(super) fn capturing(&self) -> bool {
        self.open.is_some()
    }

    /// A call this seam does not allow inside a capture: the capture is invalidated, and the
    /// error names the call. Ok when not capturing.
    pub(super) fn refuse(&mut self, call: &str) -> Result<(), BackendError> {
        let Some(o) = self.open.as_mut() else {
            return Ok(());
        };
        let why = format!("{call} while the stream is capturing a graph");
        o.invalid.get_or_insert_with(|| why.clone());
        Err(dev_err(&why, "refused; the capture is invalidated"))
    }

    /// A free while capturing: deferred to the capture's end (the capture is invalidated).
    pub(super) fn defer_free(&mut self, ptr: DevPtr, bytes: usize) -> bool {
        let Some(o) = self.open.as_mut() else {
            return false;
        };
        o.invalid
            .get_or_insert_with(|| format!("a free of {ptr:#x} while capturing"));
        o.deferred_frees.push((ptr, bytes));
        true
    }

    /// `[ptr, ptr + bytes)` was freed: graphs naming it are stale.
    pub(super) fn freed(&mut self, ptr: DevPtr, bytes: usize) {
        let end = ptr + bytes as u64;
        for e in self.execs.values_mut() {
            if e.named.iter().any(|&p| p >= ptr && p < end) {
                e.stale = true;
            }
        }
    }
}

impl CudaGpu {
    pub(super) fn graphs(&self) -> std::sync::MutexGuard<'_, Graphs> {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The stream's capture status (`cuStreamIsCapturing`).
    fn stream_capture_status(&self) -> Result<drv_sys::CUstreamCaptureStatus, BackendError> {
        let mut st = drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: our stream and a valid out-pointer.
        unsafe { drv_sys::cuStreamIsCapturing(self.cu_stream(), &mut st) }
            .result()
            .map_err(|e| self.err("cuStreamIsCapturing", e))?;
        Ok(st)
    }

    pub(super) fn graph_capture_begin(&self) -> Result<(), BackendError> {
        self.bind()?;
        let mut g = self.graphs();
        if !g.available {
            return Err(crate::gpu::graphs_unsupported());
        }
        if g.open.is_some()
            || self.stream_capture_status()?
                != drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        {
            return Err(dev_err(
                "cuStreamBeginCapture_v2",
                "the stream is already capturing",
            ));
        }
        if g.blas_workspace.is_none() && self.blas.has_set_workspace() {
            let ws = self.alloc_raw(BLAS_WORKSPACE)?;
            // SAFETY: a live handle bound to our stream; `ws` is BLAS_WORKSPACE bytes of this
            // context, freed only with the device (after the handle's last use).
            if let Err(m) = unsafe {
                self.blas
                    .set_workspace(self.handle, ws as *mut c_void, BLAS_WORKSPACE)
            } {
                self.free_raw(ws);
                return Err(dev_err("cublasSetWorkspace", m));
            }
            g.blas_workspace = Some(ws);
        }
        // SAFETY: our stream, not capturing (checked).
        unsafe {
            drv_sys::cuStreamBeginCapture_v2(
                self.cu_stream(),
                drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .result()
        .map_err(|e| self.err("cuStreamBeginCapture_v2", e))?;
        g.open = Some(Open {
            thread: std::thread::current().id(),
            named: Vec::new(),
            invalid: None,
            deferred_frees: Vec::new(),
        });
        Ok(())
    }

    /// Ends the open capture: its instantiated graph, or (`abort`, or an invalid capture) none.
    pub(super) fn graph_capture_end(&self, abort: bool) -> Result<Option<GraphId>, BackendError> {
        self.bind()?;
        let mut g = self.graphs();
        let Some(open) = g.open.as_ref() else {
            return if abort {
                Ok(None)
            } else {
                Err(dev_err("cuStreamEndCapture", "the stream is not capturing"))
            };
        };
        if open.thread != std::thread::current().id() {
            return Err(dev_err(
                "cuStreamEndCapture",
                "called from another thread than the capture's (thread-local mode)",
            ));
        }
        let open = g.open.take().expect("checked");
        let mut graph: drv_sys::CUgraph = std::ptr::null_mut();
        // SAFETY: our stream, capturing from this thread; `graph` is a valid out-pointer.
        let ended = unsafe { drv_sys::cuStreamEndCapture(self.cu_stream(), &mut graph) }.result();
        for (ptr, bytes) in open.deferred_frees {
            self.free_raw(ptr);
            g.freed(ptr, bytes);
        }
        let destroy_graph = |graph: drv_sys::CUgraph| {
            if !graph.is_null() {
                // SAFETY: a graph the capture returned, destroyed once.
                let _ = unsafe { drv_sys::cuGraphDestroy(graph) };
            }
        };
        if let Err(e) = ended {
            destroy_graph(graph);
            return Err(self.err("cuStreamEndCapture", e));
        }
        if abort {
            destroy_graph(graph);
            return Ok(None);
        }
        if let Some(why) = open.invalid {
            destroy_graph(graph);
            return Err(dev_err(
                "cuStreamEndCapture",
                format!("the capture was invalidated: {why}"),
            ));
        }
        let mut exec: drv_sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: a complete graph of this context; flags 0 (no auto-free, no upload).
        let r = unsafe { drv_sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result();
        // The executable graph does not depend on the graph it was made from.
        destroy_graph(graph);
        r.map_err(|e| self.err("cuGraphInstantiateWithFlags", e))?;
        let id = g.next;
        g.next += 1;
        g.execs.insert(
            id,
            Exec {
                exec,
                named: open.named,
                stale: false,
            },
        );
        Ok(Some(id))
    }

    pub(super) fn graph_replay(&self, id: GraphId) -> Result<(), BackendError> {
        self.bind()?;
        let g = self.graphs();
        if g.open.is_some() {
            return Err(dev_err(
                "cuGraphLaunch",
                "the stream is capturing (graphs are not nested)",
            ));
        }
        let e = g
            .execs
            .get(&id)
            .ok_or_else(|| dev_err("cuGraphLaunch", format!("no graph {id}")))?;
        if e.stale {
            return Err(dev_err(
                "cuGraphLaunch",
                format!("graph {id} names memory freed since its capture"),
            ));
        }
        // SAFETY: a live executable graph of this context, launched on our stream; the memory
        // it names is allocated (no free of it since the capture: `stale`).
        unsafe { drv_sys::cuGraphLaunch(e.exec, self.cu_stream()) }
            .result()
            .map_err(|e| self.err("cuGraphLaunch", e))
    }

    pub(super) fn graph_is_stale(&self, id: GraphId) -> bool {
        self.graphs().execs.get(&id).is_none_or(|e| e.stale)
    }

    pub(super) fn graph_destroy(&self, id: GraphId) {
        let Some(e) = self.graphs().execs.remove(&id) else {
            return;
        };
        if self.bind().is_err() {
            return;
        }
        // Its queued launches complete first.
        let _ = self.sync_stream("cuStreamSynchronize (before cuGraphExecDestroy)");
        // SAFETY: a live executable graph, no launch of it pending (synchronized), destroyed once.
        let _ = unsafe { drv_sys::cuGraphExecDestroy(e.exec) };
    }

    /// Releases every graph and cuBLAS's workspace (the device is being dropped, its stream
    /// drained).
    pub(super) fn graphs_release(&mut self) {
        let g = self.graphs.get_mut().unwrap_or_else(|e| e.into_inner());
        for (_, e) in g.execs.drain() {
            // SAFETY: no launch pending (the caller drained the stream); destroyed once.
            let _ = unsafe { drv_sys::cuGraphExecDestroy(e.exec) };
        }
        if let Some(ws) = g.blas_workspace.take() {
            // SAFETY: the handle is destroyed after this or never used again; freed once.
            let _ = unsafe { drv::free_sync(ws) };
        }
    }
}

//! A CPU emulation of the device under the backend, for tests on machines without a GPU: the
//! kernel sources compiled as C++ (`build`), run by the emulation's scheduler, on guarded host
//! memory (`memory`), with cublasGemmEx's contract done on the host. It is an emulation: it
//! checks the backend's indexing, parameter packing, stream ordering and synchronisation, and
//! arithmetic against the CPU reference; it says nothing about speed or about a real GPU.
//!
//! Strict where a device is: a launch must pass exactly the kernel's parameters with their sizes
//! (checked against the compiled signature) in a valid launch configuration, pointer parameters
//! must point into live allocations, copies must stay inside one allocation, writes past an
//! allocation's end are reported, shared memory is limited, and GEMM arguments follow cuBLAS's
//! rules.
//!
//! **One stream, run as late as allowed.** Like the real device (`driver`), the emulation has one
//! stream, and everything the seam queues on it — host→device copies (`cuMemcpyHtoDAsync` from
//! the pinned staging ring), device copies (`cuMemcpyDtoDAsync`), kernel launches
//! (`cuLaunchKernel`), GEMMs (`cublasGemmEx` on the stream), frees (`cuMemFreeAsync`), the
//! staging ring's event records (`cuEventRecord`) and a read's device→host copies
//! (`cuMemcpyDtoHAsync` into pinned memory) — is checked when it is queued and **runs later, in
//! queue order**: when the stream is synchronized (`synchronize`, a read's
//! `cuStreamSynchronize`) or, for the work up to a staging event's latest record, when the ring
//! waits for that event (`cuEventSynchronize`). That is the latest a device may run it, so a
//! missing synchronisation shows:
//!
//! - host memory read before the copy into it was synchronized holds what it held before: a
//!   read's pinned buffer is filled by its queued copies only at the synchronization (a fresh
//!   buffer holds 0xff bytes, NaN as f32, f16 and bf16), and device memory, which the emulation
//!   keeps in host memory, keeps its old bytes until the work writing it has run;
//! - a staging buffer the host rewrites before waiting for its event is what the queued copy
//!   reads (`cuMemcpyHtoDAsync` from pinned memory reads it when the stream gets there);
//! - work queued after a free may not name the freed memory (refused when queued, a use after
//!   free), and the memory stays mapped for the work queued before the free;
//! - a kernel's fault (an error of the scheduler, a write past an allocation's end) is reported
//!   by the synchronization that ran it, naming the kernels queued last, and leaves the context
//!   unusable, as on a GPU; `NPU_SERVING_CUDA_SYNC=1` synchronizes after every launch and GEMM,
//!   as on the real device, so that the fault names its own kernel.
//!
//! The read path and the staging ring are the real device's own code (`staging::read`,
//! `staging::Staging`), so these checks cover them. Not emulated: several streams, events other
//! than the ring's and the synchronous `cuMemcpy` (the backend uses none of them), and pageable
//! host memory in an asynchronous copy (the seam takes none: `htod` stages
//! through pinned memory as the driver does). A fresh allocation reads as zeros, as the driver's
//! `cuMemsetD8Async` after `cuMemAllocAsync` leaves it.
//!
//! Stream capture into graphs and their replay are in `capture`: recorded work does not run,
//! what CUDA forbids while capturing fails and invalidates the capture, and a replay runs the
//! recorded work against memory as it is then.

mod build;
mod capture;
mod memory;

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use npu_backend::{BackendError, DType, MemInfo};

use crate::fault::{self, Fault, Launch};
use crate::gpu::{ArgKind, Args, DevPtr, Gemm, Gpu, GraphId, LaunchDims};
use crate::kernels;
use crate::staging::{self, ReadDevice, StageDevice, Staging, STAGE_BUFFERS, STAGE_BYTES};
use memory::Memory;

type KernelFn = unsafe extern "C" fn(
    *const u32,
    *const u32,
    u32,
    *mut *mut c_void,
    *mut c_char,
    usize,
) -> c_int;
type ParamsFn = unsafe extern "C" fn(*mut u32, c_int) -> c_int;
type GemmFn = unsafe extern "C" fn(
    usize,
    usize,
    usize,
    *const c_void,
    usize,
    *const c_void,
    usize,
    *mut c_void,
    usize,
    c_int,
    c_int,
);

struct Kernel {
    name: String,
    run: KernelFn,
    param_sizes: Vec<u32>,
}

struct Library {
    _lib: libloading::Library,
    kernels: Vec<Kernel>,
    gemm: GemmFn,
}

fn load_library() -> Result<Library, String> {
    let path = build::library()?;
    // SAFETY: a library this crate just built from its own sources; its initialisers are the
    // C++ runtime's.
    let lib = unsafe { libloading::Library::new(&path) }
        .map_err(|e| format!("loading {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for name in kernels::kernel_names() {
        // SAFETY: the symbols are the entry points NPU_EMU_KERNEL defines, with these types.
        let (run, params) = unsafe {
            let run: libloading::Symbol<KernelFn> = lib
                .get(format!("emu_{name}\0").as_bytes())
                .map_err(|e| format!("emu_{name}: {e}"))?;
            let params: libloading::Symbol<ParamsFn> = lib
                .get(format!("emu_params_{name}\0").as_bytes())
                .map_err(|e| format!("emu_params_{name}: {e}"))?;
            (*run, *params)
        };
        let mut sizes = vec![0u32; 64];
        // SAFETY: `sizes` holds the capacity passed.
        let n = unsafe { params(sizes.as_mut_ptr(), sizes.len() as c_int) };
        sizes.truncate(n.max(0) as usize);
        out.push(Kernel {
            name,
            run,
            param_sizes: sizes,
        });
    }
    // SAFETY: the GEMM entry point runtime.cpp defines, with this type.
    let gemm = unsafe {
        *lib.get::<GemmFn>(b"npu_emu_gemm\0")
            .map_err(|e| format!("npu_emu_gemm: {e}"))?
    };
    Ok(Library {
        _lib: lib,
        kernels: out,
        gemm,
    })
}

static LIBRARY: OnceLock<Result<Library, String>> = OnceLock::new();
/// The emulation runtime's state is global: one kernel runs at a time in the process.
static LAUNCH: Mutex<()> = Mutex::new(());
/// Every kernel index run successfully in this process, on any emulated device.
static EVER_LAUNCHED: Mutex<Vec<bool>> = Mutex::new(Vec::new());

/// The kernels run successfully so far in this process (on any emulated device), by name.
pub fn kernels_launched_in_process() -> Vec<String> {
    let ever = EVER_LAUNCHED.lock().unwrap_or_else(|e| e.into_inner());
    let names = kernels::kernel_names();
    ever.iter()
        .enumerate()
        .filter(|(_, &x)| x)
        .map(|(i, _)| names[i].clone())
        .collect()
}

/// Streaming multiprocessors the emulation reports (sizes attention splits as a small GPU).
const SM_COUNT: u32 = 8;
/// Dynamic shared memory a block may use (an sm_86 device's opt-in limit).
const MAX_SMEM: u32 = 99 * 1024;
/// What emulated pinned memory holds before any copy wrote it (NaN in f32, f16 and bf16).
const PINNED_POISON: u8 = 0xff;

fn emu_err(message: String) -> BackendError {
    BackendError::Device {
        backend: "cuda",
        message: format!("emulation: {message}"),
    }
}

/// Emulated pinned host memory (`cuMemHostAlloc`): a block the host writes or reads and queued
/// copies read or write when they run.
struct Pinned {
    ptr: *mut u8,
    bytes: usize,
}

impl Pinned {
    const ALIGN: usize = 4096;

    /// `bytes` bytes of poison (none for 0).
    fn new(bytes: usize) -> Self {
        if bytes == 0 {
            return Self {
                ptr: std::ptr::null_mut(),
                bytes: 0,
            };
        }
        let layout = std::alloc::Layout::from_size_align(bytes, Self::ALIGN)
            .expect("a pinned buffer's size fits a layout");
        // SAFETY: a layout of non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // SAFETY: `ptr` holds `bytes` bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr, PINNED_POISON, bytes) };
        Self { ptr, bytes }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated in `new` with this size and alignment, freed once.
            unsafe {
                std::alloc::dealloc(
                    self.ptr,
                    std::alloc::Layout::from_size_align_unchecked(self.bytes, Self::ALIGN),
                )
            };
        }
    }
}

/// One unit of stream work: checked when queued, run when the stream gets there.
#[derive(Clone)]
enum Work {
    /// `cuMemcpyHtoDAsync` from staging buffer `buf`, which it reads when it runs.
    HtoD {
        dst: DevPtr,
        buf: usize,
        bytes: usize,
    },
    /// `cuMemcpyDtoDAsync`.
    DtoD {
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
    },
    /// `cuMemcpyDtoHAsync` into the pinned read buffer at `at`.
    DtoH {
        at: usize,
        src: DevPtr,
        bytes: usize,
    },
    /// `cuLaunchKernel`: the parameter values as they were at the launch (the driver copies
    /// them then), and the allocations its pointers point into.
    Kernel {
        kernel: usize,
        dims: LaunchDims,
        params: Vec<u64>,
        touched: Vec<u64>,
    },
    /// `cublasGemmEx` on the stream.
    Gemm(Gemm),
    /// `cuMemFreeAsync`.
    Free(DevPtr),
    /// `cuEventRecord` of a staging event: the event is complete once the stream passed it
    /// (`Device::recorded` holds each event's latest record by serial).
    Record,
}

/// The emulated device: its memory, its one stream's queue and its pinned buffers, behind one
/// lock (queued work runs with it held, so nothing the work touches changes meanwhile).
struct Device {
    mem: Memory,
    /// Queued work with its serial number, oldest first.
    queue: VecDeque<(u64, Work)>,
    next_serial: u64,
    /// The serial of each staging event's latest record (`None`: never recorded).
    recorded: [Option<u64>; STAGE_BUFFERS],
    /// The staging ring's pinned buffers.
    stage: [Pinned; STAGE_BUFFERS],
    /// The pinned buffer reads land in.
    read_buf: Pinned,
    bad_frees: Vec<String>,
    /// Stream capture and graphs (`capture`).
    capture: capture::Capture,
}

// SAFETY: the pinned buffers are owned by this value alone (their pointers are not shared
// outside the device's lock).
unsafe impl Send for Device {}

impl Device {
    fn enqueue(&mut self, w: Work) -> u64 {
        let serial = self.next_serial;
        self.next_serial += 1;
        self.queue.push_back((serial, w));
        serial
    }
}

/// The emulated device.
pub struct EmuGpu {
    lib: &'static Library,
    /// The host→device staging ring (locked before `dev`: `htod` holds both).
    ring: Mutex<Staging>,
    dev: Mutex<Device>,
    /// Kernels queued so far (tests check ops really launched kernels).
    launches: Mutex<Vec<usize>>,
    /// A kernel that faulted leaves the emulated context unusable, as on a GPU.
    fault: Fault,
    /// `NPU_SERVING_CUDA_SYNC=1`: synchronize after every launch and GEMM, as the real device.
    sync_each: bool,
    /// Deliberately wrong (the faulty-backend test): reads skip their synchronization.
    skip_read_sync: AtomicBool,
}

impl EmuGpu {
    /// Builds (once per process, cached on disk) and loads the emulation library.
    pub fn new() -> Result<Self, BackendError> {
        let lib = LIBRARY
            .get_or_init(load_library)
            .as_ref()
            .map_err(|e| emu_err(e.clone()))?;
        Ok(Self {
            lib,
            ring: Mutex::new(Staging::new(STAGE_BYTES)),
            dev: Mutex::new(Device {
                mem: Memory::default(),
                queue: VecDeque::new(),
                next_serial: 0,
                recorded: [None; STAGE_BUFFERS],
                stage: std::array::from_fn(|_| Pinned::new(STAGE_BYTES)),
                read_buf: Pinned::new(0),
                bad_frees: Vec::new(),
                capture: capture::Capture::default(),
            }),
            launches: Mutex::new(Vec::new()),
            fault: Fault::default(),
            sync_each: fault::sync_each_launch(),
            skip_read_sync: AtomicBool::new(false),
        })
    }

    fn dev(&self) -> MutexGuard<'_, Device> {
        self.dev.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A device fault while running queued work: the context is unusable from now on.
    fn fatal(&self, what: &str, error: &str) -> BackendError {
        self.fault.fatal(
            &format!("emulation: {what}"),
            &format!("{error} (on a GPU: a device fault)"),
        )
    }

    /// Runs the queued work in order, up to and including serial `upto` (all of it: `None`). A
    /// fault stops the stream: the rest of the queue is dropped, as nothing after a device fault
    /// runs.
    fn run_queue(&self, d: &mut Device, upto: Option<u64>) -> Result<(), BackendError> {
        self.fault.check()?;
        while let Some(&(serial, _)) = d.queue.front() {
            if upto.is_some_and(|u| serial > u) {
                break;
            }
            let (_, work) = d.queue.pop_front().expect("a front element");
            if let Err(e) = self.execute(d, work) {
                d.queue.clear();
                return Err(e);
            }
        }
        Ok(())
    }

    /// Runs one unit of queued work (the stream got there).
    fn execute(&self, d: &mut Device, work: Work) -> Result<(), BackendError> {
        match work {
            Work::HtoD { dst, buf, bytes } => {
                if !d.mem.mapped(dst, bytes) || bytes > d.stage[buf].bytes {
                    return Err(self.fatal(
                        "cuMemcpyHtoDAsync",
                        &format!("[{dst:#x}, +{bytes}) is not mapped when the copy runs"),
                    ));
                }
                // SAFETY: the destination lies in a mapped allocation and the source in staging
                // buffer `buf` (both checked); the device lock is held, so nothing else writes
                // either meanwhile.
                unsafe { std::ptr::copy(d.stage[buf].ptr, dst as *mut u8, bytes) };
            }
            Work::DtoD { dst, src, bytes } => {
                if !d.mem.mapped(dst, bytes) || !d.mem.mapped(src, bytes) {
                    return Err(self.fatal(
                        "cuMemcpyDtoDAsync",
                        &format!("[{src:#x}, +{bytes}) -> {dst:#x} is not mapped when it runs"),
                    ));
                }
                // SAFETY: both ranges lie in mapped allocations (checked); `copy` handles the
                // overlap of equal ranges.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
            }
            Work::DtoH { at, src, bytes } => {
                if !d.mem.mapped(src, bytes) || at + bytes > d.read_buf.bytes {
                    return Err(self.fatal(
                        "cuMemcpyDtoHAsync",
                        &format!(
                            "[{src:#x}, +{bytes}) into the read buffer at {at} (of {}) is out of \
                             bounds when the copy runs",
                            d.read_buf.bytes
                        ),
                    ));
                }
                // SAFETY: the source lies in a mapped allocation and [at, at + bytes) in the
                // pinned read buffer (both checked).
                unsafe {
                    std::ptr::copy_nonoverlapping(src as *const u8, d.read_buf.ptr.add(at), bytes)
                };
            }
            Work::Kernel {
                kernel,
                dims,
                mut params,
                touched,
            } => self.run_kernel(d, kernel, dims, &mut params, &touched)?,
            Work::Gemm(g) => self.run_gemm(d, &g)?,
            Work::Free(ptr) => {
                if let Err(e) = d.mem.free(ptr) {
                    d.bad_frees.push(e);
                }
            }
            Work::Record => {}
        }
        Ok(())
    }

    fn run_kernel(
        &self,
        d: &mut Device,
        kernel: usize,
        dims: LaunchDims,
        params: &mut [u64],
        touched: &[u64],
    ) -> Result<(), BackendError> {
        let k = &self.lib.kernels[kernel];
        if let Some(s) = touched.iter().find(|&&s| !d.mem.has(s)) {
            return Err(self.fatal(
                &k.name,
                &format!("the allocation at {s:#x} is not mapped when the kernel runs"),
            ));
        }
        let mut ptrs: Vec<*mut c_void> = params
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        let mut err = vec![0u8; 512];
        let rc = {
            let _one = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the parameters match the kernel's signature (sizes checked when queued),
            // each in its own 8-byte slot that lives across the call; the pointers point into
            // allocations still mapped (checked above: frees run in stream order, after the
            // work queued before them); the runtime is used by one kernel at a time.
            unsafe {
                (k.run)(
                    dims.grid.as_ptr(),
                    dims.block.as_ptr(),
                    dims.smem,
                    ptrs.as_mut_ptr(),
                    err.as_mut_ptr() as *mut c_char,
                    err.len(),
                )
            }
        };
        if rc != 0 {
            let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
            let what = String::from_utf8_lossy(&err[..end]).into_owned();
            return Err(self.fatal(&k.name, &what));
        }
        if let Some(s) = touched.iter().find(|&&s| !d.mem.intact(s)) {
            return Err(self.fatal(
                &k.name,
                &format!(
                    "wrote past the end of the allocation at {s:#x} (CUDA_ERROR_ILLEGAL_ADDRESS \
                     or silent corruption)"
                ),
            ));
        }
        let mut ever = EVER_LAUNCHED.lock().unwrap_or_else(|e| e.into_inner());
        if ever.len() < self.lib.kernels.len() {
            ever.resize(self.lib.kernels.len(), false);
        }
        ever[kernel] = true;
        Ok(())
    }

    fn gemm_spans(g: &Gemm) -> [(DevPtr, usize, &'static str); 3] {
        let span = |ld: usize, cols: usize, rows: usize| (cols - 1) * ld + rows;
        let ab = g.ab_type.size();
        [
            (g.a, span(g.lda, g.m, g.k) * ab, "cublasGemmEx A"),
            (g.b, span(g.ldb, g.n, g.k) * ab, "cublasGemmEx B"),
            (
                g.c,
                span(g.ldc, g.n, g.m) * g.c_type.size(),
                "cublasGemmEx C",
            ),
        ]
    }

    fn run_gemm(&self, d: &mut Device, g: &Gemm) -> Result<(), BackendError> {
        if let Some((p, n, what)) = Self::gemm_spans(g)
            .into_iter()
            .find(|&(p, n, _)| !d.mem.mapped(p, n))
        {
            return Err(self.fatal(
                "cublasGemmEx",
                &format!("{what} [{p:#x}, +{n}) is not mapped when the GEMM runs"),
            ));
        }
        let code = |t: DType| match t {
            DType::F32 => 0,
            DType::F16 => 1,
            _ => 2,
        };
        // SAFETY: the three ranges lie inside mapped allocations (checked above) and the types
        // are ones the function handles (checked when queued); the device lock is held.
        unsafe {
            (self.lib.gemm)(
                g.m,
                g.n,
                g.k,
                g.a as *const c_void,
                g.lda,
                g.b as *const c_void,
                g.ldb,
                g.c as *mut c_void,
                g.ldc,
                code(g.ab_type),
                code(g.c_type),
            )
        };
        Ok(())
    }

    /// After a launch or GEMM: `NPU_SERVING_CUDA_SYNC=1` synchronizes at once, as the real
    /// device does.
    fn after_launch(&self, d: &mut Device) -> Result<(), BackendError> {
        if self.sync_each && d.capture.recording.is_none() {
            self.run_queue(d, None)?;
        }
        Ok(())
    }
}

/// The staging ring's view of the emulated device (the device lock is held throughout).
struct EmuStage<'a> {
    gpu: &'a EmuGpu,
    dev: RefCell<&'a mut Device>,
}

impl StageDevice for EmuStage<'_> {
    fn buffer(&self, i: usize) -> *mut u8 {
        self.dev.borrow().stage[i].ptr
    }
    /// `cuEventSynchronize`: runs the stream up to the event's latest record.
    fn wait(&self, i: usize) -> Result<(), BackendError> {
        let mut d = self.dev.borrow_mut();
        d.event_wait_allowed(i)?;
        match d.recorded[i] {
            Some(serial) => self.gpu.run_queue(&mut d, Some(serial)),
            None => Ok(()),
        }
    }
    /// `cuMemcpyHtoDAsync` from staging buffer `i`, then `cuEventRecord` of event `i`.
    fn copy(&self, i: usize, dst: DevPtr, len: usize) -> Result<(), BackendError> {
        let mut d = self.dev.borrow_mut();
        d.mem
            .check(dst, len, "cuMemcpyHtoDAsync")
            .map_err(emu_err)?;
        d.submit(Work::HtoD {
            dst,
            buf: i,
            bytes: len,
        })?;
        if !d.event_recorded_in_capture(i) {
            let serial = d.enqueue(Work::Record);
            d.recorded[i] = Some(serial);
        }
        Ok(())
    }
}

/// The shared read path's view of the emulated device.
struct EmuRead<'a> {
    gpu: &'a EmuGpu,
    dev: &'a mut Device,
}

impl ReadDevice for EmuRead<'_> {
    fn reserve(&mut self, bytes: usize) -> Result<(), BackendError> {
        if self.dev.read_buf.bytes < bytes {
            self.dev.read_buf = Pinned::new(bytes);
        }
        Ok(())
    }
    fn buffer(&self) -> *const u8 {
        self.dev.read_buf.ptr
    }
    fn copy_to_host(&mut self, at: usize, src: DevPtr, bytes: usize) -> Result<(), BackendError> {
        self.dev
            .mem
            .check(src, bytes, "cuMemcpyDtoHAsync")
            .map_err(emu_err)?;
        if at + bytes > self.dev.read_buf.bytes {
            return Err(emu_err(format!(
                "cuMemcpyDtoHAsync: {bytes} bytes at {at} of a {}-byte pinned buffer",
                self.dev.read_buf.bytes
            )));
        }
        self.dev.submit(Work::DtoH { at, src, bytes })
    }
    /// `cuStreamSynchronize`.
    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.dev
            .forbidden_in_capture("cuStreamSynchronize (a read back)")?;
        if self.gpu.skip_read_sync.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.gpu.run_queue(self.dev, None)
    }
}

impl Gpu for EmuGpu {
    fn describe(&self) -> String {
        format!("CPU emulation of a CUDA device ({SM_COUNT} SMs emulated; not a GPU)")
    }

    fn sm_count(&self) -> u32 {
        SM_COUNT
    }

    fn int8_mma(&self) -> bool {
        true // emulated with warp shuffles, in the fragment layout the PTX ISA gives
    }

    fn max_dynamic_smem(&self) -> u32 {
        MAX_SMEM
    }

    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        self.fault.check()?;
        Ok(MemInfo {
            free: memory::EMULATED_DEVICE_BYTES - self.dev().mem.used(),
            total: memory::EMULATED_DEVICE_BYTES,
        })
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, BackendError> {
        self.fault.check()?;
        // A fresh mapping reads as zeros: what the driver's cuMemsetD8Async leaves, and nothing
        // can reach the memory before the stream has passed that memset.
        let mut d = self.dev();
        d.forbidden_in_capture("cuMemAllocAsync")?;
        d.mem.alloc(bytes).map_err(|_| BackendError::OutOfMemory {
            backend: "cuda",
            what: "emulated device memory".into(),
            bytes,
        })
    }

    fn free(&self, ptr: DevPtr, _bytes: usize) {
        let mut d = self.dev();
        if d.defer_free(ptr) {
            return;
        }
        match d.mem.release(ptr) {
            Ok(()) => {
                d.enqueue(Work::Free(ptr));
                d.freed(ptr);
            }
            Err(e) => d.bad_frees.push(e),
        }
    }

    fn htod(&self, dst: DevPtr, src: &[u8]) -> Result<(), BackendError> {
        if src.is_empty() {
            return Ok(());
        }
        self.fault.check()?;
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let mut d = self.dev();
        d.mem
            .check(dst, src.len(), "cuMemcpyHtoDAsync")
            .map_err(emu_err)?;
        let stage = EmuStage {
            gpu: self,
            dev: RefCell::new(&mut *d),
        };
        ring.htod(&stage, dst, src)
    }

    fn dtod(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), BackendError> {
        if bytes == 0 {
            return Ok(());
        }
        self.fault.check()?;
        let mut d = self.dev();
        d.mem
            .check(dst, bytes, "cuMemcpyDtoDAsync")
            .map_err(emu_err)?;
        d.mem
            .check(src, bytes, "cuMemcpyDtoDAsync")
            .map_err(emu_err)?;
        d.submit(Work::DtoD { dst, src, bytes })
    }

    fn read(&self, regions: &[(DevPtr, usize)], out: &mut Vec<u8>) -> Result<(), BackendError> {
        self.fault.check()?;
        {
            let mut d = self.dev();
            let mut dev = EmuRead {
                gpu: self,
                dev: &mut d,
            };
            staging::read(&mut dev, regions, staging::READ_CAP, out)?;
        }
        // Every staged upload completed with the stream (as the real device's read says).
        if !self.skip_read_sync.load(Ordering::Relaxed) {
            self.ring
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .drained();
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        self.fault.check()?;
        let mut d = self.dev();
        d.forbidden_in_capture("cuStreamSynchronize")?;
        self.run_queue(&mut d, None)?;
        match d.bad_frees.first() {
            Some(e) => Err(emu_err(e.clone())),
            None => Ok(()),
        }
    }

    fn launch(&self, kernel: usize, dims: LaunchDims, args: &mut Args) -> Result<(), BackendError> {
        self.fault.check()?;
        let k = &self.lib.kernels[kernel];
        let kinds: Vec<(ArgKind, u64)> = args.values().collect();
        let sizes: Vec<u32> = kinds.iter().map(|(k, _)| k.size() as u32).collect();
        if sizes != k.param_sizes {
            return Err(emu_err(format!(
                "{}: parameters of sizes {sizes:?} for a kernel taking {:?}",
                k.name, k.param_sizes
            )));
        }
        if dims.smem > MAX_SMEM {
            return Err(emu_err(format!(
                "{}: {} bytes of dynamic shared memory (at most {MAX_SMEM})",
                k.name, dims.smem
            )));
        }
        // cuLaunchKernel refuses a bad configuration before anything is queued (not sticky).
        let (g, b) = (dims.grid, dims.block);
        let threads = b[0] as u64 * b[1] as u64 * b[2] as u64;
        if threads == 0
            || threads > 1024
            || b[2] > 64
            || g.contains(&0)
            || g[0] > i32::MAX as u32
            || g[1] > 65535
            || g[2] > 65535
        {
            return Err(emu_err(format!(
                "{}: invalid launch configuration: grid {g:?} block {b:?} \
                 (CUDA_ERROR_INVALID_VALUE)",
                k.name
            )));
        }
        let mut d = self.dev();
        let mut touched = Vec::new();
        for (i, &(kind, v)) in kinds.iter().enumerate() {
            if kind == ArgKind::Ptr && v != 0 {
                match d.mem.find(v, 0) {
                    Some((start, _)) => touched.push(start),
                    None if d.mem.released(v) => {
                        return Err(emu_err(format!(
                            "{}: pointer parameter {i} ({v:#x}) points into memory already \
                             freed (cuMemFreeAsync queued before this launch: use after free)",
                            k.name
                        )))
                    }
                    None => {
                        return Err(emu_err(format!(
                            "{}: pointer parameter {i} ({v:#x}) is not device memory",
                            k.name
                        )))
                    }
                }
            }
        }
        self.fault.launched(Launch::Kernel {
            name: kernels::kernel_name(kernel),
            grid: dims.grid,
            block: dims.block,
            smem: dims.smem,
        });
        d.submit(Work::Kernel {
            kernel,
            dims,
            params: kinds.iter().map(|&(_, v)| v).collect(),
            touched,
        })?;
        self.launches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(kernel);
        self.after_launch(&mut d)
    }

    fn gemm(&self, g: &Gemm) -> Result<(), BackendError> {
        self.fault.check()?;
        let supported = matches!(
            (g.ab_type, g.c_type),
            (DType::F16, DType::F16 | DType::F32)
                | (DType::BF16, DType::BF16 | DType::F32)
                | (DType::F32, DType::F32)
        );
        if !supported {
            return Err(emu_err(format!(
                "cublasGemmEx: {:?} x {:?} (CUBLAS_STATUS_NOT_SUPPORTED)",
                g.ab_type, g.c_type
            )));
        }
        if g.lda < g.k.max(1) || g.ldb < g.k.max(1) || g.ldc < g.m.max(1) {
            return Err(emu_err(format!(
                "cublasGemmEx: lda {} ldb {} ldc {} for m {} n {} k {} (CUBLAS_STATUS_INVALID_VALUE)",
                g.lda, g.ldb, g.ldc, g.m, g.n, g.k
            )));
        }
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let mut d = self.dev();
        for (p, n, what) in Self::gemm_spans(g) {
            d.mem.check(p, n, what).map_err(emu_err)?;
        }
        self.fault.launched(Launch::Gemm {
            m: g.m,
            n: g.n,
            k: g.k,
        });
        d.submit(Work::Gemm(*g))?;
        self.after_launch(&mut d)
    }

    fn graphs_supported(&self) -> bool {
        true
    }
    fn capture_begin(&self) -> Result<(), BackendError> {
        self.fault.check()?;
        self.dev().capture_begin()
    }
    fn capture_end(&self) -> Result<GraphId, BackendError> {
        let id = self.dev().capture_end(false)?;
        Ok(id.expect("a graph unless aborted"))
    }
    fn capture_abort(&self) {
        let _ = self.dev().capture_end(true);
    }
    fn capturing(&self) -> bool {
        self.dev().capture.recording.is_some()
    }
    fn replay(&self, g: GraphId) -> Result<(), BackendError> {
        self.fault.check()?;
        let mut d = self.dev();
        d.replay(g)?;
        self.after_launch(&mut d)
    }
    fn graph_stale(&self, g: GraphId) -> bool {
        self.dev().graph_stale(g)
    }
    fn destroy_graph(&self, g: GraphId) {
        self.dev().destroy_graph(g);
    }
}

impl EmuGpu {
    /// The kernels queued so far, by name, in order.
    pub fn launched(&self) -> Vec<String> {
        let l = self.launches.lock().unwrap_or_else(|e| e.into_inner());
        l.iter()
            .map(|&k| self.lib.kernels[k].name.clone())
            .collect()
    }

    /// Forgets the launches so far.
    pub fn clear_launched(&self) {
        self.launches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Allocations the program holds (allocated and not freed; a free counts when called, not
    /// when the stream reaches it).
    pub fn live_allocations(&self) -> usize {
        self.dev().mem.live()
    }

    /// Units of work queued on the stream and not run yet.
    pub fn queued(&self) -> usize {
        self.dev().queue.len()
    }

    /// **Deliberately wrong**, for the faulty-backend test only: with `skip` set, reads no longer
    /// synchronize the stream after queueing their device→host copies (as a read path that forgot
    /// `cuStreamSynchronize`), so they return what the pinned buffer held before.
    pub fn skip_read_synchronization(&self, skip: bool) {
        self.skip_read_sync.store(skip, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;

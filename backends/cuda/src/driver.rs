//! The real device: a CUDA context and stream through cudarc's driver API (loaded at run time,
//! versioned entry points of CUDA 12.4 that CUDA 12 and 13 drivers export), the kernel program
//! compiled by NVRTC (13 or 12, see `nvrtc`) and loaded as a module, cuBLAS (13 or 12, see
//! `cublas`) for the GEMM, pinned staging buffers for host→device copies and a capped pinned
//! buffer that reads land in (`staging`).
//!
//! Every call first makes the context current on the calling thread (the backend may move between
//! threads). Raw driver calls go through cudarc's `result`/`sys` layers; each is checked and
//! turned into a `BackendError::Device` naming the call. An error that leaves the context
//! unusable is remembered and answers every later call (`fault`). Stream capture into CUDA
//! graphs and their replay: `graph`.

mod graph;

use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaStream, DriverError};
use npu_backend::{BackendError, DType, MemInfo};

use crate::cublas::{self, CublasApi};
use crate::fault::{self, Fault, Launch};
use crate::gpu::{Args, DevPtr, Gemm, Gpu, GraphId, LaunchDims};
use crate::kernels;
use crate::nvrtc::{self, Image, NvrtcApi};
use crate::staging::{self, ReadDevice, StageDevice, Staging, STAGE_BUFFERS, STAGE_BYTES};

const NAME: &str = "cuda";

fn dev_err(call: &str, e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device {
        backend: NAME,
        message: format!("{call} failed: {e:?}"),
    }
}

/// Pinned host memory.
struct Pinned {
    ptr: *mut u8,
    bytes: usize,
}

impl Pinned {
    const fn empty() -> Self {
        Self {
            ptr: std::ptr::null_mut(),
            bytes: 0,
        }
    }
}

/// The host→device staging ring: its pinned buffers and the event after each one's last copy.
struct Stage {
    ring: Staging,
    bufs: [*mut u8; STAGE_BUFFERS],
    events: [drv_sys::CUevent; STAGE_BUFFERS],
}

/// The versions the device runs with, for its description and error messages.
#[derive(Debug, Clone, Copy)]
pub struct Versions {
    pub driver: (u32, u32),
    pub nvrtc: (i32, i32),
}

/// The device, its stream, the loaded kernels and the cuBLAS handle.
pub struct CudaGpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: drv_sys::CUmodule,
    functions: Vec<drv_sys::CUfunction>,
    blas: Arc<CublasApi>,
    handle: cublas::Handle,
    stage: Mutex<Stage>,
    read_buf: Mutex<Pinned>,
    fault: Fault,
    sync_each: bool,
    description: String,
    sm_count: u32,
    max_smem: u32,
    int8_mma: bool,
    /// CUDA graphs (`graph`).
    graphs: Mutex<graph::Graphs>,
}

// SAFETY: the raw handles (module, functions, cuBLAS handle, pinned pointers, events) are owned
// by this value and used only through its methods; the driver API and cuBLAS are thread-safe for
// these uses once the context is current, which every method ensures; the pinned buffers are
// behind mutexes.
unsafe impl Send for CudaGpu {}
// SAFETY: as above.
unsafe impl Sync for CudaGpu {}

/// cuModuleLoadDataEx with an error-log buffer: the JIT's log names what it refused in a PTX
/// image.
fn load_module(image: &Image, v: &Versions) -> Result<drv_sys::CUmodule, String> {
    const LOG: usize = 16 << 10;
    let mut log = vec![0u8; LOG];
    let mut opts = [
        drv_sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        drv_sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    let mut vals: [*mut c_void; 2] = [log.as_mut_ptr() as *mut c_void, LOG as *mut c_void];
    let mut module: drv_sys::CUmodule = std::ptr::null_mut();
    // SAFETY: the image is a complete CUBIN, or PTX text ending in NUL, and outlives the call;
    // the option arrays hold two entries whose values are a writable buffer and its size.
    let r = unsafe {
        drv_sys::cuModuleLoadDataEx(
            &mut module,
            image.bytes.as_ptr() as *const c_void,
            2,
            opts.as_mut_ptr(),
            vals.as_mut_ptr(),
        )
    };
    if r == drv_sys::CUresult::CUDA_SUCCESS {
        return Ok(module);
    }
    let end = log.iter().position(|&b| b == 0).unwrap_or(0);
    let jit_log = String::from_utf8_lossy(&log[..end]).trim().to_string();
    let mut msg = format!(
        "cuModuleLoadDataEx ({} from NVRTC {}.{}, driver for CUDA {}.{}) failed: {r:?}",
        image.target.tag(),
        v.nvrtc.0,
        v.nvrtc.1,
        v.driver.0,
        v.driver.1
    );
    if r == drv_sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION
        || (v.nvrtc.0 as u32, v.nvrtc.1 as u32) > v.driver
    {
        msg.push_str(&format!(
            " (NVRTC {}.{} is newer than this driver's CUDA {}.{}: use the NVRTC of CUDA {}.{} or \
             older, or update the driver)",
            v.nvrtc.0, v.nvrtc.1, v.driver.0, v.driver.1, v.driver.0, v.driver.1
        ));
    }
    if !jit_log.is_empty() {
        msg.push_str(&format!("; JIT log: {jit_log}"));
    }
    Err(msg)
}

impl CudaGpu {
    /// Opens device `ordinal`: context, stream, kernels (compiled by `nvrtc` or from the cache),
    /// cuBLAS. The driver library must have been checked (`libs::require_driver`) and the
    /// libraries loaded before this is called.
    pub fn open(
        ordinal: usize,
        kernel_cache: Option<PathBuf>,
        nvrtc: &NvrtcApi,
        blas: Arc<CublasApi>,
        driver: (u32, u32),
    ) -> Result<Self, BackendError> {
        let versions = Versions {
            driver,
            nvrtc: nvrtc.version,
        };
        let count = CudaContext::device_count().map_err(|e| BackendError::Device {
            backend: NAME,
            message: format!(
                "the NVIDIA driver loads but reports no usable CUDA device (cuInit / \
                 cuDeviceGetCount: {e:?}); check nvidia-smi and CUDA_VISIBLE_DEVICES"
            ),
        })?;
        if ordinal >= count.max(0) as usize {
            return Err(BackendError::Device {
                backend: NAME,
                message: format!(
                    "no CUDA device {ordinal}: this machine has {count} (ids 0..{count})"
                ),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| dev_err("cuCtx (primary context)", e))?;
        // SAFETY: the backend tracks stream order itself (one stream) and never uses cudarc's
        // CudaSlice, whose cross-stream events this would otherwise record.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| dev_err("cuStreamCreate", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| dev_err("cuDeviceGetAttribute (compute capability)", e))?;
        let attr = |a| {
            ctx.attribute(a)
                .map_err(|e| dev_err("cuDeviceGetAttribute", e))
        };
        let sm_count =
            attr(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_smem = attr(
            drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as u32;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let total = ctx.total_mem().unwrap_or(0);

        let target =
            nvrtc
                .target_for(major as u32, minor as u32)
                .map_err(|m| BackendError::Device {
                    backend: NAME,
                    message: m,
                })?;
        ctx.bind_to_thread()
            .map_err(|e| dev_err("cuCtxSetCurrent", e))?;
        let source = kernels::program_source();
        let key = nvrtc::cache_key(&source, target, nvrtc.version);
        let compile = || nvrtc.compile_source(&source, target);
        let load = |img: &Image| load_module(img, &versions);
        let module = nvrtc::load_with_retry(&key, target, kernel_cache.as_deref(), &compile, &load)
            .map_err(|m| BackendError::Device {
                backend: NAME,
                message: m,
            })?;
        // Everything fallible after the module load releases what it made on failure.
        let mut made = Made {
            dynamic_smem: max_smem,
            ..Made::default()
        };
        let setup = |made: &mut Made| -> Result<(), BackendError> {
            for name in kernels::kernel_names() {
                let c = CString::new(name.clone()).expect("kernel names have no NUL");
                // SAFETY: `module` was loaded above and stays loaded while it is used.
                let f = unsafe { drv::module::get_function(module, c) }
                    .map_err(|e| dev_err(&format!("cuModuleGetFunction({name})"), e))?;
                made.functions.push(f);
            }
            // A block's static and dynamic shared memory together may reach the device's
            // opt-in limit, so each kernel may ask for that limit less its own static bytes
            // (cuFuncSetAttribute refuses more with CUDA_ERROR_INVALID_VALUE); the launches plan
            // against the smallest of these.
            for k in kernels::large_smem_kernels() {
                let f = made.functions[k];
                // SAFETY: a function of the loaded module; a read-only query.
                let fixed = unsafe {
                    drv::function::get_function_attribute(
                        f,
                        drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                    )
                }
                .map_err(|e| dev_err("cuFuncGetAttribute (static shared memory)", e))?
                .max(0) as u32;
                let room = max_smem.saturating_sub(fixed);
                made.dynamic_smem = made.dynamic_smem.min(room);
                // SAFETY: a function of the loaded module; the value is the device's opt-in
                // limit less the function's static shared memory.
                unsafe {
                    drv::function::set_function_attribute(
                        f,
                        drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        room as i32,
                    )
                }
                .map_err(|e| {
                    dev_err(
                        &format!(
                            "cuFuncSetAttribute ({}: {room} B of dynamic shared memory, {fixed} \
                             B static)",
                            kernels::kernel_names()[k]
                        ),
                        e,
                    )
                })?;
            }
            let handle = blas.create().map_err(|m| dev_err("cublasCreate", m))?;
            made.handle = Some(handle);
            // SAFETY: a live handle and a live stream of the current context.
            unsafe { blas.set_stream(handle, stream.cu_stream() as *mut c_void) }
                .map_err(|m| dev_err("cublasSetStream", m))?;
            for _ in 0..STAGE_BUFFERS {
                // SAFETY: a fresh pinned allocation, freed on failure or by Drop.
                let p = unsafe { drv::malloc_host(STAGE_BYTES, 0) }
                    .map_err(|e| dev_err("cuMemHostAlloc (staging)", e))?;
                made.pinned.push(p as *mut u8);
                let ev = drv::event::create(drv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| dev_err("cuEventCreate", e))?;
                made.events.push(ev);
            }
            Ok(())
        };
        if let Err(e) = setup(&mut made) {
            // SAFETY: nothing else refers to what was made.
            unsafe {
                for &ev in &made.events {
                    let _ = drv::event::destroy(ev);
                }
                for &p in &made.pinned {
                    let _ = drv::free_host(p as *mut c_void);
                }
                if let Some(h) = made.handle {
                    let _ = blas.destroy(h);
                }
                let _ = drv::module::unload(module);
            }
            return Err(e);
        }
        let description = format!(
            "{name} (device {ordinal}, sm_{major}{minor}, {} SMs, {:.1} GiB; driver for CUDA \
             {}.{}, NVRTC {}.{}, cuBLAS {}.{}.{}; kernels as {})",
            sm_count,
            total as f64 / (1u64 << 30) as f64,
            driver.0,
            driver.1,
            nvrtc.version.0,
            nvrtc.version.1,
            blas.version.0,
            blas.version.1,
            blas.version.2,
            match target {
                nvrtc::Target::Cubin(..) => "CUBIN".to_string(),
                nvrtc::Target::Ptx(a, b) => format!("PTX for compute_{a}{b}"),
            }
        );
        let sync_each = fault::sync_each_launch();
        if sync_each {
            tracing::warn!(
                "cuda: {}=1: synchronizing after every launch (slow)",
                fault::ENV_SYNC
            );
        }
        let gpu = Self {
            ctx,
            stream,
            module,
            functions: made.functions,
            blas,
            handle: made.handle.expect("made above"),
            stage: Mutex::new(Stage {
                ring: Staging::new(STAGE_BYTES),
                bufs: [made.pinned[0], made.pinned[1]],
                events: [made.events[0], made.events[1]],
            }),
            read_buf: Mutex::new(Pinned::empty()),
            fault: Fault::default(),
            sync_each,
            description,
            sm_count,
            max_smem: made.dynamic_smem,
            int8_mma: major >= 8,
            graphs: Mutex::new(graph::Graphs::new(graph::entry_points_present())),
        };
        gpu.warm_up()?;
        Ok(gpu)
    }

    /// Calls every driver and cuBLAS entry point the backend uses once, on a tiny problem:
    /// cudarc resolves each symbol on first use and panics if the driver lacks it, so this
    /// happens here, inside the caller's panic guard, and the GEMM result checks cuBLAS works.
    fn warm_up(&self) -> Result<(), BackendError> {
        let p = self.alloc(256)?;
        let ones: Vec<u8> = [1.0f32, 2.0, 0.0, 0.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let run = || -> Result<Vec<u8>, BackendError> {
            self.htod(p, &ones)?;
            self.dtod(p + 16, p, 16)?;
            // 1x1x1: c = a * b = 1 * 2.
            self.gemm(&Gemm {
                m: 1,
                n: 1,
                k: 1,
                a: p,
                lda: 1,
                b: p + 4,
                ldb: 1,
                c: p + 8,
                ldc: 1,
                ab_type: DType::F32,
                c_type: DType::F32,
            })?;
            self.mem_info()?;
            let mut out = Vec::new();
            self.read(&[(p + 8, 4), (p + 16, 4)], &mut out)?;
            Ok(out)
        };
        let out = run();
        self.free(p, 256);
        self.synchronize()?;
        let out = out?;
        let c = f32::from_le_bytes([out[0], out[1], out[2], out[3]]);
        let copied = f32::from_le_bytes([out[4], out[5], out[6], out[7]]);
        if c != 2.0 || copied != 1.0 {
            return Err(BackendError::Device {
                backend: NAME,
                message: format!(
                    "device self-test failed: GEMM gave {c} (want 2), copy {copied} (want 1)"
                ),
            });
        }
        Ok(())
    }

    /// Checks for an earlier fatal fault, then makes the context current.
    fn bind(&self) -> Result<(), BackendError> {
        self.fault.check()?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.err("cuCtxSetCurrent", e))
    }

    /// The error for a failed driver call; a context-killing one is remembered.
    fn err(&self, call: &str, e: DriverError) -> BackendError {
        if fault::is_sticky(e.0 as u32) {
            self.fault.fatal(call, &format!("{:?}", e.0))
        } else {
            dev_err(call, e.0)
        }
    }

    fn cu_stream(&self) -> drv_sys::CUstream {
        self.stream.cu_stream()
    }

    fn sync_stream(&self, call: &str) -> Result<(), BackendError> {
        // SAFETY: our own stream.
        unsafe { drv::stream::synchronize(self.cu_stream()) }.map_err(|e| self.err(call, e))
    }
}

/// What `open` made after the module load, released on failure.
#[derive(Default)]
struct Made {
    functions: Vec<drv_sys::CUfunction>,
    /// The dynamic shared memory every large-shared-memory kernel may take.
    dynamic_smem: u32,
    handle: Option<cublas::Handle>,
    pinned: Vec<*mut u8>,
    events: Vec<drv_sys::CUevent>,
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: after the stream drained, nothing uses the pinned buffers, the events, the
        // cuBLAS handle or the module; each is released once.
        unsafe {
            let _ = drv::stream::synchronize(self.cu_stream());
            let st = self.stage.get_mut().unwrap_or_else(|e| e.into_inner());
            for i in 0..STAGE_BUFFERS {
                let _ = drv::event::destroy(st.events[i]);
                let _ = drv::free_host(st.bufs[i] as *mut c_void);
            }
            let p = self.read_buf.get_mut().unwrap_or_else(|e| e.into_inner());
            if !p.ptr.is_null() {
                let _ = drv::free_host(p.ptr as *mut c_void);
            }
            let _ = self.blas.destroy(self.handle);
        }
        self.graphs_release();
        // SAFETY: nothing of the module runs any more (the stream drained).
        unsafe {
            let _ = drv::module::unload(self.module);
        }
    }
}

/// The staging ring's view of the device.
struct RingDevice<'a> {
    gpu: &'a CudaGpu,
    bufs: [*mut u8; STAGE_BUFFERS],
    events: [drv_sys::CUevent; STAGE_BUFFERS],
}

impl StageDevice for RingDevice<'_> {
    fn buffer(&self, i: usize) -> *mut u8 {
        self.bufs[i]
    }
    fn wait(&self, i: usize) -> Result<(), BackendError> {
        // SAFETY: an event of ours, recorded on our stream.
        unsafe { drv::event::synchronize(self.events[i]) }
            .map_err(|e| self.gpu.err("cuEventSynchronize (staging)", e))
    }
    fn copy(&self, i: usize, dst: DevPtr, len: usize) -> Result<(), BackendError> {
        // SAFETY: the source is pinned buffer `i` holding `len` valid bytes, not written again
        // before the event recorded after this copy completes; the caller names a device range
        // of `len` bytes inside one allocation.
        unsafe {
            drv_sys::cuMemcpyHtoDAsync_v2(
                dst,
                self.bufs[i] as *const c_void,
                len,
                self.gpu.cu_stream(),
            )
            .result()
            .map_err(|e| self.gpu.err("cuMemcpyHtoDAsync", e))?;
            drv::event::record(self.events[i], self.gpu.cu_stream())
                .map_err(|e| self.gpu.err("cuEventRecord", e))
        }
    }
}

/// The shared read path's view of the device: the capped pinned buffer reads land in, filled by
/// `cuMemcpyDtoHAsync` on our stream.
struct ReadPinned<'a> {
    gpu: &'a CudaGpu,
    pinned: std::sync::MutexGuard<'a, Pinned>,
}

impl ReadDevice for ReadPinned<'_> {
    fn reserve(&mut self, bytes: usize) -> Result<(), BackendError> {
        if self.pinned.bytes >= bytes {
            return Ok(());
        }
        // SAFETY: the old buffer is idle (each batch is synchronized before the next reserves)
        // and replaced by a fresh one of `bytes` bytes (at most READ_CAP).
        unsafe {
            if !self.pinned.ptr.is_null() {
                drv::free_host(self.pinned.ptr as *mut c_void)
                    .map_err(|e| self.gpu.err("cuMemFreeHost", e))?;
                *self.pinned = Pinned::empty();
            }
            let p = drv::malloc_host(bytes, 0).map_err(|e| self.gpu.err("cuMemHostAlloc", e))?;
            *self.pinned = Pinned {
                ptr: p as *mut u8,
                bytes,
            };
        }
        Ok(())
    }

    fn buffer(&self) -> *const u8 {
        self.pinned.ptr
    }

    fn copy_to_host(&mut self, at: usize, src: DevPtr, bytes: usize) -> Result<(), BackendError> {
        if at + bytes > self.pinned.bytes {
            return Err(dev_err(
                "cuMemcpyDtoHAsync",
                format!(
                    "{bytes} bytes at {at} of a {}-byte buffer",
                    self.pinned.bytes
                ),
            ));
        }
        // SAFETY: [at, at + bytes) lies inside the pinned buffer (checked) that no other read
        // uses (the mutex is held); the device range is the caller's; the shared read path
        // synchronizes the stream before the host reads the buffer.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(self.pinned.ptr.add(at), bytes);
            drv::memcpy_dtoh_async(dst, src, self.gpu.cu_stream())
                .map_err(|e| self.gpu.err("cuMemcpyDtoHAsync", e))
        }
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.gpu.sync_stream("cuStreamSynchronize")
    }
}

impl Gpu for CudaGpu {
    fn describe(&self) -> String {
        self.description.clone()
    }

    fn raw_stream(&self) -> Result<Option<*mut c_void>, BackendError> {
        self.bind()?;
        Ok(Some(self.cu_stream() as *mut c_void))
    }

    fn sm_count(&self) -> u32 {
        self.sm_count
    }

    fn int8_mma(&self) -> bool {
        self.int8_mma
    }

    fn max_dynamic_smem(&self) -> u32 {
        self.max_smem
    }

    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        self.bind()?;
        let (free, total) = drv::mem_get_info().map_err(|e| self.err("cuMemGetInfo", e))?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, BackendError> {
        self.graphs().refuse("cuMemAllocAsync")?;
        self.alloc_raw(bytes)
    }

    fn free(&self, ptr: DevPtr, bytes: usize) {
        {
            let mut g = self.graphs();
            if g.defer_free(ptr, bytes) {
                return;
            }
            g.freed(ptr, bytes);
        }
        self.free_raw(ptr)
    }

    fn htod(&self, dst: DevPtr, src: &[u8]) -> Result<(), BackendError> {
        if src.is_empty() {
            return Ok(());
        }
        // A captured copy from the staging ring would read its pinned buffer at each replay.
        self.graphs()
            .refuse("a host→device copy (staged through pinned memory)")?;
        self.bind()?;
        let mut st = self.stage.lock().unwrap_or_else(|e| e.into_inner());
        let dev = RingDevice {
            gpu: self,
            bufs: st.bufs,
            events: st.events,
        };
        st.ring.htod(&dev, dst, src)
    }

    fn dtod(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), BackendError> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        self.graphs().name([dst, src]);
        // SAFETY: the caller names two device ranges of `bytes` inside live allocations.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.cu_stream()) }
            .map_err(|e| self.err("cuMemcpyDtoDAsync", e))
    }

    fn read(&self, regions: &[(DevPtr, usize)], out: &mut Vec<u8>) -> Result<(), BackendError> {
        self.graphs().refuse("a read back (cuStreamSynchronize)")?;
        self.bind()?;
        let pinned = self.read_buf.lock().unwrap_or_else(|e| e.into_inner());
        let mut dev = ReadPinned { gpu: self, pinned };
        staging::read(&mut dev, regions, staging::READ_CAP, out)?;
        // Every staged upload completed with the stream.
        self.stage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ring
            .drained();
        Ok(())
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        self.graphs().refuse("cuStreamSynchronize")?;
        self.bind()?;
        self.sync_stream("cuStreamSynchronize")
    }

    fn launch(&self, kernel: usize, dims: LaunchDims, args: &mut Args) -> Result<(), BackendError> {
        self.bind()?;
        let f = self.functions[kernel];
        let name = kernels::kernel_name(kernel);
        self.fault.launched(Launch::Kernel {
            name,
            grid: dims.grid,
            block: dims.block,
            smem: dims.smem,
        });
        let capturing = {
            let mut g = self.graphs();
            g.name(
                args.values()
                    .filter(|(k, _)| *k == crate::gpu::ArgKind::Ptr)
                    .map(|(_, v)| v),
            );
            g.capturing()
        };
        let mut params = args.params();
        // SAFETY: `f` is a kernel of the loaded module; the backend packs exactly the parameters
        // its signature declares (checked against the CPU reference on the emulation), with
        // device pointers to live allocations and ranges it has checked.
        unsafe {
            drv::launch_kernel(
                f,
                (dims.grid[0], dims.grid[1], dims.grid[2]),
                (dims.block[0], dims.block[1], dims.block[2]),
                dims.smem,
                self.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| self.err(&format!("cuLaunchKernel({name})"), e))?;
        if self.sync_each && !capturing {
            self.sync_stream(&format!(
                "{name} (grid {:?}, block {:?}, NPU_SERVING_CUDA_SYNC=1)",
                dims.grid, dims.block
            ))?;
        }
        Ok(())
    }

    fn gemm(&self, g: &Gemm) -> Result<(), BackendError> {
        self.bind()?;
        let ty = |d: DType| match d {
            DType::F16 => Ok(cublas::R_16F),
            DType::BF16 => Ok(cublas::R_16BF),
            DType::F32 => Ok(cublas::R_32F),
            DType::I32 => Err(BackendError::Unsupported {
                backend: NAME,
                what: "an i32 GEMM".into(),
            }),
        };
        let (ab, c) = (ty(g.ab_type)?, ty(g.c_type)?);
        let int = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| BackendError::Unsupported {
                backend: NAME,
                what: format!("a GEMM {what} of {v} (over i32)"),
            })
        };
        let capturing = {
            let mut gr = self.graphs();
            if gr.capturing() && !gr.blas_ready() {
                gr.refuse("a cuBLAS GEMM without a workspace of its own (cublasSetWorkspace)")?;
            }
            gr.name([g.a, g.b, g.c]);
            gr.capturing()
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.fault.launched(Launch::Gemm {
            m: g.m,
            n: g.n,
            k: g.k,
        });
        // SAFETY: the handle is bound to our stream; A, B and C are device ranges the caller
        // checked against the sizes given; alpha and beta are host f32 values (the handle's
        // default pointer mode) matching the f32 compute type.
        unsafe {
            self.blas.gemm_ex(
                self.handle,
                (cublas::OP_T, cublas::OP_N),
                (int(g.m, "m")?, int(g.n, "n")?, int(g.k, "k")?),
                &alpha as *const f32 as *const c_void,
                (g.a as *const c_void, ab, int(g.lda, "lda")?),
                (g.b as *const c_void, ab, int(g.ldb, "ldb")?),
                &beta as *const f32 as *const c_void,
                (g.c as *mut c_void, c, int(g.ldc, "ldc")?),
            )
        }
        .map_err(|m| dev_err("cublasGemmEx", m))?;
        if self.sync_each && !capturing {
            self.sync_stream(&format!(
                "cublasGemmEx m {} n {} k {} (NPU_SERVING_CUDA_SYNC=1)",
                g.m, g.n, g.k
            ))?;
        }
        Ok(())
    }

    fn graphs_supported(&self) -> bool {
        self.graphs().available
    }
    fn capture_begin(&self) -> Result<(), BackendError> {
        self.graph_capture_begin()
    }
    fn capture_end(&self) -> Result<GraphId, BackendError> {
        Ok(self
            .graph_capture_end(false)?
            .expect("a graph unless aborted"))
    }
    fn capture_abort(&self) {
        if let Err(e) = self.graph_capture_end(true) {
            tracing::warn!("cuda: ending an abandoned capture: {e}");
        }
    }
    fn capturing(&self) -> bool {
        self.graphs().capturing()
    }
    fn replay(&self, g: GraphId) -> Result<(), BackendError> {
        self.graph_replay(g)
    }
    fn graph_stale(&self, g: GraphId) -> bool {
        self.graph_is_stale(g)
    }
    fn destroy_graph(&self, g: GraphId) {
        self.graph_destroy(g)
    }
}

impl CudaGpu {
    fn alloc_raw(&self, bytes: usize) -> Result<DevPtr, BackendError> {
        self.bind()?;
        let oom = |_| BackendError::OutOfMemory {
            backend: NAME,
            what: "device memory".into(),
            bytes,
        };
        // SAFETY: stream-ordered allocation and clearing of fresh memory on our stream.
        unsafe {
            let ptr = if self.ctx.has_async_alloc() {
                drv::malloc_async(self.cu_stream(), bytes).map_err(oom)?
            } else {
                drv::malloc_sync(bytes).map_err(oom)?
            };
            drv::memset_d8_async(ptr, 0, bytes, self.cu_stream())
                .map_err(|e| self.err("cuMemsetD8Async", e))?;
            Ok(ptr)
        }
    }

    fn free_raw(&self, ptr: DevPtr) {
        // After a fault the context is gone: nothing to free into, nothing to report again.
        if self.bind().is_err() {
            return;
        }
        // SAFETY: `ptr` came from `alloc` and is freed once (its owner is being dropped); a
        // stream-ordered free waits for queued work that uses it.
        let r = unsafe {
            if self.ctx.has_async_alloc() {
                drv::free_async(ptr, self.cu_stream())
            } else {
                drv::stream::synchronize(self.cu_stream()).and_then(|_| drv::free_sync(ptr))
            }
        };
        if let Err(e) = r {
            let e = self.err("cuMemFree", e);
            tracing::warn!("cuda: freeing device memory failed: {e}");
        }
    }
}

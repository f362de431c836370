//! The real device: a CUDA context and stream through cudarc's driver API (loaded at run time),
//! the kernel program compiled by NVRTC and loaded as a module, cuBLAS for the GEMM, and a
//! pinned host buffer that reads land in.
//!
//! Every call first makes the context current on the calling thread (the backend may move between
//! threads). Raw driver calls go through cudarc's `result` layer; each is checked and turned into
//! a `BackendError::Device` naming the call.

use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::cublas::{result as cublas, sys as cublas_sys};
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaStream};
use npu_backend::{BackendError, DType, MemInfo};

use crate::gpu::{Args, DevPtr, Gemm, Gpu, LaunchDims};
use crate::kernels;
use crate::nvrtc;

const NAME: &str = "cuda";

fn dev_err(call: &str, e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device {
        backend: NAME,
        message: format!("{call} failed: {e:?}"),
    }
}

/// Pinned host memory that device→host reads land in.
struct Pinned {
    ptr: *mut u8,
    bytes: usize,
}

/// The device, its stream, the loaded kernels and the cuBLAS handle.
pub struct CudaGpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: drv_sys::CUmodule,
    functions: Vec<drv_sys::CUfunction>,
    cublas: cublas_sys::cublasHandle_t,
    pinned: Mutex<Pinned>,
    description: String,
    sm_count: u32,
    max_smem: u32,
}

// SAFETY: the raw handles (module, functions, cuBLAS handle, pinned pointer) are owned by this
// value and used only through its methods; the driver API and cuBLAS are thread-safe for these
// uses once the context is current, which every method ensures; the pinned buffer is behind a
// mutex.
unsafe impl Send for CudaGpu {}
// SAFETY: as above.
unsafe impl Sync for CudaGpu {}

impl CudaGpu {
    /// Opens device `ordinal`: context, stream, kernels (compiled or from the cache), cuBLAS.
    /// The libraries must have been checked (`libs::require`) before this is called.
    pub fn open(ordinal: usize, kernel_cache: Option<PathBuf>) -> Result<Self, BackendError> {
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
            nvrtc::target_for(major as u32, minor as u32).map_err(|m| BackendError::Device {
                backend: NAME,
                message: m,
            })?;
        let image = nvrtc::kernel_image(target, kernel_cache.as_deref()).map_err(|m| {
            BackendError::Device {
                backend: NAME,
                message: m,
            }
        })?;
        ctx.bind_to_thread()
            .map_err(|e| dev_err("cuCtxSetCurrent", e))?;
        // SAFETY: the image is a complete CUBIN, or PTX text ending in NUL, as cuModuleLoadData
        // requires; it outlives the call.
        let module = unsafe { drv::module::load_data(image.bytes.as_ptr() as *const c_void) }
            .map_err(|e| dev_err("cuModuleLoadData", e))?;
        // Everything fallible after the module load releases what it made on failure.
        let setup =
            || -> Result<(Vec<drv_sys::CUfunction>, cublas_sys::cublasHandle_t), BackendError> {
                let mut functions = Vec::new();
                for name in kernels::kernel_names() {
                    let c = CString::new(name.clone()).expect("kernel names have no NUL");
                    // SAFETY: `module` was loaded above and stays loaded while it is used.
                    let f = unsafe { drv::module::get_function(module, c) }
                        .map_err(|e| dev_err(&format!("cuModuleGetFunction({name})"), e))?;
                    functions.push(f);
                }
                for k in kernels::large_smem_kernels() {
                    // SAFETY: a function of the loaded module; the value is the device's opt-in
                    // limit.
                    unsafe {
                    drv::function::set_function_attribute(
                        functions[k],
                        drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        max_smem as i32,
                    )
                }
                .map_err(|e| dev_err("cuFuncSetAttribute", e))?;
                }
                let handle = cublas::create_handle().map_err(|e| dev_err("cublasCreate", e))?;
                // SAFETY: a live handle and a live stream of the current context.
                let bound = unsafe {
                    cublas::set_stream(handle, stream.cu_stream() as cublas_sys::cudaStream_t)
                };
                if let Err(e) = bound {
                    // SAFETY: the handle was created above and is not used again.
                    let _ = unsafe { cublas::destroy_handle(handle) };
                    return Err(dev_err("cublasSetStream", e));
                }
                Ok((functions, handle))
            };
        let (functions, handle) = match setup() {
            Ok(v) => v,
            Err(e) => {
                // SAFETY: nothing refers to the module any more.
                let _ = unsafe { drv::module::unload(module) };
                return Err(e);
            }
        };
        let description = format!(
            "{name} (device {ordinal}, sm_{major}{minor}, {} SMs, {:.1} GiB, kernels as {})",
            sm_count,
            total as f64 / (1u64 << 30) as f64,
            match target {
                nvrtc::Target::Cubin(..) => "CUBIN".to_string(),
                nvrtc::Target::Ptx(a, b) => format!("PTX for compute_{a}{b}"),
            }
        );
        let gpu = Self {
            ctx,
            stream,
            module,
            functions,
            cublas: handle,
            pinned: Mutex::new(Pinned {
                ptr: std::ptr::null_mut(),
                bytes: 0,
            }),
            description,
            sm_count,
            max_smem,
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

    fn bind(&self) -> Result<(), BackendError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| dev_err("cuCtxSetCurrent", e))
    }

    fn cu_stream(&self) -> drv_sys::CUstream {
        self.stream.cu_stream()
    }
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        // SAFETY: after the stream drained, nothing uses the pinned buffer, the cuBLAS handle or
        // the module; each is released once.
        unsafe {
            let _ = drv::stream::synchronize(self.cu_stream());
            let p = self.pinned.get_mut().unwrap_or_else(|e| e.into_inner());
            if !p.ptr.is_null() {
                let _ = drv::free_host(p.ptr as *mut c_void);
            }
            let _ = cublas::destroy_handle(self.cublas);
            let _ = drv::module::unload(self.module);
        }
    }
}

impl Gpu for CudaGpu {
    fn describe(&self) -> String {
        self.description.clone()
    }

    fn sm_count(&self) -> u32 {
        self.sm_count
    }

    fn max_dynamic_smem(&self) -> u32 {
        self.max_smem
    }

    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        self.bind()?;
        let (free, total) = drv::mem_get_info().map_err(|e| dev_err("cuMemGetInfo", e))?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, BackendError> {
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
                .map_err(|e| dev_err("cuMemsetD8Async", e))?;
            Ok(ptr)
        }
    }

    fn free(&self, ptr: DevPtr, _bytes: usize) {
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
            tracing::warn!("cuda: freeing device memory failed: {e:?}");
        }
    }

    fn htod(&self, dst: DevPtr, src: &[u8]) -> Result<(), BackendError> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller names a device range of src.len() bytes inside one allocation.
        // From pageable memory the driver stages `src` before returning, so it may be reused.
        unsafe { drv::memcpy_htod_async(dst, src, self.cu_stream()) }
            .map_err(|e| dev_err("cuMemcpyHtoDAsync", e))
    }

    fn dtod(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), BackendError> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller names two device ranges of `bytes` inside live allocations.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.cu_stream()) }
            .map_err(|e| dev_err("cuMemcpyDtoDAsync", e))
    }

    fn read(&self, regions: &[(DevPtr, usize)], out: &mut Vec<u8>) -> Result<(), BackendError> {
        self.bind()?;
        let total: usize = regions.iter().map(|r| r.1).sum();
        let mut pinned = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        if pinned.bytes < total {
            // SAFETY: the old buffer is idle (reads complete before `read` returns) and replaced
            // by a fresh one of `total` bytes.
            unsafe {
                if !pinned.ptr.is_null() {
                    drv::free_host(pinned.ptr as *mut c_void)
                        .map_err(|e| dev_err("cuMemFreeHost", e))?;
                    pinned.ptr = std::ptr::null_mut();
                    pinned.bytes = 0;
                }
                let p = drv::malloc_host(total, 0).map_err(|e| dev_err("cuMemHostAlloc", e))?;
                pinned.ptr = p as *mut u8;
                pinned.bytes = total;
            }
        }
        let mut at = 0usize;
        for &(src, bytes) in regions {
            if bytes == 0 {
                continue;
            }
            // SAFETY: `pinned` holds `total` bytes, so [at, at + bytes) is inside it and no other
            // read uses it (mutex); the device range is the caller's; the stream sync below
            // completes the copy before the host reads the buffer.
            unsafe {
                let dst = std::slice::from_raw_parts_mut(pinned.ptr.add(at), bytes);
                drv::memcpy_dtoh_async(dst, src, self.cu_stream())
                    .map_err(|e| dev_err("cuMemcpyDtoHAsync", e))?;
            }
            at += bytes;
        }
        // SAFETY: our own stream.
        unsafe { drv::stream::synchronize(self.cu_stream()) }
            .map_err(|e| dev_err("cuStreamSynchronize", e))?;
        out.clear();
        if total > 0 {
            // SAFETY: the copies above completed and filled `total` bytes.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(pinned.ptr, total) });
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: our own stream.
        unsafe { drv::stream::synchronize(self.cu_stream()) }
            .map_err(|e| dev_err("cuStreamSynchronize", e))
    }

    fn launch(&self, kernel: usize, dims: LaunchDims, args: &mut Args) -> Result<(), BackendError> {
        self.bind()?;
        let f = self.functions[kernel];
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
        .map_err(|e| {
            dev_err(
                &format!("cuLaunchKernel({})", kernels::kernel_names()[kernel]),
                e,
            )
        })
    }

    fn gemm(&self, g: &Gemm) -> Result<(), BackendError> {
        self.bind()?;
        let ty = |d: DType| match d {
            DType::F16 => Ok(cublas_sys::cudaDataType::CUDA_R_16F),
            DType::BF16 => Ok(cublas_sys::cudaDataType::CUDA_R_16BF),
            DType::F32 => Ok(cublas_sys::cudaDataType::CUDA_R_32F),
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
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the handle is bound to our stream; A, B and C are device ranges the caller
        // checked against the sizes given; alpha and beta are host f32 values (the handle's
        // default pointer mode) matching the f32 compute type.
        unsafe {
            cublas::gemm_ex(
                self.cublas,
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                int(g.m, "m")?,
                int(g.n, "n")?,
                int(g.k, "k")?,
                &alpha as *const f32 as *const c_void,
                g.a as *const c_void,
                ab,
                int(g.lda, "lda")?,
                g.b as *const c_void,
                ab,
                int(g.ldb, "ldb")?,
                &beta as *const f32 as *const c_void,
                g.c as *mut c_void,
                c,
                int(g.ldc, "ldc")?,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| dev_err("cublasGemmEx", e))
    }
}

//! A CPU emulation of the device under the backend, for tests on machines without a GPU: the
//! kernel sources compiled as C++ (`build`), run by the emulation's scheduler, on guarded host
//! memory (`memory`), with cublasGemmEx's contract done on the host. It is an emulation: it
//! checks the backend's indexing, parameter packing, synchronisation and arithmetic against the
//! CPU reference; it says nothing about speed or about a real GPU.
//!
//! Strict where a device is: a launch must pass exactly the kernel's parameters with their sizes
//! (checked against the compiled signature), pointer parameters must point into live
//! allocations, copies must stay inside one allocation, writes past an allocation's end are
//! reported, shared memory is limited, and GEMM arguments follow cuBLAS's rules.

mod build;
mod memory;

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Mutex, OnceLock};

use npu_backend::{BackendError, DType, MemInfo};

use crate::fault::{Fault, Launch};
use crate::gpu::{ArgKind, Args, DevPtr, Gemm, Gpu, LaunchDims};
use crate::kernels;
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
/// The emulation runtime's state is global: one launch at a time in the process.
static LAUNCH: Mutex<()> = Mutex::new(());
/// Every kernel index launched successfully in this process, on any emulated device.
static EVER_LAUNCHED: Mutex<Vec<bool>> = Mutex::new(Vec::new());

/// The kernels launched successfully so far in this process (on any emulated device), by name.
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

fn emu_err(message: String) -> BackendError {
    BackendError::Device {
        backend: "cuda",
        message: format!("emulation: {message}"),
    }
}

/// The emulated device.
pub struct EmuGpu {
    lib: &'static Library,
    mem: Mutex<Memory>,
    /// Launches so far (tests check ops really ran kernels).
    launches: Mutex<Vec<usize>>,
    bad_frees: Mutex<Vec<String>>,
    /// A kernel that faulted leaves the emulated context unusable, as on a GPU.
    fault: Fault,
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
            mem: Mutex::new(Memory::default()),
            launches: Mutex::new(Vec::new()),
            bad_frees: Mutex::new(Vec::new()),
            fault: Fault::default(),
        })
    }

    fn mem(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.mem.lock().unwrap_or_else(|e| e.into_inner())
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
            free: memory::EMULATED_DEVICE_BYTES - self.mem().used(),
            total: memory::EMULATED_DEVICE_BYTES,
        })
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, BackendError> {
        self.fault.check()?;
        self.mem()
            .alloc(bytes)
            .map_err(|_| BackendError::OutOfMemory {
                backend: "cuda",
                what: "emulated device memory".into(),
                bytes,
            })
    }

    fn free(&self, ptr: DevPtr, _bytes: usize) {
        if let Err(e) = self.mem().free(ptr) {
            self.bad_frees
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(e);
        }
    }

    fn htod(&self, dst: DevPtr, src: &[u8]) -> Result<(), BackendError> {
        self.fault.check()?;
        self.mem()
            .check(dst, src.len(), "cuMemcpyHtoDAsync")
            .map_err(emu_err)?;
        // SAFETY: the destination lies inside a live allocation (checked).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn dtod(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), BackendError> {
        self.fault.check()?;
        let m = self.mem();
        m.check(dst, bytes, "cuMemcpyDtoDAsync").map_err(emu_err)?;
        m.check(src, bytes, "cuMemcpyDtoDAsync").map_err(emu_err)?;
        // SAFETY: both ranges lie inside live allocations (checked); they may overlap only when
        // equal, which `copy` handles.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn read(&self, regions: &[(DevPtr, usize)], out: &mut Vec<u8>) -> Result<(), BackendError> {
        self.fault.check()?;
        let m = self.mem();
        out.clear();
        for &(src, bytes) in regions {
            m.check(src, bytes, "cuMemcpyDtoHAsync").map_err(emu_err)?;
            // SAFETY: inside a live allocation (checked).
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(src as *const u8, bytes) });
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        self.fault.check()?;
        let bad = self.bad_frees.lock().unwrap_or_else(|e| e.into_inner());
        match bad.first() {
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
        let mut touched = Vec::new();
        {
            let m = self.mem();
            for (i, &(kind, v)) in kinds.iter().enumerate() {
                if kind == ArgKind::Ptr && v != 0 {
                    match m.find(v, 0) {
                        Some((start, _)) => touched.push(start),
                        None => {
                            return Err(emu_err(format!(
                                "{}: pointer parameter {i} ({v:#x}) is not device memory",
                                k.name
                            )))
                        }
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
        let mut params = args.params();
        let mut err = vec![0u8; 512];
        let rc = {
            let _one = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the parameters match the kernel's signature (sizes checked above) and the
            // pointers point into live allocations; the runtime is used by one launch at a time.
            unsafe {
                (k.run)(
                    dims.grid.as_ptr(),
                    dims.block.as_ptr(),
                    dims.smem,
                    params.as_mut_ptr(),
                    err.as_mut_ptr() as *mut c_char,
                    err.len(),
                )
            }
        };
        if rc != 0 {
            let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
            let what = String::from_utf8_lossy(&err[..end]).into_owned();
            // A bad launch configuration is refused before anything runs (not sticky on a
            // GPU); anything that went wrong while the kernel ran leaves the context unusable.
            if what.starts_with("invalid launch configuration") {
                return Err(emu_err(format!("{}: {what}", k.name)));
            }
            return Err(self.fault.fatal(
                &format!("emulation: {}", k.name),
                &format!("{what} (on a GPU: a device fault)"),
            ));
        }
        let m = self.mem();
        if let Some(s) = touched.iter().find(|&&s| !m.intact(s)) {
            return Err(self.fault.fatal(
                &format!("emulation: {}", k.name),
                &format!(
                    "wrote past the end of the allocation at {s:#x} (on a GPU: \
                     CUDA_ERROR_ILLEGAL_ADDRESS or silent corruption)"
                ),
            ));
        }
        self.launches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(kernel);
        let mut ever = EVER_LAUNCHED.lock().unwrap_or_else(|e| e.into_inner());
        if ever.len() < self.lib.kernels.len() {
            ever.resize(self.lib.kernels.len(), false);
        }
        ever[kernel] = true;
        Ok(())
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
        {
            let m = self.mem();
            let span = |ld: usize, cols: usize, rows: usize| (cols - 1) * ld + rows;
            let ab = g.ab_type.size();
            m.check(g.a, span(g.lda, g.m, g.k) * ab, "cublasGemmEx A")
                .map_err(emu_err)?;
            m.check(g.b, span(g.ldb, g.n, g.k) * ab, "cublasGemmEx B")
                .map_err(emu_err)?;
            m.check(
                g.c,
                span(g.ldc, g.n, g.m) * g.c_type.size(),
                "cublasGemmEx C",
            )
            .map_err(emu_err)?;
        }
        let code = |d: DType| match d {
            DType::F32 => 0,
            DType::F16 => 1,
            _ => 2,
        };
        // SAFETY: the three ranges lie inside live allocations (checked above) and the types
        // are ones the function handles.
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
}

impl EmuGpu {
    /// The kernels launched so far, by name, in order.
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

    /// Allocations still live.
    pub fn live_allocations(&self) -> usize {
        self.mem().live()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{op_kernel, Op};

    fn gpu() -> Option<EmuGpu> {
        match EmuGpu::new() {
            Ok(g) => Some(g),
            Err(e) if e.to_string().contains("could not run the C++ compiler") => {
                eprintln!("SKIPPED (no C++ compiler for the CUDA emulation): {e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    fn add_args(x: u64, y: u64, cols: i32) -> Args {
        Args::new().ptr(x).i32(cols).ptr(y).i32(cols).i32(cols)
    }

    #[test]
    fn the_emulation_refuses_what_a_device_would() {
        let Some(g) = gpu() else { return };
        let k = op_kernel(Op::Add, DType::F32);
        let x = g.alloc(64).unwrap();
        let y = g.alloc(256).unwrap();
        let ones: Vec<u8> = (0..64).flat_map(|_| 1f32.to_le_bytes()).collect();
        g.htod(y, &ones).unwrap();
        let dims = LaunchDims::linear([1, 1, 1], 32);
        // A good launch: 16 floats.
        g.launch(k, dims, &mut add_args(x, y, 16)).unwrap();
        // A missing parameter, and an i64 where the kernel takes an int.
        let e = g
            .launch(k, dims, &mut Args::new().ptr(x).i32(16).ptr(y).i32(16))
            .unwrap_err();
        assert!(e.to_string().contains("parameters of sizes"), "{e}");
        let e = g
            .launch(
                k,
                dims,
                &mut Args::new().ptr(x).i64(16).ptr(y).i32(16).i32(16),
            )
            .unwrap_err();
        assert!(e.to_string().contains("parameters of sizes"), "{e}");
        // A pointer that is not device memory.
        let host = [0f32; 16];
        let e = g
            .launch(k, dims, &mut add_args(host.as_ptr() as u64, y, 16))
            .unwrap_err();
        assert!(e.to_string().contains("not device memory"), "{e}");
        // Bad launch shapes, too much shared memory, copies outside an allocation.
        let e = g
            .launch(
                k,
                LaunchDims::linear([1, 1, 1], 2048),
                &mut add_args(y, y, 16),
            )
            .unwrap_err();
        assert!(e.to_string().contains("invalid launch"), "{e}");
        let e = g
            .launch(
                k,
                LaunchDims {
                    smem: MAX_SMEM + 1,
                    ..dims
                },
                &mut add_args(y, y, 16),
            )
            .unwrap_err();
        assert!(e.to_string().contains("shared memory"), "{e}");
        assert!(g.htod(y + 250, &[0u8; 8]).is_err());
        assert!(g.dtod(x, y, 65).is_err());
        let mut out = Vec::new();
        assert!(g.read(&[(y + 256, 1)], &mut out).is_err());
        // cuBLAS's leading-dimension rule.
        let e = g
            .gemm(&Gemm {
                m: 2,
                n: 2,
                k: 4,
                a: y,
                lda: 3,
                b: y,
                ldb: 4,
                c: y,
                ldc: 2,
                ab_type: DType::F32,
                c_type: DType::F32,
            })
            .unwrap_err();
        assert!(e.to_string().contains("INVALID_VALUE"), "{e}");
        g.free(y, 256);
        assert_eq!(g.live_allocations(), 1);
        // Writing 32 floats into a 64-byte allocation is caught, and, as a device fault on a
        // GPU, leaves the context unusable: every later call says so, naming the first fault.
        let e = g.launch(k, dims, &mut add_args(x, x, 32)).unwrap_err();
        assert!(e.to_string().contains("wrote past the end"), "{e}");
        assert!(e.to_string().contains("add_f32 grid [1, 1, 1]"), "{e}");
        for e in [
            g.synchronize().unwrap_err(),
            g.htod(x, &[0u8; 4]).unwrap_err(),
            g.launch(k, dims, &mut add_args(x, x, 16)).unwrap_err(),
            g.alloc(64).unwrap_err(),
        ] {
            let e = e.to_string();
            assert!(
                e.contains("unusable") && e.contains("wrote past the end"),
                "{e}"
            );
        }
    }
}

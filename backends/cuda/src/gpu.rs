//! The device the backend drives, as the few things it asks of one: stream-ordered memory,
//! copies, kernel launches by index with packed parameters (cuLaunchKernel's convention), one
//! GEMM (cublasGemmEx's contract) and a read that waits once. The real device (`driver`) does it
//! with cudarc; the emulation (`emu`, feature `emulation`) does it on the CPU with the same
//! kernel sources, so everything above this seam runs in CI.

use std::ffi::c_void;

use npu_backend::{BackendError, DType, MemInfo};

/// A device address.
pub type DevPtr = u64;

/// Grid, block and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub smem: u32,
}

impl LaunchDims {
    /// `grid` blocks of `threads` threads in x, no dynamic shared memory.
    pub fn linear(grid: [u32; 3], threads: u32) -> Self {
        Self {
            grid,
            block: [threads, 1, 1],
            smem: 0,
        }
    }
}

/// What a kernel parameter is (the emulation checks them against the kernel's signature).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgKind {
    /// A device address (or null).
    Ptr,
    /// A 4-byte value (int, float).
    Word,
    /// An 8-byte value (long long).
    Long,
}

impl ArgKind {
    pub fn size(self) -> usize {
        match self {
            ArgKind::Word => 4,
            ArgKind::Ptr | ArgKind::Long => 8,
        }
    }
}

/// Kernel parameters, each in its own 8-byte slot: cuLaunchKernel reads `sizeof(param)` bytes
/// from each pointer, so 4-byte values sit in the low bytes of their slot (little-endian).
#[derive(Debug, Default)]
pub struct Args {
    slots: Vec<u64>,
    kinds: Vec<ArgKind>,
}

impl Args {
    pub fn new() -> Self {
        Self::default()
    }
    fn push(mut self, v: u64, kind: ArgKind) -> Self {
        self.slots.push(v);
        self.kinds.push(kind);
        self
    }
    pub fn ptr(self, p: DevPtr) -> Self {
        self.push(p, ArgKind::Ptr)
    }
    pub fn i32(self, v: i32) -> Self {
        self.push(v as u32 as u64, ArgKind::Word)
    }
    pub fn f32(self, v: f32) -> Self {
        self.push(v.to_bits() as u64, ArgKind::Word)
    }
    pub fn i64(self, v: i64) -> Self {
        self.push(v as u64, ArgKind::Long)
    }
    /// Each parameter's kind and value.
    pub fn values(&self) -> impl Iterator<Item = (ArgKind, u64)> + '_ {
        self.kinds.iter().copied().zip(self.slots.iter().copied())
    }
    pub fn len(&self) -> usize {
        self.slots.len()
    }
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
    /// One pointer per parameter, valid while `self` is neither moved nor changed.
    pub fn params(&mut self) -> Vec<*mut c_void> {
        self.slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect()
    }
}

/// `C (m x n) = A^T B` in column-major terms (cublasGemmEx with transa = T, transb = N): A is
/// k x m with leading dimension `lda`, B is k x n (`ldb`), C is m x n (`ldc`); f32 accumulation,
/// alpha 1, beta 0. With row-major tensors: A is the n_out x k weight matrix, B the activation
/// rows, C the output rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: DevPtr,
    pub lda: usize,
    pub b: DevPtr,
    pub ldb: usize,
    pub c: DevPtr,
    pub ldc: usize,
    /// Type of A and B.
    pub ab_type: DType,
    pub c_type: DType,
}

/// A device: one stream, in order.
pub trait Gpu: Send + Sync {
    /// Device name, compute capability and memory, for logs.
    fn describe(&self) -> String;
    /// Streaming multiprocessors (sizes the attention split).
    fn sm_count(&self) -> u32;
    /// Whether the device has the int8 tensor-core `mma.m16n8k32` (sm_80 and later).
    fn int8_mma(&self) -> bool;
    /// Most dynamic shared memory one block may use.
    fn max_dynamic_smem(&self) -> u32;
    fn mem_info(&self) -> Result<MemInfo, BackendError>;
    /// A zeroed allocation of `bytes` (> 0), 256-byte aligned.
    fn alloc(&self, bytes: usize) -> Result<DevPtr, BackendError>;
    /// Frees an allocation once queued work is done with it.
    fn free(&self, ptr: DevPtr, bytes: usize);
    /// Queues a host→device copy; `src` may be reused when this returns.
    fn htod(&self, dst: DevPtr, src: &[u8]) -> Result<(), BackendError>;
    fn dtod(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), BackendError>;
    /// Waits for every queued op, then copies each `(address, bytes)` region to `out`, one after
    /// the other.
    fn read(&self, regions: &[(DevPtr, usize)], out: &mut Vec<u8>) -> Result<(), BackendError>;
    fn synchronize(&self) -> Result<(), BackendError>;
    /// Queues kernel `kernel` (an index of `kernels::kernel_names`).
    fn launch(&self, kernel: usize, dims: LaunchDims, args: &mut Args) -> Result<(), BackendError>;
    /// Queues a GEMM.
    fn gemm(&self, g: &Gemm) -> Result<(), BackendError>;
    /// The device's stream as the CUDA runtime's `cudaStream_t` (for NCCL), with its context
    /// made current on the calling thread; None where there is no CUDA stream (the emulation).
    fn raw_stream(&self) -> Result<Option<*mut c_void>, BackendError> {
        Ok(None)
    }

    // --- graphs (`crate::graphs`): the stream's work recorded once, replayed with one call ---
    /// Whether this device records and replays stream work (the methods below).
    fn graphs_supported(&self) -> bool {
        false
    }
    /// Starts recording the work queued on the stream from the calling thread: it is recorded,
    /// not run, until `capture_end`. A synchronization, an allocation, a free or a read while
    /// recording fails and invalidates the recording.
    fn capture_begin(&self) -> Result<(), BackendError> {
        Err(graphs_unsupported())
    }
    /// Ends the recording: the graph of the recorded work (none of it has run).
    fn capture_end(&self) -> Result<GraphId, BackendError> {
        Err(graphs_unsupported())
    }
    /// Ends an open recording, if any, and discards it.
    fn capture_abort(&self) {}
    /// Whether a recording is open.
    fn capturing(&self) -> bool {
        false
    }
    /// Queues one run of graph `g`: its recorded work, with its recorded parameters, against
    /// the device memory as it is when the run gets there.
    fn replay(&self, g: GraphId) -> Result<(), BackendError> {
        let _ = g;
        Err(graphs_unsupported())
    }
    /// Whether memory graph `g` names was freed since it was recorded (it must not run again).
    fn graph_stale(&self, g: GraphId) -> bool {
        let _ = g;
        true
    }
    /// Destroys graph `g` (queued runs of it complete first).
    fn destroy_graph(&self, g: GraphId) {
        let _ = g;
    }
}

/// A recorded graph of stream work (`Gpu::capture_end`).
pub type GraphId = u64;

/// The refusal of a device without graphs.
pub fn graphs_unsupported() -> BackendError {
    BackendError::Unsupported {
        backend: "cuda",
        what: "stream capture into CUDA graphs on this device".into(),
    }
}

/// Blocks of `per` covering `n` (at least one).
pub fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

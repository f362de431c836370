//! Device memory owned by Rust values: `DeviceMem` (bytes, freed stream-ordered on drop), the
//! typed `CudaBuffer` the Backend trait hands out, and `Scratch`, a grow-only work area.
//! A weight's `DeviceMem` can be moved to host memory and back while its owner holds it
//! (`crate::offload`): its address lives in a cell the backend's list of weights shares.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use npu_backend::{BackendError, DType, DeviceBuffer};

use crate::gpu::{DevPtr, Gpu};

/// Identifies the device (backend instance) an allocation belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceId(u64);

impl DeviceId {
    pub fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        DeviceId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A device allocation; zero bytes allocate nothing.
pub struct DeviceMem {
    gpu: Arc<dyn Gpu>,
    device: DeviceId,
    /// The address: 0 while the bytes are in host memory (a weight offloaded by
    /// `crate::offload`, which holds a `Weak` of this cell to move it back).
    ptr: Arc<AtomicU64>,
    bytes: usize,
}

impl DeviceMem {
    pub fn alloc(gpu: &Arc<dyn Gpu>, device: DeviceId, bytes: usize) -> Result<Self, BackendError> {
        let ptr = if bytes == 0 { 0 } else { gpu.alloc(bytes)? };
        Ok(Self {
            gpu: gpu.clone(),
            device,
            ptr: Arc::new(AtomicU64::new(ptr)),
            bytes,
        })
    }
    /// The device address (0 while offloaded: steps are refused then, see `crate::offload`).
    pub fn ptr(&self) -> DevPtr {
        self.ptr.load(Ordering::Relaxed)
    }
    /// The address cell, for the backend's list of offloadable weights.
    pub(crate) fn cell(&self) -> Weak<AtomicU64> {
        Arc::downgrade(&self.ptr)
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    pub fn device(&self) -> DeviceId {
        self.device
    }
}

impl std::fmt::Debug for DeviceMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceMem({:#x}, {} bytes)", self.ptr(), self.bytes)
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        // Offloaded (address 0): nothing on the device; the host copy goes with the list entry.
        let ptr = self.ptr();
        if self.bytes > 0 && ptr != 0 {
            self.gpu.free(ptr, self.bytes);
        }
    }
}

/// A typed device buffer of `len` elements.
#[derive(Debug)]
pub struct CudaBuffer {
    mem: DeviceMem,
    dtype: DType,
    len: usize,
}

impl CudaBuffer {
    pub(crate) fn new(mem: DeviceMem, dtype: DType, len: usize) -> Self {
        debug_assert!(mem.bytes() >= len * dtype.size());
        Self { mem, dtype, len }
    }
    /// Device address of element `i`.
    pub(crate) fn addr(&self, i: usize) -> DevPtr {
        self.mem.ptr() + (i * self.dtype.size()) as u64
    }
    pub(crate) fn device(&self) -> DeviceId {
        self.mem.device()
    }
    pub(crate) fn mem(&self) -> &DeviceMem {
        &self.mem
    }
}

impl DeviceBuffer for CudaBuffer {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A work area that grows to the largest size asked of it (reuse is safe: ops are stream-ordered).
#[derive(Default)]
pub struct Scratch {
    mem: Option<DeviceMem>,
}

impl Scratch {
    /// At least `bytes` of device memory (contents undefined).
    pub fn ensure(
        &mut self,
        gpu: &Arc<dyn Gpu>,
        device: DeviceId,
        bytes: usize,
    ) -> Result<DevPtr, BackendError> {
        let big_enough = matches!(&self.mem, Some(m) if m.bytes() >= bytes);
        if !big_enough {
            self.mem = None;
            self.mem = Some(DeviceMem::alloc(gpu, device, bytes.max(256))?);
        }
        Ok(self.mem.as_ref().map(|m| m.ptr()).unwrap_or(0))
    }
    /// Frees the work area (the next `ensure` allocates again); its bytes.
    pub fn release(&mut self) -> usize {
        self.mem.take().map_or(0, |m| m.bytes())
    }
}

//! Device memory (`aclrtMalloc`/`aclrtFree`) and pinned host memory (`aclrtMallocHost`/
//! `aclrtFreeHost`) as owned values, and the copies between them. Synchronous copies
//! (`aclrtMemcpy`) move step inputs up and results down once the stream is synchronized;
//! asynchronous ones (`aclrtMemcpyAsync`) go through pinned buffers, 64-byte aligned as the
//! documentation requires (both allocators return aligned memory; offsets are checked).

use core::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use npu_ffi::types::*;

use crate::device::Device;
use crate::error::{AscendError, Result};
use crate::runtime::Acl;

/// An owned device allocation. Its address lives in a shared cell so that sleep level 1 can
/// move a weight's bytes to host memory and back while its owner holds it
/// (`backend::offload`): null while they are in host memory.
pub struct DeviceBuffer {
    acl: &'static Acl,
    ptr: Arc<AtomicUsize>,
    bytes: usize,
}

// SAFETY: the address is a plain number on the host (in an atomic cell); the allocation is owned
// uniquely (the offload list only moves it while no step runs); `acl` is the loaded runtime.
unsafe impl Send for DeviceBuffer {}
// SAFETY: shared references only read the address.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `bytes` (> 0) on the current context's device.
    pub fn alloc(acl: &'static Acl, bytes: usize) -> Result<Self> {
        if bytes == 0 {
            return Err(AscendError::Invalid(
                "a device allocation of 0 bytes".into(),
            ));
        }
        let mut ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let rc = unsafe { (acl.api.rt.aclrtMalloc)(&mut ptr, bytes, ACL_MEM_MALLOC_HUGE_FIRST) };
        acl.check("aclrtMalloc", rc)?;
        acl.log("aclrtMalloc", || format!("{bytes} bytes -> {ptr:p}"));
        Ok(Self {
            acl,
            ptr: Arc::new(AtomicUsize::new(ptr as usize)),
            bytes,
        })
    }

    /// The device address (null while the bytes are in host memory: sleep level 1).
    pub fn ptr(&self) -> *mut c_void {
        self.ptr.load(Ordering::Relaxed) as *mut c_void
    }

    /// The address cell, for the backend's list of offloadable weights.
    pub(crate) fn cell(&self) -> Weak<AtomicUsize> {
        Arc::downgrade(&self.ptr)
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn range(&self, offset: usize, len: usize) -> Result<*mut c_void> {
        if offset.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(AscendError::Invalid(format!(
                "{len} bytes at offset {offset} exceed a {}-byte device buffer",
                self.bytes
            )));
        }
        let base = self.ptr.load(Ordering::Relaxed);
        if base == 0 {
            return Err(AscendError::Invalid(
                "a device buffer whose bytes are in host memory (sleep level 1)".into(),
            ));
        }
        // Pointer arithmetic on a device address: never dereferenced on the host.
        Ok((base + offset) as *mut c_void)
    }

    /// Copies `src` to `offset` (synchronous).
    pub fn upload(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let dst = self.range(offset, src.len())?;
        self.acl.log("aclrtMemcpy", || {
            format!("H2D {} bytes -> {dst:p}", src.len())
        });
        // SAFETY: `dst` lies in this allocation (checked); `src` is a live host slice of that length.
        let rc = unsafe {
            (self.acl.api.rt.aclrtMemcpy)(
                dst,
                src.len(),
                src.as_ptr().cast(),
                src.len(),
                ACL_MEMCPY_HOST_TO_DEVICE,
            )
        };
        self.acl.check("aclrtMemcpy", rc)
    }

    /// Copies from `offset` into `dst` (synchronous; the stream that wrote it must be synchronized).
    pub fn download(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.range(offset, dst.len())?;
        self.acl.log("aclrtMemcpy", || {
            format!("D2H {} bytes <- {src:p}", dst.len())
        });
        // SAFETY: `src` lies in this allocation (checked); `dst` is a live host slice of that length.
        let rc = unsafe {
            (self.acl.api.rt.aclrtMemcpy)(
                dst.as_mut_ptr().cast(),
                dst.len(),
                src,
                dst.len(),
                ACL_MEMCPY_DEVICE_TO_HOST,
            )
        };
        self.acl.check("aclrtMemcpy", rc)
    }

    /// Device-to-device copy on the device's stream (64-byte aligned offsets).
    pub fn copy_from_async(
        &mut self,
        offset: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
        device: &Device,
    ) -> Result<()> {
        let stream = device.stream();
        let d = self.range(offset, len)?;
        let s = src.range(src_offset, len)?;
        self.acl.log("aclrtMemcpyAsync", || {
            format!("D2D {len} bytes {s:p} -> {d:p}")
        });
        // SAFETY: both ranges lie in live device allocations (checked); the stream is the caller's.
        let rc = unsafe {
            (self.acl.api.rt.aclrtMemcpyAsync)(d, len, s, len, ACL_MEMCPY_DEVICE_TO_DEVICE, stream)
        };
        self.acl.check("aclrtMemcpyAsync", rc)
    }

    /// Device-to-device copy within this allocation on the device's stream (64-byte aligned
    /// offsets; the ranges must not overlap).
    pub fn copy_within_async(
        &mut self,
        dst_offset: usize,
        src_offset: usize,
        len: usize,
        device: &Device,
    ) -> Result<()> {
        if dst_offset < src_offset + len && src_offset < dst_offset + len {
            return Err(AscendError::Invalid(format!(
                "overlapping copy of {len} bytes from {src_offset} to {dst_offset}"
            )));
        }
        let stream = device.stream();
        let d = self.range(dst_offset, len)?;
        let s = self.range(src_offset, len)?;
        self.acl.log("aclrtMemcpyAsync", || {
            format!("D2D {len} bytes {s:p} -> {d:p}")
        });
        // SAFETY: both disjoint ranges lie in this live allocation (checked); the stream is live.
        let rc = unsafe {
            (self.acl.api.rt.aclrtMemcpyAsync)(d, len, s, len, ACL_MEMCPY_DEVICE_TO_DEVICE, stream)
        };
        self.acl.check("aclrtMemcpyAsync", rc)
    }

    /// Device-to-host copy on the device's stream into pinned memory at `dst_offset`; readable
    /// after the stream syncs.
    pub fn download_async(
        &self,
        offset: usize,
        dst: &mut PinnedBuffer,
        dst_offset: usize,
        len: usize,
        device: &Device,
    ) -> Result<()> {
        let stream = device.stream();
        let s = self.range(offset, len)?;
        let d = dst.range(dst_offset, len)?;
        self.acl
            .log("aclrtMemcpyAsync", || format!("D2H {len} bytes <- {s:p}"));
        // SAFETY: `s` lies in this allocation; `d` is pinned host memory of at least `len` bytes
        // that outlives the copy (the caller synchronizes before reading or dropping it).
        let rc = unsafe {
            (self.acl.api.rt.aclrtMemcpyAsync)(d, len, s, len, ACL_MEMCPY_DEVICE_TO_HOST, stream)
        };
        self.acl.check("aclrtMemcpyAsync", rc)
    }

    /// Host-to-device copy on the device's stream from pinned memory at `src_offset` (which must
    /// stay unchanged until the stream syncs).
    pub fn upload_async(
        &mut self,
        offset: usize,
        src: &PinnedBuffer,
        src_offset: usize,
        len: usize,
        device: &Device,
    ) -> Result<()> {
        let stream = device.stream();
        let d = self.range(offset, len)?;
        let s = src.range(src_offset, len)?;
        self.acl
            .log("aclrtMemcpyAsync", || format!("H2D {len} bytes -> {d:p}"));
        // SAFETY: `d` lies in this allocation; `s` is pinned memory of at least `len` bytes.
        let rc = unsafe {
            (self.acl.api.rt.aclrtMemcpyAsync)(d, len, s, len, ACL_MEMCPY_HOST_TO_DEVICE, stream)
        };
        self.acl.check("aclrtMemcpyAsync", rc)
    }

    /// Fills `len` bytes at `offset` with `value` (synchronous).
    pub fn fill(&mut self, offset: usize, value: u8, len: usize) -> Result<()> {
        let d = self.range(offset, len)?;
        // SAFETY: `d` lies in this allocation (checked).
        let rc = unsafe { (self.acl.api.rt.aclrtMemset)(d, len, value as i32, len) };
        self.acl.check("aclrtMemset", rc)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let ptr = self.ptr();
        if ptr.is_null() {
            // In host memory (sleep level 1): the backend's list holds the bytes.
            return;
        }
        free(self.acl, ptr);
    }
}

/// `aclrtFree` of an allocation the caller owns and frees once; a failure is logged.
pub(crate) fn free(acl: &'static Acl, ptr: *mut c_void) {
    // SAFETY: the caller owns the allocation at `ptr` and frees it once.
    let rc = unsafe { (acl.api.rt.aclrtFree)(ptr) };
    if rc != 0 {
        tracing::error!("aclrtFree({:p}) failed: {} {}", ptr, rc, acl.last_message());
    }
}

/// Synchronous `aclrtMemcpy` of `dst.len()` bytes at device address `ptr` into `dst` (a weight
/// going to host memory; the stream is synchronized first by the caller).
pub(crate) fn download_raw(acl: &'static Acl, ptr: *mut c_void, dst: &mut [u8]) -> Result<()> {
    // SAFETY: `ptr` is a live allocation of at least `dst.len()` bytes (the caller's list says
    // so); `dst` is a live host slice of that length.
    let rc = unsafe {
        (acl.api.rt.aclrtMemcpy)(
            dst.as_mut_ptr().cast(),
            dst.len(),
            ptr,
            dst.len(),
            ACL_MEMCPY_DEVICE_TO_HOST,
        )
    };
    acl.check("aclrtMemcpy", rc)
}

/// `aclrtMalloc` of `bytes` (> 0) for a weight coming back from host memory, and the
/// synchronous copy of `src` (`bytes` long) into it; the address.
pub(crate) fn alloc_copy(acl: &'static Acl, src: &[u8]) -> Result<*mut c_void> {
    let mut ptr = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let rc = unsafe { (acl.api.rt.aclrtMalloc)(&mut ptr, src.len(), ACL_MEM_MALLOC_HUGE_FIRST) };
    acl.check("aclrtMalloc", rc)?;
    // SAFETY: `ptr` is a fresh allocation of `src.len()` bytes; `src` a live host slice.
    let rc = unsafe {
        (acl.api.rt.aclrtMemcpy)(
            ptr,
            src.len(),
            src.as_ptr().cast(),
            src.len(),
            ACL_MEMCPY_HOST_TO_DEVICE,
        )
    };
    if let Err(e) = acl.check("aclrtMemcpy", rc) {
        free(acl, ptr);
        return Err(e);
    }
    Ok(ptr)
}

/// Owned pinned host memory (the host side of asynchronous copies).
pub struct PinnedBuffer {
    acl: &'static Acl,
    ptr: *mut c_void,
    bytes: usize,
}

// SAFETY: uniquely owned host memory.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    pub fn alloc(acl: &'static Acl, bytes: usize) -> Result<Self> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        acl.check("aclrtMallocHost", unsafe {
            (acl.api.rt.aclrtMallocHost)(&mut ptr, bytes.max(1))
        })?;
        Ok(Self { acl, ptr, bytes })
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn range(&self, offset: usize, len: usize) -> Result<*mut c_void> {
        if offset.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(AscendError::Invalid(format!(
                "{len} bytes at offset {offset} exceed a {}-byte pinned buffer",
                self.bytes
            )));
        }
        // SAFETY: the range was checked to lie inside this allocation.
        Ok(unsafe { (self.ptr as *mut u8).add(offset) }.cast())
    }

    /// The bytes (contents of an async download are valid only after the stream synchronizes).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live host allocation of `bytes` bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.bytes) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.bytes) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: owned by self, freed once.
        unsafe { (self.acl.api.rt.aclrtFreeHost)(self.ptr) };
    }
}

//! Device memory (`aclrtMalloc`/`aclrtFree`) and pinned host memory (`aclrtMallocHost`/
//! `aclrtFreeHost`) as owned values, and the copies between them. Synchronous copies
//! (`aclrtMemcpy`) move step inputs up and results down once the stream is synchronized;
//! asynchronous ones (`aclrtMemcpyAsync`) go through pinned buffers, 64-byte aligned as the
//! documentation requires (both allocators return aligned memory; offsets are checked).

use core::ffi::c_void;

use npu_ffi::types::*;

use crate::device::Device;
use crate::error::{AscendError, Result};
use crate::runtime::Acl;

/// An owned device allocation.
pub struct DeviceBuffer {
    acl: &'static Acl,
    ptr: *mut c_void,
    bytes: usize,
}

// SAFETY: a device address is a plain number on the host; ownership is unique.
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
        Ok(Self { acl, ptr, bytes })
    }

    pub fn ptr(&self) -> *mut c_void {
        self.ptr
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
        // Pointer arithmetic on a device address: never dereferenced on the host.
        Ok((self.ptr as usize + offset) as *mut c_void)
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
        // SAFETY: the allocation is owned by self and freed once.
        let rc = unsafe { (self.acl.api.rt.aclrtFree)(self.ptr) };
        if rc != 0 {
            tracing::error!(
                "aclrtFree({:p}) failed: {} {}",
                self.ptr,
                rc,
                self.acl.last_message()
            );
        }
    }
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

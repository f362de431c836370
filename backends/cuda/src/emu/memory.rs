//! The emulated device memory: each allocation is its own mapping with an inaccessible page on
//! either side and a canary pattern filling the rest of its last page, so a kernel that writes
//! before an allocation faults at once and one that writes past its end is reported after the
//! launch. Copies must lie inside one live allocation, as on a device. The space is bounded
//! (`EMULATED_DEVICE_BYTES`): an allocation past it fails as cuMemAlloc would, and the free
//! bytes reported are what the live allocations leave.
//!
//! Frees are stream-ordered (`cuMemFreeAsync`): [`Memory::release`] marks an allocation freed
//! when the program frees it — from then on no new work may name it — and [`Memory::free`]
//! unmaps it when the stream reaches the free, after the work queued before it. A released
//! allocation counts as free (a stream-ordered pool hands it out again in stream order).

use std::collections::BTreeMap;

const PAGE: usize = 4096;
/// Bytes of the emulated device (what `mem_info` reports as total).
pub const EMULATED_DEVICE_BYTES: u64 = 4 << 30;
const CANARY: u8 = 0xa5;

struct Region {
    /// Start of the mapping (the leading guard page).
    base: usize,
    map_len: usize,
    len: usize,
    /// Freed by the program; unmapped when the stream reaches the free.
    released: bool,
}

impl Region {
    fn data(&self) -> usize {
        self.base + PAGE
    }
    /// The bytes between the end of the data and the trailing guard page.
    fn slack(&self) -> &[u8] {
        let data_pages = self.len.div_ceil(PAGE) * PAGE;
        // SAFETY: the slack lies inside the mapping's readable data pages.
        unsafe {
            std::slice::from_raw_parts((self.data() + self.len) as *const u8, data_pages - self.len)
        }
    }
}

#[derive(Default)]
pub struct Memory {
    regions: BTreeMap<u64, Region>,
}

// SAFETY: the mappings are owned by this value alone (addresses are plain integers here).
unsafe impl Send for Memory {}

impl Memory {
    /// A zeroed allocation of `bytes` (page aligned).
    pub fn alloc(&mut self, bytes: usize) -> Result<u64, String> {
        if (bytes as u64).saturating_add(self.used()) > EMULATED_DEVICE_BYTES {
            return Err(format!(
                "out of memory: {bytes} bytes asked, {} of {EMULATED_DEVICE_BYTES} free",
                EMULATED_DEVICE_BYTES - self.used()
            ));
        }
        let data_pages = bytes.div_ceil(PAGE).max(1) * PAGE;
        let map_len = data_pages + 2 * PAGE;
        // SAFETY: an anonymous private mapping; the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(format!("out of memory mapping {bytes} bytes"));
        }
        let base = base as usize;
        // SAFETY: both guard pages lie inside the fresh mapping; the canary fill writes the
        // data pages' tail, also inside it.
        unsafe {
            libc::mprotect(base as *mut libc::c_void, PAGE, libc::PROT_NONE);
            libc::mprotect(
                (base + PAGE + data_pages) as *mut libc::c_void,
                PAGE,
                libc::PROT_NONE,
            );
            std::ptr::write_bytes((base + PAGE + bytes) as *mut u8, CANARY, data_pages - bytes);
        }
        let r = Region {
            base,
            map_len,
            len: bytes,
            released: false,
        };
        let addr = r.data() as u64;
        self.regions.insert(addr, r);
        Ok(addr)
    }

    /// Bytes the live (not released) allocations hold.
    pub fn used(&self) -> u64 {
        self.regions
            .values()
            .filter(|r| !r.released)
            .map(|r| r.len as u64)
            .sum()
    }

    /// Marks the allocation at `addr` freed by the program (`cuMemFreeAsync` called): new work
    /// may not name it; it stays mapped for the work queued before the free.
    pub fn release(&mut self, addr: u64) -> Result<(), String> {
        match self.regions.get_mut(&addr) {
            Some(r) if !r.released => {
                r.released = true;
                Ok(())
            }
            Some(_) => Err(format!("{addr:#x} freed twice")),
            None => Err(format!("free of {addr:#x}, which is not an allocation")),
        }
    }

    /// Unmaps the allocation at `addr` (the stream reached its free).
    pub fn free(&mut self, addr: u64) -> Result<(), String> {
        let r = self
            .regions
            .remove(&addr)
            .ok_or_else(|| format!("free of {addr:#x}, which is not an allocation"))?;
        let intact = r.slack().iter().all(|&b| b == CANARY);
        // SAFETY: the mapping is ours and nothing refers to it any more.
        unsafe { libc::munmap(r.base as *mut libc::c_void, r.map_len) };
        if intact {
            Ok(())
        } else {
            Err(format!(
                "the allocation at {addr:#x} was written past its end"
            ))
        }
    }

    /// The mapped allocation holding `[addr, addr + bytes)` (released or not), as (start,
    /// length, released).
    fn lookup(&self, addr: u64, bytes: usize) -> Option<(u64, usize, bool)> {
        let (&start, r) = self.regions.range(..=addr).next_back()?;
        let end = addr.checked_add(bytes as u64)?;
        (end <= start + r.len as u64).then_some((start, r.len, r.released))
    }

    /// The live (not released) allocation holding `[addr, addr + bytes)`, as (start, length).
    pub fn find(&self, addr: u64, bytes: usize) -> Option<(u64, usize)> {
        match self.lookup(addr, bytes) {
            Some((start, len, false)) => Some((start, len)),
            _ => None,
        }
    }

    /// Checks that `[addr, addr + bytes)` lies inside one live allocation (for new work).
    pub fn check(&self, addr: u64, bytes: usize, what: &str) -> Result<(), String> {
        if bytes == 0 {
            return Ok(());
        }
        match self.lookup(addr, bytes) {
            Some((_, _, false)) => Ok(()),
            Some((start, _, true)) => Err(format!(
                "{what}: [{addr:#x}, +{bytes}) lies in the allocation at {start:#x}, already freed \
                 (cuMemFreeAsync queued before this work: use after free)"
            )),
            None => Err(format!(
                "{what}: [{addr:#x}, +{bytes}) is not inside one device allocation \
                 (CUDA_ERROR_INVALID_VALUE)"
            )),
        }
    }

    /// Whether `addr` lies in (or just past) an allocation the program already freed.
    pub fn released(&self, addr: u64) -> bool {
        matches!(self.lookup(addr, 0), Some((_, _, true)))
    }

    /// Whether an allocation starting at `start` is mapped (released or not).
    pub fn has(&self, start: u64) -> bool {
        self.regions.contains_key(&start)
    }

    /// Whether `[addr, addr + bytes)` lies inside one mapped allocation, released or not (queued
    /// work at the time it runs: a free queued after it has not run yet).
    pub fn mapped(&self, addr: u64, bytes: usize) -> bool {
        bytes == 0 || self.lookup(addr, bytes).is_some()
    }

    /// Whether the allocation starting at `start` still has its canary intact.
    pub fn intact(&self, start: u64) -> bool {
        match self.regions.get(&start) {
            Some(r) => r.slack().iter().all(|&b| b == CANARY),
            None => true,
        }
    }

    /// Allocations the program has not freed.
    pub fn live(&self) -> usize {
        self.regions.values().filter(|r| !r.released).count()
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        for r in self.regions.values() {
            // SAFETY: each mapping is ours; the device is gone.
            unsafe { libc::munmap(r.base as *mut libc::c_void, r.map_len) };
        }
    }
}

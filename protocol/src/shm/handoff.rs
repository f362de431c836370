//! The KV handoff region: one POSIX shm object created by the server (O_EXCL, mode 0600,
//! unguessable name) and mapped by every agent, through which a prefill agent hands a request's
//! KV blocks to a decode agent. A prefill agent copies each block out of its device into a
//! handoff block (`CopyDirection::DeviceToHandoff`), a decode agent copies it into its device
//! (`CopyDirection::HandoffToDevice`); the server decides which handoff blocks each request uses
//! and orders the two steps, so no two agents touch one handoff block at once.
//!
//! Layout: a `#[repr(C)]` header (magic, version, layout hash, data offset and size) on the
//! first page, then the data. Blocks are `block_bytes` long, a model fact both sides learn
//! after the model is loaded, so the region is sized in bytes and cut into blocks by each side.

use std::fs::File;
use std::os::fd::FromRawFd;

use bytemuck::{Pod, Zeroable};
use memmap2::MmapMut;

use super::{checked_name, os_err, os_error, unlink_name, ShmError, MAX_SEGMENT_BYTES};

/// "NPUKVH" + two version-independent bytes, read as a little-endian u64.
pub const HANDOFF_MAGIC: u64 = u64::from_le_bytes(*b"NPUKVH\x00\x01");
/// Version of the region's layout.
pub const HANDOFF_VERSION: u32 = 1;
/// The data starts on the second page.
pub const HANDOFF_DATA_OFFSET: u64 = 4096;
/// The agent id that names the handoff region (`segment_name`), distinct from every agent's.
pub const HANDOFF_REGION_ID: u32 = u32::MAX;

/// The region header, at offset 0.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct HandoffHeader {
    pub magic: u64,
    pub version: u32,
    pub header_size: u32,
    pub layout_hash: u64,
    pub data_offset: u64,
    pub data_bytes: u64,
}

const _: () = assert!(std::mem::size_of::<HandoffHeader>() == 40);
const _: () = assert!((std::mem::size_of::<HandoffHeader>() as u64) <= HANDOFF_DATA_OFFSET);

/// FNV-1a over the layout's words, as the step segment's hash.
pub fn handoff_layout_hash(data_bytes: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in [
        HANDOFF_MAGIC,
        HANDOFF_VERSION as u64,
        std::mem::size_of::<HandoffHeader>() as u64,
        HANDOFF_DATA_OFFSET,
        data_bytes,
    ] {
        for byte in v.to_le_bytes() {
            h ^= byte as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Blocks of `block_bytes` that `data_bytes` of handoff region hold (0 for empty blocks).
pub fn handoff_blocks(data_bytes: u64, block_bytes: u64) -> u32 {
    if block_bytes == 0 {
        return 0;
    }
    (data_bytes / block_bytes).min(u32::MAX as u64) as u32
}

/// One mapping of the handoff region. The creator owns the name and unlinks it on drop.
pub struct HandoffRegion {
    name: String,
    map: MmapMut,
    data_bytes: u64,
    owns_name: bool,
}

impl std::fmt::Debug for HandoffRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandoffRegion")
            .field("name", &self.name)
            .field("data_bytes", &self.data_bytes)
            .field("owns_name", &self.owns_name)
            .finish()
    }
}

impl HandoffRegion {
    /// Creates the region (fails if the name exists), mode 0600, with `data_bytes` of data.
    pub fn create(name: &str, data_bytes: u64) -> Result<Self, ShmError> {
        let total = HANDOFF_DATA_OFFSET
            .checked_add(data_bytes)
            .filter(|t| *t <= MAX_SEGMENT_BYTES)
            .ok_or_else(|| {
                ShmError::BadCapacities(format!(
                    "a handoff region of {data_bytes} bytes is over the limit of \
                     {MAX_SEGMENT_BYTES} bytes"
                ))
            })?;
        let cname = checked_name(name)?;
        // SAFETY: cname is a valid NUL-terminated string; the flags and mode are plain integers.
        let fd = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                0o600 as libc::mode_t,
            )
        };
        if fd < 0 {
            return Err(os_error("shm_open(O_CREAT|O_EXCL)", name));
        }
        // SAFETY: fd was just returned by shm_open and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        let mapped = (|| {
            // SAFETY: fchmod on an fd we own.
            if unsafe { libc::fchmod(fd, 0o600) } != 0 {
                return Err(os_error("fchmod", name));
            }
            file.set_len(total)
                .map_err(|e| os_err(e, "ftruncate", name))?;
            // SAFETY: the region is shared only with our agents, which never resize it; block
            // contents are plain bytes whatever another process wrote.
            unsafe { MmapMut::map_mut(&file) }.map_err(|e| os_err(e, "mmap", name))
        })();
        let mut map = match mapped {
            Ok(map) => map,
            Err(e) => {
                let _ = unlink_name(name);
                return Err(e);
            }
        };
        let header = HandoffHeader {
            magic: HANDOFF_MAGIC,
            version: HANDOFF_VERSION,
            header_size: std::mem::size_of::<HandoffHeader>() as u32,
            layout_hash: handoff_layout_hash(data_bytes),
            data_offset: HANDOFF_DATA_OFFSET,
            data_bytes,
        };
        map[..std::mem::size_of::<HandoffHeader>()].copy_from_slice(bytemuck::bytes_of(&header));
        Ok(Self {
            name: name.to_string(),
            map,
            data_bytes,
            owns_name: true,
        })
    }

    /// Opens the region and checks its header (magic, version, layout hash, size). The opener
    /// does not own the name.
    pub fn open(name: &str) -> Result<Self, ShmError> {
        let cname = checked_name(name)?;
        // SAFETY: valid C string, plain flags.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            return Err(os_error("shm_open", name));
        }
        // SAFETY: fd was just returned by shm_open and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        let size = file.metadata().map_err(|e| os_err(e, "fstat", name))?.len();
        if size < HANDOFF_DATA_OFFSET {
            return Err(ShmError::TooSmall {
                size,
                needed: HANDOFF_DATA_OFFSET,
            });
        }
        if size > MAX_SEGMENT_BYTES {
            return Err(ShmError::LayoutMismatch(format!(
                "handoff region is {size} bytes, more than the limit of {MAX_SEGMENT_BYTES}"
            )));
        }
        // SAFETY: as in `create`; the mapping's length is fixed at map time.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| os_err(e, "mmap", name))?;
        let h: HandoffHeader =
            bytemuck::pod_read_unaligned(&map[..std::mem::size_of::<HandoffHeader>()]);
        if h.magic != HANDOFF_MAGIC {
            return Err(ShmError::BadMagic { found: h.magic });
        }
        if h.version != HANDOFF_VERSION {
            return Err(ShmError::VersionMismatch {
                found: h.version,
                expected: HANDOFF_VERSION,
            });
        }
        if h.header_size as usize != std::mem::size_of::<HandoffHeader>()
            || h.data_offset != HANDOFF_DATA_OFFSET
            || h.layout_hash != handoff_layout_hash(h.data_bytes)
            || HANDOFF_DATA_OFFSET.checked_add(h.data_bytes) != Some(size)
        {
            return Err(ShmError::LayoutMismatch(format!(
                "handoff region header {h:?} does not describe a {size}-byte region"
            )));
        }
        Ok(Self {
            name: name.to_string(),
            map,
            data_bytes: h.data_bytes,
            owns_name: false,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes of block data.
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes
    }

    /// Blocks of `block_bytes` the region holds.
    pub fn blocks(&self, block_bytes: u64) -> u32 {
        handoff_blocks(self.data_bytes, block_bytes)
    }

    fn range(&self, block: u32, block_bytes: usize) -> Result<std::ops::Range<usize>, ShmError> {
        if block >= self.blocks(block_bytes as u64) {
            return Err(ShmError::BadPlan(format!(
                "handoff block {block} of {} (blocks of {block_bytes} bytes)",
                self.blocks(block_bytes as u64)
            )));
        }
        let start = HANDOFF_DATA_OFFSET as usize + block as usize * block_bytes;
        Ok(start..start + block_bytes)
    }

    /// Handoff block `block` (blocks of `block_bytes`); an error past the region's end.
    pub fn block(&self, block: u32, block_bytes: usize) -> Result<&[u8], ShmError> {
        let r = self.range(block, block_bytes)?;
        Ok(&self.map[r])
    }

    /// Handoff block `block`, writable; an error past the region's end.
    pub fn block_mut(&mut self, block: u32, block_bytes: usize) -> Result<&mut [u8], ShmError> {
        let r = self.range(block, block_bytes)?;
        Ok(&mut self.map[r])
    }
}

impl Drop for HandoffRegion {
    fn drop(&mut self) {
        if self.owns_name {
            let _ = unlink_name(&self.name);
        }
    }
}

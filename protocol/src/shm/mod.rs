//! The shared-memory segment between the server and one agent: POSIX shm created by the server
//! (O_EXCL, mode 0600, unguessable name), mapped on both sides, holding one step plan and one
//! step result at a time. Layout in `layout`, plan/result coding in `codec`, names in `names`.

mod codec;
pub mod group;
pub mod handoff;
pub mod layout;
mod lora;
pub mod names;

use std::ffi::CString;
use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use memmap2::MmapMut;
use thiserror::Error;

pub use codec::PlanView;
pub use group::{slot_floats_for, GroupError, GroupMember, GroupRegion, GROUP_REGION_ID_BASE};
pub use handoff::{handoff_blocks, HandoffRegion, HANDOFF_REGION_ID};
pub use layout::{
    Region, ShmCapacities, ShmHeader, ShmLayout, MAX_SEGMENT_BYTES, PROTOCOL_VERSION, SHM_MAGIC,
};
pub use names::{cleanup_stale_segments, segment_name, SEGMENT_PREFIX};

use crate::step::{StepPlan, StepResult, TokenMask};

/// Everything that can go wrong with a segment.
#[derive(Debug, Error)]
pub enum ShmError {
    #[error("invalid shared-memory name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("{op} of shared-memory segment {name}: {source}")]
    Os {
        op: &'static str,
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not an npu-serving segment (magic {found:#018x})")]
    BadMagic { found: u64 },
    #[error("segment protocol version {found}, this build speaks {expected}")]
    VersionMismatch { found: u32, expected: u32 },
    #[error("segment layout mismatch: {0}")]
    LayoutMismatch(String),
    #[error("segment is {size} bytes, its layout needs {needed}")]
    TooSmall { size: u64, needed: u64 },
    #[error("bad capacities: {0}")]
    BadCapacities(String),
    #[error("{what}: {got} exceeds the capacity of {cap}")]
    CapacityExceeded {
        what: &'static str,
        got: usize,
        cap: u32,
    },
    #[error("{what} slot {slot} is not below max_slots {max_slots}")]
    BadSlot {
        what: &'static str,
        slot: u32,
        max_slots: u32,
    },
    #[error("bad step plan: {0}")]
    BadPlan(String),
    #[error("corrupt segment: {0}")]
    Corrupt(String),
    #[error("the result in the segment answers plan {result_seq}, the latest plan is {plan_seq}")]
    StaleResult { plan_seq: u64, result_seq: u64 },
    #[error("region {0:?} lies outside the mapping (layout bug)")]
    Internal(Region),
}

/// Reads and validates the step result in `image`, the bytes of a segment laid out as `layout`
/// (what [`ShmSegment::read_result`] reads from its mapping, less the sequence check): what an
/// agent wrote, as the server takes it in. For fuzzing and tests.
pub fn decode_result(layout: &ShmLayout, image: &[u8]) -> Result<StepResult, ShmError> {
    codec::read_result(layout, image)
}

/// Reads and validates the step plan in `image` (see [`decode_result`]), as an agent does.
pub fn decode_plan(layout: &ShmLayout, image: &[u8]) -> Result<StepPlan, ShmError> {
    codec::read_plan(layout, image)
}

/// A segment image of `layout` holding `plan` and `result` (what `write_plan` and
/// `write_result` put in a mapping): seeds for fuzzing and tests.
pub fn encode_image(
    layout: &ShmLayout,
    plan: &StepPlan,
    result: &StepResult,
) -> Result<Vec<u8>, ShmError> {
    let mut image = vec![0u8; layout.total_size() as usize];
    let header = layout.header();
    image[..std::mem::size_of::<ShmHeader>()].copy_from_slice(bytemuck::bytes_of(&header));
    codec::write_plan(layout, &mut image, plan)?;
    codec::write_result(layout, &mut image, result)?;
    Ok(image)
}

/// One mapped segment. The creator owns the name and unlinks it on `unlink` or drop.
pub struct ShmSegment {
    name: String,
    map: MmapMut,
    layout: ShmLayout,
    owns_name: bool,
}

impl std::fmt::Debug for ShmSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmSegment")
            .field("name", &self.name)
            .field("size", &self.map.len())
            .field("layout_hash", &format_args!("{:#018x}", self.layout.hash()))
            .field("owns_name", &self.owns_name)
            .finish()
    }
}

impl ShmSegment {
    /// Creates a new segment (fails if the name exists), mode 0600, sized and headed for `layout`.
    pub fn create(name: &str, layout: &ShmLayout) -> Result<Self, ShmError> {
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
        let sized_and_mapped = (|| {
            // SAFETY: fchmod on an fd we own.
            if unsafe { libc::fchmod(fd, 0o600) } != 0 {
                return Err(os_error("fchmod", name));
            }
            file.set_len(layout.total_size())
                .map_err(|e| os_err(e, "ftruncate", name))?;
            // SAFETY: the segment is shared only with our agent, which never resizes it; every
            // read through the mapping copies bytes out and validates them.
            unsafe { MmapMut::map_mut(&file) }.map_err(|e| os_err(e, "mmap", name))
        })();
        let mut map = match sized_and_mapped {
            Ok(map) => map,
            Err(e) => {
                let _ = unlink_name(name);
                return Err(e);
            }
        };
        let header = layout.header();
        map[..std::mem::size_of::<ShmHeader>()].copy_from_slice(bytemuck::bytes_of(&header));
        Ok(Self {
            name: name.to_string(),
            map,
            layout: layout.clone(),
            owns_name: true,
        })
    }

    /// Opens an existing segment and validates its header (magic, version, layout hash, region
    /// offsets, size). The opener does not own the name.
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
        let header_size = std::mem::size_of::<ShmHeader>() as u64;
        if size < header_size {
            return Err(ShmError::TooSmall {
                size,
                needed: header_size,
            });
        }
        if size > MAX_SEGMENT_BYTES {
            return Err(ShmError::LayoutMismatch(format!(
                "segment is {size} bytes, more than the limit of {MAX_SEGMENT_BYTES}"
            )));
        }
        // SAFETY: as in `create`; the mapping's length is fixed at map time.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| os_err(e, "mmap", name))?;
        let header: ShmHeader =
            bytemuck::pod_read_unaligned(&map[..std::mem::size_of::<ShmHeader>()]);
        let layout = ShmLayout::from_header(&header, map.len() as u64)?;
        Ok(Self {
            name: name.to_string(),
            map,
            layout,
            owns_name: false,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn layout(&self) -> &ShmLayout {
        &self.layout
    }

    /// Number of plans written so far (by anyone) into this segment.
    pub fn plan_seq(&self) -> u64 {
        self.seq(layout::PLAN_SEQ_OFFSET).load(Ordering::Acquire)
    }

    /// The plan_seq the result in the segment answers.
    pub fn result_seq(&self) -> u64 {
        self.seq(layout::RESULT_SEQ_OFFSET).load(Ordering::Acquire)
    }

    /// Writes `plan` (refusing it whole if it exceeds any capacity) and bumps the step sequence
    /// number; returns the new sequence number.
    pub fn write_plan(&mut self, plan: &StepPlan) -> Result<u64, ShmError> {
        codec::write_plan(&self.layout, &mut self.map, plan)?;
        fence(Ordering::Release);
        let seq = self.seq(layout::PLAN_SEQ_OFFSET);
        Ok(seq.fetch_add(1, Ordering::AcqRel) + 1)
    }

    /// Reads and validates the plan in the segment.
    pub fn read_plan(&self) -> Result<StepPlan, ShmError> {
        fence(Ordering::Acquire);
        codec::read_plan(&self.layout, &self.map)
    }

    /// The plan in the segment, its structure validated, read in place (see `PlanSource`).
    pub fn plan_view(&self) -> Result<PlanView<'_>, ShmError> {
        fence(Ordering::Acquire);
        PlanView::parse(&self.layout, &self.map)
    }

    /// Writes the words of the masks that follow the plan in the segment (see
    /// [`StepPlan::masks_follow`]), one per masked slot in the plan's order; the agent reads
    /// them once a `Masks` frame announces them.
    pub fn write_mask_words(&mut self, masks: &[TokenMask]) -> Result<(), ShmError> {
        codec::write_mask_words(&self.layout, &mut self.map, masks)?;
        fence(Ordering::Release);
        Ok(())
    }

    /// The masks whose words followed the plan in the segment (after their `Masks` frame).
    pub fn read_mask_words(&self) -> Result<Vec<TokenMask>, ShmError> {
        fence(Ordering::Acquire);
        codec::read_mask_words(&self.layout, &self.map)
    }

    /// Writes `result` (refusing it whole if it exceeds any capacity) as the answer to the latest
    /// plan.
    pub fn write_result(&mut self, result: &StepResult) -> Result<(), ShmError> {
        codec::write_result(&self.layout, &mut self.map, result)?;
        fence(Ordering::Release);
        let plan_seq = self.plan_seq();
        self.seq(layout::RESULT_SEQ_OFFSET)
            .store(plan_seq, Ordering::Release);
        Ok(())
    }

    /// Reads and validates the result in the segment; it must answer the latest plan.
    pub fn read_result(&self) -> Result<StepResult, ShmError> {
        let (plan_seq, result_seq) = (self.plan_seq(), self.result_seq());
        if plan_seq != result_seq {
            return Err(ShmError::StaleResult {
                plan_seq,
                result_seq,
            });
        }
        codec::read_result(&self.layout, &self.map)
    }

    /// Removes the name (the mapping stays valid until drop). Only the creator does this.
    pub fn unlink(&mut self) -> Result<(), ShmError> {
        if !self.owns_name {
            return Ok(());
        }
        self.owns_name = false;
        unlink_name(&self.name)
    }

    fn seq(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset & 7 == 0 && offset + 8 <= self.map.len());
        // SAFETY: the mapping is page-aligned and at least a header long (checked in create and
        // open); both offsets are multiples of 8 inside the header (checked at compile time in
        // `layout`); AtomicU64 has the size and alignment of u64; the pointer comes from the
        // mapping's raw pointer, not from a shared slice; the other process only touches these
        // words atomically.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU64) }
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        if self.owns_name {
            let _ = unlink_name(&self.name);
        }
    }
}

/// shm_unlink by name.
pub fn unlink_name(name: &str) -> Result<(), ShmError> {
    let cname = checked_name(name)?;
    // SAFETY: valid C string.
    if unsafe { libc::shm_unlink(cname.as_ptr()) } != 0 {
        return Err(os_error("shm_unlink", name));
    }
    Ok(())
}

fn checked_name(name: &str) -> Result<CString, ShmError> {
    let bad = |reason| ShmError::InvalidName {
        name: name.to_string(),
        reason,
    };
    if !name.starts_with('/') || name.len() < 2 {
        return Err(bad(
            "must start with '/' and have at least one more character",
        ));
    }
    if name[1..].contains('/') {
        return Err(bad("must not contain '/' after the first character"));
    }
    if name.len() > 255 {
        return Err(bad("longer than 255 bytes"));
    }
    CString::new(name).map_err(|_| bad("contains a NUL byte"))
}

fn os_error(op: &'static str, name: &str) -> ShmError {
    os_err(std::io::Error::last_os_error(), op, name)
}

fn os_err(source: std::io::Error, op: &'static str, name: &str) -> ShmError {
    ShmError::Os {
        op,
        name: name.to_string(),
        source,
    }
}

//! The shared-memory region of one tensor-parallel group: created by the server (O_EXCL, mode
//! 0600, unguessable name, like the step segments), mapped by each of the group's agent
//! processes (its ranks), through which they sum (all-reduce) and gather f32 rows.
//!
//! Layout: a `#[repr(C)]` header (magic, version, layout hash, ranks, slot size, offsets) on the
//! first page; on the second, one cache line per rank (its pid, whether it has joined, the last
//! collective it arrived at) and one shared line (a futex word bumped by every arrival, and an
//! abort word); then the data: two sets of one slot per rank, `slot_floats` f32 each.
//!
//! A collective: every rank writes its part into its own slot of the set the collective's
//! number picks (odd/even), arrives (stores the number, bumps the futex word and wakes the
//! others), waits until every rank has arrived, then reads the slots. Alternating the two sets
//! makes one barrier per collective enough: a rank writes a set again only after every rank has
//! arrived at the collective in between, which each does only once it has read that set. Sums
//! are taken in rank order, so every rank gets the same bits.
//!
//! Waiting is bounded and notices a dead peer: it spins briefly, polls yielding its core for up
//! to 2 ms, then sleeps on the futex word in short slices, between which it looks at the peers' process descriptors (pidfd; a peer
//! that exited, zombie or not, is dead) and at the abort word, and gives up at its deadline.
//! Any failure poisons the member (later collectives fail at once) and raises the abort word,
//! so the other ranks stop waiting too; the server then restarts the whole group on a fresh
//! region.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytemuck::{Pod, Zeroable};
use memmap2::MmapMut;
use thiserror::Error;

use super::{checked_name, os_err, os_error, unlink_name, ShmError, MAX_SEGMENT_BYTES};

/// "NPUTPG" + two version-independent bytes, read as a little-endian u64.
pub const GROUP_MAGIC: u64 = u64::from_le_bytes(*b"NPUTPG\x00\x01");
/// Version of the region's layout and of its protocol.
pub const GROUP_VERSION: u32 = 1;
/// The control lines start on the second page.
pub const GROUP_CONTROL_OFFSET: u64 = 4096;
/// Bytes of one control line (a cache line).
const LINE: u64 = 64;
/// The most ranks a group may have.
pub const MAX_GROUP_RANKS: u32 = 64;
/// Group regions are named by `segment_name(GROUP_REGION_ID_BASE + group)`, apart from every
/// agent's and the handoff region's ids.
pub const GROUP_REGION_ID_BASE: u32 = 0xF000_0000;

/// Values one collective round carries in the region of a model `hidden` wide whose steps
/// carry at most `max_tokens` tokens: an all-reduce of a whole step's hidden rows goes in one
/// round (longer data, e.g. logit rows, in several).
pub fn slot_floats_for(hidden: usize, max_tokens: usize) -> u64 {
    (hidden as u64).saturating_mul(max_tokens as u64).max(4096)
}

/// The region header, at offset 0.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct GroupHeader {
    pub magic: u64,
    pub version: u32,
    pub header_size: u32,
    pub layout_hash: u64,
    pub ranks: u32,
    pub _pad: u32,
    /// f32 values per slot (a multiple of 16: slots start on cache lines).
    pub slot_floats: u64,
    pub control_offset: u64,
    pub data_offset: u64,
    pub total_size: u64,
}

const _: () = assert!(std::mem::size_of::<GroupHeader>() == 64);

/// Where each part of a region of `ranks` ranks and `slot_floats` per slot lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GroupLayout {
    ranks: u32,
    slot_floats: u64,
    data_offset: u64,
    total_size: u64,
}

impl GroupLayout {
    fn new(ranks: u32, slot_floats: u64) -> Result<Self, ShmError> {
        if !(1..=MAX_GROUP_RANKS).contains(&ranks) {
            return Err(ShmError::BadCapacities(format!(
                "a group of {ranks} ranks (1..={MAX_GROUP_RANKS})"
            )));
        }
        let slot_floats = slot_floats.max(16).next_multiple_of(16);
        // The rank lines, then the shared line, rounded to pages.
        let control = (ranks as u64 + 1) * LINE;
        let data_offset = (GROUP_CONTROL_OFFSET + control).next_multiple_of(4096);
        let total = slot_floats
            .checked_mul(4 * 2 * ranks as u64)
            .and_then(|d| d.checked_add(data_offset))
            .filter(|&t| t <= MAX_SEGMENT_BYTES)
            .ok_or_else(|| {
                ShmError::BadCapacities(format!(
                    "a group region of {ranks} ranks x 2 x {slot_floats} floats is over the limit \
                     of {MAX_SEGMENT_BYTES} bytes"
                ))
            })?;
        Ok(Self {
            ranks,
            slot_floats,
            data_offset,
            total_size: total,
        })
    }

    /// FNV-1a over the layout's words, as the step segment's hash.
    fn hash(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for v in [
            GROUP_MAGIC,
            GROUP_VERSION as u64,
            std::mem::size_of::<GroupHeader>() as u64,
            self.ranks as u64,
            self.slot_floats,
            GROUP_CONTROL_OFFSET,
            self.data_offset,
            self.total_size,
        ] {
            for byte in v.to_le_bytes() {
                h ^= byte as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        h
    }

    fn header(&self) -> GroupHeader {
        GroupHeader {
            magic: GROUP_MAGIC,
            version: GROUP_VERSION,
            header_size: std::mem::size_of::<GroupHeader>() as u32,
            layout_hash: self.hash(),
            ranks: self.ranks,
            _pad: 0,
            slot_floats: self.slot_floats,
            control_offset: GROUP_CONTROL_OFFSET,
            data_offset: self.data_offset,
            total_size: self.total_size,
        }
    }
}

/// Why a collective (or joining the group) failed.
#[derive(Debug, Error)]
pub enum GroupError {
    #[error("tensor-parallel group: rank {rank} (pid {pid}) died")]
    PeerDied { rank: u32, pid: u32 },
    #[error("tensor-parallel group: rank {by} gave up ({code}); this rank stops too")]
    Aborted { by: u32, code: &'static str },
    #[error("tensor-parallel group: {what}: ranks {missing:?} did not arrive within {waited:?}")]
    Timeout {
        what: &'static str,
        missing: Vec<u32>,
        waited: Duration,
    },
    #[error("tensor-parallel group: an earlier collective failed; the group must be restarted")]
    Poisoned,
    #[error("tensor-parallel group: {0}")]
    Bad(String),
    #[error("tensor-parallel group: {0}")]
    Shm(#[from] ShmError),
}

/// Why a rank raised the abort word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum AbortCode {
    PeerDied = 1,
    Timeout = 2,
    Failed = 3,
}

fn code_name(code: u32) -> &'static str {
    match code {
        1 => "it saw a peer die",
        2 => "it waited past its deadline",
        4 => "the server is taking the group down",
        _ => "its step failed",
    }
}

/// One mapping of a group's region. The creator (the server) owns the name.
pub struct GroupRegion {
    name: String,
    map: MmapMut,
    layout: GroupLayout,
    owns_name: bool,
}

impl std::fmt::Debug for GroupRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupRegion")
            .field("name", &self.name)
            .field("ranks", &self.layout.ranks)
            .field("slot_floats", &self.layout.slot_floats)
            .field("owns_name", &self.owns_name)
            .finish()
    }
}

impl GroupRegion {
    /// Creates the region (fails if the name exists), mode 0600, for `ranks` ranks exchanging
    /// up to `slot_floats` values per collective round.
    pub fn create(name: &str, ranks: u32, slot_floats: u64) -> Result<Self, ShmError> {
        let layout = GroupLayout::new(ranks, slot_floats)?;
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
            file.set_len(layout.total_size)
                .map_err(|e| os_err(e, "ftruncate", name))?;
            // SAFETY: the region is shared only with the group's agents, which never resize it;
            // the control words are only touched atomically and the slots are plain f32 bytes.
            unsafe { MmapMut::map_mut(&file) }.map_err(|e| os_err(e, "mmap", name))
        })();
        let mut map = match mapped {
            Ok(map) => map,
            Err(e) => {
                let _ = unlink_name(name);
                return Err(e);
            }
        };
        let header = layout.header();
        map[..std::mem::size_of::<GroupHeader>()].copy_from_slice(bytemuck::bytes_of(&header));
        Ok(Self {
            name: name.to_string(),
            map,
            layout,
            owns_name: true,
        })
    }

    /// Opens the region and checks its header (magic, version, layout hash, size).
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
        let hsize = std::mem::size_of::<GroupHeader>() as u64;
        if size < GROUP_CONTROL_OFFSET {
            return Err(ShmError::TooSmall {
                size,
                needed: GROUP_CONTROL_OFFSET,
            });
        }
        if size > MAX_SEGMENT_BYTES {
            return Err(ShmError::LayoutMismatch(format!(
                "group region is {size} bytes, more than the limit of {MAX_SEGMENT_BYTES}"
            )));
        }
        // SAFETY: as in `create`; the mapping's length is fixed at map time.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| os_err(e, "mmap", name))?;
        let h: GroupHeader = bytemuck::pod_read_unaligned(&map[..hsize as usize]);
        if h.magic != GROUP_MAGIC {
            return Err(ShmError::BadMagic { found: h.magic });
        }
        if h.version != GROUP_VERSION {
            return Err(ShmError::VersionMismatch {
                found: h.version,
                expected: GROUP_VERSION,
            });
        }
        let layout = GroupLayout::new(h.ranks, h.slot_floats)?;
        if h.header_size as u64 != hsize
            || h.control_offset != GROUP_CONTROL_OFFSET
            || h.data_offset != layout.data_offset
            || h.total_size != layout.total_size
            || h.slot_floats != layout.slot_floats
            || h.layout_hash != layout.hash()
            || size != layout.total_size
        {
            return Err(ShmError::LayoutMismatch(format!(
                "group region header {h:?} does not describe a {size}-byte region"
            )));
        }
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

    pub fn ranks(&self) -> u32 {
        self.layout.ranks
    }

    /// Values one collective round moves per rank.
    pub fn slot_floats(&self) -> usize {
        self.layout.slot_floats as usize
    }

    /// The layout hash (the header's), for handshakes and logs.
    pub fn layout_hash(&self) -> u64 {
        self.layout.hash()
    }

    fn word32(&self, offset: u64) -> &AtomicU32 {
        debug_assert!(offset.is_multiple_of(4) && offset + 4 <= self.map.len() as u64);
        // SAFETY: the offset lies in the control page (checked against the layout when the
        // region was created or opened), is 4-aligned in a page-aligned mapping, and the word
        // is only ever accessed atomically by every process.
        unsafe { &*(self.map.as_ptr().add(offset as usize) as *const AtomicU32) }
    }

    fn word64(&self, offset: u64) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= self.map.len() as u64);
        // SAFETY: as `word32`, 8-aligned.
        unsafe { &*(self.map.as_ptr().add(offset as usize) as *const AtomicU64) }
    }

    fn line(&self, rank: u32) -> u64 {
        GROUP_CONTROL_OFFSET + rank as u64 * LINE
    }

    fn pid_word(&self, rank: u32) -> &AtomicU32 {
        self.word32(self.line(rank))
    }

    fn joined_word(&self, rank: u32) -> &AtomicU32 {
        self.word32(self.line(rank) + 4)
    }

    fn arrived_word(&self, rank: u32) -> &AtomicU64 {
        self.word64(self.line(rank) + 8)
    }

    fn shared_line(&self) -> u64 {
        self.line(self.layout.ranks)
    }

    /// The futex word: bumped by every arrival.
    fn epoch(&self) -> &AtomicU32 {
        self.word32(self.shared_line())
    }

    /// 0, or (the aborting rank + 1) in the low 16 bits and its code above.
    fn abort_word(&self) -> &AtomicU32 {
        self.word32(self.shared_line() + 4)
    }

    /// Pointer to the first value of `rank`'s slot in set `set`.
    fn slot_ptr(&self, set: u64, rank: u32) -> *mut f32 {
        let off = self.layout.data_offset
            + (set * self.layout.ranks as u64 + rank as u64) * self.layout.slot_floats * 4;
        debug_assert!(off + self.layout.slot_floats * 4 <= self.map.len() as u64);
        // SAFETY: `off` and the slot after it lie inside the mapping (the layout sized it so).
        unsafe { self.map.as_ptr().add(off as usize) as *mut f32 }
    }

    /// Raises the abort word for every rank (the server, when one rank of the group failed to
    /// start: the others stop waiting for it to join).
    pub fn abort_all(&self) {
        let _ = self.abort_word().compare_exchange(
            0,
            (4 << 16) | 0xffff,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        bump_and_wake(self.epoch());
    }

    /// Joins the group as `rank`: records this process's pid, then waits (until `deadline`)
    /// for every rank to have joined. Collectives then wait at most `wait` for the slowest
    /// rank.
    pub fn join(
        self,
        rank: u32,
        wait: Duration,
        deadline: Instant,
    ) -> Result<GroupMember, GroupError> {
        let ranks = self.layout.ranks;
        if rank >= ranks {
            return Err(GroupError::Bad(format!(
                "rank {rank} of a group of {ranks}"
            )));
        }
        if self.joined_word(rank).load(Ordering::Acquire) != 0 {
            return Err(GroupError::Bad(format!(
                "rank {rank} has joined this region already"
            )));
        }
        self.pid_word(rank)
            .store(std::process::id(), Ordering::Relaxed);
        self.joined_word(rank).store(1, Ordering::Release);
        bump_and_wake(self.epoch());
        let started = Instant::now();
        loop {
            let missing: Vec<u32> = (0..ranks)
                .filter(|&r| self.joined_word(r).load(Ordering::Acquire) == 0)
                .collect();
            if missing.is_empty() {
                break;
            }
            if let Some(e) = aborted(self.abort_word()) {
                return Err(e);
            }
            if Instant::now() >= deadline {
                return Err(GroupError::Timeout {
                    what: "joining",
                    missing,
                    waited: started.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut peers = Vec::new();
        for r in (0..ranks).filter(|&r| r != rank) {
            let pid = self.pid_word(r).load(Ordering::Acquire);
            peers.push(Peer::watch(r, pid)?);
        }
        Ok(GroupMember {
            region: self,
            rank,
            generation: 0,
            peers,
            wait,
            poisoned: false,
            waited: Duration::ZERO,
        })
    }
}

#[cfg(test)]
impl GroupRegion {
    /// Records `pid` as rank `rank`, joined (a stand-in process in tests).
    fn mark_joined(&self, rank: u32, pid: u32) {
        self.pid_word(rank).store(pid, Ordering::Relaxed);
        self.joined_word(rank).store(1, Ordering::Release);
    }
}

impl Drop for GroupRegion {
    fn drop(&mut self) {
        if self.owns_name {
            let _ = unlink_name(&self.name);
        }
    }
}

/// Another rank's process, watched for its exit.
struct Peer {
    rank: u32,
    pid: u32,
    /// A pidfd (readable once the process has exited); None where the kernel has none, and
    /// the process's state is read from /proc instead.
    fd: Option<OwnedFd>,
}

impl Peer {
    fn watch(rank: u32, pid: u32) -> Result<Self, GroupError> {
        if pid == 0 {
            return Err(GroupError::Bad(format!("rank {rank} joined without a pid")));
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd >= 0 {
            // SAFETY: a fresh descriptor owned by nobody else.
            let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
            // SAFETY: fcntl with integer arguments on a descriptor we own.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
            return Ok(Self {
                rank,
                pid,
                fd: Some(fd),
            });
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ESRCH) => Err(GroupError::PeerDied { rank, pid }),
            _ => Ok(Self {
                rank,
                pid,
                fd: None,
            }),
        }
    }

    fn dead(&self) -> bool {
        match &self.fd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: poll on one valid pollfd, no waiting.
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                n > 0 && p.revents != 0
            }
            None => {
                let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid));
                match stat {
                    Err(_) => true,
                    Ok(s) => matches!(
                        s.rsplit(')')
                            .next()
                            .and_then(|r| r.trim_start().chars().next()),
                        Some('Z') | Some('X')
                    ),
                }
            }
        }
    }
}

/// How long a waiting rank spins before it sleeps on the futex word.
const SPIN: Duration = Duration::from_micros(50);
/// How long a waiting rank keeps polling (yielding its core between looks) before it sleeps on
/// the futex word. A sleeping rank is woken by the last arrival, and a woken rank may take the
/// arriving rank's core from it on a busy machine; the ranks' compute between two collectives is
/// a fraction of a millisecond at decode, so most waits end within this time without a sleep.
const POLL: Duration = Duration::from_millis(2);
/// The longest sleep between looks at the peers and the abort word.
const SLICE: Duration = Duration::from_millis(2);

/// One rank's membership in a group: the collectives.
pub struct GroupMember {
    region: GroupRegion,
    rank: u32,
    /// Collectives so far (the same count on every rank).
    generation: u64,
    peers: Vec<Peer>,
    wait: Duration,
    poisoned: bool,
    /// Time spent at barriers waiting for the other ranks to arrive.
    waited: Duration,
}

impl std::fmt::Debug for GroupMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupMember")
            .field("region", &self.region.name)
            .field("rank", &self.rank)
            .field("ranks", &self.region.layout.ranks)
            .field("generation", &self.generation)
            .finish()
    }
}

impl GroupMember {
    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn ranks(&self) -> u32 {
        self.region.layout.ranks
    }

    pub fn region_name(&self) -> &str {
        &self.region.name
    }

    /// Collective rounds so far, and the time spent waiting at their barriers for the other
    /// ranks (the rest of a collective's time is copying and summing).
    pub fn stats(&self) -> (u64, Duration) {
        (self.generation, self.waited)
    }

    /// Values one collective round moves per rank (longer data goes in several rounds).
    pub fn slot_floats(&self) -> usize {
        self.region.slot_floats()
    }

    /// Tells the other ranks to stop waiting (this rank's step failed) and poisons this member.
    pub fn abort(&mut self) {
        self.raise(AbortCode::Failed);
    }

    fn raise(&mut self, code: AbortCode) {
        self.poisoned = true;
        let word = ((code as u32) << 16) | (self.rank + 1);
        let _ =
            self.region
                .abort_word()
                .compare_exchange(0, word, Ordering::AcqRel, Ordering::Acquire);
        bump_and_wake(self.region.epoch());
    }

    /// Every rank's `x` becomes the sum of all ranks' `x`, added in rank order (the same bits on
    /// every rank). Every rank must pass the same length.
    pub fn all_reduce_sum(&mut self, x: &mut [f32]) -> Result<(), GroupError> {
        let cap = self.slot_floats();
        for part in x.chunks_mut(cap) {
            let set = self.begin()?;
            let ranks = self.ranks();
            // SAFETY: this rank's slot of `set` holds `cap` >= part.len() values, and no other
            // rank touches it until every rank has arrived at the next collective.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    part.as_ptr(),
                    self.region.slot_ptr(set, self.rank),
                    part.len(),
                )
            };
            self.arrive_and_wait("all-reduce")?;
            let n = part.len();
            // SAFETY: every rank has written its slot of `set` and arrived; none writes it
            // again before this rank has arrived at the next collective (the alternating sets).
            let slots: Vec<&[f32]> = (0..ranks)
                .map(|r| unsafe { std::slice::from_raw_parts(self.region.slot_ptr(set, r), n) })
                .collect();
            sum_in_rank_order(&slots, part);
        }
        Ok(())
    }

    /// `out` gets every rank's `mine` one after the other, in rank order (`out.len()` =
    /// ranks x `mine.len()`; every rank passes the same length).
    pub fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), GroupError> {
        self.gather(mine, Some(out), true)
    }

    /// `all_gather` whose result only rank 0 needs: the other ranks pass None for `out` (and
    /// copy nothing out).
    pub fn gather_to_root(
        &mut self,
        mine: &[f32],
        out: Option<&mut [f32]>,
    ) -> Result<(), GroupError> {
        self.gather(mine, out, false)
    }

    fn gather(
        &mut self,
        mine: &[f32],
        mut out: Option<&mut [f32]>,
        everyone: bool,
    ) -> Result<(), GroupError> {
        let m = mine.len();
        let ranks = self.ranks() as usize;
        let wanted = everyone || self.rank == 0;
        match out.as_deref() {
            Some(o) if o.len() != m * ranks => {
                return Err(GroupError::Bad(format!(
                    "gather of {m} values per rank into {} values ({ranks} ranks)",
                    o.len()
                )))
            }
            None if wanted => {
                return Err(GroupError::Bad(format!(
                    "rank {} needs somewhere to gather into",
                    self.rank
                )))
            }
            _ => {}
        }
        let cap = self.slot_floats();
        let mut at = 0;
        while at < m || (m == 0 && at == 0) {
            let n = (m - at).min(cap);
            let set = self.begin()?;
            // SAFETY: as in `all_reduce_sum`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    mine[at..].as_ptr(),
                    self.region.slot_ptr(set, self.rank),
                    n,
                )
            };
            self.arrive_and_wait("all-gather")?;
            if let Some(o) = out.as_deref_mut().filter(|_| wanted) {
                for r in 0..ranks {
                    // SAFETY: as in `all_reduce_sum`.
                    let src = unsafe {
                        std::slice::from_raw_parts(self.region.slot_ptr(set, r as u32), n)
                    };
                    o[r * m + at..r * m + at + n].copy_from_slice(src);
                }
            }
            if m == 0 {
                break;
            }
            at += n;
        }
        Ok(())
    }

    /// Waits until every rank has got here (a collective without data).
    pub fn barrier(&mut self) -> Result<(), GroupError> {
        self.begin()?;
        self.arrive_and_wait("barrier")
    }

    /// The next collective's number and data set; an error on a poisoned member.
    fn begin(&mut self) -> Result<u64, GroupError> {
        if self.poisoned {
            return Err(GroupError::Poisoned);
        }
        self.generation += 1;
        Ok(self.generation % 2)
    }

    fn arrive_and_wait(&mut self, what: &'static str) -> Result<(), GroupError> {
        let g = self.generation;
        let region = &self.region;
        let ranks = region.layout.ranks;
        fence(Ordering::Release);
        region.arrived_word(self.rank).store(g, Ordering::Release);
        bump_and_wake(region.epoch());
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            let epoch = region.epoch().load(Ordering::Acquire);
            // An abort wins even over a complete collective: the group is going down.
            if let Some(e) = aborted(region.abort_word()) {
                self.poisoned = true;
                return Err(e);
            }
            if (0..ranks).all(|r| region.arrived_word(r).load(Ordering::Acquire) >= g) {
                fence(Ordering::Acquire);
                self.waited += started.elapsed();
                return Ok(());
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let elapsed = started.elapsed();
            if elapsed < SPIN {
                continue;
            }
            if elapsed < POLL {
                if spins.is_multiple_of(64 * 64) && self.peers.iter().any(Peer::dead) {
                    // Noticed below.
                } else {
                    std::thread::yield_now();
                    continue;
                }
            }
            if let Some(p) = self.peers.iter().find(|p| p.dead()) {
                let e = GroupError::PeerDied {
                    rank: p.rank,
                    pid: p.pid,
                };
                self.raise(AbortCode::PeerDied);
                return Err(e);
            }
            let waited = started.elapsed();
            if waited >= self.wait {
                let missing = (0..ranks)
                    .filter(|&r| region.arrived_word(r).load(Ordering::Acquire) < g)
                    .collect();
                self.raise(AbortCode::Timeout);
                return Err(GroupError::Timeout {
                    what,
                    missing,
                    waited,
                });
            }
            futex_wait(region.epoch(), epoch, SLICE.min(self.wait - waited));
        }
    }
}

/// `out[i]` = the sum over `slots` (in order) of `slots[r][i]`.
fn sum_in_rank_order(slots: &[&[f32]], out: &mut [f32]) {
    match slots {
        [] => {}
        [a] => out.copy_from_slice(&a[..out.len()]),
        [a, b] => {
            for ((o, x), y) in out.iter_mut().zip(a.iter()).zip(b.iter()) {
                *o = x + y;
            }
        }
        [first, rest @ ..] => {
            out.copy_from_slice(&first[..out.len()]);
            for s in rest {
                for (o, x) in out.iter_mut().zip(s.iter()) {
                    *o += x;
                }
            }
        }
    }
}

fn aborted(word: &AtomicU32) -> Option<GroupError> {
    let w = word.load(Ordering::Acquire);
    (w != 0).then(|| GroupError::Aborted {
        by: (w & 0xffff) - 1,
        code: code_name(w >> 16),
    })
}

fn bump_and_wake(word: &AtomicU32) {
    word.fetch_add(1, Ordering::AcqRel);
    // SAFETY: FUTEX_WAKE on a 4-aligned word of a shared mapping; no memory is written.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
        )
    };
}

/// Sleeps until `word` changes from `seen`, a wake, or `timeout`.
fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a 4-aligned word of a shared mapping with a relative timeout; it
    // only reads the word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
        )
    };
}

#[cfg(test)]
mod tests;

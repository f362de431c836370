//! The emulation's HCCL communicator: a shared-memory file per communicator, so that the ranks
//! of one group may be threads of one process (the conformance suite) or separate processes
//! (the server's agents) alike.
//!
//! The file is `/dev/shm/ascend-emulator-hccl-<id>` (`<id>`: the 16 random bytes of the root
//! info, in hex), created `O_EXCL` with mode 0600 by the first rank to arrive and unlinked once
//! every rank has joined. Layout: a header page (magic, ranks, slot bytes, the broken flag and
//! its message); one 128-byte line per rank (joined, pid, device, the last round it posted,
//! destroyed); then two sets of one slot per rank, each a 64-byte descriptor (collective number,
//! kind, dtype, op, count, bytes) and `SLOT_BYTES` of data.
//!
//! One collective is one or more rounds (data longer than a slot goes in pieces). A round: every
//! rank writes its descriptor and piece into its slot of the set the round's number picks
//! (odd/even), stores the round number, waits until every rank has posted it, then checks that
//! every descriptor is the same collective with the same count, dtype and op — a difference
//! marks the communicator broken, and every rank fails with `HCCL_E_PARA` and a message naming
//! both calls — and reads the pieces. A rank writes a set again only after every rank has posted
//! the round in between, which each does only after reading that set, so two sets suffice.
//! Waiting notices a broken communicator, a peer that destroyed its communicator or whose
//! process exited, and gives up after `HCCL_EXEC_TIMEOUT` seconds (`HCCL_CONNECT_TIMEOUT` while
//! joining; 120 s each unless set) with `HCCL_E_TIMEOUT`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use npu_ffi::hccl::*;

/// The root info's first bytes: a root info from the emulation's `HcclGetRootInfo`.
pub const ROOT_MAGIC: &[u8; 8] = b"EMUHCCL1";
const FILE_MAGIC: u64 = u64::from_le_bytes(*b"EMUHCCLF");
pub const MAX_RANKS: u32 = 64;
/// Bytes of one rank's piece of one round.
pub const SLOT_BYTES: u64 = 4 << 20;
const LINE: u64 = 128;
const LINES_AT: u64 = 1024;
const SLOT_HEADER: u64 = 64;
const DATA_AT: u64 = LINES_AT + LINE * MAX_RANKS as u64 + 1024 * 3;
const MSG_AT: u64 = 64;
const MSG_BYTES: usize = 896;

// Header words.
const H_MAGIC: u64 = 0;
const H_RANKS: u64 = 8;
const H_SLOT: u64 = 16;
const H_BROKEN: u64 = 24;
// Rank line words.
const L_JOINED: u64 = 0;
const L_PID: u64 = 8;
const L_DEVICE: u64 = 16;
const L_POSTED: u64 = 24;
const L_DESTROYED: u64 = 32;

/// A failure: an HcclResult and the message `aclGetRecentErrMsg` returns.
pub type Fail = (HcclResult, String);

/// What one collective call is, as every rank must agree on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    pub kind: u64,
    pub dtype: HcclDataType,
    pub op: HcclReduceOp,
    pub count: u64,
}

pub const KIND_ALL_REDUCE: u64 = 1;
pub const KIND_ALL_GATHER: u64 = 2;

pub fn dtype_name(d: HcclDataType) -> &'static str {
    match d {
        HCCL_DATA_TYPE_INT8 => "int8",
        HCCL_DATA_TYPE_INT32 => "int32",
        HCCL_DATA_TYPE_FP16 => "fp16",
        HCCL_DATA_TYPE_FP32 => "fp32",
        HCCL_DATA_TYPE_BFP16 => "bfp16",
        _ => "another dtype",
    }
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            KIND_ALL_REDUCE => write!(
                f,
                "HcclAllReduce(count {}, {}, op {})",
                self.count,
                dtype_name(self.dtype),
                match self.op {
                    HCCL_REDUCE_SUM => "sum",
                    HCCL_REDUCE_PROD => "prod",
                    HCCL_REDUCE_MAX => "max",
                    HCCL_REDUCE_MIN => "min",
                    _ => "unknown",
                }
            ),
            KIND_ALL_GATHER => write!(
                f,
                "HcclAllGather(sendCount {}, {})",
                self.count,
                dtype_name(self.dtype)
            ),
            _ => write!(f, "nothing"),
        }
    }
}

fn timeout(var: &str) -> Duration {
    Duration::from_secs(
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&s| s > 0)
            .unwrap_or(120),
    )
}

pub fn file_name(id: &[u8]) -> String {
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    format!("/dev/shm/ascend-emulator-hccl-{hex}")
}

/// A communicator's file mapped in this process: the words every rank reads and writes through
/// atomics, the data slots of the round protocol and the broken message.
pub struct Mapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is process-wide shared memory; every word shared between threads or
// processes is accessed through atomics, a data slot only by the round protocol (written by its
// rank before it posts the round, read by the others after), and the message area only by the
// winner of the broken flag's exchange before it publishes the flag.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are the mapping made in `Comm::join`, unmapped once here.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl Mapping {
    fn word(&self, at: u64) -> &AtomicU64 {
        // SAFETY: every offset used is 8-aligned and inside the mapping (header, lines and slot
        // descriptors are laid out below `DATA_AT` or at slot starts, all multiples of 8); the
        // mapping lives as long as `self`.
        unsafe { &*(self.base.add(at as usize) as *const AtomicU64) }
    }

    fn line(&self, rank: u32, word: u64) -> &AtomicU64 {
        self.word(LINES_AT + LINE * rank as u64 + word)
    }

    /// Rounds rank `r` has posted.
    pub fn posted(&self, r: u32) -> u64 {
        self.line(r, L_POSTED).load(Ordering::Acquire)
    }

    /// Whether some rank of `ranks` posted a round `rank` has not: a peer waits in a collective
    /// `rank` has not reached yet.
    pub fn peer_ahead(&self, rank: u32, ranks: u32) -> bool {
        let mine = self.posted(rank);
        (0..ranks).any(|r| self.posted(r) > mine)
    }

    /// Whether the communicator is marked broken.
    pub fn is_broken(&self) -> bool {
        self.word(H_BROKEN).load(Ordering::Acquire) != 0
    }

    fn broken(&self) -> Option<String> {
        if self.word(H_BROKEN).load(Ordering::Acquire) == 0 {
            return None;
        }
        // SAFETY: the message area lies in the header page; written before the flag was set.
        let bytes =
            unsafe { std::slice::from_raw_parts(self.base.add(MSG_AT as usize), MSG_BYTES) };
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(MSG_BYTES);
        Some(String::from_utf8_lossy(&bytes[..end]).into_owned())
    }

    /// Marks the communicator broken with `msg` (the first writer's message stays).
    pub fn break_with(&self, msg: &str) {
        if self
            .word(H_BROKEN)
            .compare_exchange(0, 2, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let n = msg.len().min(MSG_BYTES - 1);
            // SAFETY: the message area lies in the header page; only the winner of the flag's
            // exchange writes it, before publishing the flag as 1.
            unsafe {
                let dst = self.base.add(MSG_AT as usize);
                std::ptr::copy_nonoverlapping(msg.as_ptr(), dst, n);
                *dst.add(n) = 0;
            }
            self.word(H_BROKEN).store(1, Ordering::Release);
        }
    }
}

/// One rank's handle on its communicator's mapping.
pub struct Comm {
    map: std::sync::Arc<Mapping>,
    pub rank: u32,
    pub ranks: u32,
    pub device: i32,
    /// Collectives called on this rank.
    seq: u64,
    /// Rounds posted by this rank.
    round: u64,
    slot: u64,
}

fn os(what: &str) -> Fail {
    (
        HCCL_E_SYSCALL,
        format!("{what}: {}", std::io::Error::last_os_error()),
    )
}

impl Comm {
    fn word(&self, at: u64) -> &AtomicU64 {
        self.map.word(at)
    }

    fn line(&self, rank: u32, word: u64) -> &AtomicU64 {
        self.map.line(rank, word)
    }

    /// The shared mapping (to mark the communicator broken, or watch its rounds, without this
    /// handle's lock).
    pub fn mapping(&self) -> std::sync::Arc<Mapping> {
        self.map.clone()
    }

    fn slot_at(&self, set: u64, rank: u32) -> u64 {
        DATA_AT + (set * self.ranks as u64 + rank as u64) * (SLOT_HEADER + self.slot)
    }

    fn total(ranks: u32, slot: u64) -> u64 {
        DATA_AT + 2 * ranks as u64 * (SLOT_HEADER + slot)
    }

    /// Joins (creating where first) the communicator of `id` as `rank` of `ranks`, on `device`;
    /// waits until every rank has joined.
    pub fn join(id: &[u8], ranks: u32, rank: u32, device: i32) -> Result<Comm, Fail> {
        let name = file_name(id);
        let cname =
            std::ffi::CString::new(name.clone()).map_err(|_| (HCCL_E_PARA, name.clone()))?;
        let deadline = Instant::now() + timeout("HCCL_CONNECT_TIMEOUT");
        let total = Self::total(ranks, SLOT_BYTES);
        // SAFETY: a NUL-terminated path; O_EXCL creation with mode 0600.
        let mut fd = unsafe {
            libc::open(
                cname.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600,
            )
        };
        let created = fd >= 0;
        if created {
            // SAFETY: a descriptor just opened; the file is sized before anyone maps it whole.
            if unsafe { libc::ftruncate(fd, total as libc::off_t) } != 0 {
                let e = os("sizing the communicator's file");
                // SAFETY: closing and unlinking what this call created.
                unsafe {
                    libc::close(fd);
                    libc::unlink(cname.as_ptr());
                }
                return Err(e);
            }
        } else {
            // SAFETY: as above, opening the existing file.
            fd = unsafe { libc::open(cname.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err((
                    HCCL_E_PARA,
                    format!(
                        "HcclCommInitRootInfo: the communicator {name} is gone (every rank joined already, or its root rank's process never made it): {}",
                        std::io::Error::last_os_error()
                    ),
                ));
            }
        }
        // Wait for the creator to size the file.
        loop {
            // SAFETY: all-zero is a valid stat; `fd` is open.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: `st` is a valid out-pointer.
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                // SAFETY: closing our descriptor.
                unsafe { libc::close(fd) };
                return Err(os("fstat of the communicator's file"));
            }
            if st.st_size as u64 >= DATA_AT {
                break;
            }
            if Instant::now() > deadline {
                // SAFETY: closing our descriptor.
                unsafe { libc::close(fd) };
                return Err((HCCL_E_TIMEOUT, format!("{name} was never sized")));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // SAFETY: mapping `total` bytes of a file at least that long (sized by its creator with
        // the same constants; a file of another size is refused below before any slot is used).
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        // SAFETY: the mapping keeps the file; the descriptor is no longer needed.
        unsafe { libc::close(fd) };
        if base == libc::MAP_FAILED {
            return Err(os("mapping the communicator's file"));
        }
        let mut comm = Comm {
            map: std::sync::Arc::new(Mapping {
                base: base.cast(),
                len: total as usize,
            }),
            rank,
            ranks,
            device,
            seq: 0,
            round: 0,
            slot: SLOT_BYTES,
        };
        if created {
            comm.word(H_RANKS).store(ranks as u64, Ordering::Relaxed);
            comm.word(H_SLOT).store(SLOT_BYTES, Ordering::Relaxed);
            comm.word(H_MAGIC).store(FILE_MAGIC, Ordering::Release);
        }
        while comm.word(H_MAGIC).load(Ordering::Acquire) != FILE_MAGIC {
            if Instant::now() > deadline {
                return Err((HCCL_E_TIMEOUT, format!("{name} was never initialised")));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let theirs = comm.word(H_RANKS).load(Ordering::Relaxed) as u32;
        if theirs != ranks || comm.word(H_SLOT).load(Ordering::Relaxed) != SLOT_BYTES {
            comm.ranks = theirs.min(ranks);
            return Err((
                HCCL_E_PARA,
                format!(
                    "HcclCommInitRootInfo: rank {rank} was told nRanks {ranks}, the root info's communicator has {theirs}"
                ),
            ));
        }
        if comm
            .line(rank, L_JOINED)
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err((
                HCCL_E_PARA,
                format!("HcclCommInitRootInfo: rank {rank} joined this communicator twice"),
            ));
        }
        comm.line(rank, L_PID)
            .store(std::process::id() as u64, Ordering::Relaxed);
        comm.line(rank, L_DEVICE)
            .store(device as u64 + 1, Ordering::Release);
        // Every rank joined, each on its own device.
        for r in 0..ranks {
            while comm.line(r, L_DEVICE).load(Ordering::Acquire) == 0 {
                if Instant::now() > deadline {
                    comm.line(rank, L_DESTROYED).store(1, Ordering::Release);
                    return Err((
                        HCCL_E_TIMEOUT,
                        format!(
                            "HcclCommInitRootInfo: rank {r} of {ranks} never joined within HCCL_CONNECT_TIMEOUT"
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            let d = comm.line(r, L_DEVICE).load(Ordering::Acquire) as i64 - 1;
            let pid = comm.line(r, L_PID).load(Ordering::Relaxed);
            if r != rank && d == device as i64 && pid == std::process::id() as u64 {
                comm.line(rank, L_DESTROYED).store(1, Ordering::Release);
                return Err((
                    HCCL_E_PARA,
                    format!(
                        "HcclCommInitRootInfo: ranks {r} and {rank} are both on device {device}; each rank of a communicator needs its own device"
                    ),
                ));
            }
        }
        // Everyone has the file open: its name can go.
        // SAFETY: a NUL-terminated path; ENOENT (another rank unlinked it) is fine.
        unsafe { libc::unlink(cname.as_ptr()) };
        Ok(comm)
    }

    /// Marks this rank's communicator destroyed (peers waiting on it fail).
    pub fn destroy(&self) {
        self.line(self.rank, L_DESTROYED)
            .store(1, Ordering::Release);
    }

    fn broken(&self) -> Option<String> {
        self.map.broken()
    }

    /// Marks the communicator broken with `msg` (the first writer's message stays).
    pub fn break_with(&self, msg: &str) {
        self.map.break_with(msg)
    }

    fn wait_round(&self, round: u64, deadline: Instant) -> Result<(), Fail> {
        let mut spins = 0u32;
        loop {
            if let Some(m) = self.broken() {
                return Err((HCCL_E_PARA, m));
            }
            let mut all = true;
            for r in 0..self.ranks {
                if self.line(r, L_POSTED).load(Ordering::Acquire) >= round {
                    continue;
                }
                all = false;
                if self.line(r, L_DESTROYED).load(Ordering::Acquire) != 0 {
                    return Err((
                        HCCL_E_REMOTE,
                        format!("rank {r} destroyed its communicator while rank {} waited for it in a collective", self.rank),
                    ));
                }
                let pid = self.line(r, L_PID).load(Ordering::Relaxed) as libc::pid_t;
                // SAFETY: signal 0 only checks that the process exists.
                if pid > 0
                    && unsafe { libc::kill(pid, 0) } != 0
                    && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
                {
                    return Err((HCCL_E_REMOTE, format!("rank {r}'s process ({pid}) is gone")));
                }
            }
            if all {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err((
                    HCCL_E_TIMEOUT,
                    format!(
                        "rank {}: the other ranks did not call collective #{} within HCCL_EXEC_TIMEOUT",
                        self.rank, self.seq
                    ),
                ));
            }
            spins += 1;
            if spins < 200 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// One collective: `mine` (this rank's `count` elements of `es` bytes) in, every rank's
    /// bytes out (`on_piece(rank, offset, bytes)` for each piece of each rank).
    pub fn exchange(
        &mut self,
        call: Call,
        mine: &[u8],
        mut on_piece: impl FnMut(u32, usize, &[u8]),
    ) -> Result<(), Fail> {
        if let Some(m) = self.broken() {
            return Err((HCCL_E_PARA, format!("the communicator is broken: {m}")));
        }
        self.seq += 1;
        let deadline = Instant::now() + timeout("HCCL_EXEC_TIMEOUT");
        let piece = self.slot as usize;
        let pieces = mine.len().div_ceil(piece).max(1);
        for k in 0..pieces {
            let part = &mine[(k * piece).min(mine.len())..((k + 1) * piece).min(mine.len())];
            self.round += 1;
            let at = self.slot_at(self.round % 2, self.rank);
            let desc = [
                self.seq,
                call.kind,
                call.dtype as u64,
                call.op as u64,
                call.count,
                part.len() as u64,
            ];
            for (i, v) in desc.iter().enumerate() {
                self.word(at + 8 * i as u64).store(*v, Ordering::Relaxed);
            }
            // SAFETY: the slot's data area lies in the mapping (`part` is at most a slot long);
            // no other rank reads it before this rank posts the round below.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    part.as_ptr(),
                    self.map.base.add((at + SLOT_HEADER) as usize),
                    part.len(),
                )
            };
            self.line(self.rank, L_POSTED)
                .store(self.round, Ordering::Release);
            self.wait_round(self.round, deadline)?;
            for r in 0..self.ranks {
                let at = self.slot_at(self.round % 2, r);
                let d: Vec<u64> = (0..6)
                    .map(|i| self.word(at + 8 * i).load(Ordering::Relaxed))
                    .collect();
                let theirs = Call {
                    kind: d[1],
                    dtype: d[2] as HcclDataType,
                    op: d[3] as HcclReduceOp,
                    count: d[4],
                };
                if d[0] != self.seq || theirs != call || d[5] != part.len() as u64 {
                    let msg = format!(
                        "collective #{} of this communicator: rank {} called {call} but rank {r} called {theirs}; every rank must call the same collectives with the same count, dtype and op, in the same order",
                        self.seq, self.rank
                    );
                    self.break_with(&msg);
                    return Err((HCCL_E_PARA, msg));
                }
                // SAFETY: the peer posted this round, so its slot holds `part.len()` bytes
                // (checked equal above) that it does not rewrite before this rank posts again.
                let bytes = unsafe {
                    std::slice::from_raw_parts(
                        self.map.base.add((at + SLOT_HEADER) as usize),
                        part.len(),
                    )
                };
                on_piece(r, k * piece, bytes);
            }
        }
        Ok(())
    }
}

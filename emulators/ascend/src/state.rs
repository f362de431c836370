//! The emulation's single process-wide state, shared by every library name it is loaded under
//! (`libascendcl.so`, `libnnopbase.so`, `libopapi.so` are one file): device memory, pinned host
//! memory, contexts, streams and their queued tasks, events, and the aclnn objects.
//!
//! Device memory is a separate address space: addresses handed out by `aclrtMalloc` start at
//! `DEVICE_BASE`, which is not a canonical user-space address on x86-64 or aarch64 (dereferencing
//! one on the host faults), and every device access is looked up in the allocation table — a host
//! pointer given where device memory is expected is refused, and so is a range that leaves its
//! allocation. Addresses are never reused, so a freed allocation is recognised as freed.
//! Handles (tensors, executors, streams, ...) are likewise non-dereferenceable numbers looked up
//! in tables, with a distinct prefix per kind; destroyed handles stay known as destroyed.
//!
//! Streams queue their work; it runs at `aclrtSynchronizeStream` / `aclrtSynchronizeDevice` /
//! `aclrtSynchronizeEvent`. Until then the bytes of a device-to-host async copy's destination hold
//! a poison pattern, and a synchronous copy that touches device memory a queued task reads or
//! writes is refused: results cannot be read before the stream is synchronized.
//!
//! An HCCL collective is stream work too (`crate::hccl`): it reads its send buffer when it runs,
//! then waits for the other ranks with the state's lock released (the other ranks may be threads
//! of this process that need the lock to run their own streams), then writes its result. While
//! it waits its stream is busy: other runs of that stream wait for it, and the memory it reads
//! and writes counts as queued work's. A device runs its stream without the host, so a rank that
//! waits for a peer's collective must not wait for the peer's host to synchronize: each
//! communicator has a progress thread (`hccl::progress`) that, when a peer has reached a
//! collective this rank has not run, runs this rank's stream up to that collective; a failure it
//! meets is reported by the stream's next synchronization.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::CString;
use std::sync::{LazyLock, Mutex, MutexGuard};

use npu_ffi::types::*;

use crate::objects::{Executor, Obj};

pub const DEVICE_BASE: u64 = 0x00f0_0000_0000_0000;
const DEVICE_ALIGN: u64 = 512;
/// Byte written where a result is not there yet (NaN in f16/bf16/f32, -1 in ints).
pub const POISON: u8 = 0xff;

pub const KIND_TENSOR: u64 = 0x00e1;
pub const KIND_SCALAR: u64 = 0x00e2;
pub const KIND_INT_ARRAY: u64 = 0x00e3;
pub const KIND_TENSOR_LIST: u64 = 0x00e4;
pub const KIND_EXECUTOR: u64 = 0x00e5;
pub const KIND_STREAM: u64 = 0x00e6;
pub const KIND_EVENT: u64 = 0x00e7;
pub const KIND_CONTEXT: u64 = 0x00e8;
pub const KIND_HCCL_COMM: u64 = 0x00e9;
pub const KIND_MODEL_RI: u64 = 0x00ea;

pub fn kind_name(kind: u64) -> &'static str {
    match kind {
        KIND_TENSOR => "aclTensor",
        KIND_SCALAR => "aclScalar",
        KIND_INT_ARRAY => "aclIntArray",
        KIND_TENSOR_LIST => "aclTensorList",
        KIND_EXECUTOR => "aclOpExecutor",
        KIND_STREAM => "aclrtStream",
        KIND_EVENT => "aclrtEvent",
        KIND_CONTEXT => "aclrtContext",
        KIND_HCCL_COMM => "HcclComm",
        KIND_MODEL_RI => "aclmdlRI",
        _ => "handle",
    }
}

/// An error the emulation reports: a status code and the message `aclGetRecentErrMsg` returns.
#[derive(Debug, Clone)]
pub struct Fail {
    pub code: i32,
    pub msg: String,
}

pub fn fail<T>(code: i32, msg: impl Into<String>) -> Result<T, Fail> {
    Err(Fail {
        code,
        msg: msg.into(),
    })
}

pub struct DeviceAlloc {
    pub data: Vec<u8>,
    pub device: i32,
    /// Changes whenever the bytes may have been written (caches derived from them key on it).
    pub version: u64,
}

/// What a cached conversion of device data was made from: each source tensor's address, the
/// version of its allocation, and its description, plus kernel parameters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DerivedKey {
    pub sources: Vec<(u64, u64, String)>,
    pub params: Vec<i64>,
}

/// The work of a queued task, run with the state at synchronization.
pub type TaskFn = Box<dyn FnOnce(&mut State) -> Result<(), Fail> + Send>;

/// The part of a task that runs with the state's lock released (a collective waiting for the
/// other ranks); what it returns runs with the lock held again. A task asks for it by leaving
/// it in [`State::blocking`].
pub type Blocking = Box<dyn FnOnce() -> Result<TaskFn, Fail> + Send>;

/// A task running with the lock released: its stream is busy until it is done.
pub struct InFlight {
    pub name: String,
    pub reads: Vec<(u64, u64)>,
    pub writes: Vec<(u64, u64)>,
}

/// One unit of queued stream work.
pub struct Task {
    pub name: String,
    /// Device byte ranges the task reads and writes (for hazard checks before it runs).
    pub reads: Vec<(u64, u64)>,
    pub writes: Vec<(u64, u64)>,
    pub run: TaskFn,
}

pub struct Stream {
    pub context: u64,
    pub device: i32,
    pub queue: VecDeque<Task>,
}

pub struct Context {
    pub device: i32,
    pub default_stream: u64,
}

#[derive(Default)]
pub struct Event {
    pub recorded: bool,
    pub time: Option<std::time::Instant>,
}

pub struct HostAlloc {
    pub layout: std::alloc::Layout,
}

#[derive(Default)]
pub struct State {
    pub initialized: bool,
    pub finalized: bool,
    pub next_device_addr: u64,
    pub device_used: u64,
    pub device_mem: BTreeMap<u64, DeviceAlloc>,
    pub freed: BTreeMap<u64, u64>,
    pub host_mem: HashMap<usize, HostAlloc>,
    pub next_handle: u64,
    pub handles: HashMap<u64, Obj>,
    pub streams: HashMap<u64, Stream>,
    pub contexts: HashMap<u64, Context>,
    pub events: HashMap<u64, Event>,
    pub executors: HashMap<u64, Executor>,
    pub devices_set: HashMap<i32, u64>,
    pub device_refs: HashMap<i32, u32>,
    pub next_version: u64,
    /// Weights converted to f32 once and reused while their bytes stay the same (keyed by the
    /// allocation versions they were read from): the emulation's speed, not a CANN feature.
    pub derived: HashMap<DerivedKey, std::sync::Arc<Vec<f32>>>,
    /// Live HCCL communicators (`crate::hccl`), described for the leak report.
    pub hccl_comms: BTreeMap<u64, String>,
    /// Queued collectives per communicator, in call order: (stream, ticket).
    pub hccl_queued: HashMap<u64, VecDeque<(u64, u64)>>,
    pub next_ticket: u64,
    /// Left by a running task: its part to run with the lock released.
    pub blocking: Option<Blocking>,
    /// Streams whose task runs with the lock released.
    pub busy: HashMap<u64, InFlight>,
    /// Failures of stream work that a progress thread ran, for the stream's next synchronization.
    pub stream_errors: HashMap<u64, Fail>,
    /// Open stream captures, by stream (`crate::capture`).
    pub captures: HashMap<u64, crate::capture::Capture>,
    /// Live model run instances (`aclmdlRI`), by handle.
    pub graphs: HashMap<u64, crate::capture::Graph>,
}

static STATE: LazyLock<Mutex<State>> = LazyLock::new(|| Mutex::new(State::default()));

thread_local! {
    static LAST_ERROR: std::cell::RefCell<CString> = std::cell::RefCell::new(CString::default());
    pub static CURRENT_CONTEXT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

pub fn try_state() -> Option<MutexGuard<'static, State>> {
    match STATE.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

pub fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records `f`'s message for `aclGetRecentErrMsg` and returns its code (or `ok`).
pub fn finish(r: Result<(), Fail>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(f) => {
            set_error(&f.msg);
            f.code
        }
    }
}

pub fn set_error(msg: &str) {
    let text = format!("[ascend-emulator] {msg}");
    if std::env::var_os("ASCEND_EMULATOR_VERBOSE").is_some() {
        eprintln!("{text}");
    }
    LAST_ERROR
        .with(|e| *e.borrow_mut() = CString::new(text.replace('\0', " ")).unwrap_or_default());
}

pub fn last_error_ptr() -> *const core::ffi::c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Emulated device memory per device (`ASCEND_EMULATOR_HBM_MB`, default 32 GiB).
pub fn hbm_total() -> u64 {
    std::env::var("ASCEND_EMULATOR_HBM_MB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(32 * 1024)
        << 20
}

/// Emulated device count: the length of `ASCEND_RT_VISIBLE_DEVICES` when set, else
/// `ASCEND_EMULATOR_DEVICES` (default 8).
pub fn device_count() -> u32 {
    if let Ok(v) = std::env::var("ASCEND_RT_VISIBLE_DEVICES") {
        return v.split(',').filter(|s| !s.trim().is_empty()).count() as u32;
    }
    std::env::var("ASCEND_EMULATOR_DEVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

impl State {
    pub fn require_init(&self) -> Result<(), Fail> {
        if !self.initialized || self.finalized {
            return fail(
                ACL_ERROR_UNINITIALIZE,
                "aclInit has not been called (or aclFinalize already was)",
            );
        }
        Ok(())
    }

    pub fn new_handle(&mut self, kind: u64) -> u64 {
        self.next_handle += 1;
        (kind << 48) | (self.next_handle << 4)
    }

    /// The current context of the calling thread.
    pub fn current_context(&self) -> Result<(u64, &Context), Fail> {
        let c = CURRENT_CONTEXT.with(|c| c.get());
        match self.contexts.get(&c) {
            Some(ctx) => Ok((c, ctx)),
            None => fail(
                ACL_ERROR_RT_CONTEXT_NULL,
                "no current context on this thread (call aclrtSetDevice or aclrtSetCurrentContext first)",
            ),
        }
    }

    /// Resolves a stream handle (null = the current context's default stream); the stream must
    /// belong to the calling thread's current context.
    pub fn resolve_stream(&self, stream: u64) -> Result<u64, Fail> {
        let (ctx_id, ctx) = self.current_context()?;
        let s = if stream == 0 {
            ctx.default_stream
        } else {
            stream
        };
        match self.streams.get(&s) {
            None => fail(
                ACL_ERROR_RT_INVALID_HANDLE,
                format!("stream {s:#x} is not a live aclrtStream"),
            ),
            Some(st) if st.context != ctx_id => fail(
                ACL_ERROR_RT_STREAM_CONTEXT,
                format!("stream {s:#x} belongs to another context than the thread's current one"),
            ),
            Some(_) => Ok(s),
        }
    }

    /// The allocation holding `[addr, addr+len)`: its start address.
    pub fn device_range(&self, addr: u64, len: u64, what: &str) -> Result<u64, Fail> {
        if let Some((&start, a)) = self.device_mem.range(..=addr).next_back() {
            let size = a.data.len() as u64;
            if addr < start + size.max(1) {
                if addr + len > start + size {
                    return fail(
                        ACL_ERROR_RT_PARAM_INVALID,
                        format!(
                            "{what}: {len} bytes at {addr:#x} run past the end of the {size}-byte device allocation at {start:#x}"
                        ),
                    );
                }
                return Ok(start);
            }
        }
        if let Some((&start, &size)) = self.freed.range(..=addr).next_back() {
            if addr < start + size.max(1) {
                return fail(
                    ACL_ERROR_RT_INVALID_MEMORY_TYPE,
                    format!(
                        "{what}: {addr:#x} is device memory that was already freed with aclrtFree"
                    ),
                );
            }
        }
        fail(
            ACL_ERROR_RT_INVALID_MEMORY_TYPE,
            format!("{what}: {addr:#x} is not device memory (a host pointer, or never returned by aclrtMalloc); device memory is a separate address space"),
        )
    }

    /// The version of the allocation holding `addr` (0 when there is none).
    pub fn version_of(&self, addr: u64) -> u64 {
        match self.device_mem.range(..=addr).next_back() {
            Some((&start, a)) if addr < start + (a.data.len() as u64).max(1) => a.version,
            _ => 0,
        }
    }

    /// Drops cached conversions read from `[start, start + size)`.
    pub fn forget_derived(&mut self, start: u64, size: u64) {
        self.derived.retain(|k, _| {
            !k.sources
                .iter()
                .any(|(a, _, _)| *a >= start && *a < start + size.max(1))
        });
    }

    pub fn is_device(&self, addr: u64) -> bool {
        (DEVICE_BASE..DEVICE_BASE + (1 << 52)).contains(&addr)
    }

    pub fn bytes(&self, addr: u64, len: u64) -> Result<&[u8], Fail> {
        let start = self.device_range(addr, len, "device read")?;
        let a = &self.device_mem[&start];
        let off = (addr - start) as usize;
        Ok(&a.data[off..off + len as usize])
    }

    pub fn bytes_mut(&mut self, addr: u64, len: u64) -> Result<&mut [u8], Fail> {
        let start = self.device_range(addr, len, "device write")?;
        self.next_version += 1;
        let a = self.device_mem.get_mut(&start).expect("range found");
        a.version = self.next_version;
        let off = (addr - start) as usize;
        Ok(&mut a.data[off..off + len as usize])
    }

    pub fn malloc(&mut self, size: u64) -> Result<u64, Fail> {
        if size == 0 {
            return fail(ACL_ERROR_INVALID_PARAM, "aclrtMalloc of 0 bytes");
        }
        if self.device_used + size > hbm_total() {
            return fail(
                ACL_ERROR_RT_MEMORY_ALLOCATION,
                format!(
                    "aclrtMalloc of {size} bytes: device memory exhausted ({} of {} bytes in use)",
                    self.device_used,
                    hbm_total()
                ),
            );
        }
        let device = self.current_context()?.1.device;
        if self.next_device_addr == 0 {
            self.next_device_addr = DEVICE_BASE;
        }
        let addr = self.next_device_addr;
        self.next_device_addr += size.div_ceil(DEVICE_ALIGN) * DEVICE_ALIGN + DEVICE_ALIGN;
        // Fresh device memory holds whatever was there: poison, so reading it unwritten shows.
        self.device_mem.insert(
            addr,
            DeviceAlloc {
                data: vec![POISON; size as usize],
                device,
                version: 0,
            },
        );
        self.device_used += size;
        Ok(addr)
    }

    /// Fails if queued work on any stream touches `[addr, addr+len)` (`write`: any access;
    /// otherwise: a queued write).
    pub fn check_no_pending(
        &self,
        addr: u64,
        len: u64,
        write: bool,
        what: &str,
    ) -> Result<(), Fail> {
        let overlaps = |r: &(u64, u64)| r.0 < addr + len && addr < r.0 + r.1;
        let queued = self
            .streams
            .values()
            .flat_map(|st| &st.queue)
            .map(|t| (&t.name, &t.reads, &t.writes));
        let in_flight = self.busy.values().map(|t| (&t.name, &t.reads, &t.writes));
        for (name, reads, writes) in queued.chain(in_flight) {
            let hit = writes.iter().any(overlaps) || (write && reads.iter().any(overlaps));
            if hit {
                return fail(
                    ACL_ERROR_INVALID_PARAM,
                    format!(
                        "{what}: device memory {addr:#x}+{len} is used by queued stream work ({name}) that has not run: synchronize the stream before touching its results"
                    ),
                );
            }
        }
        Ok(())
    }

    /// Runs the queued work of `stream` with the lock held throughout (for callers inside other
    /// stream work, which cannot release it): a collective waits for the other ranks holding it,
    /// so ranks that are threads of this process cannot progress meanwhile (it fails at
    /// `HCCL_EXEC_TIMEOUT`). Top-level synchronizations use [`synchronize_streams`]. The first
    /// failing task fails the run and drops the rest of the queue (the stream is then empty, as
    /// after a device error).
    pub fn run_stream(&mut self, stream: u64) -> Result<(), Fail> {
        if !self.streams.contains_key(&stream) {
            return fail(
                ACL_ERROR_RT_INVALID_HANDLE,
                format!("stream {stream:#x} is not a live aclrtStream"),
            );
        }
        if let Some(f) = self.stream_errors.remove(&stream) {
            return Err(f);
        }
        if let Some(t) = self.busy.get(&stream) {
            return fail(
                ACL_ERROR_RT_PARAM_INVALID,
                format!(
                    "stream {stream:#x} is running {} on another thread; synchronize it from the top level",
                    t.name
                ),
            );
        }
        while let Some(task) = self
            .streams
            .get_mut(&stream)
            .and_then(|s| s.queue.pop_front())
        {
            let name = task.name.clone();
            let r = match self.run_task(task) {
                Ok(None) => Ok(()),
                Ok(Some((blocking, _))) => blocking().and_then(|then| then(self)),
                Err(f) => Err(f),
            };
            if let Err(f) = r {
                return Err(self.abandon_stream(stream, &name, f));
            }
        }
        Ok(())
    }

    /// Runs one task with the lock held; returns its part to run with the lock released, if it
    /// left one, with what it touches.
    fn run_task(&mut self, task: Task) -> Result<Option<(Blocking, InFlight)>, Fail> {
        let Task {
            name,
            reads,
            writes,
            run,
        } = task;
        self.blocking = None;
        run(self)?;
        Ok(self.blocking.take().map(|b| {
            (
                b,
                InFlight {
                    name,
                    reads,
                    writes,
                },
            )
        }))
    }

    /// After task `name` of `stream` failed with `f`: drops the rest of the queue (a stream stops
    /// at a device error), marks the communicators of the collectives dropped with it broken
    /// (their peers would wait for them in vain), and returns the failure naming the task.
    fn abandon_stream(&mut self, stream: u64, name: &str, f: Fail) -> Fail {
        if let Some(s) = self.streams.get_mut(&stream) {
            s.queue.clear();
        }
        let msg = format!("stream task {name} failed: {}", f.msg);
        for (&comm, q) in self.hccl_queued.iter_mut() {
            if q.iter().any(|&(s, _)| s == stream) {
                q.retain(|&(s, _)| s != stream);
                crate::hccl::abandon(
                    comm,
                    &format!("a collective was dropped from its stream: {msg}"),
                );
            }
        }
        Fail { code: f.code, msg }
    }

    pub fn enqueue(&mut self, stream: u64, task: Task) {
        self.streams
            .get_mut(&stream)
            .expect("resolved stream")
            .queue
            .push_back(task);
    }
}

/// Runs the queued work of each stream in `ids` (a top-level synchronization), releasing the
/// lock while a collective waits for the other ranks; waits first for a run of the same stream
/// that another thread has in flight. The first failure is returned (the failed stream's queue
/// is dropped).
pub fn synchronize_streams(ids: &[u64]) -> Result<(), Fail> {
    let mut g = state();
    for &s in ids {
        let (back, r) = run_released(g, s, None);
        g = back;
        r?;
    }
    Ok(())
}

/// Runs stream `s` with the lock released during collectives: all of its queued work, or, with
/// `until` = (communicator, ticket), only until that collective has run. Returns the lock.
pub fn run_released(
    mut g: MutexGuard<'static, State>,
    s: u64,
    until: Option<(u64, u64)>,
) -> (MutexGuard<'static, State>, Result<(), Fail>) {
    loop {
        let mut waited = 0u32;
        while g.busy.contains_key(&s) {
            drop(g);
            waited += 1;
            if waited < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            g = state();
        }
        if !g.streams.contains_key(&s) {
            let r = match until {
                Some(_) => Ok(()),
                None => fail(
                    ACL_ERROR_RT_INVALID_HANDLE,
                    format!("stream {s:#x} is not a live aclrtStream"),
                ),
            };
            return (g, r);
        }
        if let Some(f) = g.stream_errors.remove(&s) {
            return (g, Err(f));
        }
        if let Some((comm, ticket)) = until {
            let queued = g
                .hccl_queued
                .get(&comm)
                .is_some_and(|q| q.iter().any(|&(_, t)| t == ticket));
            if !queued {
                return (g, Ok(()));
            }
        }
        let Some(task) = g.streams.get_mut(&s).and_then(|st| st.queue.pop_front()) else {
            return (g, Ok(()));
        };
        let name = task.name.clone();
        let r = match g.run_task(task) {
            Ok(None) => Ok(()),
            Ok(Some((blocking, in_flight))) => {
                g.busy.insert(s, in_flight);
                drop(g);
                let r = blocking();
                g = state();
                g.busy.remove(&s);
                r.and_then(|then| then(&mut g))
            }
            Err(f) => Err(f),
        };
        if let Err(f) = r {
            let f = g.abandon_stream(s, &name, f);
            return (g, Err(f));
        }
    }
}

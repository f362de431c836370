//! HCCL's entry points (`libhccl.so`, a link to the emulation's one library): the root-info
//! handshake, communicators, all-reduce and all-gather on device memory, on a stream.
//!
//! Strictness (from the HCCL reference): a root info must come from `HcclGetRootInfo`
//! (HCCL_E_PARA otherwise); `nRanks` and `rank` must agree with the communicator's; each rank of a
//! communicator is on its own device, and a collective's stream and buffers must be on that
//! device; `count` > 0, a supported dtype and op, buffers that are live device memory of the
//! sizes the call implies (HCCL_E_PARA / HCCL_E_PTR) — these are checked at the call. Every rank
//! must call the same collective, with the same count, dtype and op, in the same order —
//! otherwise, when the collectives run, every rank's fails with HCCL_E_PARA and a message naming
//! both calls (see `hccl_comm`), the stream's synchronization reports it, and the communicator
//! stays broken. Messages go to `aclGetRecentErrMsg`.
//!
//! **Stream order.** A collective is enqueued on its stream and runs in order with the other work
//! on it, as HCCL documents: the call checks its arguments and queues it; when the stream runs it
//! (at a synchronization, or when the communicator's progress thread runs it, below) it reads
//! this rank's send buffer **then** — after the work queued before it, before the work queued
//! after it — exchanges it with the other ranks through the communicator's shared memory, and
//! writes the result to the receive buffer. Until it has run, its send buffer counts as read and
//! its receive buffer as written by queued work: a synchronous copy touching them is refused (a
//! read of the receive buffer, or a write of the send buffer, before the stream is synchronized).
//! A pinned host buffer that an async copy queued before the collective reads is read when that
//! copy runs, so the collective sends what the host left there by then.
//!
//! **Progress.** A device runs its stream without its host; a peer's collective may wait for one
//! this rank's host has queued but not synchronized. Each communicator therefore has a progress
//! thread ([`progress`]): when a peer has posted a round this rank has not, it runs this rank's
//! stream up to this rank's next queued collective on the communicator (the work before it
//! included, a device having run it by then); a failure it meets is reported by the stream's next
//! synchronization.
//!
//! **Arithmetic.** The all-reduce sums as a ring all-reduce does, in the payload's dtype: the
//! `count` elements are cut into one chunk per rank (chunk `c`: elements `c·count/n` to
//! `(c+1)·count/n`), chunk `c` is reduced around the ring starting at rank `c` (`x_c + x_{c+1}`,
//! then `+ x_{c+2}`, ..., ending with rank `c−1`), each partial sum rounded to the dtype as it is
//! sent on (f16 and bf16: the exact sum of two values rounded once to the dtype; f32: f32
//! additions in that order; integers wrap), and every rank receives the same reduced chunks.
//! All-gather concatenates the ranks' buffers in rank order.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use half::{bf16, f16};
use npu_ffi::hccl::*;

use crate::hccl_comm::{self, Call, Comm, Mapping, KIND_ALL_GATHER, KIND_ALL_REDUCE, ROOT_MAGIC};
use crate::state::*;

/// One live communicator of this process.
struct Entry {
    /// The handle's counters (locked by the collective running on it: it waits for the other
    /// ranks without holding the emulation's state).
    comm: Mutex<Comm>,
    /// The shared mapping, for the progress thread and to mark it broken without the lock.
    map: Arc<Mapping>,
    rank: u32,
    ranks: u32,
    device: i32,
    /// `HcclGetCommName`'s answer: the same on every rank of the communicator (from its root
    /// info), as the `group` of the fused matmul + all-reduce operators names it.
    name: String,
}

/// Live communicators by handle.
static COMMS: LazyLock<Mutex<HashMap<u64, Arc<Entry>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn done(r: Result<(), hccl_comm::Fail>) -> HcclResult {
    match r {
        Ok(()) => HCCL_SUCCESS,
        Err((code, msg)) => {
            set_error(&format!("HCCL: {msg}"));
            code
        }
    }
}

fn para<T>(msg: impl Into<String>) -> Result<T, hccl_comm::Fail> {
    Err((HCCL_E_PARA, msg.into()))
}

fn from_acl(f: Fail) -> hccl_comm::Fail {
    (HCCL_E_RUNTIME, f.msg)
}

/// An HCCL failure of a collective as its stream reports it.
fn on_stream(what: &str, (code, msg): hccl_comm::Fail) -> Fail {
    Fail {
        code: npu_ffi::types::ACL_ERROR_FAILURE,
        msg: format!("HCCL: {what} failed with {}: {msg}", result_name(code)),
    }
}

/// Marks communicator `comm` broken with `msg`, if it is live (a collective of it was dropped
/// from its stream: its peers would wait for it in vain). Takes no lock but the table's.
pub fn abandon(comm: u64, msg: &str) {
    let entry = COMMS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&comm)
        .cloned();
    if let Some(e) = entry {
        e.map.break_with(&format!("rank {}: {msg}", e.rank));
    }
}

/// The progress thread of communicator `handle` (until it is destroyed): when a peer has
/// posted a round this rank has not — it waits in a collective this rank has not run — runs
/// this rank's stream up to its next queued collective on the communicator, as a device would
/// have run it without waiting for its host. A failure is kept for the stream's next
/// synchronization.
pub fn progress(handle: u64) {
    let mut idle = 0u32;
    loop {
        let entry = COMMS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&handle)
            .cloned();
        let Some(entry) = entry else { return };
        if entry.map.peer_ahead(entry.rank, entry.ranks) && !entry.map.is_broken() {
            // A peer waits: poll fast until this rank's host has queued the collective.
            idle = 0;
            let g = state();
            let next = g.hccl_queued.get(&handle).and_then(|q| q.front().copied());
            if let Some((s, ticket)) = next.filter(|&(s, _)| !g.busy.contains_key(&s)) {
                let (mut g, r) = run_released(g, s, Some((handle, ticket)));
                if let Err(f) = r {
                    g.stream_errors.insert(s, f);
                }
                continue;
            }
        }
        drop(entry);
        idle = idle.saturating_add(1);
        std::thread::sleep(Duration::from_micros(if idle < 2000 { 100 } else { 2000 }));
    }
}

fn random_id() -> Result<[u8; 16], hccl_comm::Fail> {
    let mut id = [0u8; 16];
    let f = std::fs::File::open("/dev/urandom");
    match f.and_then(|mut f| std::io::Read::read_exact(&mut f, &mut id)) {
        Ok(()) => Ok(id),
        Err(e) => Err((HCCL_E_SYSCALL, format!("reading /dev/urandom: {e}"))),
    }
}

/// # Safety
/// `rootInfo` is null or points to an `HcclRootInfo`.
#[no_mangle]
pub unsafe extern "C" fn HcclGetRootInfo(rootInfo: *mut HcclRootInfo) -> HcclResult {
    done((|| {
        if rootInfo.is_null() {
            return Err((HCCL_E_PTR, "HcclGetRootInfo: null rootInfo".into()));
        }
        {
            let st = state();
            st.require_init().map_err(from_acl)?;
            st.current_context().map_err(from_acl)?;
        }
        let mut info = [0u8; HCCL_ROOT_INFO_BYTES];
        info[..8].copy_from_slice(ROOT_MAGIC);
        info[8..24].copy_from_slice(&random_id()?);
        // SAFETY: checked non-null; the caller's struct holds HCCL_ROOT_INFO_BYTES bytes.
        unsafe { *rootInfo = HcclRootInfo::from_bytes(&info) };
        Ok(())
    })())
}

/// # Safety
/// `rootInfo` is null or points to an `HcclRootInfo`; `comm` is null or a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn HcclCommInitRootInfo(
    nRanks: u32,
    rootInfo: *const HcclRootInfo,
    rank: u32,
    comm: *mut HcclComm,
) -> HcclResult {
    done((|| {
        if rootInfo.is_null() || comm.is_null() {
            return Err((
                HCCL_E_PTR,
                "HcclCommInitRootInfo: null rootInfo or comm".into(),
            ));
        }
        if nRanks == 0 || nRanks > hccl_comm::MAX_RANKS || rank >= nRanks {
            return para(format!(
                "HcclCommInitRootInfo: rank {rank} of nRanks {nRanks} (1 to {} ranks)",
                hccl_comm::MAX_RANKS
            ));
        }
        // SAFETY: checked non-null; the caller's struct holds HCCL_ROOT_INFO_BYTES bytes.
        let info = unsafe { (*rootInfo).as_bytes() };
        if &info[..8] != ROOT_MAGIC || info[24..].iter().any(|&b| b != 0) {
            return para(
                "HcclCommInitRootInfo: rootInfo was not made by HcclGetRootInfo (or was damaged on its way to this rank)",
            );
        }
        let device = {
            let st = state();
            st.require_init().map_err(from_acl)?;
            st.current_context().map_err(from_acl)?.1.device
        };
        let c = Comm::join(&info[8..24], nRanks, rank, device)?;
        let name: String = info[8..24].iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("hccl_emulated_{name}");
        let map = c.mapping();
        let handle = {
            let mut st = state();
            let h = st.new_handle(KIND_HCCL_COMM);
            st.hccl_comms.insert(
                h,
                format!("HcclComm {h:#x} (rank {rank} of {nRanks}, device {device})"),
            );
            h
        };
        COMMS.lock().unwrap_or_else(|e| e.into_inner()).insert(
            handle,
            Arc::new(Entry {
                comm: Mutex::new(c),
                map,
                rank,
                ranks: nRanks,
                device,
                name,
            }),
        );
        let spawned = std::thread::Builder::new()
            .name(format!("hccl-progress-{rank}"))
            .spawn(move || progress(handle));
        if let Err(e) = spawned {
            let _ = HcclCommDestroy(handle as HcclComm);
            return Err((
                HCCL_E_SYSCALL,
                format!("HcclCommInitRootInfo: starting the progress thread: {e}"),
            ));
        }
        // SAFETY: checked non-null.
        unsafe { *comm = handle as HcclComm };
        Ok(())
    })())
}

fn lookup(comm: HcclComm, what: &str) -> Result<Arc<Entry>, hccl_comm::Fail> {
    COMMS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(comm as u64))
        .cloned()
        .ok_or_else(|| {
            (
                HCCL_E_PARA,
                format!("{what}: {:#x} is not a live HcclComm", comm as u64),
            )
        })
}

/// Destroys a communicator. Refused (HCCL_E_PARA) while a collective of it is queued on a
/// stream or running: synchronize the stream first (its peers would wait for it in vain).
#[no_mangle]
pub extern "C" fn HcclCommDestroy(comm: HcclComm) -> HcclResult {
    done((|| {
        let c = lookup(comm, "HcclCommDestroy")?;
        {
            let st = state();
            if let Some(&(s, _)) = st.hccl_queued.get(&(comm as u64)).and_then(|q| q.front()) {
                return para(format!(
                    "HcclCommDestroy: a collective of this communicator is still queued on stream {s:#x}; synchronize the stream first"
                ));
            }
        }
        c.comm.lock().unwrap_or_else(|e| e.into_inner()).destroy();
        COMMS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(comm as u64));
        let mut st = state();
        st.hccl_comms.remove(&(comm as u64));
        st.hccl_queued.remove(&(comm as u64));
        Ok(())
    })())
}

fn elem_bytes(dtype: HcclDataType) -> Option<usize> {
    match dtype {
        HCCL_DATA_TYPE_INT8 | HCCL_DATA_TYPE_UINT8 => Some(1),
        HCCL_DATA_TYPE_FP16 | HCCL_DATA_TYPE_BFP16 => Some(2),
        HCCL_DATA_TYPE_FP32 | HCCL_DATA_TYPE_INT32 => Some(4),
        _ => None,
    }
}

/// The checks of a collective's arguments under the state lock (`send` and `recv`: address and
/// bytes); returns the stream.
fn check_args(
    st: &State,
    what: &str,
    c: &Entry,
    (send, in_bytes): (u64, u64),
    (recv, out_bytes): (u64, u64),
    stream: aclrtStream,
) -> Result<u64, hccl_comm::Fail> {
    st.require_init().map_err(from_acl)?;
    if stream.is_null() {
        return para(format!(
            "{what}: a null stream (HCCL needs the stream to queue on)"
        ));
    }
    let s = st
        .resolve_stream(stream as u64)
        .map_err(|f| (HCCL_E_PARA, f.msg))?;
    if st.captures.contains_key(&s) {
        return para(format!(
            "{what}: the stream is capturing (aclmdlRICaptureBegin): the emulation does not capture collectives"
        ));
    }
    if st.streams[&s].device != c.device {
        return para(format!(
            "{what}: the stream is on device {}, the communicator's rank {} on device {}",
            st.streams[&s].device, c.rank, c.device
        ));
    }
    for (addr, len, name) in [(send, in_bytes, "sendBuf"), (recv, out_bytes, "recvBuf")] {
        if addr == 0 {
            return Err((HCCL_E_PTR, format!("{what}: null {name}")));
        }
        let start = st
            .device_range(addr, len, &format!("{what} {name}"))
            .map_err(|f| (HCCL_E_PARA, f.msg))?;
        let dev = st.device_mem[&start].device;
        if dev != c.device {
            return para(format!(
                "{what}: {name} is memory of device {dev}, the communicator's rank {} is on device {}",
                c.rank, c.device
            ));
        }
    }
    if send != recv && send < recv + out_bytes && recv < send + in_bytes {
        return para(format!(
            "{what}: sendBuf and recvBuf overlap without being the same"
        ));
    }
    Ok(s)
}

/// Element `i` of a buffer of `dtype` elements, as f64 (floats) or its integer value.
fn load(dtype: HcclDataType, b: &[u8], i: usize) -> f64 {
    match dtype {
        HCCL_DATA_TYPE_FP16 => f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f64(),
        HCCL_DATA_TYPE_BFP16 => bf16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f64(),
        HCCL_DATA_TYPE_FP32 => {
            f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]) as f64
        }
        HCCL_DATA_TYPE_INT32 => {
            i32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]) as f64
        }
        HCCL_DATA_TYPE_INT8 => b[i] as i8 as f64,
        _ => b[i] as f64,
    }
}

/// One hop of the ring: `acc + x` in `dtype`, rounded to it once (f16/bf16: the sum of two
/// such values is exact in f64, then rounded; f32: an f32 addition; integers wrap).
fn hop(dtype: HcclDataType, acc: f64, x: f64) -> f64 {
    match dtype {
        HCCL_DATA_TYPE_FP16 => f16::from_f64(acc + x).to_f64(),
        HCCL_DATA_TYPE_BFP16 => bf16::from_f64(acc + x).to_f64(),
        HCCL_DATA_TYPE_FP32 => (acc as f32 + x as f32) as f64,
        HCCL_DATA_TYPE_INT32 => (acc as i32).wrapping_add(x as i32) as f64,
        HCCL_DATA_TYPE_INT8 => (acc as i8).wrapping_add(x as i8) as f64,
        _ => (acc as u8).wrapping_add(x as u8) as f64,
    }
}

fn store(dtype: HcclDataType, out: &mut Vec<u8>, v: f64) {
    match dtype {
        HCCL_DATA_TYPE_FP16 => out.extend(f16::from_f64(v).to_le_bytes()),
        HCCL_DATA_TYPE_BFP16 => out.extend(bf16::from_f64(v).to_le_bytes()),
        HCCL_DATA_TYPE_FP32 => out.extend((v as f32).to_le_bytes()),
        HCCL_DATA_TYPE_INT32 => out.extend((v as i32).to_le_bytes()),
        HCCL_DATA_TYPE_INT8 => out.push(v as i8 as u8),
        _ => out.push(v as u8),
    }
}

/// The sum of every rank's `count` elements as a ring all-reduce computes it (see the module
/// doc): chunk `c` of `n` is reduced starting at rank `c` and going around the ring, each hop
/// rounded to the dtype. `inputs[r]` is rank `r`'s buffer.
pub fn ring_sum(dtype: HcclDataType, count: usize, inputs: &[Vec<u8>]) -> Vec<u8> {
    let n = inputs.len();
    let mut out = Vec::with_capacity(count * elem_bytes(dtype).unwrap_or(1));
    for c in 0..n {
        for i in c * count / n..(c + 1) * count / n {
            let mut acc = load(dtype, &inputs[c], i);
            for k in 1..n {
                acc = hop(dtype, acc, load(dtype, &inputs[(c + k) % n], i));
            }
            store(dtype, &mut out, acc);
        }
    }
    out
}

/// The collective's exchange and result, once its stream ran it with `mine` read from the send
/// buffer (runs without the emulation's state lock: it waits for the other ranks).
fn exchange(handle: u64, what: &str, call: Call, mine: &[u8]) -> Result<Vec<u8>, hccl_comm::Fail> {
    let entry = COMMS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&handle)
        .cloned()
        .ok_or_else(|| {
            (
                HCCL_E_PARA,
                format!(
                    "{what}: the communicator {handle:#x} was destroyed before the collective ran"
                ),
            )
        })?;
    let mut c = entry.comm.lock().unwrap_or_else(|e| e.into_inner());
    let n = mine.len();
    let mut each = vec![vec![0u8; n]; c.ranks as usize];
    c.exchange(call, mine, |r, off, bytes| {
        each[r as usize][off..off + bytes.len()].copy_from_slice(bytes)
    })?;
    Ok(if call.kind == KIND_ALL_REDUCE {
        ring_sum(call.dtype, call.count as usize, &each)
    } else {
        each.concat()
    })
}

fn collective(
    what: &'static str,
    call: Call,
    send: u64,
    recv: u64,
    comm: HcclComm,
    stream: aclrtStream,
) -> Result<(), hccl_comm::Fail> {
    let c = lookup(comm, what)?;
    let Some(es) = elem_bytes(call.dtype) else {
        return Err((
            HCCL_E_NOT_SUPPORT,
            format!("{what}: dataType {} is not supported", call.dtype),
        ));
    };
    if call.count == 0 {
        return para(format!("{what}: count 0"));
    }
    if call.kind == KIND_ALL_REDUCE
        && !matches!(
            call.op,
            HCCL_REDUCE_SUM | HCCL_REDUCE_PROD | HCCL_REDUCE_MAX | HCCL_REDUCE_MIN
        )
    {
        return para(format!("{what}: op {} is not an HcclReduceOp", call.op));
    }
    if call.kind == KIND_ALL_REDUCE && call.op != HCCL_REDUCE_SUM {
        return Err((
            HCCL_E_NOT_SUPPORT,
            format!("{what}: the emulation has HCCL_REDUCE_SUM only"),
        ));
    }
    let in_bytes = call.count * es as u64;
    let out_bytes = if call.kind == KIND_ALL_GATHER {
        in_bytes * c.ranks as u64
    } else {
        in_bytes
    };
    let mut st = state();
    let s = check_args(&st, what, &c, (send, in_bytes), (recv, out_bytes), stream)?;
    let handle = comm as u64;
    st.next_ticket += 1;
    let ticket = st.next_ticket;
    st.hccl_queued
        .entry(handle)
        .or_default()
        .push_back((s, ticket));
    let run: TaskFn = Box::new(move |st: &mut State| {
        // Running now: no longer queued.
        if let Some(q) = st.hccl_queued.get_mut(&handle) {
            q.retain(|&(_, t)| t != ticket);
        }
        let mine = st.bytes(send, in_bytes)?.to_vec();
        st.blocking = Some(Box::new(move || {
            let out = exchange(handle, what, call, &mine).map_err(|f| on_stream(what, f))?;
            let write: TaskFn = Box::new(move |st: &mut State| {
                st.bytes_mut(recv, out_bytes)?.copy_from_slice(&out);
                Ok(())
            });
            Ok(write)
        }));
        Ok(())
    });
    st.enqueue(
        s,
        Task {
            name: format!("{call} on HcclComm {handle:#x}"),
            reads: vec![(send, in_bytes)],
            writes: vec![(recv, out_bytes)],
            run,
        },
    );
    Ok(())
}

#[no_mangle]
pub extern "C" fn HcclAllReduce(
    sendBuf: *mut core::ffi::c_void,
    recvBuf: *mut core::ffi::c_void,
    count: u64,
    dataType: HcclDataType,
    op: HcclReduceOp,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let call = Call {
        kind: KIND_ALL_REDUCE,
        dtype: dataType,
        op,
        count,
    };
    done(collective(
        "HcclAllReduce",
        call,
        sendBuf as u64,
        recvBuf as u64,
        comm,
        stream,
    ))
}

#[no_mangle]
pub extern "C" fn HcclAllGather(
    sendBuf: *mut core::ffi::c_void,
    recvBuf: *mut core::ffi::c_void,
    sendCount: u64,
    dataType: HcclDataType,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let call = Call {
        kind: KIND_ALL_GATHER,
        dtype: dataType,
        op: 0,
        count: sendCount,
    };
    done(collective(
        "HcclAllGather",
        call,
        sendBuf as u64,
        recvBuf as u64,
        comm,
        stream,
    ))
}

/// The communicator's name, NUL-terminated, into the caller's buffer of
/// `HCCL_COMM_NAME_MAX_LENGTH` bytes.
///
/// # Safety
/// `commName` is null or points to `HCCL_COMM_NAME_MAX_LENGTH` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn HcclGetCommName(
    comm: HcclComm,
    commName: *mut core::ffi::c_char,
) -> HcclResult {
    done((|| {
        if commName.is_null() {
            return Err((HCCL_E_PTR, "HcclGetCommName: null commName".into()));
        }
        let c = lookup(comm, "HcclGetCommName")?;
        let bytes = c.name.as_bytes();
        debug_assert!(bytes.len() < HCCL_COMM_NAME_MAX_LENGTH);
        // SAFETY: non-null; the caller's buffer holds HCCL_COMM_NAME_MAX_LENGTH bytes and the
        // name with its NUL is shorter (32 hex digits and a prefix).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr().cast(), commName, bytes.len());
            *commName.add(bytes.len()) = 0;
        }
        Ok(())
    })())
}

/// The communicator of this process named `group` (`HcclGetCommName`) whose rank is on
/// `device`, as (handle, ranks); None when there is no such live communicator.
pub(crate) fn by_name(group: &str, device: i32) -> Option<(u64, u32)> {
    COMMS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(_, e)| e.name == group && e.device == device)
        .map(|(&h, e)| (h, e.ranks))
}

/// The device of live communicator `comm` (None once destroyed).
pub(crate) fn device_of(comm: u64) -> Option<i32> {
    COMMS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&comm)
        .map(|e| e.device)
}

/// What a fused operator does with its all-reduce's result (the state locked again).
pub(crate) type Then = Box<dyn FnOnce(&mut State, Vec<u8>) -> Result<(), Fail> + Send>;

/// A fused operator's all-reduce (HCCL_REDUCE_SUM of `count` elements of `dtype`) on
/// communicator `comm`, from inside its stream task: leaves in `st.blocking` the exchange of
/// `mine` with the other ranks — the same call, and the same ring sum, as an `HcclAllReduce` of
/// those bytes — and `then` gets the sum with the state locked again.
pub(crate) fn all_reduce_then(
    st: &mut State,
    comm: u64,
    what: &'static str,
    (dtype, count): (HcclDataType, u64),
    mine: Vec<u8>,
    then: Then,
) {
    let call = Call {
        kind: KIND_ALL_REDUCE,
        dtype,
        op: HCCL_REDUCE_SUM,
        count,
    };
    st.blocking = Some(Box::new(move || {
        let out = exchange(comm, what, call, &mine).map_err(|f| on_stream(what, f))?;
        let write: TaskFn = Box::new(move |st: &mut State| then(st, out));
        Ok(write)
    }));
}

#[no_mangle]
pub extern "C" fn HcclGetErrorString(code: HcclResult) -> *const core::ffi::c_char {
    static NAMES: LazyLock<Mutex<HashMap<HcclResult, std::ffi::CString>>> =
        LazyLock::new(|| Mutex::new(HashMap::new()));
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    names
        .entry(code)
        .or_insert_with(|| std::ffi::CString::new(result_name(code)).unwrap_or_default())
        .as_ptr()
}

// Compile-time check: every export has the declared prototype of npu-ffi.
const _: () = {
    use npu_ffi::hccl::sig;
    let _: sig::HcclGetRootInfo = HcclGetRootInfo;
    let _: sig::HcclCommInitRootInfo = HcclCommInitRootInfo;
    let _: sig::HcclAllReduce = HcclAllReduce;
    let _: sig::HcclAllGather = HcclAllGather;
    let _: sig::HcclCommDestroy = HcclCommDestroy;
    let _: sig::HcclGetErrorString = HcclGetErrorString;
    let _: sig::HcclGetCommName = HcclGetCommName;
};

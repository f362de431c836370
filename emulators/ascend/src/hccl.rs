//! HCCL's entry points (`libhccl.so`, a link to the emulation's one library): the root-info
//! handshake, communicators, all-reduce and all-gather on device memory, on a stream.
//!
//! Strictness (from the HCCL reference): a root info must come from `HcclGetRootInfo`
//! (HCCL_E_PARA otherwise); `nRanks` and `rank` must agree with the communicator's; each rank of a
//! communicator is on its own device, and a collective's stream and buffers must be on that
//! device; `count` > 0, a supported dtype and op, buffers that are live device memory of the
//! sizes the call implies (HCCL_E_PARA / HCCL_E_PTR); and every rank must call the same
//! collective, with the same count, dtype and op, in the same order — otherwise every rank's
//! call fails with HCCL_E_PARA and a message naming both calls (see `hccl_comm`), and the
//! communicator stays broken. Messages go to `aclGetRecentErrMsg`.
//!
//! How it runs: a collective first runs the stream's queued work (a device would have reached
//! the collective in stream order), reads this rank's input, exchanges it with the other ranks
//! through the communicator's shared memory (the call returns once every rank has called it),
//! and queues the write of the result on the stream: the result is there after the stream is
//! synchronized, like any other stream work. Running the queued work early is the one thing
//! less strict than the rest of the emulation: a device-to-host copy queued before a collective
//! has its bytes before the stream is synchronized.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use half::{bf16, f16};
use npu_ffi::hccl::*;

use crate::hccl_comm::{self, Call, Comm, KIND_ALL_GATHER, KIND_ALL_REDUCE, ROOT_MAGIC};
use crate::state::*;

/// Live communicators by handle (each behind its own lock: a collective waits for the other
/// ranks without holding the emulation's state).
static COMMS: LazyLock<Mutex<HashMap<u64, std::sync::Arc<Mutex<Comm>>>>> =
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
        let handle = {
            let mut st = state();
            let h = st.new_handle(KIND_HCCL_COMM);
            st.hccl_comms.insert(
                h,
                format!("HcclComm {h:#x} (rank {rank} of {nRanks}, device {device})"),
            );
            h
        };
        COMMS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(handle, std::sync::Arc::new(Mutex::new(c)));
        // SAFETY: checked non-null.
        unsafe { *comm = handle as HcclComm };
        Ok(())
    })())
}

fn lookup(comm: HcclComm, what: &str) -> Result<std::sync::Arc<Mutex<Comm>>, hccl_comm::Fail> {
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

#[no_mangle]
pub extern "C" fn HcclCommDestroy(comm: HcclComm) -> HcclResult {
    done((|| {
        let c = lookup(comm, "HcclCommDestroy")?;
        c.lock().unwrap_or_else(|e| e.into_inner()).destroy();
        COMMS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(comm as u64));
        state().hccl_comms.remove(&(comm as u64));
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

/// The checks of a collective's arguments under the state lock, then the stream's queued work:
/// returns (stream, this rank's input bytes).
fn prepare(
    what: &str,
    c: &Comm,
    send: u64,
    recv: u64,
    in_bytes: u64,
    out_bytes: u64,
    stream: aclrtStream,
) -> Result<(u64, Vec<u8>), hccl_comm::Fail> {
    let mut st = state();
    st.require_init().map_err(from_acl)?;
    if stream.is_null() {
        return para(format!(
            "{what}: a null stream (HCCL needs the stream to queue on)"
        ));
    }
    let s = st
        .resolve_stream(stream as u64)
        .map_err(|f| (HCCL_E_PARA, f.msg))?;
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
    st.run_stream(s).map_err(|f| {
        let msg = format!("{what}: the stream's earlier work failed: {}", f.msg);
        c.break_with(&format!("rank {}: {msg}", c.rank));
        (HCCL_E_RUNTIME, msg)
    })?;
    let mine = st.bytes(send, in_bytes).map_err(from_acl)?.to_vec();
    Ok((s, mine))
}

fn queue_result(s: u64, what: &str, recv: u64, out: Vec<u8>) {
    let mut st = state();
    let len = out.len() as u64;
    st.enqueue(
        s,
        Task {
            name: what.to_string(),
            reads: Vec::new(),
            writes: vec![(recv, len)],
            run: Box::new(move |st| {
                st.bytes_mut(recv, len)?.copy_from_slice(&out);
                Ok(())
            }),
        },
    );
}

/// Element-wise sums in rank order, kept in f32 (f64 for ints) and rounded once.
struct Sum {
    dtype: HcclDataType,
    acc: Vec<f64>,
}

impl Sum {
    fn add(&mut self, offset: usize, bytes: &[u8]) {
        let es = elem_bytes(self.dtype).unwrap_or(1);
        for (i, c) in bytes.chunks_exact(es).enumerate() {
            let v = match self.dtype {
                HCCL_DATA_TYPE_FP16 => f16::from_le_bytes([c[0], c[1]]).to_f32() as f64,
                HCCL_DATA_TYPE_BFP16 => bf16::from_le_bytes([c[0], c[1]]).to_f32() as f64,
                HCCL_DATA_TYPE_FP32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
                HCCL_DATA_TYPE_INT32 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
                HCCL_DATA_TYPE_INT8 => c[0] as i8 as f64,
                _ => c[0] as f64,
            };
            let a = &mut self.acc[offset / es + i];
            // f32 arithmetic for the float types, as the device's: sum in rank order.
            *a = if matches!(
                self.dtype,
                HCCL_DATA_TYPE_INT32 | HCCL_DATA_TYPE_INT8 | HCCL_DATA_TYPE_UINT8
            ) {
                *a + v
            } else {
                (*a as f32 + v as f32) as f64
            };
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for &a in &self.acc {
            match self.dtype {
                HCCL_DATA_TYPE_FP16 => out.extend(f16::from_f32(a as f32).to_le_bytes()),
                HCCL_DATA_TYPE_BFP16 => out.extend(bf16::from_f32(a as f32).to_le_bytes()),
                HCCL_DATA_TYPE_FP32 => out.extend((a as f32).to_le_bytes()),
                HCCL_DATA_TYPE_INT32 => out.extend((a as i64 as i32).to_le_bytes()),
                _ => out.push(a as i64 as u8),
            }
        }
        out
    }
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
    let mut c = c.lock().unwrap_or_else(|e| e.into_inner());
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
    let (s, mine) = prepare(what, &c, send, recv, in_bytes, out_bytes, stream)?;
    let out = if call.kind == KIND_ALL_REDUCE {
        let mut sum = Sum {
            dtype: call.dtype,
            acc: vec![0.0; call.count as usize],
        };
        c.exchange(call, &mine, |_, off, bytes| sum.add(off, bytes))?;
        sum.bytes()
    } else {
        let mut out = vec![0u8; out_bytes as usize];
        let n = in_bytes as usize;
        c.exchange(call, &mine, |r, off, bytes| {
            out[r as usize * n + off..][..bytes.len()].copy_from_slice(bytes)
        })?;
        out
    };
    queue_result(s, what, recv, out);
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
};

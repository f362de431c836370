//! HCCL's emulation runs a collective in stream order, with a ring all-reduce's rounding: ranks
//! are threads of this process, each on its own emulated device (every test its own devices).
//!
//! - `a_collective_sends_what_its_stream_wrote_by_its_turn`: a deliberately wrong use, caught;
//! - `the_all_reduce_rounds_as_a_ring_in_the_payload_dtype`: f32, f16 and bf16 over three ranks;
//! - `a_rank_that_does_not_synchronize_still_reaches_its_collective`: a device runs its stream
//!   without its host, so a peer never waits for this rank's host to synchronize.

use std::ffi::c_void;
use std::sync::{Barrier, Once};

use ascendcl::hccl::*;
use ascendcl::rt::*;
use half::{bf16, f16};
use npu_ffi::hccl::*;
use npu_ffi::types::*;

static INIT: Once = Once::new();

fn init() {
    INIT.call_once(|| assert_eq!(aclInit(std::ptr::null()), 0));
}

fn last_error() -> String {
    // SAFETY: a NUL-terminated message owned by the emulation (this thread's).
    unsafe { std::ffi::CStr::from_ptr(aclGetRecentErrMsg()) }
        .to_string_lossy()
        .into_owned()
}

fn malloc(bytes: usize) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { aclrtMalloc(&mut p, bytes, ACL_MEM_MALLOC_HUGE_FIRST) },
        0
    );
    p
}

fn upload(p: *mut c_void, bytes: &[u8]) -> aclError {
    // SAFETY: `bytes` is valid host memory of its length; the emulation checks the device side.
    unsafe {
        aclrtMemcpy(
            p,
            bytes.len(),
            bytes.as_ptr().cast(),
            bytes.len(),
            ACL_MEMCPY_HOST_TO_DEVICE,
        )
    }
}

fn download(p: *mut c_void, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    // SAFETY: `out` holds `n` bytes; the emulation checks the device side.
    let rc = unsafe { aclrtMemcpy(out.as_mut_ptr().cast(), n, p, n, ACL_MEMCPY_DEVICE_TO_HOST) };
    assert_eq!(rc, 0, "{}", last_error());
    out
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Runs `f(rank, stream, comm)` on one thread per device of `devices`, rank `r` on
/// `devices[r]`, each with its own stream and communicator; returns each rank's result.
fn ranks<T: Send>(devices: &[i32], f: impl Fn(u32, aclrtStream, HcclComm) -> T + Sync) -> Vec<T> {
    init();
    let n = devices.len() as u32;
    let mut root = HcclRootInfo::zeroed();
    // SAFETY: a device is set for the call below; `root` is a valid out-pointer.
    unsafe {
        assert_eq!(aclrtSetDevice(devices[0]), 0);
        assert_eq!(HcclGetRootInfo(&mut root), HCCL_SUCCESS);
    }
    let root = root.as_bytes();
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(r, &d)| {
                let f = &f;
                s.spawn(move || {
                    let info = HcclRootInfo::from_bytes(&root);
                    let mut stream = std::ptr::null_mut();
                    let mut comm = std::ptr::null_mut();
                    // SAFETY: the documented calls with valid out-pointers.
                    unsafe {
                        assert_eq!(aclrtSetDevice(d), 0);
                        assert_eq!(aclrtCreateStream(&mut stream), 0);
                        assert_eq!(
                            HcclCommInitRootInfo(n, &info, r as u32, &mut comm),
                            HCCL_SUCCESS,
                            "{}",
                            last_error()
                        );
                    }
                    let out = f(r as u32, stream, comm);
                    assert_eq!(HcclCommDestroy(comm), HCCL_SUCCESS, "{}", last_error());
                    assert_eq!(aclrtDestroyStream(stream), 0, "{}", last_error());
                    assert_eq!(aclrtResetDevice(d), 0);
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    });
    assert_eq!(aclrtResetDevice(devices[0]), 0);
    out
}

const N: usize = 64;

/// Deliberately wrong: each rank queues an async copy from pinned host memory into its send
/// buffer and an all-reduce of it, then, before synchronizing the stream, rewrites the pinned
/// memory (the queued copy has not read it yet) and writes the send buffer with a synchronous
/// copy (the queued all-reduce has not read it yet). On a device the all-reduce may send the
/// late bytes; the emulation runs the stream's work as late as allowed, so it sends the late
/// pinned values, and refuses the synchronous write of a buffer queued work still reads.
///
/// FAILS on the emulation before stream-ordered collectives (up to commit b3808fe), which ran
/// the stream's queued work and read the send buffer at the `HcclAllReduce` call: it summed the
/// early values and let the synchronous write through; PASSES on the emulation that runs the
/// collective when its stream does. (Checked by running this file against the old `src/hccl.rs`,
/// `src/hccl_comm.rs`, `src/state.rs` and `src/rt.rs`.)
#[test]
fn a_collective_sends_what_its_stream_wrote_by_its_turn() {
    let early = |r: u32| -> Vec<f32> { (0..N).map(|i| (i as u32 * (r + 1)) as f32).collect() };
    let late = |r: u32| -> Vec<f32> { (0..N).map(|i| 1000.0 + (i as u32 + r) as f32).collect() };
    let both_wrote = Barrier::new(2);
    let outs = ranks(&[0, 1], |r, stream, comm| {
        let bytes = N * 4;
        let mut pinned = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { aclrtMallocHost(&mut pinned, bytes) }, 0);
        let host = |v: &[f32]| {
            // SAFETY: `pinned` holds `bytes` bytes of this thread's pinned memory.
            unsafe { std::ptr::copy_nonoverlapping(f32s(v).as_ptr(), pinned.cast(), bytes) }
        };
        host(&early(r));
        let (send, recv) = (malloc(bytes), malloc(bytes));
        // SAFETY: pinned memory and a device buffer of `bytes` each, both 64-byte aligned.
        let rc = unsafe {
            aclrtMemcpyAsync(
                send,
                bytes,
                pinned,
                bytes,
                ACL_MEMCPY_HOST_TO_DEVICE,
                stream,
            )
        };
        assert_eq!(rc, 0, "{}", last_error());
        let rc = HcclAllReduce(
            send,
            recv,
            N as u64,
            HCCL_DATA_TYPE_FP32,
            HCCL_REDUCE_SUM,
            comm,
            stream,
        );
        assert_eq!(rc, HCCL_SUCCESS, "{}", last_error());
        // Wrong: the send buffer is written while the queued all-reduce still reads it...
        let refused = upload(send, &f32s(&[-1.0; N])) != 0;
        let why = last_error();
        // ... and the pinned source of the queued copy is rewritten before it ran.
        host(&late(r));
        // Both ranks rewrote theirs before either stream runs (or a peer's progress thread
        // might run this rank's stream before the rewrite).
        both_wrote.wait();
        assert_eq!(aclrtSynchronizeStream(stream), 0, "{}", last_error());
        let got = floats(&download(recv, bytes));
        assert_eq!(aclrtFree(send), 0);
        assert_eq!(aclrtFree(recv), 0);
        assert_eq!(aclrtFreeHost(pinned), 0);
        (got, refused, why)
    });
    let late_sum: Vec<f32> = late(0).iter().zip(late(1)).map(|(a, b)| a + b).collect();
    for (r, (got, refused, why)) in outs.iter().enumerate() {
        assert!(
            *got == late_sum,
            "rank {r}: the all-reduce did not sum what its stream had written by its turn (the \
             pinned values at the synchronization): got {:?}...",
            &got[..4]
        );
        assert!(
            *refused && why.contains("queued stream work"),
            "rank {r}: a synchronous write of the send buffer of a queued all-reduce was let \
             through: {why}"
        );
    }
}

/// The ring's order and rounding: with three ranks holding 1, e and e (e: half an ulp of 1 in
/// the dtype), chunk 0 (elements 0..2) is reduced 1 + e (a tie, to even: 1) + e = 1, chunk 1
/// (2..4) e + e = 2e exactly, + 1 = 1 + 2e, chunk 2 (4..6) e + 1 = 1, + e = 1. A sum in rank
/// order rounded once (the emulation before) gives 1 + 2e everywhere in f16/bf16 and 1 in f32.
#[test]
fn the_all_reduce_rounds_as_a_ring_in_the_payload_dtype() {
    type Enc = fn(f64) -> Vec<u8>;
    type Dec = fn(&[u8]) -> f64;
    let cases: [(HcclDataType, usize, f64, Enc, Dec); 3] = [
        (
            HCCL_DATA_TYPE_FP32,
            4,
            2f64.powi(-24),
            |v| (v as f32).to_le_bytes().to_vec(),
            |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        ),
        (
            HCCL_DATA_TYPE_FP16,
            2,
            2f64.powi(-11),
            |v| f16::from_f64(v).to_le_bytes().to_vec(),
            |b| f16::from_le_bytes([b[0], b[1]]).to_f64(),
        ),
        (
            HCCL_DATA_TYPE_BFP16,
            2,
            2f64.powi(-8),
            |v| bf16::from_f64(v).to_le_bytes().to_vec(),
            |b| bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        ),
    ];
    let outs = ranks(&[2, 3, 4], |r, stream, comm| {
        let mut got = Vec::new();
        for &(dtype, es, e, enc, dec) in &cases {
            let x = if r == 0 { 1.0 } else { e };
            let bytes: Vec<u8> = (0..6).flat_map(|_| enc(x)).collect();
            let p = malloc(bytes.len());
            assert_eq!(upload(p, &bytes), 0, "{}", last_error());
            let rc = HcclAllReduce(p, p, 6, dtype, HCCL_REDUCE_SUM, comm, stream);
            assert_eq!(rc, HCCL_SUCCESS, "{}", last_error());
            assert_eq!(aclrtSynchronizeStream(stream), 0, "{}", last_error());
            let out = download(p, 6 * es);
            got.push(out.chunks_exact(es).map(dec).collect::<Vec<f64>>());
            assert_eq!(aclrtFree(p), 0);
        }
        got
    });
    for (i, &(dtype, _, e, _, _)) in cases.iter().enumerate() {
        let want = vec![1.0, 1.0, 1.0 + 2.0 * e, 1.0 + 2.0 * e, 1.0, 1.0];
        for (r, o) in outs.iter().enumerate() {
            assert_eq!(o[i], want, "dtype {dtype}, rank {r}");
        }
    }
}

/// Rank 1 queues its collectives and waits, without synchronizing, for rank 0 to have read the
/// results (as a rank whose host goes on to other work): a device runs its stream without the
/// host, so rank 0's synchronization must not wait for rank 1's — the communicator's progress
/// thread runs rank 1's stream up to each collective rank 0 waits in.
#[test]
fn a_rank_that_does_not_synchronize_still_reaches_its_collective() {
    let (tx, rx) = std::sync::mpsc::channel::<Vec<f32>>();
    let rx = std::sync::Mutex::new(rx);
    let started = std::time::Instant::now();
    let outs = ranks(&[5, 6], |r, stream, comm| {
        let x = malloc(N * 4);
        let all = malloc(2 * N * 4);
        let mine: Vec<f32> = (0..N).map(|i| (i + 100 * r as usize) as f32).collect();
        assert_eq!(upload(x, &f32s(&mine)), 0);
        let rc = HcclAllReduce(
            x,
            x,
            N as u64,
            HCCL_DATA_TYPE_FP32,
            HCCL_REDUCE_SUM,
            comm,
            stream,
        );
        assert_eq!(rc, HCCL_SUCCESS, "{}", last_error());
        let rc = HcclAllGather(x, all, N as u64, HCCL_DATA_TYPE_FP32, comm, stream);
        assert_eq!(rc, HCCL_SUCCESS, "{}", last_error());
        let got = if r == 0 {
            assert_eq!(aclrtSynchronizeStream(stream), 0, "{}", last_error());
            let got = floats(&download(all, 2 * N * 4));
            tx.send(got.clone()).unwrap();
            got
        } else {
            let got = rx.lock().unwrap().recv().unwrap();
            assert_eq!(aclrtSynchronizeStream(stream), 0, "{}", last_error());
            got
        };
        assert_eq!(aclrtFree(x), 0);
        assert_eq!(aclrtFree(all), 0);
        got
    });
    let sum: Vec<f32> = (0..N).map(|i| (2 * i + 100) as f32).collect();
    let both: Vec<f32> = sum.iter().chain(&sum).copied().collect();
    assert_eq!(outs[0], both);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
}

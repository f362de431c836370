//! aclnnMatmulAllReduce on the emulation: ranks are threads of this process, each on its own
//! emulated device (every test its own devices).
//!
//! - `fused_gives_the_bits_of_matmul_then_hccl_all_reduce`: two ranks, f16 and bf16, a weight
//!   as the backend passes it (the transpose of its (n, k) storage): the fused output equals
//!   aclnnMatmul then HcclAllReduce bit for bit, on both ranks, and the launches are counted;
//! - `quantized_fused_gives_the_bits_of_wqbmm_then_hccl_all_reduce`: WeightQuantMatmulAllReduce
//!   with INT8 weights and per-group scales against WeightQuantBatchMatmulV2 then HcclAllReduce;
//! - `the_quantized_form_refuses_what_its_page_forbids`: a foreign group, an x3, a group size
//!   not a multiple of 32, f32 activations;
//! - `what_the_page_forbids_is_refused`: a group that is no live communicator's name, f32,
//!   a 1-D x1, reduceOp "max", commTurn 1, streamMode 0, a bias — each refused with a message
//!   naming it, while the same call with the documented arguments is accepted.

use std::ffi::{c_char, c_void, CStr};
use std::sync::Once;

use ascendcl::hccl::*;
use ascendcl::objects::*;
use ascendcl::ops::{
    aclnnMatmul, aclnnMatmulAllReduce, aclnnWeightQuantBatchMatmulV2,
    aclnnWeightQuantMatmulAllReduce, ascendEmulatorLaunchCount,
};
use ascendcl::rt::*;
use half::{bf16, f16};
use npu_ffi::hccl::*;
use npu_ffi::types::*;

extern "C" {
    // Defined by the emulation (its modules are private); the prototypes of `npu_ffi::aclnn`.
    fn aclnnMatmulGetWorkspaceSize(
        self_: *const aclTensor,
        mat2: *const aclTensor,
        out: *mut aclTensor,
        cubeMathType: i8,
        workspaceSize: *mut u64,
        executor: *mut *mut aclOpExecutor,
    ) -> aclnnStatus;
    fn aclnnWeightQuantBatchMatmulV2GetWorkspaceSize(
        x: *const aclTensor,
        weight: *const aclTensor,
        antiquantScale: *const aclTensor,
        antiquantOffsetOptional: *const aclTensor,
        quantScaleOptional: *const aclTensor,
        quantOffsetOptional: *const aclTensor,
        biasOptional: *const aclTensor,
        antiquantGroupSize: core::ffi::c_int,
        y: *const aclTensor,
        workspaceSize: *mut u64,
        executor: *mut *mut aclOpExecutor,
    ) -> aclnnStatus;
    fn aclnnWeightQuantMatmulAllReduceGetWorkspaceSize(
        x1: *const aclTensor,
        x2: *const aclTensor,
        bias: *const aclTensor,
        antiquantScale: *const aclTensor,
        antiquantOffset: *const aclTensor,
        x3: *const aclTensor,
        group: *const c_char,
        reduceOp: *const c_char,
        commTurn: i64,
        streamMode: i64,
        antiquantGroupSize: i64,
        output: *const aclTensor,
        workspaceSize: *mut u64,
        executor: *mut *mut aclOpExecutor,
    ) -> aclnnStatus;
    fn aclnnMatmulAllReduceGetWorkspaceSize(
        x1: *const aclTensor,
        x2: *const aclTensor,
        bias: *const aclTensor,
        group: *const c_char,
        reduceOp: *const c_char,
        commTurn: i64,
        streamMode: i64,
        output: *const aclTensor,
        workspaceSize: *mut u64,
        executor: *mut *mut aclOpExecutor,
    ) -> aclnnStatus;
}

static INIT: Once = Once::new();

fn init() {
    INIT.call_once(|| {
        let opp = std::env::temp_dir().join(format!("ascend-mc2-opp-{}", std::process::id()));
        std::fs::create_dir_all(&opp).unwrap();
        std::env::set_var("ASCEND_OPP_PATH", &opp);
        assert_eq!(aclInit(std::ptr::null()), 0);
    });
}

fn last_error() -> String {
    // SAFETY: a NUL-terminated message owned by the emulation (this thread's).
    unsafe { CStr::from_ptr(aclGetRecentErrMsg()) }
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

fn upload(p: *mut c_void, bytes: &[u8]) {
    // SAFETY: `bytes` is valid host memory of its length; the emulation checks the device side.
    let rc = unsafe {
        aclrtMemcpy(
            p,
            bytes.len(),
            bytes.as_ptr().cast(),
            bytes.len(),
            ACL_MEMCPY_HOST_TO_DEVICE,
        )
    };
    assert_eq!(rc, 0, "{}", last_error());
}

fn download(p: *mut c_void, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    // SAFETY: `out` holds `n` bytes; the emulation checks the device side.
    let rc = unsafe { aclrtMemcpy(out.as_mut_ptr().cast(), n, p, n, ACL_MEMCPY_DEVICE_TO_HOST) };
    assert_eq!(rc, 0, "{}", last_error());
    out
}

/// Values as 2-byte `dtype` (ACL_FLOAT16 or ACL_BF16) bytes, or f32 bytes for ACL_FLOAT.
fn bytes_of(dtype: aclDataType, v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| match dtype {
            ACL_FLOAT16 => f16::from_f32(x).to_le_bytes().to_vec(),
            ACL_BF16 => bf16::from_f32(x).to_le_bytes().to_vec(),
            _ => x.to_le_bytes().to_vec(),
        })
        .collect()
}

/// A tensor over device memory `p`: `dims` with `strides`, storage `storage` elements.
fn tensor(
    p: *mut c_void,
    dtype: aclDataType,
    dims: &[i64],
    strides: &[i64],
    storage: i64,
) -> *mut aclTensor {
    let st = [storage];
    // SAFETY: valid arrays of the lengths passed; `p` is device memory of the storage.
    let t = unsafe {
        aclCreateTensor(
            dims.as_ptr(),
            dims.len() as u64,
            dtype,
            strides.as_ptr(),
            0,
            ACL_FORMAT_ND,
            st.as_ptr(),
            1,
            p,
        )
    };
    assert!(!t.is_null(), "{}", last_error());
    t
}

/// The name of communicator `comm` (`HcclGetCommName`).
fn comm_name(comm: HcclComm) -> std::ffi::CString {
    let mut name = [0 as c_char; HCCL_COMM_NAME_MAX_LENGTH];
    // SAFETY: a live communicator and a buffer of the documented size.
    let rc = unsafe { HcclGetCommName(comm, name.as_mut_ptr()) };
    assert_eq!(rc, HCCL_SUCCESS, "{}", last_error());
    // SAFETY: NUL-terminated by the call.
    unsafe { CStr::from_ptr(name.as_ptr()) }.to_owned()
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

/// aclnnMatmulAllReduce launches so far in this process (the emulation's count).
fn launches() -> u64 {
    // SAFETY: a NUL-terminated name.
    unsafe { ascendEmulatorLaunchCount(c"aclnnMatmulAllReduce".as_ptr()) }
}

const M: usize = 3;
const K: usize = 40;
const N: usize = 24;

/// Rank `r`'s activations (M x K) and weight storage (N x K, the operator sees its transpose).
fn inputs(r: u32) -> (Vec<f32>, Vec<f32>) {
    let x = (0..M * K)
        .map(|i| ((i * 37 + r as usize * 101) % 53) as f32 * 0.25 - 6.0)
        .collect();
    let w = (0..N * K)
        .map(|i| ((i * 29 + r as usize * 7) % 31) as f32 * 0.0625 - 0.9)
        .collect();
    (x, w)
}

/// The first phase of MatmulAllReduce; Err((status, message)) on a refusal.
#[allow(clippy::too_many_arguments)]
fn prepare(
    x1: *mut aclTensor,
    x2: *mut aclTensor,
    bias: *mut aclTensor,
    group: &CStr,
    op: &CStr,
    comm_turn: i64,
    stream_mode: i64,
    out: *mut aclTensor,
) -> Result<(u64, *mut aclOpExecutor), (aclnnStatus, String)> {
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    // SAFETY: live tensors (or null bias), NUL-terminated strings, valid out-pointers.
    let rc = unsafe {
        aclnnMatmulAllReduceGetWorkspaceSize(
            x1,
            x2,
            bias,
            group.as_ptr(),
            op.as_ptr(),
            comm_turn,
            stream_mode,
            out,
            &mut ws,
            &mut exec,
        )
    };
    if rc == 0 {
        Ok((ws, exec))
    } else {
        Err((rc, last_error()))
    }
}

#[test]
fn fused_gives_the_bits_of_matmul_then_hccl_all_reduce() {
    for (dtype, hccl_dt, devices) in [
        (ACL_FLOAT16, HCCL_DATA_TYPE_FP16, [0, 1]),
        (ACL_BF16, HCCL_DATA_TYPE_BFP16, [2, 3]),
    ] {
        let before = launches();
        let outs = ranks(&devices, |r, stream, comm| {
            let (xv, wv) = inputs(r);
            let (x, w) = (malloc(M * K * 2), malloc(N * K * 2));
            let (fused, two) = (malloc(M * N * 2), malloc(M * N * 2));
            upload(x, &bytes_of(dtype, &xv));
            upload(w, &bytes_of(dtype, &wv));
            let tx = tensor(
                x,
                dtype,
                &[M as i64, K as i64],
                &[K as i64, 1],
                (M * K) as i64,
            );
            // (K, N) over the (N, K) storage: the transposed view the backend passes.
            let tw = tensor(
                w,
                dtype,
                &[K as i64, N as i64],
                &[1, K as i64],
                (N * K) as i64,
            );
            let tf = tensor(
                fused,
                dtype,
                &[M as i64, N as i64],
                &[N as i64, 1],
                (M * N) as i64,
            );
            let tt = tensor(
                two,
                dtype,
                &[M as i64, N as i64],
                &[N as i64, 1],
                (M * N) as i64,
            );
            let group = comm_name(comm);
            let (ws, exec) = prepare(tx, tw, std::ptr::null_mut(), &group, c"sum", 0, 1, tf)
                .unwrap_or_else(|(rc, m)| panic!("rank {r}: refused ({rc}): {m}"));
            assert_eq!(ws, 0);
            assert_eq!(
                aclnnMatmulAllReduce(std::ptr::null_mut(), 0, exec, stream),
                0,
                "{}",
                last_error()
            );
            // The two calls: Matmul, then HcclAllReduce in place.
            let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
            // SAFETY: live tensors and valid out-pointers.
            let rc = unsafe { aclnnMatmulGetWorkspaceSize(tx, tw, tt, 0, &mut ws, &mut exec) };
            assert_eq!(rc, 0, "{}", last_error());
            assert_eq!(aclnnMatmul(std::ptr::null_mut(), 0, exec, stream), 0);
            let rc = HcclAllReduce(
                two,
                two,
                (M * N) as u64,
                hccl_dt,
                HCCL_REDUCE_SUM,
                comm,
                stream,
            );
            assert_eq!(rc, HCCL_SUCCESS, "{}", last_error());
            assert_eq!(aclrtSynchronizeStream(stream), 0, "{}", last_error());
            let got = (download(fused, M * N * 2), download(two, M * N * 2));
            for t in [tx, tw, tf, tt] {
                aclDestroyTensor(t);
            }
            for p in [x, w, fused, two] {
                assert_eq!(aclrtFree(p), 0);
            }
            got
        });
        for (r, (fused, two)) in outs.iter().enumerate() {
            assert!(
                fused == two,
                "dtype {dtype}, rank {r}: the fused output differs from Matmul + HcclAllReduce"
            );
            assert!(fused.iter().any(|&b| b != 0), "rank {r}: all zeros");
        }
        assert_eq!(outs[0].0, outs[1].0, "dtype {dtype}: the ranks differ");
        let after = launches();
        assert!(after >= before + 2, "launches counted: {before} -> {after}");
    }
}

#[test]
fn what_the_page_forbids_is_refused() {
    ranks(&[4], |_, stream, comm| {
        let (xv, wv) = inputs(0);
        let h = ACL_FLOAT16;
        let (x, w, out) = (malloc(M * K * 4), malloc(N * K * 4), malloc(M * N * 4));
        upload(x, &bytes_of(h, &xv));
        upload(w, &bytes_of(h, &wv));
        let tx = tensor(x, h, &[M as i64, K as i64], &[K as i64, 1], (M * K) as i64);
        let tw = tensor(w, h, &[K as i64, N as i64], &[1, K as i64], (N * K) as i64);
        let to = tensor(
            out,
            h,
            &[M as i64, N as i64],
            &[N as i64, 1],
            (M * N) as i64,
        );
        let f = ACL_FLOAT;
        let fx = tensor(x, f, &[M as i64, K as i64], &[K as i64, 1], (M * K) as i64);
        let fw = tensor(w, f, &[K as i64, N as i64], &[1, K as i64], (N * K) as i64);
        let fo = tensor(
            out,
            f,
            &[M as i64, N as i64],
            &[N as i64, 1],
            (M * N) as i64,
        );
        let flat = tensor(x, h, &[(M * K) as i64], &[1], (M * K) as i64);
        let bias = tensor(out, h, &[N as i64], &[1], N as i64);
        let group = comm_name(comm);
        let null = std::ptr::null_mut();
        let cases: [(&str, _, &str); 8] = [
            (
                "a group that is no live communicator's name",
                prepare(tx, tw, null, c"not-a-communicator", c"sum", 0, 1, to),
                "not the HcclGetCommName",
            ),
            (
                "f32",
                prepare(fx, fw, null, &group, c"sum", 0, 1, fo),
                "data type",
            ),
            (
                "a 1-D x1",
                prepare(flat, tw, null, &group, c"sum", 0, 1, to),
                "2-D or 3-D",
            ),
            (
                "reduceOp max",
                prepare(tx, tw, null, &group, c"max", 0, 1, to),
                "reduceOp",
            ),
            (
                "commTurn 1",
                prepare(tx, tw, null, &group, c"sum", 1, 1, to),
                "commTurn",
            ),
            (
                "streamMode 0",
                prepare(tx, tw, null, &group, c"sum", 0, 0, to),
                "streamMode",
            ),
            (
                "a bias (not emulated)",
                prepare(tx, tw, bias, &group, c"sum", 0, 1, to),
                "bias",
            ),
            (
                "x2 that does not meet x1's k",
                prepare(tx, to, null, &group, c"sum", 0, 1, to),
                "do not agree",
            ),
        ];
        for (what, r, says) in cases {
            match r {
                Ok(_) => panic!("{what}: accepted"),
                Err((rc, msg)) => {
                    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID, "{what}: {msg}");
                    assert!(
                        msg.contains("aclnnMatmulAllReduce") && msg.contains(says),
                        "{what}: {msg}"
                    );
                }
            }
        }
        // The documented arguments are accepted (one rank: the product itself).
        let (_, exec) = prepare(tx, tw, null, &group, c"sum", 0, 1, to)
            .unwrap_or_else(|(rc, m)| panic!("refused ({rc}): {m}"));
        assert_eq!(
            aclnnMatmulAllReduce(std::ptr::null_mut(), 0, exec, stream),
            0,
            "{}",
            last_error()
        );
        assert_eq!(aclrtSynchronizeStream(stream), 0, "{}", last_error());
        for t in [tx, tw, to, fx, fw, fo, flat, bias] {
            aclDestroyTensor(t);
        }
        for p in [x, w, out] {
            assert_eq!(aclrtFree(p), 0);
        }
    });
}

#[test]
fn quantized_fused_gives_the_bits_of_wqbmm_then_hccl_all_reduce() {
    const KQ: usize = 64;
    const G: usize = 32;
    let h = ACL_FLOAT16;
    let outs = ranks(&[5, 6], |r, stream, comm| {
        let xv: Vec<f32> = (0..M * KQ)
            .map(|i| ((i * 37 + r as usize * 101) % 53) as f32 * 0.25 - 6.0)
            .collect();
        // INT8 weights stored (n, k), seen (k, n) transposed; scales (k/G, n) contiguous.
        let wq: Vec<u8> = (0..N * KQ)
            .map(|i| (((i * 29 + r as usize * 7) % 255) as i32 - 127) as i8 as u8)
            .collect();
        let sv: Vec<f32> = (0..KQ / G * N)
            .map(|i| 0.001 + (i % 7) as f32 * 0.0005)
            .collect();
        let (x, w, s) = (malloc(M * KQ * 2), malloc(N * KQ), malloc(KQ / G * N * 2));
        let (fused, two) = (malloc(M * N * 2), malloc(M * N * 2));
        upload(x, &bytes_of(h, &xv));
        upload(w, &wq);
        upload(s, &bytes_of(h, &sv));
        let (m, k, n, g) = (M as i64, KQ as i64, N as i64, (KQ / G) as i64);
        let tx = tensor(x, h, &[m, k], &[k, 1], m * k);
        let tw = tensor(w, ACL_INT8, &[k, n], &[1, k], n * k);
        let ts = tensor(s, h, &[g, n], &[n, 1], g * n);
        let tf = tensor(fused, h, &[m, n], &[n, 1], m * n);
        let tt = tensor(two, h, &[m, n], &[n, 1], m * n);
        let group = comm_name(comm);
        let null = std::ptr::null();
        let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
        // SAFETY: live tensors, null optionals, NUL-terminated strings, valid out-pointers.
        let rc = unsafe {
            aclnnWeightQuantMatmulAllReduceGetWorkspaceSize(
                tx,
                tw,
                null,
                ts,
                null,
                null,
                group.as_ptr(),
                c"sum".as_ptr(),
                0,
                1,
                G as i64,
                tf,
                &mut ws,
                &mut exec,
            )
        };
        assert_eq!(rc, 0, "{}", last_error());
        assert_eq!(
            aclnnWeightQuantMatmulAllReduce(std::ptr::null_mut(), 0, exec, stream),
            0,
            "{}",
            last_error()
        );
        // The two calls: WeightQuantBatchMatmulV2, then HcclAllReduce in place.
        // SAFETY: live tensors, null optionals and valid out-pointers.
        let rc = unsafe {
            aclnnWeightQuantBatchMatmulV2GetWorkspaceSize(
                tx, tw, ts, null, null, null, null, G as i32, tt, &mut ws, &mut exec,
            )
        };
        assert_eq!(rc, 0, "{}", last_error());
        assert_eq!(
            aclnnWeightQuantBatchMatmulV2(std::ptr::null_mut(), 0, exec, stream),
            0
        );
        let rc = HcclAllReduce(
            two,
            two,
            (M * N) as u64,
            HCCL_DATA_TYPE_FP16,
            HCCL_REDUCE_SUM,
            comm,
            stream,
        );
        assert_eq!(rc, HCCL_SUCCESS, "{}", last_error());
        assert_eq!(aclrtSynchronizeStream(stream), 0, "{}", last_error());
        let got = (download(fused, M * N * 2), download(two, M * N * 2));
        for t in [tx, tw, ts, tf, tt] {
            aclDestroyTensor(t);
        }
        for p in [x, w, s, fused, two] {
            assert_eq!(aclrtFree(p), 0);
        }
        got
    });
    for (r, (fused, two)) in outs.iter().enumerate() {
        assert!(
            fused == two,
            "rank {r}: the fused output differs from WeightQuantBatchMatmulV2 + HcclAllReduce"
        );
        assert!(fused.iter().any(|&b| b != 0), "rank {r}: all zeros");
    }
    assert_eq!(outs[0].0, outs[1].0, "the ranks differ");
}

/// WeightQuantMatmulAllReduce refuses, naming itself and the argument: a group that is no live
/// communicator's name, an x3 (not emulated), a group size that is not a multiple of 32, and
/// f32 activations; the documented arguments are accepted.
#[test]
fn the_quantized_form_refuses_what_its_page_forbids() {
    const KQ: usize = 64;
    ranks(&[7], |_, stream, comm| {
        let h = ACL_FLOAT16;
        let (m, k, n, g) = (M as i64, KQ as i64, N as i64, 2i64);
        let (x, w, s, out) = (
            malloc(M * KQ * 4),
            malloc(N * KQ),
            malloc(2 * N * 2),
            malloc(M * N * 4),
        );
        upload(x, &bytes_of(h, &vec![0.5; M * KQ]));
        upload(w, &[3u8; N * KQ]);
        upload(s, &bytes_of(h, &[0.25; 2 * N]));
        let tx = tensor(x, h, &[m, k], &[k, 1], m * k);
        let fx = tensor(x, ACL_FLOAT, &[m, k], &[k, 1], m * k);
        let tw = tensor(w, ACL_INT8, &[k, n], &[1, k], n * k);
        let ts = tensor(s, h, &[g, n], &[n, 1], g * n);
        let to = tensor(out, h, &[m, n], &[n, 1], m * n);
        let group = comm_name(comm);
        let null = std::ptr::null();
        let call = |x1, x3, grp: &CStr, gs: i64| {
            let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
            // SAFETY: live tensors (or null), NUL-terminated strings, valid out-pointers.
            let rc = unsafe {
                aclnnWeightQuantMatmulAllReduceGetWorkspaceSize(
                    x1,
                    tw,
                    null,
                    ts,
                    null,
                    x3,
                    grp.as_ptr(),
                    c"sum".as_ptr(),
                    0,
                    1,
                    gs,
                    to,
                    &mut ws,
                    &mut exec,
                )
            };
            (rc, last_error(), exec)
        };
        for (what, (rc, msg, _), says) in [
            (
                "a foreign group",
                call(tx, null, c"not-a-communicator", 32),
                "not the HcclGetCommName",
            ),
            ("an x3", call(tx, to, &group, 32), "x3"),
            (
                "group size 48",
                call(tx, null, &group, 48),
                "multiple of 32",
            ),
            ("f32 x1", call(fx, null, &group, 32), "data type"),
        ] {
            assert_eq!(rc, ACLNN_ERR_PARAM_INVALID, "{what}: {msg}");
            assert!(
                msg.contains("aclnnWeightQuantMatmulAllReduce") && msg.contains(says),
                "{what}: {msg}"
            );
        }
        let (rc, msg, exec) = call(tx, null, &group, 32);
        assert_eq!(rc, 0, "the documented arguments: {msg}");
        assert_eq!(
            aclnnWeightQuantMatmulAllReduce(std::ptr::null_mut(), 0, exec, stream),
            0,
            "{}",
            last_error()
        );
        assert_eq!(aclrtSynchronizeStream(stream), 0, "{}", last_error());
        for t in [tx, fx, tw, ts, to] {
            aclDestroyTensor(t);
        }
        for p in [x, w, s, out] {
            assert_eq!(aclrtFree(p), 0);
        }
    });
}

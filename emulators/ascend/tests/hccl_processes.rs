//! HCCL's emulation across processes, as the server's agents use it: this test (rank 0) runs
//! itself again as a child process (rank 1, on device 1), handing it the root info in the
//! environment. Both sum 64 f32 values (each rank sees the same sums), gather them, and then
//! call mismatched collectives, which are queued (a collective runs in stream order) and must
//! fail on both when the stream runs them, with HCCL_E_PARA.

use std::ffi::c_void;

use ascendcl::hccl::*;
use ascendcl::rt::*;
use npu_ffi::hccl::*;
use npu_ffi::types::*;

const RANK_VAR: &str = "ASCEND_EMULATOR_TEST_HCCL_RANK";
const ROOT_VAR: &str = "ASCEND_EMULATOR_TEST_HCCL_ROOT";
const N: usize = 64;

fn values(rank: usize) -> Vec<f32> {
    (0..N).map(|i| (i * (rank + 1)) as f32 + 0.5).collect()
}

fn dev_upload(v: &[f32]) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    let bytes = std::mem::size_of_val(v);
    // SAFETY: valid out-pointer; the copy reads `bytes` host bytes into the fresh allocation.
    unsafe {
        assert_eq!(aclrtMalloc(&mut p, bytes * 2, ACL_MEM_MALLOC_HUGE_FIRST), 0);
        assert_eq!(
            aclrtMemcpy(
                p,
                bytes * 2,
                v.as_ptr().cast(),
                bytes,
                ACL_MEMCPY_HOST_TO_DEVICE
            ),
            0
        );
    }
    p
}

fn dev_read(p: *mut c_void, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    // SAFETY: `p` holds at least `n` f32 (the stream was synchronized before).
    let rc = unsafe {
        aclrtMemcpy(
            out.as_mut_ptr().cast(),
            n * 4,
            p,
            n * 4,
            ACL_MEMCPY_DEVICE_TO_HOST,
        )
    };
    assert_eq!(rc, 0);
    out
}

/// One rank's part; panics (a failed test, or the child's non-zero exit) on any difference.
fn rank(rank: u32, root: &HcclRootInfo) {
    let mut stream = std::ptr::null_mut();
    let mut comm = std::ptr::null_mut();
    // SAFETY: the documented calls with valid out-pointers.
    unsafe {
        assert_eq!(aclrtSetDevice(rank as i32), 0);
        assert_eq!(aclrtCreateStream(&mut stream), 0);
        assert_eq!(HcclCommInitRootInfo(2, root, rank, &mut comm), HCCL_SUCCESS);
    }
    let x = dev_upload(&values(rank as usize));
    let gathered = dev_upload(&[0f32; 2 * N]);
    // The emulation's collectives are safe to call with any arguments (it checks them).
    assert_eq!(
        HcclAllReduce(
            x,
            x,
            N as u64,
            HCCL_DATA_TYPE_FP32,
            HCCL_REDUCE_SUM,
            comm,
            stream
        ),
        HCCL_SUCCESS
    );
    assert_eq!(
        HcclAllGather(x, gathered, N as u64, HCCL_DATA_TYPE_FP32, comm, stream),
        HCCL_SUCCESS
    );
    assert_eq!(aclrtSynchronizeStream(stream), 0);
    let sum: Vec<f32> = values(0)
        .iter()
        .zip(values(1))
        .map(|(a, b)| a + b)
        .collect();
    assert_eq!(dev_read(x, N), sum, "rank {rank}: the all-reduce");
    let both: Vec<f32> = sum.iter().chain(&sum).copied().collect();
    assert_eq!(
        dev_read(gathered, 2 * N),
        both,
        "rank {rank}: the all-gather"
    );
    // Rank 0 sums where rank 1 gathers.
    let rc = if rank == 0 {
        HcclAllReduce(
            x,
            x,
            N as u64,
            HCCL_DATA_TYPE_FP32,
            HCCL_REDUCE_SUM,
            comm,
            stream,
        )
    } else {
        HcclAllGather(x, gathered, N as u64, HCCL_DATA_TYPE_FP32, comm, stream)
    };
    assert_eq!(rc, HCCL_SUCCESS, "rank {rank}: a collective is queued");
    assert_ne!(
        aclrtSynchronizeStream(stream),
        0,
        "rank {rank}: mismatched collectives ran"
    );
    // SAFETY: a NUL-terminated message owned by the emulation.
    let msg = unsafe { std::ffi::CStr::from_ptr(aclGetRecentErrMsg()) }.to_string_lossy();
    assert!(
        msg.contains("HcclAllReduce")
            && msg.contains("HcclAllGather")
            && msg.contains("HCCL_E_PARA"),
        "{msg}"
    );
    assert_eq!(HcclCommDestroy(comm), HCCL_SUCCESS);
    assert_eq!(aclrtFree(x), 0);
    assert_eq!(aclrtFree(gathered), 0);
    assert_eq!(aclrtDestroyStream(stream), 0);
    assert_eq!(aclrtResetDevice(rank as i32), 0);
}

#[test]
fn two_processes_sum_gather_and_refuse_mismatched_collectives() {
    assert_eq!(aclInit(std::ptr::null()), 0);
    if let Ok(hex) = std::env::var(ROOT_VAR) {
        let r: u32 = std::env::var(RANK_VAR).unwrap().parse().unwrap();
        let bytes: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let root = HcclRootInfo::from_bytes(&bytes.try_into().unwrap());
        rank(r, &root);
        return;
    }
    let mut root = HcclRootInfo::zeroed();
    // SAFETY: a device is set for the call below; `root` is a valid out-pointer.
    unsafe {
        assert_eq!(aclrtSetDevice(0), 0);
        assert_eq!(HcclGetRootInfo(&mut root), HCCL_SUCCESS);
    }
    let hex: String = root.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "two_processes_sum_gather_and_refuse_mismatched_collectives",
            "--nocapture",
        ])
        .env(RANK_VAR, "1")
        .env(ROOT_VAR, hex)
        .spawn()
        .unwrap();
    rank(0, &root);
    assert_eq!(aclrtResetDevice(0), 0);
    assert!(child.wait().unwrap().success(), "rank 1's process failed");
}

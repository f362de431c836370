//! ACL graph capture on the emulation (`aclmdlRICaptureBegin/End`, `aclmdlRIExecuteAsync`,
//! `aclmdlRIDestroy`): launches on a capturing stream are recorded, not run; the calls the
//! capture mode forbids fail with ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT; a replay runs the
//! record in order against the captured addresses (new inputs written there first); destroying
//! frees the record. One test: a capture in GLOBAL mode is process-wide.

use std::ffi::c_void;

use ascendcl::capture::*;
use ascendcl::objects::*;
use ascendcl::ops::aclnnAdd;
use ascendcl::rt::*;
use npu_ffi::types::*;

extern "C" {
    // Defined by the emulation (its module is private); the prototype of `npu_ffi::aclnn`.
    fn aclnnAddGetWorkspaceSize(
        self_: *const aclTensor,
        other: *const aclTensor,
        alpha: *const aclScalar,
        out: *mut aclTensor,
        workspaceSize: *mut u64,
        executor: *mut *mut aclOpExecutor,
    ) -> aclnnStatus;
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
    let rc = unsafe { aclrtMalloc(&mut p, bytes, ACL_MEM_MALLOC_HUGE_FIRST) };
    assert_eq!(rc, 0, "{}", last_error());
    p
}

fn upload(p: *mut c_void, v: &[f32]) -> aclError {
    let n = std::mem::size_of_val(v);
    // SAFETY: `v` is valid host memory of `n` bytes; the emulation checks the device side.
    unsafe { aclrtMemcpy(p, n, v.as_ptr().cast(), n, ACL_MEMCPY_HOST_TO_DEVICE) }
}

fn download(p: *mut c_void, n: usize) -> Result<Vec<f32>, aclError> {
    let mut out = vec![0f32; n];
    // SAFETY: `out` holds `n` f32s; the emulation checks the device side.
    let rc = unsafe {
        aclrtMemcpy(
            out.as_mut_ptr().cast(),
            n * 4,
            p,
            n * 4,
            ACL_MEMCPY_DEVICE_TO_HOST,
        )
    };
    if rc == 0 {
        Ok(out)
    } else {
        Err(rc)
    }
}

fn tensor(p: *mut c_void, n: i64) -> *mut aclTensor {
    let (dims, strides) = ([n], [1i64]);
    // SAFETY: valid arrays of one element each; `p` is device memory of `n` f32s.
    let t = unsafe {
        aclCreateTensor(
            dims.as_ptr(),
            1,
            ACL_FLOAT,
            strides.as_ptr(),
            0,
            ACL_FORMAT_ND,
            dims.as_ptr(),
            1,
            p,
        )
    };
    assert!(!t.is_null(), "{}", last_error());
    t
}

/// `out = a + b` launched on `stream` (queued, or recorded while it captures).
fn add(
    a: *mut c_void,
    b: *mut c_void,
    out: *mut c_void,
    n: i64,
    stream: aclrtStream,
) -> aclnnStatus {
    let (ta, tb, to) = (tensor(a, n), tensor(b, n), tensor(out, n));
    let mut one = 1f32;
    // SAFETY: a valid f32 value.
    let alpha = unsafe { aclCreateScalar((&mut one as *mut f32).cast(), ACL_FLOAT) };
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    // SAFETY: live objects and valid out-pointers.
    let rc = unsafe { aclnnAddGetWorkspaceSize(ta, tb, alpha, to, &mut ws, &mut exec) };
    assert_eq!(rc, 0, "{}", last_error());
    assert_eq!(ws, 0);
    let rc = aclnnAdd(std::ptr::null_mut(), 0, exec, stream);
    for t in [ta, tb, to] {
        aclDestroyTensor(t);
    }
    aclDestroyScalar(alpha);
    rc
}

#[test]
fn capture_records_refuses_and_replays() {
    let opp = std::env::temp_dir().join(format!("ascend-capture-opp-{}", std::process::id()));
    std::fs::create_dir_all(&opp).unwrap();
    std::env::set_var("ASCEND_OPP_PATH", &opp);
    assert_eq!(aclInit(std::ptr::null()), 0);
    assert_eq!(aclrtSetDevice(0), 0);
    let mut stream = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { aclrtCreateStream(&mut stream) },
        0,
        "{}",
        last_error()
    );
    const N: usize = 64;
    let (x, y, z, w) = (malloc(N * 4), malloc(N * 4), malloc(N * 4), malloc(N * 4));
    let ones = vec![1f32; N];
    let iota: Vec<f32> = (0..N).map(|i| i as f32).collect();
    assert_eq!(upload(x, &iota), 0);
    assert_eq!(upload(y, &ones), 0);
    assert_eq!(upload(z, &vec![0f32; N]), 0);

    // End without a begin.
    let mut ri: aclmdlRI = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { aclmdlRICaptureEnd(stream, &mut ri) },
        ACL_ERROR_RT_STREAM_NOT_CAPTURED
    );
    assert_eq!(aclmdlRICaptureBegin(stream, 7), ACL_ERROR_INVALID_PARAM);

    // Capture z = x + y; w = z + y.
    assert_eq!(
        aclmdlRICaptureBegin(stream, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL),
        0,
        "{}",
        last_error()
    );
    assert_eq!(
        aclmdlRICaptureBegin(stream, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL),
        ACL_ERROR_RT_PARAM_INVALID
    );
    assert_eq!(add(x, y, z, N as i64, stream), 0, "{}", last_error());
    assert_eq!(add(z, y, w, N as i64, stream), 0, "{}", last_error());
    // Forbidden while capturing: reading back (a synchronous copy), writing, memset, allocation,
    // free, synchronization, events.
    let not = ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT;
    assert_eq!(download(z, N), Err(not));
    assert!(last_error().contains("capturing"), "{}", last_error());
    assert_eq!(upload(x, &ones), not);
    assert_eq!(aclrtMemset(x, N * 4, 0, N * 4), not);
    let mut p = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { aclrtMalloc(&mut p, 256, ACL_MEM_MALLOC_HUGE_FIRST) },
        not
    );
    assert_eq!(aclrtFree(w), not);
    assert_eq!(aclrtSynchronizeStream(stream), not);
    assert_eq!(aclrtSynchronizeDevice(), not);
    assert_eq!(aclrtDestroyStream(stream), not);
    let mut ev = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { aclrtCreateEvent(&mut ev) }, 0);
    assert_eq!(aclrtRecordEvent(ev, stream), not);
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { aclmdlRICaptureEnd(stream, &mut ri) },
        0,
        "{}",
        last_error()
    );
    assert!(!ri.is_null());
    assert_eq!(aclrtDestroyEvent(ev), 0);

    // Nothing ran: z and w are as before the capture.
    assert_eq!(aclrtSynchronizeStream(stream), 0, "{}", last_error());
    assert_eq!(download(z, N).unwrap(), vec![0f32; N]);

    // Replays run the record against the captured addresses, with whatever they hold then.
    let before = ascendEmulatorGraphReplays();
    assert_eq!(aclmdlRIExecuteAsync(ri, stream), 0, "{}", last_error());
    // A replay still queued cannot be destroyed.
    assert_eq!(aclmdlRIDestroy(ri), ACL_ERROR_RT_PARAM_INVALID);
    assert_eq!(aclrtSynchronizeStream(stream), 0, "{}", last_error());
    let want: Vec<f32> = iota.iter().map(|v| v + 2.0).collect();
    assert_eq!(download(w, N).unwrap(), want);
    // New inputs at the same address, written by an async copy queued before the replay.
    let mut pinned = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { aclrtMallocHost(&mut pinned, N * 4) }, 0);
    // SAFETY: `pinned` holds N f32s.
    unsafe { std::slice::from_raw_parts_mut(pinned as *mut f32, N) }.fill(10.0);
    // SAFETY: pinned host memory and device memory of N * 4 bytes.
    let rc =
        unsafe { aclrtMemcpyAsync(x, N * 4, pinned, N * 4, ACL_MEMCPY_HOST_TO_DEVICE, stream) };
    assert_eq!(rc, 0, "{}", last_error());
    assert_eq!(aclmdlRIExecuteAsync(ri, stream), 0, "{}", last_error());
    assert_eq!(aclrtSynchronizeStream(stream), 0, "{}", last_error());
    assert_eq!(download(w, N).unwrap(), vec![12f32; N]);
    assert_eq!(download(z, N).unwrap(), vec![11f32; N]);
    assert_eq!(ascendEmulatorGraphReplays() - before, 2);

    // A recorded address freed: the replay is refused.
    assert_eq!(aclrtFree(w), 0);
    assert_eq!(aclmdlRIExecuteAsync(ri, stream), ACL_ERROR_RT_PARAM_INVALID);
    assert!(
        last_error().contains("no longer allocated"),
        "{}",
        last_error()
    );

    // RELAXED permits the unsafe calls; THREAD_LOCAL forbids them on the capturing thread only.
    assert_eq!(
        aclmdlRICaptureBegin(stream, ACL_MODEL_RI_CAPTURE_MODE_RELAXED),
        0
    );
    assert_eq!(upload(x, &ones), 0, "{}", last_error());
    assert_eq!(aclrtSynchronizeStream(stream), not);
    let mut empty: aclmdlRI = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { aclmdlRICaptureEnd(stream, &mut empty) }, 0);
    assert_eq!(
        aclmdlRICaptureBegin(stream, ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL),
        0
    );
    assert_eq!(upload(x, &ones), not);
    let ctx = {
        let mut c = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { aclrtGetCurrentContext(&mut c) }, 0);
        c as usize
    };
    let xa = x as usize;
    let other = std::thread::spawn(move || {
        assert_eq!(aclrtSetCurrentContext(ctx as aclrtContext), 0);
        upload(xa as *mut c_void, &[2f32; N])
    })
    .join()
    .unwrap();
    assert_eq!(other, 0, "another thread may copy under THREAD_LOCAL");
    let mut third: aclmdlRI = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { aclmdlRICaptureEnd(stream, &mut third) }, 0);

    // Destroying frees the record; a destroyed instance is gone.
    for g in [ri, empty, third] {
        assert_eq!(aclmdlRIDestroy(g), 0, "{}", last_error());
    }
    assert_eq!(aclmdlRIDestroy(ri), ACL_ERROR_RT_INVALID_HANDLE);
    assert_eq!(
        aclmdlRIExecuteAsync(ri, stream),
        ACL_ERROR_RT_INVALID_HANDLE
    );
    for p in [x, y, z] {
        assert_eq!(aclrtFree(p), 0);
    }
    assert_eq!(aclrtFreeHost(pinned), 0);
    assert_eq!(aclrtDestroyStream(stream), 0, "{}", last_error());
    assert!(
        !ascendcl::state::state()
            .leak_report()
            .iter()
            .any(|l| l.contains("aclmdlRI")),
        "no model run instance left"
    );
    assert_eq!(aclrtResetDevice(0), 0);
    assert_eq!(aclFinalize(), 0);
    let _ = std::fs::remove_dir_all(&opp);
}

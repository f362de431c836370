//! An emulated Atlas A3 (`ASCEND_EMULATOR_SOC=Ascend910_9391`, set before the emulation first
//! reads it; this file is its own process): `aclrtGetSocName` names it, and the two fused
//! matmul + all-reduce operators, whose pages list Atlas A2 only, are refused naming the chip
//! before any argument is looked at (the backend reads the name and keeps matmul then
//! HcclAllReduce there).

use std::ffi::{c_char, CStr};

use ascendcl::rt::*;
use npu_ffi::types::*;

extern "C" {
    // Defined by the emulation (its modules are private); the prototypes of `npu_ffi::aclnn`.
    #[allow(clippy::too_many_arguments)]
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
    #[allow(clippy::too_many_arguments)]
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
}

fn last_error() -> String {
    // SAFETY: a NUL-terminated message owned by the emulation (this thread's).
    unsafe { CStr::from_ptr(aclGetRecentErrMsg()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn an_atlas_a3_names_itself_and_refuses_the_fused_matmul_all_reduce() {
    std::env::set_var("ASCEND_EMULATOR_SOC", "Ascend910_9391");
    let opp = std::env::temp_dir().join(format!("ascend-soc-opp-{}", std::process::id()));
    std::fs::create_dir_all(&opp).unwrap();
    std::env::set_var("ASCEND_OPP_PATH", &opp);
    assert_eq!(aclInit(std::ptr::null()), 0);
    assert_eq!(aclrtSetDevice(0), 0);
    // SAFETY: a NUL-terminated name owned by the emulation for the process.
    let soc = unsafe { CStr::from_ptr(aclrtGetSocName()) };
    assert_eq!(soc.to_str().unwrap(), "Ascend910_9391");
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    let null = std::ptr::null();
    // SAFETY: null tensors and strings are allowed arguments (refused by the operator); the
    // out-pointers are valid.
    let rc = unsafe {
        aclnnMatmulAllReduceGetWorkspaceSize(
            null,
            null,
            null,
            c"g".as_ptr(),
            c"sum".as_ptr(),
            0,
            1,
            null,
            &mut ws,
            &mut exec,
        )
    };
    assert_ne!(rc, 0);
    let e = last_error();
    assert!(
        e.contains("aclnnMatmulAllReduce") && e.contains("Atlas A3"),
        "{e}"
    );
    // SAFETY: as above.
    let rc = unsafe {
        aclnnWeightQuantMatmulAllReduceGetWorkspaceSize(
            null,
            null,
            null,
            null,
            null,
            null,
            c"g".as_ptr(),
            c"sum".as_ptr(),
            0,
            1,
            32,
            null,
            &mut ws,
            &mut exec,
        )
    };
    assert_ne!(rc, 0);
    let e = last_error();
    assert!(
        e.contains("aclnnWeightQuantMatmulAllReduce") && e.contains("Atlas A3"),
        "{e}"
    );
    assert_eq!(aclrtResetDevice(0), 0);
    assert_eq!(aclFinalize(), 0);
}

//! ACL runtime prototypes (`libascendcl.so`: `acl/acl.h`, `acl/acl_rt.h`): init/finalize,
//! devices, contexts, streams, events, device and pinned host memory, copies, memory info, the
//! installed version and the last error message. Written from the documented prototypes (AscendCL API reference,
//! "aclInit", "aclrtMalloc", "aclrtMemcpyAsync", "aclrtGetMemInfo", ...). Device memory
//! information is `aclrtGetMemInfo(attr, &free, &total)`, ACL's name for what other runtimes
//! call "MemGetInfo".

use core::ffi::{c_char, c_void};

pub use crate::types::*;

crate::api_table! {
    /// The ACL runtime entry points, resolved from `libascendcl.so`.
    pub struct AclRuntimeApi ("libascendcl.so") {
        required {
            fn aclInit(configPath: *const c_char) -> aclError;
            fn aclFinalize() -> aclError;
            fn aclGetRecentErrMsg() -> *const c_char;
            fn aclrtGetVersion(majorVersion: *mut i32, minorVersion: *mut i32, patchVersion: *mut i32) -> aclError;
            fn aclrtSetDevice(deviceId: i32) -> aclError;
            fn aclrtResetDevice(deviceId: i32) -> aclError;
            fn aclrtGetDevice(deviceId: *mut i32) -> aclError;
            fn aclrtGetDeviceCount(count: *mut u32) -> aclError;
            fn aclrtCreateContext(context: *mut aclrtContext, deviceId: i32) -> aclError;
            fn aclrtDestroyContext(context: aclrtContext) -> aclError;
            fn aclrtSetCurrentContext(context: aclrtContext) -> aclError;
            fn aclrtGetCurrentContext(context: *mut aclrtContext) -> aclError;
            fn aclrtCreateStream(stream: *mut aclrtStream) -> aclError;
            fn aclrtDestroyStream(stream: aclrtStream) -> aclError;
            fn aclrtSynchronizeStream(stream: aclrtStream) -> aclError;
            fn aclrtSynchronizeDevice() -> aclError;
            fn aclrtCreateEvent(event: *mut aclrtEvent) -> aclError;
            fn aclrtDestroyEvent(event: aclrtEvent) -> aclError;
            fn aclrtRecordEvent(event: aclrtEvent, stream: aclrtStream) -> aclError;
            fn aclrtSynchronizeEvent(event: aclrtEvent) -> aclError;
            fn aclrtStreamWaitEvent(stream: aclrtStream, event: aclrtEvent) -> aclError;
            fn aclrtEventElapsedTime(ms: *mut f32, startEvent: aclrtEvent, endEvent: aclrtEvent) -> aclError;
            fn aclrtMalloc(devPtr: *mut *mut c_void, size: usize, policy: aclrtMemMallocPolicy) -> aclError;
            fn aclrtFree(devPtr: *mut c_void) -> aclError;
            fn aclrtMallocHost(hostPtr: *mut *mut c_void, size: usize) -> aclError;
            fn aclrtFreeHost(hostPtr: *mut c_void) -> aclError;
            fn aclrtMemcpy(dst: *mut c_void, destMax: usize, src: *const c_void, count: usize, kind: aclrtMemcpyKind) -> aclError;
            fn aclrtMemcpyAsync(dst: *mut c_void, destMax: usize, src: *const c_void, count: usize, kind: aclrtMemcpyKind, stream: aclrtStream) -> aclError;
            fn aclrtMemset(devPtr: *mut c_void, maxCount: usize, value: i32, count: usize) -> aclError;
            fn aclrtMemsetAsync(devPtr: *mut c_void, maxCount: usize, value: i32, count: usize, stream: aclrtStream) -> aclError;
            fn aclrtGetMemInfo(attr: aclrtMemAttr, free: *mut usize, total: *mut usize) -> aclError;
        }
        optional {
            // Deprecated in newer headers in favour of the two below (CANN 8.5+, "runtime" etc.
            // as package names, the directories of `share/info`); kept as the fallback.
            fn aclsysGetCANNVersion(name: aclCANNPackageName, version: *mut aclCANNPackageVersion) -> aclError;
            fn aclsysGetVersionStr(pkgName: *mut c_char, versionStr: *mut c_char) -> aclError;
            fn aclsysGetVersionNum(pkgName: *mut c_char, versionNum: *mut i32) -> aclError;
            // ACL graph: stream capture into a model run instance and its replay (CANN 8.1+,
            // documented as a trial feature; "aclmdlRICaptureBegin", "aclmdlRICaptureEnd",
            // "aclmdlRIExecuteAsync", "aclmdlRIDestroy").
            fn aclmdlRICaptureBegin(stream: aclrtStream, mode: aclmdlRICaptureMode) -> aclError;
            fn aclmdlRICaptureEnd(stream: aclrtStream, modelRI: *mut aclmdlRI) -> aclError;
            fn aclmdlRIExecuteAsync(modelRI: aclmdlRI, stream: aclrtStream) -> aclError;
            fn aclmdlRIDestroy(modelRI: aclmdlRI) -> aclError;
            // The SoC's name ("aclrtGetSocName": e.g. "Ascend910B3" on an Atlas A2,
            // "Ascend910_9391" on an Atlas A3); null when it cannot be read.
            fn aclrtGetSocName() -> *const c_char;
        }
    }
}

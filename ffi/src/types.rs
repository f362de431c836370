//! C types, enums and status codes of the ACL runtime (`acl/acl_base.h`, `acl/acl_rt.h`,
//! `acl/acl.h`, `acl/error_codes/rt_error_codes.h`) and of aclnn (`aclnn/acl_meta.h`,
//! `aclnn/opdev/op_errno.h`), written from CANN's documented headers (checked against CANN
//! 8.1.RC1). Enum types are plain integer aliases with one constant per documented value, the way
//! the C ABI passes them (and the way bindgen renders them).

#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]

use core::ffi::{c_char, c_int, c_uint, c_void};

/// `typedef int aclError;`
pub type aclError = c_int;
/// `typedef int32_t aclnnStatus;`
pub type aclnnStatus = i32;
/// `typedef void *aclrtStream;`
pub type aclrtStream = *mut c_void;
/// `typedef void *aclrtEvent;`
pub type aclrtEvent = *mut c_void;
/// `typedef void *aclrtContext;`
pub type aclrtContext = *mut c_void;
/// `typedef void *aclmdlRI;` (a model run instance: what stream capture records).
pub type aclmdlRI = *mut c_void;
/// `typedef uint16_t aclFloat16;`
pub type aclFloat16 = u16;

macro_rules! opaque {
    ($($name:ident),* $(,)?) => {$(
        /// Opaque handle type (only ever used behind a pointer).
        #[repr(C)]
        pub struct $name {
            _unused: [u8; 0],
        }
    )*};
}
opaque!(
    aclOpExecutor,
    aclTensor,
    aclScalar,
    aclIntArray,
    aclFloatArray,
    aclBoolArray,
    aclTensorList
);

// ---- aclDataType (acl_base.h) -------------------------------------------------------------
pub type aclDataType = c_int;
pub const ACL_DT_UNDEFINED: aclDataType = -1;
pub const ACL_FLOAT: aclDataType = 0;
pub const ACL_FLOAT16: aclDataType = 1;
pub const ACL_INT8: aclDataType = 2;
pub const ACL_INT32: aclDataType = 3;
pub const ACL_UINT8: aclDataType = 4;
pub const ACL_INT16: aclDataType = 6;
pub const ACL_UINT16: aclDataType = 7;
pub const ACL_UINT32: aclDataType = 8;
pub const ACL_INT64: aclDataType = 9;
pub const ACL_UINT64: aclDataType = 10;
pub const ACL_DOUBLE: aclDataType = 11;
pub const ACL_BOOL: aclDataType = 12;
pub const ACL_STRING: aclDataType = 13;
pub const ACL_COMPLEX64: aclDataType = 16;
pub const ACL_COMPLEX128: aclDataType = 17;
pub const ACL_BF16: aclDataType = 27;
pub const ACL_INT4: aclDataType = 29;
pub const ACL_UINT1: aclDataType = 30;
pub const ACL_COMPLEX32: aclDataType = 33;

// ---- aclFormat (acl_base.h) ---------------------------------------------------------------
pub type aclFormat = c_int;
pub const ACL_FORMAT_UNDEFINED: aclFormat = -1;
pub const ACL_FORMAT_NCHW: aclFormat = 0;
pub const ACL_FORMAT_NHWC: aclFormat = 1;
pub const ACL_FORMAT_ND: aclFormat = 2;
pub const ACL_FORMAT_NC1HWC0: aclFormat = 3;
pub const ACL_FORMAT_FRACTAL_Z: aclFormat = 4;
pub const ACL_FORMAT_FRACTAL_NZ: aclFormat = 29;
pub const ACL_FORMAT_NCDHW: aclFormat = 30;
pub const ACL_FORMAT_NC: aclFormat = 35;
pub const ACL_FORMAT_NCL: aclFormat = 47;

// ---- aclmdlRICaptureMode (acl_mdl.h; ACL graph capture, CANN 8.1+) ---------------------------
/// Which threads may call the functions unsafe while a stream captures (`aclrtMemset`,
/// `aclrtMemcpy`, `aclrtMemcpy2d`, asynchronous copies of memory that is not pinned).
pub type aclmdlRICaptureMode = c_uint;
/// No thread may call them.
pub const ACL_MODEL_RI_CAPTURE_MODE_GLOBAL: aclmdlRICaptureMode = 0;
/// The capturing thread may not call them.
pub const ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL: aclmdlRICaptureMode = 1;
/// Every thread may call them.
pub const ACL_MODEL_RI_CAPTURE_MODE_RELAXED: aclmdlRICaptureMode = 2;

// ---- aclrtMemcpyKind (acl_rt.h) -----------------------------------------------------------
pub type aclrtMemcpyKind = c_uint;
pub const ACL_MEMCPY_HOST_TO_HOST: aclrtMemcpyKind = 0;
pub const ACL_MEMCPY_HOST_TO_DEVICE: aclrtMemcpyKind = 1;
pub const ACL_MEMCPY_DEVICE_TO_HOST: aclrtMemcpyKind = 2;
pub const ACL_MEMCPY_DEVICE_TO_DEVICE: aclrtMemcpyKind = 3;
pub const ACL_MEMCPY_DEFAULT: aclrtMemcpyKind = 4;

// ---- aclrtMemMallocPolicy (acl_rt.h) ------------------------------------------------------
pub type aclrtMemMallocPolicy = c_uint;
pub const ACL_MEM_MALLOC_HUGE_FIRST: aclrtMemMallocPolicy = 0;
pub const ACL_MEM_MALLOC_HUGE_ONLY: aclrtMemMallocPolicy = 1;
pub const ACL_MEM_MALLOC_NORMAL_ONLY: aclrtMemMallocPolicy = 2;

// ---- aclrtMemAttr (acl_rt.h), for aclrtGetMemInfo -----------------------------------------
pub type aclrtMemAttr = c_uint;
pub const ACL_DDR_MEM: aclrtMemAttr = 0;
pub const ACL_HBM_MEM: aclrtMemAttr = 1;

// ---- aclrtEventRecordedStatus (acl_rt.h) --------------------------------------------------
pub type aclrtEventRecordedStatus = c_uint;
pub const ACL_EVENT_RECORDED_STATUS_NOT_READY: aclrtEventRecordedStatus = 0;
pub const ACL_EVENT_RECORDED_STATUS_COMPLETE: aclrtEventRecordedStatus = 1;

// ---- aclCANNPackageName / aclCANNPackageVersion (acl.h, CANN 8.x) -------------------------
pub type aclCANNPackageName = c_uint;
pub const ACL_PKG_NAME_CANN: aclCANNPackageName = 0;
pub const ACL_PKG_NAME_RUNTIME: aclCANNPackageName = 1;
pub const ACL_PKG_VERSION_MAX_SIZE: usize = 128;
pub const ACL_PKG_VERSION_PARTS_MAX_SIZE: usize = 64;

/// `aclCANNPackageVersion`: NUL-terminated version strings.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct aclCANNPackageVersion {
    pub version: [c_char; ACL_PKG_VERSION_MAX_SIZE],
    pub majorVersion: [c_char; ACL_PKG_VERSION_PARTS_MAX_SIZE],
    pub minorVersion: [c_char; ACL_PKG_VERSION_PARTS_MAX_SIZE],
    pub releaseVersion: [c_char; ACL_PKG_VERSION_PARTS_MAX_SIZE],
    pub patchVersion: [c_char; ACL_PKG_VERSION_PARTS_MAX_SIZE],
    pub reserved: [c_char; ACL_PKG_VERSION_MAX_SIZE],
}

// ---- ACL status codes (acl_base.h) --------------------------------------------------------
pub const ACL_SUCCESS: aclError = 0;
pub const ACL_ERROR_INVALID_PARAM: aclError = 100000;
pub const ACL_ERROR_UNINITIALIZE: aclError = 100001;
pub const ACL_ERROR_REPEAT_INITIALIZE: aclError = 100002;
pub const ACL_ERROR_REPEAT_FINALIZE: aclError = 100037;
pub const ACL_ERROR_RELATIVE_RESOURCE_NOT_CLEARED: aclError = 148051;
pub const ACL_ERROR_BAD_ALLOC: aclError = 200000;
pub const ACL_ERROR_API_NOT_SUPPORT: aclError = 200001;
pub const ACL_ERROR_INVALID_DEVICE: aclError = 200002;
pub const ACL_ERROR_MEMORY_ADDRESS_UNALIGNED: aclError = 200003;
pub const ACL_ERROR_INVALID_RESOURCE_HANDLE: aclError = 200005;
pub const ACL_ERROR_FAILURE: aclError = 500001;

// ---- runtime status codes (error_codes/rt_error_codes.h) ----------------------------------
pub const ACL_ERROR_RT_PARAM_INVALID: aclError = 107000;
pub const ACL_ERROR_RT_INVALID_DEVICEID: aclError = 107001;
pub const ACL_ERROR_RT_CONTEXT_NULL: aclError = 107002;
pub const ACL_ERROR_RT_STREAM_CONTEXT: aclError = 107003;
pub const ACL_ERROR_RT_ADDR_UNALIGNED: aclError = 107008;
pub const ACL_ERROR_RT_INVALID_MEMORY_TYPE: aclError = 107016;
pub const ACL_ERROR_RT_INVALID_HANDLE: aclError = 107017;
/// The stream is not capturing (`aclmdlRICaptureEnd` without a begin on it).
pub const ACL_ERROR_RT_STREAM_NOT_CAPTURED: aclError = 107029;
/// The stream is capturing and the capture mode does not permit the operation.
pub const ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT: aclError = 107030;
pub const ACL_ERROR_RT_FEATURE_NOT_SUPPORT: aclError = 207000;
pub const ACL_ERROR_RT_MEMORY_ALLOCATION: aclError = 207001;
pub const ACL_ERROR_RT_AICORE_EXCEPTION: aclError = 507015;

// ---- aclnn status codes (aclnn/opdev/op_errno.h, "aclnn返回码") ----------------------------
pub const ACLNN_SUCCESS: aclnnStatus = 0;
pub const ACLNN_ERR_PARAM_NULLPTR: aclnnStatus = 161001;
pub const ACLNN_ERR_PARAM_INVALID: aclnnStatus = 161002;
pub const ACLNN_ERR_RUNTIME_ERROR: aclnnStatus = 361001;
pub const ACLNN_ERR_INNER: aclnnStatus = 561000;
/// A shape or attribute the operator's tiling refuses ("ACLNN_ERR_INNER_TILING_ERROR").
pub const ACLNN_ERR_INNER_TILING_ERROR: aclnnStatus = 561002;

// ---- aclnnMatmul cubeMathType (aclnnMatmul docs) ------------------------------------------
pub const KEEP_DTYPE: i8 = 0;
pub const ALLOW_FP32_DOWN_PRECISION: i8 = 1;
pub const USE_FP16: i8 = 2;
pub const USE_HF32: i8 = 3;

/// The documented name of an ACL/aclnn status code, for error messages.
pub fn status_name(code: i32) -> &'static str {
    match code {
        0 => "ACL_SUCCESS",
        100000 => "ACL_ERROR_INVALID_PARAM",
        100001 => "ACL_ERROR_UNINITIALIZE",
        100002 => "ACL_ERROR_REPEAT_INITIALIZE",
        100037 => "ACL_ERROR_REPEAT_FINALIZE",
        148051 => "ACL_ERROR_RELATIVE_RESOURCE_NOT_CLEARED",
        200000 => "ACL_ERROR_BAD_ALLOC",
        200001 => "ACL_ERROR_API_NOT_SUPPORT",
        200002 => "ACL_ERROR_INVALID_DEVICE",
        200003 => "ACL_ERROR_MEMORY_ADDRESS_UNALIGNED",
        200005 => "ACL_ERROR_INVALID_RESOURCE_HANDLE",
        500001 => "ACL_ERROR_FAILURE",
        107000 => "ACL_ERROR_RT_PARAM_INVALID",
        107001 => "ACL_ERROR_RT_INVALID_DEVICEID",
        107002 => "ACL_ERROR_RT_CONTEXT_NULL",
        107003 => "ACL_ERROR_RT_STREAM_CONTEXT",
        107008 => "ACL_ERROR_RT_ADDR_UNALIGNED",
        107016 => "ACL_ERROR_RT_INVALID_MEMORY_TYPE",
        107017 => "ACL_ERROR_RT_INVALID_HANDLE",
        107029 => "ACL_ERROR_RT_STREAM_NOT_CAPTURED",
        107030 => "ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT",
        207000 => "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
        207001 => "ACL_ERROR_RT_MEMORY_ALLOCATION",
        507015 => "ACL_ERROR_RT_AICORE_EXCEPTION",
        161001 => "ACLNN_ERR_PARAM_NULLPTR",
        161002 => "ACLNN_ERR_PARAM_INVALID",
        361001 => "ACLNN_ERR_RUNTIME_ERROR",
        561000 => "ACLNN_ERR_INNER",
        561002 => "ACLNN_ERR_INNER_TILING_ERROR",
        _ => "unknown status",
    }
}

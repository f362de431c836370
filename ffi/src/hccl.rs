//! HCCL, CANN's collective communication library (`libhccl.so`, `hccl/hccl.h` and
//! `hccl/hccl_types.h`): the root-info handshake, communicator creation and destruction, and
//! the two collectives tensor parallelism needs (all-reduce, all-gather), written by hand from
//! the documented prototypes (HCCL API reference: "HcclGetRootInfo", "HcclCommInitRootInfo",
//! "HcclAllReduce", "HcclAllGather", "HcclCommDestroy", "HcclGetErrorString").
//!
//! The library is separate from the runtime and optional for the rest of the backend: an install
//! without it (or a process that never forms a group) loads nothing here. [`HcclLibrary::load`]
//! finds it in the same directories as the runtime's libraries.

#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]

use core::ffi::{c_char, c_void};
use std::path::PathBuf;

use libloading::Library;

use crate::loader::{LoadError, SearchPaths};
pub use crate::types::aclrtStream;

/// `typedef enum { HCCL_SUCCESS = 0, ... } HcclResult;`
pub type HcclResult = i32;
pub const HCCL_SUCCESS: HcclResult = 0;
pub const HCCL_E_PARA: HcclResult = 1;
pub const HCCL_E_PTR: HcclResult = 2;
pub const HCCL_E_MEMORY: HcclResult = 3;
pub const HCCL_E_INTERNAL: HcclResult = 4;
pub const HCCL_E_NOT_SUPPORT: HcclResult = 5;
pub const HCCL_E_NOT_FOUND: HcclResult = 6;
pub const HCCL_E_UNAVAIL: HcclResult = 7;
pub const HCCL_E_SYSCALL: HcclResult = 8;
pub const HCCL_E_TIMEOUT: HcclResult = 9;
pub const HCCL_E_OPEN_FILE_FAILURE: HcclResult = 10;
pub const HCCL_E_RUNTIME: HcclResult = 15;
pub const HCCL_E_REMOTE: HcclResult = 21;

/// The documented name of an `HcclResult` (for messages).
pub fn result_name(code: HcclResult) -> &'static str {
    match code {
        0 => "HCCL_SUCCESS",
        1 => "HCCL_E_PARA",
        2 => "HCCL_E_PTR",
        3 => "HCCL_E_MEMORY",
        4 => "HCCL_E_INTERNAL",
        5 => "HCCL_E_NOT_SUPPORT",
        6 => "HCCL_E_NOT_FOUND",
        7 => "HCCL_E_UNAVAIL",
        8 => "HCCL_E_SYSCALL",
        9 => "HCCL_E_TIMEOUT",
        10 => "HCCL_E_OPEN_FILE_FAILURE",
        11 => "HCCL_E_TCP_CONNECT",
        12 => "HCCL_E_ROCE_CONNECT",
        13 => "HCCL_E_TCP_TRANSFER",
        14 => "HCCL_E_ROCE_TRANSFER",
        15 => "HCCL_E_RUNTIME",
        16 => "HCCL_E_DRV",
        17 => "HCCL_E_PROFILING",
        18 => "HCCL_E_CCE",
        19 => "HCCL_E_NETWORK",
        20 => "HCCL_E_AGAIN",
        21 => "HCCL_E_REMOTE",
        22 => "HCCL_E_SUSPENDING",
        _ => "an unknown HcclResult",
    }
}

/// `typedef enum { HCCL_DATA_TYPE_INT8 = 0, ... } HcclDataType;`
pub type HcclDataType = i32;
pub const HCCL_DATA_TYPE_INT8: HcclDataType = 0;
pub const HCCL_DATA_TYPE_INT16: HcclDataType = 1;
pub const HCCL_DATA_TYPE_INT32: HcclDataType = 2;
pub const HCCL_DATA_TYPE_FP16: HcclDataType = 3;
pub const HCCL_DATA_TYPE_FP32: HcclDataType = 4;
pub const HCCL_DATA_TYPE_INT64: HcclDataType = 5;
pub const HCCL_DATA_TYPE_UINT64: HcclDataType = 6;
pub const HCCL_DATA_TYPE_UINT8: HcclDataType = 7;
pub const HCCL_DATA_TYPE_UINT16: HcclDataType = 8;
pub const HCCL_DATA_TYPE_UINT32: HcclDataType = 9;
pub const HCCL_DATA_TYPE_FP64: HcclDataType = 10;
pub const HCCL_DATA_TYPE_BFP16: HcclDataType = 11;

/// `typedef enum { HCCL_REDUCE_SUM = 0, ... } HcclReduceOp;`
pub type HcclReduceOp = i32;
pub const HCCL_REDUCE_SUM: HcclReduceOp = 0;
pub const HCCL_REDUCE_PROD: HcclReduceOp = 1;
pub const HCCL_REDUCE_MAX: HcclReduceOp = 2;
pub const HCCL_REDUCE_MIN: HcclReduceOp = 3;

/// `const uint32_t HCCL_ROOT_INFO_BYTES = 4108;`
pub const HCCL_ROOT_INFO_BYTES: usize = 4108;

/// `typedef struct HcclRootInfoDef { char internal[HCCL_ROOT_INFO_BYTES]; } HcclRootInfo;`
/// Opaque bytes made by `HcclGetRootInfo` on the root rank and handed to every other rank.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HcclRootInfo {
    pub internal: [c_char; HCCL_ROOT_INFO_BYTES],
}

const _: () = assert!(std::mem::size_of::<HcclRootInfo>() == HCCL_ROOT_INFO_BYTES);

impl HcclRootInfo {
    pub fn zeroed() -> Self {
        Self {
            internal: [0; HCCL_ROOT_INFO_BYTES],
        }
    }

    pub fn as_bytes(&self) -> [u8; HCCL_ROOT_INFO_BYTES] {
        self.internal.map(|c| c as u8)
    }

    pub fn from_bytes(bytes: &[u8; HCCL_ROOT_INFO_BYTES]) -> Self {
        Self {
            internal: bytes.map(|b| b as c_char),
        }
    }
}

/// `typedef void *HcclComm;`
pub type HcclComm = *mut c_void;

crate::api_table! {
    /// The HCCL entry points, resolved from `libhccl.so`.
    pub struct HcclApi ("libhccl.so") {
        required {
            fn HcclGetRootInfo(rootInfo: *mut HcclRootInfo) -> HcclResult;
            fn HcclCommInitRootInfo(nRanks: u32, rootInfo: *const HcclRootInfo, rank: u32, comm: *mut HcclComm) -> HcclResult;
            fn HcclAllReduce(sendBuf: *mut c_void, recvBuf: *mut c_void, count: u64, dataType: HcclDataType, op: HcclReduceOp, comm: HcclComm, stream: aclrtStream) -> HcclResult;
            fn HcclAllGather(sendBuf: *mut c_void, recvBuf: *mut c_void, sendCount: u64, dataType: HcclDataType, comm: HcclComm, stream: aclrtStream) -> HcclResult;
            fn HcclCommDestroy(comm: HcclComm) -> HcclResult;
        }
        optional {
            // In the headers of newer releases only.
            fn HcclGetErrorString(code: HcclResult) -> *const c_char;
            // The communicator's name (the `group` of the fused matmul + all-reduce operators),
            // at most HCCL_COMM_NAME_MAX_LENGTH bytes with its NUL.
            fn HcclGetCommName(comm: HcclComm, commName: *mut c_char) -> HcclResult;
        }
    }
}

/// The buffer `HcclGetCommName` fills (`HCCL_COMM_NAME_MAX_LENGTH` of `hccl_types.h`).
pub const HCCL_COMM_NAME_MAX_LENGTH: usize = 128;

/// The file name HCCL is loaded by.
pub const HCCL_LIBRARY: &str = "libhccl.so";

/// `libhccl.so`, loaded and resolved; kept loaded for the life of the process.
pub struct HcclLibrary {
    pub api: HcclApi,
    pub path: PathBuf,
    _library: Library,
}

impl std::fmt::Debug for HcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HcclLibrary")
            .field("path", &self.path)
            .finish()
    }
}

impl HcclLibrary {
    /// Finds `libhccl.so` among the directories of `paths` (those of the runtime's libraries)
    /// and resolves every declared symbol.
    pub fn load(paths: &SearchPaths) -> Result<Self, LoadError> {
        let path = paths
            .find(HCCL_LIBRARY)
            .ok_or_else(|| LoadError::MissingLibrary {
                library: HCCL_LIBRARY,
                searched: paths
                    .library_dirs()
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect(),
            })?;
        // SAFETY: loading HCCL runs its initialisers; it is the vendor's library (or the
        // emulation's) from the install the user's environment names, loaded once per process.
        let library = unsafe { Library::new(&path) }.map_err(|e| LoadError::Unloadable {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        // SAFETY: the table's declarations are HCCL's documented prototypes.
        let api = unsafe { HcclApi::load(&[(path.display().to_string(), &library)])? };
        Ok(Self {
            api,
            path,
            _library: library,
        })
    }

    /// HCCL's own text for `code` where the release has `HcclGetErrorString`, else its name.
    pub fn error_string(&self, code: HcclResult) -> String {
        if let Some(f) = self.api.HcclGetErrorString {
            // SAFETY: takes a result code, returns null or a static NUL-terminated string.
            let p = unsafe { f(code) };
            if !p.is_null() {
                // SAFETY: non-null and NUL-terminated, owned by the library.
                return unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned();
            }
        }
        result_name(code).to_string()
    }
}

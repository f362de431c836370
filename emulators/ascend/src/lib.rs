//! ascend-emulator: a strict CPU **emulation** of the subset of CANN's ACL runtime and aclnn
//! operator API that npu-serving's Ascend backend calls — for CI and development on machines
//! without an NPU. It is not a product and is never shipped: `scripts/ascend-emulator.sh` builds
//! it into a directory laid out like a CANN install (`lib64/libascendcl.so`, with
//! `libnnopbase.so`, `libopapi.so` and `libopapi_transformer.so` linked to the same file so that
//! every name shares one state, `version.cfg`, `runtime/version.info`, `set_env.sh`), and the
//! backend runs unchanged with `ASCEND_HOME_PATH` pointing at it.
//!
//! Strict means it refuses what the CANN documentation forbids, with the documented status codes:
//! unsupported dtype/format/shape combinations (ACLNN_ERR_PARAM_INVALID), device copies not
//! 64-byte aligned (ACL_ERROR_RT_ADDR_UNALIGNED), page-attention block sizes outside the
//! documented multiples, a workspace smaller than asked, a destroyed tensor or executor used again,
//! a host pointer where device memory is expected (device memory is a separate address space),
//! results read before the stream is synchronized; at `aclFinalize` and process exit it reports
//! every object never destroyed; operators need `ASCEND_OPP_PATH` (as `set_env.sh` exports it). See
//! `state`, `rt`, `install`, `objects` and `ops` for each rule.
//!
//! ACL graph capture (`aclmdlRICaptureBegin/End`, `aclmdlRIExecuteAsync`, `aclmdlRIDestroy`) is
//! emulated too: a capturing stream records its work instead of running it, the calls the
//! capture mode forbids fail, and a replay runs the record against the captured addresses
//! (`capture`).
//!
//! HCCL (`libhccl.so`, linked to the same file) is emulated too: communicators from a root info,
//! all-reduce and all-gather on device memory, strict about every rank calling the same
//! collectives in the same order, across threads or processes (`hccl`, `hccl_comm`). A
//! collective runs in stream order — it reads its send buffer when its stream reaches it, not at
//! the call — and the all-reduce rounds as a ring all-reduce does, each hop in the payload's
//! dtype.
//!
//! Environment: `ASCEND_EMULATOR_HBM_MB` (device memory per device, default 32768),
//! `ASCEND_EMULATOR_DEVICES` (device count, default 8; `ASCEND_RT_VISIBLE_DEVICES` overrides),
//! `ASCEND_EMULATOR_CANN_VERSION` (reported version, default 8.3.RC1), `ASCEND_EMULATOR_VERBOSE`
//! (print every refusal to stderr).

#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

pub mod capture;
pub mod hccl;
pub mod hccl_comm;
pub mod install;
pub mod objects;
pub mod ops;
pub mod rt;
pub mod state;
pub mod view;

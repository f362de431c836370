//! aclnn's two-phase calls. `aclnnXxxGetWorkspaceSize` validates its arguments against the
//! operator's documented constraints (dtypes, formats, shapes, attributes; ACLNN_ERR_PARAM_NULLPTR
//! / ACLNN_ERR_PARAM_INVALID otherwise), snapshots the tensors into an executor, and returns the
//! workspace the kernel needs; `aclnnXxx(workspace, size, executor, stream)` checks the workspace
//! (at least the size asked for, in device memory), the executor (live, not consumed unless
//! repeatable) and the stream, then queues the kernel, which runs on the CPU at synchronization.
//! Every tensor's storage must lie in device memory: a host pointer is refused.
//!
//! Features the emulation does not implement are refused with ACLNN_ERR_PARAM_INVALID and a
//! message saying so — never silently computed wrong.

mod attention;
mod elementwise;
mod kv_cache;
mod matmul;

use core::ffi::c_void;

use npu_ffi::types::*;

use crate::objects::{ExecState, Executor};
use crate::state::*;
use crate::view::{read_elem, write_elem, DType, View};

/// The tensors an executor reads (`ins`) and writes (`outs`), in the operator's parameter order
/// (the indices of aclSetInputTensorAddr / aclSetOutputTensorAddr).
#[derive(Clone, Default)]
pub struct Io {
    pub ins: Vec<View>,
    pub outs: Vec<View>,
}

pub trait Kernel: Send {
    fn name(&self) -> &'static str;
    fn io(&self) -> &Io;
    fn io_mut(&mut self) -> &mut Io;
    /// Workspace bytes the kernel asks for.
    fn workspace(&self) -> u64 {
        0
    }
    fn run(&self, st: &mut State) -> Result<(), Fail>;
    fn clone_box(&self) -> Box<dyn Kernel>;
}

pub fn invalid<T>(op: &str, msg: impl std::fmt::Display) -> Result<T, Fail> {
    fail(ACLNN_ERR_PARAM_INVALID, format!("{op}: {msg}"))
}

/// Byte range of a view's storage.
fn range(v: &View) -> (u64, u64) {
    (v.addr, v.storage_bytes())
}

/// Reads every element of `v` (row-major over its view) as f64.
pub fn read(st: &State, v: &View) -> Result<Vec<f64>, Fail> {
    if v.numel() == 0 {
        return Ok(Vec::new());
    }
    let bytes = st.bytes(v.addr, v.storage_bytes())?;
    Ok(v.positions()
        .into_iter()
        .map(|p| read_elem(bytes, v.dtype, p as usize))
        .collect())
}

/// Writes `vals` (row-major over the view) into `v`.
pub fn write(st: &mut State, v: &View, vals: &[f64]) -> Result<(), Fail> {
    if v.numel() == 0 {
        return Ok(());
    }
    let pos = v.positions();
    let bytes = st.bytes_mut(v.addr, v.storage_bytes())?;
    for (p, x) in pos.into_iter().zip(vals) {
        write_elem(bytes, v.dtype, p as usize, *x);
    }
    Ok(())
}

/// The validated first phase shared by every operator.
///
/// # Safety
/// `workspace_size` and `executor` are null or valid out-pointers (the caller's arguments).
pub unsafe fn prepare(
    op: &'static str,
    workspace_size: *mut u64,
    executor: *mut *mut aclOpExecutor,
    build: impl FnOnce(&State) -> Result<Box<dyn Kernel>, Fail>,
) -> aclnnStatus {
    let mut st = state();
    let r = (|| {
        st.require_init()?;
        st.current_context()?;
        if workspace_size.is_null() || executor.is_null() {
            return fail(
                ACLNN_ERR_PARAM_NULLPTR,
                format!("{op}GetWorkspaceSize: null workspaceSize or executor out-pointer"),
            );
        }
        let kernel = build(&st).map_err(|f| Fail {
            code: f.code,
            msg: format!("{op}GetWorkspaceSize: {}", f.msg),
        })?;
        let ws = kernel.workspace();
        let h = st.new_handle(KIND_EXECUTOR);
        st.executors.insert(
            h,
            Executor {
                kernel,
                repeatable: false,
                state: ExecState::Fresh,
            },
        );
        // SAFETY: both out-pointers checked non-null; the caller passes valid ones.
        unsafe {
            *workspace_size = ws;
            *executor = h as *mut aclOpExecutor;
        }
        Ok(())
    })();
    finish(r)
}

/// The second phase shared by every operator.
pub fn launch(
    op: &'static str,
    workspace: *mut c_void,
    workspace_size: u64,
    executor: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus {
    let mut st = state();
    let r = (|| {
        st.require_init()?;
        let h = executor as u64;
        let e = match st.executors.get(&h) {
            None => return invalid(op, format!("executor {h:#x} is not an aclOpExecutor")),
            Some(e) => e,
        };
        match (e.state, e.repeatable) {
            (ExecState::Destroyed, _) => return invalid(op, format!("executor {h:#x} was destroyed and is used again")),
            (ExecState::Consumed, false) => {
                return invalid(op, format!("executor {h:#x} already ran and is not repeatable (aclSetAclOpExecutorRepeatable)"))
            }
            _ => {}
        }
        if e.kernel.name() != op {
            return invalid(
                op,
                format!(
                    "executor {h:#x} was made by {}GetWorkspaceSize",
                    e.kernel.name()
                ),
            );
        }
        let need = e.kernel.workspace();
        if workspace_size < need {
            return invalid(op, format!("workspace of {workspace_size} bytes is smaller than the {need} bytes GetWorkspaceSize asked for"));
        }
        if need > 0 {
            st.device_range(workspace as u64, need, "workspace")
                .map_err(|f| Fail {
                    code: ACLNN_ERR_PARAM_INVALID,
                    msg: format!("{op}: {}", f.msg),
                })?;
        }
        let sid = st.resolve_stream(stream as u64).map_err(|f| Fail {
            code: ACLNN_ERR_RUNTIME_ERROR,
            msg: format!("{op}: {}", f.msg),
        })?;
        let e = st.executors.get_mut(&h).expect("checked");
        e.state = ExecState::Consumed;
        let kernel = e.kernel.clone_box();
        let reads = kernel.io().ins.iter().map(range).collect();
        let writes = kernel.io().outs.iter().map(range).collect();
        st.enqueue(
            sid,
            Task {
                name: op.to_string(),
                reads,
                writes,
                run: Box::new(move |st| kernel.run(st)),
            },
        );
        Ok(())
    })();
    finish(r)
}

/// Defines `aclnnXxx(workspace, workspaceSize, executor, stream)` for each operator.
macro_rules! launchers {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus {
            launch(stringify!($name), workspace, workspaceSize, executor, stream)
        }
        const _: npu_ffi::aclnn::ops::sig::$name = $name;
    )*};
}
launchers!(
    aclnnAdd,
    aclnnInplaceAdd,
    aclnnCast,
    aclnnRmsNorm,
    aclnnSwiGlu,
    aclnnEmbedding,
    aclnnArgMax,
    aclnnMatmul,
    aclnnWeightQuantBatchMatmulV2,
    aclnnFusedInferAttentionScoreV2,
    aclnnScatterNdUpdate,
    aclnnApplyRotaryPosEmb,
    aclnnRotaryPositionEmbedding,
    aclnnScatterPaKvCache,
);

/// Checks a dtype is one of `allowed`.
pub fn dtype_in(op: &str, what: &str, v: &View, allowed: &[DType]) -> Result<(), Fail> {
    if allowed.contains(&v.dtype) {
        Ok(())
    } else {
        invalid(
            op,
            format!(
                "{what} has data type {}; supported: {}",
                v.dtype.name(),
                allowed
                    .iter()
                    .map(|d| d.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    }
}

/// Checks the ND format (the only one the emulated operators take here).
pub fn nd(op: &str, what: &str, v: &View) -> Result<(), Fail> {
    if matches!(
        v.format,
        ACL_FORMAT_ND
            | ACL_FORMAT_NCHW
            | ACL_FORMAT_NHWC
            | ACL_FORMAT_NCDHW
            | ACL_FORMAT_NC
            | ACL_FORMAT_NCL
    ) {
        Ok(())
    } else {
        invalid(
            op,
            format!("{what} has format {} (this emulation takes ND)", v.format),
        )
    }
}

/// Generic kernel plumbing for structs holding `io: Io` and deriving Clone.
macro_rules! kernel_common {
    ($op:literal) => {
        fn name(&self) -> &'static str {
            $op
        }
        fn io(&self) -> &crate::ops::Io {
            &self.io
        }
        fn io_mut(&mut self) -> &mut crate::ops::Io {
            &mut self.io
        }
        fn clone_box(&self) -> Box<dyn crate::ops::Kernel> {
            Box::new(self.clone())
        }
    };
}
pub(crate) use kernel_common;

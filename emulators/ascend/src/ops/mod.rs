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

mod activation;
mod attention;
pub mod contiguity;
pub(crate) mod elementwise;
mod fused_norm;
mod grouped_matmul;
mod init_routing;
mod kv_cache;
mod matmul;
mod mc2;
mod mla;
mod moe;
mod reduce;

use core::ffi::c_void;

use npu_ffi::types::*;

use crate::objects::{ExecState, Executor};
use crate::state::*;
use crate::view::{f16_at, read_elem, write_elem, DType, View};

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
    /// The HCCL communicator of an operator fused with a collective (its launch takes its place
    /// in the communicator's order, as an `HcclAllReduce` would); None for the others.
    fn communicator(&self) -> Option<u64> {
        None
    }
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
    let mut out = Vec::with_capacity(v.numel());
    if v.numel() == 0 {
        return Ok(out);
    }
    let bytes = st.bytes(v.addr, v.storage_bytes())?;
    match v.dtype {
        DType::F16 => v.for_each_position(|p| out.push(f16_at(bytes, p) as f64)),
        dt => v.for_each_position(|p| out.push(read_elem(bytes, dt, p))),
    }
    Ok(out)
}

/// Reads every element of `v` (row-major over its view) as f32.
pub fn read_f32(st: &State, v: &View) -> Result<Vec<f32>, Fail> {
    let mut out = Vec::with_capacity(v.numel());
    if v.numel() == 0 {
        return Ok(out);
    }
    let bytes = st.bytes(v.addr, v.storage_bytes())?;
    match v.dtype {
        DType::F16 => v.for_each_position(|p| out.push(f16_at(bytes, p))),
        dt => v.for_each_position(|p| out.push(read_elem(bytes, dt, p) as f32)),
    }
    Ok(out)
}

/// Writes `vals` (row-major over the view) into `v`.
pub fn write(st: &mut State, v: &View, vals: &[f64]) -> Result<(), Fail> {
    if v.numel() == 0 {
        return Ok(());
    }
    let bytes = st.bytes_mut(v.addr, v.storage_bytes())?;
    let mut it = vals.iter();
    v.for_each_position(|p| {
        if let Some(x) = it.next() {
            write_elem(bytes, v.dtype, p, *x);
        }
    });
    Ok(())
}

/// Number of threads the emulation's heavy kernels split their work over
/// (`ASCEND_EMULATOR_THREADS`, default: the machine's, at most 8).
pub fn threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("ASCEND_EMULATOR_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .clamp(1, 8)
    })
}

/// Fills `out` (chunks of `chunk` values) with `f(first_chunk_index, chunks)`, split over
/// [`threads`] when there is enough `work`.
pub fn par_chunks<T: Send, F>(out: &mut [T], chunk: usize, work: usize, f: F)
where
    F: Fn(usize, &mut [T]) + Sync,
{
    let n = out.len() / chunk.max(1);
    let t = threads().min(n.max(1));
    if t <= 1 || work < 1 << 20 {
        f(0, out);
        return;
    }
    let per = n.div_ceil(t);
    std::thread::scope(|s| {
        for (i, part) in out.chunks_mut(per * chunk).enumerate() {
            let f = &f;
            s.spawn(move || f(i * per, part));
        }
    });
}

/// A conversion of device data cached under `key` (made by `make` on a miss).
pub fn derived(
    st: &mut State,
    key: DerivedKey,
    make: impl FnOnce(&State) -> Result<Vec<f32>, Fail>,
) -> Result<std::sync::Arc<Vec<f32>>, Fail> {
    if let Some(v) = st.derived.get(&key) {
        return Ok(v.clone());
    }
    let v = std::sync::Arc::new(make(st)?);
    // Older conversions of the same tensors are stale: their bytes changed since.
    let addrs: Vec<u64> = key.sources.iter().map(|s| s.0).collect();
    st.derived
        .retain(|k, _| !k.sources.iter().any(|s| addrs.contains(&s.0)));
    st.derived.insert(key, v.clone());
    Ok(v)
}

/// The key of a conversion read from `views` with `params`.
pub fn derived_key(st: &State, views: &[&View], params: &[i64]) -> DerivedKey {
    DerivedKey {
        sources: views
            .iter()
            .map(|v| (v.addr, st.version_of(v.addr), v.key()))
            .collect(),
        params: params.to_vec(),
    }
}

/// `a · b` over f32 slices of equal length, with independent partial sums.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
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
        crate::install::check_operator_package()?;
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
        // A collective's place among its communicator's collectives (the progress thread runs
        // this stream up to it when a peer waits), checked as HcclAllReduce checks its stream.
        let ticket = match st.executors[&h].kernel.communicator() {
            None => None,
            Some(comm) => {
                if st.captures.contains_key(&sid) {
                    return invalid(
                        op,
                        "the stream is capturing: the emulation does not capture collectives",
                    );
                }
                let dev = st.streams[&sid].device;
                match crate::hccl::device_of(comm) {
                    None => {
                        return invalid(
                            op,
                            format!("the communicator {comm:#x} of its group was destroyed"),
                        )
                    }
                    Some(d) if d != dev => {
                        return invalid(
                            op,
                            format!(
                                "the stream is on device {dev}, the group's rank on device {d}"
                            ),
                        )
                    }
                    Some(_) => {}
                }
                st.next_ticket += 1;
                let t = st.next_ticket;
                st.hccl_queued.entry(comm).or_default().push_back((sid, t));
                Some((comm, t))
            }
        };
        let e = st.executors.get_mut(&h).expect("checked");
        e.state = ExecState::Consumed;
        let kernel = e.kernel.clone_box();
        let reads = kernel.io().ins.iter().map(range).collect();
        let writes = kernel.io().outs.iter().map(range).collect();
        count_launch(op);
        st.submit(
            sid,
            op.to_string(),
            reads,
            writes,
            Box::new(move || {
                let k = kernel.clone_box();
                Box::new(move |st| {
                    if let Some((comm, t)) = ticket {
                        // Running now: no longer queued.
                        if let Some(q) = st.hccl_queued.get_mut(&comm) {
                            q.retain(|&(_, x)| x != t);
                        }
                    }
                    k.run(st)
                })
            }),
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
    aclnnInplaceCopy,
    aclnnNanToNum,
    aclnnLogSoftmax,
    aclnnGather,
    aclnnMul,
    aclnnDynamicQuant,
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
    aclnnGeluV2,
    aclnnInplaceMul,
    aclnnInplaceMuls,
    aclnnMoeGatingTopKSoftmaxV2,
    aclnnMoeFinalizeRoutingV2,
    aclnnMoeInitRoutingV2,
    aclnnGroupedMatmulV4,
    aclnnMoeGatingTopK,
    aclnnFusedInferAttentionScoreV3,
    aclnnAddRmsNorm,
    aclnnMatmulAllReduce,
    aclnnWeightQuantMatmulAllReduce,
);

/// Second-phase calls queued so far, by operator (emulation-only, for tests).
static LAUNCHES: std::sync::Mutex<Vec<(&'static str, u64)>> = std::sync::Mutex::new(Vec::new());

fn count_launch(op: &'static str) {
    let mut l = LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
    match l.iter_mut().find(|(n, _)| *n == op) {
        Some((_, c)) => *c += 1,
        None => l.push((op, 1)),
    }
}

/// Emulation-only extension (not part of CANN): how many times operator `name` (a NUL-terminated
/// `aclnnXxx`) was launched (second phase accepted and queued) in this process. Tests count a
/// layer's calls with it.
///
/// # Safety
/// `name` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ascendEmulatorLaunchCount(name: *const std::ffi::c_char) -> u64 {
    if name.is_null() {
        return 0;
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    let name = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy();
    let l = LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
    l.iter().find(|(n, _)| *n == name).map_or(0, |(_, c)| *c)
}

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

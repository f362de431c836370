//! aclnn's two-phase calls, once per operator: `…GetWorkspaceSize` (validates, returns the
//! workspace size and an executor), then the launch on the agent's stream with a workspace that
//! grows to the largest size asked (a smaller buffer being replaced is kept until the next
//! synchronization, since queued kernels may still use it). Calls are counted per step
//! ([`StepStats`]) and logged with shapes and dtypes under `NPU_SERVING_ACL_LOG`.
//!
//! Executor reuse: [`OpRunner::prepare_repeatable`] marks an executor repeatable
//! (`aclSetAclOpExecutorRepeatable`, where the CANN release has it) so a step can launch it again
//! with new tensor addresses (`aclSetInputTensorAddr` / `aclSetOutputTensorAddr`) instead of
//! paying the first phase every time; it is destroyed with `aclDestroyAclOpExecutor`.

use core::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use npu_ffi::aclnn::ops::sig;
use npu_ffi::types::*;

use crate::device::Device;
use crate::error::{AscendError, Result};
use crate::memory::DeviceBuffer;
use crate::runtime::Acl;
use crate::tensor::{IntArray, Scalar, Tensor, TensorList};

/// aclnn calls since the last [`OpRunner::take_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepStats {
    /// First-phase calls (`…GetWorkspaceSize`).
    pub prepares: u32,
    /// Second-phase calls (kernel launches).
    pub launches: u32,
    /// Launches of a reused (repeatable) executor, with no first phase.
    pub reused_launches: u32,
}

/// A repeatable executor and the tensors it was prepared with (which must outlive it).
pub struct RepeatableOp {
    acl: &'static Acl,
    name: &'static str,
    executor: *mut aclOpExecutor,
    workspace: u64,
    launch: sig::aclnnAdd,
    pub tensors: Vec<Tensor>,
}

// SAFETY: the executor handle and tensors are owned by this value and used by one thread at a
// time (the launcher that owns it).
unsafe impl Send for RepeatableOp {}

impl RepeatableOp {
    /// Points input `index` (the operator's tensor inputs in parameter order), described by
    /// `self.tensors[tensor]`, at `buf` (which must outlive the executor's launches).
    pub fn set_input_addr(
        &mut self,
        index: usize,
        tensor: usize,
        buf: &DeviceBuffer,
    ) -> Result<()> {
        let addr = buf.ptr();
        let f = self.acl.api.base.aclSetInputTensorAddr.ok_or_else(|| {
            AscendError::Invalid("aclSetInputTensorAddr is not in this CANN".into())
        })?;
        let t = self
            .tensors
            .get(tensor)
            .ok_or_else(|| AscendError::Invalid(format!("no tensor {tensor}")))?;
        // SAFETY: executor and tensor are live (owned by self).
        self.acl.check("aclSetInputTensorAddr", unsafe {
            f(self.executor, index, t.raw(), addr)
        })
    }

    /// Points output `index` at `buf` (which must outlive the executor's launches).
    pub fn set_output_addr(
        &mut self,
        index: usize,
        tensor: usize,
        buf: &DeviceBuffer,
    ) -> Result<()> {
        let addr = buf.ptr();
        let f = self.acl.api.base.aclSetOutputTensorAddr.ok_or_else(|| {
            AscendError::Invalid("aclSetOutputTensorAddr is not in this CANN".into())
        })?;
        let t = self
            .tensors
            .get(tensor)
            .ok_or_else(|| AscendError::Invalid(format!("no tensor {tensor}")))?;
        // SAFETY: executor and tensor are live (owned by self).
        self.acl.check("aclSetOutputTensorAddr", unsafe {
            f(self.executor, index, t.raw(), addr)
        })
    }
}

impl Drop for RepeatableOp {
    fn drop(&mut self) {
        if let Some(f) = self.acl.api.base.aclDestroyAclOpExecutor {
            // SAFETY: the executor is owned by self and destroyed once.
            unsafe { f(self.executor) };
        }
    }
}

pub struct OpRunner {
    acl: &'static Acl,
    stream: aclrtStream,
    /// The device's flag of work queued since its last synchronization, set before each launch.
    queued: Arc<AtomicBool>,
    workspace: Option<DeviceBuffer>,
    retired: Vec<DeviceBuffer>,
    stats: StepStats,
    /// (first phases, launches) since the runner was made, never reset.
    totals: (u64, u64),
}

// SAFETY: the stream handle is a plain identifier; the runner is used by one thread at a time.
unsafe impl Send for OpRunner {}

fn describe(ts: &[(&str, &Tensor)]) -> String {
    ts.iter()
        .map(|(n, t)| format!("{n}={}", t.view().describe()))
        .collect::<Vec<_>>()
        .join(" ")
}

impl OpRunner {
    pub fn new(device: &Device) -> Self {
        Self {
            acl: device.acl,
            stream: device.stream(),
            queued: device.queue_flag(),
            workspace: None,
            retired: Vec::new(),
            stats: StepStats::default(),
            totals: (0, 0),
        }
    }

    pub fn acl(&self) -> &'static Acl {
        self.acl
    }

    /// Counts since the last call, and resets them.
    pub fn take_stats(&mut self) -> StepStats {
        std::mem::take(&mut self.stats)
    }

    /// Counts without resetting them.
    pub fn stats(&self) -> StepStats {
        self.stats
    }

    /// (first phases, launches) since the runner was made.
    pub fn totals(&self) -> (u64, u64) {
        self.totals
    }

    /// Releases workspaces replaced since the last synchronization (call after one).
    pub fn synchronized(&mut self) {
        self.retired.clear();
    }

    /// Workspaces replaced since the last synchronization (freed by [`OpRunner::synchronized`]).
    pub fn retired_workspaces(&self) -> usize {
        self.retired.len()
    }

    /// Bytes of the current workspace.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.as_ref().map_or(0, |w| w.bytes())
    }

    fn workspace_ptr(&mut self, size: u64) -> Result<*mut c_void> {
        if size == 0 {
            return Ok(std::ptr::null_mut());
        }
        if self.workspace_bytes() < size as usize {
            let grown = DeviceBuffer::alloc(self.acl, (size as usize).next_power_of_two())?;
            if let Some(old) = self.workspace.replace(grown) {
                self.retired.push(old);
            }
        }
        Ok(self.workspace.as_ref().expect("just ensured").ptr())
    }

    fn first_phase(
        &mut self,
        name: &'static str,
        detail: String,
        prepare: impl FnOnce(*mut u64, *mut *mut aclOpExecutor) -> aclnnStatus,
    ) -> Result<(u64, *mut aclOpExecutor)> {
        let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
        self.acl.log(name, || detail);
        self.stats.prepares += 1;
        self.totals.0 += 1;
        self.acl.check(name, prepare(&mut ws, &mut exec))?;
        Ok((ws, exec))
    }

    fn second_phase(
        &mut self,
        name: &'static str,
        ws: u64,
        exec: *mut aclOpExecutor,
        launch: sig::aclnnAdd,
    ) -> Result<()> {
        let w = self.workspace_ptr(ws)?;
        self.stats.launches += 1;
        self.totals.1 += 1;
        self.queued.store(true, Ordering::SeqCst);
        // SAFETY: the executor came from this operator's first phase; the workspace holds `ws` bytes.
        self.acl
            .check(name, unsafe { launch(w, ws, exec, self.stream) })
    }

    /// One two-phase call: `prepare` is the operator's first phase (given the workspace-size
    /// and executor out-pointers), `launch` its second.
    pub fn call(
        &mut self,
        name: &'static str,
        detail: String,
        prepare: impl FnOnce(*mut u64, *mut *mut aclOpExecutor) -> aclnnStatus,
        launch: sig::aclnnAdd,
    ) -> Result<()> {
        let (ws, exec) = self.first_phase(name, detail, prepare)?;
        self.second_phase(name, ws, exec, launch)
    }

    /// The first phase of an operator with its executor made repeatable; `tensors` are kept
    /// alive with it.
    pub fn prepare_repeatable(
        &mut self,
        name: &'static str,
        tensors: Vec<Tensor>,
        prepare: impl FnOnce(&[Tensor], *mut u64, *mut *mut aclOpExecutor) -> aclnnStatus,
        launch: sig::aclnnAdd,
    ) -> Result<RepeatableOp> {
        let set = self
            .acl
            .api
            .base
            .aclSetAclOpExecutorRepeatable
            .ok_or_else(|| {
                AscendError::Invalid("this CANN has no aclSetAclOpExecutorRepeatable".into())
            })?;
        let detail = describe(
            &tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (["t0", "t1", "t2", "t3", "t4", "t5"][i.min(5)], t))
                .collect::<Vec<_>>(),
        );
        let (ws, exec) = self.first_phase(name, detail, |w, e| prepare(&tensors, w, e))?;
        // SAFETY: a fresh executor from the first phase.
        self.acl
            .check("aclSetAclOpExecutorRepeatable", unsafe { set(exec) })?;
        Ok(RepeatableOp {
            acl: self.acl,
            name,
            executor: exec,
            workspace: ws,
            launch,
            tensors,
        })
    }

    /// Launches a repeatable executor again (no first phase).
    pub fn launch_repeatable(&mut self, op: &RepeatableOp) -> Result<()> {
        self.acl.log(op.name, || "(reused executor)".into());
        self.stats.reused_launches += 1;
        self.second_phase(op.name, op.workspace, op.executor, op.launch)
    }

    // ---- operators ----------------------------------------------------------------------------

    /// `out = a + alpha·b` (broadcasting).
    pub fn add(&mut self, a: &Tensor, b: &Tensor, alpha: f32, out: &Tensor) -> Result<()> {
        let s = Scalar::f32(self.acl, alpha)?;
        let ops = self.acl.api.ops;
        // SAFETY (closure): live handles and out-pointers.
        self.call(
            "aclnnAdd",
            describe(&[("self", a), ("other", b), ("out", out)]),
            |w, e| unsafe {
                (ops.aclnnAddGetWorkspaceSize)(a.raw(), b.raw(), s.raw(), out.raw(), w, e)
            },
            ops.aclnnAdd,
        )
    }

    /// `a += b` (broadcasting `b`).
    pub fn inplace_add(&mut self, a: &Tensor, b: &Tensor) -> Result<()> {
        let s = Scalar::f32(self.acl, 1.0)?;
        let ops = self.acl.api.ops;
        // SAFETY (closure): live handles and out-pointers.
        self.call(
            "aclnnInplaceAdd",
            describe(&[("selfRef", a), ("other", b)]),
            |w, e| unsafe {
                (ops.aclnnInplaceAddGetWorkspaceSize)(a.raw(), b.raw(), s.raw(), w, e)
            },
            ops.aclnnInplaceAdd,
        )
    }

    pub fn cast(&mut self, x: &Tensor, out: &Tensor) -> Result<()> {
        let ops = self.acl.api.ops;
        let dt = out.view().dtype.acl();
        // SAFETY (closure): live handles and out-pointers.
        self.call(
            "aclnnCast",
            describe(&[("self", x), ("out", out)]),
            |w, e| unsafe { (ops.aclnnCastGetWorkspaceSize)(x.raw(), dt, out.raw(), w, e) },
            ops.aclnnCast,
        )
    }

    /// `y = x / rms(x) · gamma` over the trailing dims of `gamma`; `rstd` (f32) receives 1/rms.
    pub fn rms_norm(
        &mut self,
        x: &Tensor,
        gamma: &Tensor,
        eps: f64,
        y: &Tensor,
        rstd: &Tensor,
    ) -> Result<()> {
        let ops = self.acl.api.ops;
        // SAFETY (closure): live handles and out-pointers.
        self.call(
            "aclnnRmsNorm",
            describe(&[("x", x), ("gamma", gamma), ("yOut", y), ("rstdOut", rstd)]),
            |w, e| unsafe {
                (ops.aclnnRmsNormGetWorkspaceSize)(
                    x.raw(),
                    gamma.raw(),
                    eps,
                    y.raw(),
                    rstd.raw(),
                    w,
                    e,
                )
            },
            ops.aclnnRmsNorm,
        )
    }

    /// `out = silu(first half) · second half` along `dim`.
    pub fn swiglu(&mut self, x: &Tensor, dim: i64, out: &Tensor) -> Result<()> {
        let ops = self.acl.api.ops;
        // SAFETY (closure): live handles and out-pointers.
        self.call(
            "aclnnSwiGlu",
            describe(&[("x", x), ("out", out)]),
            |w, e| unsafe { (ops.aclnnSwiGluGetWorkspaceSize)(x.raw(), dim, out.raw(), w, e) },
            ops.aclnnSwiGlu,
        )
    }

    /// `out[i] = weight[indices[i]]` (rows).
    pub fn embedding(&mut self, weight: &Tensor, indices: &Tensor, out: &Tensor) -> Result<()> {
        let ops = self.acl.api.ops;
        // SAFETY (closure): live handles and out-pointers.
        self.call(
            "aclnnEmbedding",
            describe(&[("weight", weight), ("indices", indices), ("out", out)]),
            |w, e| unsafe {
                (ops.aclnnEmbeddingGetWorkspaceSize)(weight.raw(), indices.raw(), out.raw(), w, e)
            },
            ops.aclnnEmbedding,
        )
    }

    /// Index of the maximum along `dim` (INT64 `out`).
    pub fn argmax(&mut self, x: &Tensor, dim: i64, out: &Tensor) -> Result<()> {
        let ops = self.acl.api.ops;
        // SAFETY (closure): live handles and out-pointers.
        self.call(
            "aclnnArgMax",
            describe(&[("self", x), ("out", out)]),
            |w, e| unsafe {
                (ops.aclnnArgMaxGetWorkspaceSize)(x.raw(), dim, false, out.raw(), w, e)
            },
            ops.aclnnArgMax,
        )
    }

    /// `out = a @ b` (f16/bf16/f32, `b` may be a transposed view).
    pub fn matmul(&mut self, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
        let ops = self.acl.api.ops;
        // SAFETY (closure): live handles and out-pointers.
        self.call(
            "aclnnMatmul",
            describe(&[("self", a), ("mat2", b), ("out", out)]),
            |w, e| unsafe {
                (ops.aclnnMatmulGetWorkspaceSize)(a.raw(), b.raw(), out.raw(), KEEP_DTYPE, w, e)
            },
            ops.aclnnMatmul,
        )
    }

    /// `y = x @ ((weight + offset) · scale)` with INT8/INT4 weights (k, n) and per-group
    /// (`group` > 0) or per-channel (`group` = 0) antiquant parameters.
    pub fn weight_quant_matmul(
        &mut self,
        x: &Tensor,
        weight: &Tensor,
        scale: &Tensor,
        offset: Option<&Tensor>,
        group: i32,
        y: &Tensor,
    ) -> Result<()> {
        let ops = self.acl.api.ops;
        let off = offset.map_or(std::ptr::null(), |t| t.raw() as *const aclTensor);
        let mut d = describe(&[
            ("x", x),
            ("weight", weight),
            ("antiquantScale", scale),
            ("y", y),
        ]);
        d.push_str(&format!(" group={group}"));
        // SAFETY (closure): live handles (or null optionals) and out-pointers.
        self.call(
            "aclnnWeightQuantBatchMatmulV2",
            d,
            |w, e| unsafe {
                (ops.aclnnWeightQuantBatchMatmulV2GetWorkspaceSize)(
                    x.raw(),
                    weight.raw(),
                    scale.raw(),
                    off,
                    std::ptr::null(),
                    std::ptr::null(),
                    std::ptr::null(),
                    group,
                    y.raw(),
                    w,
                    e,
                )
            },
            ops.aclnnWeightQuantBatchMatmulV2,
        )
    }

    /// Rotary embedding of `x` (4-D) into `out`: mode 0 half rotation, 1 interleaved pairs
    /// (RotaryPositionEmbedding, newer CANN releases).
    pub fn rope(
        &mut self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mode: i64,
        out: &Tensor,
    ) -> Result<()> {
        let ops = self.acl.api.ops;
        let (Some(p), Some(l)) = (
            ops.aclnnRotaryPositionEmbeddingGetWorkspaceSize,
            ops.aclnnRotaryPositionEmbedding,
        ) else {
            return Err(AscendError::Invalid(
                "aclnnRotaryPositionEmbedding is not in this CANN release (use apply_rope)".into(),
            ));
        };
        // SAFETY (closure): live handles and out-pointers.
        self.call(
            "aclnnRotaryPositionEmbedding",
            describe(&[("x", x), ("cos", cos), ("sin", sin), ("out", out)]),
            |w, e| unsafe { p(x.raw(), cos.raw(), sin.raw(), mode, out.raw(), w, e) },
            l,
        )
    }

    /// Half-rotation rotary embedding of `q` and `k` (BSND) in place (ApplyRotaryPosEmb).
    pub fn apply_rope(&mut self, q: &Tensor, k: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<()> {
        let ops = self.acl.api.ops;
        // SAFETY (closure): live handles and out-pointers.
        self.call(
            "aclnnApplyRotaryPosEmb",
            describe(&[("queryRef", q), ("keyRef", k), ("cos", cos), ("sin", sin)]),
            |w, e| unsafe {
                (ops.aclnnApplyRotaryPosEmbGetWorkspaceSize)(
                    q.raw(),
                    k.raw(),
                    cos.raw(),
                    sin.raw(),
                    1,
                    w,
                    e,
                )
            },
            ops.aclnnApplyRotaryPosEmb,
        )
    }

    /// Writes the step's new K/V rows into one layer's paged caches by slot mapping:
    /// ScatterPaKvCache where the release has it (caches seen as (blocks, block_size, N, D)),
    /// else ScatterNdUpdate over caches seen as (blocks·block_size, N·D) rows. ScatterPaKvCache
    /// runs in scatter mode "None", which takes contiguous key/value rows: `row_stride` must be
    /// `kv_heads · head_dim` there (copy strided rows into a dense buffer first).
    pub fn write_kv(&mut self, w: &KvWrite) -> Result<()> {
        let acl = self.acl;
        let ops = acl.api.ops;
        let t = w.tokens as i64;
        let (n, d) = (w.kv_heads as i64, w.head_dim as i64);
        use crate::tensor::{DType, View};
        if let (Some(p), Some(l)) = (
            ops.aclnnScatterPaKvCacheGetWorkspaceSize,
            ops.aclnnScatterPaKvCache,
        ) {
            if w.tokens > 1 && w.row_stride != w.kv_heads * w.head_dim {
                return Err(AscendError::Invalid(format!(
                    "ScatterPaKvCache (scatter mode \"None\") takes contiguous key/value rows; \
                     these are {} apart for {} values",
                    w.row_stride,
                    w.kv_heads * w.head_dim
                )));
            }
            let k = Tensor::new(
                acl,
                w.key,
                View::strided(
                    w.dtype,
                    &[t, n, d],
                    &[w.row_stride as i64, d, 1],
                    w.key_offset as i64,
                ),
            )?;
            let v = Tensor::new(
                acl,
                w.value,
                View::strided(
                    w.dtype,
                    &[t, n, d],
                    &[w.row_stride as i64, d, 1],
                    w.value_offset as i64,
                ),
            )?;
            let cache_view =
                View::contiguous(w.dtype, &[w.num_blocks as i64, w.block_size as i64, n, d]);
            let kc = Tensor::new(acl, w.key_cache, cache_view.clone())?;
            let vc = Tensor::new(acl, w.value_cache, cache_view)?;
            let sm = Tensor::new(
                acl,
                w.slots,
                View::strided(DType::I32, &[t], &[1], w.slots_offset as i64),
            )?;
            let (mut norm, mut none) = (*b"Norm\0", *b"None\0");
            // Read only in "Nct" mode; passed explicitly as torch_npu does.
            let strides = IntArray::new(acl, &[1, 1])?;
            let offsets = IntArray::new(acl, &[0, 0])?;
            let detail = describe(&[("key", &k), ("keyCacheRef", &kc), ("slotMapping", &sm)]);
            // SAFETY (closure): live handles and arrays, NUL-terminated mode strings,
            // out-pointers.
            return self.call(
                "aclnnScatterPaKvCache",
                detail,
                |ws, e| unsafe {
                    p(
                        k.raw(),
                        kc.raw(),
                        sm.raw(),
                        v.raw(),
                        vc.raw(),
                        std::ptr::null(),
                        std::ptr::null(),
                        std::ptr::null(),
                        norm.as_mut_ptr() as *mut c_char,
                        none.as_mut_ptr() as *mut c_char,
                        strides.raw(),
                        offsets.raw(),
                        ws,
                        e,
                    )
                },
                l,
            );
        }
        self.write_kv_rows(w)
    }

    /// [`OpRunner::write_kv`] through ScatterNdUpdate, the path for releases without
    /// ScatterPaKvCache: each cache seen as (blocks·block_size, N·D) rows, slots as (T, 1) indices.
    pub fn write_kv_rows(&mut self, w: &KvWrite) -> Result<()> {
        for (src, off, cache) in [
            (w.key, w.key_offset, w.key_cache),
            (w.value, w.value_offset, w.value_cache),
        ] {
            self.scatter_rows(&RowScatter {
                dtype: w.dtype,
                tokens: w.tokens,
                width: w.kv_heads * w.head_dim,
                row_stride: w.row_stride,
                src,
                src_offset: off,
                cache,
                slots: w.slots,
                slots_offset: w.slots_offset,
                cache_rows: w.num_blocks * w.block_size,
            })?;
        }
        Ok(())
    }

    /// One ScatterNdUpdate: the step's `tokens` rows of `width` values (`row_stride` apart from
    /// `src_offset`) into `cache` seen as (`cache_rows`, `width`) rows, at the slots as (T, 1)
    /// indices. The latent pool's write (one cache a layer) and each cache of the K/V write.
    pub fn scatter_rows(&mut self, w: &RowScatter) -> Result<()> {
        use crate::tensor::{DType, View};
        let acl = self.acl;
        let ops = acl.api.ops;
        let t = w.tokens as i64;
        let idx = Tensor::new(
            acl,
            w.slots,
            View::strided(DType::I32, &[t, 1], &[1, 1], w.slots_offset as i64),
        )?;
        let width = w.width as i64;
        let upd = Tensor::new(
            acl,
            w.src,
            View::strided(
                w.dtype,
                &[t, width],
                &[w.row_stride as i64, 1],
                w.src_offset as i64,
            ),
        )?;
        let var = Tensor::new(
            acl,
            w.cache,
            View::contiguous(w.dtype, &[w.cache_rows as i64, width]),
        )?;
        // SAFETY (closure): live handles and out-pointers.
        self.call(
            "aclnnScatterNdUpdate",
            describe(&[("varRef", &var), ("indices", &idx), ("updates", &upd)]),
            |ws, e| unsafe {
                (ops.aclnnScatterNdUpdateGetWorkspaceSize)(var.raw(), idx.raw(), upd.raw(), ws, e)
            },
            ops.aclnnScatterNdUpdate,
        )
    }

    /// Paged attention (FusedInferAttentionScoreV2, BSH layout): `q` (B, S, N·D), caches
    /// (blocks, block_size, KV_N·D), INT32 `block_table` (B, max_blocks), per-sequence query and
    /// KV lengths. S > 1 uses the right-down causal mask (`mask`: the 2048×2048 lower-triangular
    /// INT8 matrix, sparseMode 3), or with `band` the band mode over the same mask (sparseMode 4,
    /// preTokens = band, nextTokens = 0: a sliding window). S = 1 takes `mask` as the per-entry
    /// (B, 1, 1, KV_S) mask of the incremental branch (1 = masked), or none.
    pub fn attention(&mut self, a: &Attention) -> Result<()> {
        let acl = self.acl;
        let ops = acl.api.ops;
        let kl = TensorList::new(
            acl,
            vec![Tensor::new(acl, a.key_cache, a.cache_view.clone())?],
        )?;
        let vl = TensorList::new(
            acl,
            vec![Tensor::new(acl, a.value_cache, a.cache_view.clone())?],
        )?;
        let kv_lens = IntArray::new(acl, a.kv_lens)?;
        let q_lens = IntArray::new(acl, a.q_lens)?;
        let s = a.query.view().dims[1];
        // S = 1 (the incremental branch): sparseMode and the token counts have no effect there;
        // a mask, if any, is the per-entry (B, 1, 1, KV_S) one. S > 1: the 2048×2048 mask with
        // rightDownCausal, or band for a sliding window (preTokens back from the diagonal).
        let (mask, sparse, pre_tokens) = match (s, a.mask, a.band) {
            (1, m, _) => (
                m.map_or(std::ptr::null(), |m| m.raw() as *const aclTensor),
                0,
                i32::MAX as i64,
            ),
            (_, Some(m), None) => (m.raw() as *const aclTensor, 3, i32::MAX as i64),
            (_, Some(m), Some(pre)) => (m.raw() as *const aclTensor, 4, pre),
            (_, None, _) => {
                return Err(AscendError::Invalid(
                    "prefill attention needs the causal mask".into(),
                ))
            }
        };
        let mut layout = *b"BSH\0";
        let mut detail = describe(&[
            ("query", a.query),
            ("blockTable", a.block_table),
            ("attentionOut", a.out),
        ]);
        detail.push_str(&format!(
            " kv={:?} q={:?} blockSize={} heads={}/{} sparseMode={sparse} preTokens={pre_tokens}{}",
            a.kv_lens,
            a.q_lens,
            a.block_size,
            a.heads,
            a.kv_heads,
            if mask.is_null() { "" } else { " masked" }
        ));
        let null = std::ptr::null::<aclTensor>();
        // SAFETY (closure): live handles (or null optionals), NUL-terminated layout, out-pointers.
        self.call(
            "aclnnFusedInferAttentionScoreV2",
            detail,
            |w, e| unsafe {
                (ops.aclnnFusedInferAttentionScoreV2GetWorkspaceSize)(
                    a.query.raw(),
                    kl.raw(),
                    vl.raw(),
                    null,
                    mask,
                    q_lens.raw(),
                    kv_lens.raw(),
                    null,
                    null,
                    null,
                    null,
                    null,
                    null,
                    null,
                    a.block_table.raw(),
                    null,
                    null,
                    null,
                    null,
                    null,
                    null,
                    null,
                    null,
                    std::ptr::null(),
                    a.heads,
                    a.scale,
                    pre_tokens,
                    0,
                    layout.as_mut_ptr() as *mut c_char,
                    a.kv_heads,
                    sparse,
                    0,
                    a.block_size,
                    0,
                    false,
                    0,
                    0,
                    a.out.raw(),
                    null,
                    w,
                    e,
                )
            },
            ops.aclnnFusedInferAttentionScoreV2,
        )
    }
}

/// One layer's K/V write: new rows in `key`/`value` starting at element `key_offset` /
/// `value_offset` with `row_stride` elements between tokens (e.g. the K and V parts of fused QKV
/// rows), the caches, and the INT32 slot of each token (from `slots_offset` in `slots`).
pub struct KvWrite<'a> {
    pub dtype: crate::tensor::DType,
    pub tokens: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub row_stride: usize,
    pub key: &'a DeviceBuffer,
    pub key_offset: usize,
    pub value: &'a DeviceBuffer,
    pub value_offset: usize,
    pub key_cache: &'a DeviceBuffer,
    pub value_cache: &'a DeviceBuffer,
    pub slots: &'a DeviceBuffer,
    /// Element offset of the first slot in `slots`.
    pub slots_offset: usize,
    pub num_blocks: usize,
    pub block_size: usize,
}

/// Rows scattered into one cache by slot ([`OpRunner::scatter_rows`]).
pub struct RowScatter<'a> {
    pub dtype: crate::tensor::DType,
    pub tokens: usize,
    pub width: usize,
    pub row_stride: usize,
    pub src: &'a DeviceBuffer,
    pub src_offset: usize,
    pub cache: &'a DeviceBuffer,
    pub slots: &'a DeviceBuffer,
    /// Element offset of the first slot in `slots`.
    pub slots_offset: usize,
    pub cache_rows: usize,
}

/// One layer's paged attention call.
pub struct Attention<'a> {
    pub query: &'a Tensor,
    pub out: &'a Tensor,
    pub key_cache: &'a DeviceBuffer,
    pub value_cache: &'a DeviceBuffer,
    pub cache_view: crate::tensor::View,
    pub block_table: &'a Tensor,
    /// S > 1: the 2048×2048 causal mask; S = 1: a per-entry key mask, or none.
    pub mask: Option<&'a Tensor>,
    /// S > 1: a sliding window of `band + 1` positions (band mode's preTokens).
    pub band: Option<i64>,
    pub q_lens: &'a [i64],
    pub kv_lens: &'a [i64],
    pub heads: i64,
    pub kv_heads: i64,
    pub block_size: i64,
    pub scale: f64,
}

//! Mixture-of-experts on the CUDA backend ([`Capability::Moe`]): routing on the device (one
//! `moe_route` launch: softmax and top-k per token), then each expert once over the rows routed
//! to it: the routed ids are read back (t x k integers), the host plans the groups (which rows
//! each expert serves, in token order), one `gather_rows` launch lays the rows out expert by
//! expert, each active expert's gate+up and down matmuls run over its contiguous group, one SwiGLU
//! launch covers every group, and one `moe_combine` launch adds the weighted outputs back in token
//! order. The read-back is the one host synchronisation a MoE layer costs; a grouped matmul over
//! all experts in one launch is not built yet (each active expert is its own launch).
//!
//! [`Capability::Moe`]: npu_backend::Capability::Moe

use npu_backend::moe::{check_expert_shapes, ExpertGroups};
use npu_backend::{Backend, BackendError, DType, HostSlice, HostSliceMut, Readback, View, ViewMut};

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;
use crate::gpu::{blocks, Args, LaunchDims};
use crate::kernels::{op_kernel, Op};
use crate::ops::{addr, addr_mut, float, grid_rows, int, need, same, EW_THREADS};
use crate::weights::CudaMatrix;

impl CudaBackend {
    pub(crate) fn op_moe_route(
        &mut self,
        logits: View<'_, CudaBuffer>,
        k: usize,
        normalize: bool,
        ids: ViewMut<'_, CudaBuffer>,
        weights: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "moe_route";
        self.own(logits.buf(), OP)?;
        self.own(ids.buf(), OP)?;
        self.own(weights.buf(), OP)?;
        let dt = float(OP, logits.dtype())?;
        need(ids.dtype() == DType::I32, OP, || {
            format!("ids are {}, not i32", ids.dtype().name())
        })?;
        need(weights.dtype() == DType::F32, OP, || {
            format!("weights are {}, not f32", weights.dtype().name())
        })?;
        let (ll, il, wl) = (logits.layout(), ids.layout(), weights.layout());
        let (t, ne) = (ll.rows(), ll.cols());
        need(k >= 1 && k <= ne, OP, || format!("{k} experts of {ne}"))?;
        need(
            (il.rows(), il.cols(), wl.rows(), wl.cols()) == (t, k, t, k),
            OP,
            || {
                format!(
                    "ids {}x{} and weights {}x{} for {t} rows of {k}",
                    il.rows(),
                    il.cols(),
                    wl.rows(),
                    wl.cols()
                )
            },
        )?;
        if t == 0 {
            return Ok(());
        }
        self.launch(
            op_kernel(Op::MoeRoute, dt),
            LaunchDims::linear([grid_rows(OP, t)?, 1, 1], 32),
            Args::new()
                .ptr(addr(&logits))
                .i32(int(OP, ll.stride())?)
                .i32(int(OP, ne)?)
                .i32(int(OP, k)?)
                .i32(i32::from(normalize))
                .ptr(addr_mut(&ids))
                .i32(int(OP, il.stride())?)
                .ptr(addr_mut(&weights))
                .i32(int(OP, wl.stride())?),
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_moe_ffn(
        &mut self,
        x: View<'_, CudaBuffer>,
        ids: View<'_, CudaBuffer>,
        weights: View<'_, CudaBuffer>,
        gate_up: &[CudaMatrix],
        down: &[CudaMatrix],
        ff: usize,
        mut out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "moe_ffn";
        self.own(x.buf(), OP)?;
        self.own(ids.buf(), OP)?;
        self.own(weights.buf(), OP)?;
        self.own(out.buf(), OP)?;
        let dt = float(OP, x.dtype())?;
        same(OP, dt, out.dtype())?;
        need(weights.dtype() == DType::F32, OP, || {
            format!("weights are {}, not f32", weights.dtype().name())
        })?;
        let (xl, il, wl, ol) = (x.layout(), ids.layout(), weights.layout(), out.layout());
        let (t, h, k) = (xl.rows(), xl.cols(), il.cols());
        need(
            (il.rows(), wl.rows(), wl.cols(), ol.rows(), ol.cols()) == (t, t, k, t, h),
            OP,
            || {
                format!(
                    "x {t}x{h}, ids {}x{k}, weights {}x{}, out {}x{}",
                    il.rows(),
                    wl.rows(),
                    wl.cols(),
                    ol.rows(),
                    ol.cols()
                )
            },
        )?;
        check_expert_shapes(
            OP,
            gate_up.iter().map(|m| (m.k, m.n)),
            down.iter().map(|m| (m.k, m.n)),
            h,
            ff,
        )?;
        if t == 0 {
            return Ok(());
        }
        // The plan: the routed ids, read back, grouped by expert in token order.
        let mut id_host = vec![0i32; t * k];
        self.read_back(&mut [Readback {
            src: ids,
            dst: HostSliceMut::I32(&mut id_host),
        }])?;
        let groups = ExpertGroups::plan(OP, &id_host, k, gate_up.len())?;
        let n = t * k;
        let mut plan = self.alloc(DType::I32, 2 * n)?;
        self.upload(
            HostSlice::I32(&groups.rows),
            ViewMut::rows(&mut plan, 1, n)?,
        )?;
        self.upload(
            HostSlice::I32(&groups.pos),
            ViewMut::rows(&mut plan, 2, n)?.row_range(1, 1)?,
        )?;
        let plan_ptr = plan.addr(0);
        // Rows expert by expert.
        let mut xs = self.alloc(dt, n * h)?;
        self.launch(
            op_kernel(Op::GatherRows, dt),
            LaunchDims::linear(
                [blocks(h, EW_THREADS), grid_rows(OP, n)?, 1],
                EW_THREADS as u32,
            ),
            Args::new()
                .ptr(addr(&x))
                .i32(int(OP, xl.stride())?)
                .ptr(plan_ptr)
                .i32(int(OP, h)?)
                .ptr(xs.addr(0))
                .i32(int(OP, h)?),
        )?;
        let mut gu = self.alloc(dt, n * 2 * ff)?;
        let mut act = self.alloc(dt, n * ff)?;
        let mut ys = self.alloc(dt, n * h)?;
        for (e, s, c) in groups.active() {
            self.op_matmul(
                View::rows(&xs, n, h)?.row_range(s, c)?,
                &gate_up[e],
                ViewMut::rows(&mut gu, n, 2 * ff)?.row_range(s, c)?,
            )?;
        }
        {
            let guv = View::rows(&gu, n, 2 * ff)?;
            self.op_swiglu(
                guv.col_range(0, ff)?,
                guv.col_range(ff, ff)?,
                ViewMut::rows(&mut act, n, ff)?,
            )?;
        }
        for (e, s, c) in groups.active() {
            self.op_matmul(
                View::rows(&act, n, ff)?.row_range(s, c)?,
                &down[e],
                ViewMut::rows(&mut ys, n, h)?.row_range(s, c)?,
            )?;
        }
        let _ = &mut xs;
        // The weighted sum back in token order.
        self.launch(
            op_kernel(Op::MoeCombine, dt),
            LaunchDims::linear(
                [blocks(h, EW_THREADS), grid_rows(OP, t)?, 1],
                EW_THREADS as u32,
            ),
            Args::new()
                .ptr(ys.addr(0))
                .i32(int(OP, h)?)
                .ptr(plan_ptr + 4 * n as u64)
                .ptr(addr(&weights))
                .i32(int(OP, wl.stride())?)
                .i32(int(OP, k)?)
                .ptr(addr_mut(&out))
                .i32(int(OP, ol.stride())?)
                .i32(int(OP, h)?),
        )?;
        let _ = &mut out;
        Ok(())
    }
}

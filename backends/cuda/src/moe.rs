//! Mixture-of-experts on the CUDA backend ([`Capability::Moe`]): routing on the device (one
//! `moe_route` launch: softmax and top-k per token), then each expert once over the rows routed
//! to it, with nothing read back: one `moe_plan` launch groups the routed ids on the device (the
//! grouping `npu_backend::moe::ExpertGroups` makes on the host: which rows each expert serves,
//! in token order, and the groups' offsets), one `gather_rows` launch lays the rows out expert by
//! expert, one grouped matmul launch per projection (`moe_mm_*`, kernels/moe_matmul.cu: gate+up
//! of every expert, then down of every expert, each block finding its expert's rows from the
//! offsets; a quantized format first quantizes all grouped rows to 8 bits in one `quantize_q8`
//! launch), one SwiGLU launch over every group, and one `moe_combine` launch adds the weighted
//! outputs back in token order.
//!
//! The grouped matmul takes every format the backend keeps experts in: packed F16, Q4_0, Q4_1
//! and Q8_0 (the GEMV kernels' arithmetic, 8 rows per pass over an expert's weights), and dense
//! rows in the activation dtype (`MatmulMode::Dequantized`, or F32 experts under f32
//! activations); all experts of one projection must share one form. It never uses cuBLAS or the
//! int8 tensor-core GEMM, so a large prefill group runs at GEMV speed (a grouped tensor-core
//! kernel is not built).
//!
//! [`Capability::Moe`]: npu_backend::Capability::Moe

use npu_backend::moe::check_expert_shapes;
use npu_backend::{Backend, BackendError, DType, View, ViewMut};

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;
use crate::gpu::{blocks, Args, DevPtr, LaunchDims};
use crate::kernels::{moe_mm_kernel, op_kernel, MoeWeights, Op, WeightFormat};
use crate::ops::{addr, addr_mut, float, grid_rows, int, need, same, EW_THREADS};
use crate::weights::{CudaMatrix, MatrixKind};

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
        let gu_w = self.moe_weights(OP, gate_up, dt)?;
        let down_w = self.moe_weights(OP, down, dt)?;
        let ne = gate_up.len();
        need(ne <= 65535, OP, || {
            format!("{ne} experts (a grid dimension: at most 65535)")
        })?;
        let n = t * k;
        int(OP, n)?;
        // The plan, on the device: grouped rows' tokens, slots' grouped rows, group offsets.
        let plan = self.alloc_mem(4 * (2 * n + ne + 1))?;
        let (rows_at, pos_at, offsets_at) = (
            plan.ptr(),
            plan.ptr() + 4 * n as u64,
            plan.ptr() + 8 * n as u64,
        );
        self.launch(
            op_kernel(Op::MoePlan, dt),
            LaunchDims::linear([1, 1, 1], PLAN_THREADS),
            Args::new()
                .ptr(addr(&ids))
                .i32(int(OP, il.stride())?)
                .i32(int(OP, t)?)
                .i32(int(OP, k)?)
                .i32(int(OP, ne)?)
                .ptr(offsets_at)
                .ptr(rows_at)
                .ptr(pos_at),
        )?;
        // The experts' weight addresses: 3 a matrix (weights, scales, minimums), gate+up's
        // experts then down's.
        let table: Vec<u8> = gate_up
            .iter()
            .chain(down)
            .flat_map(|m| {
                let p = m.mem.ptr();
                [p, p + m.scales_at as u64, p + m.mins_at as u64]
            })
            .flat_map(u64::to_le_bytes)
            .collect();
        let wt = self.alloc_mem(table.len())?;
        self.gpu.htod(wt.ptr(), &table)?;
        // Rows expert by expert.
        let xs = self.alloc(dt, n * h)?;
        self.launch(
            op_kernel(Op::GatherRows, dt),
            LaunchDims::linear(
                [blocks(h, EW_THREADS), grid_rows(OP, n)?, 1],
                EW_THREADS as u32,
            ),
            Args::new()
                .ptr(addr(&x))
                .i32(int(OP, xl.stride())?)
                .ptr(rows_at)
                .i32(int(OP, h)?)
                .ptr(xs.addr(0))
                .i32(int(OP, h)?),
        )?;
        let gu = self.alloc(dt, n * 2 * ff)?;
        let mut act = self.alloc(dt, n * ff)?;
        let ys = self.alloc(dt, n * h)?;
        let grouped = Grouped {
            offsets: offsets_at,
            rows: n,
            experts: ne,
        };
        self.moe_matmul(
            grouped,
            (gu_w, wt.ptr(), h, 2 * ff),
            (xs.addr(0), h),
            (gu.addr(0), 2 * ff),
            dt,
        )?;
        {
            let guv = View::rows(&gu, n, 2 * ff)?;
            self.op_swiglu(
                guv.col_range(0, ff)?,
                guv.col_range(ff, ff)?,
                ViewMut::rows(&mut act, n, ff)?,
            )?;
        }
        self.moe_matmul(
            grouped,
            (down_w, wt.ptr() + 24 * ne as u64, ff, h),
            (act.addr(0), ff),
            (ys.addr(0), h),
            dt,
        )?;
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
                .ptr(pos_at)
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

    /// The grouped kernel's weight form for `mats` (every expert of one projection) under `dt`
    /// activations: one packed format for all, or dense rows in `dt`; anything else is refused
    /// by name.
    fn moe_weights(
        &self,
        op: &'static str,
        mats: &[CudaMatrix],
        dt: DType,
    ) -> Result<MoeWeights, BackendError> {
        let kind = mats[0].kind;
        need(mats.iter().all(|m| m.kind == kind), op, || {
            "experts of one projection in different formats (one grouped launch takes one)".into()
        })?;
        need(
            mats.iter().all(|m| m.mem.device() == self.device),
            op,
            || "a matrix of another backend instance".into(),
        )?;
        match kind {
            MatrixKind::Packed(f) => Ok(MoeWeights::Packed(f)),
            MatrixKind::Q4K | MatrixKind::Q6K => Err(BackendError::Unsupported {
                backend: "cuda",
                what: format!(
                    "{op}: packed K-quant experts (the grouped matmul reads Q4_0, Q4_1, Q8_0, F16 \
                     or dense weights; `load_experts` widens K-quant experts to F16)"
                ),
            }),
            MatrixKind::Dense(wdt) if wdt == dt => Ok(MoeWeights::Dense),
            MatrixKind::Dense(wdt) => Err(BackendError::Unsupported {
                backend: "cuda",
                what: format!(
                    "{op}: dense {} experts with {} activations (the grouped matmul reads dense \
                     weights in the activation dtype)",
                    wdt.name(),
                    dt.name()
                ),
            }),
        }
    }

    /// One grouped launch: `out` rows (grouped as `g` says) = the rows of `x` times each group's
    /// expert, `w` the weights' form, `table` their addresses (3 per expert), `kin` inputs and
    /// `kout` outputs; a quantized format first quantizes every row to 8 bits (one launch).
    fn moe_matmul(
        &mut self,
        g: Grouped,
        (w, table, kin, kout): (MoeWeights, DevPtr, usize, usize),
        (x, ldx): (DevPtr, usize),
        (out, ldo): (DevPtr, usize),
        dt: DType,
    ) -> Result<(), BackendError> {
        const OP: &str = "moe_ffn";
        let dims = LaunchDims::linear(
            [blocks(kout, MM_WARPS), grid_rows(OP, g.experts)?, 1],
            (MM_WARPS * 32) as u32,
        );
        let head = Args::new()
            .ptr(table)
            .ptr(g.offsets)
            .i32(int(OP, kout)?)
            .i32(int(OP, kin)?);
        let kernel = moe_mm_kernel(w, dt);
        if matches!(w, MoeWeights::Dense | MoeWeights::Packed(WeightFormat::F16)) {
            return self.launch(
                kernel,
                dims,
                head.ptr(x).i32(int(OP, ldx)?).ptr(out).i32(int(OP, ldo)?),
            );
        }
        let nb = kin / 32;
        let xq_bytes = g.rows * kin;
        let q = self.alloc_mem(xq_bytes + g.rows * nb * 16)?;
        let (xq, xs) = (q.ptr(), q.ptr() + xq_bytes as u64);
        self.launch(
            op_kernel(Op::QuantizeQ8, dt),
            LaunchDims::linear([blocks(nb, 8), grid_rows(OP, g.rows)?, 1], 256),
            Args::new()
                .ptr(x)
                .i32(int(OP, ldx)?)
                .i32(int(OP, kin)?)
                .ptr(xq)
                .ptr(xs),
        )?;
        self.launch(
            kernel,
            dims,
            head.ptr(xq).ptr(xs).ptr(out).i32(int(OP, ldo)?),
        )
    }
}

/// Threads of the `moe_plan` block (one expert each, striding).
const PLAN_THREADS: u32 = 256;
/// Warps a block of a grouped matmul (one output each).
const MM_WARPS: usize = 4;

/// Where a step's grouped rows lie: `rows` in all, over `experts` groups whose offsets (i32,
/// `experts + 1`) are at `offsets` on the device.
#[derive(Clone, Copy)]
struct Grouped {
    offsets: DevPtr,
    rows: usize,
    experts: usize,
}

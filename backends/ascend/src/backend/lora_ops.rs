//! Low-rank adapters on Ascend ([`Capability::Lora`](npu_backend::Capability::Lora)): the
//! segmented LoRA product of one step, `out[r] += scale_g * B_g (A_g x[r])` for the rows of each
//! adapter group (the engine's runs of rows on one adapter), as documented aclnn calls on the
//! agent's stream with no host synchronisation. Per group and projection, three calls:
//!
//! 1. Matmul: the group's rows of `x`, seen as (n, in) over their row stride, times `A` (rank
//!    rows of the input width) seen transposed, (in, rank), into a contiguous (n, rank) scratch;
//! 2. Matmul: that scratch times `Bᵀ` (`b_t`: rank rows of the output width) into a contiguous
//!    (n, out) scratch;
//! 3. InplaceAdd: the group's rows of `out` += `scale` · that scratch (`alpha` = scale).
//!
//! Matmul takes `self` and `mat2` of one type, so `A` and `Bᵀ` are used in the activations' type
//! (f16, or bf16 for a wide model): a whole-buffer upload of f32 (or bf16) values also writes
//! that copy ([`AscendBackend::upload_half_copy`]: the agent uploads adapters once, at load),
//! and a weight without one (written by other means) is cast into a scratch first (one more
//! aclnnCast). Both matrix products accumulate in f32 on the cube unit and round to the
//! activations' type. Every group's shapes, dtypes and rows are checked before anything is
//! launched, as the CPU and CUDA backends check them.

use npu_backend::{BackendError, DType, DeviceBuffer as _, HostSlice, LoraGroup, View, ViewMut};

use super::layer_ops::{bad, want_act};
use super::objects::{self, AscendBuffer};
use super::{err, AscendBackend, Scratch};
use crate::memory::DeviceBuffer as Mem;
use crate::reuse::Arg;
use crate::tensor::View as TView;

const OP: &str = "lora_add";

/// Scratch names of the cast `A` and `Bᵀ` (for weights with no copy in the activations' type).
const A16: &str = "lora_a16";
const B16: &str = "lora_b16";

impl AscendBackend {
    /// After a whole-buffer upload of `src` into `buf` (f32 or bf16, other than the activations'
    /// type): the same values in the activations' type, kept as the buffer's `half` copy (what
    /// `lora_add` multiplies with; an upload that covers part of the buffer leaves none).
    pub(super) fn upload_half_copy(
        &self,
        buf: &mut AscendBuffer,
        src: HostSlice<'_>,
        whole: bool,
    ) -> Result<(), BackendError> {
        let dt = buf.dtype();
        if !whole || dt == self.act || !matches!(dt, DType::F32 | DType::BF16) {
            return Ok(());
        }
        if let HostSlice::F32(v) = src {
            let bytes = objects::half_bytes(self.act, v);
            buf.half = Some(objects::upload_new(&self.dev, &bytes, "a 16-bit copy")?);
        }
        Ok(())
    }

    pub(super) fn op_lora_add(
        &mut self,
        x: View<'_, AscendBuffer>,
        groups: &[LoraGroup<'_, AscendBuffer>],
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        want_act(OP, "x", x.dtype(), self.act)?;
        want_act(OP, "out", out.dtype(), self.act)?;
        let (xl, ol) = (x.layout(), out.layout());
        if xl.rows() != ol.rows() {
            return Err(bad(
                OP,
                format!("x of {} rows and out of {}", xl.rows(), ol.rows()),
            ));
        }
        let (n_in, n_out) = (xl.cols(), ol.cols());
        // Every group checked first; rows sorted to find overlaps.
        let mut spans = Vec::with_capacity(groups.len());
        let (mut cast_a, mut cast_b, mut max_n, mut max_rank) = (0usize, 0usize, 0usize, 0usize);
        for (gi, g) in groups.iter().enumerate() {
            if g.rank == 0 {
                return Err(bad(OP, format!("group {gi}: rank 0")));
            }
            let wdt = g.a.dtype();
            if wdt != g.b_t.dtype() || !matches!(wdt, DType::F32 | DType::BF16 | DType::F16) {
                return Err(bad(
                    OP,
                    format!(
                        "group {gi}: A is {} and B {}; both f32, bf16 or f16",
                        wdt.name(),
                        g.b_t.dtype().name()
                    ),
                ));
            }
            let (a_len, b_len) = (g.a.len(), g.b_t.len());
            if Some(a_len) != g.rank.checked_mul(n_in) || Some(b_len) != g.rank.checked_mul(n_out) {
                return Err(bad(
                    OP,
                    format!(
                        "group {gi}: A of {a_len} and B of {b_len} values for rank {} and a \
                         {n_in} -> {n_out} projection",
                        g.rank
                    ),
                ));
            }
            if !g.scale.is_finite() {
                return Err(bad(OP, format!("group {gi}: scale {}", g.scale)));
            }
            if g.row.checked_add(g.n).filter(|&e| e <= xl.rows()).is_none() {
                return Err(bad(
                    OP,
                    format!("group {gi}: rows {}+{} of {}", g.row, g.n, xl.rows()),
                ));
            }
            if wdt != self.act && wdt == DType::F16 {
                return Err(bad(
                    OP,
                    format!(
                        "group {gi}: f16 A and B for {} activations",
                        self.act.name()
                    ),
                ));
            }
            if g.n > 0 && n_in > 0 && n_out > 0 {
                spans.push((g.row, g.n, gi));
                max_n = max_n.max(g.n);
                max_rank = max_rank.max(g.rank);
                if needs_cast(g.a, self.act) {
                    cast_a = cast_a.max(a_len);
                }
                if needs_cast(g.b_t, self.act) {
                    cast_b = cast_b.max(b_len);
                }
            }
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                let gi = w[0].2.max(w[1].2);
                return Err(bad(OP, format!("group {gi} overlaps another group's rows")));
            }
        }
        if spans.is_empty() {
            return Ok(());
        }
        // Every scratch grown before any is borrowed (growing one replaces its memory).
        let dev = &self.dev;
        self.scratch.ensure(dev, "lora_s", max_n * max_rank * 2)?;
        self.scratch.ensure(dev, "lora_t", max_n * n_out * 2)?;
        if cast_a > 0 {
            self.scratch.ensure(dev, A16, cast_a * 2)?;
        }
        if cast_b > 0 {
            self.scratch.ensure(dev, B16, cast_b * 2)?;
        }
        self.pending = true;
        let act = self.act_t();
        let api = self.dev.acl.api.ops;
        for &(row, n, gi) in &spans {
            let g = &groups[gi];
            let (n, rank) = (n as i64, g.rank as i64);
            let (ni, no) = (n_in as i64, n_out as i64);
            let a = self.weight16(g.a, A16)?;
            let b = self.weight16(g.b_t, B16)?;
            let a = weight_mem(&self.scratch, g.a, self.act, a, A16);
            let b = weight_mem(&self.scratch, g.b_t, self.act, b, B16);
            let s = self.scratch.get("lora_s");
            let t = self.scratch.get("lora_t");
            let s_view = TView::contiguous(act, &[n, rank]);
            let t_view = TView::contiguous(act, &[n, no]);
            let x_rows = TView::strided(
                act,
                &[n, ni],
                &[xl.stride() as i64, 1],
                (xl.offset() + row * xl.stride()) as i64,
            );
            let out_rows = TView::strided(
                act,
                &[n, no],
                &[ol.stride() as i64, 1],
                (ol.offset() + row * ol.stride()) as i64,
            );
            // A (rank, in) seen transposed: (in, rank).
            let a_t = TView::strided(act, &[ni, rank], &[1, ni], 0);
            let b_view = TView::contiguous(act, &[rank, no]);
            for (xm, xv, wm, wv, ym, yv) in [
                (&x.buf().mem, x_rows, a, a_t, s, s_view.clone()),
                (s, s_view, b, b_view, t, t_view.clone()),
            ] {
                let prep = api.aclnnMatmulGetWorkspaceSize;
                self.ops
                    .call(
                        "aclnnMatmul",
                        api.aclnnMatmul,
                        &[
                            Arg::input("self", 0, xm, xv),
                            Arg::input("mat2", 1, wm, wv),
                            Arg::output("out", 0, ym, yv),
                        ],
                        &[],
                        &[],
                        // SAFETY (closure): live tensors and out-pointers from the launcher.
                        Box::new(move |ts, _, w, e| unsafe {
                            prep(
                                ts[0].raw(),
                                ts[1].raw(),
                                ts[2].raw(),
                                npu_ffi::types::KEEP_DTYPE,
                                w,
                                e,
                            )
                        }),
                    )
                    .map_err(err)?;
            }
            let prep = api.aclnnInplaceAddGetWorkspaceSize;
            self.ops
                .call(
                    "aclnnInplaceAdd",
                    api.aclnnInplaceAdd,
                    &[
                        Arg::fixed("selfRef", &out.buf().mem, out_rows),
                        Arg::fixed("other", t, t_view),
                    ],
                    &[],
                    &[g.scale],
                    // SAFETY (closure): live tensors, scalar and out-pointers from the launcher.
                    Box::new(move |ts, sc, w, e| unsafe {
                        prep(ts[0].raw(), ts[1].raw(), sc[0].raw(), w, e)
                    }),
                )
                .map_err(err)?;
        }
        Ok(())
    }

    /// Makes `w` available in the activations' type: `false` where it is already (its own
    /// memory or its `half` copy), else cast into scratch `name` (one aclnnCast) and `true`.
    fn weight16(&mut self, w: &AscendBuffer, name: &'static str) -> Result<bool, BackendError> {
        if !needs_cast(w, self.act) {
            return Ok(false);
        }
        let n = w.len() as i64;
        let act = self.act_t();
        let from = objects::acl_dtype(w.dtype());
        let s = self.scratch.get(name);
        let api = self.dev.acl.api.ops;
        let pc = api.aclnnCastGetWorkspaceSize;
        self.ops
            .call(
                "aclnnCast",
                api.aclnnCast,
                &[
                    Arg::input("self", 0, &w.mem, TView::contiguous(from, &[n])),
                    Arg::output("out", 0, s, TView::contiguous(act, &[n])),
                ],
                &[act.acl() as i64],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    pc(ts[0].raw(), act.acl(), ts[1].raw(), w, e)
                }),
            )
            .map_err(err)?;
        Ok(true)
    }
}

/// The memory holding `w` in the activations' type `act` (after [`AscendBackend::weight16`]
/// said whether it `cast` it into scratch `name`).
fn weight_mem<'a>(
    scratch: &'a Scratch,
    w: &'a AscendBuffer,
    act: DType,
    cast: bool,
    name: &'static str,
) -> &'a Mem {
    match &w.half {
        _ if cast => scratch.get(name),
        Some(h) if w.dtype() != act => h,
        _ => &w.mem,
    }
}

/// Whether `w` has neither the activations' type nor a `half` copy in it.
fn needs_cast(w: &AscendBuffer, act: DType) -> bool {
    w.dtype() != act && w.half.is_none()
}

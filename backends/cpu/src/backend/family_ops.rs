//! The CPU's ops beyond the Llama step, for the families that need them: per-head Q/K RMS norm
//! (Qwen3, Gemma 3), the GELU-gated FFN and row scaling (Gemma), and the mixture-of-experts
//! routing and expert FFN (Qwen3-MoE: each expert runs once over the tokens routed to it). The
//! trait methods of `CpuBackend` call these; the shapes are checked here before any kernel runs.

use npu_backend::{Backend, BackendError, Capability, DType, View, ViewMut};

use super::buffer::{bad, i32_rows, i32_rows_mut, rows, rows_mut, shape};
use super::{CpuBackend, CpuBuffer};
use crate::kernels::elementwise;
use crate::quant::WeightMatrix;

/// What the CPU backend has of [`Capability`]: all of it.
pub(super) fn supports(c: Capability) -> bool {
    match c {
        Capability::HeadNorm
        | Capability::GeluGate
        | Capability::ScaleRows
        | Capability::SlidingWindow
        | Capability::RopeFactors
        | Capability::PerLayerRope
        | Capability::Moe
        | Capability::ScoredRouting
        | Capability::LatentAttention
        | Capability::Lora
        | Capability::HeldExperts => true,
    }
}

/// Softmax of one row of router logits, then its `k` most probable experts (descending; ties to
/// the lower index) and their probabilities, renormalised when asked, as ggml computes them
/// (f64 sum of the exponentials, f32 sum of the chosen weights).
pub(crate) fn route_row(logits: &[f32], k: usize, normalize: bool, ids: &mut [i32], w: &mut [f32]) {
    // The scored routing's softmax case, with no bias, no groups and no scale.
    let spec = npu_backend::RouteSpec {
        k,
        gating: npu_model::Gating::Softmax,
        normalize,
        scale: 1.0,
        groups: None,
    };
    super::latent_ops::route_scored_row(logits, None, &spec, ids, w);
}

impl CpuBackend {
    pub(super) fn rms_norm_heads_op(
        &mut self,
        mut x: ViewMut<'_, CpuBuffer>,
        w: &CpuBuffer,
        eps: f32,
        head_dim: usize,
    ) -> Result<(), BackendError> {
        const OP: &str = "rms_norm_heads";
        let x = rows_mut(&mut x, OP)?;
        let w = w.f32s(OP)?;
        if head_dim == 0 || w.len() != head_dim || !x.cols.is_multiple_of(head_dim) {
            return Err(bad(
                OP,
                format!(
                    "{} weights for heads of {head_dim} in rows of {}",
                    w.len(),
                    x.cols
                ),
            ));
        }
        self.par_rows_mut(x, |_, row| elementwise::rms_norm_in_place(row, w, eps))
    }

    pub(super) fn scale_rows_op(
        &mut self,
        mut x: ViewMut<'_, CpuBuffer>,
        s: f32,
    ) -> Result<(), BackendError> {
        let x = rows_mut(&mut x, "scale_rows")?;
        self.par_rows_mut(x, |_, row| elementwise::scale(row, s))
    }

    pub(super) fn geglu_op(
        &mut self,
        gate: View<'_, CpuBuffer>,
        up: View<'_, CpuBuffer>,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "geglu";
        let (gate, up) = (rows(&gate, OP)?, rows(&up, OP)?);
        let o = rows_mut(&mut out, OP)?;
        shape(OP, "up", up.rows, up.cols, gate.rows, gate.cols)?;
        shape(OP, "out", o.rows, o.cols, gate.rows, gate.cols)?;
        self.par_rows_mut_quantized(o, |r, dst| elementwise::geglu(gate.row(r), up.row(r), dst))
    }
}

impl CpuBackend {
    pub(super) fn moe_route_op(
        &mut self,
        logits: View<'_, CpuBuffer>,
        k: usize,
        normalize: bool,
        mut ids: ViewMut<'_, CpuBuffer>,
        mut weights: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "moe_route";
        let l = rows(&logits, OP)?;
        if k == 0 || k > l.cols {
            return Err(bad(OP, format!("{k} experts of {}", l.cols)));
        }
        let il = ids.layout();
        shape(OP, "ids", il.rows(), il.cols(), l.rows, k)?;
        let mut w = rows_mut(&mut weights, OP)?;
        shape(OP, "weights", w.rows, w.cols, l.rows, k)?;
        let (id_data, id_stride) = i32_rows_mut(&mut ids, OP)?;
        for r in 0..l.rows {
            route_row(
                l.row(r),
                k,
                normalize,
                &mut id_data[r * id_stride..r * id_stride + k],
                w.row_mut(r),
            );
        }
        Ok(())
    }

    /// `moe_ffn` (all experts held: `held` is `0..n_experts`) and `moe_ffn_held` (a range of
    /// them: slots routed elsewhere add nothing).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_ffn_op(
        &mut self,
        x: View<'_, CpuBuffer>,
        ids: View<'_, CpuBuffer>,
        weights: View<'_, CpuBuffer>,
        gate_up: &[WeightMatrix],
        down: &[WeightMatrix],
        held: std::ops::Range<usize>,
        n_experts: usize,
        ff: usize,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "moe_ffn";
        let x = rows(&x, OP)?;
        let (t, h) = (x.rows, x.cols);
        let il = ids.layout();
        let k = il.cols();
        shape(OP, "ids", il.rows(), k, t, k)?;
        let w = rows(&weights, OP)?;
        shape(OP, "weights", w.rows, w.cols, t, k)?;
        if gate_up.len() != down.len() {
            return Err(bad(
                OP,
                format!("{} gate/up and {} down experts", gate_up.len(), down.len()),
            ));
        }
        if held.len() != down.len() || held.end > n_experts {
            return Err(bad(
                OP,
                format!(
                    "{} experts given as experts {held:?} of {n_experts}",
                    down.len()
                ),
            ));
        }
        for (e, (gu, d)) in gate_up.iter().zip(down).enumerate() {
            if gu.k() != h || gu.n() != 2 * ff || d.k() != ff || d.n() != h {
                return Err(bad(
                    OP,
                    format!(
                        "expert {e} is {}x{} then {}x{}, expected {h}x{} then {ff}x{h}",
                        gu.k(),
                        gu.n(),
                        d.k(),
                        d.n(),
                        2 * ff
                    ),
                ));
            }
        }
        // Which (token, slot) pairs each held expert serves, and which slots are held at all.
        let (id_data, id_stride) = i32_rows(&ids, OP)?;
        let mut served: Vec<Vec<(usize, usize)>> = vec![Vec::new(); gate_up.len()];
        let mut slot_held = vec![false; t * k];
        for r in 0..t {
            for j in 0..k {
                let e = id_data[r * id_stride + j];
                let e = usize::try_from(e)
                    .ok()
                    .filter(|&e| e < n_experts)
                    .ok_or_else(|| {
                        bad(
                            OP,
                            format!("token {r} is routed to expert {e} of {n_experts}"),
                        )
                    })?;
                if held.contains(&e) {
                    served[e - held.start].push((r, j));
                    slot_held[r * k + j] = true;
                }
            }
        }
        // Each expert once, over the rows routed to it; its outputs kept per (token, slot).
        let mut y = vec![0f32; t * k * h];
        let packed = (
            super::moe_grouped::packed_all(gate_up),
            super::moe_grouped::packed_all(down),
        );
        let looped = packed.0.is_none() || packed.1.is_none();
        if let (Some(gu), Some(dn)) = packed {
            // All experts packed: one grouped job per projection (bit for bit the loop below).
            let mut groups = Vec::with_capacity(served.len());
            let mut xs = Vec::with_capacity(t * k * h);
            for list in &served {
                let start = xs.len() / h.max(1);
                for &(r, _) in list {
                    xs.extend_from_slice(x.row(r));
                }
                groups.push(start..start + list.len());
            }
            let mut ys = vec![0f32; t * k * h];
            // The scratch activations are overwritten: no cached quantization stays valid.
            self.acts_key = None;
            super::moe_grouped::grouped_ffn(
                &self.pool,
                self.isa,
                (&gu.0, gu.1),
                (&dn.0, dn.1),
                &groups,
                &xs,
                h,
                ff,
                &mut self.acts,
                &mut ys,
            )?;
            for (list, g) in served.iter().zip(&groups) {
                for (&(r, j), i) in list.iter().zip(g.clone()) {
                    y[(r * k + j) * h..(r * k + j + 1) * h]
                        .copy_from_slice(&ys[i * h..(i + 1) * h]);
                }
            }
        }
        for (e, list) in served
            .iter()
            .enumerate()
            .filter(|(_, l)| looped && !l.is_empty())
        {
            let n = list.len();
            let mut xs = Vec::with_capacity(n * h);
            for &(r, _) in list {
                xs.extend_from_slice(x.row(r));
            }
            let xs = CpuBuffer::from_f32(xs);
            let mut gu = CpuBuffer::zeroed(DType::F32, n * 2 * ff)?;
            self.matmul(
                View::rows(&xs, n, h)?,
                &gate_up[e],
                ViewMut::rows(&mut gu, n, 2 * ff)?,
            )?;
            let mut act = CpuBuffer::zeroed(DType::F32, n * ff)?;
            let guv = View::rows(&gu, n, 2 * ff)?;
            self.swiglu(
                guv.col_range(0, ff)?,
                guv.col_range(ff, ff)?,
                ViewMut::rows(&mut act, n, ff)?,
            )?;
            let mut ye = CpuBuffer::zeroed(DType::F32, n * h)?;
            self.matmul(
                View::rows(&act, n, ff)?,
                &down[e],
                ViewMut::rows(&mut ye, n, h)?,
            )?;
            let ye = ye.f32s(OP)?;
            for (i, &(r, j)) in list.iter().enumerate() {
                y[(r * k + j) * h..(r * k + j + 1) * h].copy_from_slice(&ye[i * h..(i + 1) * h]);
            }
        }
        // Weighted, the held slots added in slot order (a row with none is zero).
        let mut o = rows_mut(&mut out, OP)?;
        shape(OP, "out", o.rows, o.cols, t, h)?;
        for r in 0..t {
            let wr = w.row(r);
            let dst = o.row_mut(r);
            let mut first = true;
            for j in (0..k).filter(|&j| slot_held[r * k + j]) {
                let yj = &y[(r * k + j) * h..(r * k + j + 1) * h];
                if first {
                    for (d, &v) in dst.iter_mut().zip(yj) {
                        *d = v * wr[j];
                    }
                } else {
                    for (d, &v) in dst.iter_mut().zip(yj) {
                        *d += v * wr[j];
                    }
                }
                first = false;
            }
            if first {
                dst.fill(0.0);
            }
        }
        Ok(())
    }
}

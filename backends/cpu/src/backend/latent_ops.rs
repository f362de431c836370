//! DeepSeek's ops on the CPU: the latent KV pool's writes and the attention over it
//! (multi-head latent attention with the up-projections absorbed: every head attends over the
//! same cached rows, a latent and a rotated key per token), and scored expert routing (sigmoid
//! or softmax scores, a selection bias, group-limited choice, a routed scaling factor), as
//! llama.cpp's `build_moe_ffn` computes it. The shapes are checked here before any loop runs.

use half::f16;
use npu_backend::{AttnGeometry, BackendError, RouteSpec, View, ViewMut};
use npu_model::Gating;

use super::buffer::{bad, i32_rows_mut, rows, rows_mut, shape};
use super::kv::KvPool;
use super::{CpuBackend, CpuBuffer};

/// One query row of a latent attention: where its sequence's context lies and how far it sees.
struct QueryRow<'t> {
    /// Positions it attends (its own and every earlier one).
    len: usize,
    table: &'t [u32],
}

impl CpuBackend {
    pub(super) fn init_latent_kv_op(
        &mut self,
        spec: npu_backend::KvSpec,
    ) -> Result<(), BackendError> {
        if self.kv_dtype != npu_backend::KvDtype::F16 {
            return Err(BackendError::Unsupported {
                backend: super::NAME,
                what: format!(
                    "kv_cache_dtype {} with latent attention (the latent KV pool stays f16)",
                    self.kv_dtype.name()
                ),
            });
        }
        self.kv = Some(KvPool::new_latent(spec)?);
        Ok(())
    }

    pub(super) fn kv_write_latent_op(
        &mut self,
        latent: View<'_, CpuBuffer>,
        rope: View<'_, CpuBuffer>,
        layer: usize,
    ) -> Result<(), BackendError> {
        const OP: &str = "kv_write_latent";
        let (lat, rp) = (rows(&latent, OP)?, rows(&rope, OP)?);
        let n = self.step.slot_mapping.len();
        let kv = self
            .kv
            .as_mut()
            .ok_or_else(|| bad(OP, "the KV pool is not initialised (init_latent_kv)".into()))?;
        let row = kv.spec.head_dim;
        shape(OP, "latent", lat.rows, lat.cols + rp.cols, n, row)?;
        shape(OP, "rope", rp.rows, rp.cols, n, row - lat.cols)?;
        let base = kv.latent_base(OP, layer)?;
        let (bs, blocks, stride) = (kv.spec.block_size, kv.spec.num_blocks, kv.block_len());
        let data = kv.data_mut();
        for (i, &slot) in self.step.slot_mapping.iter().enumerate() {
            let (b, off) = (slot as usize / bs, slot as usize % bs);
            if b >= blocks {
                return Err(BackendError::BadStep(format!(
                    "slot {slot} lies beyond the pool's {blocks} blocks of {bs}"
                )));
            }
            let at = b * stride + base + off * row;
            let dst = &mut data[at..at + row];
            for (d, &v) in dst.iter_mut().zip(lat.row(i).iter().chain(rp.row(i))) {
                *d = f16::from_f32(v);
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_latent_op(
        &mut self,
        q_latent: View<'_, CpuBuffer>,
        q_rope: View<'_, CpuBuffer>,
        g: &AttnGeometry,
        latent_dim: usize,
        layer: usize,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "attention_latent";
        let (ql, qr) = (rows(&q_latent, OP)?, rows(&q_rope, OP)?);
        let o = rows_mut(&mut out, OP)?;
        let n = self.step.tokens.len();
        let kv = self.kv(OP)?;
        let row = kv.spec.head_dim;
        let h = g.n_heads;
        if g.head_dim != row || g.n_kv_heads != 1 || latent_dim == 0 || latent_dim >= row {
            return Err(bad(
                OP,
                format!(
                    "a geometry of {} KV heads of {} with a latent of {latent_dim} over a pool \
                     of rows of {row}",
                    g.n_kv_heads, g.head_dim
                ),
            ));
        }
        if g.window.is_some() {
            return Err(bad(OP, "latent attention through a window".into()));
        }
        let rope_dim = row - latent_dim;
        shape(OP, "q_latent", ql.rows, ql.cols, n, h * latent_dim)?;
        shape(OP, "q_rope", qr.rows, qr.cols, n, h * rope_dim)?;
        shape(OP, "out", o.rows, o.cols, n, h * latent_dim)?;
        let base = kv.latent_base(OP, layer)?;
        let (bs, blocks, stride) = (kv.spec.block_size, kv.spec.num_blocks, kv.block_len());
        let mb = self.step.max_blocks;
        // Each row's sequence: its context length and block table, checked once.
        let mut queries: Vec<Option<QueryRow<'_>>> = (0..n).map(|_| None).collect();
        for (i, s) in self.step.seqs.iter().enumerate() {
            let (q_row, n_q, start) = (s.q_row as usize, s.n_q as usize, s.start_pos as usize);
            let table = self.step.block_tables.get(i * mb..(i + 1) * mb);
            let (Some(table), true) = (table, q_row + n_q <= n) else {
                return Err(BackendError::BadStep(format!(
                    "sequence {i} lies outside the step's {n} tokens or block tables"
                )));
            };
            let need = (start + n_q).div_ceil(bs);
            if need > mb || table[..need].iter().any(|&b| b as usize >= blocks) {
                return Err(BackendError::BadStep(format!(
                    "sequence {i}'s {} positions need blocks beyond its table or the pool",
                    start + n_q
                )));
            }
            for j in 0..n_q {
                queries[q_row + j] = Some(QueryRow {
                    len: start + j + 1,
                    table,
                });
            }
        }
        if let Some(r) = queries.iter().position(Option::is_none) {
            return Err(BackendError::BadStep(format!(
                "token row {r} belongs to no sequence"
            )));
        }
        let cache = kv.data();
        let scale = g.scale;
        self.par_rows_mut(o, |r, dst| {
            let Some(q) = &queries[r] else { return };
            // The context's rows as f32, once for every head.
            let mut ctx = vec![0f32; q.len * row];
            for (pos, c) in ctx.chunks_exact_mut(row).enumerate() {
                let at = q.table[pos / bs] as usize * stride + base + (pos % bs) * row;
                for (d, s) in c.iter_mut().zip(&cache[at..at + row]) {
                    *d = s.to_f32();
                }
            }
            // As llama.cpp's attention without flash attention (what the other CPU attention
            // kernel follows too): the query and the probabilities meet the f16 cache as f16,
            // products summed in f32, the softmax's sum in f64.
            let round = |v: f32| f16::from_f32(v).to_f32();
            let mut scores = vec![0f32; q.len];
            let (mut qh, mut qp) = (vec![0f32; latent_dim], vec![0f32; rope_dim]);
            for head in 0..h {
                let src = &ql.row(r)[head * latent_dim..(head + 1) * latent_dim];
                qh.iter_mut().zip(src).for_each(|(d, &v)| *d = round(v));
                let src = &qr.row(r)[head * rope_dim..(head + 1) * rope_dim];
                qp.iter_mut().zip(src).for_each(|(d, &v)| *d = round(v));
                let mut max = f32::NEG_INFINITY;
                for (s, c) in scores.iter_mut().zip(ctx.chunks_exact(row)) {
                    let (cl, cr) = c.split_at(latent_dim);
                    *s = (dot(&qh, cl) + dot(&qp, cr)) * scale;
                    max = max.max(*s);
                }
                let mut sum = 0f64;
                for s in &mut scores {
                    *s = (*s - max).exp();
                    sum += f64::from(*s);
                }
                let inv = (1.0 / sum) as f32;
                let out = &mut dst[head * latent_dim..(head + 1) * latent_dim];
                out.fill(0.0);
                for (&p, c) in scores.iter().zip(ctx.chunks_exact(row)) {
                    let p = round(p * inv);
                    for (o, &v) in out.iter_mut().zip(&c[..latent_dim]) {
                        *o += p * v;
                    }
                }
            }
        })
    }

    pub(super) fn moe_route_scored_op(
        &mut self,
        logits: View<'_, CpuBuffer>,
        bias: Option<&CpuBuffer>,
        spec: &RouteSpec,
        mut ids: ViewMut<'_, CpuBuffer>,
        mut weights: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "moe_route_scored";
        let l = rows(&logits, OP)?;
        let (k, ne) = (spec.k, l.cols);
        if k == 0 || k > ne {
            return Err(bad(OP, format!("{k} experts of {ne}")));
        }
        let bias = match bias {
            Some(b) => {
                let b = b.f32s(OP)?;
                if b.len() != ne {
                    return Err(bad(OP, format!("{} bias values for {ne} experts", b.len())));
                }
                Some(b)
            }
            None => None,
        };
        if let Some((groups, used)) = spec.groups {
            if groups < 2 || !ne.is_multiple_of(groups) || used == 0 || used >= groups {
                return Err(bad(
                    OP,
                    format!("{used} of {groups} groups over {ne} experts"),
                ));
            }
            if k > used * (ne / groups) {
                return Err(bad(
                    OP,
                    format!("{k} experts from {used} groups of {}", ne / groups),
                ));
            }
        }
        let il = ids.layout();
        shape(OP, "ids", il.rows(), il.cols(), l.rows, k)?;
        let mut w = rows_mut(&mut weights, OP)?;
        shape(OP, "weights", w.rows, w.cols, l.rows, k)?;
        let (id_data, id_stride) = i32_rows_mut(&mut ids, OP)?;
        let mut chosen = vec![0i32; k];
        for r in 0..l.rows {
            route_scored_row(l.row(r), bias, spec, &mut chosen, w.row_mut(r));
            id_data[r * id_stride..r * id_stride + k].copy_from_slice(&chosen);
        }
        Ok(())
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// One token's scored routing (see `Backend::moe_route_scored`), as ggml computes it: softmax
/// (f64 sum) or sigmoid scores, the bias added for the choice only, groups scored by the sum of
/// their two best biased scores with the others masked out, the top k by biased score
/// (descending, ties to the lower index), their unbiased scores normalised (the f32 sum clamped
/// to at least 2^-14) and scaled.
pub(crate) fn route_scored_row(
    logits: &[f32],
    bias: Option<&[f32]>,
    spec: &RouteSpec,
    ids: &mut [i32],
    w: &mut [f32],
) {
    let k = spec.k;
    let probs: Vec<f32> = match spec.gating {
        Gating::Softmax => {
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut p: Vec<f32> = logits.iter().map(|&v| (v - max).exp()).collect();
            let sum: f64 = p.iter().map(|&v| f64::from(v)).sum();
            let inv = (1.0 / sum) as f32;
            p.iter_mut().for_each(|v| *v *= inv);
            p
        }
        Gating::Sigmoid => logits.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect(),
    };
    let mut select: Vec<f32> = match bias {
        Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
        None => probs.clone(),
    };
    if let Some((groups, used)) = spec.groups {
        let per = select.len() / groups;
        let score = |g: usize| {
            let part = &select[g * per..(g + 1) * per];
            let mut order: Vec<usize> = (0..per).collect();
            order.sort_by(|&a, &b| part[b].total_cmp(&part[a]).then(a.cmp(&b)));
            order.iter().take(2).map(|&i| part[i]).sum::<f32>()
        };
        let scores: Vec<f32> = (0..groups).map(score).collect();
        let mut order: Vec<usize> = (0..groups).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        for &g in &order[used..] {
            select[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
        }
    }
    let mut order: Vec<usize> = (0..select.len()).collect();
    order.sort_by(|&a, &b| select[b].total_cmp(&select[a]).then(a.cmp(&b)));
    for j in 0..k {
        ids[j] = order[j] as i32;
        w[j] = probs[order[j]];
    }
    if spec.normalize {
        let s = w[..k].iter().fold(0f32, |s, &v| s + v).max(6.103_515_6e-5);
        w[..k].iter_mut().for_each(|v| *v /= s);
    }
    if spec.scale != 0.0 && spec.scale != 1.0 {
        w[..k].iter_mut().for_each(|v| *v *= spec.scale);
    }
}

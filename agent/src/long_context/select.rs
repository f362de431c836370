//! Choosing memory units for one layer of one step (InfLLM's unit lookup): each unit is scored by
//! the step's queries against its representative keys, all placed at the memory position, and
//! the best `k` are attended to. A score is a sum of dot products, so the queries of a step and
//! the query heads sharing a KV head are summed first (`memory_query`) and each unit keeps the
//! sum of its representative keys (`representative_sum`): one dot product per unit.

use npu_model::Rope;

use super::rotary;

/// Query-head geometry of a layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Heads {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope: Rope,
}

impl Heads {
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}

/// The step's queries (`rows` of `n_heads * head_dim`, rotated at their own positions) turned
/// to face keys left unrotated as if the memory sat at `memory_pos`, summed over the rows and
/// over the query heads of each KV head: `kv_width` values into `out`.
pub fn memory_query(h: &Heads, rows: &[f32], memory_pos: u64, out: &mut Vec<f32>) {
    let qw = h.n_heads * h.head_dim;
    let mut sum = vec![0f32; qw];
    for row in rows.chunks_exact(qw) {
        for (s, &x) in sum.iter_mut().zip(row) {
            *s += x;
        }
    }
    // q . R(pm) k0 = (R(-pm) q) . k0; the rotation is linear, so the sum can turn once.
    let mut cs = Vec::new();
    rotary::angles(&h.rope, -(memory_pos as f64), &mut cs);
    rotary::rotate(&h.rope, &mut sum, h.head_dim, &cs);
    out.clear();
    out.resize(h.kv_width(), 0.0);
    for (qh, head) in sum.chunks_exact(h.head_dim).enumerate() {
        let g = qh / h.group();
        for (o, &x) in out[g * h.head_dim..(g + 1) * h.head_dim]
            .iter_mut()
            .zip(head)
        {
            *o += x;
        }
    }
}

/// The representative keys of one unit's layer block (`keys`: token rows of `kv_width`
/// values, unrotated): the `r` tokens whose keys agree most with the block's mean key (the
/// dot product with it, over all KV heads; the first on ties), summed into `out`.
pub fn representative_sum(keys: &[f32], kv_width: usize, r: usize, out: &mut [f32]) {
    let n = keys.len() / kv_width;
    let mut mean = vec![0f32; kv_width];
    for row in keys.chunks_exact(kv_width) {
        for (m, &x) in mean.iter_mut().zip(row) {
            *m += x;
        }
    }
    let mut scored: Vec<(f32, usize)> = keys
        .chunks_exact(kv_width)
        .enumerate()
        .map(|(t, row)| (dot(row, &mean), t))
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    out.fill(0.0);
    for &(_, t) in scored.iter().take(r.min(n)) {
        for (o, &x) in out.iter_mut().zip(&keys[t * kv_width..(t + 1) * kv_width]) {
            *o += x;
        }
    }
}

/// The `k` best units by `query . repr[u]` (`repr`: one `query.len()` row per unit), best
/// first, the lower unit first on equal scores; NaN scores count as lowest.
pub fn top_units(query: &[f32], repr: &[f32], k: usize, scores: &mut Vec<f32>) -> Vec<u64> {
    let w = query.len();
    scores.clear();
    scores.extend(repr.chunks_exact(w).map(|row| dot(row, query)));
    let mut idx: Vec<u64> = (0..scores.len() as u64).collect();
    let key = |u: &u64| {
        let s = scores[*u as usize];
        if s.is_nan() {
            f32::NEG_INFINITY
        } else {
            s
        }
    };
    let cmp = |a: &u64, b: &u64| key(b).total_cmp(&key(a)).then(a.cmp(b));
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx
}

/// Dot product in eight lanes (the compiler vectorises it).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests;

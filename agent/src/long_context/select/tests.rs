//! Unit selection against a scalar reference that follows InfLLM's formula literally: for every
//! query token, every query head and every representative key, the dot product with the key
//! moved to the memory position, summed in f64; then all units sorted.

use npu_model::{Rope, RopeStyle};

use super::*;

/// A small deterministic generator (xorshift), values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn heads(style: RopeStyle) -> Heads {
    Heads {
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 8,
        rope: Rope {
            style,
            dims: 8,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
    }
}

fn rotated(h: &Heads, row: &[f32], delta: f64) -> Vec<f32> {
    let mut r = row.to_vec();
    let mut cs = Vec::new();
    rotary::angles(&h.rope, delta, &mut cs);
    rotary::rotate(&h.rope, &mut r, h.head_dim, &cs);
    r
}

/// The reference score of one unit: `cached` holds its token rows rotated at `first_pos + t`.
fn reference_score(
    h: &Heads,
    queries: &[f32],
    cached: &[f32],
    first_pos: u64,
    r: usize,
    memory_pos: u64,
) -> f64 {
    let (w, hd) = (h.kv_width(), h.head_dim);
    let bs = cached.len() / w;
    let unrotated: Vec<Vec<f32>> = (0..bs)
        .map(|t| {
            rotated(
                h,
                &cached[t * w..(t + 1) * w],
                -((first_pos + t as u64) as f64),
            )
        })
        .collect();
    let mut mean = vec![0f64; w];
    for k in &unrotated {
        for i in 0..w {
            mean[i] += f64::from(k[i]);
        }
    }
    let mut order: Vec<(f64, usize)> = (0..bs)
        .map(|t| {
            let s: f64 = (0..w).map(|i| f64::from(unrotated[t][i]) * mean[i]).sum();
            (s, t)
        })
        .collect();
    order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut total = 0f64;
    for &(_, t) in order.iter().take(r) {
        let pos = first_pos + t as u64;
        let at_memory = rotated(
            h,
            &cached[t * w..(t + 1) * w],
            memory_pos as f64 - pos as f64,
        );
        for q in queries.chunks_exact(h.n_heads * hd) {
            for qh in 0..h.n_heads {
                let g = qh / (h.n_heads / h.n_kv_heads);
                for d in 0..hd {
                    total += f64::from(q[qh * hd + d]) * f64::from(at_memory[g * hd + d]);
                }
            }
        }
    }
    total
}

#[test]
fn selection_matches_the_scalar_reference() {
    for (style, n_q, r, k) in [
        (RopeStyle::Halves, 1, 2, 3),
        (RopeStyle::Interleaved, 5, 4, 4),
        (RopeStyle::Halves, 3, 1, 40),
    ] {
        let h = heads(style);
        let (w, bs, units) = (h.kv_width(), 4usize, 30u64);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (n_q * 31 + r) as u64);
        let first_unit_pos = 16u64;
        let memory_pos = first_unit_pos + units * bs as u64 + 7;
        let cached: Vec<Vec<f32>> = (0..units)
            .map(|_| (0..bs * w).map(|_| rng.next()).collect())
            .collect();
        let queries: Vec<f32> = (0..n_q * h.n_heads * h.head_dim)
            .map(|_| rng.next())
            .collect();
        // The fast path: representative sums of unrotated keys, one query, one dot per unit.
        let mut repr = vec![0f32; units as usize * w];
        for (u, block) in cached.iter().enumerate() {
            let first = first_unit_pos + (u * bs) as u64;
            let unrot: Vec<f32> = block
                .chunks_exact(w)
                .enumerate()
                .flat_map(|(t, row)| rotated(&h, row, -((first + t as u64) as f64)))
                .collect();
            representative_sum(&unrot, w, r, &mut repr[u * w..(u + 1) * w]);
        }
        let mut q = Vec::new();
        memory_query(&h, &queries, memory_pos, &mut q);
        let mut scores = Vec::new();
        let got = top_units(&q, &repr, k, &mut scores);

        let want_scores: Vec<f64> = cached
            .iter()
            .enumerate()
            .map(|(u, c)| {
                reference_score(
                    &h,
                    &queries,
                    c,
                    first_unit_pos + (u * bs) as u64,
                    r,
                    memory_pos,
                )
            })
            .collect();
        for (u, (&f, &s)) in scores.iter().zip(&want_scores).enumerate() {
            assert!(
                (f64::from(f) - s).abs() < 1e-3 * (1.0 + s.abs()),
                "unit {u}: {f} vs {s}"
            );
        }
        let mut want: Vec<u64> = (0..units).collect();
        want.sort_by(|a, b| {
            want_scores[*b as usize]
                .total_cmp(&want_scores[*a as usize])
                .then(a.cmp(b))
        });
        want.truncate(k.min(units as usize));
        assert_eq!(got, want, "{style:?} n_q {n_q} r {r} k {k}");
    }
}

#[test]
fn top_units_handles_ties_nan_and_small_counts() {
    let q = [1.0f32, 0.0];
    let repr = [2.0, 9.0, f32::NAN, 0.0, 2.0, 1.0, 3.0, 0.0];
    let mut s = Vec::new();
    assert_eq!(top_units(&q, &repr, 2, &mut s), vec![3, 0]);
    assert_eq!(top_units(&q, &repr, 10, &mut s), vec![3, 0, 2, 1]);
    assert!(top_units(&q, &repr, 0, &mut s).is_empty());
    assert!(top_units(&q, &[], 3, &mut s).is_empty());
}

//! 8-bit activation quantization for the quantized matmuls: each row of activations is cut into
//! blocks of 32, each block gets a scale `d = amax / 127` and int8 values, the integer sum of its
//! values, and `s = d * sum` (both rounded through f16 as llama.cpp's Q8_1 does, so results agree
//! with it). The K-quant kernels also read, per block, the integer sums of its two 16-value halves
//! and the exact `d * sum` (`ActSums`, made from the quantized rows the first time a matmul asks).

use std::sync::OnceLock;

use half::f16;

pub const QBLOCK: usize = 32;

/// Values of one Q8_K super-block.
pub const QK_K: usize = 256;

/// How a row of activations is cut into scaled int8 blocks: as llama.cpp quantizes them for the
/// weights they meet (the weight type's `vec_dot_type`), so both round the same values the same
/// way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActBlocks {
    /// Q8_0 / Q8_1: a scale `amax / 127` per 32 values, values rounded to nearest-even (Q4_0,
    /// Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL weights).
    #[default]
    Q8_0,
    /// Q8_K: one f32 scale per 256 values, `-max / 127` of the value largest in magnitude (the
    /// K-quants and IQ4_XS); stored here as that scale on each of the super-block's eight
    /// 32-value blocks.
    Q8K,
}

/// Quantized rows of activations (reused between calls; grows, never shrinks).
#[derive(Default)]
pub struct QuantizedActs {
    pub rows: usize,
    pub k: usize,
    /// How the rows were quantized.
    pub blocks: ActBlocks,
    /// rows * k values.
    pub qs: Vec<i8>,
    /// Per block: scale (f16-rounded).
    pub d: Vec<f32>,
    /// Per block: scale times the sum of the block's values (f16-rounded).
    pub s: Vec<f32>,
    /// Per block: sum of the block's int8 values.
    pub isum: Vec<i32>,
    /// The values of whole 16-row tiles in tile order (`[tile][block][16 rows][32]`), for AMX;
    /// filled by `fill_tiles` (empty otherwise).
    pub tiles: Vec<i8>,
    /// Sums the K-quant kernels read, made from `qs`, `d` and `isum` when first asked for
    /// (`sums`); every write through `resize` or `quantize_row_into` drops them.
    sums: OnceLock<ActSums>,
}

/// Per-block sums of quantized activations beyond `isum` and `s`.
#[derive(Debug, Default)]
pub struct ActSums {
    /// Per block, the integer sums of its values 0..16 and 16..32 (two per block; each at most
    /// 16 * 127 in size, so the pair also reads as one 32-bit word of two 16-bit lanes).
    pub s16: Vec<i16>,
    /// Per block, `d * isum` in f32 (not rounded through f16 as `s` is).
    pub sx: Vec<f32>,
}

impl QuantizedActs {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn blocks_per_row(&self) -> usize {
        self.k / QBLOCK
    }

    /// Sizes the buffers for `rows` rows of `k` values (k a multiple of 32).
    pub fn resize(&mut self, rows: usize, k: usize) {
        assert!(
            k.is_multiple_of(QBLOCK),
            "activation row length {k} is not a multiple of 32"
        );
        self.rows = rows;
        self.k = k;
        let nb = rows * k / QBLOCK;
        self.qs.resize(rows * k, 0);
        self.d.resize(nb, 0.0);
        self.s.resize(nb, 0.0);
        self.isum.resize(nb, 0);
        self.tiles.clear();
        self.blocks = ActBlocks::Q8_0;
        self.sums = OnceLock::new();
    }

    /// The per-16 integer sums and exact block sums of the current rows, made on first use (the
    /// rows must not change until the next `resize` or `quantize_row_into`).
    pub fn sums(&self) -> &ActSums {
        self.sums.get_or_init(|| {
            let nb = self.rows * self.k / QBLOCK;
            let mut s16 = vec![0i16; 2 * nb];
            for (half, q) in s16.iter_mut().zip(self.qs[..nb * QBLOCK].chunks_exact(16)) {
                *half = q.iter().map(|&v| v as i16).sum();
            }
            let sx = (0..nb).map(|b| self.d[b] * self.isum[b] as f32).collect();
            ActSums { s16, sx }
        })
    }

    /// The sums if `sums` has made them already (never makes them, so never waits).
    pub fn sums_made(&self) -> Option<&ActSums> {
        self.sums.get()
    }

    /// Whether the buffers hold every value and block scale of `rows` rows of `k` (what `sums`
    /// reads).
    pub fn holds_rows(&self) -> bool {
        let nb = self.rows * self.k / QBLOCK;
        self.qs.len() >= self.rows * self.k && self.d.len() >= nb && self.isum.len() >= nb
    }

    /// Copies the values of the whole 16-row tiles into `tiles` (tile order).
    pub fn fill_tiles(&mut self) {
        let k = self.k;
        let nb = k / QBLOCK;
        let n_tiles = self.rows / 16;
        self.tiles.resize(n_tiles * nb * 16 * QBLOCK, 0);
        for t in 0..n_tiles {
            for b in 0..nb {
                for r in 0..16 {
                    let src = (t * 16 + r) * k + b * QBLOCK;
                    let dst = ((t * nb + b) * 16 + r) * QBLOCK;
                    self.tiles[dst..dst + QBLOCK].copy_from_slice(&self.qs[src..src + QBLOCK]);
                }
            }
        }
    }

    /// Quantizes `rows` rows of `k` values from `x` (row-major) as Q8_K (`k` a multiple of 256).
    pub fn quantize_q8k(&mut self, x: &[f32], rows: usize, k: usize) {
        assert_eq!(x.len(), rows * k);
        assert!(k.is_multiple_of(QK_K), "Q8_K rows of {k} values");
        self.resize(rows, k);
        self.blocks = ActBlocks::Q8K;
        let nb = k / QBLOCK;
        for r in 0..rows {
            quantize_row_q8k(
                &x[r * k..(r + 1) * k],
                &mut self.qs[r * k..(r + 1) * k],
                &mut self.d[r * nb..(r + 1) * nb],
                &mut self.s[r * nb..(r + 1) * nb],
                &mut self.isum[r * nb..(r + 1) * nb],
            );
        }
    }

    /// Quantizes `rows` rows of `k` values from `x` (row-major).
    pub fn quantize(&mut self, x: &[f32], rows: usize, k: usize) {
        assert_eq!(x.len(), rows * k);
        self.resize(rows, k);
        let nb = k / QBLOCK;
        for r in 0..rows {
            self.quantize_row_into(r, &x[r * k..(r + 1) * k], nb);
        }
    }

    /// Quantizes one row in place (rows must already be sized by `resize`).
    pub fn quantize_row_into(&mut self, r: usize, x: &[f32], nb: usize) {
        self.sums = OnceLock::new();
        let qs = &mut self.qs[r * self.k..(r + 1) * self.k];
        let d = &mut self.d[r * nb..(r + 1) * nb];
        let s = &mut self.s[r * nb..(r + 1) * nb];
        let isum = &mut self.isum[r * nb..(r + 1) * nb];
        quantize_row(x, qs, d, s, isum);
    }
}

/// The reference row quantizer (inlined into the ISA-specific copies that call it).
#[inline(always)]
pub fn quantize_row(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], isum: &mut [i32]) {
    for (b, (xb, qb)) in x
        .chunks_exact(QBLOCK)
        .zip(qs.chunks_exact_mut(QBLOCK))
        .enumerate()
    {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let dd = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in qb.iter_mut().zip(xb) {
            let r = (v * id).round_ties_even();
            // NaN becomes 0 and infinities saturate: a poisoned activation must not be UB.
            let qi = if r.is_nan() {
                0
            } else {
                r.clamp(-127.0, 127.0) as i32
            };
            *q = qi as i8;
            sum += qi;
        }
        d[b] = f16::from_f32(dd).to_f32();
        s[b] = f16::from_f32(dd * sum as f32).to_f32();
        isum[b] = sum;
    }
}

/// The Q8_K row quantizer, as llama.cpp's `quantize_row_q8_K_ref` (which its x86 build uses):
/// per 256 values the one of largest magnitude (the first, on ties) `max`, `iscale = -127 / max`,
/// each value `round_ties_even(iscale * x)` at most 127, and the scale `1 / iscale` in f32. Each
/// of the super-block's 32-value blocks gets that scale, its integer sum, and `s` (the sum
/// scaled, rounded through f16, as for Q8_0). `x.len()` must be a multiple of 256.
#[inline(always)]
pub fn quantize_row_q8k(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], isum: &mut [i32]) {
    const PER: usize = QK_K / QBLOCK;
    for (sb, (xs, qsb)) in x
        .chunks_exact(QK_K)
        .zip(qs.chunks_exact_mut(QK_K))
        .enumerate()
    {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in xs {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let blocks = sb * PER..(sb + 1) * PER;
        if amax == 0.0 {
            qsb.fill(0);
            d[blocks.clone()].fill(0.0);
            s[blocks.clone()].fill(0.0);
            isum[blocks].fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in qsb.iter_mut().zip(xs) {
            let r = (iscale * v).round_ties_even();
            // NaN becomes 0 (a poisoned activation must not be UB); the top is clamped to 127
            // as llama.cpp clamps it.
            *q = if r.is_nan() {
                0
            } else {
                r.clamp(-128.0, 127.0) as i8
            };
        }
        let scale = 1.0 / iscale;
        for (j, b) in blocks.enumerate() {
            let sum: i32 = qsb[j * QBLOCK..(j + 1) * QBLOCK]
                .iter()
                .map(|&q| q as i32)
                .sum();
            d[b] = scale;
            isum[b] = sum;
            s[b] = f16::from_f32(scale * sum as f32).to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q8_K as llama.cpp defines it: the largest-magnitude value maps to -127 exactly, one
    /// scale per 256 values (negative when that value is positive), values within half a step.
    #[test]
    fn q8k_rows_follow_llama_cpp() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.173 + if i == 300 { 40.0 } else { 0.0 })
            .collect();
        let mut a = QuantizedActs::new();
        a.quantize_q8k(&x, 1, 512);
        assert_eq!(a.blocks, ActBlocks::Q8K);
        for sb in 0..2 {
            let xs = &x[sb * 256..(sb + 1) * 256];
            let (i, max) =
                xs.iter().enumerate().fold(
                    (0, 0f32),
                    |b, (i, &v)| if v.abs() > b.1.abs() { (i, v) } else { b },
                );
            assert_eq!(a.qs[sb * 256 + i], -127);
            let d = a.d[sb * 8];
            assert_eq!(d, 1.0 / (-127.0 / max));
            assert!(a.d[sb * 8..sb * 8 + 8].iter().all(|&v| v == d));
            for (j, &v) in xs.iter().enumerate() {
                let back = d * a.qs[sb * 256 + j] as f32;
                assert!((back - v).abs() <= d.abs() * 0.5 + 1e-5, "{v} vs {back}");
            }
            for b in 0..8 {
                let want: i32 = a.qs[sb * 256 + b * 32..sb * 256 + b * 32 + 32]
                    .iter()
                    .map(|&q| q as i32)
                    .sum();
                assert_eq!(a.isum[sb * 8 + b], want);
            }
        }
    }

    #[test]
    fn dequantized_values_are_close() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
            .collect();
        let mut a = QuantizedActs::new();
        a.quantize(&x, 1, 64);
        for b in 0..2 {
            let amax = x[b * 32..b * 32 + 32]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            let mut sum = 0;
            for j in 0..32 {
                let back = a.qs[b * 32 + j] as f32 * a.d[b];
                assert!((back - x[b * 32 + j]).abs() <= amax / 127.0 * 0.51 + 1e-3);
                sum += a.qs[b * 32 + j] as i32;
            }
            assert_eq!(sum, a.isum[b]);
        }
    }

    #[test]
    fn zero_and_nan_rows_do_not_panic() {
        let mut a = QuantizedActs::new();
        a.quantize(&[0.0; 32], 1, 32);
        assert!(a.qs.iter().all(|&q| q == 0));
        assert_eq!(a.d[0], 0.0);
        let mut x = [1.0f32; 32];
        x[3] = f32::NAN;
        a.quantize(&x, 1, 32);
    }
}

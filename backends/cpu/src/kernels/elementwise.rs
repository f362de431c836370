//! The element-wise parts of a layer: RMS normalisation (of rows, and of each head of a row),
//! rotary position embedding, SwiGLU and GELU-gated activations, scaling, residual adds, and
//! embedding-row lookup. They follow ggml's arithmetic (f64 sum of squares,
//! here over interleaved lanes, `1/sqrt(mean + eps)` in f32, rotation angles by repeated
//! multiplication) so hidden states track llama.cpp's closely.

use half::f16;

use super::vecmath::exp_approx;
use super::Isa;
pub use npu_model::{Rope, RopeStyle};

/// `out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w` for every row of `x` (row length `w.len()`).
/// The squares are summed in f64 over `SUM_LANES` interleaved lanes (then the lanes in order):
/// independent chains the compiler vectorizes, where one in-order chain waits on every add. The
/// f32 mean equals the in-order sum's except when the two f64 sums round to different f32s.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let scale = rms_scale(xr, eps);
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = (v * scale) * g;
        }
    }
}

/// `rms_norm` in place: every `w.len()` values of `x` (each head of a row, for per-head norms).
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    for xr in x.chunks_exact_mut(w.len()) {
        let scale = rms_scale(xr, eps);
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = (*v * scale) * g;
        }
    }
}

/// `1 / sqrt(mean(x^2) + eps)`, the squares summed as `rms_norm` documents.
#[inline(always)]
fn rms_scale(xr: &[f32], eps: f32) -> f32 {
    const SUM_LANES: usize = 8;
    let mut lanes = [0f64; SUM_LANES];
    let mut chunks = xr.chunks_exact(SUM_LANES);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += (v * v) as f64;
        }
    }
    for (l, &v) in lanes.iter_mut().zip(chunks.remainder()) {
        *l += (v * v) as f64;
    }
    let sum: f64 = lanes.iter().sum();
    let mean = (sum / xr.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// Rotates `n_heads` heads of `head_dim` values (one token) in place with precomputed angles.
pub fn rope_apply(rope: &Rope, v: &mut [f32], n_heads: usize, head_dim: usize, cs: &[f32]) {
    for h in 0..n_heads {
        let head = &mut v[h * head_dim..(h + 1) * head_dim];
        for i in 0..rope.dims / 2 {
            let (c, s) = (cs[2 * i], cs[2 * i + 1]);
            let (a, b) = match rope.style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::Halves => (i, i + rope.dims / 2),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * c - x1 * s;
            head[b] = x0 * s + x1 * c;
        }
    }
}

/// `out[i] = silu(gate[i]) * up[i]` (the three slices have the same length).
pub fn swiglu(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let isa = isa.checked();
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::checked` found AVX-512F on this CPU; the body is safe slice code.
        Isa::Avx512Vnni => unsafe { swiglu_avx512(gate, up, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::checked` found AVX2 and FMA on this CPU; the body is safe slice code.
        Isa::Avx2 => unsafe { swiglu_avx2(gate, up, out) },
        _ => swiglu_body(gate, up, out),
    }
    super::inject_fault(isa, out.first_mut());
}

#[inline(always)]
fn swiglu_body(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = (g / (1.0 + exp_approx(-g))) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn swiglu_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_body(gate, up, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_body(gate, up, out)
}

/// GELU with the tanh approximation, in f32 (ggml's `ggml_gelu_f32`).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044_715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh())
}

/// `gelu_tanh` of every f16 value, rounded to f16: ggml's CPU table, through which llama.cpp
/// computes GELU (inputs rounded to f16 first), so hidden states track its values.
fn gelu_f16_table() -> &'static [f16] {
    static TABLE: std::sync::OnceLock<Vec<f16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_tanh(f16::from_bits(bits).to_f32())))
            .collect()
    })
}

/// `out[i] = gelu_tanh(gate[i]) * up[i]` as ggml computes it on the CPU: 0 at or below -10, the
/// gate itself at or above 10, else the f16 table's value at the gate rounded to f16.
pub fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let table = gelu_f16_table();
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let act = if g <= -10.0 {
            0.0
        } else if g >= 10.0 {
            g
        } else {
            table[usize::from(f16::from_f32(g).to_bits())].to_f32()
        };
        *o = act * u;
    }
}

/// `x *= s`.
pub fn scale(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Rounds every value through f16 (as ggml does when it feeds f32 data to an f16 kernel).
pub fn round_f16(x: &mut [f32]) {
    for v in x {
        *v = f16::from_f32(*v).to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0f32, 4.0, 0.0, 0.0];
        let w = [1.0f32, 2.0, 1.0, 1.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &w, 0.0, &mut out);
        let rms = (25.0f32 / 4.0).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6);
        assert!((out[1] - 8.0 / rms).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs_and_preserves_norm() {
        let rope = Rope {
            style: RopeStyle::Interleaved,
            dims: 4,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        };
        let mut cs = [0f32; 4];
        rope.angles(3, &mut cs);
        let mut v = [1.0f32, 0.0, 0.0, 1.0];
        rope_apply(&rope, &mut v, 1, 4, &cs);
        assert!((v[0] - 3f32.cos()).abs() < 1e-6 && (v[1] - 3f32.sin()).abs() < 1e-6);
        let t = 3.0 * 10000f32.powf(-0.5);
        assert!((v[2] + t.sin()).abs() < 1e-5 && (v[3] - t.cos()).abs() < 1e-5);
        // Position 0 is the identity.
        rope.angles(0, &mut cs);
        let mut w = [0.3f32, -0.7, 1.1, 2.0];
        let before = w;
        rope_apply(&rope, &mut w, 1, 4, &cs);
        assert_eq!(w, before);
        // Halves style pairs i with i + d/2.
        let halves = Rope {
            style: RopeStyle::Halves,
            ..rope
        };
        halves.angles(3, &mut cs);
        let mut h = [1.0f32, 0.0, 0.0, 0.0];
        rope_apply(&halves, &mut h, 1, 4, &cs);
        assert!((h[0] - 3f32.cos()).abs() < 1e-6 && (h[2] - 3f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn swiglu_values() {
        let gu = [0.0f32, 1.0, 2.0, 3.0];
        let mut out = [0f32; 2];
        swiglu(Isa::Scalar, &gu[..2], &gu[2..], &mut out);
        assert_eq!(out[0], 0.0);
        assert!((out[1] - (1.0 / (1.0 + (-1f32).exp())) * 3.0).abs() < 1e-6);
    }

    #[test]
    fn rms_norm_lanes_agree_with_the_in_order_sum() {
        // Hidden-state-like rows (values over several orders of magnitude), odd lengths too.
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let (mut same, mut total) = (0usize, 0usize);
        for &n in &[576usize, 1536, 13, 8, 3] {
            for _ in 0..50 {
                let x: Vec<f32> = (0..n)
                    .map(|_| (next() - 0.5) * 10f32.powi((next() * 6.0) as i32 - 3))
                    .collect();
                let w: Vec<f32> = (0..n).map(|_| next() + 0.5).collect();
                let mut got = vec![0f32; n];
                rms_norm(&x, &w, 1e-5, &mut got);
                let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
                let scale = 1.0 / ((sum / n as f64) as f32 + 1e-5).sqrt();
                for ((&g, &v), &wv) in got.iter().zip(&x).zip(&w) {
                    let want = (v * scale) * wv;
                    total += 1;
                    same += (g.to_bits() == want.to_bits()) as usize;
                    // At most one f32 step of the scale apart.
                    assert!(
                        (g - want).abs() <= want.abs() * 4.0 * f32::EPSILON,
                        "{g} vs {want}"
                    );
                }
            }
        }
        assert!(
            same * 100 >= total * 99,
            "{same} of {total} values bit-identical"
        );
    }
}

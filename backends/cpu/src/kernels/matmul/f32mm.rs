//! f32 weights (models stored as F32/F16/BF16): plain dot products written so the compiler
//! vectorizes them, compiled once per instruction set.

use super::super::Isa;
use crate::disjoint::Tile;

const LANES: usize = 16;

#[inline(always)]
fn dot(x: &[f32], w: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut xc = x.chunks_exact(LANES);
    let mut wc = w.chunks_exact(LANES);
    for (xa, wa) in (&mut xc).zip(&mut wc) {
        for j in 0..LANES {
            acc[j] = xa[j].mul_add(wa[j], acc[j]);
        }
    }
    let mut tail = 0f32;
    for (a, b) in xc.remainder().iter().zip(wc.remainder()) {
        tail = a.mul_add(*b, tail);
    }
    acc.iter().sum::<f32>() + tail
}

/// `out[m][n] = x[m] . w[n]` for every row of the tile and its columns.
#[inline(always)]
fn body(w: &[f32], k: usize, x: &[f32], out: &mut Tile<f32>) {
    let cols = out.cols();
    for m in out.rows() {
        let xr = &x[m * k..(m + 1) * k];
        let orow = out.row_mut(m);
        for (o, n) in orow.iter_mut().zip(cols.clone()) {
            *o = dot(xr, &w[n * k..(n + 1) * k]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn body_avx512(w: &[f32], k: usize, x: &[f32], out: &mut Tile<f32>) {
    body(w, k, x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn body_avx2(w: &[f32], k: usize, x: &[f32], out: &mut Tile<f32>) {
    body(w, k, x, out)
}

/// The tile's rows of `x` (rows of `k` values) times the tile's columns of `w` (row-major `n x k`).
/// Panics if `x` or `w` are too short for them.
pub fn matmul_f32(isa: Isa, w: &[f32], k: usize, x: &[f32], out: &mut Tile<f32>) {
    let isa = isa.checked();
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::checked` found these features; the body is safe slice code.
        Isa::Avx512Vnni => unsafe { body_avx512(w, k, x, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::checked` found these features; the body is safe slice code.
        Isa::Avx2 => unsafe { body_avx2(w, k, x, out) },
        _ => body(w, k, x, out),
    }
    if let Some(first) = out.rows().next() {
        super::super::inject_fault(isa, out.row_mut(first).first_mut());
    }
}

//! f32 weights (models stored as F32/F16/BF16): plain dot products written so the compiler
//! vectorizes them, compiled once per instruction set.

use super::super::{Isa, SharedOut};
use std::ops::Range;

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

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn body(
    w: &[f32],
    k: usize,
    x: &[f32],
    rows: usize,
    cols: Range<usize>,
    out: SharedOut,
    ldo: usize,
) {
    for m in 0..rows {
        let xr = &x[m * k..(m + 1) * k];
        for n in cols.clone() {
            let v = dot(xr, &w[n * k..(n + 1) * k]);
            // SAFETY: tasks own disjoint column ranges; out is sized rows x ldo.
            unsafe { *out.0.add(m * ldo + n) = v };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn body_avx512(
    w: &[f32],
    k: usize,
    x: &[f32],
    rows: usize,
    cols: Range<usize>,
    out: SharedOut,
    ldo: usize,
) {
    body(w, k, x, rows, cols, out, ldo)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn body_avx2(
    w: &[f32],
    k: usize,
    x: &[f32],
    rows: usize,
    cols: Range<usize>,
    out: SharedOut,
    ldo: usize,
) {
    body(w, k, x, rows, cols, out, ldo)
}

#[allow(clippy::too_many_arguments)]
pub fn matmul_f32(
    isa: Isa,
    w: &[f32],
    k: usize,
    x: &[f32],
    rows: usize,
    cols: Range<usize>,
    out: SharedOut,
    ldo: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx512Vnni is only chosen when these features are present.
        Isa::Avx512Vnni => unsafe { body_avx512(w, k, x, rows, cols, out, ldo) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx2 is only chosen when these features are present.
        Isa::Avx2 => unsafe { body_avx2(w, k, x, rows, cols, out, ldo) },
        _ => body(w, k, x, rows, cols, out, ldo),
    }
}

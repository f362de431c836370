//! Fast 8-bit activation quantization (the matmuls' input), bit-identical to the reference in
//! `quant::acts`: per 32-value block, scale `amax/127` rounded through f16, values rounded to
//! nearest-even, and the block's integer sum. Many rows are split across the thread pool.

use std::ops::Range;

use super::{Isa, KernelError};
use crate::disjoint::{GridError, TileGrid};
use crate::quant::acts::{quantize_row, QuantizedActs, QBLOCK};
use crate::threadpool::ThreadPool;

/// Quantizes `rows` rows of `k` values of `x` into `acts` (`k` a multiple of 32).
pub fn quantize_acts(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    acts: &mut QuantizedActs,
) -> Result<(), KernelError> {
    let bad = |message: String| KernelError::BadShape {
        op: "activation quantization",
        message,
    };
    if !k.is_multiple_of(QBLOCK) {
        return Err(bad(format!("row length {k} is not a multiple of {QBLOCK}")));
    }
    if x.len() < rows * k {
        return Err(bad(format!("{} values for {rows} rows of {k}", x.len())));
    }
    let isa = isa.checked();
    acts.resize(rows, k);
    let nb = k / QBLOCK;
    let tasks = if rows >= 8 && pool.threads() > 1 {
        pool.threads().min(rows)
    } else {
        1
    };
    let parts: Vec<Range<usize>> = (0..tasks)
        .map(|t| crate::threadpool::split_range(rows, tasks, t))
        .collect();
    let grid_err = |e: GridError| bad(e.to_string());
    let qs = TileGrid::rows(&mut acts.qs[..rows * k], k, parts.clone()).map_err(grid_err)?;
    let ds = TileGrid::rows(&mut acts.d[..rows * nb], nb, parts.clone()).map_err(grid_err)?;
    let ss = TileGrid::rows(&mut acts.s[..rows * nb], nb, parts.clone()).map_err(grid_err)?;
    let sums = TileGrid::rows(&mut acts.isum[..rows * nb], nb, parts.clone()).map_err(grid_err)?;
    pool.run(tasks, |t| {
        let (mut q, mut d, mut s, mut i) =
            (qs.take(t, 0), ds.take(t, 0), ss.take(t, 0), sums.take(t, 0));
        let (q, d, s, i) = (
            q.contiguous_mut(),
            d.contiguous_mut(),
            s.contiguous_mut(),
            i.contiguous_mut(),
        );
        for (j, r) in parts[t].clone().enumerate() {
            let xr = &x[r * k..(r + 1) * k];
            let qr = &mut q[j * k..(j + 1) * k];
            let (dr, sr, ir) = (
                &mut d[j * nb..(j + 1) * nb],
                &mut s[j * nb..(j + 1) * nb],
                &mut i[j * nb..(j + 1) * nb],
            );
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa` passed `Isa::checked`, so the CPU has AVX-512 F/BW/VL; the row
                // function reads and writes `xr.len() / 32` blocks of its slices, which are
                // `k` and `k / 32` long.
                Isa::Avx512Vnni => unsafe { row_avx512(xr, qr, dr, sr, ir) },
                _ => quantize_row(xr, qr, dr, sr, ir),
            }
        }
    })?;
    super::inject_fault(isa, acts.d.first_mut());
    // The AMX matmul reads whole 16-row tiles in tile order: lay them out once here, shared by
    // every matrix this activation multiplies.
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni && rows >= 16 && crate::kernels::matmul::amx::available() {
        acts.fill_tiles();
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
/// # Safety
/// The CPU must have AVX-512 F/BW/VL; `qs` must hold `x.len()` values rounded down to whole
/// blocks of 32, and `d`, `s`, `isum` one per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn row_avx512(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], isum: &mut [i32]) {
    use half::f16;
    use std::arch::x86_64::*;
    for b in 0..x.len() / QBLOCK {
        let p = x.as_ptr().add(b * QBLOCK);
        let v0 = _mm512_loadu_ps(p);
        let v1 = _mm512_loadu_ps(p.add(16));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        let dd = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let vid = _mm512_set1_ps(id);
        // cvtps rounds to nearest-even under the default MXCSR, as the reference does.
        let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
        let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
        let lim = _mm512_set1_epi32(127);
        let q0 = _mm512_max_epi32(_mm512_min_epi32(q0, lim), _mm512_set1_epi32(-127));
        let q1 = _mm512_max_epi32(_mm512_min_epi32(q1, lim), _mm512_set1_epi32(-127));
        let out = qs.as_mut_ptr().add(b * QBLOCK);
        _mm_storeu_si128(out as *mut __m128i, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(out.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(q1));
        let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        d[b] = f16::from_f32(dd).to_f32();
        s[b] = f16::from_f32(dd * sum as f32).to_f32();
        isum[b] = sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::testing::TestRng;

    #[test]
    fn every_isa_matches_the_reference() {
        let pool = ThreadPool::new(2);
        let mut rng = TestRng::new(3);
        let (rows, k) = (13, 576);
        let mut x: Vec<f32> = (0..rows * k).map(|_| rng.uniform(-3.0, 3.0)).collect();
        // A zero block and a block with exact halves (ties) too.
        x[..32].fill(0.0);
        for (i, v) in x[32..64].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 0.5;
        }
        let mut want = QuantizedActs::new();
        want.quantize(&x, rows, k);
        for isa in Isa::available() {
            let mut got = QuantizedActs::new();
            quantize_acts(&pool, isa, &x, rows, k, &mut got).unwrap();
            assert_eq!(got.qs, want.qs, "{}", isa.name());
            assert_eq!(got.d, want.d, "{}", isa.name());
            assert_eq!(got.s, want.s, "{}", isa.name());
            assert_eq!(got.isum, want.isum, "{}", isa.name());
        }
    }
}

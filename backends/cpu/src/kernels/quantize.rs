//! Fast 8-bit activation quantization (the matmuls' input), bit-identical to the reference in
//! `quant::acts`: per 32-value block, scale `amax/127` rounded through f16, values rounded to
//! nearest-even, and the block's integer sum. Many rows are split across the thread pool.

use half::f16;

use super::{Isa, SharedOut};
use crate::quant::acts::{quantize_row, QuantizedActs, QBLOCK};
use crate::threadpool::ThreadPool;

/// Quantizes `rows` rows of `k` values of `x` into `acts`.
pub fn quantize_acts(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    acts: &mut QuantizedActs,
) {
    acts.resize(rows, k);
    let nb = k / QBLOCK;
    let qs = SharedOut(acts.qs.as_mut_ptr() as *mut f32);
    let d = SharedOut(acts.d.as_mut_ptr());
    let s = SharedOut(acts.s.as_mut_ptr());
    let isum = SharedOut(acts.isum.as_mut_ptr() as *mut f32);
    let one = |r: usize| {
        // SAFETY: each row index writes only its own row of each buffer, sized by resize().
        let (qr, dr, sr, ir) = unsafe {
            (
                std::slice::from_raw_parts_mut((qs.ptr() as *mut i8).add(r * k), k),
                std::slice::from_raw_parts_mut(d.ptr().add(r * nb), nb),
                std::slice::from_raw_parts_mut(s.ptr().add(r * nb), nb),
                std::slice::from_raw_parts_mut((isum.ptr() as *mut i32).add(r * nb), nb),
            )
        };
        let xr = &x[r * k..(r + 1) * k];
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: chosen only when the CPU has AVX-512 F/BW.
            Isa::Avx512Vnni => unsafe { row_avx512(xr, qr, dr, sr, ir) },
            _ => quantize_row(xr, qr, dr, sr, ir),
        }
    };
    if rows >= 8 && pool.threads() > 1 {
        let tasks = pool.threads().min(rows);
        pool.run(tasks, |t| {
            for r in crate::threadpool::split_range(rows, tasks, t) {
                one(r);
            }
        });
    } else {
        (0..rows).for_each(one);
    }
    // The AMX matmul reads whole 16-row tiles in tile order: lay them out once here, shared by
    // every matrix this activation multiplies.
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni && rows >= 16 && crate::kernels::matmul::amx::available() {
        acts.fill_tiles();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn row_avx512(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], isum: &mut [i32]) {
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
            quantize_acts(&pool, isa, &x, rows, k, &mut got);
            assert_eq!(got.qs, want.qs, "{}", isa.name());
            assert_eq!(got.d, want.d, "{}", isa.name());
            assert_eq!(got.s, want.s, "{}", isa.name());
            assert_eq!(got.isum, want.isum, "{}", isa.name());
        }
    }
}

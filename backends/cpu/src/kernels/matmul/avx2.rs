//! AVX2 packed matmul (no VNNI): a group's 16 rows are handled as two 8-lane halves; byte
//! products go through `vpmaddubsw`, which is exact for 4-bit weights and, by splitting each byte
//! into two nibbles, for 8-bit weights too.

use std::arch::x86_64::*;

use super::{PackedJob, RawOut};
use crate::quant::acts::QBLOCK;
use crate::quant::packed::{PackKind, GROUP};

/// Activation rows per tile (AVX2 has 16 registers).
const R2: usize = 2;

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `job` must describe valid buffers.
/// The job must have passed `check_job`, and `out` must be writable, by this call alone, at rows
/// `job.rows` x the output columns of `job.groups` (what `packed_job` guarantees).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn packed(job: &PackedJob, out: RawOut) {
    let f = job.w.format;
    match (f.kind == PackKind::Nibble, f.f16_scales, f.has_min) {
        (true, true, true) => run::<true, true, true>(job, out),
        (true, true, false) => run::<true, true, false>(job, out),
        (true, false, true) => run::<true, false, true>(job, out),
        (true, false, false) => run::<true, false, false>(job, out),
        (false, true, true) => run::<false, true, true>(job, out),
        (false, true, false) => run::<false, true, false>(job, out),
        (false, false, true) => run::<false, false, true>(job, out),
        (false, false, false) => run::<false, false, false>(job, out),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run<const NIB: bool, const F16S: bool, const MIN: bool>(job: &PackedJob, out: RawOut) {
    let rows = job.rows.end;
    for g in job.groups.clone() {
        let valid = (job.w.n - g * GROUP).min(GROUP);
        let mut m0 = job.rows.start;
        while m0 + R2 <= rows {
            tile::<R2, NIB, F16S, MIN>(job, out, g, m0, valid);
            m0 += R2;
        }
        if m0 < rows {
            tile::<1, NIB, F16S, MIN>(job, out, g, m0, valid);
        }
    }
}

/// Sum over 4-byte lanes of u8 x i8 products, for u8 values below 16 (no i16 saturation).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_nibbles(w: &[__m256i; 8], x: &[__m256i; 8]) -> __m256i {
    let mut s = _mm256_maddubs_epi16(w[0], x[0]);
    for c in 1..8 {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[c], x[c]));
    }
    _mm256_madd_epi16(s, _mm256_set1_epi16(1))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_scales<const F16S: bool>(p: *const u8, half: usize) -> __m256 {
    if F16S {
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(half * 16) as *const __m128i))
    } else {
        _mm256_loadu_ps((p as *const f32).add(half * 8))
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const NIB: bool, const F16S: bool, const MIN: bool>(
    job: &PackedJob,
    out: RawOut,
    g: usize,
    m0: usize,
    valid: usize,
) {
    let w = job.w;
    let a = job.acts;
    let k = a.k;
    let nb = k / QBLOCK;
    let unit = w.format.unit_bytes();
    let vb = w.format.values_bytes();
    let sb = w.format.scale_bytes();
    let offset = w.format.offset;
    let gd = w.group_data(g).as_ptr();
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for b in 0..nb {
        let u = gd.add(b * unit);
        for half in 0..2 {
            // The 8 value registers of this half: 32 bytes per 64-byte row of the unit.
            let mut wv = [_mm256_setzero_si256(); 8];
            if NIB {
                for j in 0..4 {
                    let v = _mm256_loadu_si256(u.add(j * 64 + half * 32) as *const __m256i);
                    wv[j] = _mm256_and_si256(v, low);
                    wv[j + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                }
            } else {
                for (c, wc) in wv.iter_mut().enumerate() {
                    *wc = _mm256_loadu_si256(u.add(c * 64 + half * 32) as *const __m256i);
                }
            }
            let dw = load_scales::<F16S>(u.add(vb), half);
            let mw = if MIN {
                load_scales::<F16S>(u.add(vb + sb), half)
            } else {
                _mm256_setzero_ps()
            };
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let row = m0 + r;
                let xq = a.qs.as_ptr().add(row * k + b * QBLOCK) as *const i32;
                let mut xv = [_mm256_setzero_si256(); 8];
                for (c, xc) in xv.iter_mut().enumerate() {
                    *xc = _mm256_set1_epi32(xq.add(c).read_unaligned());
                }
                let mut ia = if NIB {
                    dot_nibbles(&wv, &xv)
                } else {
                    let mut lo = [_mm256_setzero_si256(); 8];
                    let mut hi = [_mm256_setzero_si256(); 8];
                    for c in 0..8 {
                        lo[c] = _mm256_and_si256(wv[c], low);
                        hi[c] = _mm256_and_si256(_mm256_srli_epi16::<4>(wv[c]), low);
                    }
                    let l = dot_nibbles(&lo, &xv);
                    let h = dot_nibbles(&hi, &xv);
                    _mm256_add_epi32(l, _mm256_slli_epi32::<4>(h))
                };
                let blk = row * nb + b;
                if offset != 0 {
                    ia = _mm256_sub_epi32(ia, _mm256_set1_epi32(offset * a.isum[blk]));
                }
                let sc = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[blk]));
                acc_r[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), sc, acc_r[half]);
                if MIN {
                    acc_r[half] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[blk]), acc_r[half]);
                }
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let mut tmp = [0f32; GROUP];
        _mm256_storeu_ps(tmp.as_mut_ptr(), acc_r[0]);
        _mm256_storeu_ps(tmp.as_mut_ptr().add(8), acc_r[1]);
        let dst = out.base.add((m0 + r) * out.ld + g * GROUP);
        std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, valid);
    }
}

//! The K-quant lane search (`super::search_lanes`) written with AVX2 intrinsics: one 256-bit
//! register holds the 8 sub-blocks' lanes. Same operations in the same order as the portable
//! form and the reference — separate multiplies and adds (no FMA), IEEE division, ordered
//! comparisons (false on NaN, as C's `>`/`<`) — so the bytes are the same; the tests compare
//! them bit for bit.

use std::arch::x86_64::*;

use super::{finalize, prepare, Found, Lanes, Search};

/// The lane search for one super-block.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn search(p: &Search, x: &[f32]) -> Found {
    let prep = prepare(x);
    // SAFETY (all loads and stores below): every pointer is to a whole `[f32; 8]` (32 bytes);
    // the unaligned forms need no alignment.
    let load = |a: &Lanes| unsafe { _mm256_loadu_ps(a.as_ptr()) };
    let xt: [__m256; 32] = std::array::from_fn(|i| load(&prep.xt[i]));
    let wt: [__m256; 32] = std::array::from_fn(|i| load(&prep.wt[i]));
    let max = load(&prep.max);
    let sum_w = load(&prep.sum_w);
    let sum_x = load(&prep.sum_x);
    let mut min = load(&prep.min);

    let zero = _mm256_setzero_ps();
    let magic = _mm256_set1_ps(12_582_912.0);
    let mantissa = _mm256_set1_epi32(0x007f_ffff);
    let offset = _mm256_set1_epi32(0x0040_0000);
    let nmax_i = _mm256_set1_epi32(p.nmax);
    let nmax_f = p.nmax as f32;
    // clamp(nearest_int(v), 0, nmax) as f32, lane-wise.
    let level = |v: __m256| {
        let bits = _mm256_castps_si256(_mm256_add_ps(v, magic));
        let l = _mm256_sub_epi32(_mm256_and_si256(bits, mantissa), offset);
        let l = _mm256_min_epi32(_mm256_max_epi32(l, _mm256_setzero_si256()), nmax_i);
        _mm256_cvtepi32_ps(l)
    };

    let mut levels = [zero; 32];
    let iscale = _mm256_div_ps(_mm256_set1_ps(nmax_f), _mm256_sub_ps(max, min));
    let mut scale = _mm256_div_ps(_mm256_set1_ps(1.0), iscale);
    let mut best = zero;
    for i in 0..32 {
        let l = level(_mm256_mul_ps(iscale, _mm256_sub_ps(xt[i], min)));
        levels[i] = l;
        let diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, l), min), xt[i]);
        best = _mm256_add_ps(best, _mm256_mul_ps(wt[i], _mm256_mul_ps(diff, diff)));
    }
    let mut aux = [zero; 32];
    for is in 0..=p.nstep {
        let num = p.rmin + p.rdelta * is as f32 + nmax_f;
        let iscale = _mm256_div_ps(_mm256_set1_ps(num), _mm256_sub_ps(max, min));
        let (mut sum_l, mut sum_l2, mut sum_xl) = (zero, zero, zero);
        for i in 0..32 {
            let l = level(_mm256_mul_ps(iscale, _mm256_sub_ps(xt[i], min)));
            aux[i] = l;
            let wl = _mm256_mul_ps(wt[i], l);
            sum_l = _mm256_add_ps(sum_l, wl);
            sum_l2 = _mm256_add_ps(sum_l2, _mm256_mul_ps(wl, l));
            sum_xl = _mm256_add_ps(sum_xl, _mm256_mul_ps(wl, xt[i]));
        }
        let d = _mm256_sub_ps(_mm256_mul_ps(sum_w, sum_l2), _mm256_mul_ps(sum_l, sum_l));
        let this_scale = _mm256_div_ps(
            _mm256_sub_ps(_mm256_mul_ps(sum_w, sum_xl), _mm256_mul_ps(sum_x, sum_l)),
            d,
        );
        let this_min = _mm256_div_ps(
            _mm256_sub_ps(_mm256_mul_ps(sum_l2, sum_x), _mm256_mul_ps(sum_l, sum_xl)),
            d,
        );
        let pos = _mm256_cmp_ps::<_CMP_GT_OQ>(this_min, zero);
        let this_scale = _mm256_blendv_ps(this_scale, _mm256_div_ps(sum_xl, sum_l2), pos);
        let this_min = _mm256_blendv_ps(this_min, zero, pos);
        let mut cur = zero;
        for i in 0..32 {
            let diff = _mm256_sub_ps(
                _mm256_add_ps(_mm256_mul_ps(this_scale, aux[i]), this_min),
                xt[i],
            );
            cur = _mm256_add_ps(cur, _mm256_mul_ps(wt[i], _mm256_mul_ps(diff, diff)));
        }
        let take = _mm256_and_ps(
            _mm256_cmp_ps::<_CMP_GT_OQ>(d, zero),
            _mm256_cmp_ps::<_CMP_LT_OQ>(cur, best),
        );
        if _mm256_movemask_ps(take) != 0 {
            for i in 0..32 {
                levels[i] = _mm256_blendv_ps(levels[i], aux[i], take);
            }
            best = _mm256_blendv_ps(best, cur, take);
            scale = _mm256_blendv_ps(scale, this_scale, take);
            min = _mm256_blendv_ps(min, this_min, take);
        }
    }
    let store = |v: __m256| {
        let mut a = [0.0f32; 8];
        // SAFETY: `a` is 8 f32s; the unaligned store needs no alignment.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        a
    };
    let levels: [Lanes; 32] = std::array::from_fn(|i| store(levels[i]));
    finalize(&prep, &levels, store(scale), store(min))
}

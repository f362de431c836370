//! AVX2 inner loops of paged attention for one query row (a decoding sequence's head): scores
//! and the V sum read the f16 cache directly (`vcvtph2ps` into the multiply-adds) instead of
//! widening each block into a buffer first. Every output is summed in the portable path's order
//! (scores over dimensions, the V sum over positions), so the results are its bits.

use std::arch::x86_64::*;

use half::f16;

/// `scores[i * bs + t] = sum_d q[d] * k_i[d * bs + t]` for the `NB` K blocks at `k` (each
/// `[d][t]`, `hd * bs` values), multiply-adds in order of `d` from zero.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `bs` a multiple of 16; each `k[i]` valid for `hd * bs`
/// values; `q` holds `hd` values; `scores` is valid for `NB * bs` writes.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn row_scores<const NB: usize>(
    k: [*const f16; NB],
    q: &[f32],
    hd: usize,
    bs: usize,
    scores: *mut f32,
) {
    let load = |p: *const f16| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
    for t0 in (0..bs).step_by(16) {
        let mut acc = [[_mm256_setzero_ps(); 2]; NB];
        for (d, &qd) in q[..hd].iter().enumerate() {
            let qv = _mm256_set1_ps(qd);
            for (i, a) in acc.iter_mut().enumerate() {
                let kp = k[i].add(d * bs + t0);
                a[0] = _mm256_fmadd_ps(qv, load(kp), a[0]);
                a[1] = _mm256_fmadd_ps(qv, load(kp.add(8)), a[1]);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            let o = scores.add(i * bs + t0);
            _mm256_storeu_ps(o, a[0]);
            _mm256_storeu_ps(o.add(8), a[1]);
        }
    }
}

/// `o[d] += p[t] * v[t * hd + d]` for `t` in order, every `d < hd`, from the f16 V block at `v`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `hd` a multiple of 8; `v` valid for `p.len() * hd`
/// values; `o` holds `hd` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn row_pv(v: *const f16, p: &[f32], hd: usize, o: &mut [f32]) {
    let o = &mut o[..hd];
    for d0 in (0..hd).step_by(64) {
        let n = (hd - d0).min(64) / 8;
        let mut acc = [_mm256_setzero_ps(); 8];
        for (j, a) in acc[..n].iter_mut().enumerate() {
            *a = _mm256_loadu_ps(o.as_ptr().add(d0 + 8 * j));
        }
        for (t, &pt) in p.iter().enumerate() {
            let pv = _mm256_set1_ps(pt);
            let vp = v.add(t * hd + d0);
            for (j, a) in acc[..n].iter_mut().enumerate() {
                let vv = _mm256_cvtph_ps(_mm_loadu_si128(vp.add(8 * j) as *const __m128i));
                *a = _mm256_fmadd_ps(pv, vv, *a);
            }
        }
        for (j, a) in acc[..n].iter().enumerate() {
            _mm256_storeu_ps(o.as_mut_ptr().add(d0 + 8 * j), *a);
        }
    }
}

/// `row_scores` for `R` query rows of one token (rows `hd` apart in `q`) against one K block
/// at `k`: row `r`'s scores at `scores + r * span`. Each K load feeds `R` rows.
///
/// # Safety
/// As `row_scores`, with `q` holding `R * hd` values and `scores` valid for `bs` writes at each
/// of `R` rows `span` apart.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_scores<const R: usize>(
    k: *const f16,
    q: &[f32],
    hd: usize,
    bs: usize,
    scores: *mut f32,
    span: usize,
) {
    let q = &q[..R * hd];
    let load = |p: *const f16| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
    for t0 in (0..bs).step_by(16) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for d in 0..hd {
            let kp = k.add(d * bs + t0);
            let (k0, k1) = (load(kp), load(kp.add(8)));
            for (r, a) in acc.iter_mut().enumerate() {
                let qv = _mm256_set1_ps(q[r * hd + d]);
                a[0] = _mm256_fmadd_ps(qv, k0, a[0]);
                a[1] = _mm256_fmadd_ps(qv, k1, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let o = scores.add(r * span + t0);
            _mm256_storeu_ps(o, a[0]);
            _mm256_storeu_ps(o.add(8), a[1]);
        }
    }
}

/// `row_pv` for `R` rows of one token: row `r` adds `p[r * span + t] * v[t * hd + d]` for
/// `t < n_t` in order into `o[r * hd + d]`; each V load feeds `R` rows.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `hd` a multiple of 16; `v` valid for `n_t * hd`
/// values; `p` valid for `n_t` reads at each of `R` rows `span` apart; `o` holds `R * hd`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_pv<const R: usize>(
    v: *const f16,
    p: *const f32,
    span: usize,
    n_t: usize,
    hd: usize,
    o: &mut [f32],
) {
    let o = &mut o[..R * hd];
    let load = |p: *const f16| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
    for d0 in (0..hd).step_by(16) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for (r, a) in acc.iter_mut().enumerate() {
            a[0] = _mm256_loadu_ps(o.as_ptr().add(r * hd + d0));
            a[1] = _mm256_loadu_ps(o.as_ptr().add(r * hd + d0 + 8));
        }
        for t in 0..n_t {
            let vp = v.add(t * hd + d0);
            let (v0, v1) = (load(vp), load(vp.add(8)));
            for (r, a) in acc.iter_mut().enumerate() {
                let pv = _mm256_set1_ps(*p.add(r * span + t));
                a[0] = _mm256_fmadd_ps(pv, v0, a[0]);
                a[1] = _mm256_fmadd_ps(pv, v1, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.as_mut_ptr().add(r * hd + d0), a[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(r * hd + d0 + 8), a[1]);
        }
    }
}

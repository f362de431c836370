//! AVX-512 inner loops of paged attention: the scores of a whole K block for several query rows
//! (each f16 K row is converted once and shared by the rows of a GQA group), the scaling and lane
//! maxima of a row of scores, its exponentials and their lane sums, the normalised probabilities
//! rounded through f16, and the probability-weighted sum of a V block into register-held
//! output rows. Used for head dims and block sizes that are multiples of 16; everything else
//! takes the portable path.

use std::arch::x86_64::*;

use half::f16;

/// Asks for the cache lines of `[p, p + bytes)` ahead of use. A prefetch never faults and
/// reads nothing architecturally, so this is safe for any address.
#[inline]
pub fn prefetch(p: *const u8, bytes: usize) {
    let mut off = 0;
    while off < bytes {
        // SAFETY: `prefetcht0` is SSE (baseline on x86-64) and is only a hint: it cannot fault
        // or change memory, whatever the address; the address is formed with wrapping
        // arithmetic and never dereferenced.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(off) as *const i8) };
        off += 64;
    }
}

/// Each lane's maximum over the whole 16-value chunks of `x`, `if v > max { v } else { max }`
/// from negative infinity (what `vmaxps` computes with the new value first), lane j over values
/// j, j + 16, ... The scores come here already scaled (`block_scores` scales them as it stores
/// them), so this pass only reads.
///
/// # Safety
/// AVX-512F must be present.
#[target_feature(enable = "avx512f")]
pub unsafe fn lane_max(x: &[f32]) -> [f32; 16] {
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    for c in x.chunks_exact(16) {
        m = _mm512_max_ps(_mm512_loadu_ps(c.as_ptr()), m);
    }
    let mut out = [0f32; 16];
    _mm512_storeu_ps(out.as_mut_ptr(), m);
    out
}

/// `x[i] = exp_approx(x[i] - max)` over the whole 16-value chunks of `x`, returning each lane's
/// sum (lane j adds values j, j + 16, ... in order, from zero): the portable softmax loop's
/// arithmetic with the sums held in a register (as an array they went through memory every
/// chunk, and the store-to-load latency set the pace).
///
/// # Safety
/// AVX-512F must be present.
#[target_feature(enable = "avx512f")]
pub unsafe fn exp_lane_sums(x: &mut [f32], max: f32) -> [f32; 16] {
    let m = _mm512_set1_ps(max);
    let mut sum = _mm512_setzero_ps();
    for c in x.chunks_exact_mut(16) {
        let e = crate::kernels::vecmath::exp_approx_avx512(_mm512_sub_ps(
            _mm512_loadu_ps(c.as_ptr()),
            m,
        ));
        _mm512_storeu_ps(c.as_mut_ptr(), e);
        sum = _mm512_add_ps(sum, e);
    }
    let mut out = [0f32; 16];
    _mm512_storeu_ps(out.as_mut_ptr(), sum);
    out
}

/// `x[i] = f16(x[i] * inv)` back in f32, over the whole 16-value chunks of `x`: the softmax's
/// normalisation and its rounding through f16 for the V product in one pass (the same two
/// roundings, in the same order, as a multiply pass and then `round_through_f16`).
///
/// # Safety
/// AVX-512F and F16C must be present.
#[target_feature(enable = "avx512f,f16c")]
pub unsafe fn scale_round_f16(x: &mut [f32], inv: f32) {
    let s = _mm512_set1_ps(inv);
    for c in x.chunks_exact_mut(16) {
        let v = _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), s);
        let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        _mm512_storeu_ps(c.as_mut_ptr(), _mm512_cvtph_ps(h));
    }
}

/// Query rows handled together when scoring.
const SCORE_ROWS: usize = 8;

/// `scores[r * stride + j * bs + t] = (q[r] . K_j[:, t]) * scale` for the `NB` (1 or 2) blocks
/// `k[j]`, `t < bs`, rows `0..rows` (the dot product rounded, then the product with `scale`: the
/// portable path's separate scaling pass, done at the store); each block is one KV head's
/// `[hd][bs]` f16; `q` is `rows x hd`. Two blocks at once give twice the independent accumulator
/// chains (each score is still summed over `d` in order, so the result does not depend on the
/// pairing).
///
/// # Safety
/// AVX-512F and F16C must be present; `hd` and `bs` multiples of 16; buffers large enough.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,f16c,fma")]
pub unsafe fn block_scores<const NB: usize>(
    k: [*const f16; NB],
    hd: usize,
    bs: usize,
    q: &[f32],
    rows: usize,
    scores: *mut f32,
    stride: usize,
    scale: f32,
) {
    let mut r0 = 0;
    while r0 < rows {
        let n = (rows - r0).min(SCORE_ROWS);
        let at = ScoresAt {
            r0,
            scores,
            stride,
            scale,
        };
        match n {
            8 => scores_rows::<8, NB>(k, hd, bs, q, at),
            7 => scores_rows::<7, NB>(k, hd, bs, q, at),
            6 => scores_rows::<6, NB>(k, hd, bs, q, at),
            5 => scores_rows::<5, NB>(k, hd, bs, q, at),
            4 => scores_rows::<4, NB>(k, hd, bs, q, at),
            3 => scores_rows::<3, NB>(k, hd, bs, q, at),
            2 => scores_rows::<2, NB>(k, hd, bs, q, at),
            _ => scores_rows::<1, NB>(k, hd, bs, q, at),
        }
        r0 += n;
    }
}

/// Where `scores_rows` writes: rows from `r0`, `stride` apart from `scores`, each value times
/// `scale`.
#[derive(Clone, Copy)]
struct ScoresAt {
    r0: usize,
    scores: *mut f32,
    stride: usize,
    scale: f32,
}

#[inline]
#[target_feature(enable = "avx512f,f16c,fma")]
unsafe fn scores_rows<const R: usize, const NB: usize>(
    k: [*const f16; NB],
    hd: usize,
    bs: usize,
    q: &[f32],
    at: ScoresAt,
) {
    let ScoresAt {
        r0,
        scores,
        stride,
        scale,
    } = at;
    let scale = _mm512_set1_ps(scale);
    let qp = q.as_ptr().add(r0 * hd);
    for t0 in (0..bs).step_by(16) {
        let mut acc = [[_mm512_setzero_ps(); R]; NB];
        for d in 0..hd {
            for (j, aj) in acc.iter_mut().enumerate() {
                let kv =
                    _mm512_cvtph_ps(_mm256_loadu_si256(k[j].add(d * bs + t0) as *const __m256i));
                for (r, a) in aj.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_set1_ps(*qp.add(r * hd + d)), kv, *a);
                }
            }
        }
        for (j, aj) in acc.iter().enumerate() {
            for (r, a) in aj.iter().enumerate() {
                _mm512_storeu_ps(
                    scores.add((r0 + r) * stride + j * bs + t0),
                    _mm512_mul_ps(*a, scale),
                );
            }
        }
    }
}

/// `o[r] += sum_t p[r * stride + t] * V[t, :]` for `t < n_t`, rows `0..rows`; `v` is one block of
/// one KV head, `[bs][hd]` f16; `o` is `rows x hd`. Probabilities of tokens a row may not see must
/// be zero.
///
/// # Safety
/// AVX-512F and F16C must be present; `hd` a multiple of 16 (at most 256); buffers large enough.
#[target_feature(enable = "avx512f,f16c,fma")]
pub unsafe fn block_pv(
    v: *const f16,
    hd: usize,
    n_t: usize,
    p: *const f32,
    stride: usize,
    rows: usize,
    o: &mut [f32],
) {
    match hd / 16 {
        4 => pv_rows::<4>(v, n_t, p, stride, rows, o),
        8 => pv_rows::<8>(v, n_t, p, stride, rows, o),
        2 => pv_rows::<2>(v, n_t, p, stride, rows, o),
        1 => pv_rows::<1>(v, n_t, p, stride, rows, o),
        w => pv_generic(v, w, n_t, p, stride, rows, o),
    }
}

/// D = hd / 16 registers per output row; rows are taken as many at a time as registers allow
/// (16 or 24 accumulators), each group by a kernel whose row count is a constant, so the
/// accumulators stay in registers.
#[inline]
#[target_feature(enable = "avx512f,f16c,fma")]
unsafe fn pv_rows<const D: usize>(
    v: *const f16,
    n_t: usize,
    p: *const f32,
    stride: usize,
    rows: usize,
    o: &mut [f32],
) {
    // 16 accumulators, but 24 for 64-wide heads: each V row converted once feeds 6 rows' 24
    // multiply-adds instead of 4 rows' 16 (with its 4 registers and a broadcast, 29 of 32).
    // Prefill of 4096 tokens, 1B Q4_0 file, three alternations: +1.4-3.3%.
    let per = if D == 4 { 6 } else { (16 / D).max(1) };
    let mut r0 = 0;
    while r0 < rows {
        let n = (rows - r0).min(per);
        let (p0, o0) = (p.add(r0 * stride), &mut o[r0 * D * 16..]);
        match n {
            1 => pv_tile::<D, 1>(v, n_t, p0, stride, o0),
            2 => pv_tile::<D, 2>(v, n_t, p0, stride, o0),
            3 => pv_tile::<D, 3>(v, n_t, p0, stride, o0),
            4 => pv_tile::<D, 4>(v, n_t, p0, stride, o0),
            5 => pv_tile::<D, 5>(v, n_t, p0, stride, o0),
            6 => pv_tile::<D, 6>(v, n_t, p0, stride, o0),
            7 => pv_tile::<D, 7>(v, n_t, p0, stride, o0),
            8 => pv_tile::<D, 8>(v, n_t, p0, stride, o0),
            _ => {
                // 9..16 rows of one register each (D = 1): two tiles.
                pv_tile::<D, 8>(v, n_t, p0, stride, o0);
                let rest = n - 8;
                let (p1, o1) = (p0.add(8 * stride), &mut o0[8 * D * 16..]);
                match rest {
                    1 => pv_tile::<D, 1>(v, n_t, p1, stride, o1),
                    2 => pv_tile::<D, 2>(v, n_t, p1, stride, o1),
                    3 => pv_tile::<D, 3>(v, n_t, p1, stride, o1),
                    4 => pv_tile::<D, 4>(v, n_t, p1, stride, o1),
                    5 => pv_tile::<D, 5>(v, n_t, p1, stride, o1),
                    6 => pv_tile::<D, 6>(v, n_t, p1, stride, o1),
                    7 => pv_tile::<D, 7>(v, n_t, p1, stride, o1),
                    _ => pv_tile::<D, 8>(v, n_t, p1, stride, o1),
                }
            }
        }
        r0 += n;
    }
}

/// `R` rows of `D` registers: `o[r] += sum_t p[r * stride + t] * V[t, :]`, each accumulator
/// updated in `t` order (the same sums as any other row grouping).
#[inline]
#[target_feature(enable = "avx512f,f16c,fma")]
unsafe fn pv_tile<const D: usize, const R: usize>(
    v: *const f16,
    n_t: usize,
    p: *const f32,
    stride: usize,
    o: &mut [f32],
) {
    let hd = D * 16;
    assert!(o.len() >= R * hd, "output rows beyond the buffer");
    let mut acc = [[_mm512_setzero_ps(); D]; R];
    for (r, a) in acc.iter_mut().enumerate() {
        for (j, x) in a.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(o.as_ptr().add(r * hd + j * 16));
        }
    }
    for t in 0..n_t {
        let mut vv = [_mm512_setzero_ps(); D];
        for (j, x) in vv.iter_mut().enumerate() {
            *x = _mm512_cvtph_ps(_mm256_loadu_si256(v.add(t * hd + j * 16) as *const __m256i));
        }
        for (r, a) in acc.iter_mut().enumerate() {
            let pt = _mm512_set1_ps(*p.add(r * stride + t));
            for j in 0..D {
                a[j] = _mm512_fmadd_ps(pt, vv[j], a[j]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        for (j, x) in a.iter().enumerate() {
            _mm512_storeu_ps(o.as_mut_ptr().add(r * hd + j * 16), *x);
        }
    }
}

#[target_feature(enable = "avx512f,f16c,fma")]
unsafe fn pv_generic(
    v: *const f16,
    d16: usize,
    n_t: usize,
    p: *const f32,
    stride: usize,
    rows: usize,
    o: &mut [f32],
) {
    let hd = d16 * 16;
    for r in 0..rows {
        for j in 0..d16 {
            let mut a = _mm512_loadu_ps(o.as_ptr().add(r * hd + j * 16));
            for t in 0..n_t {
                let vv =
                    _mm512_cvtph_ps(_mm256_loadu_si256(v.add(t * hd + j * 16) as *const __m256i));
                a = _mm512_fmadd_ps(_mm512_set1_ps(*p.add(r * stride + t)), vv, a);
            }
            _mm512_storeu_ps(o.as_mut_ptr().add(r * hd + j * 16), a);
        }
    }
}

//! The int8 cache's inner loops on x86-64: i16 queries (or V weights) against int8 keys (or
//! values) widened to i16 in registers, two positions' (or dimensions') values interleaved so
//! each i32 lane sums one pair (`vpdpwssd` on AVX-512 VNNI, `vpmaddwd` + `vpaddd` on AVX2).
//! The sums are exact integers, so these give the portable loops' bits.

use std::arch::x86_64::*;

use half::f16;

use super::RUN;

/// Query rows scored together.
const ROWS: usize = 4;

/// The `vpermw` index that interleaves the two 16-value halves of a register: element `2i` from
/// element `i`, `2i + 1` from element `16 + i`.
#[inline(always)]
unsafe fn interleave_index() -> __m512i {
    let idx: [i16; 32] = std::array::from_fn(|i| (i / 2 + 16 * (i % 2)) as i16);
    _mm512_loadu_si512(idx.as_ptr() as *const _)
}

/// Sixteen i16 pairs `(a[i], b[i])` from the 16 int8 values at `a` and at `b = a + dist`
/// (`CONTIG`: `dist` is 16, one load).
#[inline(always)]
unsafe fn pairs16<const CONTIG: bool>(a: *const i8, dist: usize, idx: __m512i) -> __m512i {
    let x = if CONTIG {
        _mm256_loadu_si256(a as *const __m256i)
    } else {
        _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(a as *const __m128i)),
            _mm_loadu_si128(a.add(dist) as *const __m128i),
        )
    };
    _mm512_permutexvar_epi16(idx, _mm512_cvtepi8_epi16(x))
}

/// # Safety
/// AVX-512F/BW/VNNI, FMA and F16C; hd and bs multiples of 16; `k` holds `hd * bs` values, `ks`
/// `bs`, `qp` `rows * hd / 2` pairs (`rows = qscale.len()`), `scores`
/// `(rows - 1) * stride + bs`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
pub(super) unsafe fn scores_avx512(
    k: &[i8],
    ks: &[f16],
    qp: &[i32],
    qscale: &[f32],
    hd: usize,
    bs: usize,
    scores: &mut [f32],
    stride: usize,
) {
    let rows = qscale.len();
    let mut r0 = 0;
    while r0 < rows {
        let n = (rows - r0).min(ROWS);
        let at = Rows {
            qp: qp.as_ptr().add(r0 * hd / 2),
            qscale: qscale.as_ptr().add(r0),
            o: scores.as_mut_ptr().add(r0 * stride),
            stride,
        };
        match (n, bs == 16) {
            (4, true) => scores_tile512::<4, true>(k, ks, hd, bs, at),
            (3, true) => scores_tile512::<3, true>(k, ks, hd, bs, at),
            (2, true) => scores_tile512::<2, true>(k, ks, hd, bs, at),
            (_, true) => scores_tile512::<1, true>(k, ks, hd, bs, at),
            (4, false) => scores_tile512::<4, false>(k, ks, hd, bs, at),
            (3, false) => scores_tile512::<3, false>(k, ks, hd, bs, at),
            (2, false) => scores_tile512::<2, false>(k, ks, hd, bs, at),
            (_, false) => scores_tile512::<1, false>(k, ks, hd, bs, at),
        }
        r0 += n;
    }
}

/// Where a tile of rows reads its quantized queries and scales and writes its scores.
#[derive(Clone, Copy)]
struct Rows {
    qp: *const i32,
    qscale: *const f32,
    o: *mut f32,
    stride: usize,
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn scores_tile512<const R: usize, const CONTIG: bool>(
    k: &[i8],
    ks: &[f16],
    hd: usize,
    bs: usize,
    at: Rows,
) {
    let kp = k.as_ptr();
    let hd2 = hd / 2;
    let idx = interleave_index();
    for t0 in (0..bs).step_by(16) {
        // Two accumulators a row (even and odd pairs of dimensions): twice the independent
        // chains; their sum is the same integer.
        let mut acc = [[_mm512_setzero_si512(); 2]; R];
        for j in (0..hd2).step_by(2) {
            let k0 = pairs16::<CONTIG>(kp.add(2 * j * bs + t0), bs, idx);
            let k1 = pairs16::<CONTIG>(kp.add((2 * j + 2) * bs + t0), bs, idx);
            for (r, a) in acc.iter_mut().enumerate() {
                let q0 = _mm512_set1_epi32(*at.qp.add(r * hd2 + j));
                let q1 = _mm512_set1_epi32(*at.qp.add(r * hd2 + j + 1));
                a[0] = _mm512_dpwssd_epi32(a[0], k0, q0);
                a[1] = _mm512_dpwssd_epi32(a[1], k1, q1);
            }
        }
        let kscale = _mm512_cvtph_ps(_mm256_loadu_si256(ks.as_ptr().add(t0) as *const __m256i));
        for (r, a) in acc.iter().enumerate() {
            let sum = _mm512_cvtepi32_ps(_mm512_add_epi32(a[0], a[1]));
            let v = _mm512_mul_ps(
                _mm512_mul_ps(sum, kscale),
                _mm512_set1_ps(*at.qscale.add(r)),
            );
            _mm512_storeu_ps(at.o.add(r * at.stride + t0), v);
        }
    }
}

/// # Safety
/// AVX2, FMA and F16C; hd and bs multiples of 8; lengths as for `scores_avx512`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores_avx2(
    k: &[i8],
    ks: &[f16],
    qp: &[i32],
    qscale: &[f32],
    hd: usize,
    bs: usize,
    scores: &mut [f32],
    stride: usize,
) {
    let rows = qscale.len();
    let mut r0 = 0;
    while r0 < rows {
        let n = (rows - r0).min(ROWS);
        let at = Rows {
            qp: qp.as_ptr().add(r0 * hd / 2),
            qscale: qscale.as_ptr().add(r0),
            o: scores.as_mut_ptr().add(r0 * stride),
            stride,
        };
        match n {
            4 => scores_tile256::<4>(k, ks, hd, bs, at),
            3 => scores_tile256::<3>(k, ks, hd, bs, at),
            2 => scores_tile256::<2>(k, ks, hd, bs, at),
            _ => scores_tile256::<1>(k, ks, hd, bs, at),
        }
        r0 += n;
    }
}

/// Eight i16 pairs `(a[i], b[i])` from the 8 int8 values at `a` and at `a + dist`.
#[inline(always)]
unsafe fn pairs8(a: *const i8, dist: usize) -> __m256i {
    let x = _mm_unpacklo_epi8(
        _mm_loadl_epi64(a as *const __m128i),
        _mm_loadl_epi64(a.add(dist) as *const __m128i),
    );
    _mm256_cvtepi8_epi16(x)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_tile256<const R: usize>(k: &[i8], ks: &[f16], hd: usize, bs: usize, at: Rows) {
    let kp = k.as_ptr();
    let hd2 = hd / 2;
    for t0 in (0..bs).step_by(8) {
        let mut acc = [[_mm256_setzero_si256(); 2]; R];
        for j in (0..hd2).step_by(2) {
            let k0 = pairs8(kp.add(2 * j * bs + t0), bs);
            let k1 = pairs8(kp.add((2 * j + 2) * bs + t0), bs);
            for (r, a) in acc.iter_mut().enumerate() {
                let q0 = _mm256_set1_epi32(*at.qp.add(r * hd2 + j));
                let q1 = _mm256_set1_epi32(*at.qp.add(r * hd2 + j + 1));
                a[0] = _mm256_add_epi32(a[0], _mm256_madd_epi16(k0, q0));
                a[1] = _mm256_add_epi32(a[1], _mm256_madd_epi16(k1, q1));
            }
        }
        let kscale = _mm256_cvtph_ps(_mm_loadu_si128(ks.as_ptr().add(t0) as *const __m128i));
        for (r, a) in acc.iter().enumerate() {
            let sum = _mm256_cvtepi32_ps(_mm256_add_epi32(a[0], a[1]));
            let v = _mm256_mul_ps(
                _mm256_mul_ps(sum, kscale),
                _mm256_set1_ps(*at.qscale.add(r)),
            );
            _mm256_storeu_ps(at.o.add(r * at.stride + t0), v);
        }
    }
}

/// # Safety
/// AVX-512F/BW/VNNI, FMA and F16C; hd a multiple of 16; `v` holds `n_t` rounded up to even
/// positions of `hd` values, `wp` `rows * RUN / 2` pairs (`rows = wscale.len()`), `o`
/// `rows * hd`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
pub(super) unsafe fn pv_avx512(
    v: &[i8],
    n_t: usize,
    wp: &[i32],
    wscale: &[f32],
    hd: usize,
    o: &mut [f32],
) {
    let rows = wscale.len();
    if hd.is_multiple_of(64) {
        // 64 dimensions at a time: two positions' rows interleaved byte by byte in their
        // 128-bit lanes (no lane crossing), the sums' dimension order put back at the end.
        let mut r0 = 0;
        while r0 < rows {
            let n = (rows - r0).min(6);
            for g in (0..hd).step_by(64) {
                let (vg, wp, ws, o) = (
                    v.as_ptr().add(g),
                    wp.as_ptr().add(r0 * RUN / 2),
                    wscale.as_ptr().add(r0),
                    o.as_mut_ptr().add(r0 * hd + g),
                );
                match n {
                    6 => pv_tile64::<6>(vg, hd, n_t, wp, ws, o),
                    5 => pv_tile64::<5>(vg, hd, n_t, wp, ws, o),
                    4 => pv_tile64::<4>(vg, hd, n_t, wp, ws, o),
                    3 => pv_tile64::<3>(vg, hd, n_t, wp, ws, o),
                    2 => pv_tile64::<2>(vg, hd, n_t, wp, ws, o),
                    _ => pv_tile64::<1>(vg, hd, n_t, wp, ws, o),
                }
            }
            r0 += n;
        }
        return;
    }
    let mut r0 = 0;
    while r0 < rows {
        // Rows a tile holds: its accumulators and the position pair's values in registers.
        let per = if hd / 16 >= 8 { 2 } else { ROWS };
        let n = (rows - r0).min(per);
        let (wp, ws, o) = (
            wp.as_ptr().add(r0 * RUN / 2),
            wscale.as_ptr().add(r0),
            o.as_mut_ptr().add(r0 * hd),
        );
        match (hd / 16, n) {
            (4, 4) => pv_tile512::<4, 4>(v, n_t, wp, ws, o),
            (4, 3) => pv_tile512::<4, 3>(v, n_t, wp, ws, o),
            (4, 2) => pv_tile512::<4, 2>(v, n_t, wp, ws, o),
            (4, 1) => pv_tile512::<4, 1>(v, n_t, wp, ws, o),
            (8, 2) => pv_tile512::<8, 2>(v, n_t, wp, ws, o),
            (8, 1) => pv_tile512::<8, 1>(v, n_t, wp, ws, o),
            (2, 4) => pv_tile512::<2, 4>(v, n_t, wp, ws, o),
            (2, 3) => pv_tile512::<2, 3>(v, n_t, wp, ws, o),
            (2, 2) => pv_tile512::<2, 2>(v, n_t, wp, ws, o),
            (2, 1) => pv_tile512::<2, 1>(v, n_t, wp, ws, o),
            (1, 4) => pv_tile512::<1, 4>(v, n_t, wp, ws, o),
            (1, 3) => pv_tile512::<1, 3>(v, n_t, wp, ws, o),
            (1, 2) => pv_tile512::<1, 2>(v, n_t, wp, ws, o),
            (1, 1) => pv_tile512::<1, 1>(v, n_t, wp, ws, o),
            (d16, _) => {
                // Other widths: one register of one row at a time.
                let idx = interleave_index();
                for r in 0..n {
                    for j in 0..d16 {
                        let mut a = _mm512_setzero_si512();
                        for tp in 0..n_t.div_ceil(2) {
                            let vv =
                                pairs16::<false>(v.as_ptr().add(2 * tp * hd + 16 * j), hd, idx);
                            a = _mm512_dpwssd_epi32(
                                a,
                                vv,
                                _mm512_set1_epi32(*wp.add(r * RUN / 2 + tp)),
                            );
                        }
                        let op = o.add(r * hd + 16 * j);
                        let x = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(a),
                            _mm512_set1_ps(*ws.add(r)),
                            _mm512_loadu_ps(op),
                        );
                        _mm512_storeu_ps(op, x);
                    }
                }
            }
        }
        r0 += n;
    }
}

/// `R` rows (`hd` outputs apart) of 64 dimensions from `v` (rows `hd` apart): for each pair of
/// positions, `vpunpck{l,h}bw` interleave their rows within 128-bit lanes, so accumulator j
/// holds dimensions `{0..8, 16..24} + 8 (j / 2) + 32 (j % 2)`; the sums are put back in order
/// (`vshufi64x2`) before the one multiply-add into the output.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn pv_tile64<const R: usize>(
    v: *const i8,
    hd: usize,
    n_t: usize,
    wp: *const i32,
    ws: *const f32,
    o: *mut f32,
) {
    let mut acc = [[_mm512_setzero_si512(); 4]; R];
    for tp in 0..n_t.div_ceil(2) {
        let a = _mm512_loadu_si512(v.add(2 * tp * hd) as *const _);
        let b = _mm512_loadu_si512(v.add((2 * tp + 1) * hd) as *const _);
        let (lo, hi) = (_mm512_unpacklo_epi8(a, b), _mm512_unpackhi_epi8(a, b));
        let vv = [
            _mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo)),
            _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(lo)),
            _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi)),
            _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(hi)),
        ];
        for (r, a) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_epi32(*wp.add(r * RUN / 2 + tp));
            for j in 0..4 {
                a[j] = _mm512_dpwssd_epi32(a[j], vv[j], w);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        // a[0]: dims 0..8, 16..24; a[2]: 8..16, 24..32; a[1]: 32..40, 48..56; a[3]: 40..48, 56..64.
        let ordered = [
            _mm512_shuffle_i64x2::<0b01_00_01_00>(a[0], a[2]),
            _mm512_shuffle_i64x2::<0b11_10_11_10>(a[0], a[2]),
            _mm512_shuffle_i64x2::<0b01_00_01_00>(a[1], a[3]),
            _mm512_shuffle_i64x2::<0b11_10_11_10>(a[1], a[3]),
        ];
        let s = _mm512_set1_ps(*ws.add(r));
        for (j, x) in ordered.iter().enumerate() {
            let op = o.add(r * hd + 16 * j);
            _mm512_storeu_ps(
                op,
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(*x), s, _mm512_loadu_ps(op)),
            );
        }
    }
}

/// `R` rows of `D` registers (hd = 16 D): the integer sums over the run's position pairs, then
/// one multiply-add into each output register.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn pv_tile512<const D: usize, const R: usize>(
    v: &[i8],
    n_t: usize,
    wp: *const i32,
    ws: *const f32,
    o: *mut f32,
) {
    let hd = D * 16;
    let idx = interleave_index();
    let mut acc = [[_mm512_setzero_si512(); D]; R];
    for tp in 0..n_t.div_ceil(2) {
        let row = v.as_ptr().add(2 * tp * hd);
        let mut vv = [_mm512_setzero_si512(); D];
        for (j, x) in vv.iter_mut().enumerate() {
            *x = pairs16::<false>(row.add(16 * j), hd, idx);
        }
        for (r, a) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_epi32(*wp.add(r * RUN / 2 + tp));
            for j in 0..D {
                a[j] = _mm512_dpwssd_epi32(a[j], vv[j], w);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let s = _mm512_set1_ps(*ws.add(r));
        for (j, x) in a.iter().enumerate() {
            let op = o.add(r * hd + 16 * j);
            _mm512_storeu_ps(
                op,
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(*x), s, _mm512_loadu_ps(op)),
            );
        }
    }
}

/// # Safety
/// AVX2, FMA and F16C; hd a multiple of 8; lengths as for `pv_avx512`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pv_avx2(
    v: &[i8],
    n_t: usize,
    wp: &[i32],
    wscale: &[f32],
    hd: usize,
    o: &mut [f32],
) {
    // Per row, 8 registers (64 dimensions) at a time.
    for (r, &s) in wscale.iter().enumerate() {
        for d0 in (0..hd).step_by(64) {
            let nreg = (hd - d0).min(64) / 8;
            let mut acc = [_mm256_setzero_si256(); 8];
            for tp in 0..n_t.div_ceil(2) {
                let w = _mm256_set1_epi32(wp[r * RUN / 2 + tp]);
                let row = v.as_ptr().add(2 * tp * hd + d0);
                for (j, a) in acc[..nreg].iter_mut().enumerate() {
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(pairs8(row.add(8 * j), hd), w));
                }
            }
            let sv = _mm256_set1_ps(s);
            for (j, a) in acc[..nreg].iter().enumerate() {
                let op = o.as_mut_ptr().add(r * hd + d0 + 8 * j);
                _mm256_storeu_ps(
                    op,
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(*a), sv, _mm256_loadu_ps(op)),
                );
            }
        }
    }
}

/// `quantize_weights` on AVX-512, the same bits: None where the portable one must decide (a
/// weight NaN, or all zero or not finite).
///
/// # Safety
/// AVX-512F/BW/VL and F16C; `p.len()` at most `RUN`, `vs` as long, `out` `RUN / 2` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
pub(super) unsafe fn quantize_weights_avx512(
    p: &[f32],
    vs: &[f16],
    out: &mut [i32],
) -> Option<f32> {
    let n = p.len();
    assert!(n <= RUN && vs.len() >= n && out.len() >= RUN / 2);
    let mut w = [_mm512_setzero_ps(); RUN / 16];
    let mut m = _mm512_setzero_ps();
    for (c, wc) in w.iter_mut().enumerate().take(n.div_ceil(16)) {
        let left = n - 16 * c;
        let mask: __mmask16 = if left >= 16 {
            0xffff
        } else {
            (1u16 << left) - 1
        };
        let pv = _mm512_maskz_loadu_ps(mask, p.as_ptr().add(16 * c));
        let sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
            mask,
            vs.as_ptr().add(16 * c) as *const i16,
        ));
        *wc = _mm512_mul_ps(pv, sv);
        if _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(*wc, *wc) != 0 {
            return None;
        }
        m = _mm512_max_ps(m, _mm512_abs_ps(*wc));
    }
    let amax = _mm512_reduce_max_ps(m);
    if amax == 0.0 || !amax.is_finite() {
        return None;
    }
    let inv = _mm512_set1_ps(32767.0 / amax);
    let (hi, lo) = (_mm512_set1_epi32(32767), _mm512_set1_epi32(-32767));
    for (c, wc) in w.iter().enumerate() {
        // `vcvtps2dq` rounds to nearest even (the default rounding mode), as `round_ties_even`.
        let q = _mm512_cvtps_epi32(_mm512_mul_ps(*wc, inv));
        let q = _mm512_max_epi32(_mm512_min_epi32(q, hi), lo);
        _mm256_storeu_si256(
            out.as_mut_ptr().add(8 * c) as *mut __m256i,
            _mm512_cvtepi32_epi16(q),
        );
    }
    Some(amax / 32767.0)
}

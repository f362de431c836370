//! Scans over a row of logits, shared by the sampler and the CPU backend's device greedy pick so
//! both give the same token and the same log-probability bit for bit: sanitising (NaN -> -inf,
//! +inf -> `f32::MAX`, nothing finite -> uniform), the log-normaliser, and the argmax (lowest id
//! on ties). The backend reads values sanitised on the fly instead of writing a sanitised copy;
//! both go through the same generic scan. Each is compiled for AVX-512 (or else AVX2) when the
//! CPU has it; the arithmetic is the same on every path (the exponential's fused multiply-adds are
//! one rounding each everywhere, and no other operation is fused).

use super::vecmath::exp_approx;
#[cfg(target_arch = "x86_64")]
use super::vecmath::exp_approx_avx512;

/// `sanitize`, then `log_sum_exp`, compiled for the widest vector unit present (the scans over
/// the vocabulary are a visible part of a decode step). Same results on every path.
pub fn sanitize_and_log_norm(logits: &mut [f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { sanitize_and_log_norm_avx512(logits) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { sanitize_and_log_norm_avx2(logits) };
    }
    sanitize(logits);
    log_sum_exp(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sanitize_and_log_norm_avx2(logits: &mut [f32]) -> f64 {
    sanitize(logits);
    log_sum_exp(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sanitize_and_log_norm_avx512(logits: &mut [f32]) -> f64 {
    sanitize(logits);
    log_sum_exp(logits)
}

/// `argmax`, compiled for the widest vector unit present.
pub fn fast_argmax(logits: &[f32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { argmax_avx512(logits) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { argmax_avx2(logits) };
    }
    argmax(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn argmax_avx2(logits: &[f32]) -> u32 {
    argmax(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn argmax_avx512(logits: &[f32]) -> u32 {
    argmax(logits)
}

/// NaN -> -inf, +inf -> f32::MAX; if nothing is finite, make every logit 0 (uniform).
#[inline(always)]
pub fn sanitize(logits: &mut [f32]) {
    let mut any_finite = false;
    for x in logits.iter_mut() {
        let v = *x;
        let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
        let v = if v == f32::INFINITY { f32::MAX } else { v };
        *x = v;
        any_finite |= v != f32::NEG_INFINITY;
    }
    if !any_finite {
        logits.fill(0.0);
    }
}

/// Lanes of the vectorizable scans.
const SCAN_LANES: usize = 16;

/// log(sum(exp(logits))), max-subtracted and summed in f64. Needs NaN-free logits with a finite
/// maximum.
#[inline(always)]
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    log_sum_exp_of(logits, |x| x).1
}

/// The maximum of `read(x)` over `logits` and the log-normaliser of those values: the one
/// arithmetic behind `log_sum_exp` (`read` the identity) and `max_logprob_sanitized` (`read`
/// sanitising each value as it is read).
#[inline(always)]
fn log_sum_exp_of(logits: &[f32], read: impl Fn(f32) -> f32) -> (f32, f64) {
    // Lane-wise maximum with plain comparisons (no NaN here), so it vectorizes.
    let mut lane_max = [f32::NEG_INFINITY; SCAN_LANES];
    let mut chunks = logits.chunks_exact(SCAN_LANES);
    for c in &mut chunks {
        for j in 0..SCAN_LANES {
            let v = read(c[j]);
            lane_max[j] = if v > lane_max[j] { v } else { lane_max[j] };
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .map(|&x| read(x))
        .chain(lane_max.iter().copied())
        .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m });
    // A polynomial exp and eight f64 partial sums.
    let mut lanes = [0f64; 8];
    let mut chunks = logits.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            lanes[j] += exp_approx(read(c[j]) - max) as f64;
        }
    }
    let mut sum: f64 = lanes.iter().sum();
    for &x in chunks.remainder() {
        sum += exp_approx(read(x) - max) as f64;
    }
    (max, max as f64 + sum.ln())
}

/// A value as `sanitize` leaves it (NaN -> -inf, +inf -> f32::MAX).
#[inline(always)]
fn sanitized(v: f32) -> f32 {
    let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
    if v == f32::INFINITY {
        f32::MAX
    } else {
        v
    }
}

/// `fast_argmax` of the row as `sanitize` would leave it, without writing it: the same token.
pub fn argmax_sanitized(logits: &[f32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { argmax_sanitized_avx512(logits) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { argmax_sanitized_avx2(logits) };
    }
    argmax_of(logits, sanitized)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn argmax_sanitized_avx2(logits: &[f32]) -> u32 {
    argmax_of(logits, sanitized)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn argmax_sanitized_avx512(logits: &[f32]) -> u32 {
    argmax_of(logits, sanitized)
}

/// The log-probability the sampler reports for the greedy pick of this row (raw logits, no
/// penalties), without writing the row: bit for bit `logprob(x[pick], sanitize_and_log_norm(x))`.
pub fn max_logprob_sanitized(logits: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { max_logprob_sanitized_avx512(logits) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { max_logprob_sanitized_avx2(logits) };
    }
    max_logprob_body(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn max_logprob_sanitized_avx2(logits: &[f32]) -> f32 {
    max_logprob_body(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn max_logprob_sanitized_avx512(logits: &[f32]) -> f32 {
    max_logprob_body(logits)
}

#[inline(always)]
fn max_logprob_body(logits: &[f32]) -> f32 {
    let (max, log_norm) = log_sum_exp_of(logits, sanitized);
    if max == f32::NEG_INFINITY {
        // Nothing finite: `sanitize` makes the row uniform (all zeros).
        let zeros = vec![0f32; logits.len()];
        return logprob(0.0, log_sum_exp(&zeros));
    }
    logprob(max, log_norm)
}

/// `(argmax_sanitized(row), max_logprob_sanitized(row))` bit for bit, in two passes over the
/// row where the CPU has AVX-512 (the lane maxima are the argmax's lane bests, so one pass finds
/// both; the second sums the exponentials) instead of three.
pub fn pick_sanitized(logits: &[f32]) -> (u32, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { pick_sanitized_avx512(logits) };
    }
    (argmax_sanitized(logits), max_logprob_sanitized(logits))
}

/// The explicit AVX-512 form of `argmax_of` + `log_sum_exp_of` with sanitising reads: the same
/// comparisons lane by lane (`vmaxps` keeps the old value unless the new one is greater, as
/// `if v > m`), the same merges in the same order, the same exponential (fused multiply-adds,
/// as the scalar code), the same eight f64 partial sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pick_sanitized_avx512(logits: &[f32]) -> (u32, f32) {
    use std::arch::x86_64::*;
    let len = logits.len();
    let full = len / SCAN_LANES * SCAN_LANES;
    let p = logits.as_ptr();
    let read = |i: usize| {
        // SAFETY (for every caller below): i + 16 <= full <= len, inside the row.
        let v = _mm512_loadu_ps(p.add(i));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        let v = _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(f32::NEG_INFINITY));
        let inf = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(v, _mm512_set1_ps(f32::INFINITY));
        _mm512_mask_mov_ps(v, inf, _mm512_set1_ps(f32::MAX))
    };
    // Pass 1: lane bests (values and first indices); the values are also the lane maxima.
    // Chunk c goes to accumulator c % 4 (four independent compare chains); the four are then
    // merged lane by lane, greater value first, lower index on ties, which gives each lane's
    // first occurrence of its maximum: exactly the single chain's lane bests.
    let mut best_v = [_mm512_set1_ps(f32::NEG_INFINITY); 4];
    let mut best_i = [_mm512_setzero_si512(); 4];
    let mut idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let step = _mm512_set1_epi32(SCAN_LANES as i32);
    let mut i = 0;
    let mut a = 0;
    while i < full {
        let v = read(i);
        let better = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, best_v[a]);
        best_v[a] = _mm512_mask_mov_ps(best_v[a], better, v);
        best_i[a] = _mm512_mask_mov_epi32(best_i[a], better, idx);
        idx = _mm512_add_epi32(idx, step);
        i += SCAN_LANES;
        a = (a + 1) % 4;
    }
    let (mut bv, mut bi) = (best_v[0], best_i[0]);
    for (v, ix) in best_v[1..].iter().zip(&best_i[1..]) {
        let greater = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(*v, bv);
        let tie = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(*v, bv) & _mm512_cmplt_epu32_mask(*ix, bi);
        bv = _mm512_mask_mov_ps(bv, greater | tie, *v);
        bi = _mm512_mask_mov_epi32(bi, greater | tie, *ix);
    }
    let (best_v, best_i) = (bv, bi);
    let mut lane_v = [0f32; SCAN_LANES];
    let mut lane_i = [0u32; SCAN_LANES];
    _mm512_storeu_ps(lane_v.as_mut_ptr(), best_v);
    _mm512_storeu_si512(lane_i.as_mut_ptr() as *mut _, best_i);
    let rest = &logits[full..];
    // The argmax merge, as `argmax_of`.
    let (mut v, mut id) = (f32::NEG_INFINITY, 0u32);
    for (&bv, &bi) in lane_v.iter().zip(&lane_i) {
        if bv > v || (bv == v && bi < id) {
            (v, id) = (bv, bi);
        }
    }
    for (k, &x) in rest.iter().enumerate() {
        let x = sanitized(x);
        if x > v {
            (v, id) = (x, (full + k) as u32);
        }
    }
    if v == f32::NEG_INFINITY {
        id = 0;
    }
    // The maximum, as `log_sum_exp_of` folds it: the remainder first, then the lanes.
    let max = rest
        .iter()
        .map(|&x| sanitized(x))
        .chain(lane_v.iter().copied())
        .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m });
    if max == f32::NEG_INFINITY {
        // Nothing finite: the uniform row's log-probability, as `max_logprob_body`.
        return (id, max_logprob_body(logits));
    }
    // Pass 2: exponentials into eight f64 lanes, values 0..8 then 8..16 of each chunk of 16
    // (the scalar code's chunks of 8 in order).
    let mut acc = _mm512_setzero_pd();
    let vmax = _mm512_set1_ps(max);
    let mut i = 0;
    while i < full {
        let e = exp_approx_avx512(_mm512_sub_ps(read(i), vmax));
        acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e)));
        acc = _mm512_add_pd(acc, _mm512_cvtps_pd(hi));
        i += SCAN_LANES;
    }
    let mut lanes = [0f64; 8];
    _mm512_storeu_pd(lanes.as_mut_ptr(), acc);
    // A last chunk of 8 (when the length leaves 8..15 over), then the scalar remainder.
    let mut k = full;
    if len - full >= 8 {
        for (j, lane) in lanes.iter_mut().enumerate() {
            *lane += exp_approx(sanitized(logits[k + j]) - max) as f64;
        }
        k += 8;
    }
    let mut sum: f64 = lanes.iter().sum();
    for &x in &logits[k..] {
        sum += exp_approx(sanitized(x) - max) as f64;
    }
    (id, logprob(max, max as f64 + sum.ln()))
}

/// `logit - log_norm`, rounded to f32: a token's log-probability.
pub fn logprob(logit: f32, log_norm: f64) -> f32 {
    (logit as f64 - log_norm) as f32
}

/// The best token, lowest id on ties (NaN-free logits). Lane-wise bests with strict comparisons
/// keep each lane's lowest id; the lanes are then merged the same way.
#[inline(always)]
pub fn argmax(logits: &[f32]) -> u32 {
    argmax_of(logits, |x| x)
}

#[inline(always)]
fn argmax_of(logits: &[f32], read: impl Fn(f32) -> f32) -> u32 {
    let mut best_v = [f32::NEG_INFINITY; SCAN_LANES];
    let mut best_i = [0u32; SCAN_LANES];
    let mut chunks = logits.chunks_exact(SCAN_LANES);
    let mut base = 0u32;
    for c in &mut chunks {
        for j in 0..SCAN_LANES {
            let v = read(c[j]);
            let better = v > best_v[j];
            best_v[j] = if better { v } else { best_v[j] };
            best_i[j] = if better { base + j as u32 } else { best_i[j] };
        }
        base += SCAN_LANES as u32;
    }
    let (mut v, mut i) = (f32::NEG_INFINITY, 0u32);
    let full = base as usize;
    for (&bv, &bi) in best_v.iter().zip(&best_i) {
        if bv > v || (bv == v && bi < i) {
            (v, i) = (bv, bi);
        }
    }
    for (k, &x) in chunks.remainder().iter().enumerate() {
        let x = read(x);
        if x > v {
            (v, i) = (x, (full + k) as u32);
        }
    }
    // All -inf: the lowest id, like a plain scan.
    if v == f32::NEG_INFINITY {
        return 0;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A xorshift64 stream from `seed`.
    fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    /// The vectorized scans equal plain ones: argmax (lowest id on ties, coarse values so ties
    /// are common, lengths around the lane count) and the log-normalizer against an f64
    /// reference.
    #[test]
    fn vocabulary_scans_match_plain_scans() {
        let mut next = xorshift(0x1234_5678_9abc_def0u64);
        for len in [1usize, 5, 15, 16, 17, 31, 33, 100, 1000, 49_152] {
            for _ in 0..20 {
                let l: Vec<f32> = (0..len).map(|_| (next() % 7) as f32 - 3.0).collect();
                let mut want = 0;
                for (i, &x) in l.iter().enumerate() {
                    if x > l[want] {
                        want = i;
                    }
                }
                assert_eq!(fast_argmax(&l) as usize, want, "len {len}");
                assert_eq!(argmax(&l) as usize, want, "len {len}");
                let mut m = l.clone();
                let got = sanitize_and_log_norm(&mut m);
                let mut plain = l.clone();
                sanitize(&mut plain);
                assert_eq!(
                    got.to_bits(),
                    log_sum_exp(&plain).to_bits(),
                    "len {len}: the vector path's normaliser is the plain one's bit for bit"
                );
                let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let reference = max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
                assert!(
                    (got - reference).abs() < 1e-5,
                    "len {len}: {got} vs {reference}"
                );
            }
        }
        assert_eq!(fast_argmax(&[f32::NEG_INFINITY; 40]), 0);
    }

    /// The two-pass pick gives the three-pass scans' token and log-probability bit for bit:
    /// lengths with every remainder shape, specials sprinkled in, rows with nothing finite, ties,
    /// and spreads wide enough to reach the exponential's clamp.
    #[test]
    fn two_pass_pick_equals_the_separate_scans() {
        let mut next = xorshift(0x5eed_1234_abcd_0042u64);
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX];
        for len in [1usize, 7, 8, 15, 16, 17, 24, 31, 40, 100, 4099, 49_152] {
            for case in 0..24 {
                let spread = [0.37f32, 3.7, 37.0][case % 3];
                let row: Vec<f32> = (0..len)
                    .map(|_| match next() % 97 {
                        0..=3 if case % 4 == 1 => specials[(next() % 4) as usize],
                        _ if case == 23 => f32::NAN,
                        v if case % 4 == 2 => (v % 5) as f32,
                        v => (v as f32 - 48.0) * spread,
                    })
                    .collect();
                let (id, lp) = pick_sanitized(&row);
                assert_eq!(id, argmax_sanitized(&row), "len {len} case {case}");
                assert_eq!(
                    lp.to_bits(),
                    max_logprob_sanitized(&row).to_bits(),
                    "len {len} case {case}: {lp} vs {}",
                    max_logprob_sanitized(&row)
                );
            }
        }
    }

    /// The reads that sanitise on the fly give what the sampler gets from a sanitised copy, bit
    /// for bit, with NaN and infinities sprinkled in and rows with nothing finite.
    #[test]
    fn sanitising_reads_equal_a_sanitised_copy() {
        let mut next = xorshift(0x0bad_cafe_f00d_1234u64);
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX];
        for len in [1usize, 7, 16, 17, 100, 4099] {
            for case in 0..30 {
                let row: Vec<f32> = (0..len)
                    .map(|_| match next() % 97 {
                        0..=3 if case % 3 != 0 => specials[(next() % 4) as usize],
                        _ if case == 29 => f32::NAN,
                        v => (v as f32 - 48.0) * 0.37,
                    })
                    .collect();
                let mut copy = row.clone();
                let log_norm = sanitize_and_log_norm(&mut copy);
                let token = fast_argmax(&copy);
                assert_eq!(argmax_sanitized(&row), token, "len {len} case {case}");
                assert_eq!(argmax_of(&row, sanitized), token);
                let want = logprob(copy[token as usize], log_norm);
                assert_eq!(
                    max_logprob_sanitized(&row).to_bits(),
                    want.to_bits(),
                    "len {len} case {case}: {} vs {want}",
                    max_logprob_sanitized(&row)
                );
                assert_eq!(max_logprob_body(&row).to_bits(), want.to_bits());
            }
        }
        // +inf ties with f32::MAX (the lower id wins); nothing finite is uniform.
        assert_eq!(argmax_sanitized(&[1.0, f32::MAX, f32::INFINITY]), 1);
        assert_eq!(argmax_sanitized(&[f32::NAN, f32::NAN]), 0);
        let lp = max_logprob_sanitized(&[f32::NAN, f32::NEG_INFINITY]);
        assert!((lp + 2f32.ln()).abs() < 1e-6, "{lp}");
    }
}

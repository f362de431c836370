//! Paged attention over an int8 cache (`KvDtype::Int8`): K and V in the f16 cache's layouts, one
//! byte a value, with one f16 scale per token and KV head for K and one for V (`I8Cache`). A
//! score is `(q . k_int8) * k_scale * softmax_scale` (the dot product summed over the head's
//! dimensions in order, from zero), an output `sum_t (p_t * v_scale_t) * v_int8_t` (positions in
//! order). The AVX-512 and AVX2 inner loops read the int8 values straight into their
//! multiply-adds (`vpmovsxbd` + `vcvtdq2ps`) and do exactly the portable loops' arithmetic, so
//! every instruction set gives the portable path's bits. The softmax is the f16 cache's.

use super::task::{exp_lane_sums, normalise_through_f16, scale_lane_max, Task};
use super::*;

/// One layer of an int8 cache, as the kernels read it: the K and V values from the layer's
/// first block (the f16 cache's layouts and block stride, in bytes), and the K and V scales
/// from theirs (`slay`: `head_dim` 1, one scale per token and KV head).
#[derive(Debug, Clone, Copy)]
pub struct I8Cache<'a> {
    pub k: &'a [i8],
    pub v: &'a [i8],
    pub ks: &'a [f16],
    pub vs: &'a [f16],
    pub slay: KvLayout,
}

/// Quantizes `x` into `q` (same length) with one scale: `scale = f16(max |x| / 127)` (at most
/// f16's largest), `q = round(x / scale)` clamped to ±127 (0 where the scale is 0). Returns the
/// scale; a value is read back as `q * scale`.
pub fn quantize_row_i8(x: &[f32], q: &mut [i8]) -> f16 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = f16::from_f32((amax / 127.0).min(f16::MAX.to_f32()));
    let s = scale.to_f32();
    if s == 0.0 || !s.is_finite() {
        q.fill(0);
        return f16::ZERO;
    }
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (v / s).round().clamp(-127.0, 127.0) as i8;
    }
    scale
}

/// `out[i] = q[i] * scale`.
pub fn dequantize_row_i8(q: &[i8], scale: f16, out: &mut [f32]) {
    let s = scale.to_f32();
    for (o, &v) in out.iter_mut().zip(q) {
        *o = v as f32 * s;
    }
}

/// Which inner loops a task takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kern {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// Computes one task over an int8 cache into `s.o` and the rows' softmax statistics (what
/// `run_task` leaves for an f16 cache).
pub(super) fn run_task_i8(t: &Task, c: &I8Cache, s: &mut Scratch) {
    #[cfg(target_arch = "x86_64")]
    let kern = {
        let (hd, bs) = (t.p.lay.head_dim, t.p.lay.block_size);
        match t.isa {
            Isa::Avx512Vnni if hd % 16 == 0 && bs % 16 == 0 => Kern::Avx512,
            Isa::Avx512Vnni | Isa::Avx2 if hd % 8 == 0 && bs % 8 == 0 => Kern::Avx2,
            _ => Kern::Scalar,
        }
    };
    // The int8 loops have no NEON form yet: the portable one serves every other target.
    #[cfg(not(target_arch = "x86_64"))]
    let kern = Kern::Scalar;
    match kern {
        // SAFETY: the isa passed `Isa::checked` (in `paged_attention`): AVX-512 VNNI includes
        // AVX-512F/BW, F16C and FMA.
        #[cfg(target_arch = "x86_64")]
        Kern::Avx512 => unsafe { body_avx512(t, c, s) },
        // SAFETY: AVX2 (or AVX-512) was checked, with FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Kern::Avx2 => unsafe { body_avx2(t, c, s) },
        Kern::Scalar => body(t, c, s, Kern::Scalar),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn body_avx512(t: &Task, c: &I8Cache, s: &mut Scratch) {
    body(t, c, s, Kern::Avx512)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn body_avx2(t: &Task, c: &I8Cache, s: &mut Scratch) {
    body(t, c, s, Kern::Avx2)
}

#[inline(always)]
fn body(t: &Task, c: &I8Cache, s: &mut Scratch, kern: Kern) {
    let lay = t.p.lay;
    let (hd, bs) = (lay.head_dim, lay.block_size);
    let group = t.p.n_heads / lay.n_kv_heads;
    let ng = t.g1 - t.g0;
    let n_tok = t.t1 - t.t0;
    let rows = n_tok * ng;
    let max_ctx = (t.seq.start_pos + t.t1).min(t.cap);
    let n_blocks = max_ctx.div_ceil(bs);
    let span = n_blocks * bs;
    s.q.resize(rows * hd, 0.0);
    s.scores.resize(rows * span, 0.0);
    s.o.resize(rows * hd, 0.0);
    s.vbuf.resize(bs, 0.0);
    // Queries rounded through f16, as for the f16 cache.
    for tok in 0..n_tok {
        let qrow = &t.q[(t.seq.q_row + t.t0 + tok) * t.ldq..];
        for g in t.g0..t.g1 {
            let h = t.kvh * group + g;
            let r = tok * ng + g - t.g0;
            s.q[r * hd..(r + 1) * hd].copy_from_slice(&qrow[h * hd..(h + 1) * hd]);
        }
    }
    round_through_f16(t.isa, &mut s.q);
    let ctx_of = |r: usize| (t.seq.start_pos + t.t0 + r / ng + 1).min(t.cap);
    let lo_of = |r: usize| {
        t.p.window.map_or(0, |w| {
            (t.seq.start_pos + t.t0 + r / ng + 1).saturating_sub(w)
        })
    };
    s.row_max.resize(rows, 0.0);
    s.row_sum.resize(rows, 0.0);
    let k_block = |bi: usize| {
        let blk = t.seq.block_table[bi] as usize;
        let k0 = lay.k_at(blk, t.kvh, 0, 0);
        let s0 = c.slay.k_at(blk, t.kvh, 0, 0);
        (&c.k[k0..k0 + hd * bs], &c.ks[s0..s0 + bs])
    };
    let v_block = |bi: usize| {
        let blk = t.seq.block_table[bi] as usize;
        let v0 = lay.v_at(blk, t.kvh, 0, 0);
        let s0 = c.slay.v_at(blk, t.kvh, 0, 0);
        (&c.v[v0..v0 + bs * hd], &c.vs[s0..s0 + bs])
    };
    // The blocks lie far apart (each holds every layer): the K of blocks ahead and the V of
    // the block scored now are asked for before use, as for the f16 cache.
    #[cfg(target_arch = "x86_64")]
    let ahead = super::task::prefetch_blocks();
    #[cfg(target_arch = "x86_64")]
    let prefetch = |bi: usize, k: bool| {
        if bi < n_blocks {
            let p = if k { k_block(bi).0 } else { v_block(bi).0 };
            crate::kernels::attention_avx512::prefetch(p.as_ptr() as *const u8, hd * bs);
        }
    };
    #[cfg(target_arch = "x86_64")]
    for bi in 0..ahead {
        prefetch(bi, true);
    }
    for bi in 0..n_blocks {
        #[cfg(target_arch = "x86_64")]
        {
            prefetch(bi + ahead, true);
            prefetch(bi, false);
        }
        let (k, ks) = k_block(bi);
        let out = &mut s.scores[bi * bs..(rows - 1) * span + (bi + 1) * bs];
        block_scores(kern, k, ks, &s.q[..rows * hd], hd, bs, out, span, t.p.scale);
    }
    // Softmax per row over its own context (the scores are scaled already: `fast` only reads
    // the maxima, the portable pass multiplies by 1, exactly).
    let fast = {
        #[cfg(target_arch = "x86_64")]
        {
            kern == Kern::Avx512
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    };
    for r in 0..rows {
        let (lo, ctx) = (lo_of(r), ctx_of(r));
        s.scores[r * span..r * span + lo].fill(0.0);
        let sc = &mut s.scores[r * span + lo..r * span + ctx];
        let whole = sc.len() / 16 * 16;
        let lane_max = scale_lane_max(fast, &mut sc[..whole], 1.0);
        let mut max = lane_max
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
        for &v in &sc[whole..] {
            if v > max {
                max = v;
            }
        }
        let lanes = exp_lane_sums(fast, &mut sc[..whole], max);
        let mut sum: f64 = lanes.iter().map(|&v| v as f64).sum();
        for v in &mut sc[whole..] {
            *v = exp_approx(*v - max);
            sum += *v as f64;
        }
        s.row_max[r] = max;
        s.row_sum[r] = sum;
        let inv = (1.0 / sum) as f32;
        normalise_through_f16(fast, t.isa, sc, inv);
        s.scores[r * span + ctx..(r + 1) * span].fill(0.0);
    }
    // The V sum: each probability times its position's scale, then times the int8 values.
    s.o.fill(0.0);
    for bi in 0..n_blocks {
        let (v, vs) = v_block(bi);
        let n_t = (max_ctx - bi * bs).min(bs);
        let p = &s.scores[bi * bs..(rows - 1) * span + bi * bs + n_t];
        block_pv(kern, v, vs, n_t, p, span, rows, hd, &mut s.o[..rows * hd]);
    }
}

/// `scores[r * stride + t] = ((q[r] . K[:, t]) * ks[t]) * scale` for `t < bs`, every row of `q`
/// (`hd` values each); `k` is one block of one KV head, `[hd][bs]`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn block_scores(
    kern: Kern,
    k: &[i8],
    ks: &[f16],
    q: &[f32],
    hd: usize,
    bs: usize,
    scores: &mut [f32],
    stride: usize,
    scale: f32,
) {
    let rows = q.len() / hd;
    assert!(k.len() >= hd * bs && ks.len() >= bs && scores.len() >= (rows - 1) * stride + bs);
    match kern {
        // SAFETY: `Kern::Avx512` is chosen only with AVX-512F/BW, FMA and F16C present and hd,
        // bs multiples of 16; the lengths are checked above.
        #[cfg(target_arch = "x86_64")]
        Kern::Avx512 => unsafe { simd::scores_avx512(k, ks, q, hd, bs, scores, stride, scale) },
        // SAFETY: AVX2, FMA and F16C present, hd and bs multiples of 8; lengths checked above.
        #[cfg(target_arch = "x86_64")]
        Kern::Avx2 => unsafe { simd::scores_avx2(k, ks, q, hd, bs, scores, stride, scale) },
        Kern::Scalar => {
            for (r, qr) in q.chunks_exact(hd).enumerate() {
                let out = &mut scores[r * stride..r * stride + bs];
                out.fill(0.0);
                for (d, &qd) in qr.iter().enumerate() {
                    for (o, &kv) in out.iter_mut().zip(&k[d * bs..(d + 1) * bs]) {
                        *o = qd.mul_add(kv as f32, *o);
                    }
                }
                for (o, s) in out.iter_mut().zip(ks) {
                    *o = (*o * s.to_f32()) * scale;
                }
            }
        }
    }
}

/// `o[r][d] += sum_{t < n_t} (p[r * stride + t] * vs[t]) * V[t][d]`, positions in order; `v` is
/// one block of one KV head, `[bs][hd]`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn block_pv(
    kern: Kern,
    v: &[i8],
    vs: &[f16],
    n_t: usize,
    p: &[f32],
    stride: usize,
    rows: usize,
    hd: usize,
    o: &mut [f32],
) {
    assert!(
        v.len() >= n_t * hd
            && vs.len() >= n_t
            && p.len() >= (rows - 1) * stride + n_t
            && o.len() >= rows * hd
    );
    match kern {
        // SAFETY: as for `block_scores`; lengths checked above.
        #[cfg(target_arch = "x86_64")]
        Kern::Avx512 => unsafe { simd::pv_avx512(v, vs, n_t, p, stride, rows, hd, o) },
        // SAFETY: as for `block_scores`; lengths checked above.
        #[cfg(target_arch = "x86_64")]
        Kern::Avx2 => unsafe { simd::pv_avx2(v, vs, n_t, p, stride, rows, hd, o) },
        Kern::Scalar => {
            for r in 0..rows {
                let or = &mut o[r * hd..(r + 1) * hd];
                for t in 0..n_t {
                    let pt = p[r * stride + t] * vs[t].to_f32();
                    for (x, &vv) in or.iter_mut().zip(&v[t * hd..(t + 1) * hd]) {
                        *x = pt.mul_add(vv as f32, *x);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use half::f16;

    /// Query rows scored together.
    const ROWS: usize = 4;

    /// # Safety
    /// AVX-512F/BW, FMA and F16C; hd and bs multiples of 16; `k` holds `hd * bs` values, `ks`
    /// `bs`, `scores` `(rows - 1) * stride + bs`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
    pub(super) unsafe fn scores_avx512(
        k: &[i8],
        ks: &[f16],
        q: &[f32],
        hd: usize,
        bs: usize,
        scores: &mut [f32],
        stride: usize,
        scale: f32,
    ) {
        let rows = q.len() / hd;
        let mut r0 = 0;
        while r0 < rows {
            let n = (rows - r0).min(ROWS);
            let (q, o) = (&q[r0 * hd..], scores.as_mut_ptr().add(r0 * stride));
            match n {
                4 => scores_tile512::<4>(k, ks, q, hd, bs, o, stride, scale),
                3 => scores_tile512::<3>(k, ks, q, hd, bs, o, stride, scale),
                2 => scores_tile512::<2>(k, ks, q, hd, bs, o, stride, scale),
                _ => scores_tile512::<1>(k, ks, q, hd, bs, o, stride, scale),
            }
            r0 += n;
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
    unsafe fn scores_tile512<const R: usize>(
        k: &[i8],
        ks: &[f16],
        q: &[f32],
        hd: usize,
        bs: usize,
        o: *mut f32,
        stride: usize,
        scale: f32,
    ) {
        let (kp, qp) = (k.as_ptr(), q.as_ptr());
        let sv = _mm512_set1_ps(scale);
        for t0 in (0..bs).step_by(16) {
            let mut acc = [_mm512_setzero_ps(); R];
            for d in 0..hd {
                let kv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    kp.add(d * bs + t0) as *const __m128i,
                )));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_set1_ps(*qp.add(r * hd + d)), kv, *a);
                }
            }
            let kscale = _mm512_cvtph_ps(_mm256_loadu_si256(ks.as_ptr().add(t0) as *const __m256i));
            for (r, a) in acc.iter().enumerate() {
                let v = _mm512_mul_ps(_mm512_mul_ps(*a, kscale), sv);
                _mm512_storeu_ps(o.add(r * stride + t0), v);
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
        q: &[f32],
        hd: usize,
        bs: usize,
        scores: &mut [f32],
        stride: usize,
        scale: f32,
    ) {
        let rows = q.len() / hd;
        let mut r0 = 0;
        while r0 < rows {
            let n = (rows - r0).min(ROWS);
            let (q, o) = (&q[r0 * hd..], scores.as_mut_ptr().add(r0 * stride));
            match n {
                4 => scores_tile256::<4>(k, ks, q, hd, bs, o, stride, scale),
                3 => scores_tile256::<3>(k, ks, q, hd, bs, o, stride, scale),
                2 => scores_tile256::<2>(k, ks, q, hd, bs, o, stride, scale),
                _ => scores_tile256::<1>(k, ks, q, hd, bs, o, stride, scale),
            }
            r0 += n;
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_tile256<const R: usize>(
        k: &[i8],
        ks: &[f16],
        q: &[f32],
        hd: usize,
        bs: usize,
        o: *mut f32,
        stride: usize,
        scale: f32,
    ) {
        let (kp, qp) = (k.as_ptr(), q.as_ptr());
        let sv = _mm256_set1_ps(scale);
        for t0 in (0..bs).step_by(8) {
            let mut acc = [_mm256_setzero_ps(); R];
            for d in 0..hd {
                let kv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    kp.add(d * bs + t0) as *const __m128i,
                )));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(*qp.add(r * hd + d)), kv, *a);
                }
            }
            let kscale = _mm256_cvtph_ps(_mm_loadu_si128(ks.as_ptr().add(t0) as *const __m128i));
            for (r, a) in acc.iter().enumerate() {
                let v = _mm256_mul_ps(_mm256_mul_ps(*a, kscale), sv);
                _mm256_storeu_ps(o.add(r * stride + t0), v);
            }
        }
    }

    /// The block's V scales widened (exact), up to `n_t`.
    #[inline(always)]
    fn widen(vs: &[f16], n_t: usize) -> [f32; 64] {
        let mut out = [0f32; 64];
        for (o, s) in out.iter_mut().zip(&vs[..n_t.min(64)]) {
            *o = s.to_f32();
        }
        out
    }

    /// # Safety
    /// AVX-512F/BW, FMA and F16C; hd a multiple of 16; lengths as `block_pv` checks them.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
    pub(super) unsafe fn pv_avx512(
        v: &[i8],
        vs: &[f16],
        n_t: usize,
        p: &[f32],
        stride: usize,
        rows: usize,
        hd: usize,
        o: &mut [f32],
    ) {
        if n_t > 64 {
            // Blocks of more than 64 positions: in runs of 64 (the same order of the sums).
            let mut t0 = 0;
            while t0 < n_t {
                let n = (n_t - t0).min(64);
                pv_avx512(&v[t0 * hd..], &vs[t0..], n, &p[t0..], stride, rows, hd, o);
                t0 += n;
            }
            return;
        }
        let vsf = widen(vs, n_t);
        let mut r0 = 0;
        while r0 < rows {
            let n = (rows - r0).min(ROWS);
            let (p, o) = (&p[r0 * stride..], &mut o[r0 * hd..]);
            match (hd / 16, n) {
                (4, 4) => pv_tile512::<4, 4>(v, &vsf, n_t, p, stride, o),
                (4, 3) => pv_tile512::<4, 3>(v, &vsf, n_t, p, stride, o),
                (4, 2) => pv_tile512::<4, 2>(v, &vsf, n_t, p, stride, o),
                (4, 1) => pv_tile512::<4, 1>(v, &vsf, n_t, p, stride, o),
                (8, 4) | (8, 3) => {
                    pv_tile512::<8, 2>(v, &vsf, n_t, p, stride, o);
                    let (p, o) = (&p[2 * stride..], &mut o[2 * hd..]);
                    if n == 4 {
                        pv_tile512::<8, 2>(v, &vsf, n_t, p, stride, o);
                    } else {
                        pv_tile512::<8, 1>(v, &vsf, n_t, p, stride, o);
                    }
                }
                (8, 2) => pv_tile512::<8, 2>(v, &vsf, n_t, p, stride, o),
                (8, 1) => pv_tile512::<8, 1>(v, &vsf, n_t, p, stride, o),
                (2, _) | (1, _) | (_, _) => {
                    // Other widths: one register of one row at a time.
                    for r in 0..n {
                        for d0 in (0..hd).step_by(16) {
                            let op = o.as_mut_ptr().add(r * hd + d0);
                            let mut a = _mm512_loadu_ps(op);
                            for (t, &s) in vsf[..n_t].iter().enumerate() {
                                let vv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                    v.as_ptr().add(t * hd + d0) as *const __m128i,
                                )));
                                let pt = _mm512_set1_ps(p[r * stride + t] * s);
                                a = _mm512_fmadd_ps(pt, vv, a);
                            }
                            _mm512_storeu_ps(op, a);
                        }
                    }
                }
            }
            r0 += n;
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
    unsafe fn pv_tile512<const D: usize, const R: usize>(
        v: &[i8],
        vsf: &[f32; 64],
        n_t: usize,
        p: &[f32],
        stride: usize,
        o: &mut [f32],
    ) {
        let hd = D * 16;
        let mut acc = [[_mm512_setzero_ps(); D]; R];
        for (r, a) in acc.iter_mut().enumerate() {
            for (j, x) in a.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(o.as_ptr().add(r * hd + j * 16));
            }
        }
        for (t, &s) in vsf[..n_t].iter().enumerate() {
            let mut vv = [_mm512_setzero_ps(); D];
            for (j, x) in vv.iter_mut().enumerate() {
                *x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    v.as_ptr().add(t * hd + j * 16) as *const __m128i,
                )));
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let pt = _mm512_set1_ps(*p.get_unchecked(r * stride + t) * s);
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

    /// # Safety
    /// AVX2, FMA and F16C; hd a multiple of 8; lengths as `block_pv` checks them.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn pv_avx2(
        v: &[i8],
        vs: &[f16],
        n_t: usize,
        p: &[f32],
        stride: usize,
        rows: usize,
        hd: usize,
        o: &mut [f32],
    ) {
        if n_t > 64 {
            let mut t0 = 0;
            while t0 < n_t {
                let n = (n_t - t0).min(64);
                pv_avx2(&v[t0 * hd..], &vs[t0..], n, &p[t0..], stride, rows, hd, o);
                t0 += n;
            }
            return;
        }
        let vsf = widen(vs, n_t);
        // Per row, 8 registers (64 dimensions) at a time.
        for r in 0..rows {
            for d0 in (0..hd).step_by(64) {
                let nreg = (hd - d0).min(64) / 8;
                let op = o.as_mut_ptr().add(r * hd + d0);
                let mut acc = [_mm256_setzero_ps(); 8];
                for (j, a) in acc[..nreg].iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(op.add(8 * j));
                }
                for (t, &s) in vsf[..n_t].iter().enumerate() {
                    let pt = _mm256_set1_ps(p[r * stride + t] * s);
                    let vp = v.as_ptr().add(t * hd + d0);
                    for (j, a) in acc[..nreg].iter_mut().enumerate() {
                        let vv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                            vp.add(8 * j) as *const __m128i,
                        )));
                        *a = _mm256_fmadd_ps(pt, vv, *a);
                    }
                }
                for (j, a) in acc[..nreg].iter().enumerate() {
                    _mm256_storeu_ps(op.add(8 * j), *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;

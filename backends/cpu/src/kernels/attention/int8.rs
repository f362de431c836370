//! Paged attention over an int8 cache (`KvDtype::Int8`): K and V in the f16 cache's layouts, one
//! byte a value, with one f16 scale per token and KV head for K and one for V (`I8Cache`).
//!
//! Both products run in integers, exactly, so every instruction set gives the same bits:
//! - scores: each query row is quantized to i16 with its own f32 scale (`quantize_query`: at
//!   most 32767 in magnitude, 2^-16 of the row's largest value a step, finer than the f16
//!   rounding the f16 cache gives its queries), and a score is
//!   `(f32(sum_d q16_d * k8_{d,t}) * k_scale_t) * (q_scale * softmax_scale)`, the sum in i32;
//! - the V sum: the softmax's probabilities (rounded through f16, as for the f16 cache) times
//!   their positions' V scales are quantized to i16 per query row and run of at most 64
//!   positions of a block (`quantize_weights`), and the output gains
//!   `f32(sum_t w16_t * v8_{t,d}) * w_scale` (one multiply-add).
//!
//! The AVX-512 VNNI kernels (`simd`) multiply pairs of i16 into i32 with `vpdpwssd` (the int8
//! values widened and interleaved in registers, so the cache is streamed once), the AVX2 ones
//! with `vpmaddwd`; the portable loops are their twin. The softmax is the f16 cache's.

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

/// Positions of a block whose V weights share one i16 scale (per query row).
const RUN: usize = 64;

/// The largest magnitude of a quantized query value for heads of `hd` dimensions: 32767, or
/// less where `hd` products with an int8 key could overflow the i32 sum.
fn query_limit(hd: usize) -> f32 {
    (i32::MAX as usize / (127 * hd.max(1))).min(32767) as f32
}

/// An i16 pair packed into one i32 as `vpdpwssd` and `vpmaddwd` read it: `a` in the low half.
#[inline(always)]
fn pack(a: i16, b: i16) -> i32 {
    (a as u16 as u32 | ((b as u16 as u32) << 16)) as i32
}

/// The two i16 of a packed pair, widened.
#[inline(always)]
fn unpack(p: i32) -> (i32, i32) {
    (p as i16 as i32, p >> 16)
}

/// Quantizes one query row to i16 with one scale (`round_ties_even(q * limit / max|q|)`),
/// packed in pairs of consecutive dimensions (`out`: `q.len().div_ceil(2)` values, an odd last
/// dimension paired with 0); returns the scale, `max|q| / limit` (0 for a zero row; not finite
/// for a row that is not, so its scores are not finite either).
fn quantize_query(q: &[f32], limit: f32, out: &mut [i32]) -> f32 {
    let amax = q.iter().fold(0f32, |m, v| {
        if v.abs() > m || v.is_nan() {
            v.abs()
        } else {
            m
        }
    });
    if amax == 0.0 {
        out.fill(0);
        return 0.0;
    }
    let inv = limit / amax;
    let q16 = |v: f32| (v * inv).round_ties_even().clamp(-limit, limit) as i16;
    for (o, pair) in out.iter_mut().zip(q.chunks(2)) {
        *o = pack(q16(pair[0]), pair.get(1).map_or(0, |&v| q16(v)));
    }
    amax / limit
}

/// The V weights of one row over a run of `p.len()` (at most `RUN`) positions, `p_t * vs_t`,
/// quantized to i16 (at most 32767) with one scale, in pairs of consecutive positions (`out`:
/// `RUN / 2` values, zero past the run); returns the scale (0 where every weight is 0, NaN
/// where one is NaN).
fn quantize_weights(p: &[f32], vs: &[f16], out: &mut [i32]) -> f32 {
    let n = p.len();
    let mut w = [0f32; RUN];
    let mut amax = 0f32;
    let mut nan = false;
    for ((w, &p), s) in w.iter_mut().zip(p).zip(vs) {
        *w = p * s.to_f32();
        nan |= w.is_nan();
        amax = amax.max(w.abs());
    }
    let out = &mut out[..RUN / 2];
    if nan || amax == 0.0 || !amax.is_finite() {
        out.fill(0);
        return if amax == 0.0 && !nan { 0.0 } else { f32::NAN };
    }
    let inv = 32767.0 / amax;
    let q16 = |v: f32| (v * inv).round_ties_even().clamp(-32767.0, 32767.0) as i16;
    for (tp, o) in out.iter_mut().enumerate() {
        *o = if 2 * tp < n {
            pack(q16(w[2 * tp]), q16(w[2 * tp + 1]))
        } else {
            0
        };
    }
    amax / 32767.0
}

/// `quantize_weights` on the task's instruction set (the same bits).
#[inline(always)]
fn weights(kern: Kern, p: &[f32], vs: &[f16], out: &mut [i32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if kern == Kern::Avx512 {
        // SAFETY: `Kern::Avx512` is chosen only with AVX-512F/BW/VL and F16C present; the
        // function checks the lengths.
        if let Some(s) = unsafe { simd::quantize_weights_avx512(p, vs, out) } {
            return s;
        }
    }
    let _ = kern;
    quantize_weights(p, vs, out)
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
        // AVX-512F/BW/VNNI, F16C and FMA.
        #[cfg(target_arch = "x86_64")]
        Kern::Avx512 => unsafe { body_avx512(t, c, s) },
        // SAFETY: AVX2 (or AVX-512) was checked, with FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Kern::Avx2 => unsafe { body_avx2(t, c, s) },
        Kern::Scalar => body(t, c, s, Kern::Scalar),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
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
    let hd2 = hd.div_ceil(2);
    let group = t.p.n_heads / lay.n_kv_heads;
    let ng = t.g1 - t.g0;
    let n_tok = t.t1 - t.t0;
    let rows = n_tok * ng;
    let max_ctx = (t.seq.start_pos + t.t1).min(t.cap);
    let n_blocks = max_ctx.div_ceil(bs);
    let span = n_blocks * bs;
    s.qpairs.resize(rows * hd2, 0);
    s.qscale.resize(rows, 0.0);
    s.wpairs.resize(rows * RUN / 2, 0);
    s.wscale.resize(rows, 0.0);
    s.scores.resize(rows * span, 0.0);
    s.o.resize(rows * hd, 0.0);
    // Queries quantized per row, the softmax scale folded into each row's scale.
    let limit = query_limit(hd);
    for tok in 0..n_tok {
        let qrow = &t.q[(t.seq.q_row + t.t0 + tok) * t.ldq..];
        for g in t.g0..t.g1 {
            let h = t.kvh * group + g;
            let r = tok * ng + g - t.g0;
            let qs = quantize_query(
                &qrow[h * hd..(h + 1) * hd],
                limit,
                &mut s.qpairs[r * hd2..(r + 1) * hd2],
            );
            s.qscale[r] = qs * t.p.scale;
        }
    }
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
    // the block scored now are asked for before use, as for the f16 cache, with their scales.
    // A task of KV head 0 with a next head is the first of a thread's walk over every KV head
    // of these blocks (a split chunk's KV part, or a decoding batch's chunk): it asks for all
    // the heads' K and V of each block at once (each one run of memory, a layer's heads lying
    // side by side), which the later heads then find in cache; asked head by head, each 1 KB
    // run was fetched on its own, one latency each.
    #[cfg(target_arch = "x86_64")]
    let ahead = super::task::prefetch_blocks();
    #[cfg(target_arch = "x86_64")]
    let heads = if t.kvh == 0 && t.next_kvh.is_some() {
        lay.n_kv_heads
    } else {
        1
    };
    #[cfg(target_arch = "x86_64")]
    let prefetch = |bi: usize, k: bool| {
        if bi < n_blocks {
            let blk = t.seq.block_table[bi] as usize;
            let kvh = if heads > 1 { 0 } else { t.kvh };
            let (p, sc) = if k {
                (
                    &c.k[lay.k_at(blk, kvh, 0, 0)..][..heads * hd * bs],
                    &c.ks[c.slay.k_at(blk, kvh, 0, 0)..][..heads * bs],
                )
            } else {
                (
                    &c.v[lay.v_at(blk, kvh, 0, 0)..][..heads * bs * hd],
                    &c.vs[c.slay.v_at(blk, kvh, 0, 0)..][..heads * bs],
                )
            };
            crate::kernels::attention_avx512::prefetch(p.as_ptr() as *const u8, p.len());
            crate::kernels::attention_avx512::prefetch(sc.as_ptr() as *const u8, 2 * sc.len());
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
        let q = (&s.qpairs[..rows * hd2], &s.qscale[..rows]);
        block_scores(kern, k, ks, q, hd, bs, out, span);
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
    // The V sum, in runs of at most `RUN` positions of a block: each row's weights (its
    // probabilities times the positions' scales) quantized, then times the int8 values.
    s.o.fill(0.0);
    for bi in 0..n_blocks {
        let (v, vs) = v_block(bi);
        let n_t = (max_ctx - bi * bs).min(bs);
        let mut t0 = 0;
        while t0 < n_t {
            let n = (n_t - t0).min(RUN);
            for r in 0..rows {
                let p = &s.scores[r * span + bi * bs + t0..r * span + bi * bs + t0 + n];
                let (vs, w) = (
                    &vs[t0..t0 + n],
                    &mut s.wpairs[r * RUN / 2..(r + 1) * RUN / 2],
                );
                s.wscale[r] = weights(kern, p, vs, w);
            }
            let w = (&s.wpairs[..rows * RUN / 2], &s.wscale[..rows]);
            block_pv(kern, &v[t0 * hd..], n, w, hd, &mut s.o[..rows * hd]);
            t0 += n;
        }
    }
}

/// `scores[r * stride + t] = (f32(q16[r] . K[:, t]) * ks[t]) * qscale[r]` for `t < bs`, every
/// row of the quantized queries `q` (packed pairs, `hd.div_ceil(2)` a row, and each row's
/// scale); `k` is one block of one KV head, `[hd][bs]`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn block_scores(
    kern: Kern,
    k: &[i8],
    ks: &[f16],
    (qp, qscale): (&[i32], &[f32]),
    hd: usize,
    bs: usize,
    scores: &mut [f32],
    stride: usize,
) {
    let (rows, hd2) = (qscale.len(), hd.div_ceil(2));
    assert!(
        k.len() >= hd * bs
            && ks.len() >= bs
            && qp.len() >= rows * hd2
            && scores.len() >= (rows - 1) * stride + bs
    );
    match kern {
        // SAFETY: `Kern::Avx512` is chosen only with AVX-512F/BW/VNNI, FMA and F16C present and
        // hd, bs multiples of 16; the lengths are checked above.
        #[cfg(target_arch = "x86_64")]
        Kern::Avx512 => unsafe { simd::scores_avx512(k, ks, qp, qscale, hd, bs, scores, stride) },
        // SAFETY: AVX2, FMA and F16C present, hd and bs multiples of 8; lengths checked above.
        #[cfg(target_arch = "x86_64")]
        Kern::Avx2 => unsafe { simd::scores_avx2(k, ks, qp, qscale, hd, bs, scores, stride) },
        Kern::Scalar => {
            let mut acc = vec![0i32; bs];
            for (r, q) in qp.chunks_exact(hd2).take(rows).enumerate() {
                acc.fill(0);
                for (j, &pair) in q.iter().enumerate() {
                    let (a, b) = unpack(pair);
                    let k0 = &k[2 * j * bs..(2 * j + 1) * bs];
                    for (x, &kv) in acc.iter_mut().zip(k0) {
                        *x += a * kv as i32;
                    }
                    if 2 * j + 1 < hd {
                        let k1 = &k[(2 * j + 1) * bs..(2 * j + 2) * bs];
                        for (x, &kv) in acc.iter_mut().zip(k1) {
                            *x += b * kv as i32;
                        }
                    }
                }
                let out = &mut scores[r * stride..r * stride + bs];
                for ((o, &a), s) in out.iter_mut().zip(&acc).zip(ks) {
                    *o = (a as f32 * s.to_f32()) * qscale[r];
                }
            }
        }
    }
}

/// `o[r][d] = f32(sum_{t < n_t} w16[r][t] * V[t][d]).mul_add(wscale[r], o[r][d])`, every row of
/// the quantized weights `w` (`RUN / 2` packed pairs a row, and each row's scale); `v` holds
/// `n_t` (at most `RUN`) positions of one block of one KV head, `[t][hd]`.
#[inline(always)]
fn block_pv(
    kern: Kern,
    v: &[i8],
    n_t: usize,
    (wp, wscale): (&[i32], &[f32]),
    hd: usize,
    o: &mut [f32],
) {
    let rows = wscale.len();
    assert!(
        n_t <= RUN && v.len() >= n_t * hd && wp.len() >= rows * RUN / 2 && o.len() >= rows * hd
    );
    match kern {
        #[cfg(target_arch = "x86_64")]
        Kern::Avx512 => {
            // The kernels read positions in pairs: an odd run's last pair reads the next row
            // (its weight 0), which lies inside the block (a block's position count is a
            // multiple of 8 on these paths, so an odd run is the block's last, partial one).
            assert!(v.len() >= n_t.next_multiple_of(2) * hd);
            // SAFETY: as for `block_scores`; lengths checked above and here.
            unsafe { simd::pv_avx512(v, n_t, wp, wscale, hd, o) }
        }
        #[cfg(target_arch = "x86_64")]
        Kern::Avx2 => {
            assert!(v.len() >= n_t.next_multiple_of(2) * hd);
            // SAFETY: as above.
            unsafe { simd::pv_avx2(v, n_t, wp, wscale, hd, o) }
        }
        Kern::Scalar => {
            for r in 0..rows {
                let w = &wp[r * RUN / 2..(r + 1) * RUN / 2];
                let or = &mut o[r * hd..(r + 1) * hd];
                for (d, x) in or.iter_mut().enumerate() {
                    let mut acc = 0i32;
                    for t in 0..n_t {
                        let (a, b) = unpack(w[t / 2]);
                        acc += if t % 2 == 0 { a } else { b } * v[t * hd + d] as i32;
                    }
                    *x = (acc as f32).mul_add(wscale[r], *x);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod bench;

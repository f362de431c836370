//! One attention task: query heads of one KV head for a chunk of one sequence's tokens, over
//! the blocks its table names — the scores, the softmax and the V sum, on the AVX-512 kernels,
//! the AVX2 single-token kernels or the portable path.

use super::*;

pub(super) struct Task<'a> {
    pub(super) isa: Isa,
    pub(super) p: &'a AttnParams,
    pub(super) q: &'a [f32],
    pub(super) ldq: usize,
    pub(super) seq: &'a AttnSeq<'a>,
    /// Positions (from the start of `seq`'s table) this task may see at most.
    pub(super) cap: usize,
    pub(super) kvh: usize,
    pub(super) t0: usize,
    pub(super) t1: usize,
    /// Query heads `g0..g1` of the KV head's group.
    pub(super) g0: usize,
    pub(super) g1: usize,
    /// The KV head the same thread works on next for this sequence (its K is asked for ahead
    /// where the machine has prefetch instructions we use).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) next_kvh: Option<usize>,
    pub(super) k_cache: &'a [f16],
    pub(super) v_cache: &'a [f16],
    /// An int8 cache (then `k_cache` and `v_cache` are empty).
    pub(super) i8: Option<super::int8::I8Cache<'a>>,
}

/// Computes one task into `s.o` (rows x hd, row `tok * (g1 - g0) + g - g0`) and the rows'
/// softmax statistics.
pub(super) fn run_task(isa: Isa, t: &Task, s: &mut Scratch) {
    if let Some(c) = &t.i8 {
        return super::int8::run_task_i8(t, c, s);
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` passed `Isa::checked`, so the CPU has these features.
        Isa::Avx512Vnni => unsafe { task_avx512(t, s) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` passed `Isa::checked`, so the CPU has these features.
        Isa::Avx2 => unsafe { task_avx2(t, s) },
        _ => task_body(t, s),
    }
}

/// Writes a task's output rows `o` into its tile of the output.
pub(super) fn write_out(t: &Task, o: &[f32], out: &mut Tile<f32>) {
    let hd = t.p.lay.head_dim;
    let group = t.p.n_heads / t.p.lay.n_kv_heads;
    let ng = t.g1 - t.g0;
    let c0 = out.cols().start;
    for tok in 0..t.t1 - t.t0 {
        let orow = out.row_mut(t.seq.q_row + t.t0 + tok);
        for g in t.g0..t.g1 {
            let h = t.kvh * group + g;
            let r = tok * ng + g - t.g0;
            orow[h * hd - c0..(h + 1) * hd - c0].copy_from_slice(&o[r * hd..(r + 1) * hd]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma,f16c")]
unsafe fn task_avx512(t: &Task, s: &mut Scratch) {
    task_body(t, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2(t: &Task, s: &mut Scratch) {
    task_body(t, s)
}

/// KV blocks asked for ahead of use (a tunable, `NPU_SERVING_ATTN_PREFETCH`).
#[cfg(target_arch = "x86_64")]
pub(super) fn prefetch_blocks() -> usize {
    static BLOCKS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BLOCKS.get_or_init(|| {
        std::env::var("NPU_SERVING_ATTN_PREFETCH")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4)
    })
}

/// Lanes of the fixed-width accumulators below (one AVX-512 register).
const LANES: usize = 16;

/// Rows the portable path computes together: one K or V load feeds this many independent
/// accumulator chains (one chain per row is bound by the multiply-add's latency).
const ROW_BLOCK: usize = 4;

/// Multiplies `x` (whole chunks of `LANES`) by `scale` in place and returns each lane's maximum
/// (lane j over values j, j + LANES, ...), kept as `if v > max { v } else { max }`. On the fast
/// path the scores were scaled as they were stored (the same products), so only the maxima are
/// taken there.
#[inline(always)]
pub(super) fn scale_lane_max(fast: bool, x: &mut [f32], scale: f32) -> [f32; LANES] {
    #[cfg(target_arch = "x86_64")]
    if fast {
        // SAFETY: `fast` holds only for an instruction set that passed `Isa::checked` as AVX-512
        // VNNI, which includes AVX-512F; the function reads only whole chunks of `x`.
        return unsafe { crate::kernels::attention_avx512::lane_max(x) };
    }
    let _ = fast;
    let mut lane_max = [f32::NEG_INFINITY; LANES];
    for c in x.chunks_exact_mut(LANES) {
        for j in 0..LANES {
            c[j] *= scale;
            lane_max[j] = if c[j] > lane_max[j] {
                c[j]
            } else {
                lane_max[j]
            };
        }
    }
    lane_max
}

/// `x[i] = exp_approx(x[i] - max)` over the whole chunks of `x` (of `LANES`), returning each
/// lane's sum (lane j over values j, j + LANES, ..., in order).
#[inline(always)]
pub(super) fn exp_lane_sums(fast: bool, x: &mut [f32], max: f32) -> [f32; LANES] {
    #[cfg(target_arch = "x86_64")]
    if fast {
        // SAFETY: as for `scale_lane_max`: AVX-512F is present; whole chunks only.
        return unsafe { crate::kernels::attention_avx512::exp_lane_sums(x, max) };
    }
    let _ = fast;
    let mut lanes = [0f32; LANES];
    for c in x.chunks_exact_mut(LANES) {
        for j in 0..LANES {
            c[j] = exp_approx(c[j] - max);
            lanes[j] += c[j];
        }
    }
    lanes
}

/// `x[i] *= inv`, then every value rounded through f16 (the probabilities the V product takes).
#[inline(always)]
pub(super) fn normalise_through_f16(fast: bool, isa: Isa, x: &mut [f32], inv: f32) {
    #[cfg(target_arch = "x86_64")]
    if fast {
        let whole = x.len() / LANES * LANES;
        // SAFETY: `fast` means the instruction set passed `Isa::checked` as AVX-512 VNNI, which
        // includes AVX-512F and F16C; the function touches only whole chunks of `x`.
        unsafe { crate::kernels::attention_avx512::scale_round_f16(&mut x[..whole], inv) };
        for v in &mut x[whole..] {
            *v = half::f16::from_f32(*v * inv).to_f32();
        }
        crate::kernels::inject_fault(isa, x.first_mut());
        return;
    }
    let _ = fast;
    for v in x.iter_mut() {
        *v *= inv;
    }
    round_through_f16(isa, x);
}

/// `src` widened to f32 into the front of `dst` (exact: every f16 is an f32), eight values an
/// instruction where the CPU has F16C, instead of a library call per eight values.
#[inline(always)]
fn widen_f16(src: &[f16], dst: &mut [f32]) {
    let dst = &mut dst[..src.len()];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has F16C (and AVX, which F16C's 256-bit form needs, with it); the
        // lengths are equal.
        return unsafe { widen_f16c(src, dst) };
    }
    src.convert_to_f32_slice(dst);
}

/// # Safety
/// The CPU must have AVX and F16C; `dst` must be as long as `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16c(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n8 = src.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= n8 <= len of both slices; unaligned loads and stores.
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
    }
    src[n8..].convert_to_f32_slice(&mut dst[n8..]);
}

/// Where a score tile lies: rows `r0..` of the scores (rows `span` apart), K blocks `b0..`.
#[derive(Clone, Copy)]
struct ScoreAt {
    hd: usize,
    bs: usize,
    span: usize,
    r0: usize,
    b0: usize,
}

/// Scores of `R` query rows against the `NB` K blocks widened in `kbuf` (block `i` at
/// `i * hd * bs`, `[d][t]`): `R * NB` independent accumulator chains per 16 positions, each
/// score summed over `d` in order (the same arithmetic as one row and one block at a time).
#[inline(always)]
fn score_tile<const R: usize, const NB: usize>(
    q: &[f32],
    kbuf: &[f32],
    scores: &mut [f32],
    at: ScoreAt,
) {
    let ScoreAt {
        hd,
        bs,
        span,
        r0,
        b0,
    } = at;
    let kbuf = &kbuf[..NB * hd * bs];
    let q = &q[r0 * hd..(r0 + R) * hd];
    for t0 in (0..bs).step_by(LANES) {
        let mut acc = [[[0f32; LANES]; NB]; R];
        for d in 0..hd {
            let mut kd = [[0f32; LANES]; NB];
            for (i, k) in kd.iter_mut().enumerate() {
                k.copy_from_slice(&kbuf[i * hd * bs + d * bs + t0..][..LANES]);
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let qd = q[r * hd + d];
                for (acc_ri, k) in acc_r.iter_mut().zip(&kd) {
                    for j in 0..LANES {
                        acc_ri[j] = qd.mul_add(k[j], acc_ri[j]);
                    }
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (i, acc_ri) in acc_r.iter().enumerate() {
                let o = (r0 + r) * span + (b0 + i) * bs + t0;
                scores[o..o + LANES].copy_from_slice(acc_ri);
            }
        }
    }
}

/// One task: query heads `g0..g1` of KV head `kvh` for tokens `t0..t1` of one sequence (at
/// most `cap` positions of it), into `s.o` and the softmax statistics.
#[inline(always)]
fn task_body(t: &Task, s: &mut Scratch) {
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
    s.vbuf.resize(bs * hd, 0.0);
    s.o.resize(rows * hd, 0.0);
    // Queries rounded through f16, as ggml feeds them to its f16 K cache product.
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
    // The first position each row sees (beyond 0 only through a sliding window).
    let lo_of = |r: usize| {
        t.p.window.map_or(0, |w| {
            (t.seq.start_pos + t.t0 + r / ng + 1).saturating_sub(w)
        })
    };
    s.row_max.resize(rows, 0.0);
    s.row_sum.resize(rows, 0.0);
    #[cfg(target_arch = "x86_64")]
    let fast = t.isa == Isa::Avx512Vnni && hd % LANES == 0 && bs % LANES == 0 && hd <= 256;
    #[cfg(not(target_arch = "x86_64"))]
    let fast = false;
    // Scores, one K block at a time (two at a time on the fast path).
    #[cfg(target_arch = "x86_64")]
    if fast {
        let k_ptr = |bi: usize| {
            let k0 = lay.k_at(t.seq.block_table[bi] as usize, t.kvh, 0, 0);
            t.k_cache[k0..k0 + hd * bs].as_ptr()
        };
        // The blocks of a sequence lie far apart (each holds every layer), so the hardware
        // prefetcher cannot follow the block table: the K of the next `PREFETCH_BLOCKS` blocks
        // are asked for ahead of use (and the V likewise below).
        let prefetch_k = |bi: usize| {
            if bi < n_blocks {
                crate::kernels::attention_avx512::prefetch(k_ptr(bi) as *const u8, hd * bs * 2);
            }
        };
        // The V of the blocks scored now is asked for too: it is needed right after the
        // softmax, and asking early keeps more of the task's reads in flight.
        let prefetch_v = |bi: usize| {
            if bi < n_blocks {
                let v0 = lay.v_at(t.seq.block_table[bi] as usize, t.kvh, 0, 0);
                let v = t.v_cache[v0..v0 + bs * hd].as_ptr();
                crate::kernels::attention_avx512::prefetch(v as *const u8, bs * hd * 2);
            }
        };
        let ahead = prefetch_blocks();
        for bi in 0..ahead {
            prefetch_k(bi);
        }
        let mut bi = 0;
        while bi < n_blocks {
            prefetch_k(bi + ahead);
            prefetch_k(bi + ahead + 1);
            prefetch_v(bi);
            prefetch_v(bi + 1);
            // SAFETY: `fast` means the CPU has AVX-512 (the isa passed `Isa::checked`) and hd, bs
            // are multiples of 16 with hd <= 256; each K pointer starts an `hd * bs` slice of the
            // cache (sliced in `k_ptr`); `s.q` holds rows x hd values; the call writes scores
            // `r * span + bi * bs + t` for r < rows, t < 2 * bs (or bs), inside the rows x span
            // buffer because bi + 2 <= n_blocks (or bi + 1) and span = n_blocks * bs.
            unsafe {
                let out = s.scores.as_mut_ptr().add(bi * bs);
                if bi + 1 < n_blocks {
                    crate::kernels::attention_avx512::block_scores::<2>(
                        [k_ptr(bi), k_ptr(bi + 1)],
                        hd,
                        bs,
                        &s.q,
                        rows,
                        out,
                        span,
                        t.p.scale,
                    );
                    bi += 2;
                } else {
                    crate::kernels::attention_avx512::block_scores::<1>(
                        [k_ptr(bi)],
                        hd,
                        bs,
                        &s.q,
                        rows,
                        out,
                        span,
                        t.p.scale,
                    );
                    bi += 1;
                }
            }
        }
    }
    // The portable path (nothing left to do here when the fast one ran).
    let portable_blocks = if fast { 0 } else { n_blocks };
    // Rows are taken up to ROW_BLOCK at a time; with few rows (a decoding sequence), several K
    // blocks at a time instead, so each K load feeds enough independent accumulator chains.
    let nb_group = match rows {
        1 => 4,
        2 | 3 => 2,
        _ => 1,
    };
    s.kbuf.resize(nb_group * hd * bs, 0.0);
    // One query row on AVX2: the K and V blocks are read as f16 straight into the
    // multiply-adds (same order, same bits).
    #[cfg(target_arch = "x86_64")]
    let f16c_row = t.isa == Isa::Avx2 && rows == 1 && bs % LANES == 0 && hd % 8 == 0;
    // Two to four rows of one token (a decoding sequence's query heads of one KV head, in a
    // batch): the same, each K and V load feeding every row; the rows share their context.
    #[cfg(target_arch = "x86_64")]
    let f16c_rows = t.isa == Isa::Avx2
        && n_tok == 1
        && (2..=ROW_BLOCK).contains(&rows)
        && bs % LANES == 0
        && hd % LANES == 0;
    // As on the fast path, the K of blocks ahead and the V of the blocks scored now are asked
    // for before use (the block table defeats the hardware prefetcher).
    #[cfg(target_arch = "x86_64")]
    let prefetch_kv = |bi: usize, k: bool| {
        if bi < portable_blocks {
            let blk = t.seq.block_table[bi] as usize;
            let (cache, at) = if k {
                (t.k_cache, lay.k_at(blk, t.kvh, 0, 0))
            } else {
                (t.v_cache, lay.v_at(blk, t.kvh, 0, 0))
            };
            crate::kernels::attention_avx512::prefetch(
                cache[at..at + hd * bs].as_ptr() as *const u8,
                hd * bs * 2,
            );
        }
    };
    #[cfg(target_arch = "x86_64")]
    let ahead = prefetch_blocks();
    #[cfg(target_arch = "x86_64")]
    for bi in 0..ahead.min(portable_blocks) {
        prefetch_kv(bi, true);
    }
    let mut b0 = 0;
    while b0 < portable_blocks {
        let nb = nb_group.min(portable_blocks - b0);
        #[cfg(target_arch = "x86_64")]
        for i in 0..nb {
            prefetch_kv(b0 + ahead + i, true);
            prefetch_kv(b0 + i, false);
        }
        let k_block = |i: usize| {
            let k0 = lay.k_at(t.seq.block_table[b0 + i] as usize, t.kvh, 0, 0);
            &t.k_cache[k0..k0 + hd * bs]
        };
        #[cfg(target_arch = "x86_64")]
        if f16c_row {
            let out = &mut s.scores[(b0 * bs)..(b0 + nb) * bs];
            // SAFETY: `f16c_row` means the CPU has AVX2, FMA and F16C (the isa passed
            // `Isa::checked`), `bs` is a multiple of 16 and there is one query row of `hd`
            // values; each K pointer starts an `hd * bs` slice of the cache (`k_block`), and the
            // scores slice holds the `nb * bs` values written.
            unsafe {
                let q = &s.q[..hd];
                let o = out.as_mut_ptr();
                if nb == 4 {
                    let k = [0, 1, 2, 3].map(|i| k_block(i).as_ptr());
                    crate::kernels::attention_avx2::row_scores::<4>(k, q, hd, bs, o);
                } else {
                    for i in 0..nb {
                        let k = [k_block(i).as_ptr()];
                        crate::kernels::attention_avx2::row_scores::<1>(
                            k,
                            q,
                            hd,
                            bs,
                            o.add(i * bs),
                        );
                    }
                }
            }
            b0 += nb;
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if f16c_rows {
            for i in 0..nb {
                let (k, q) = (k_block(i).as_ptr(), &s.q[..rows * hd]);
                let o = s.scores[(b0 + i) * bs..(rows - 1) * span + (b0 + i + 1) * bs].as_mut_ptr();
                // SAFETY: `f16c_rows`: AVX2, FMA and F16C present, `bs` a multiple of 16, `rows`
                // (2..=4) rows of `hd` query values; `k` starts an `hd * bs` slice of the cache;
                // the scores slice covers `bs` values at each of the rows, `span` apart.
                unsafe {
                    match rows {
                        2 => {
                            crate::kernels::attention_avx2::rows_scores::<2>(k, q, hd, bs, o, span)
                        }
                        3 => {
                            crate::kernels::attention_avx2::rows_scores::<3>(k, q, hd, bs, o, span)
                        }
                        _ => {
                            crate::kernels::attention_avx2::rows_scores::<4>(k, q, hd, bs, o, span)
                        }
                    }
                }
            }
            b0 += nb;
            continue;
        }
        for i in 0..nb {
            widen_f16(k_block(i), &mut s.kbuf[i * hd * bs..(i + 1) * hd * bs]);
        }
        let mut r0 = 0;
        while r0 < rows {
            // Rows see more of the context the later their token: the group's last row decides
            // whether the blocks are needed at all (scores past a row's context are computed
            // from real cache positions and ignored by its softmax).
            let r1 = (r0 + ROW_BLOCK).min(rows);
            if b0 * bs >= ctx_of(r1 - 1) {
                r0 = r1;
                continue;
            }
            let at = ScoreAt {
                hd,
                bs,
                span,
                r0,
                b0,
            };
            if bs % LANES != 0 {
                for r in r0..r1 {
                    for i in 0..nb {
                        let sc = &mut s.scores[r * span + (b0 + i) * bs..][..bs];
                        sc.fill(0.0);
                        for d in 0..hd {
                            let qd = s.q[r * hd + d];
                            let kd = &s.kbuf[i * hd * bs + d * bs..][..bs];
                            for (o, &k) in sc.iter_mut().zip(kd) {
                                *o = qd.mul_add(k, *o);
                            }
                        }
                    }
                }
            } else {
                let (q, kb, sc) = (&s.q, &s.kbuf, &mut s.scores);
                match (r1 - r0, nb) {
                    (4, 1) => score_tile::<4, 1>(q, kb, sc, at),
                    (1, 4) => score_tile::<1, 4>(q, kb, sc, at),
                    (2, 2) => score_tile::<2, 2>(q, kb, sc, at),
                    (3, 2) => score_tile::<3, 2>(q, kb, sc, at),
                    (r, nb) => {
                        for rr in 0..r {
                            for i in 0..nb {
                                let one = ScoreAt {
                                    r0: r0 + rr,
                                    b0: b0 + i,
                                    ..at
                                };
                                score_tile::<1, 1>(q, &kb[i * hd * bs..], sc, one);
                            }
                        }
                    }
                }
            }
            r0 = r1;
        }
        b0 += nb;
    }
    // Softmax per row over its own context; probabilities rounded through f16 for the V product.
    for r in 0..rows {
        let (lo, ctx) = (lo_of(r), ctx_of(r));
        // Positions before the window weigh nothing in the V sum.
        s.scores[r * span..r * span + lo].fill(0.0);
        let sc = &mut s.scores[r * span + lo..r * span + ctx];
        // Scale and maximum, lane-wise (plain comparisons, no NaN rules).
        let whole = sc.len() / LANES * LANES;
        let lane_max = scale_lane_max(fast, &mut sc[..whole], t.p.scale);
        let mut max = lane_max
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
        for v in &mut sc[whole..] {
            if !fast {
                *v *= t.p.scale;
            }
            if *v > max {
                max = *v;
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
        // Positions this row may not see weigh nothing in the V sum.
        s.scores[r * span + ctx..(r + 1) * span].fill(0.0);
    }
    // Weighted sum of V, one block at a time; 16 dimensions per register-held accumulator.
    s.o.fill(0.0);
    // While this head's V is summed, the next head's K (same blocks) is asked for.
    #[cfg(target_arch = "x86_64")]
    let prefetch_next_k = |bi: usize| {
        if let Some(kvh) = t.next_kvh.filter(|_| bi < n_blocks) {
            let k0 = lay.k_at(t.seq.block_table[bi] as usize, kvh, 0, 0);
            let k = t.k_cache[k0..k0 + hd * bs].as_ptr();
            crate::kernels::attention_avx512::prefetch(k as *const u8, hd * bs * 2);
        }
    };
    for bi in 0..n_blocks {
        let blk = t.seq.block_table[bi] as usize;
        let v0 = lay.v_at(blk, t.kvh, 0, 0);
        #[cfg(target_arch = "x86_64")]
        if fast {
            prefetch_next_k(bi);
            let n_t = (max_ctx - bi * bs).min(bs);
            // SAFETY: as for the scores: V is an `bs * hd` slice of the cache; probabilities are
            // read at `r * span + bi * bs + t` for r < rows, t < n_t <= bs, inside the scores
            // buffer; `s.o` holds rows x hd values (resized above). Probabilities beyond each
            // row's context are zero, so reading them adds nothing.
            unsafe {
                crate::kernels::attention_avx512::block_pv(
                    t.v_cache[v0..v0 + bs * hd].as_ptr(),
                    hd,
                    n_t,
                    s.scores.as_ptr().add(bi * bs),
                    span,
                    rows,
                    &mut s.o,
                );
            }
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        prefetch_next_k(bi);
        #[cfg(target_arch = "x86_64")]
        if f16c_row {
            let ctx = ctx_of(0);
            if bi * bs < ctx {
                let n_t = (ctx - bi * bs).min(bs);
                let v = &t.v_cache[v0..v0 + bs * hd];
                let p = &s.scores[bi * bs..bi * bs + n_t];
                // SAFETY: `f16c_row`: AVX2, FMA and F16C present, `hd` a multiple of 8; `v` is a
                // `bs * hd` slice of the cache and `n_t <= bs`; `s.o` holds the row's `hd`
                // values.
                unsafe { crate::kernels::attention_avx2::row_pv(v.as_ptr(), p, hd, &mut s.o) };
            }
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if f16c_rows {
            let ctx = ctx_of(0);
            if bi * bs < ctx {
                let n_t = (ctx - bi * bs).min(bs);
                let v = t.v_cache[v0..v0 + bs * hd].as_ptr();
                let p = s.scores[bi * bs..(rows - 1) * span + bi * bs + n_t].as_ptr();
                let o = &mut s.o[..rows * hd];
                // SAFETY: `f16c_rows`: AVX2, FMA and F16C present, `hd` a multiple of 16; `v`
                // starts a `bs * hd` slice of the cache and `n_t <= bs`; the probabilities
                // slice covers `n_t` values at each row, `span` apart; `o` holds the rows.
                unsafe {
                    match rows {
                        2 => crate::kernels::attention_avx2::rows_pv::<2>(v, p, span, n_t, hd, o),
                        3 => crate::kernels::attention_avx2::rows_pv::<3>(v, p, span, n_t, hd, o),
                        _ => crate::kernels::attention_avx2::rows_pv::<4>(v, p, span, n_t, hd, o),
                    }
                }
            }
            continue;
        }
        widen_f16(&t.v_cache[v0..v0 + bs * hd], &mut s.vbuf);
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + ROW_BLOCK).min(rows);
            let ctx = ctx_of(r1 - 1);
            if bi * bs >= ctx {
                r0 = r1;
                continue;
            }
            if hd % LANES == 0 && r1 - r0 == ROW_BLOCK {
                // Four rows at once, up to the last row's context: the earlier rows'
                // probabilities beyond their own context are zero and add nothing.
                let n_t = (ctx - bi * bs).min(bs);
                for d0 in (0..hd).step_by(LANES) {
                    let mut acc = [[0f32; LANES]; ROW_BLOCK];
                    for (i, acc_i) in acc.iter_mut().enumerate() {
                        acc_i.copy_from_slice(&s.o[(r0 + i) * hd + d0..(r0 + i) * hd + d0 + LANES]);
                    }
                    for tt in 0..n_t {
                        let vr = &s.vbuf[tt * hd + d0..tt * hd + d0 + LANES];
                        for (i, acc_i) in acc.iter_mut().enumerate() {
                            let pt = s.scores[(r0 + i) * span + bi * bs + tt];
                            for j in 0..LANES {
                                acc_i[j] = pt.mul_add(vr[j], acc_i[j]);
                            }
                        }
                    }
                    for (i, acc_i) in acc.iter().enumerate() {
                        s.o[(r0 + i) * hd + d0..(r0 + i) * hd + d0 + LANES].copy_from_slice(acc_i);
                    }
                }
                r0 = r1;
                continue;
            }
            for r in r0..r1 {
                let ctx = ctx_of(r);
                if bi * bs >= ctx {
                    continue;
                }
                let n_t = (ctx - bi * bs).min(bs);
                let pr = &s.scores[r * span + bi * bs..r * span + bi * bs + n_t];
                let or = &mut s.o[r * hd..(r + 1) * hd];
                // Position by position over all dimensions: every dimension's chain is
                // independent of the others (each still sums its positions in order).
                for (tt, &pt) in pr.iter().enumerate() {
                    for (o, &v) in or.iter_mut().zip(&s.vbuf[tt * hd..(tt + 1) * hd]) {
                        *o = pt.mul_add(v, *o);
                    }
                }
            }
            r0 = r1;
        }
    }
}

//! The AVX-512 VNNI packed matmul on two groups at once (32 output columns): each broadcast
//! 4-byte slice of an activation row feeds the products of both groups, halving the broadcasts
//! per product against `avx512::tile`. A block's values are unpacked register pair by register
//! pair (registers `p` and `p + 4` share a 64-byte plane of nibbles), so both groups' weights
//! need only four registers at a time and the 4 rows x 2 groups integer and float accumulators
//! stay in registers. One product chain per row and group: for the formats whose block step
//! needs only the sum of a block's two halves (4- and 8-bit values with per-block scales, and
//! Q4_K). Integer sums are exact and the epilogue is `avx512::block_step`'s, so the results are
//! the scalar kernel's bit for bit.

use std::arch::x86_64::*;

use super::avx512::{block_scales, block_step, header, iq4_table, prefetch_distance, SumPtrs};
use super::{PackedJob, RawOut};
use crate::quant::acts::QBLOCK;
use crate::quant::packed::{code, GROUP};

/// Whether the two-group kernel serves a format (values, scales): every one whose block step
/// takes only the sum of the block's two halves, but those with per-block minimums (Q4_1,
/// Q5_1), which measured 25% slower on it than on `avx512::tile` (one thread, 512x2048x2048:
/// 446-458 against 592-608 GOP/s) where Q4_0 gained 18-20%, Q8_0 37%, Q5_0 16%, IQ4_NL 18%,
/// IQ4_XS 14%, Q5_K 10% and Q4_K 2-8%.
pub(crate) const fn serves(v: u8, s: u8) -> bool {
    matches!(v, code::Q4 | code::Q5 | code::Q8 | code::IQ4)
        && matches!(s, code::F16 | code::F32SUPER | code::K4 | code::XS)
}

/// Fewest activation rows a job takes the two-group kernel for. A pass over 4 rows of a pair
/// wants its weights from memory twice as fast as a pass of `avx512::tile`, which the memory
/// cannot give; so each later pass over a pair asks for a slice of the next pair's bytes
/// (`Ahead`), and its first pass finds them in cache. With that, in a 1B Q4_0 model's
/// decode steps (`bench-model`, same run, three alternations) pairs ran 4% faster at 8 rows, 15%
/// at 16 and 17% at 32 (before it: 11% slower at 8, level at 32); below 8 rows (one pass, nothing
/// to overlap) they measured 25-30% slower at batch 4 and batch 1.
pub(crate) const MIN_ROWS: usize = 8;

/// The share of the next pair's bytes one pass over a pair's rows asks the memory for ahead of
/// time. A pair's first pass streams its weights from memory far faster than the memory delivers
/// them, and its later passes find them in cache and ask for nothing: so the later passes each
/// ask for an equal slice of the next pair's bytes, and its first pass then finds them on the
/// way. Addresses past the matrix are only ever prefetched, never read. (`avx512::tile` does
/// without: with the cursor in its loop Q4_1 ran 7-9% slower, and its rows gained nothing.)
#[derive(Clone, Copy)]
pub(crate) struct Ahead {
    base: *const u8,
    from: usize,
    to: usize,
}

impl Ahead {
    /// The slice for the pass starting at row `m0` of `rows`, in passes of `per` rows, over the
    /// `bytes` bytes from `next`: none on the first pass (or past the last); the rest divided
    /// among the others.
    pub(crate) fn of(
        next: *const u8,
        bytes: usize,
        rows: std::ops::Range<usize>,
        per: usize,
        m0: usize,
    ) -> Ahead {
        let passes = rows.len().div_ceil(per);
        let p = (m0 - rows.start) / per;
        if p == 0 || p >= passes {
            return Ahead {
                base: next,
                from: 0,
                to: 0,
            };
        }
        let share = |i: usize| bytes * i / (passes - 1) / 64 * 64;
        Ahead {
            base: next,
            from: share(p - 1),
            to: share(p),
        }
    }

    /// A cursor that spreads this slice's lines evenly over `steps` calls of `AheadCursor::step`.
    pub(crate) fn cursor(&self, steps: usize) -> AheadCursor {
        AheadCursor {
            base: self.base,
            at: self.from,
            lines: (self.to - self.from) / 64,
            steps,
            credit: 0,
        }
    }
}

/// Where a pass is in its slice of look-ahead lines (no division on the way: a kernel calls
/// `step` once per block).
pub(crate) struct AheadCursor {
    base: *const u8,
    at: usize,
    lines: usize,
    steps: usize,
    credit: usize,
}

impl AheadCursor {
    /// Asks for the lines due after one more of the `steps` steps.
    #[inline(always)]
    pub(crate) fn step(&mut self) {
        self.credit += self.lines;
        while self.credit >= self.steps {
            // SAFETY: a prefetch never faults, whatever the address (formed with wrapping
            // arithmetic and never dereferenced); SSE is baseline on x86-64.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.base.wrapping_add(self.at) as *const i8) };
            self.at += 64;
            self.credit -= self.steps;
        }
    }
}

/// Registers `p` and `p + 4` of the block at `vp` (unsigned bytes; see `packed`'s module doc).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn register_pair<const V: u8>(vp: *const u8, p: usize) -> (__m512i, __m512i) {
    let ld = |o: usize| _mm512_loadu_si512(vp.add(o) as *const _);
    if V == code::Q8 {
        return (ld(p * 64), ld((p + 4) * 64));
    }
    let low = _mm512_set1_epi8(0x0F);
    let v = ld(p * 64);
    let (mut r0, mut r1) = (
        _mm512_and_si512(v, low),
        _mm512_and_si512(_mm512_srli_epi16::<4>(v), low),
    );
    if V == code::Q5 {
        // Bit c of the plane is bit 4 of register c: register p's moves up by 4 - p, register
        // p + 4's down by p (a bit never leaves its byte, so 16-bit shifts serve).
        let (h, b4) = (ld(256), _mm512_set1_epi8(0x10));
        let up = _mm512_sll_epi16(h, _mm_cvtsi32_si128(4 - p as i32));
        let down = _mm512_srl_epi16(h, _mm_cvtsi32_si128(p as i32));
        r0 = _mm512_ternarylogic_epi32::<0xF8>(r0, up, b4);
        r1 = _mm512_ternarylogic_epi32::<0xF8>(r1, down, b4);
    } else if V == code::IQ4 {
        let t = iq4_table();
        (r0, r1) = (_mm512_shuffle_epi8(t, r0), _mm512_shuffle_epi8(t, r1));
    }
    (r0, r1)
}

/// Rows `m0..m0 + R` against groups `g` and `g + 1` (`masks`: their valid output columns).
///
/// # Safety
/// As `avx512::packed`, for a job whose groups include `g` and `g + 1`, and a format `serves`
/// takes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile2<const R: usize, const V: u8, const S: u8>(
    job: &PackedJob,
    sums: SumPtrs,
    out: RawOut,
    g: usize,
    m0: usize,
    masks: [__mmask16; 2],
    first_pass: bool,
    ahead: Ahead,
) {
    let w = job.w;
    let a = job.acts;
    let k = a.k;
    let nb = k / QBLOCK;
    let lay = code::Layout::of(V, S);
    let (bps, super_bytes) = (lay.bps, lay.super_bytes);
    let offset = w.format.offset;
    // Where the epilogue would subtract `offset` times the block's activation sum, the integer
    // sums start from that term instead, and the epilogue is told there is no offset left.
    let fold = offset != 0 && matches!(S, code::F16 | code::F32SUPER | code::XS);
    let rest = if fold { 0 } else { offset };
    let gd = [w.group_data(g).as_ptr(), w.group_data(g + 1).as_ptr()];
    let qs = a.qs.as_ptr();
    let xa = (a.d.as_ptr(), a.s.as_ptr(), a.isum.as_ptr());
    const { assert!(R <= 4) };
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); 2]; 4];
    let pf_dist = prefetch_distance(super_bytes / bps);
    let mut pf_next = pf_dist;
    let mut pf_ahead = ahead.cursor(nb);
    for sup in 0..nb / bps {
        let base = [gd[0].add(sup * super_bytes), gd[1].add(sup * super_bytes)];
        let (hd0, hm0) = header::<S>(base[0]);
        let (hd1, hm1) = header::<S>(base[1]);
        for j in 0..bps {
            let b = sup * bps + j;
            pf_ahead.step();
            if first_pass {
                // Both groups' bytes ahead (see `avx512::tile`).
                let end = (b + 1) * super_bytes / bps + pf_dist;
                while pf_next < end {
                    _mm_prefetch::<_MM_HINT_T1>(gd[0].wrapping_add(pf_next) as *const i8);
                    _mm_prefetch::<_MM_HINT_T1>(gd[1].wrapping_add(pf_next) as *const i8);
                    pf_next += 64;
                }
            }
            let vp = [base[0].add(lay.values_at(j)), base[1].add(lay.values_at(j))];
            // One broadcast per row serves both groups (1-2% on Q4_0, Q5_0 and IQ4_NL at
            // 512x2048x2048, one thread, three alternations).
            let mut ia = [[zero; 2]; 4];
            if fold {
                for (r, ia_r) in ia.iter_mut().enumerate().take(R) {
                    let o = _mm512_set1_epi32(-offset * *xa.2.add((m0 + r) * nb + b));
                    *ia_r = [o, o];
                }
            }
            for p in 0..4 {
                let (a0, a1) = register_pair::<V>(vp[0], p);
                let (b0, b1) = register_pair::<V>(vp[1], p);
                macro_rules! rows {
                    ($($r:literal)*) => {$(
                        if $r < R {
                            let xq = qs.add((m0 + $r) * k + b * QBLOCK) as *const i32;
                            let x0 = _mm512_set1_epi32(xq.add(p).read_unaligned());
                            let x1 = _mm512_set1_epi32(xq.add(p + 4).read_unaligned());
                            let [i0, i1] = &mut ia[$r];
                            *i0 = _mm512_dpbusd_epi32(*i0, a0, x0);
                            *i1 = _mm512_dpbusd_epi32(*i1, b0, x0);
                            *i0 = _mm512_dpbusd_epi32(*i0, a1, x1);
                            *i1 = _mm512_dpbusd_epi32(*i1, b1, x1);
                        }
                    )*};
                }
                rows!(0 1 2 3);
            }
            let s0 = block_scales::<S>(base[0].add(lay.scales_at(j)), hd0, hm0, offset);
            let s1 = block_scales::<S>(base[1].add(lay.scales_at(j)), hd1, hm1, offset);
            macro_rules! steps {
                ($($r:literal)*) => {$(
                    if $r < R {
                        let blk = (m0 + $r) * nb + b;
                        let [i0, i1] = ia[$r];
                        acc[$r][0] =
                            block_step::<S>(&s0, rest, i0, zero, xa, sums, blk, acc[$r][0]);
                        acc[$r][1] =
                            block_step::<S>(&s1, rest, i1, zero, xa, sums, blk, acc[$r][1]);
                    }
                )*};
            }
            steps!(0 1 2 3);
        }
    }
    for (r, acc_r) in acc.iter().enumerate().take(R) {
        for (h, (acc_h, mask)) in acc_r.iter().zip(masks).enumerate() {
            let dst = out.base.add((m0 + r) * out.ld + (g + h) * GROUP);
            _mm512_mask_storeu_ps(dst, mask, *acc_h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Ahead;

    #[test]
    fn later_passes_share_the_next_pairs_lines_without_gaps_or_overlap() {
        let bytes = 36_864;
        for rows in [8..16usize, 3..40, 0..512] {
            let passes = rows.len().div_ceil(4);
            let slices: Vec<(usize, usize)> = (0..passes)
                .map(|p| {
                    let a = Ahead::of(std::ptr::null(), bytes, rows.clone(), 4, rows.start + 4 * p);
                    (a.from, a.to)
                })
                .collect();
            assert_eq!(slices[0], (0, 0), "the first pass asks for nothing");
            let mut at = 0;
            for &(from, to) in &slices[1..] {
                assert_eq!(from, at, "rows {rows:?}");
                assert!(to >= from && to % 64 == 0);
                at = to;
            }
            assert_eq!(
                at, bytes,
                "rows {rows:?}: every line of the next pair is asked for"
            );
            // A cursor over a pass's blocks asks for each of its lines once.
            let a = Ahead::of(std::ptr::null(), bytes, rows.clone(), 4, rows.start + 4);
            let mut c = a.cursor(64);
            for _ in 0..64 {
                c.step();
            }
            assert_eq!(c.at, a.to, "rows {rows:?}");
        }
    }
}

//! AVX2 packed matmul (no VNNI): a group's 16 rows are handled as two 8-lane halves; byte
//! products go through `vpmaddubsw` over as many 4-value registers as its 16-bit sums allow (four
//! for values below 32, two for 6-bit values; 8-bit values, stored with an offset of 128, are
//! re-centred to signed bytes and multiplied as |w| by x with w's sign, one register at a time).
//! Integer sums are exact, so the results are the scalar kernel's bit for bit.

use std::arch::x86_64::*;

use super::{PackedJob, RawOut};
use crate::quant::acts::{ActSums, QBLOCK};
use crate::quant::packed::{code, GROUP};

/// Activation rows per tile: a tile holds one half's 8 unpacked weight registers and one f32
/// accumulator per row (AVX2 has 16 registers); fewer rows re-unpack the weights more often.
const ROWS: usize = 5;

/// The activations' per-16 sums and exact block sums (null where the format needs none).
type SumPtrs = (*const i16, *const f32);

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `job` must describe valid buffers.
/// The job must have passed `check_job`, `sums` must be the activations' sums where the format
/// needs them, and `out` must be writable, by this call alone, at rows `job.rows` x the output
/// columns of `job.groups` (what `packed_job` guarantees).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn packed(job: &PackedJob, sums: Option<&ActSums>, out: RawOut) {
    let f = job.w.format;
    let offset = f.offset
        - if signed_values(code::values(f.values)) {
            128
        } else {
            0
        };
    assert!(
        offset == 0 || (offset > 0 && offset.count_ones() == 1),
        "format offset {offset} is not zero or a power of two"
    );
    let s = sums.map_or((std::ptr::null(), std::ptr::null()), |s| {
        (s.s16.as_ptr(), s.sx.as_ptr())
    });
    macro_rules! go {
        ($($v:ident $s:ident),*) => {
            match (code::values(f.values), code::scales(f.scales)) {
                $((code::$v, code::$s) => run::<{ code::$v }, { code::$s }>(job, s, out),)*
                _ => unreachable!("a packed format without a kernel: {f:?}"),
            }
        };
    }
    go!(
        Q4 F16, Q4 F16MIN, Q5 F16, Q5 F16MIN, Q8 F16, Q8 F32SUPER, Q4 K4, Q5 K4, Q6 K6, Q3 K3,
        Q2 K2, IQ4 F16, IQ4 XS
    );
}

/// Activation bytes per panel of rows: a panel stays in the core's L2 cache while every group
/// of the job passes over it (a group's weights stay in L1 across the panel's tiles).
const PANEL_BYTES: usize = 128 << 10;

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run<const V: u8, const S: u8>(job: &PackedJob, sums: SumPtrs, out: RawOut) {
    let panel = (PANEL_BYTES / job.acts.k / ROWS).max(1) * ROWS;
    let mut p0 = job.rows.start;
    while p0 < job.rows.end {
        let rows = (p0 + panel).min(job.rows.end);
        for g in job.groups.clone() {
            let valid = (job.w.n - g * GROUP).min(GROUP);
            let mut m0 = p0;
            while m0 + ROWS <= rows {
                tile::<ROWS, V, S>(job, sums, out, g, m0, valid);
                m0 += ROWS;
            }
            match rows - m0 {
                0 => {}
                1 => tile::<1, V, S>(job, sums, out, g, m0, valid),
                2 => tile::<2, V, S>(job, sums, out, g, m0, valid),
                3 => tile::<3, V, S>(job, sums, out, g, m0, valid),
                4 => tile::<4, V, S>(job, sums, out, g, m0, valid),
                _ => tile::<5, V, S>(job, sums, out, g, m0, valid),
            }
        }
        p0 = rows;
    }
}

/// Shifts each 16-bit lane left by `L` or right by `R` (at most one non-zero); bit planes only
/// move bits within their byte.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn sh<const L: i32, const R: i32>(v: __m256i) -> __m256i {
    if L > 0 {
        _mm256_slli_epi16::<L>(v)
    } else if R > 0 {
        _mm256_srli_epi16::<R>(v)
    } else {
        v
    }
}

/// `a | (b & c)`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn or_and(a: __m256i, b: __m256i, c: __m256i) -> __m256i {
    _mm256_or_si256(a, _mm256_and_si256(b, c))
}

/// Whether the kernel multiplies a format's values re-centred to signed bytes (their stored
/// offset of 128 removed): 8-bit values, and IQ4's table values (up to 241 with the offset, too
/// large for `vpmaddubsw`'s 16-bit pair sums).
const fn signed_values(v: u8) -> bool {
    v == code::Q8 || v == code::IQ4
}

/// The 8 value registers (this half's 32 bytes of each) of the block at `vp` (IQ4: the table's
/// signed values, already re-centred).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn unpack<const V: u8>(vp: *const u8, half: usize) -> [__m256i; 8] {
    let ld = |o: usize| _mm256_loadu_si256(vp.add(o + half * 32) as *const __m256i);
    match V {
        code::Q8 => [
            ld(0),
            ld(64),
            ld(128),
            ld(192),
            ld(256),
            ld(320),
            ld(384),
            ld(448),
        ],
        code::Q4 | code::Q5 | code::Q6 | code::IQ4 => {
            let low = _mm256_set1_epi8(0x0F);
            let mut w = [_mm256_setzero_si256(); 8];
            for j in 0..4 {
                let v = ld(j * 64);
                w[j] = _mm256_and_si256(v, low);
                w[j + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
            }
            if V == code::IQ4 {
                let t = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                    npu_gguf::quants::IQ4_VALUES.as_ptr() as *const __m128i,
                ));
                for wc in w.iter_mut() {
                    *wc = _mm256_shuffle_epi8(t, *wc);
                }
            }
            if V == code::Q5 {
                let (h, b4) = (ld(256), _mm256_set1_epi8(0x10));
                w[0] = or_and(w[0], sh::<4, 0>(h), b4);
                w[1] = or_and(w[1], sh::<3, 0>(h), b4);
                w[2] = or_and(w[2], sh::<2, 0>(h), b4);
                w[3] = or_and(w[3], sh::<1, 0>(h), b4);
                w[4] = or_and(w[4], h, b4);
                w[5] = or_and(w[5], sh::<0, 1>(h), b4);
                w[6] = or_and(w[6], sh::<0, 2>(h), b4);
                w[7] = or_and(w[7], sh::<0, 3>(h), b4);
            } else if V == code::Q6 {
                let b45 = _mm256_set1_epi8(0x30);
                for (p, h) in [ld(256), ld(320)].into_iter().enumerate() {
                    w[4 * p] = or_and(w[4 * p], sh::<4, 0>(h), b45);
                    w[4 * p + 1] = or_and(w[4 * p + 1], sh::<2, 0>(h), b45);
                    w[4 * p + 2] = or_and(w[4 * p + 2], h, b45);
                    w[4 * p + 3] = or_and(w[4 * p + 3], sh::<0, 2>(h), b45);
                }
            }
            w
        }
        _ => {
            let b01 = _mm256_set1_epi8(3);
            let mut w = [_mm256_setzero_si256(); 8];
            for (p, l) in [ld(0), ld(64)].into_iter().enumerate() {
                w[4 * p] = _mm256_and_si256(l, b01);
                w[4 * p + 1] = _mm256_and_si256(sh::<0, 2>(l), b01);
                w[4 * p + 2] = _mm256_and_si256(sh::<0, 4>(l), b01);
                w[4 * p + 3] = _mm256_and_si256(sh::<0, 6>(l), b01);
            }
            if V == code::Q3 {
                let (h, b2) = (ld(128), _mm256_set1_epi8(4));
                w[0] = or_and(w[0], sh::<2, 0>(h), b2);
                w[1] = or_and(w[1], sh::<1, 0>(h), b2);
                w[2] = or_and(w[2], h, b2);
                w[3] = or_and(w[3], sh::<0, 1>(h), b2);
                w[4] = or_and(w[4], sh::<0, 2>(h), b2);
                w[5] = or_and(w[5], sh::<0, 3>(h), b2);
                w[6] = or_and(w[6], sh::<0, 4>(h), b2);
                w[7] = or_and(w[7], sh::<0, 5>(h), b2);
            }
            w
        }
    }
}

/// Sums over 4-byte lanes of u8 x i8 products of registers `w[0..4]` against `x[0..4]`, adding
/// `PAIR` registers' 16-bit sums before widening (4 for values below 32, 2 for 6-bit values).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot4<const PAIR: usize>(w: &[__m256i], x: &[__m256i]) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let p = |c: usize| _mm256_maddubs_epi16(w[c], x[c]);
    if PAIR == 4 {
        let s = _mm256_add_epi16(_mm256_add_epi16(p(0), p(1)), _mm256_add_epi16(p(2), p(3)));
        _mm256_madd_epi16(s, ones)
    } else {
        let s01 = _mm256_madd_epi16(_mm256_add_epi16(p(0), p(1)), ones);
        let s23 = _mm256_madd_epi16(_mm256_add_epi16(p(2), p(3)), ones);
        _mm256_add_epi32(s01, s23)
    }
}

/// Whether a format's block step uses only the sum of its two halves' products (one scale per
/// block and row).
const fn combined(s: u8) -> bool {
    matches!(s, code::F16 | code::F16MIN | code::F32SUPER | code::K4)
}

/// Whether `dots` returns the whole block's product in its first register (and zero in the
/// second): 4-bit values whose block step only needs the sum.
const fn one_sum(v: u8, s: u8) -> bool {
    v == code::Q4 && combined(s)
}

/// Whether a format scales each 16-value half of a block by its own integer (Q6_K, Q3_K, Q2_K).
const fn sub_scaled(s: u8) -> bool {
    matches!(s, code::K6 | code::K3 | code::K2)
}

/// `s0 D0 + s1 D1` for this half's 8 rows: the halves' 16-bit sums are widened by `vpmaddwd`
/// against the scales themselves instead of ones (16-bit scale times 16-bit sum, exact in 32).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scaled_dots<const V: u8>(
    w: &[__m256i; 8],
    x: &[__m256i; 8],
    sc: &BlockScales,
) -> __m256i {
    let p = |c: usize| _mm256_maddubs_epi16(w[c], x[c]);
    let q = |c: usize| _mm256_add_epi16(p(c), p(c + 1));
    if V == code::Q6 {
        // 6-bit values: two 16-bit pair sums of at most 2 * 63 * 127 stay below 2^15.
        _mm256_add_epi32(
            _mm256_add_epi32(
                _mm256_madd_epi16(q(0), sc.sc0),
                _mm256_madd_epi16(q(2), sc.sc0),
            ),
            _mm256_add_epi32(
                _mm256_madd_epi16(q(4), sc.sc1),
                _mm256_madd_epi16(q(6), sc.sc1),
            ),
        )
    } else {
        // Values below 8: four pair sums of at most 2 * 7 * 127 stay below 2^15.
        _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_add_epi16(q(0), q(2)), sc.sc0),
            _mm256_madd_epi16(_mm256_add_epi16(q(4), q(6)), sc.sc1),
        )
    }
}

/// The integer products of the block's two 16-value halves for this half's 8 rows (their sum
/// in the first register, zero in the second, where `one_sum`). For 8-bit values `w` holds the
/// re-centred signed weights and `aw` their magnitudes (unused otherwise).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dots<const V: u8, const S: u8>(
    w: &[__m256i; 8],
    aw: &[__m256i; 8],
    x: &[__m256i; 8],
    sc: &BlockScales,
) -> (__m256i, __m256i) {
    if sub_scaled(S) {
        return (scaled_dots::<V>(w, x, sc), _mm256_setzero_si256());
    }
    match V {
        code::Q8 | code::IQ4 => {
            // |w - 128| <= 128 and |x| <= 127, so a pair's 16-bit sum is at most
            // 2 * 128 * 127 < 2^15: exact. The products are of (w - 128), which `tile` accounts
            // for in the offset.
            let ones = _mm256_set1_epi16(1);
            let p = |c: usize| {
                let pr = _mm256_maddubs_epi16(aw[c], _mm256_sign_epi8(x[c], w[c]));
                _mm256_madd_epi16(pr, ones)
            };
            let half = |c: usize| {
                _mm256_add_epi32(
                    _mm256_add_epi32(p(c), p(c + 1)),
                    _mm256_add_epi32(p(c + 2), p(c + 3)),
                )
            };
            (half(0), half(4))
        }
        code::Q6 => (dot4::<2>(&w[0..4], &x[0..4]), dot4::<2>(&w[4..8], &x[4..8])),
        _ if one_sum(V, S) => {
            // Values below 16: eight 16-bit pair sums of at most 2 * 15 * 127 add up to at most
            // 30,480 < 2^15, exact before one widening.
            let p = |c: usize| _mm256_maddubs_epi16(w[c], x[c]);
            let q = |c: usize| _mm256_add_epi16(p(c), p(c + 1));
            let s = _mm256_add_epi16(_mm256_add_epi16(q(0), q(2)), _mm256_add_epi16(q(4), q(6)));
            (
                _mm256_madd_epi16(s, _mm256_set1_epi16(1)),
                _mm256_setzero_si256(),
            )
        }
        _ => (dot4::<4>(&w[0..4], &x[0..4]), dot4::<4>(&w[4..8], &x[4..8])),
    }
}

/// `-v`, as scalar negation gives it.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn neg(v: __m256) -> __m256 {
    _mm256_xor_ps(v, _mm256_set1_ps(-0.0))
}

/// This half's `d` and `-dmin` from the super-block header at `hp`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn header<const S: u8>(hp: *const u8, half: usize) -> (__m256, __m256) {
    let f16s = |o: usize| _mm256_cvtph_ps(_mm_loadu_si128(hp.add(o + half * 16) as *const __m128i));
    match S {
        code::F32SUPER => (
            _mm256_loadu_ps((hp as *const f32).add(half * 8)),
            _mm256_setzero_ps(),
        ),
        code::K4 | code::K2 => (f16s(0), neg(f16s(32))),
        code::K6 | code::K3 | code::XS => (f16s(0), _mm256_setzero_ps()),
        _ => (_mm256_setzero_ps(), _mm256_setzero_ps()),
    }
}

/// A block's weight-side scales for this half's 8 rows (as the AVX-512 kernel's).
#[derive(Clone, Copy)]
struct BlockScales {
    dw: __m256,
    mw: __m256,
    /// Sub-block scales (Q6_K, Q3_K, Q2_K): each 32-bit lane holds its row's scale of the
    /// first 16 values in both 16-bit halves (`sc0`), likewise for the last 16 (`sc1`).
    sc0: __m256i,
    sc1: __m256i,
    /// Each 32-bit lane holds the pair (first, second) in its 16-bit halves: the scales for
    /// Q6_K/Q3_K (against the activation half-sums, for the offset), the minimums for Q2_K.
    pair: __m256i,
}

/// 32-bit lanes `a` and `b` (each in -32768..32768) as the 16-bit pair (a, b) of each lane.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pair16(a: __m256i, b: __m256i) -> __m256i {
    _mm256_or_si256(
        _mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)),
        _mm256_slli_epi32::<16>(b),
    )
}

/// Eight bytes at `p` widened to 32-bit lanes, unsigned.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bytes8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn block_scales<const S: u8>(
    sp: *const u8,
    half: usize,
    hd: __m256,
    hm: __m256,
) -> BlockScales {
    let z = _mm256_setzero_si256();
    let mut s = BlockScales {
        dw: hd,
        mw: hm,
        sc0: z,
        sc1: z,
        pair: z,
    };
    let f16s = |o: usize| _mm256_cvtph_ps(_mm_loadu_si128(sp.add(o + half * 16) as *const __m128i));
    // The two 6-bit numbers of this half's rows (K4/K3).
    let pairs = || {
        let b = bytes8(sp.add(half * 8));
        let nib = bytes8(sp.add(16));
        let nib = if half == 0 {
            _mm256_and_si256(nib, _mm256_set1_epi32(15))
        } else {
            _mm256_srli_epi32::<4>(nib)
        };
        let first = _mm256_and_si256(b, _mm256_set1_epi32(63));
        let second = _mm256_or_si256(
            nib,
            _mm256_and_si256(_mm256_srli_epi32::<2>(b), _mm256_set1_epi32(0x30)),
        );
        (first, second)
    };
    match S {
        code::F16 => s.dw = f16s(0),
        code::F16MIN => {
            s.dw = f16s(0);
            s.mw = f16s(32);
        }
        code::K4 => {
            let (sc, m) = pairs();
            s.dw = _mm256_mul_ps(_mm256_cvtepi32_ps(sc), hd);
            s.mw = _mm256_mul_ps(_mm256_cvtepi32_ps(m), hm);
        }
        code::K3 => {
            let (s0, s1) = pairs();
            let (s0, s1) = (
                _mm256_sub_epi32(s0, _mm256_set1_epi32(32)),
                _mm256_sub_epi32(s1, _mm256_set1_epi32(32)),
            );
            (s.sc0, s.sc1, s.pair) = (pair16(s0, s0), pair16(s1, s1), pair16(s0, s1));
        }
        code::K6 => {
            let s0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sp.add(half * 8) as *const __m128i));
            let s1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sp.add(16 + half * 8) as *const __m128i));
            (s.sc0, s.sc1, s.pair) = (pair16(s0, s0), pair16(s1, s1), pair16(s0, s1));
        }
        code::XS => {
            // This half's rows: nibble `half` of bytes 0..8, and 2-bit fields of bytes
            // 8 + 2 half, 9 + 2 half (rows 8 half + r at bits 2r of their 16-bit word).
            let low = bytes8(sp);
            let low = if half == 0 {
                _mm256_and_si256(low, _mm256_set1_epi32(15))
            } else {
                _mm256_srli_epi32::<4>(low)
            };
            let word = (sp.add(8 + 2 * half) as *const u16).read_unaligned() as i32;
            let high = _mm256_and_si256(
                _mm256_srlv_epi32(
                    _mm256_set1_epi32(word),
                    _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14),
                ),
                _mm256_set1_epi32(3),
            );
            let sc = _mm256_sub_epi32(
                _mm256_or_si256(low, _mm256_slli_epi32::<4>(high)),
                _mm256_set1_epi32(32),
            );
            // d (s - 32), exact in f32.
            s.dw = _mm256_mul_ps(_mm256_cvtepi32_ps(sc), hd);
        }
        code::K2 => {
            let (b0, b1) = (bytes8(sp.add(half * 8)), bytes8(sp.add(16 + half * 8)));
            let low = _mm256_set1_epi32(15);
            let (s0, s1) = (_mm256_and_si256(b0, low), _mm256_and_si256(b1, low));
            s.sc0 = pair16(s0, s0);
            s.sc1 = pair16(s1, s1);
            s.pair = pair16(_mm256_srli_epi32::<4>(b0), _mm256_srli_epi32::<4>(b1));
        }
        _ => {}
    }
    s
}

/// A format's offset as the kernels subtract it: `offset * v` is `v` shifted left by `shift`
/// (every format's offset is zero or a power of two; `packed` checks).
#[derive(Clone, Copy)]
struct Offset {
    nonzero: bool,
    shift: __m128i,
}

impl Offset {
    /// `offset * v` in every lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn times(self, v: i32) -> __m256i {
        _mm256_sll_epi32(_mm256_set1_epi32(v), self.shift)
    }
}

/// One block's contribution to one output row's half (the scalar kernel's `block_step`).
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_step<const V: u8, const S: u8>(
    s: &BlockScales,
    off: Offset,
    i0: __m256i,
    i1: __m256i,
    a: (*const f32, *const f32, *const i32),
    sums: SumPtrs,
    blk: usize,
    acc: __m256,
) -> __m256 {
    let (xd, xs, xsum) = a;
    let xdv = _mm256_set1_ps(*xd.add(blk));
    let whole = || {
        if one_sum(V, S) {
            i0
        } else {
            _mm256_add_epi32(i0, i1)
        }
    };
    match S {
        code::F16 | code::F16MIN | code::F32SUPER | code::XS => {
            let mut ia = whole();
            if off.nonzero {
                ia = _mm256_sub_epi32(ia, off.times(*xsum.add(blk)));
            }
            let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(s.dw, xdv), acc);
            if S == code::F16MIN {
                _mm256_fmadd_ps(s.mw, _mm256_set1_ps(*xs.add(blk)), acc)
            } else {
                acc
            }
        }
        code::K4 => {
            let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(whole()), _mm256_mul_ps(s.dw, xdv), acc);
            _mm256_fmadd_ps(s.mw, _mm256_set1_ps(*sums.1.add(blk)), acc)
        }
        code::K6 | code::K3 => {
            // s0 (D0 - offset S0) + s1 (D1 - offset S1), with `i0` = s0 D0 + s1 D1 and the
            // scale pairs against the half-sum pair (S0, S1) in one `vpmaddwd`.
            let ss = _mm256_madd_epi16(s.pair, half_sums(sums, blk));
            let ia = _mm256_sub_epi32(i0, _mm256_sll_epi32(ss, off.shift));
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(s.dw, xdv), acc)
        }
        _ => {
            // Q2_K: `i0` = s0 D0 + s1 D1; the minimums m0 S0 + m1 S1 in one `vpmaddwd`.
            let im = _mm256_madd_epi16(s.pair, half_sums(sums, blk));
            let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(s.dw, xdv), acc);
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(s.mw, xdv), acc)
        }
    }
}

/// The activation block's two 16-value sums (S0, S1) as the 16-bit pair of every lane.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn half_sums(sums: SumPtrs, blk: usize) -> __m256i {
    _mm256_set1_epi32((sums.0.add(2 * blk) as *const i32).read_unaligned())
}

/// Rows `m0..m0 + R` against group `g`, one half (8 output columns) at a time: the half's
/// weights are unpacked once per block into registers and used for all `R` rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const V: u8, const S: u8>(
    job: &PackedJob,
    sums: SumPtrs,
    out: RawOut,
    g: usize,
    m0: usize,
    valid: usize,
) {
    let w = job.w;
    let a = job.acts;
    let k = a.k;
    let nb = k / QBLOCK;
    let lay = code::Layout::of(V, S);
    let (bps, super_bytes) = (lay.bps, lay.super_bytes);
    // `dots` gives 8-bit values' products already re-centred by 128.
    let offset = w.format.offset - if signed_values(V) { 128 } else { 0 };
    let off = Offset {
        nonzero: offset != 0,
        shift: _mm_cvtsi32_si128(offset.trailing_zeros() as i32),
    };
    let gd = w.group_data(g).as_ptr();
    let xa = (a.d.as_ptr(), a.s.as_ptr(), a.isum.as_ptr());
    for half in 0..2 {
        let mut acc = [_mm256_setzero_ps(); R];
        for sup in 0..nb / bps {
            let base = gd.add(sup * super_bytes);
            let (hd, hm) = header::<S>(base, half);
            for j in 0..bps {
                let b = sup * bps + j;
                let mut wv = unpack::<V>(base.add(lay.values_at(j)), half);
                // 8-bit values: re-centred to signed bytes (w - 128, the top bit flipped); with
                // IQ4's (signed already), their magnitudes, once for all rows.
                let mut aw = wv;
                if signed_values(V) {
                    for (w, a) in wv.iter_mut().zip(aw.iter_mut()) {
                        if V == code::Q8 {
                            *w = _mm256_xor_si256(*w, _mm256_set1_epi8(i8::MIN));
                        }
                        *a = _mm256_abs_epi8(*w);
                    }
                }
                let s = block_scales::<S>(base.add(lay.scales_at(j)), half, hd, hm);
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let row = m0 + r;
                    let xq = a.qs.as_ptr().add(row * k + b * QBLOCK) as *const i32;
                    let mut xv = [_mm256_setzero_si256(); 8];
                    for (c, xc) in xv.iter_mut().enumerate() {
                        *xc = _mm256_set1_epi32(xq.add(c).read_unaligned());
                    }
                    let (i0, i1) = dots::<V, S>(&wv, &aw, &xv, &s);
                    *acc_r = block_step::<V, S>(&s, off, i0, i1, xa, sums, row * nb + b, *acc_r);
                }
            }
        }
        let cols = valid.saturating_sub(half * 8).min(8);
        for (r, acc_r) in acc.iter().enumerate() {
            let dst = out.base.add((m0 + r) * out.ld + g * GROUP + half * 8);
            if cols == 8 {
                _mm256_storeu_ps(dst, *acc_r);
            } else {
                let mut tmp = [0f32; 8];
                _mm256_storeu_ps(tmp.as_mut_ptr(), *acc_r);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, cols);
            }
        }
    }
}

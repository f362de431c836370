//! AVX-512 VNNI packed matmul. One 512-bit register holds 4 consecutive values of each of the 16
//! rows of a group, so `vpdpbusd` against a broadcast 4-byte slice of one activation row gives 16
//! partial dot products at once; a block's 8 registers are unpacked once (nibbles, bit planes)
//! and reused for up to `MR` activation rows, and so are its scales (the K-quants' 6-bit, 8-bit
//! or 4-bit integer scales widened in registers, never in memory). The arithmetic is the scalar
//! kernel's, in its order.

use std::arch::x86_64::*;

use super::{avx512_wide, PackedJob, RawOut};

/// Activation rows per tile: one block's unpacked values and scales serve 4 rows. More rows
/// amortize the unpacking further and ran faster alone on one matrix, but inside a model step
/// tiles of 6, 8, 12 and 16 rows measured 25-40% slower than 4 (registers run out: accumulators,
/// value registers and scales spill to the stack), and 5 no faster than 4.
const MR: usize = 4;
use crate::quant::acts::{ActSums, QBLOCK};
use crate::quant::packed::{code, GROUP};

/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, FMA and F16C; `job` must describe valid buffers.
/// The job must have passed `check_job`, `sums` must be the activations' sums where the format
/// needs them (what `job_sums` gives), and `out` must be writable, by this call alone, at rows
/// `job.rows` x the output columns of `job.groups` (what `packed_job` guarantees).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub unsafe fn packed(job: &PackedJob, sums: Option<&ActSums>, out: RawOut) {
    let f = job.w.format;
    let s = sum_ptrs(sums);
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

/// The activations' per-16 sums and exact block sums (null where the format needs none).
pub(crate) type SumPtrs = (*const i16, *const f32);

/// The pointers the kernels read the activation sums through (null where there are none).
pub(crate) fn sum_ptrs(sums: Option<&ActSums>) -> SumPtrs {
    sums.map_or((std::ptr::null(), std::ptr::null()), |s| {
        (s.s16.as_ptr(), s.sx.as_ptr())
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn run<const V: u8, const S: u8>(job: &PackedJob, sums: SumPtrs, out: RawOut) {
    let rows = job.rows.end;
    let first = |m0: usize| m0 == job.rows.start;
    let mask_of = |g: usize| -> __mmask16 {
        let valid = (job.w.n - g * GROUP).min(GROUP);
        if valid == GROUP {
            0xFFFF
        } else {
            ((1u32 << valid) - 1) as u16
        }
    };
    let mut g = job.groups.start;
    let group_bytes = job.w.group_bytes();
    // Pairs of groups on the two-group kernel where it serves the format and the rows are many
    // enough for the products to set the pace (see `avx512_wide::MIN_ROWS`).
    if avx512_wide::serves(V, S) && job.rows.len() >= avx512_wide::MIN_ROWS {
        while g + 2 <= job.groups.end {
            let masks = [mask_of(g), mask_of(g + 1)];
            let next = job.w.data().as_ptr().wrapping_add((g + 2) * group_bytes);
            let ahead =
                |m0: usize| avx512_wide::Ahead::of(next, 2 * group_bytes, job.rows.clone(), 4, m0);
            let mut m0 = job.rows.start;
            while m0 + 4 <= rows {
                let f = first(m0);
                avx512_wide::tile2::<4, V, S>(job, sums, out, g, m0, masks, f, ahead(m0));
                m0 += 4;
            }
            let (f, ah) = (first(m0), ahead(m0));
            match rows - m0 {
                1 => avx512_wide::tile2::<1, V, S>(job, sums, out, g, m0, masks, f, ah),
                2 => avx512_wide::tile2::<2, V, S>(job, sums, out, g, m0, masks, f, ah),
                3 => avx512_wide::tile2::<3, V, S>(job, sums, out, g, m0, masks, f, ah),
                _ => {}
            }
            g += 2;
        }
    }
    for g in g..job.groups.end {
        let mask = mask_of(g);
        let mut m0 = job.rows.start;
        while m0 + MR <= rows {
            tile::<MR, V, S>(job, sums, out, g, m0, mask, first(m0));
            m0 += MR;
        }
        match rows - m0 {
            1 => tile::<1, V, S>(job, sums, out, g, m0, mask, first(m0)),
            2 => tile::<2, V, S>(job, sums, out, g, m0, mask, first(m0)),
            3 => tile::<3, V, S>(job, sums, out, g, m0, mask, first(m0)),
            _ => {}
        }
    }
}

/// Bytes ahead of the current block to prefetch: `block` bytes times the distance in blocks
/// (`super::prefetch_blocks`).
#[inline]
pub(crate) fn prefetch_distance(block: usize) -> usize {
    block * super::prefetch_blocks()
}

/// Shifts each 16-bit lane left by `L` or right by `R` (at most one non-zero). The bit planes
/// only ever move a bit within its own byte, so 16-bit shifts serve as byte shifts.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn sh<const L: u32, const R: u32>(v: __m512i) -> __m512i {
    if L > 0 {
        _mm512_slli_epi16::<L>(v)
    } else if R > 0 {
        _mm512_srli_epi16::<R>(v)
    } else {
        v
    }
}

/// `a | (b & c)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn or_and(a: __m512i, b: __m512i, c: __m512i) -> __m512i {
    _mm512_ternarylogic_epi32::<0xF8>(a, b, c)
}

/// The 8 value registers of the block at `vp` (unsigned bytes; see `packed`'s module doc).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn unpack<const V: u8>(vp: *const u8) -> [__m512i; 8] {
    let ld = |o: usize| _mm512_loadu_si512(vp.add(o) as *const _);
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
            let low = _mm512_set1_epi8(0x0F);
            let (v0, v1, v2, v3) = (ld(0), ld(64), ld(128), ld(192));
            let mut w = [
                _mm512_and_si512(v0, low),
                _mm512_and_si512(v1, low),
                _mm512_and_si512(v2, low),
                _mm512_and_si512(v3, low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v0), low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v1), low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v2), low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v3), low),
            ];
            if V == code::Q5 {
                // Bit c of the plane is bit 4 of register c.
                let (h, b4) = (ld(256), _mm512_set1_epi8(0x10));
                w[0] = or_and(w[0], sh::<4, 0>(h), b4);
                w[1] = or_and(w[1], sh::<3, 0>(h), b4);
                w[2] = or_and(w[2], sh::<2, 0>(h), b4);
                w[3] = or_and(w[3], sh::<1, 0>(h), b4);
                w[4] = or_and(w[4], h, b4);
                w[5] = or_and(w[5], sh::<0, 1>(h), b4);
                w[6] = or_and(w[6], sh::<0, 2>(h), b4);
                w[7] = or_and(w[7], sh::<0, 3>(h), b4);
            } else if V == code::Q6 {
                // Bits 2(c % 4).. of plane c / 4 are bits 4-5 of register c.
                let b45 = _mm512_set1_epi8(0x30);
                for (p, h) in [ld(256), ld(320)].into_iter().enumerate() {
                    w[4 * p] = or_and(w[4 * p], sh::<4, 0>(h), b45);
                    w[4 * p + 1] = or_and(w[4 * p + 1], sh::<2, 0>(h), b45);
                    w[4 * p + 2] = or_and(w[4 * p + 2], h, b45);
                    w[4 * p + 3] = or_and(w[4 * p + 3], sh::<0, 2>(h), b45);
                }
            } else if V == code::IQ4 {
                // Each nibble indexes the table (its values plus 128, so unsigned).
                let t = iq4_table();
                for wc in w.iter_mut() {
                    *wc = _mm512_shuffle_epi8(t, *wc);
                }
            }
            w
        }
        _ => {
            // Q2/Q3: bits 2(c % 4).. of plane c / 4 are bits 0-1 of register c.
            let b01 = _mm512_set1_epi8(3);
            let mut w = [_mm512_setzero_si512(); 8];
            for (p, l) in [ld(0), ld(64)].into_iter().enumerate() {
                w[4 * p] = _mm512_and_si512(l, b01);
                w[4 * p + 1] = _mm512_and_si512(sh::<0, 2>(l), b01);
                w[4 * p + 2] = _mm512_and_si512(sh::<0, 4>(l), b01);
                w[4 * p + 3] = _mm512_and_si512(sh::<0, 6>(l), b01);
            }
            if V == code::Q3 {
                // Bit c of the plane is bit 2 of register c.
                let (h, b2) = (ld(128), _mm512_set1_epi8(4));
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

/// IQ4_NL's table of values plus 128, in each 128-bit lane (for `vpshufb` by nibble).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn iq4_table() -> __m512i {
    let t: [u8; 16] = std::array::from_fn(|i| (npu_gguf::quants::IQ4_VALUES[i] as i32 + 128) as u8);
    _mm512_broadcast_i32x4(_mm_loadu_si128(t.as_ptr() as *const __m128i))
}

/// A block's weight-side scales for the 16 rows, as the epilogue takes them.
#[derive(Clone, Copy)]
pub(crate) struct BlockScales {
    /// `d` (per-block formats, and the header `d` of K6/K3/K2) or `d s` (K4).
    pub dw: __m512,
    /// `m` (F16Min), `-dmin m` (K4) or `-dmin` (K2).
    pub mw: __m512,
    pub sc0: __m512i,
    pub sc1: __m512i,
    pub mn0: __m512i,
    pub mn1: __m512i,
    /// Two 16-bit numbers per row for one `vpdpwssd` against the activations' pair of half sums:
    /// `-offset s0`, `-offset s1` (K6, K3) or `m0`, `m1` (K2).
    pub pairs: __m512i,
}

/// The two 6-bit numbers of each row in a K4/K3 scale field at `sp`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn six_bit_pairs(sp: *const u8) -> (__m512i, __m512i) {
    let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(sp as *const __m128i));
    let first = _mm512_and_si512(b, _mm512_set1_epi32(63));
    // Rows 0..8 take the low nibbles of bytes 16..24, rows 8..16 the high ones.
    let lo8 = _mm_loadl_epi64(sp.add(16) as *const __m128i);
    let nib = _mm512_srlv_epi32(
        _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo8, lo8)),
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4),
    );
    let second = _mm512_or_si512(
        _mm512_and_si512(nib, _mm512_set1_epi32(15)),
        _mm512_and_si512(_mm512_srli_epi32::<2>(b), _mm512_set1_epi32(0x30)),
    );
    (first, second)
}

/// `-v`, as scalar negation gives it (the sign bit flipped).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn neg(v: __m512) -> __m512 {
    _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(v),
        _mm512_set1_epi32(i32::MIN),
    ))
}

/// The header of the super-block at `hp`: `d` and `-dmin` (zero where the format has none).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
pub(crate) unsafe fn header<const S: u8>(hp: *const u8) -> (__m512, __m512) {
    let f16s = |o: usize| _mm512_cvtph_ps(_mm256_loadu_si256(hp.add(o) as *const __m256i));
    match S {
        code::F32SUPER => (_mm512_loadu_ps(hp as *const f32), _mm512_setzero_ps()),
        code::K4 | code::K2 => (f16s(0), neg(f16s(32))),
        code::K6 | code::K3 | code::XS => (f16s(0), _mm512_setzero_ps()),
        _ => (_mm512_setzero_ps(), _mm512_setzero_ps()),
    }
}

/// The scales of the block whose scale fields are at `sp`, in the super-block with header `hd`
/// (`d`) and `hm` (`-dmin`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
pub(crate) unsafe fn block_scales<const S: u8>(
    sp: *const u8,
    hd: __m512,
    hm: __m512,
    offset: i32,
) -> BlockScales {
    let z = _mm512_setzero_si512();
    let mut s = BlockScales {
        dw: hd,
        mw: hm,
        sc0: z,
        sc1: z,
        mn0: z,
        mn1: z,
        pairs: z,
    };
    // Two 32-bit lanes' low halves as one lane's 16-bit pair.
    let pack = |lo: __m512i, hi: __m512i| {
        _mm512_or_si512(
            _mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)),
            _mm512_slli_epi32::<16>(hi),
        )
    };
    let neg_off = _mm512_set1_epi32(-offset);
    let f16s = |o: usize| _mm512_cvtph_ps(_mm256_loadu_si256(sp.add(o) as *const __m256i));
    let bytes = |o: usize| _mm512_cvtepu8_epi32(_mm_loadu_si128(sp.add(o) as *const __m128i));
    match S {
        code::F16 => s.dw = f16s(0),
        code::F16MIN => {
            s.dw = f16s(0);
            s.mw = f16s(32);
        }
        code::K4 => {
            let (sc, m) = six_bit_pairs(sp);
            s.dw = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), hd);
            s.mw = _mm512_mul_ps(_mm512_cvtepi32_ps(m), hm);
        }
        code::K3 => {
            let (s0, s1) = six_bit_pairs(sp);
            s.sc0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(32));
            s.sc1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(32));
            s.pairs = pack(
                _mm512_mullo_epi32(s.sc0, neg_off),
                _mm512_mullo_epi32(s.sc1, neg_off),
            );
        }
        code::K6 => {
            s.sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(sp as *const __m128i));
            s.sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(sp.add(16) as *const __m128i));
            s.pairs = pack(
                _mm512_mullo_epi32(s.sc0, neg_off),
                _mm512_mullo_epi32(s.sc1, neg_off),
            );
        }
        code::XS => {
            // Low nibbles of bytes 0..8 (rows 0..8) and their high nibbles (rows 8..16), and the
            // high 2 bits of row i at bits 2i of the 32-bit word at byte 8.
            let lo8 = _mm_loadl_epi64(sp as *const __m128i);
            let low = _mm512_and_si512(
                _mm512_srlv_epi32(
                    _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo8, lo8)),
                    _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4),
                ),
                _mm512_set1_epi32(15),
            );
            let high = _mm512_and_si512(
                _mm512_srlv_epi32(
                    _mm512_set1_epi32((sp.add(8) as *const i32).read_unaligned()),
                    _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                ),
                _mm512_set1_epi32(3),
            );
            let sc = _mm512_sub_epi32(
                _mm512_or_si512(low, _mm512_slli_epi32::<4>(high)),
                _mm512_set1_epi32(32),
            );
            // d (s - 32), exact in f32.
            s.dw = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), hd);
        }
        code::K2 => {
            let (b0, b1) = (bytes(0), bytes(16));
            let low = _mm512_set1_epi32(15);
            s.sc0 = _mm512_and_si512(b0, low);
            s.sc1 = _mm512_and_si512(b1, low);
            s.mn0 = _mm512_srli_epi32::<4>(b0);
            s.mn1 = _mm512_srli_epi32::<4>(b1);
            s.pairs = pack(s.mn0, s.mn1);
        }
        _ => {}
    }
    s
}

/// One block's contribution to one output row (the scalar kernel's `block_step`): `i0`, `i1` the
/// integer products of the block's halves, `blk` the activation block's index.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn block_step<const S: u8>(
    s: &BlockScales,
    offset: i32,
    i0: __m512i,
    i1: __m512i,
    a: (*const f32, *const f32, *const i32),
    sums: SumPtrs,
    blk: usize,
    acc: __m512,
) -> __m512 {
    let (xd, xs, xsum) = a;
    let xdv = _mm512_set1_ps(*xd.add(blk));
    match S {
        code::F16 | code::F16MIN | code::F32SUPER | code::XS => {
            let mut ia = _mm512_add_epi32(i0, i1);
            if offset != 0 {
                ia = _mm512_sub_epi32(ia, _mm512_set1_epi32(offset * *xsum.add(blk)));
            }
            let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(s.dw, xdv), acc);
            if S == code::F16MIN {
                _mm512_fmadd_ps(s.mw, _mm512_set1_ps(*xs.add(blk)), acc)
            } else {
                acc
            }
        }
        code::K4 => {
            let ia = _mm512_add_epi32(i0, i1);
            let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(s.dw, xdv), acc);
            _mm512_fmadd_ps(s.mw, _mm512_set1_ps(*sums.1.add(blk)), acc)
        }
        code::K6 | code::K3 => {
            // s0 (i0 - offset S0) + s1 (i1 - offset S1): the offset terms in one vpdpwssd of
            // the rows' (-offset s0, -offset s1) against the half sums (S0, S1).
            let hs = _mm512_set1_epi32((sums.0.add(2 * blk) as *const i32).read_unaligned());
            let ia = _mm512_add_epi32(_mm512_mullo_epi32(s.sc0, i0), _mm512_mullo_epi32(s.sc1, i1));
            let ia = _mm512_dpwssd_epi32(ia, s.pairs, hs);
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(s.dw, xdv), acc)
        }
        _ => {
            // K2: the minimums' m0 S0 + m1 S1 in one vpdpwssd.
            let hs = _mm512_set1_epi32((sums.0.add(2 * blk) as *const i32).read_unaligned());
            let ia = _mm512_add_epi32(_mm512_mullo_epi32(s.sc0, i0), _mm512_mullo_epi32(s.sc1, i1));
            let im = _mm512_dpwssd_epi32(_mm512_setzero_si512(), s.pairs, hs);
            let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(s.dw, xdv), acc);
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(im), _mm512_mul_ps(s.mw, xdv), acc)
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize, const V: u8, const S: u8>(
    job: &PackedJob,
    sums: SumPtrs,
    out: RawOut,
    g: usize,
    m0: usize,
    mask: __mmask16,
    first_pass: bool,
) {
    let w = job.w;
    let a = job.acts;
    let k = a.k;
    let nb = k / QBLOCK;
    let lay = code::Layout::of(V, S);
    let (bps, super_bytes) = (lay.bps, lay.super_bytes);
    let offset = w.format.offset;
    let gd = w.group_data(g).as_ptr();
    let qs = a.qs.as_ptr();
    let xa = (a.d.as_ptr(), a.s.as_ptr(), a.isum.as_ptr());
    // Room for the most rows a tile takes (rows R.. stay unused, and vanish at compile time).
    const { assert!(R <= 8) };
    let mut acc = [_mm512_setzero_ps(); 8];
    // Weights stream from memory once per step: ask for the bytes ahead early (a prefetch never
    // faults; the address may lie past the matrix, so it is formed with wrapping arithmetic and
    // never dereferenced). Only the group's first pass over its rows asks: later passes find the
    // lines asked for already, and the requests would only take load slots.
    let pf_dist = prefetch_distance(super_bytes / bps);
    let mut pf_next = pf_dist;
    for sup in 0..nb / bps {
        let base = gd.add(sup * super_bytes);
        let (hd, hm) = header::<S>(base);
        for j in 0..bps {
            let b = sup * bps + j;
            if first_pass {
                let end = (b + 1) * super_bytes / bps + pf_dist;
                while pf_next < end {
                    _mm_prefetch::<_MM_HINT_T1>(gd.wrapping_add(pf_next) as *const i8);
                    pf_next += 64;
                }
            }
            let wv = unpack::<V>(base.add(lay.values_at(j)));
            let s = block_scales::<S>(base.add(lay.scales_at(j)), hd, hm, offset);
            // The rows written out one by one (a loop over the rows is not always unrolled, and
            // then the accumulators live on the stack), each under a test `R` decides at compile
            // time.
            macro_rules! rows {
                ($($r:literal)*) => {$(
                    if $r < R {
                        let row = m0 + $r;
                        let xq = qs.add(row * k + b * QBLOCK) as *const i32;
                        let x = |c: usize| _mm512_set1_epi32(xq.add(c).read_unaligned());
                        let mut i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], x(0));
                        let mut i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[4], x(4));
                        i0 = _mm512_dpbusd_epi32(i0, wv[1], x(1));
                        i1 = _mm512_dpbusd_epi32(i1, wv[5], x(5));
                        i0 = _mm512_dpbusd_epi32(i0, wv[2], x(2));
                        i1 = _mm512_dpbusd_epi32(i1, wv[6], x(6));
                        i0 = _mm512_dpbusd_epi32(i0, wv[3], x(3));
                        i1 = _mm512_dpbusd_epi32(i1, wv[7], x(7));
                        acc[$r] =
                            block_step::<S>(&s, offset, i0, i1, xa, sums, row * nb + b, acc[$r]);
                    }
                )*};
            }
            rows!(0 1 2 3 4 5 6 7);
        }
    }
    for (r, acc_r) in acc.iter().enumerate().take(R) {
        let dst = out.base.add((m0 + r) * out.ld + g * GROUP);
        _mm512_mask_storeu_ps(dst, mask, *acc_r);
    }
}

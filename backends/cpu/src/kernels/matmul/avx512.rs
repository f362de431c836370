//! AVX-512 VNNI packed matmul. One 512-bit register holds 4 consecutive values of each of the 16
//! rows of a group, so `vpdpbusd` against a broadcast 4-byte slice of one activation row gives 16
//! partial dot products at once; a block's 8 registers are unpacked once and reused for up to
//! `MR` activation rows.

use std::arch::x86_64::*;

use super::{PackedJob, RawOut, MR};
use crate::quant::acts::QBLOCK;
use crate::quant::packed::{PackKind, GROUP};

/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, FMA and F16C; `job` must describe valid buffers.
/// The job must have passed `check_job`, and `out` must be writable, by this call alone, at rows
/// `job.rows` x the output columns of `job.groups` (what `packed_job` guarantees).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub unsafe fn packed(job: &PackedJob, out: RawOut) {
    let f = job.w.format;
    match (f.kind == PackKind::Nibble, f.f16_scales, f.has_min) {
        (true, true, true) => run::<true, true, true>(job, out),
        (true, true, false) => run::<true, true, false>(job, out),
        (true, false, true) => run::<true, false, true>(job, out),
        (true, false, false) => run::<true, false, false>(job, out),
        (false, true, true) => run::<false, true, true>(job, out),
        (false, true, false) => run::<false, true, false>(job, out),
        (false, false, true) => run::<false, false, true>(job, out),
        (false, false, false) => run::<false, false, false>(job, out),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn run<const NIB: bool, const F16S: bool, const MIN: bool>(job: &PackedJob, out: RawOut) {
    let rows = job.rows.end;
    for g in job.groups.clone() {
        let valid = (job.w.n - g * GROUP).min(GROUP);
        let mask: __mmask16 = if valid == GROUP {
            0xFFFF
        } else {
            ((1u32 << valid) - 1) as u16
        };
        let mut m0 = job.rows.start;
        while m0 + MR <= rows {
            tile::<MR, NIB, F16S, MIN>(job, out, g, m0, mask, m0 == job.rows.start);
            m0 += MR;
        }
        match rows - m0 {
            1 => tile::<1, NIB, F16S, MIN>(job, out, g, m0, mask, m0 == job.rows.start),
            2 => tile::<2, NIB, F16S, MIN>(job, out, g, m0, mask, m0 == job.rows.start),
            3 => tile::<3, NIB, F16S, MIN>(job, out, g, m0, mask, m0 == job.rows.start),
            4 => tile::<4, NIB, F16S, MIN>(job, out, g, m0, mask, m0 == job.rows.start),
            5 => tile::<5, NIB, F16S, MIN>(job, out, g, m0, mask, m0 == job.rows.start),
            6 => tile::<6, NIB, F16S, MIN>(job, out, g, m0, mask, m0 == job.rows.start),
            7 => tile::<7, NIB, F16S, MIN>(job, out, g, m0, mask, m0 == job.rows.start),
            _ => {}
        }
    }
}

/// Bytes ahead of the current unit to prefetch (a tunable, `NPU_SERVING_PREFETCH` in units).
fn prefetch_distance(unit: usize) -> usize {
    static UNITS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    unit * *UNITS.get_or_init(|| {
        std::env::var("NPU_SERVING_PREFETCH")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(32)
    })
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn tile<const R: usize, const NIB: bool, const F16S: bool, const MIN: bool>(
    job: &PackedJob,
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
    let unit = w.format.unit_bytes();
    let vb = w.format.values_bytes();
    let sb = w.format.scale_bytes();
    let offset = w.format.offset;
    let gd = w.group_data(g).as_ptr();
    let qs = a.qs.as_ptr();
    let xd = a.d.as_ptr();
    let xs = a.s.as_ptr();
    let xsum = a.isum.as_ptr();
    let low = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); R];
    // Only the group's first pass over its rows asks for the units ahead: later passes find
    // them asked for already, and the requests would only take load slots.
    let pf_dist = prefetch_distance(unit);
    let pf_bytes = if first_pass { unit } else { 0 };
    for b in 0..nb {
        let u = gd.add(b * unit);
        // Weights stream from memory once per step: ask for the units ahead early (a prefetch
        // never faults; the address may lie past the matrix, so it is formed with wrapping
        // arithmetic and never dereferenced).
        let mut l = 0;
        while l < pf_bytes {
            _mm_prefetch::<_MM_HINT_T1>(u.wrapping_add(pf_dist + l) as *const i8);
            l += 64;
        }
        let wv: [__m512i; 8] = if NIB {
            let v0 = _mm512_loadu_si512(u as *const _);
            let v1 = _mm512_loadu_si512(u.add(64) as *const _);
            let v2 = _mm512_loadu_si512(u.add(128) as *const _);
            let v3 = _mm512_loadu_si512(u.add(192) as *const _);
            [
                _mm512_and_si512(v0, low),
                _mm512_and_si512(v1, low),
                _mm512_and_si512(v2, low),
                _mm512_and_si512(v3, low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v0), low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v1), low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v2), low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v3), low),
            ]
        } else {
            let mut v = [_mm512_setzero_si512(); 8];
            for (c, vc) in v.iter_mut().enumerate() {
                *vc = _mm512_loadu_si512(u.add(c * 64) as *const _);
            }
            v
        };
        let dw = if F16S {
            _mm512_cvtph_ps(_mm256_loadu_si256(u.add(vb) as *const __m256i))
        } else {
            _mm512_loadu_ps(u.add(vb) as *const f32)
        };
        let mw = if MIN {
            if F16S {
                _mm512_cvtph_ps(_mm256_loadu_si256(u.add(vb + sb) as *const __m256i))
            } else {
                _mm512_loadu_ps(u.add(vb + sb) as *const f32)
            }
        } else {
            _mm512_setzero_ps()
        };
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let row = m0 + r;
            let xq = qs.add(row * k + b * QBLOCK) as *const i32;
            let x = |c: usize| _mm512_set1_epi32(xq.add(c).read_unaligned());
            let mut i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], x(0));
            let mut i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[1], x(1));
            i0 = _mm512_dpbusd_epi32(i0, wv[2], x(2));
            i1 = _mm512_dpbusd_epi32(i1, wv[3], x(3));
            i0 = _mm512_dpbusd_epi32(i0, wv[4], x(4));
            i1 = _mm512_dpbusd_epi32(i1, wv[5], x(5));
            i0 = _mm512_dpbusd_epi32(i0, wv[6], x(6));
            i1 = _mm512_dpbusd_epi32(i1, wv[7], x(7));
            let mut ia = _mm512_add_epi32(i0, i1);
            let blk = row * nb + b;
            if offset != 0 {
                ia = _mm512_sub_epi32(ia, _mm512_set1_epi32(offset * *xsum.add(blk)));
            }
            let sc = _mm512_mul_ps(dw, _mm512_set1_ps(*xd.add(blk)));
            *acc_r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), sc, *acc_r);
            if MIN {
                *acc_r = _mm512_fmadd_ps(mw, _mm512_set1_ps(*xs.add(blk)), *acc_r);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let dst = out.base.add((m0 + r) * out.ld + g * GROUP);
        _mm512_mask_storeu_ps(dst, mask, *acc_r);
    }
}

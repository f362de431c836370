//! The K-quant quantizers (Q4_K, Q5_K, Q6_K) of `quantize`: llama.cpp's `make_qkx2_quants` scale
//! search in two forms — a plain per-sub-block port (the reference) and an 8-lane form that runs
//! the 8 sub-blocks of a super-block side by side, each lane doing exactly the reference's
//! operations in the reference's order, so that vectorizing it (AVX2 when the CPU has it, chosen
//! at run time; SSE2/NEON width otherwise) changes no bit — plus the super-block packing they
//! share, and Q6_K's `make_qx_quants` search (plain only).

use super::{fp16_bits, fp16_to_f32, nearest_int};
use crate::quants::k4_scale_min;
use crate::GgmlType;

#[cfg(target_arch = "x86_64")]
mod avx2;

/// `make_qkx2_quants`'s arguments as Q4_K and Q5_K call it (32 values, `use_mad` false).
struct Search {
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
}

const Q4_K: Search = Search {
    nmax: 15,
    rmin: -1.0,
    rdelta: 0.1,
    nstep: 20,
};
const Q5_K: Search = Search {
    nmax: 31,
    rmin: -0.5,
    rdelta: 0.1,
    nstep: 15,
};

/// What the search gives for one super-block: per sub-block the scale and the (positive) min,
/// and the 256 levels.
struct Found {
    scales: [f32; 8],
    mins: [f32; 8],
    levels: [u8; 256],
}

pub(super) fn q4_k_row(x: &[f32], out: &mut [u8]) {
    for (x, y) in x.chunks_exact(256).zip(out.chunks_exact_mut(144)) {
        finish(false, x, search_fast(&Q4_K, x), y);
    }
}

pub(super) fn q5_k_row(x: &[f32], out: &mut [u8]) {
    for (x, y) in x.chunks_exact(256).zip(out.chunks_exact_mut(176)) {
        finish(true, x, search_fast(&Q5_K, x), y);
    }
}

/// Q4_K (`q5` false) or Q5_K with the plain search.
pub(super) fn k_row_reference(q5: bool, x: &[f32], out: &mut [u8]) {
    let (p, bb) = if q5 { (&Q5_K, 176) } else { (&Q4_K, 144) };
    for (x, y) in x.chunks_exact(256).zip(out.chunks_exact_mut(bb)) {
        finish(q5, x, search_reference(p, x), y);
    }
}

/// The K-quant search of a super-block in its fastest form on this CPU.
fn search_fast(p: &Search, x: &[f32]) -> Found {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above), the only requirement of avx2::search.
        return unsafe { avx2::search(p, x) };
    }
    search_lanes(p, x)
}

/// Q4_K (`q5` false) or Q5_K with the portable lane search, for the speed test.
#[cfg(test)]
pub(super) fn k_row_portable(q5: bool, x: &[f32], out: &mut [u8]) {
    let (p, bb) = if q5 { (&Q5_K, 176) } else { (&Q4_K, 144) };
    for (x, y) in x.chunks_exact(256).zip(out.chunks_exact_mut(bb)) {
        finish(q5, x, search_lanes(p, x), y);
    }
}

/// The form used on CPUs without AVX2, and the one the tests pin against the reference.
#[cfg(test)]
pub(super) fn search_portable(q5: bool, x: &[f32]) -> ([f32; 8], [f32; 8], [u8; 256]) {
    let f = search_lanes(if q5 { &Q5_K } else { &Q4_K }, x);
    (f.scales, f.mins, f.levels)
}

/// The fast form as `quantize_row` picks it, for the tests.
#[cfg(test)]
pub(super) fn search_dispatched(q5: bool, x: &[f32]) -> ([f32; 8], [f32; 8], [u8; 256]) {
    let f = search_fast(if q5 { &Q5_K } else { &Q4_K }, x);
    (f.scales, f.mins, f.levels)
}

/// The plain form, for the tests.
#[cfg(test)]
pub(super) fn search_plain(q5: bool, x: &[f32]) -> ([f32; 8], [f32; 8], [u8; 256]) {
    let f = search_reference(if q5 { &Q5_K } else { &Q4_K }, x);
    (f.scales, f.mins, f.levels)
}

type Lanes = [f32; 8];

/// Lane-wise `if c { a } else { b }`.
#[inline(always)]
fn select(c: [bool; 8], a: Lanes, b: Lanes) -> Lanes {
    std::array::from_fn(|j| if c[j] { a[j] } else { b[j] })
}

/// The inputs of the 8 lane searches: values and weights transposed (`xt[i][j]` is value i of
/// sub-block j), and per lane the min (clamped to ≤ 0), max, Σw and Σw·x of the reference's
/// first loop, in its order.
struct Prep {
    xt: [Lanes; 32],
    wt: [Lanes; 32],
    min: Lanes,
    max: Lanes,
    sum_w: Lanes,
    sum_x: Lanes,
}

/// `quantize_row_q4_K_ref`'s weights (sqrt(Σx²/32) + |x|) and `make_qkx2_quants`'s first loop,
/// for the 8 sub-blocks side by side.
#[inline(always)]
fn prepare(x: &[f32]) -> Prep {
    let mut xt = [[0.0f32; 8]; 32];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        for (i, &v) in sub.iter().enumerate() {
            xt[i][j] = v;
        }
    }
    let mut sum_x2 = [0.0f32; 8];
    for xi in &xt {
        for j in 0..8 {
            sum_x2[j] += xi[j] * xi[j];
        }
    }
    let av_x: Lanes = std::array::from_fn(|j| (sum_x2[j] / 32.0).sqrt());
    let mut wt = [[0.0f32; 8]; 32];
    for (wi, xi) in wt.iter_mut().zip(&xt) {
        for j in 0..8 {
            wi[j] = av_x[j] + xi[j].abs();
        }
    }
    let mut min = xt[0];
    let mut max = xt[0];
    let mut sum_w = wt[0];
    let mut sum_x: Lanes = std::array::from_fn(|j| wt[0][j] * xt[0][j]);
    for i in 1..32 {
        for j in 0..8 {
            let v = xt[i][j];
            min[j] = if v < min[j] { v } else { min[j] };
            max[j] = if v > max[j] { v } else { max[j] };
            sum_w[j] += wt[i][j];
            sum_x[j] += wt[i][j] * v;
        }
    }
    for m in &mut min {
        *m = if *m > 0.0 { 0.0 } else { *m };
    }
    Prep {
        xt,
        wt,
        min,
        max,
        sum_w,
        sum_x,
    }
}

/// The lane searches' results into `Found`: `scale`, `min` and `levels` as the search left them,
/// except that a flat sub-block (max == min) returns at once in the reference: levels 0, scale 0,
/// the min it started from.
#[inline(always)]
fn finalize(prep: &Prep, levels: &[Lanes; 32], scale: Lanes, min: Lanes) -> Found {
    let flat: [bool; 8] = std::array::from_fn(|j| prep.max[j] == prep.min[j]);
    let mut out = Found {
        scales: select(flat, [0.0; 8], scale),
        mins: std::array::from_fn(|j| -if flat[j] { prep.min[j] } else { min[j] }),
        levels: [0; 256],
    };
    for (i, li) in levels.iter().enumerate() {
        for j in 0..8 {
            out.levels[32 * j + i] = if flat[j] { 0 } else { li[j] as u8 };
        }
    }
    out
}

/// The 8 sub-blocks' searches side by side: lane j is sub-block j, and within a lane every sum
/// runs over i = 0..32 in order, as `make_qkx2_quants` does.
#[inline(always)]
fn search_lanes(p: &Search, x: &[f32]) -> Found {
    let prep = prepare(x);
    let Prep {
        xt,
        wt,
        sum_w,
        sum_x,
        max,
        ..
    } = &prep;
    let mut min = prep.min;
    let nmax = p.nmax;
    let nmax_f = nmax as f32;

    let mut levels = [[0.0f32; 8]; 32];
    let mut iscale: Lanes = std::array::from_fn(|j| nmax_f / (max[j] - min[j]));
    let mut scale: Lanes = std::array::from_fn(|j| 1.0 / iscale[j]);
    let mut best = [0.0f32; 8];
    for i in 0..32 {
        for j in 0..8 {
            let l = nearest_int(iscale[j] * (xt[i][j] - min[j])).clamp(0, nmax) as f32;
            levels[i][j] = l;
            let diff = scale[j] * l + min[j] - xt[i][j];
            best[j] += wt[i][j] * (diff * diff);
        }
    }
    let mut aux = [[0.0f32; 8]; 32];
    for is in 0..=p.nstep {
        let num = p.rmin + p.rdelta * is as f32 + nmax_f;
        for j in 0..8 {
            iscale[j] = num / (max[j] - min[j]);
        }
        let mut sum_l = [0.0f32; 8];
        let mut sum_l2 = [0.0f32; 8];
        let mut sum_xl = [0.0f32; 8];
        for i in 0..32 {
            for j in 0..8 {
                let l = nearest_int(iscale[j] * (xt[i][j] - min[j])).clamp(0, nmax) as f32;
                aux[i][j] = l;
                let wl = wt[i][j] * l;
                sum_l[j] += wl;
                sum_l2[j] += wl * l;
                sum_xl[j] += wl * xt[i][j];
            }
        }
        let d: Lanes = std::array::from_fn(|j| sum_w[j] * sum_l2[j] - sum_l[j] * sum_l[j]);
        let mut this_scale: Lanes =
            std::array::from_fn(|j| (sum_w[j] * sum_xl[j] - sum_x[j] * sum_l[j]) / d[j]);
        let mut this_min: Lanes =
            std::array::from_fn(|j| (sum_l2[j] * sum_x[j] - sum_l[j] * sum_xl[j]) / d[j]);
        let pos: [bool; 8] = std::array::from_fn(|j| this_min[j] > 0.0);
        let alt: Lanes = std::array::from_fn(|j| sum_xl[j] / sum_l2[j]);
        this_scale = select(pos, alt, this_scale);
        this_min = select(pos, [0.0; 8], this_min);
        let mut cur = [0.0f32; 8];
        for i in 0..32 {
            for j in 0..8 {
                let diff = this_scale[j] * aux[i][j] + this_min[j] - xt[i][j];
                cur[j] += wt[i][j] * (diff * diff);
            }
        }
        let take: [bool; 8] = std::array::from_fn(|j| d[j] > 0.0 && cur[j] < best[j]);
        if take.iter().any(|&t| t) {
            for (li, ai) in levels.iter_mut().zip(&aux) {
                *li = select(take, *ai, *li);
            }
            best = select(take, cur, best);
            scale = select(take, this_scale, scale);
            min = select(take, this_min, min);
        }
    }
    finalize(&prep, &levels, scale, min)
}

/// The plain search: `quantize_row_q4_K_ref`'s weights and `make_qkx2_quants` per sub-block.
fn search_reference(p: &Search, x: &[f32]) -> Found {
    let mut out = Found {
        scales: [0.0; 8],
        mins: [0.0; 8],
        levels: [0; 256],
    };
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let mut sum_x2 = 0.0f32;
        for &v in sub {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|l| av_x + sub[l].abs());
        let levels: &mut [u8; 32] = (&mut out.levels[32 * j..32 * j + 32]).try_into().unwrap();
        let (scale, the_min) = make_qkx2_quants(p, sub, &weights, levels);
        out.scales[j] = scale;
        out.mins[j] = the_min;
    }
    out
}

/// `make_qkx2_quants(32, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, false)`:
/// returns (scale, the_min).
fn make_qkx2_quants(p: &Search, x: &[f32], w: &[f32; 32], l_out: &mut [u8; 32]) -> (f32, f32) {
    let nmax = p.nmax;
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..32 {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        *l_out = [0; 32];
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..32 {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += w[i] * (diff * diff);
    }
    let mut aux = [0u8; 32];
    for is in 0..=p.nstep {
        iscale = (p.rmin + p.rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..32 {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = l as u8;
            let lf = l as f32;
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..32 {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                cur_error += w[i] * (diff * diff);
            }
            if cur_error < best_error {
                *l_out = aux;
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// The rest of `quantize_row_q4_K_ref` / `quantize_row_q5_K_ref` after the search: 6-bit
/// sub-block scales and mins against the super-block's f16 d and dmin, the final levels from
/// those rounded scales, and the packing.
fn finish(q5: bool, x: &[f32], f: Found, y: &mut [u8]) {
    let nmax = if q5 { 31 } else { 15 };
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..8 {
        if f.scales[j] > max_scale {
            max_scale = f.scales[j];
        }
        if f.mins[j] > max_min {
            max_min = f.mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut sc = [0u8; 12];
    for j in 0..8 {
        // C: uint8_t ls = nearest_int(...) keeps the low 8 bits, then MIN(63, ·).
        let ls = (nearest_int(inv_scale * f.scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * f.mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    let d_bits = fp16_bits(max_scale / 63.0);
    let dmin_bits = fp16_bits(max_min / 63.0);
    let d16 = fp16_to_f32(d_bits);
    let dmin16 = fp16_to_f32(dmin_bits);
    let mut levels = f.levels;
    for j in 0..8 {
        let (s, m) = k4_scale_min(j, &sc);
        let d = d16 * s as f32;
        if d == 0.0 {
            // The reference keeps the search's levels for this sub-block.
            continue;
        }
        let dm = dmin16 * m as f32;
        for ii in 0..32 {
            levels[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    y[0..2].copy_from_slice(&d_bits.to_le_bytes());
    y[2..4].copy_from_slice(&dmin_bits.to_le_bytes());
    y[4..16].copy_from_slice(&sc);
    if q5 {
        let (qh, ql) = y[16..176].split_at_mut(32);
        qh.fill(0);
        for n in 0..4 {
            let (m1, m2) = (1u8 << (2 * n), 2u8 << (2 * n));
            for j in 0..32 {
                let mut l1 = levels[64 * n + j];
                if l1 > 15 {
                    l1 -= 16;
                    qh[j] |= m1;
                }
                let mut l2 = levels[64 * n + j + 32];
                if l2 > 15 {
                    l2 -= 16;
                    qh[j] |= m2;
                }
                ql[32 * n + j] = l1 | (l2 << 4);
            }
        }
    } else {
        for n in 0..4 {
            for l in 0..32 {
                y[16 + 32 * n + l] = levels[64 * n + l] | (levels[64 * n + l + 32] << 4);
            }
        }
    }
}

/// `make_qx_quants(16, 32, x, L, 1, NULL)` of Q6_K: levels 0..=63 (level − 32 is the value) and
/// the scale.
fn make_qx_quants(x: &[f32], l_out: &mut [u8]) -> f32 {
    const NMAX: i32 = 32;
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < 1e-15 {
        l_out.fill(0);
        return 0.0;
    }
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = nearest_int(iscale * v).clamp(-NMAX, NMAX - 1) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let set_levels = |iscale: f32, l_out: &mut [u8]| {
        for (q, &v) in l_out.iter_mut().zip(x) {
            *q = (NMAX + nearest_int(iscale * v).clamp(-NMAX, NMAX - 1)) as u8;
        }
    };
    let iscale = -(NMAX as f32) / max;
    set_levels(iscale, l_out);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        let iscale = -(NMAX as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            set_levels(iscale, l_out);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// One Q6_K super-block (`quantize_row_q6_K_ref`): 16 sub-blocks of 16 with signed 8-bit scales
/// against an f16 d; ql (low nibbles), qh (high 2 bits), scales, d.
pub(super) fn q6_k_block(x: &[f32], y: &mut [u8]) {
    debug_assert_eq!(y.len(), GgmlType::Q6K.block_bytes());
    let mut levels = [0u8; 256];
    let mut scales = [0.0f32; 16];
    let mut max_scale = 0.0f32;
    let mut max_abs_scale = 0.0f32;
    for ib in 0..16 {
        let scale = make_qx_quants(
            &x[16 * ib..16 * ib + 16],
            &mut levels[16 * ib..16 * ib + 16],
        );
        scales[ib] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    if max_abs_scale < 1e-15 {
        y.fill(0);
        y[208..210].copy_from_slice(&fp16_bits(0.0).to_le_bytes());
        return;
    }
    let iscale = -128.0 / max_scale;
    let d_bits = fp16_bits(1.0 / iscale);
    let d16 = fp16_to_f32(d_bits);
    let mut sc = [0i8; 16];
    for ib in 0..16 {
        // C: int8_t = MIN(127, nearest_int(...)), the conversion keeping the low 8 bits.
        sc[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
    }
    for j in 0..16 {
        let d = d16 * sc[j] as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let l = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
            levels[16 * j + ii] = (l + 32) as u8;
        }
    }
    let (ql, rest) = y.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    for (c, j) in (0..256).step_by(128).enumerate() {
        for l in 0..32 {
            let (a, b, cc, dd) = (
                levels[j + l],
                levels[j + l + 32],
                levels[j + l + 64],
                levels[j + l + 96],
            );
            ql[64 * c + l] = (a & 0xF) | ((cc & 0xF) << 4);
            ql[64 * c + l + 32] = (b & 0xF) | ((dd & 0xF) << 4);
            qh[32 * c + l] = (a >> 4) | ((b >> 4) << 2) | ((cc >> 4) << 4) | ((dd >> 4) << 6);
        }
    }
    for (b, &s) in rest[..16].iter_mut().zip(&sc) {
        *b = s as u8;
    }
    rest[16..18].copy_from_slice(&d_bits.to_le_bytes());
}

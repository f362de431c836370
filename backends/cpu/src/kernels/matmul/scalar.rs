//! The scalar packed matmul: the reference every SIMD kernel must reproduce bit for bit. Per
//! block and row it forms the integer dot products of the block's two 16-value halves, combines
//! them with the format's integer scales and offset, and accumulates with the same fused
//! multiply-adds, in the same order, as the vector kernels:
//!
//! - per-block f16/f32 scales (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_K, IQ4_NL; IQ4_XS with `d` its
//!   block's `d (s - 32)`, exact):
//!   `acc += (D0 + D1 - offset isum) (d dx)`, then `acc += m s` with a minimum (`s` the
//!   activation block's `dx isum` rounded through f16, as llama.cpp's Q8_1 has it);
//! - Q4_K/Q5_K: `acc += (D0 + D1) ((d s) dx)`, then `acc += (-dmin m) (dx isum)` (not rounded
//!   through f16: llama.cpp's Q8_K keeps exact integer sums for the K-quants);
//! - Q6_K/Q3_K: `acc += (s0 (D0 - offset S0) + s1 (D1 - offset S1)) (d dx)`;
//! - Q2_K: `acc += (s0 D0 + s1 D1) (d dx)`, then `acc += (m0 S0 + m1 S1) ((-dmin) dx)`;
//!
//! where `D0`, `D1` are the integer products of the halves, `S0`, `S1` the activation sums of the
//! halves, `dx` the activation block's scale. The integer parts are exact.

use super::PackedJob;
use crate::disjoint::Tile;
use crate::quant::acts::{ActSums, QBLOCK};
use crate::quant::packed::{lane_scales, lane_value, LaneScales, PackFormat, Scales, GROUP};
use crate::quant::QuantizedActs;

/// Writes the job's outputs through the tile's checked rows (the tile covers the job). `sums` are
/// the activations' extra sums, present when the format needs them.
pub fn packed(job: &PackedJob, sums: Option<&ActSums>, out: &mut Tile<f32>) {
    let w = job.w;
    let a = job.acts;
    let f = w.format;
    let vb = f.values_bytes();
    let nb = w.blocks();
    let c0 = out.cols().start;
    for g in job.groups.clone() {
        let gd = w.group_data(g);
        for m in job.rows.clone() {
            let xq = &a.qs[m * a.k..(m + 1) * a.k];
            let orow = out.row_mut(m);
            for i in 0..GROUP {
                let n = g * GROUP + i;
                if n >= w.n {
                    break;
                }
                let mut acc = 0f32;
                for b in 0..nb {
                    let at = f.block_at(b);
                    let v = &gd[at.values_at..at.values_at + vb];
                    let mut dots = [0i32; 2];
                    for kk in 0..QBLOCK {
                        dots[kk / 16] +=
                            lane_value(f.values, v, i, kk) as i32 * xq[b * QBLOCK + kk] as i32;
                    }
                    let l = lane_scales(f, gd, at, i);
                    acc = block_step(f, &l, dots, a, sums, m * nb + b, acc);
                }
                orow[n - c0] = acc;
            }
        }
    }
}

/// One block's contribution to one output (see the module doc): `dots` are the integer products
/// of the block's halves, `blk` the activation block's index.
#[inline]
pub(crate) fn block_step(
    f: PackFormat,
    l: &LaneScales,
    dots: [i32; 2],
    a: &QuantizedActs,
    sums: Option<&ActSums>,
    blk: usize,
    acc: f32,
) -> f32 {
    let xd = a.d[blk];
    let half_sums = || {
        let s = &sums.expect("activation sums for a K-quant format").s16;
        [s[2 * blk] as i32, s[2 * blk + 1] as i32]
    };
    match f.scales {
        Scales::F16 | Scales::F16Min | Scales::F32Super | Scales::Xs => {
            let ia = dots[0] + dots[1] - f.offset * a.isum[blk];
            let acc = (ia as f32).mul_add(l.d * xd, acc);
            if f.scales == Scales::F16Min {
                l.m.mul_add(a.s[blk], acc)
            } else {
                acc
            }
        }
        Scales::K4 => {
            let sx = sums.expect("activation sums for a K-quant format").sx[blk];
            let acc = ((dots[0] + dots[1]) as f32).mul_add(l.d * xd, acc);
            l.m.mul_add(sx, acc)
        }
        Scales::K6 | Scales::K3 => {
            let s = half_sums();
            let ia = l.sc[0] * (dots[0] - f.offset * s[0]) + l.sc[1] * (dots[1] - f.offset * s[1]);
            (ia as f32).mul_add(l.d * xd, acc)
        }
        Scales::K2 => {
            let s = half_sums();
            let ia = l.sc[0] * dots[0] + l.sc[1] * dots[1];
            let im = l.mn[0] * s[0] + l.mn[1] * s[1];
            let acc = (ia as f32).mul_add(l.d * xd, acc);
            (im as f32).mul_add(l.m * xd, acc)
        }
    }
}

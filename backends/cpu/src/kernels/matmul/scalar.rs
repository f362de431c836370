//! The scalar packed matmul: the reference every SIMD kernel must reproduce bit for bit. Per
//! block it forms the integer dot product, subtracts `offset * sum(x)`, and accumulates with the
//! same fused multiply-adds, in the same order, as the vector kernels.

use super::PackedJob;
use crate::disjoint::Tile;
use crate::quant::acts::QBLOCK;
use crate::quant::packed::{unit_scale_min, unit_value, GROUP};

/// Writes the job's outputs through the tile's checked rows (the tile covers the job).
pub fn packed(job: &PackedJob, out: &mut Tile<f32>) {
    let w = job.w;
    let a = job.acts;
    let f = w.format;
    let unit = f.unit_bytes();
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
                    let u = &gd[b * unit..(b + 1) * unit];
                    let mut dot = 0i32;
                    for kk in 0..QBLOCK {
                        dot += unit_value(f, u, i, kk) as i32 * xq[b * QBLOCK + kk] as i32;
                    }
                    dot -= f.offset * a.isum[m * nb + b];
                    let (d, mn) = unit_scale_min(f, u, i);
                    acc = (dot as f32).mul_add(d * a.d[m * nb + b], acc);
                    if f.has_min {
                        acc = mn.mul_add(a.s[m * nb + b], acc);
                    }
                }
                orow[n - c0] = acc;
            }
        }
    }
}

//! NEON packed matmul for Arm hosts (the Kunpeng CPUs beside Ascend cards). A group's 16 rows are
//! four 4-lane quarters; products use baseline NEON widening multiplies (`smull`) and pairwise
//! adds, so no optional extension is needed. Byte weights are made signed by flipping their top
//! bit and the `128 * sum(x)` this removes is added back.

use std::arch::aarch64::*;

use super::PackedJob;
use crate::quant::acts::QBLOCK;
use crate::quant::packed::{unit_scale_min, PackKind, GROUP};

/// # Safety
/// `job` must describe valid buffers (NEON is always present on aarch64).
#[target_feature(enable = "neon")]
pub unsafe fn packed(job: &PackedJob) {
    let w = job.w;
    let a = job.acts;
    let f = w.format;
    let nib = f.kind == PackKind::Nibble;
    let k = a.k;
    let nb = k / QBLOCK;
    let unit = f.unit_bytes();
    // Byte values are flipped to signed (q - 128): add back 128 * sum(x), minus the offset.
    let comp = if nib { -f.offset } else { 128 - f.offset };
    for g in job.groups.clone() {
        let gd = w.group_data(g).as_ptr();
        let valid = (w.n - g * GROUP).min(GROUP);
        for row in job.rows.clone() {
            let mut acc = [vdupq_n_f32(0.0); 4];
            for b in 0..nb {
                let u = gd.add(b * unit);
                let us = std::slice::from_raw_parts(u, unit);
                let xq = a.qs.as_ptr().add(row * k + b * QBLOCK) as *const i32;
                let blk = row * nb + b;
                let xd = a.d[blk];
                let xs = a.s[blk];
                for (qtr, acc_q) in acc.iter_mut().enumerate() {
                    let mut ia = vdupq_n_s32(0);
                    for c in 0..8 {
                        let wv: int8x16_t = if nib {
                            let raw = vld1q_u8(u.add((c % 4) * 64 + qtr * 16));
                            let v = if c < 4 {
                                vandq_u8(raw, vdupq_n_u8(0x0F))
                            } else {
                                vshrq_n_u8::<4>(raw)
                            };
                            vreinterpretq_s8_u8(v)
                        } else {
                            let raw = vld1q_u8(u.add(c * 64 + qtr * 16));
                            vreinterpretq_s8_u8(veorq_u8(raw, vdupq_n_u8(0x80)))
                        };
                        let xv = vreinterpretq_s8_s32(vdupq_n_s32(xq.add(c).read_unaligned()));
                        let lo = vmull_s8(vget_low_s8(wv), vget_low_s8(xv));
                        let hi = vmull_high_s8(wv, xv);
                        ia = vaddq_s32(ia, vpaddlq_s16(vpaddq_s16(lo, hi)));
                    }
                    if comp != 0 {
                        ia = vaddq_s32(ia, vdupq_n_s32(comp * a.isum[blk]));
                    }
                    let mut dw = [0f32; 4];
                    let mut mw = [0f32; 4];
                    for l in 0..4 {
                        let (d, m) = unit_scale_min(f, us, qtr * 4 + l);
                        dw[l] = d;
                        mw[l] = m;
                    }
                    let sc = vmulq_f32(vld1q_f32(dw.as_ptr()), vdupq_n_f32(xd));
                    *acc_q = vfmaq_f32(*acc_q, vcvtq_f32_s32(ia), sc);
                    if f.has_min {
                        *acc_q = vfmaq_f32(*acc_q, vld1q_f32(mw.as_ptr()), vdupq_n_f32(xs));
                    }
                }
            }
            let mut tmp = [0f32; GROUP];
            for (qtr, acc_q) in acc.iter().enumerate() {
                vst1q_f32(tmp.as_mut_ptr().add(qtr * 4), *acc_q);
            }
            let dst = job.out.0.add(row * job.ldo + g * GROUP);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, valid);
        }
    }
}

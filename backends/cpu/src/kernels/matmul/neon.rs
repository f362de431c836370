//! NEON packed matmul for Arm hosts (the Kunpeng CPUs beside Ascend cards). A group's 16 rows are
//! four 4-lane quarters; one 16-byte load holds 4 consecutive values of each lane of a quarter.
//! The integer dot products use baseline NEON widening multiplies (`smull`) and pairwise adds,
//! or, with the dot-product extension, `sdot` against a 4-byte slice of the activation row. Byte
//! weights are made signed by flipping their top bit and the `128 * sum(x)` this removes is added
//! back. Integer sums are exact, and the scale epilogue is the scalar kernel's, in its order.

use std::arch::aarch64::*;
use std::arch::asm;

use super::{PackedJob, RawOut};
use crate::quant::acts::QBLOCK;
use crate::quant::packed::{unit_scale_min, PackKind, GROUP};

/// Baseline NEON (present on every aarch64 CPU).
///
/// # Safety
/// The job must have passed `check_job`, and `out` must be writable, by this call alone, at rows
/// `job.rows` x the output columns of `job.groups` (what `packed_job` guarantees).
#[target_feature(enable = "neon")]
pub unsafe fn packed(job: &PackedJob, out: RawOut) {
    body::<false>(job, out)
}

/// NEON with the dot-product extension (`sdot`).
///
/// # Safety
/// The CPU must have the dot-product extension; otherwise as for [`packed`].
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn packed_dot(job: &PackedJob, out: RawOut) {
    body::<true>(job, out)
}

/// `acc` lane i += the dot product of bytes 4i..4i+4 of `w` with 4-byte element `L` of `x`.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn sdot_lane<const L: i32>(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: a register-only instruction; the caller's target features include dotprod.
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {w:v}.16b, {x:v}.4b[{l}]",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            x = in(vreg) x,
            l = const L,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// The 16 bytes of chunk `c` (values 4c..4c+4 of the block) for quarter `qtr` of a unit, signed.
#[inline(always)]
unsafe fn weights(u: *const u8, nib: bool, c: usize, qtr: usize) -> int8x16_t {
    if nib {
        // Low nibbles hold values 0..16, high nibbles values 16..32.
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
    }
}

#[inline(always)]
unsafe fn body<const DOT: bool>(job: &PackedJob, out: RawOut) {
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
                let xp = a.qs.as_ptr().add(row * k + b * QBLOCK);
                let blk = row * nb + b;
                let xd = a.d[blk];
                let xs = a.s[blk];
                for (qtr, acc_q) in acc.iter_mut().enumerate() {
                    let mut ia = vdupq_n_s32(0);
                    if DOT {
                        let x0 = vld1q_s8(xp);
                        let x1 = vld1q_s8(xp.add(16));
                        ia = sdot_lane::<0>(ia, weights(u, nib, 0, qtr), x0);
                        ia = sdot_lane::<1>(ia, weights(u, nib, 1, qtr), x0);
                        ia = sdot_lane::<2>(ia, weights(u, nib, 2, qtr), x0);
                        ia = sdot_lane::<3>(ia, weights(u, nib, 3, qtr), x0);
                        ia = sdot_lane::<0>(ia, weights(u, nib, 4, qtr), x1);
                        ia = sdot_lane::<1>(ia, weights(u, nib, 5, qtr), x1);
                        ia = sdot_lane::<2>(ia, weights(u, nib, 6, qtr), x1);
                        ia = sdot_lane::<3>(ia, weights(u, nib, 7, qtr), x1);
                    } else {
                        let xq = xp as *const i32;
                        for c in 0..8 {
                            let wv = weights(u, nib, c, qtr);
                            let xv = vreinterpretq_s8_s32(vdupq_n_s32(xq.add(c).read_unaligned()));
                            let lo = vmull_s8(vget_low_s8(wv), vget_low_s8(xv));
                            let hi = vmull_high_s8(wv, xv);
                            ia = vaddq_s32(ia, vpaddlq_s16(vpaddq_s16(lo, hi)));
                        }
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
            let dst = out.base.add(row * out.ld + g * GROUP);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, valid);
        }
    }
}

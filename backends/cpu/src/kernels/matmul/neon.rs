//! NEON packed matmul for Arm hosts (the Kunpeng CPUs beside Ascend cards). A group's 16 rows are
//! four 4-lane quarters; 16 bytes of a value register hold 4 consecutive values of each lane of a
//! quarter (nibbles and bit planes are unpacked with per-byte shifts). The integer dot products of
//! a block's two 16-value halves use baseline NEON widening multiplies (`smull`) and pairwise
//! adds, or, with the dot-product extension, `sdot` against a 4-byte slice of the activation row.
//! 8-bit weights are made signed by flipping their top bit and the `128 * sum(x)` this removes is
//! added back. Integer sums are exact, and the scale epilogue is the scalar kernel's, in its order.

use std::arch::aarch64::*;
use std::arch::asm;

use super::{PackedJob, RawOut};
use crate::quant::acts::{ActSums, QBLOCK};
use crate::quant::packed::{lane_scales, Scales, Values, GROUP};

/// Baseline NEON (present on every aarch64 CPU).
///
/// # Safety
/// The job must have passed `check_job`, `sums` must be the activations' sums where the format
/// needs them, and `out` must be writable, by this call alone, at rows `job.rows` x the output
/// columns of `job.groups` (what `packed_job` guarantees).
#[target_feature(enable = "neon")]
pub unsafe fn packed(job: &PackedJob, sums: Option<&ActSums>, out: RawOut) {
    body::<false>(job, sums, out)
}

/// NEON with the dot-product extension (`sdot`).
///
/// # Safety
/// The CPU must have the dot-product extension; otherwise as for [`packed`].
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn packed_dot(job: &PackedJob, sums: Option<&ActSums>, out: RawOut) {
    body::<true>(job, sums, out)
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

/// `(v >> r) & mask` (r >= 0) or `(v << -r) & mask`, per byte.
#[inline(always)]
unsafe fn field(v: uint8x16_t, r: i8, mask: u8) -> uint8x16_t {
    vandq_u8(vshlq_u8(v, vdupq_n_s8(-r)), vdupq_n_u8(mask))
}

/// The 16 bytes of register `c` (values 4c..4c+4 of the block) for quarter `qtr` of the block
/// at `vp`, as signed bytes (8-bit values less 128, IQ4's table values, the others as they are:
/// all below 64).
#[inline(always)]
unsafe fn weights(vp: *const u8, kind: Values, c: usize, qtr: usize) -> int8x16_t {
    let ld = |o: usize| vld1q_u8(vp.add(o + qtr * 16));
    let ci = c as i8;
    let v = match kind {
        Values::Q8 => veorq_u8(ld(c * 64), vdupq_n_u8(0x80)),
        Values::Q4 | Values::Q5 | Values::Q6 | Values::IQ4 => {
            // Low nibbles hold registers 0..4, high nibbles registers 4..8.
            let raw = ld((c % 4) * 64);
            let nib = if c < 4 {
                vandq_u8(raw, vdupq_n_u8(0x0F))
            } else {
                vshrq_n_u8::<4>(raw)
            };
            match kind {
                Values::Q5 => vorrq_u8(nib, field(ld(256), ci - 4, 0x10)),
                Values::Q6 => {
                    let h = ld(256 + (c / 4) * 64);
                    vorrq_u8(nib, field(h, 2 * (ci % 4) - 4, 0x30))
                }
                // The table's signed values, already less 128.
                Values::IQ4 => {
                    let t = vld1q_u8(npu_gguf::quants::IQ4_VALUES.as_ptr() as *const u8);
                    vqtbl1q_u8(t, nib)
                }
                _ => nib,
            }
        }
        Values::Q2 | Values::Q3 => {
            let lo = field(ld((c / 4) * 64), 2 * (ci % 4), 3);
            if kind == Values::Q3 {
                vorrq_u8(lo, field(ld(128), ci - 2, 4))
            } else {
                lo
            }
        }
    };
    vreinterpretq_s8_u8(v)
}

#[inline(always)]
unsafe fn body<const DOT: bool>(job: &PackedJob, sums: Option<&ActSums>, out: RawOut) {
    let w = job.w;
    let a = job.acts;
    let f = w.format;
    let k = a.k;
    let nb = k / QBLOCK;
    // 8-bit values are flipped to signed (q - 128): add back 128 * sum(x), with the offset (every
    // 8-bit format has per-block scales; the K-quants' values are all below 128).
    let comp = if matches!(f.values, Values::Q8 | Values::IQ4) {
        128
    } else {
        0
    } - f.offset;
    let s16 = sums.map(|s| &s.s16[..]);
    for g in job.groups.clone() {
        let gd = w.group_data(g);
        let valid = (w.n - g * GROUP).min(GROUP);
        for row in job.rows.clone() {
            let mut acc = [vdupq_n_f32(0.0); 4];
            for b in 0..nb {
                let at = f.block_at(b);
                let vp = gd.as_ptr().add(at.values_at);
                let xp = a.qs.as_ptr().add(row * k + b * QBLOCK);
                let blk = row * nb + b;
                // The activation sums of the block's halves (K-quants).
                let hs = match s16 {
                    Some(s) => [s[2 * blk] as i32, s[2 * blk + 1] as i32],
                    None => [0, 0],
                };
                for (qtr, acc_q) in acc.iter_mut().enumerate() {
                    let mut i = [vdupq_n_s32(0); 2];
                    if DOT {
                        let x0 = vld1q_s8(xp);
                        let x1 = vld1q_s8(xp.add(16));
                        let wt = |c: usize| weights(vp, f.values, c, qtr);
                        i[0] = sdot_lane::<0>(i[0], wt(0), x0);
                        i[0] = sdot_lane::<1>(i[0], wt(1), x0);
                        i[0] = sdot_lane::<2>(i[0], wt(2), x0);
                        i[0] = sdot_lane::<3>(i[0], wt(3), x0);
                        i[1] = sdot_lane::<0>(i[1], wt(4), x1);
                        i[1] = sdot_lane::<1>(i[1], wt(5), x1);
                        i[1] = sdot_lane::<2>(i[1], wt(6), x1);
                        i[1] = sdot_lane::<3>(i[1], wt(7), x1);
                    } else {
                        let xq = xp as *const i32;
                        for c in 0..8 {
                            let wv = weights(vp, f.values, c, qtr);
                            let xv = vreinterpretq_s8_s32(vdupq_n_s32(xq.add(c).read_unaligned()));
                            let lo = vmull_s8(vget_low_s8(wv), vget_low_s8(xv));
                            let hi = vmull_high_s8(wv, xv);
                            i[c / 4] = vaddq_s32(i[c / 4], vpaddlq_s16(vpaddq_s16(lo, hi)));
                        }
                    }
                    let mut l = [Default::default(); 4];
                    for (lane, ls) in l.iter_mut().enumerate() {
                        *ls = lane_scales(f, gd, at, qtr * 4 + lane);
                    }
                    let fl = |v: fn(&crate::quant::packed::LaneScales) -> f32| {
                        let t = [v(&l[0]), v(&l[1]), v(&l[2]), v(&l[3])];
                        vld1q_f32(t.as_ptr())
                    };
                    let il = |v: fn(&crate::quant::packed::LaneScales) -> i32| {
                        let t = [v(&l[0]), v(&l[1]), v(&l[2]), v(&l[3])];
                        vld1q_s32(t.as_ptr())
                    };
                    let xd = vdupq_n_f32(a.d[blk]);
                    let dw = vmulq_f32(fl(|l| l.d), xd);
                    *acc_q = match f.scales {
                        Scales::F16 | Scales::F16Min | Scales::F32Super | Scales::Xs => {
                            let ia =
                                vaddq_s32(vaddq_s32(i[0], i[1]), vdupq_n_s32(comp * a.isum[blk]));
                            let r = vfmaq_f32(*acc_q, vcvtq_f32_s32(ia), dw);
                            if f.scales == Scales::F16Min {
                                vfmaq_f32(r, fl(|l| l.m), vdupq_n_f32(a.s[blk]))
                            } else {
                                r
                            }
                        }
                        Scales::K4 => {
                            let sx = sums.expect("activation sums").sx[blk];
                            let r = vfmaq_f32(*acc_q, vcvtq_f32_s32(vaddq_s32(i[0], i[1])), dw);
                            vfmaq_f32(r, fl(|l| l.m), vdupq_n_f32(sx))
                        }
                        Scales::K6 | Scales::K3 => {
                            let t0 = vsubq_s32(i[0], vdupq_n_s32(f.offset * hs[0]));
                            let t1 = vsubq_s32(i[1], vdupq_n_s32(f.offset * hs[1]));
                            let ia = vaddq_s32(
                                vmulq_s32(il(|l| l.sc[0]), t0),
                                vmulq_s32(il(|l| l.sc[1]), t1),
                            );
                            vfmaq_f32(*acc_q, vcvtq_f32_s32(ia), dw)
                        }
                        Scales::K2 => {
                            let ia = vaddq_s32(
                                vmulq_s32(il(|l| l.sc[0]), i[0]),
                                vmulq_s32(il(|l| l.sc[1]), i[1]),
                            );
                            let im = vaddq_s32(
                                vmulq_s32(il(|l| l.mn[0]), vdupq_n_s32(hs[0])),
                                vmulq_s32(il(|l| l.mn[1]), vdupq_n_s32(hs[1])),
                            );
                            let r = vfmaq_f32(*acc_q, vcvtq_f32_s32(ia), dw);
                            vfmaq_f32(r, vcvtq_f32_s32(im), vmulq_f32(fl(|l| l.m), xd))
                        }
                    };
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

//! Vector helpers the kernels share: a branch-free `exp` the compiler vectorizes (accurate to a
//! few ulp, like ggml's own vector exp), and rounding slices of f32 through f16 with the F16C
//! instructions where present.

use half::f16;

use super::Isa;

/// e^x for finite or infinite x (NaN in, NaN out); relative error below 3e-7. Plain adds and
/// multiplies only (rounding by the 1.5 * 2^23 trick), so it vectorizes on any SIMD level.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
                                     // Clamp so that 2^n stays within f32's exponent range; e^-87 is ~0 for our uses anyway.
    let x = x.clamp(-87.3, 88.3);
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    // The integer n sits in t's low mantissa bits: no float-to-int conversion needed.
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    // r = x - n ln2 in two parts (Cody-Waite): n * 0.693359375 is exact in f32.
    let r = x - n * 0.693_359_4;
    let r = r + n * 2.121_944_4e-4;
    // Degree-6 Taylor polynomial for e^r on |r| <= ln2/2.
    let mut p = 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    let bits = (ni.wrapping_add(127) as u32) << 23;
    p * f32::from_bits(bits)
}

/// Rounds every value to the nearest f16 and back (ggml feeds f16 kernels this way).
pub fn round_through_f16(isa: Isa, x: &mut [f32]) {
    let isa = isa.checked();
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::checked` found one of these on this CPU, and both imply AVX and F16C;
        // the function touches only whole 8-value chunks of `x` and its remainder.
        Isa::Avx512Vnni | Isa::Avx2 => unsafe { round_f16c(x) },
        _ => {
            for v in x.iter_mut() {
                *v = f16::from_f32(*v).to_f32();
            }
        }
    }
    super::inject_fault(isa, x.first_mut());
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn round_f16c(x: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        let v = _mm256_loadu_ps(c.as_ptr());
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        _mm256_storeu_ps(c.as_mut_ptr(), _mm256_cvtph_ps(h));
    }
    for v in chunks.into_remainder() {
        *v = f16::from_f32(*v).to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate() {
        let mut x = -90.0f32;
        while x < 89.0 {
            let want = (x as f64).exp();
            let got = exp_approx(x) as f64;
            if (-87.3..88.3).contains(&x) {
                assert!(
                    ((got - want) / want).abs() < 3e-7,
                    "exp({x}) = {got}, want {want}"
                );
            }
            x += 0.0137;
        }
        assert!(exp_approx(f32::NEG_INFINITY) < 1e-37);
        assert_eq!(exp_approx(0.0), 1.0);
    }

    #[test]
    fn f16_rounding_matches_half_on_every_isa() {
        let vals: Vec<f32> = (0..1000)
            .map(|i| ((i as f32) * 0.731).sin() * 10f32.powi((i % 13) - 8))
            .collect();
        let want: Vec<f32> = vals.iter().map(|v| f16::from_f32(*v).to_f32()).collect();
        for isa in Isa::available() {
            let mut got = vals.clone();
            round_through_f16(isa, &mut got);
            assert_eq!(got, want, "{}", isa.name());
        }
    }
}

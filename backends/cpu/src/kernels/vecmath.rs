//! Vector helpers the kernels share: a branch-free `exp` the compiler vectorizes (accurate to a
//! few ulp, like ggml's own vector exp) and its AVX-512 form with the same bits, and rounding
//! slices of f32 through f16 with the F16C instructions where present.

use half::f16;

use super::Isa;

/// e^x for finite or infinite x (NaN in, NaN out); relative error below 3e-7. Fused
/// multiply-adds and the 1.5 * 2^23 rounding trick only (no float-to-int conversion, no table),
/// so it vectorizes on any SIMD level with FMA. Each `mul_add` is one rounding, on every target
/// the same: where the caller is compiled with FMA (the AVX2 and AVX-512 kernels, aarch64) it is
/// one instruction; elsewhere it is the C library's correctly rounded `fmaf`, slower but with
/// the same bits. Fused, the polynomial costs half the instructions of separate multiplies and
/// adds: the attention softmax and SiLU are bound by them.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
                                     // Clamp so that 2^n stays within f32's exponent range; e^-87 is ~0 for our uses anyway.
    let x = x.clamp(-87.3, 88.3);
    // n = x log2(e) rounded to the nearest integer, which sits in t's low mantissa bits.
    let t = x.mul_add(std::f32::consts::LOG2_E, ROUND);
    let n = t - ROUND;
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    // r = x - n ln2 in two parts (Cody-Waite): n * 0.693359375 is exact in f32.
    let r = (-n).mul_add(0.693_359_4, x);
    let r = n.mul_add(2.121_944_4e-4, r);
    // Degree-6 Taylor polynomial for e^r on |r| <= ln2/2, by Horner's rule.
    let mut p = 1.0f32 / 720.0;
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    let bits = (ni.wrapping_add(127) as u32) << 23;
    p * f32::from_bits(bits)
}

/// `exp_approx` on 16 lanes: the same operations in the same order, so every lane's bits are the
/// scalar function's (NaN in, NaN out too: the clamp's bounds are `vmaxps`/`vminps`'s first
/// operands, and those return the second one, `x`, where it is NaN).
///
/// # Safety
/// AVX-512F must be present.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn exp_approx_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    const ROUND: f32 = 12_582_912.0;
    let x = _mm512_min_ps(
        _mm512_set1_ps(88.3),
        _mm512_max_ps(_mm512_set1_ps(-87.3), x),
    );
    let t = _mm512_fmadd_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
        _mm512_set1_ps(ROUND),
    );
    let n = _mm512_sub_ps(t, _mm512_set1_ps(ROUND));
    let ni = _mm512_sub_epi32(
        _mm512_castps_si512(t),
        _mm512_set1_epi32(ROUND.to_bits() as i32),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.121_944_4e-4), r);
    let step = |p: __m512, c: f32| _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    let mut p = _mm512_set1_ps(1.0 / 720.0);
    p = step(p, 1.0 / 120.0);
    p = step(p, 1.0 / 24.0);
    p = step(p, 1.0 / 6.0);
    p = step(p, 0.5);
    p = step(p, 1.0);
    p = step(p, 1.0);
    let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(ni, _mm512_set1_epi32(127)));
    _mm512_mul_ps(p, _mm512_castsi512_ps(bits))
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

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx512_exp_has_the_scalar_bits_nan_and_infinities_included() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("SKIPPED: no AVX-512F on this CPU");
            return;
        }
        let mut xs: Vec<f32> = (0..4000).map(|i| -100.0 + i as f32 * 0.0497).collect();
        xs.extend([
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            -87.3,
            88.3,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
        ]);
        while !xs.len().is_multiple_of(16) {
            xs.push(1.0);
        }
        for c in xs.chunks_exact(16) {
            let mut got = [0f32; 16];
            // SAFETY: AVX-512F detected above; 16 values in and out.
            unsafe {
                use std::arch::x86_64::*;
                let e = exp_approx_avx512(_mm512_loadu_ps(c.as_ptr()));
                _mm512_storeu_ps(got.as_mut_ptr(), e);
            }
            for (x, g) in c.iter().zip(got) {
                let want = exp_approx(*x);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "exp({x}): {g} vs {want}"
                );
            }
        }
    }
}

//! Counter-based random numbers for sampling: the uniform draw for a token depends only on the
//! request's seed and the index of the token being generated, so a recomputed request (after
//! preemption) or a different batch composition yields the same draws.

/// The SplitMix64 increment (2^64 / golden ratio).
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijective 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `index`-th 64-bit output of a SplitMix64 stream keyed by `mix64(seed)`.
///
/// Keying by the mixed seed makes streams of nearby seeds (0, 1, 2...) unrelated instead of
/// shifted copies of one another.
pub fn random_u64(seed: u64, index: u64) -> u64 {
    let key = mix64(seed.wrapping_add(GOLDEN_GAMMA));
    mix64(key.wrapping_add(index.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA)))
}

/// A uniform number in [0, 1) with 53 random bits, for draw `index` of stream `seed`.
pub fn uniform_f64(seed: u64, index: u64) -> f64 {
    (random_u64(seed, index) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_inputs_same_output_and_range() {
        for seed in [0u64, 1, 42, u64::MAX] {
            for index in [0u64, 1, 2, 1000, u64::MAX] {
                let a = uniform_f64(seed, index);
                assert_eq!(a, uniform_f64(seed, index));
                assert!((0.0..1.0).contains(&a), "{a} out of [0,1)");
            }
        }
    }

    #[test]
    fn uniform_mean_and_buckets_are_flat() {
        let n = 100_000u64;
        let mut buckets = [0u32; 10];
        let mut sum = 0.0;
        for i in 0..n {
            let u = uniform_f64(7, i);
            sum += u;
            buckets[(u * 10.0) as usize] += 1;
        }
        let mean = sum / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        for (b, &c) in buckets.iter().enumerate() {
            let expected = n as f64 / 10.0;
            assert!(
                (c as f64 - expected).abs() < 5.0 * expected.sqrt(),
                "bucket {b}: {c} vs {expected}"
            );
        }
    }

    #[test]
    fn nearby_seeds_give_unrelated_streams() {
        // Stream of seed s+1 must not be stream of seed s shifted by one index.
        let shifted = (0..64)
            .filter(|&i| random_u64(1, i) == random_u64(0, i + 1))
            .count();
        assert_eq!(shifted, 0);
        let equal = (0..1000)
            .filter(|&i| random_u64(3, i) == random_u64(4, i))
            .count();
        assert_eq!(equal, 0);
    }
}

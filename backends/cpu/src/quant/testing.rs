//! Test support: random but well-formed ggml tensor bytes (finite f16 scales) for any format.

use half::f16;

use npu_gguf::GgmlType;

/// A small deterministic generator (xorshift64*).
pub struct TestRng(u64);

impl TestRng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

/// Byte offsets of the f16 scale fields inside one block of `ty`.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4NL | GgmlType::IQ4XS => {
            &[0]
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        _ => &[],
    }
}

/// `rows` rows of `k` values of type `ty` with random contents and finite scales.
pub fn random_ggml_rows(ty: GgmlType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut rng = TestRng::new(seed);
    let rb = ty.row_bytes(k).expect("k must be a whole number of blocks");
    let mut out: Vec<u8> = (0..rows * rb).map(|_| rng.next_u64() as u8).collect();
    match ty {
        GgmlType::F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.uniform(-1.0, 1.0).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(rng.uniform(-1.0, 1.0)).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32(rng.uniform(-1.0, 1.0)).to_le_bytes());
            }
        }
        GgmlType::Q8K => {
            for blk in out.chunks_exact_mut(ty.block_bytes()) {
                blk[0..4].copy_from_slice(&rng.uniform(0.001, 0.01).to_le_bytes());
            }
        }
        _ => {
            for blk in out.chunks_exact_mut(ty.block_bytes()) {
                for &p in f16_fields(ty) {
                    let v = f16::from_f32(rng.uniform(-0.05, 0.05));
                    blk[p..p + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    out
}

//! GGUF's block-quantized weights in the form WeightQuantBatchMatmulV2 takes (`y = x @ ((w +
//! offset) · scale)`, per-group antiquant parameters, group 32): a matrix of `n` rows of `k`
//! values becomes a weight stored (n, k) — seen by the operator as the transposed (k, n) view —
//! with scale and offset stored (n, k/32), also seen transposed as (k/32, n).
//!
//! Q8_0 (f16 `d`, 32 × i8 `q`; `w = d·q`): INT8 weight, scale `d`, no offset. Q4_0 (`w = d·(q −
//! 8)`): INT4 weight `q − 8`, scale `d`, no offset.
//! Q4_1 (f16 `d`, f16 `m`, 16 bytes of nibbles — element i in the low nibble of byte i for
//! i < 16, element i in the high nibble of byte i−16 otherwise; `w = d·q + m`, q in 0..16): INT4
//! weight `s = q − 8` (two per byte, even element in the low nibble), scale `d`, offset
//! `8 + m/d`, so `(s + offset)·scale = d·q + m`; a block with `d = 0` (every value `m`) becomes
//! `s = 1`, scale `m`, offset 0.

use half::f16;

use crate::error::{AscendError, Result};

pub const GROUP: usize = 32;
const Q8_0_BLOCK: usize = 34;
const Q4_1_BLOCK: usize = 20;
const Q4_0_BLOCK: usize = 18;

/// A weight in WeightQuantBatchMatmulV2's per-group form (host bytes, ready to upload).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantWeight {
    pub n: usize,
    pub k: usize,
    /// INT8 (n·k bytes) or INT4 (n·k/2 bytes), row-major (n, k).
    pub weight: Vec<u8>,
    pub int4: bool,
    /// (n, k/32) f16.
    pub scale: Vec<f16>,
    /// (n, k/32) f16, for INT4 weights.
    pub offset: Option<Vec<f16>>,
}

fn check(data: &[u8], n: usize, k: usize, block: usize, name: &str) -> Result<()> {
    if !k.is_multiple_of(GROUP) || data.len() != n * (k / GROUP) * block {
        return Err(AscendError::Invalid(format!(
            "{name} data of {} bytes is not {n} rows of {k} values",
            data.len()
        )));
    }
    Ok(())
}

pub fn from_q8_0(data: &[u8], n: usize, k: usize) -> Result<QuantWeight> {
    check(data, n, k, Q8_0_BLOCK, "Q8_0")?;
    let mut weight = Vec::with_capacity(n * k);
    let mut scale = Vec::with_capacity(n * k / GROUP);
    for b in data.chunks_exact(Q8_0_BLOCK) {
        scale.push(f16::from_le_bytes([b[0], b[1]]));
        weight.extend_from_slice(&b[2..]);
    }
    Ok(QuantWeight {
        n,
        k,
        weight,
        int4: false,
        scale,
        offset: None,
    })
}

/// Q4_0 (f16 `d`, nibbles as in Q4_1; `w = d·(q − 8)`): INT4 weight `q − 8`, scale `d`, no offset.
pub fn from_q4_0(data: &[u8], n: usize, k: usize) -> Result<QuantWeight> {
    check(data, n, k, Q4_0_BLOCK, "Q4_0")?;
    let mut weight = Vec::with_capacity(n * k / 2);
    let mut scale = Vec::with_capacity(n * k / GROUP);
    for b in data.chunks_exact(Q4_0_BLOCK) {
        scale.push(f16::from_le_bytes([b[0], b[1]]));
        let q = |i: usize| {
            if i < 16 {
                b[2 + i] & 0x0f
            } else {
                b[2 + i - 16] >> 4
            }
        };
        for i in (0..GROUP).step_by(2) {
            let (lo, hi) = (q(i).wrapping_sub(8) & 0x0f, q(i + 1).wrapping_sub(8) & 0x0f);
            weight.push(lo | (hi << 4));
        }
    }
    Ok(QuantWeight {
        n,
        k,
        weight,
        int4: true,
        scale,
        offset: None,
    })
}

/// Stacks weights of the same form (their rows in order).
pub fn stack(parts: Vec<QuantWeight>) -> Result<QuantWeight> {
    let mut it = parts.into_iter();
    let mut out = it
        .next()
        .ok_or_else(|| AscendError::Invalid("no weights to stack".into()))?;
    for p in it {
        if p.k != out.k || p.int4 != out.int4 || p.offset.is_some() != out.offset.is_some() {
            return Err(AscendError::Invalid(
                "weights of different forms cannot be stacked".into(),
            ));
        }
        out.n += p.n;
        out.weight.extend(p.weight);
        out.scale.extend(p.scale);
        if let (Some(o), Some(po)) = (out.offset.as_mut(), p.offset) {
            o.extend(po);
        }
    }
    Ok(out)
}

pub fn from_q4_1(data: &[u8], n: usize, k: usize) -> Result<QuantWeight> {
    check(data, n, k, Q4_1_BLOCK, "Q4_1")?;
    let mut weight = Vec::with_capacity(n * k / 2);
    let mut scale = Vec::with_capacity(n * k / GROUP);
    let mut offset = Vec::with_capacity(n * k / GROUP);
    for b in data.chunks_exact(Q4_1_BLOCK) {
        let d = f16::from_le_bytes([b[0], b[1]]);
        let m = f16::from_le_bytes([b[2], b[3]]);
        let q = |i: usize| {
            if i < 16 {
                b[4 + i] & 0x0f
            } else {
                b[4 + i - 16] >> 4
            }
        };
        let s: Vec<u8> = if d.to_f32() == 0.0 {
            scale.push(m);
            offset.push(f16::ZERO);
            vec![1; GROUP]
        } else {
            scale.push(d);
            offset.push(f16::from_f32(8.0 + m.to_f32() / d.to_f32()));
            (0..GROUP).map(|i| q(i).wrapping_sub(8) & 0x0f).collect()
        };
        for pair in s.chunks_exact(2) {
            weight.push(pair[0] | (pair[1] << 4));
        }
    }
    Ok(QuantWeight {
        n,
        k,
        weight,
        int4: true,
        scale,
        offset: Some(offset),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nib(w: &[u8], i: usize) -> f32 {
        let b = w[i / 2];
        let v = if i.is_multiple_of(2) {
            b & 0x0f
        } else {
            b >> 4
        };
        ((v as i8) << 4 >> 4) as f32
    }

    #[test]
    fn q4_1_dequantizes_to_the_same_values() {
        let mut block = vec![0u8; 20];
        block[0..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        block[2..4].copy_from_slice(&f16::from_f32(-1.5).to_le_bytes());
        for i in 0..16 {
            block[4 + i] = (i as u8) | (((15 - i) as u8) << 4);
        }
        let mut zero = vec![0u8; 20];
        zero[2..4].copy_from_slice(&f16::from_f32(0.75).to_le_bytes());
        let data = [block.clone(), zero].concat();
        let qw = from_q4_1(&data, 2, 32).unwrap();
        for i in 0..32 {
            let q = if i < 16 {
                block[4 + i] & 0x0f
            } else {
                block[4 + i - 16] >> 4
            } as f32;
            let want = 0.25 * q - 1.5;
            let off = qw.offset.as_ref().unwrap()[0].to_f32();
            let got = (nib(&qw.weight, i) + off) * qw.scale[0].to_f32();
            assert!((got - want).abs() < 2e-3, "element {i}: {got} vs {want}");
            let got0 = (nib(&qw.weight, 32 + i) + qw.offset.as_ref().unwrap()[1].to_f32())
                * qw.scale[1].to_f32();
            assert_eq!(got0, 0.75);
        }
    }

    #[test]
    fn q4_0_dequantizes_to_the_same_values() {
        let mut block = vec![0u8; 18];
        block[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for i in 0..16 {
            block[2 + i] = (i as u8) | (((15 - i) as u8) << 4);
        }
        let qw = from_q4_0(&block, 1, 32).unwrap();
        assert!(qw.offset.is_none());
        for i in 0..32 {
            let q = if i < 16 {
                block[2 + i] & 0x0f
            } else {
                block[2 + i - 16] >> 4
            } as f32;
            assert_eq!(nib(&qw.weight, i) * qw.scale[0].to_f32(), 0.5 * (q - 8.0));
        }
        let two = stack(vec![qw.clone(), qw]).unwrap();
        assert_eq!((two.n, two.weight.len(), two.scale.len()), (2, 32, 2));
    }

    #[test]
    fn q8_0_keeps_quants_and_scale() {
        let mut block = vec![0u8; 34];
        block[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for i in 0..32 {
            block[2 + i] = (i as i8 - 16) as u8;
        }
        let qw = from_q8_0(&block, 1, 32).unwrap();
        assert_eq!(qw.weight[0] as i8, -16);
        assert_eq!(qw.scale[0].to_f32(), 0.5);
        assert!(from_q8_0(&block[..33], 1, 32).is_err());
    }
}

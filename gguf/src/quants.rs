//! Reference dequantization of ggml tensor formats (the block layouts GGUF files store), written
//! for clarity: one row of any supported type to f32. Fast paths never use this; it is the oracle
//! they are tested against and the loader's route for formats without a packed form.

use half::{bf16, f16};

use crate::{GgmlType, GgufError};

#[inline]
pub fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantizes one row (`dst.len()` elements, a whole number of blocks) of type `ty`. Bytes
/// that are not such a row (`src` of another length, `dst` not whole blocks) are an error, and
/// nothing is written.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), GgufError> {
    let n = dst.len();
    if ty.row_bytes(n) != Some(src.len()) {
        return Err(GgufError::RowLength {
            ty,
            values: n,
            bytes: src.len(),
        });
    }
    let bl = ty.block_len();
    let bb = ty.block_bytes();
    for (blk, out) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(bl)) {
        match ty {
            GgmlType::F32 => out[0] = f32::from_le_bytes(blk.try_into().unwrap()),
            GgmlType::F16 => out[0] = f16_at(blk, 0),
            GgmlType::BF16 => out[0] = bf16::from_le_bytes([blk[0], blk[1]]).to_f32(),
            GgmlType::Q4_0 => q4_0(blk, out),
            GgmlType::Q4_1 => q4_1(blk, out),
            GgmlType::Q5_0 => q5_0(blk, out),
            GgmlType::Q5_1 => q5_1(blk, out),
            GgmlType::Q8_0 => q8_0(blk, out),
            GgmlType::Q2K => q2_k(blk, out),
            GgmlType::Q3K => q3_k(blk, out),
            GgmlType::Q4K => q4_k(blk, out),
            GgmlType::Q5K => q5_k(blk, out),
            GgmlType::Q6K => q6_k(blk, out),
            GgmlType::Q8K => q8_k(blk, out),
            GgmlType::IQ4NL => iq4_nl(blk, out),
            GgmlType::IQ4XS => iq4_xs(blk, out),
        }
    }
    Ok(())
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// The 5-bit values of a Q5_0/Q5_1 block (0..=31).
fn q5_values(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut v = [0u8; 32];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) as u8;
        let h1 = ((qh >> (j + 16)) & 1) as u8;
        v[j] = (qs[j] & 0x0F) | (h0 << 4);
        v[j + 16] = (qs[j] >> 4) | (h1 << 4);
    }
    v
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes(b[2..6].try_into().unwrap());
    let v = q5_values(qh, &b[6..22]);
    for j in 0..32 {
        y[j] = (v[j] as i32 - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes(b[4..8].try_into().unwrap());
    let v = q5_values(qh, &b[8..24]);
    for j in 0..32 {
        y[j] = v[j] as f32 * d + m;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// Scale and min of sub-block `j` (0..8) from the 12 packed 6-bit values of Q4_K/Q5_K.
pub fn k4_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K: d, dmin, 12 scale bytes, 128 bytes of nibbles; 8 sub-blocks of 32.
pub fn q4_k_subblocks(b: &[u8]) -> [(f32, f32, [u8; 32]); 8] {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    let mut out = [(0.0, 0.0, [0u8; 32]); 8];
    for pair in 0..4 {
        let q = &qs[pair * 32..pair * 32 + 32];
        for half in 0..2 {
            let j = pair * 2 + half;
            let (sc, m) = k4_scale_min(j, scales);
            let mut v = [0u8; 32];
            for l in 0..32 {
                v[l] = if half == 0 { q[l] & 0x0F } else { q[l] >> 4 };
            }
            out[j] = (d * sc as f32, -(dmin * m as f32), v);
        }
    }
    out
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    for (j, (d, m, v)) in q4_k_subblocks(b).iter().enumerate() {
        for l in 0..32 {
            y[j * 32 + l] = d * v[l] as f32 + m;
        }
    }
}

/// Q5_K: d, dmin, 12 scale bytes, 32 bytes of high bits, 128 bytes of nibbles.
pub fn q5_k_subblocks(b: &[u8]) -> [(f32, f32, [u8; 32]); 8] {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    let mut out = [(0.0, 0.0, [0u8; 32]); 8];
    for pair in 0..4 {
        let q = &qs[pair * 32..pair * 32 + 32];
        for half in 0..2 {
            let j = pair * 2 + half;
            let bit = 1u8 << j;
            let (sc, m) = k4_scale_min(j, scales);
            let mut v = [0u8; 32];
            for l in 0..32 {
                let lo = if half == 0 { q[l] & 0x0F } else { q[l] >> 4 };
                v[l] = lo | if qh[l] & bit != 0 { 16 } else { 0 };
            }
            out[j] = (d * sc as f32, -(dmin * m as f32), v);
        }
    }
    out
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    for (j, (d, m, v)) in q5_k_subblocks(b).iter().enumerate() {
        for l in 0..32 {
            y[j * 32 + l] = d * v[l] as f32 + m;
        }
    }
}

/// Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 signed scales, d at the end.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[half * 64..half * 64 + 64];
        let qh = &b[128 + half * 32..128 + half * 32 + 32];
        let sc = &b[192 + half * 8..192 + half * 8 + 8];
        let yo = &mut y[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            yo[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            yo[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            yo[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            yo[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// Q2_K: 16 scale bytes (4-bit scale, 4-bit min), 64 bytes of 2-bit values, d, dmin.
fn q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    let mut is = 0;
    let mut yi = 0;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0F) as f32;
                let ml = dmin * (sc >> 4) as f32;
                for l in 0..16 {
                    y[yi] = dl * ((q[part * 16 + l] >> shift) & 3) as f32 - ml;
                    yi += 1;
                }
            }
        }
    }
}

/// Q3_K: 32 bytes high-bit mask, 64 bytes of 2-bit values, 12 bytes of 6-bit scales, d.
fn q3_k(b: &[u8], y: &mut [f32]) {
    let hm = &b[0..32];
    let qs = &b[32..96];
    let sb = &b[96..108];
    let d = f16_at(b, 108);
    // Unpack sixteen 6-bit scales: low 4 bits from bytes 0..8, high 2 bits from bytes 8..12.
    let mut scales = [0i32; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        let low = if i < 8 { sb[i] & 0x0F } else { sb[i - 8] >> 4 };
        let high = (sb[8 + i % 4] >> (2 * (i / 4))) & 3;
        *s = (low | (high << 4)) as i32 - 32;
    }
    let mut is = 0;
    let mut yi = 0;
    let mut m = 1u8;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * scales[is] as f32;
                is += 1;
                for l in 0..16 {
                    let idx = part * 16 + l;
                    let v = ((q[idx] >> shift) & 3) as i32 - if hm[idx] & m != 0 { 0 } else { 4 };
                    y[yi] = dl * v as f32;
                    yi += 1;
                }
            }
            m <<= 1;
        }
    }
}

fn q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes(b[0..4].try_into().unwrap());
    for j in 0..256 {
        y[j] = (b[4 + j] as i8) as f32 * d;
    }
}

/// The values IQ4_NL and IQ4_XS's 4-bit indices stand for (ggml's `kvalues_iq4nl`).
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// 32 indices in 16 bytes: values 0..16 in the low nibbles, 16..32 in the high ones, each the
/// table value times `d`.
fn iq4_values(d: f32, qs: &[u8], y: &mut [f32]) {
    for j in 0..16 {
        y[j] = d * IQ4_VALUES[(qs[j] & 15) as usize] as f32;
        y[j + 16] = d * IQ4_VALUES[(qs[j] >> 4) as usize] as f32;
    }
}

fn iq4_nl(b: &[u8], y: &mut [f32]) {
    iq4_values(f16_at(b, 0), &b[2..18], y);
}

/// The 6-bit scale of sub-block `j` (0..8) of an IQ4_XS block, with its offset of 32 removed.
pub fn iq4_xs_scale(b: &[u8], j: usize) -> i32 {
    let high = u16::from_le_bytes([b[2], b[3]]);
    let low = (b[4 + j / 2] >> (4 * (j % 2))) & 15;
    (low as i32 | ((((high >> (2 * j)) & 3) as i32) << 4)) - 32
}

fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..8 {
        let dl = d * iq4_xs_scale(b, j) as f32;
        iq4_values(
            dl,
            &b[8 + 16 * j..8 + 16 * j + 16],
            &mut y[32 * j..32 * j + 32],
        );
    }
}

#[cfg(test)]
mod tests;

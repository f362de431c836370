//! Quantization of f32 rows into the ggml block formats the backends run fast (Q8_0, Q4_0, Q4_K,
//! Q5_K, Q6_K): what the loader uses to turn a Hugging Face checkpoint's bf16/f16/f32 weights into
//! `npu_serving.quantize` formats while loading, tensor by tensor.
//!
//! Every quantizer reproduces llama.cpp's reference one byte for byte (`quantize_row_q8_0_ref`,
//! `quantize_row_q4_0_ref`, `quantize_row_q4_K_ref`, `quantize_row_q5_K_ref`,
//! `quantize_row_q6_K_ref` of ggml/src/ggml-quants.c, llama.cpp as vendored by llama-cpp-python
//! 0.3.36): the bytes `llama-quantize --pure` writes without an importance matrix. That means
//! ggml's `nearest_int` (the 1.5·2²³ trick, ties to even), `roundf` (ties away from zero),
//! truncating float→int casts, ggml's own fp32→fp16 rounding, and every float expression in C's
//! order with no fused multiply-add (ggml-base is built without -march, so x86-64 builds cannot
//! contract; Rust never contracts).
//!
//! Golden values: `scripts/quant-golden.sh` compiles ggml-quants.c (-O2 -ffp-contract=off
//! -DNDEBUG) with a small harness that quantizes 4,096 deterministic rows of 256 values (varied
//! scales: 2^±20, 1e-30, 6e4, 1e20, subnormals, all-zero, constant, one outlier, one-signed,
//! sparse, per-block scales) and prints a SHA-256 per type plus the hex of one explicit row;
//! `quantize/tests.rs` regenerates the same rows and checks both. The inputs must be finite:
//! a NaN or infinity is an error here (C's float→int casts are undefined on them).
//!
//! Q4_K and Q5_K spend nearly all their time in the `make_qkx2_quants` scale search; it runs over
//! the 8 sub-blocks of a super-block as 8 lanes (`kquants`), compiled for AVX2 when the CPU has
//! it (chosen at run time) and portable otherwise, and is tested bit for bit against a plain
//! per-sub-block port.

use thiserror::Error;

use crate::quants::dequantize_row;
use crate::{GgmlType, GgufError};

mod kquants;
#[cfg(test)]
mod tests;

use kquants::q6_k_block;

/// Why a row could not be quantized (or converted); every message names the type and lengths.
#[derive(Debug, Error)]
pub enum QuantizeError {
    #[error("cannot quantize to {}: the load-time quantizer writes {}", .0.name(), QUANTIZE_TYPES)]
    UnsupportedType(GgmlType),
    #[error("{values} values are not a whole number of {}'s {}-value blocks", ty.name(), ty.block_len())]
    NotWholeBlocks { ty: GgmlType, values: usize },
    #[error("a row of {values} values quantized to {} takes {need} bytes, but the output has {got}", ty.name())]
    OutputLength {
        ty: GgmlType,
        values: usize,
        need: usize,
        got: usize,
    },
    #[error("{values} values are not whole rows of {cols} columns (quantizing to {})", ty.name())]
    NotWholeRows {
        ty: GgmlType,
        values: usize,
        cols: usize,
    },
    #[error("value {index} is {value}, which cannot be quantized to {} (only finite values can)", ty.name())]
    NonFinite {
        ty: GgmlType,
        index: usize,
        value: f32,
    },
    #[error("converting {} bytes to f32: only F32, F16 and BF16 rows are float rows", .0.name())]
    NotFloat(GgmlType),
    #[error(transparent)]
    Source(#[from] GgufError),
}

/// The formats `quantize_row` writes, for messages.
pub const QUANTIZE_TYPES: &str = "Q8_0, Q4_0, Q4_K, Q5_K, Q6_K";

/// Whether `quantize_row` can write `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K
    )
}

/// The formats a float row can be quantized into at load: quantizes `x` (a whole number of
/// `ty`'s blocks, all finite) into `out` (exactly `ty.row_bytes(x.len())` bytes), byte for byte
/// as llama.cpp's reference quantizer of that type. On error nothing meaningful is in `out`.
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<(), QuantizeError> {
    check_row(ty, x.len(), out.len())?;
    if let Some(index) = x.iter().position(|v| !v.is_finite()) {
        return Err(QuantizeError::NonFinite {
            ty,
            index,
            value: x[index],
        });
    }
    let bl = ty.block_len();
    let bb = ty.block_bytes();
    let blocks = x.chunks_exact(bl).zip(out.chunks_exact_mut(bb));
    match ty {
        GgmlType::Q8_0 => blocks.for_each(|(x, y)| q8_0_block(x, y)),
        GgmlType::Q4_0 => blocks.for_each(|(x, y)| q4_0_block(x, y)),
        GgmlType::Q4K => kquants::q4_k_row(x, out),
        GgmlType::Q5K => kquants::q5_k_row(x, out),
        GgmlType::Q6K => blocks.for_each(|(x, y)| q6_k_block(x, y)),
        _ => unreachable!("check_row admits only quantizable types"),
    }
    Ok(())
}

/// `quantize_row` with the K-quant scale search always in its plain per-sub-block form (no SIMD,
/// no lanes): the oracle the fast forms are tested against. Same bytes, several times slower.
pub fn quantize_row_reference(
    ty: GgmlType,
    x: &[f32],
    out: &mut [u8],
) -> Result<(), QuantizeError> {
    match ty {
        GgmlType::Q4K | GgmlType::Q5K => {
            check_row(ty, x.len(), out.len())?;
            if let Some(index) = x.iter().position(|v| !v.is_finite()) {
                return Err(QuantizeError::NonFinite {
                    ty,
                    index,
                    value: x[index],
                });
            }
            kquants::k_row_reference(ty == GgmlType::Q5K, x, out);
            Ok(())
        }
        _ => quantize_row(ty, x, out),
    }
}

fn check_row(ty: GgmlType, values: usize, got: usize) -> Result<(), QuantizeError> {
    if !can_quantize(ty) {
        return Err(QuantizeError::UnsupportedType(ty));
    }
    let need = ty
        .row_bytes(values)
        .ok_or(QuantizeError::NotWholeBlocks { ty, values })?;
    if need != got {
        return Err(QuantizeError::OutputLength {
            ty,
            values,
            need,
            got,
        });
    }
    Ok(())
}

/// Many rows of `cols` values at once over `threads` threads (0 counts as 1; never more threads
/// than rows), rows split in contiguous chunks: the same bytes as `quantize_row` row by row.
/// A non-finite value's error gives its index in the whole of `x`.
pub fn quantize_rows(
    ty: GgmlType,
    x: &[f32],
    cols: usize,
    out: &mut [u8],
    threads: usize,
) -> Result<(), QuantizeError> {
    if !can_quantize(ty) {
        return Err(QuantizeError::UnsupportedType(ty));
    }
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(QuantizeError::NotWholeRows {
            ty,
            values: x.len(),
            cols,
        });
    }
    let row_bytes = ty
        .row_bytes(cols)
        .ok_or(QuantizeError::NotWholeBlocks { ty, values: cols })?;
    let rows = x.len() / cols;
    let need = rows
        .checked_mul(row_bytes)
        .ok_or(QuantizeError::NotWholeBlocks { ty, values: cols })?;
    if out.len() != need {
        return Err(QuantizeError::OutputLength {
            ty,
            values: x.len(),
            need,
            got: out.len(),
        });
    }
    if rows == 0 {
        return Ok(());
    }
    let threads = threads.clamp(1, rows);
    let per = rows.div_ceil(threads);
    let run = |first_row: usize, x: &[f32], out: &mut [u8]| -> Result<(), QuantizeError> {
        for (r, (xr, or)) in x
            .chunks_exact(cols)
            .zip(out.chunks_exact_mut(row_bytes))
            .enumerate()
        {
            quantize_row(ty, xr, or).map_err(|e| match e {
                QuantizeError::NonFinite { ty, index, value } => QuantizeError::NonFinite {
                    ty,
                    index: (first_row + r) * cols + index,
                    value,
                },
                e => e,
            })?;
        }
        Ok(())
    };
    if threads == 1 {
        return run(0, x, out);
    }
    std::thread::scope(|s| {
        let mut chunks = x
            .chunks(per * cols)
            .zip(out.chunks_mut(per * row_bytes))
            .enumerate();
        // The first chunk runs on this thread; the others each on their own.
        let first = chunks.next();
        let handles: Vec<_> = chunks
            .map(|(c, (xc, oc))| s.spawn(move || run(c * per, xc, oc)))
            .collect();
        let mut result = match first {
            Some((_, (xc, oc))) => run(0, xc, oc),
            None => Ok(()),
        };
        for h in handles {
            // A quantizer thread cannot panic short of a bug; pass such a panic on unchanged.
            let r = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            // Chunks are joined in row order: the first error is the lowest row's.
            if result.is_ok() {
                result = r;
            }
        }
        result
    })
}

/// Converts a row of `ty` (F32, F16 or BF16) bytes to f32, `out.len()` values: the loader's step
/// before `quantize_row`. The bytes must be exactly `out.len()` values of `ty`.
pub fn float_row_to_f32(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantizeError> {
    if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        return Err(QuantizeError::NotFloat(ty));
    }
    dequantize_row(ty, bytes, out)?;
    Ok(())
}

/// ggml's `nearest_int`: adds 1.5·2²³ so that the float's low mantissa bits hold the rounded
/// integer (ties to even). Exact for |v| ≤ 4194303; beyond that it wraps as the C does, which no
/// finite input reaches where it matters.
#[inline(always)]
pub(crate) fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// ggml's fp32→fp16 (`ggml_compute_fp32_to_fp16`, its software form, which ggml-base uses on
/// every CPU): round to nearest even, overflow to infinity, NaN to 0x7E00. Little-endian bytes.
#[inline]
pub(crate) fn fp16_bits(f: f32) -> u16 {
    let scale_to_inf = f32::from_bits(0x7780_0000); // 2^112
    let scale_to_zero = f32::from_bits(0x0880_0000); // 2^-110
    let mut base = (f.abs() * scale_to_inf) * scale_to_zero;
    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let bias = (shl1_w & 0xFF00_0000).max(0x7100_0000);
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let exp_bits = (bits >> 13) & 0x0000_7C00;
    let mantissa_bits = bits & 0x0000_0FFF;
    let nonsign = exp_bits + mantissa_bits;
    ((sign >> 16)
        | if shl1_w > 0xFF00_0000 {
            0x7E00
        } else {
            nonsign
        }) as u16
}

/// The f32 value of fp16 bits (exact).
#[inline]
pub(crate) fn fp16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// C's float→int conversion as x86-64 does it (`cvttss2si`): truncation, and i32::MIN for NaN
/// and values out of range. The C casts to int8_t take the low byte of that. It matters where
/// a block's scale is so small (all |x| below ~3.7e-37) that 1/d overflows to infinity:
/// llama.cpp then stores 0 for every value, and so does this.
#[inline(always)]
fn c_to_int(v: f32) -> i32 {
    if (-2_147_483_648.0..2_147_483_648.0).contains(&v) {
        v as i32
    } else {
        i32::MIN
    }
}

/// One Q8_0 block: f16 d = amax/127, then `roundf(x/d)` as i8.
fn q8_0_block(x: &[f32], y: &mut [u8]) {
    let mut amax = 0.0f32;
    for &v in x {
        let a = v.abs();
        amax = if amax > a { amax } else { a };
    }
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    y[..2].copy_from_slice(&fp16_bits(d).to_le_bytes());
    for (q, &v) in y[2..34].iter_mut().zip(x) {
        *q = c_to_int((v * id).round()) as i8 as u8;
    }
}

/// One Q4_0 block: d = (the value of largest magnitude, first such)/-8, then
/// `min(15, trunc(x/d + 8.5))`, low nibbles the first 16 values, high nibbles the last 16.
fn q4_0_block(x: &[f32], y: &mut [u8]) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    y[..2].copy_from_slice(&fp16_bits(d).to_le_bytes());
    for j in 0..16 {
        let x0 = x[j] * id;
        let x1 = x[16 + j] * id;
        // C: MIN(15, (int8_t)(x + 8.5f)), then uint8_t.
        let q0 = (c_to_int(x0 + 8.5) as i8).min(15) as u8;
        let q1 = (c_to_int(x1 + 8.5) as i8).min(15) as u8;
        y[2 + j] = q0 | (q1 << 4);
    }
}

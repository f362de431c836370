//! Fast 8-bit activation quantization (the matmuls' input), bit-identical to the reference in
//! `quant::acts`: per 32-value block, scale `amax/127` rounded through f16, values rounded to
//! nearest-even, and the block's integer sum. Many rows are split across the thread pool.

use std::ops::Range;

use super::{Isa, KernelError};
use crate::disjoint::{GridError, Tile, TileGrid};
use crate::quant::acts::{quantize_row, quantize_row_q8k, ActBlocks, QuantizedActs, QBLOCK, QK_K};
use crate::threadpool::ThreadPool;

/// Quantizes `rows` rows of `k` values of `x` into `acts` as `blocks` says (`k` a multiple of
/// 32, of 256 for Q8_K).
pub fn quantize_acts(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    rows: usize,
    k: usize,
    blocks: ActBlocks,
    acts: &mut QuantizedActs,
) -> Result<(), KernelError> {
    let bad = |message: String| KernelError::BadShape {
        op: "activation quantization",
        message,
    };
    let per = block_len(blocks);
    if !k.is_multiple_of(per) {
        return Err(bad(format!("row length {k} is not a multiple of {per}")));
    }
    if x.len() < rows * k {
        return Err(bad(format!("{} values for {rows} rows of {k}", x.len())));
    }
    let isa = isa.checked();
    acts.resize(rows, k);
    acts.blocks = blocks;
    let split = Split::new(pool, acts, rows, k, blocks).map_err(|e| bad(e.to_string()))?;
    pool.run(split.parts.len(), |t| {
        let mut part = split.take(isa, t);
        for (j, r) in split.parts[t].clone().enumerate() {
            part.put(j, &x[r * k..(r + 1) * k]);
        }
    })?;
    drop(split);
    finish(isa, rows, acts);
    Ok(())
}

/// The rows of `acts` cut into one part per task (several tasks only for 8 rows or more), each
/// part's quantized values, scales, scaled sums and integer sums a tile of its own.
struct Split<'a> {
    blocks: ActBlocks,
    parts: Vec<Range<usize>>,
    qs: TileGrid<'a, i8>,
    ds: TileGrid<'a, f32>,
    ss: TileGrid<'a, f32>,
    sums: TileGrid<'a, i32>,
    k: usize,
}

impl<'a> Split<'a> {
    /// `acts` must be sized for `rows` rows of `k` (a multiple of 32) already.
    fn new(
        pool: &ThreadPool,
        acts: &'a mut QuantizedActs,
        rows: usize,
        k: usize,
        blocks: ActBlocks,
    ) -> Result<Self, GridError> {
        let nb = k / QBLOCK;
        let tasks = if rows >= 8 && pool.threads() > 1 {
            pool.threads().min(rows)
        } else {
            1
        };
        let parts: Vec<Range<usize>> = (0..tasks)
            .map(|t| crate::threadpool::split_range(rows, tasks, t))
            .collect();
        Ok(Self {
            qs: TileGrid::rows(&mut acts.qs[..rows * k], k, parts.clone())?,
            ds: TileGrid::rows(&mut acts.d[..rows * nb], nb, parts.clone())?,
            ss: TileGrid::rows(&mut acts.s[..rows * nb], nb, parts.clone())?,
            sums: TileGrid::rows(&mut acts.isum[..rows * nb], nb, parts.clone())?,
            blocks,
            parts,
            k,
        })
    }

    /// Part `t`'s writer (each part taken once, by its task).
    fn take(&self, isa: Isa, t: usize) -> PartWriter<'_> {
        PartWriter {
            q: self.qs.take(t, 0),
            d: self.ds.take(t, 0),
            s: self.ss.take(t, 0),
            i: self.sums.take(t, 0),
            k: self.k,
            blocks: self.blocks,
            isa,
        }
    }
}

/// One part's tiles of the quantized activations.
struct PartWriter<'g> {
    q: Tile<'g, i8>,
    d: Tile<'g, f32>,
    s: Tile<'g, f32>,
    i: Tile<'g, i32>,
    k: usize,
    blocks: ActBlocks,
    isa: Isa,
}

impl PartWriter<'_> {
    /// Quantizes `x` (`k` values) as the part's row `j`.
    fn put(&mut self, j: usize, x: &[f32]) {
        let (k, nb) = (self.k, self.k / QBLOCK);
        let row = match self.blocks {
            ActBlocks::Q8_0 => quantize_row_isa,
            // Q8_K rows take the portable quantizer (a pass over the row and one over its
            // values; llama.cpp's x86 build uses its reference too).
            ActBlocks::Q8K => quantize_row_q8k_checked,
        };
        row(
            self.isa,
            x,
            &mut self.q.contiguous_mut()[j * k..(j + 1) * k],
            &mut self.d.contiguous_mut()[j * nb..(j + 1) * nb],
            &mut self.s.contiguous_mut()[j * nb..(j + 1) * nb],
            &mut self.i.contiguous_mut()[j * nb..(j + 1) * nb],
        );
    }
}

/// One row with the instruction set `isa` (which passed `Isa::checked`): `qs` as long as `x`
/// (a multiple of 32), `d`, `s`, `isum` one per block.
#[inline]
fn quantize_row_isa(
    isa: Isa,
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    i: &mut [i32],
) {
    assert!(
        qs.len() == x.len() && [d.len(), s.len(), i.len()] == [x.len() / QBLOCK; 3],
        "a row of {} values with {} quantized values and {} / {} / {} block fields",
        x.len(),
        qs.len(),
        d.len(),
        s.len(),
        i.len()
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` passed `Isa::checked`, so the CPU has AVX-512 F/BW/VL; the row
        // function reads and writes `x.len() / 32` blocks of its slices, whose lengths were
        // checked above.
        Isa::Avx512Vnni => unsafe { row_avx512(x, qs, d, s, i) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` passed `Isa::checked`, so the CPU has AVX2 (and with it SSE4.1).
        Isa::Avx2 => unsafe { row_avx2(x, qs, d, s, i) },
        _ => quantize_row(x, qs, d, s, i),
    }
}

/// The Q8_K quantizer with `quantize_row_isa`'s signature and length checks: the reference's
/// operations compiled for the instruction set (rounding by `roundps`, the value loops in vector
/// registers), so the same bits on every one.
fn quantize_row_q8k_checked(
    isa: Isa,
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    i: &mut [i32],
) {
    assert!(
        x.len().is_multiple_of(QK_K)
            && qs.len() == x.len()
            && [d.len(), s.len(), i.len()] == [x.len() / QBLOCK; 3],
        "a Q8_K row of {} values with {} quantized values and {} / {} / {} block fields",
        x.len(),
        qs.len(),
        d.len(),
        s.len(),
        i.len()
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` passed `Isa::checked`, so the CPU has AVX-512 F/BW/VL; the lengths the
        // function relies on were asserted above.
        Isa::Avx512Vnni => unsafe { row_q8k_avx512(x, qs, d, s, i) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` passed `Isa::checked`, so the CPU has AVX2; the lengths the function
        // relies on were asserted above.
        Isa::Avx2 => unsafe { row_q8k_avx2(x, qs, d, s, i) },
        _ => quantize_row_q8k(x, qs, d, s, i),
    }
}

/// The Q8_K reference in AVX-512 registers, value for value: the largest magnitude by `vmaxps`
/// with the running maximum second (a NaN weighs nothing, as the reference's strict `>` skips
/// it), the first value of that magnitude for the sign, the scale as the reference computes it,
/// each value multiplied, rounded to nearest-even, NaN made 0, clamped as the reference clamps,
/// converted; the block sums in integers. So the same bits.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL; `x.len()` a multiple of 256, `qs` as long, `d`, `s`, `i`
/// one per 32 values (checked by the caller).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn row_q8k_avx512(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], i: &mut [i32]) {
    use crate::quant::acts::QK_K;
    use half::f16;
    use std::arch::x86_64::*;
    const CHUNKS: usize = QK_K / 16;
    for sb in 0..x.len() / QK_K {
        let p = x.as_ptr().add(sb * QK_K);
        let mut m = _mm512_setzero_ps();
        for c in 0..CHUNKS {
            m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(p.add(16 * c))), m);
        }
        let amax = _mm512_reduce_max_ps(m);
        let blocks = sb * (QK_K / QBLOCK)..(sb + 1) * (QK_K / QBLOCK);
        if amax == 0.0 {
            qs[sb * QK_K..(sb + 1) * QK_K].fill(0);
            d[blocks.clone()].fill(0.0);
            s[blocks.clone()].fill(0.0);
            i[blocks].fill(0);
            continue;
        }
        let va = _mm512_set1_ps(amax);
        let mut max = 0.0;
        for c in 0..CHUNKS {
            let v = _mm512_loadu_ps(p.add(16 * c));
            let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(v), va);
            if hit != 0 {
                max = *x.get_unchecked(sb * QK_K + 16 * c + hit.trailing_zeros() as usize);
                break;
            }
        }
        let iscale = -127.0 / max;
        let vis = _mm512_set1_ps(iscale);
        let (hi, lo) = (_mm512_set1_ps(127.0), _mm512_set1_ps(-128.0));
        let scale = 1.0 / iscale;
        for (j, b) in blocks.enumerate() {
            let mut sum = _mm512_setzero_si512();
            for h in 0..2 {
                let at = j * QBLOCK + 16 * h;
                let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm512_mul_ps(_mm512_loadu_ps(p.add(at)), vis),
                );
                let r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r), r);
                let q = _mm512_cvttps_epi32(_mm512_max_ps(_mm512_min_ps(r, hi), lo));
                _mm_storeu_si128(
                    qs.as_mut_ptr().add(sb * QK_K + at) as *mut __m128i,
                    _mm512_cvtepi32_epi8(q),
                );
                sum = _mm512_add_epi32(sum, q);
            }
            let sum = _mm512_reduce_add_epi32(sum);
            d[b] = scale;
            i[b] = sum;
            s[b] = f16::from_f32(scale * sum as f32).to_f32();
        }
    }
}

/// [`row_q8k_avx512`] in AVX2 registers: the same steps, 8 lanes at a time (the first value of
/// the largest magnitude found by a compare and its mask), so the same bits.
///
/// # Safety
/// The CPU must have AVX2; `x.len()` a multiple of 256, `qs` as long, `d`, `s`, `i` one per 32
/// values (checked by the caller).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_q8k_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], i: &mut [i32]) {
    use crate::quant::acts::QK_K;
    use half::f16;
    use std::arch::x86_64::*;
    const CHUNKS: usize = QK_K / 8;
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    for sb in 0..x.len() / QK_K {
        let p = x.as_ptr().add(sb * QK_K);
        let mut m = _mm256_setzero_ps();
        for c in 0..CHUNKS {
            m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(p.add(8 * c)), abs_mask), m);
        }
        // Lanes hold no NaN, so their maximum does not depend on the order.
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        let amax = lanes.iter().fold(0f32, |a, &l| a.max(l));
        let blocks = sb * (QK_K / QBLOCK)..(sb + 1) * (QK_K / QBLOCK);
        if amax == 0.0 {
            qs[sb * QK_K..(sb + 1) * QK_K].fill(0);
            d[blocks.clone()].fill(0.0);
            s[blocks.clone()].fill(0.0);
            i[blocks].fill(0);
            continue;
        }
        let va = _mm256_set1_ps(amax);
        let mut max = 0.0;
        for c in 0..CHUNKS {
            let v = _mm256_and_ps(_mm256_loadu_ps(p.add(8 * c)), abs_mask);
            let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(v, va));
            if hit != 0 {
                max = *x.get_unchecked(sb * QK_K + 8 * c + hit.trailing_zeros() as usize);
                break;
            }
        }
        let iscale = -127.0 / max;
        let vis = _mm256_set1_ps(iscale);
        let (hi, lo) = (_mm256_set1_ps(127.0), _mm256_set1_ps(-128.0));
        let scale = 1.0 / iscale;
        for (j, b) in blocks.enumerate() {
            let mut q = [_mm256_setzero_si256(); 4];
            for (k, qk) in q.iter_mut().enumerate() {
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm256_mul_ps(_mm256_loadu_ps(p.add(j * QBLOCK + 8 * k)), vis),
                );
                let r = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(r, r), r);
                *qk = _mm256_cvttps_epi32(_mm256_max_ps(_mm256_min_ps(r, hi), lo));
            }
            // Packing interleaves the 128-bit halves; one permutation puts the bytes in order.
            let w01 = _mm256_packs_epi32(q[0], q[1]);
            let w23 = _mm256_packs_epi32(q[2], q[3]);
            let bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(w01, w23),
                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
            );
            _mm256_storeu_si256(
                qs.as_mut_ptr().add(sb * QK_K + j * QBLOCK) as *mut __m256i,
                bytes,
            );
            let t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
            let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b01_00_11_10>(t));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32::<0b10_11_00_01>(t)));
            d[b] = scale;
            i[b] = sum;
            s[b] = f16::from_f32(scale * sum as f32).to_f32();
        }
    }
}

/// Values per scale of `blocks`.
fn block_len(blocks: ActBlocks) -> usize {
    match blocks {
        ActBlocks::Q8_0 => QBLOCK,
        ActBlocks::Q8K => QK_K,
    }
}

/// What follows the rows: the ISA check's fault hook, and the AMX tile layout (whole 16-row
/// tiles, shared by every matrix this activation multiplies).
fn finish(isa: Isa, rows: usize, acts: &mut QuantizedActs) {
    super::inject_fault(isa, acts.d.first_mut());
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni && rows >= 16 && crate::kernels::matmul::amx::available() {
        acts.fill_tiles();
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = rows;
}

/// Calls `f(r, row)` for every row `r < rows` of `out` (rows `ld` apart, `cols` values each), in
/// parallel as `quantize_acts` splits rows, and quantizes each row into `acts` right after `f`
/// wrote it, while it is in this core's cache: the same `acts` as `quantize_acts` of the rows
/// `f` left (an op's output quantized for the matmul that reads it next, without a pass of its
/// own). `cols` must be a multiple of 32.
#[allow(clippy::too_many_arguments)]
pub fn map_rows_quantized<F>(
    pool: &ThreadPool,
    isa: Isa,
    out: &mut [f32],
    rows: usize,
    cols: usize,
    ld: usize,
    blocks: ActBlocks,
    acts: &mut QuantizedActs,
    f: F,
) -> Result<(), KernelError>
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let bad = |message: String| KernelError::BadShape {
        op: "row map with quantization",
        message,
    };
    let per = block_len(blocks);
    if !cols.is_multiple_of(per) {
        return Err(bad(format!("row length {cols} is not a multiple of {per}")));
    }
    let isa = isa.checked();
    acts.resize(rows, cols);
    acts.blocks = blocks;
    if rows == 0 {
        return Ok(());
    }
    let split = Split::new(pool, acts, rows, cols, blocks).map_err(|e| bad(e.to_string()))?;
    let xs = TileGrid::row_parts(out, ld, split.parts.clone(), 0..cols)
        .map_err(|e| bad(e.to_string()))?;
    pool.run(split.parts.len(), |t| {
        let mut x = xs.take(t, 0);
        let mut part = split.take(isa, t);
        for (j, r) in split.parts[t].clone().enumerate() {
            let xr = x.row_mut(r);
            f(r, xr);
            part.put(j, xr);
        }
    })?;
    drop((split, xs));
    finish(isa, rows, acts);
    Ok(())
}

/// The reference quantizer in AVX2 registers, the same arithmetic on each value: the block's
/// absolute maximum lane-wise (`vmaxps` with the running maximum second returns it for a NaN
/// value, as `f32::max` does), the scale and its inverse as the reference computes them, each
/// value multiplied, rounded to nearest-even (`roundps`), NaN made 0, clamped to ±127 and
/// converted; the block sum in integers. So the same bits, NaN and infinities included.
///
/// # Safety
/// The CPU must have AVX2; `qs` must hold `x.len()` values rounded down to whole blocks of 32,
/// and `d`, `s`, `isum` one per block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], isum: &mut [i32]) {
    use half::f16;
    use std::arch::x86_64::*;
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let (hi, lo) = (_mm256_set1_ps(127.0), _mm256_set1_ps(-127.0));
    for b in 0..x.len() / QBLOCK {
        let p = x.as_ptr().add(b * QBLOCK);
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let mut m = _mm256_setzero_ps();
        for vi in v {
            m = _mm256_max_ps(_mm256_and_ps(vi, abs_mask), m);
        }
        // Lanes hold no NaN, so their maximum does not depend on the order.
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        let amax = lanes.iter().fold(0f32, |a, &l| a.max(l));
        let dd = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let vid = _mm256_set1_ps(id);
        let mut q = [_mm256_setzero_si256(); 4];
        for (qi, vi) in q.iter_mut().zip(v) {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(vi, vid),
            );
            let r = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(r, r), r);
            *qi = _mm256_cvttps_epi32(_mm256_max_ps(_mm256_min_ps(r, hi), lo));
        }
        // Packing interleaves the 128-bit halves; one permutation puts the bytes in order.
        let w01 = _mm256_packs_epi32(q[0], q[1]);
        let w23 = _mm256_packs_epi32(q[2], q[3]);
        let bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(w01, w23),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
        );
        _mm256_storeu_si256(qs.as_mut_ptr().add(b * QBLOCK) as *mut __m256i, bytes);
        let t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
        let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b01_00_11_10>(t));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32::<0b10_11_00_01>(t)));
        d[b] = f16::from_f32(dd).to_f32();
        s[b] = f16::from_f32(dd * sum as f32).to_f32();
        isum[b] = sum;
    }
}

#[cfg(target_arch = "x86_64")]
/// # Safety
/// The CPU must have AVX-512 F/BW/VL; `qs` must hold `x.len()` values rounded down to whole
/// blocks of 32, and `d`, `s`, `isum` one per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn row_avx512(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], isum: &mut [i32]) {
    use half::f16;
    use std::arch::x86_64::*;
    for b in 0..x.len() / QBLOCK {
        let p = x.as_ptr().add(b * QBLOCK);
        let v0 = _mm512_loadu_ps(p);
        let v1 = _mm512_loadu_ps(p.add(16));
        // `vmaxps` returns its second operand when the first is NaN, so with the running
        // maximum second a NaN weighs nothing, as in the reference's `f32::max` fold; the lanes
        // then hold no NaN and their maximum does not depend on the order.
        let m = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps());
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v1), m));
        let dd = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let vid = _mm512_set1_ps(id);
        // Rounded to nearest-even, NaN made 0, clamped to ±127 in floats (so infinities
        // saturate), then converted: the reference's steps.
        let (hi, lo) = (_mm512_set1_ps(127.0), _mm512_set1_ps(-127.0));
        let q = |v: __m512| {
            let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(v, vid),
            );
            let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r);
            let r = _mm512_maskz_mov_ps(ordered, r);
            _mm512_cvttps_epi32(_mm512_max_ps(_mm512_min_ps(r, hi), lo))
        };
        let (q0, q1) = (q(v0), q(v1));
        let out = qs.as_mut_ptr().add(b * QBLOCK);
        _mm_storeu_si128(out as *mut __m128i, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(out.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(q1));
        let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        d[b] = f16::from_f32(dd).to_f32();
        s[b] = f16::from_f32(dd * sum as f32).to_f32();
        isum[b] = sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::testing::TestRng;

    #[test]
    fn every_isa_matches_the_q8k_reference() {
        let pool = ThreadPool::new(2);
        let mut rng = TestRng::new(4);
        let (rows, k) = (11, 768);
        let mut x: Vec<f32> = (0..rows * k).map(|_| rng.uniform(-3.0, 3.0)).collect();
        // A zero super-block, one whose largest magnitude is negative and appears twice with
        // both signs (the first one sets the sign), and a NaN.
        x[..256].fill(0.0);
        x[300] = -9.0;
        x[400] = 9.0;
        x[1000] = f32::NAN;
        let mut want = QuantizedActs::new();
        want.quantize_q8k(&x, rows, k);
        assert_eq!(want.qs[300], -127);
        assert_eq!(want.qs[400], 127);
        for isa in Isa::available() {
            let mut got = QuantizedActs::new();
            quantize_acts(&pool, isa, &x, rows, k, ActBlocks::Q8K, &mut got).unwrap();
            assert_eq!(got.blocks, ActBlocks::Q8K);
            assert_eq!(got.qs, want.qs, "{}", isa.name());
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.d), bits(&want.d), "{}", isa.name());
            assert_eq!(bits(&got.s), bits(&want.s), "{}", isa.name());
            assert_eq!(got.isum, want.isum, "{}", isa.name());
        }
    }

    #[test]
    fn every_isa_matches_the_reference() {
        let pool = ThreadPool::new(2);
        let mut rng = TestRng::new(3);
        let (rows, k) = (13, 576);
        let mut x: Vec<f32> = (0..rows * k).map(|_| rng.uniform(-3.0, 3.0)).collect();
        // A zero block and a block with exact halves (ties) too.
        x[..32].fill(0.0);
        for (i, v) in x[32..64].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 0.5;
        }
        let mut want = QuantizedActs::new();
        want.quantize(&x, rows, k);
        for isa in Isa::available() {
            let mut got = QuantizedActs::new();
            quantize_acts(&pool, isa, &x, rows, k, ActBlocks::Q8_0, &mut got).unwrap();
            assert_eq!(got.qs, want.qs, "{}", isa.name());
            assert_eq!(got.d, want.d, "{}", isa.name());
            assert_eq!(got.s, want.s, "{}", isa.name());
            assert_eq!(got.isum, want.isum, "{}", isa.name());
        }
    }

    /// Quantizing rows as they are written gives what quantizing them afterwards gives, on
    /// every instruction set, for rows inside a wider buffer (the op writes only its window).
    #[test]
    fn rows_quantized_as_written_equal_a_separate_pass() {
        let pool = ThreadPool::new(2);
        let (rows, k, ld) = (13, 96, 100);
        let value = |r: usize, c: usize| ((r * 31 + c * 7) % 23) as f32 * 0.3 - 3.0;
        let want_rows: Vec<f32> = (0..rows * k).map(|i| value(i / k, i % k)).collect();
        let mut want = QuantizedActs::new();
        want.quantize(&want_rows, rows, k);
        for isa in Isa::available() {
            let mut buf = vec![7f32; rows * ld];
            let mut got = QuantizedActs::new();
            map_rows_quantized(
                &pool,
                isa,
                &mut buf,
                rows,
                k,
                ld,
                ActBlocks::Q8_0,
                &mut got,
                |r, row| {
                    for (c, x) in row.iter_mut().enumerate() {
                        *x = value(r, c);
                    }
                },
            )
            .unwrap();
            for r in 0..rows {
                assert_eq!(&buf[r * ld..r * ld + k], &want_rows[r * k..(r + 1) * k]);
                assert!(buf[r * ld + k..(r + 1) * ld].iter().all(|&x| x == 7.0));
            }
            assert_eq!(got.qs, want.qs, "{}", isa.name());
            assert_eq!(got.d, want.d, "{}", isa.name());
            assert_eq!(got.s, want.s, "{}", isa.name());
            assert_eq!(got.isum, want.isum, "{}", isa.name());
        }
    }

    /// Every quantizer follows the reference on poisoned values too: a NaN weighs nothing in
    /// the block's maximum and becomes 0, an infinity makes the block's scale infinite and its
    /// values 0 (or ±127 for the infinities themselves), huge finite values saturate.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn every_isa_matches_the_reference_on_nan_and_infinities() {
        let pool = ThreadPool::new(2);
        let mut rng = TestRng::new(9);
        let (rows, k) = (4, 128);
        let mut x: Vec<f32> = (0..rows * k).map(|_| rng.uniform(-3.0, 3.0)).collect();
        x[3] = f32::NAN;
        x[40] = f32::INFINITY;
        x[70] = f32::NEG_INFINITY;
        x[100] = f32::MAX;
        x[101] = -f32::MAX;
        x[140..172].fill(f32::NAN);
        x[200] = -0.0;
        let mut want = QuantizedActs::new();
        want.quantize(&x, rows, k);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for isa in Isa::available() {
            let mut got = QuantizedActs::new();
            quantize_acts(&pool, isa, &x, rows, k, ActBlocks::Q8_0, &mut got).unwrap();
            assert_eq!(got.qs, want.qs, "{}", isa.name());
            assert_eq!(bits(&got.d), bits(&want.d), "{}", isa.name());
            assert_eq!(bits(&got.s), bits(&want.s), "{}", isa.name());
            assert_eq!(got.isum, want.isum, "{}", isa.name());
        }
    }
}

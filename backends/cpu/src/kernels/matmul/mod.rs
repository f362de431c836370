//! Matrix products `out[m][n] = sum_k x[m][k] * w[n][k]` for packed quantized weights against
//! 8-bit quantized activations, and for f32 weights. The packed kernels unpack each weight block
//! once and reuse it across up to `MR` activation rows, which is what makes prefill and batched
//! decode fast. Work is split over output-row groups across the thread pool.

#[cfg(target_arch = "x86_64")]
pub mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod f32mm;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;
#[cfg(test)]
mod tests;

use std::ops::Range;

use super::{Isa, SharedOut};
use crate::quant::packed::{PackKind, PackedMatrix, WeightMatrix};
use crate::quant::QuantizedActs;
use crate::threadpool::ThreadPool;

/// Activation rows processed together against one unpacked weight block.
pub const MR: usize = 4;

/// The arguments every packed kernel takes: a range of 16-row groups of `w`, all rows of `acts`,
/// and the output (row stride `ldo`).
#[derive(Clone)]
pub struct PackedJob<'a> {
    pub w: &'a PackedMatrix,
    pub acts: &'a QuantizedActs,
    pub groups: Range<usize>,
    /// Activation rows to compute (all of them unless a kernel split the work).
    pub rows: Range<usize>,
    pub out: SharedOut,
    pub ldo: usize,
}

/// Runs one packed job with the given instruction set (falls back to scalar when `isa` is not
/// compiled for this target).
pub fn packed_job(isa: Isa, job: &PackedJob) {
    assert_eq!(
        job.acts.k, job.w.k,
        "activation and weight inner dimensions differ"
    );
    assert!(job.rows.end <= job.acts.rows);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni
            if job.rows.len() >= amx::TILE_ROWS
                && job.rows.start.is_multiple_of(amx::TILE_ROWS)
                && job.w.format.kind == PackKind::Nibble
                && !job.acts.tiles.is_empty()
                && amx::available() =>
        {
            // Whole 16-row tiles on AMX, the remaining rows on AVX-512 (identical arithmetic).
            // 4-bit weights only: for 8-bit ones the AVX-512 kernel measured faster.
            let full = job.rows.start + job.rows.len() / amx::TILE_ROWS * amx::TILE_ROWS;
            unsafe {
                amx::packed_full_tiles(&PackedJob {
                    rows: job.rows.start..full,
                    ..job.clone()
                });
                avx512::packed(&PackedJob {
                    rows: full..job.rows.end,
                    ..job.clone()
                });
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { avx512::packed(job) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::packed(job) },
        #[cfg(target_arch = "aarch64")]
        Isa::NeonDot => unsafe { neon::packed(job) },
        _ => scalar::packed(job),
    }
}

/// The input rows of a matmul in both forms.
#[derive(Clone, Copy)]
pub struct MatmulInput<'a> {
    /// Unquantized rows (used by f32 weights).
    pub f32: &'a [f32],
    /// The same rows quantized (used by packed weights; may be stale or empty for f32 weights).
    pub quantized: &'a QuantizedActs,
    pub rows: usize,
}

/// `out[m * ldo + n] = x[m] . w[n]` for all input rows and all rows of `w`, in parallel.
pub fn matmul(
    pool: &ThreadPool,
    isa: Isa,
    w: &WeightMatrix,
    x: MatmulInput,
    out: &mut [f32],
    ldo: usize,
) {
    let (x_f32, acts, rows) = (x.f32, x.quantized, x.rows);
    assert!(out.len() >= (rows.max(1) - 1) * ldo + w.n());
    let out_ptr = SharedOut(out.as_mut_ptr());
    match w {
        WeightMatrix::Packed(p) => {
            assert_eq!(acts.rows, rows);
            let groups = p.groups();
            let tasks = task_count(pool, groups, rows * p.blocks());
            pool.run(tasks, |t| {
                let r = crate::threadpool::split_range(groups, tasks, t);
                packed_job(
                    isa,
                    &PackedJob {
                        w: p,
                        acts,
                        groups: r,
                        rows: 0..rows,
                        out: out_ptr,
                        ldo,
                    },
                );
            });
        }
        WeightMatrix::F32 { n, k, data } => {
            let n = *n;
            let k = *k;
            assert!(x_f32.len() >= rows * k);
            let cols = n.div_ceil(16);
            let tasks = task_count(pool, cols, rows * k.div_ceil(32));
            pool.run(tasks, |t| {
                let r = crate::threadpool::split_range(cols, tasks, t);
                let cr = r.start * 16..(r.end * 16).min(n);
                f32mm::matmul_f32(isa, data, k, x_f32, rows, cr, out_ptr, ldo);
            });
        }
    }
}

/// How many tasks to cut `units` independent 16-column groups into, when each group costs
/// `blocks_per_unit` block products (16 x 32 multiply-adds, roughly 10 ns each).
fn task_count(pool: &ThreadPool, units: usize, blocks_per_unit: usize) -> usize {
    let threads = pool.threads();
    let work = units * blocks_per_unit.max(1);
    if threads == 1 || work < 256 {
        return 1;
    }
    // Tasks of at least ~20 us keep claiming cheap; several per thread even out uneven progress
    // (a thread may be descheduled on a busy machine).
    (work / 2048).clamp(threads, threads * 8).min(units)
}

/// Whether a packed matrix's values are 4-bit.
pub fn is_nibble(w: &PackedMatrix) -> bool {
    w.format.kind == PackKind::Nibble
}

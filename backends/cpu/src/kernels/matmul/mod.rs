//! Matrix products `out[m][n] = sum_k x[m][k] * w[n][k]` for packed quantized weights against
//! 8-bit quantized activations, and for f32 weights. The packed kernels unpack each weight block
//! once and reuse it across several activation rows, which is what makes prefill and batched
//! decode fast. Work is split over output-row groups across the thread pool.

#[cfg(target_arch = "x86_64")]
pub mod amx;
#[cfg(all(test, target_arch = "x86_64"))]
mod amx_emulation;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_wide;
mod f32mm;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;
#[cfg(test)]
mod tests;

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::vecmath::round_through_f16;
use super::{Isa, KernelError};
use crate::disjoint::{Tile, TileGrid};
use crate::quant::acts::{ActSums, QBLOCK};
use crate::quant::packed::{FloatActs, PackedMatrix, Values, WeightMatrix, GROUP};
use crate::quant::QuantizedActs;
use crate::threadpool::ThreadPool;

/// What one packed kernel call computes: the 16-row groups `groups` of `w` against the
/// activation rows `rows` of `acts`.
#[derive(Clone)]
pub struct PackedJob<'a> {
    pub w: &'a PackedMatrix,
    pub acts: &'a QuantizedActs,
    pub groups: Range<usize>,
    pub rows: Range<usize>,
}

/// Where a kernel writes: element `(m, n)` of the output at `base + m * ld + n`. Made only by
/// `packed_job`, from a tile it checked covers the job's rows and columns.
#[derive(Clone, Copy)]
pub(crate) struct RawOut {
    pub(crate) base: *mut f32,
    pub(crate) ld: usize,
}

/// Checks everything the kernels rely on to stay inside their buffers: the matrix's bytes match
/// its shape, the activations hold the rows asked for, the job stays inside both, and the tile
/// covers the job's output rows and columns.
fn check_job(job: &PackedJob, out: &Tile<f32>) {
    let (w, a) = (job.w, job.acts);
    assert_eq!(a.k, w.k, "activation and weight inner dimensions differ");
    assert!(
        w.k.is_multiple_of(QBLOCK),
        "inner dimension {} is not a multiple of {QBLOCK}",
        w.k
    );
    let nb = w.blocks();
    assert!(
        w.k.is_multiple_of(w.format.super_len()) && w.data().len() >= w.groups() * w.group_bytes(),
        "packed matrix bytes do not cover {} x {}",
        w.n,
        w.k
    );
    assert!(
        a.qs.len() >= a.rows * a.k
            && a.d.len() >= a.rows * nb
            && a.s.len() >= a.rows * nb
            && a.isum.len() >= a.rows * nb,
        "quantized activations are shorter than {} rows of {}",
        a.rows,
        a.k
    );
    assert!(
        job.rows.end <= a.rows,
        "rows {:?} of {} activation rows",
        job.rows,
        a.rows
    );
    assert!(
        job.groups.end <= w.groups(),
        "groups {:?} of {}",
        job.groups,
        w.groups()
    );
    let cols = job.groups.start * GROUP..(job.groups.end * GROUP).min(w.n);
    let (tr, tc) = (out.rows(), out.cols());
    assert!(
        tr.start <= job.rows.start
            && job.rows.end <= tr.end
            && tc.start <= cols.start
            && cols.end <= tc.end,
        "output tile rows {tr:?} x columns {tc:?} does not cover rows {:?} x columns {cols:?}",
        job.rows
    );
}

/// The activations' extra sums when the weight format needs them, checked to cover every block
/// of the activations. They must have been made before the job (`QuantizedActs::sums`, which
/// `matmul` calls before its tasks start): made here, inside a task, the other tasks of the job
/// would block on them.
fn job_sums<'a>(job: &PackedJob<'a>) -> Option<&'a ActSums> {
    if !job.w.format.needs_act_sums() {
        return None;
    }
    let a = job.acts;
    let s = a
        .sums_made()
        .expect("a K-quant job's activation sums are made before it runs (QuantizedActs::sums)");
    let nb = a.rows * a.blocks_per_row();
    assert!(
        s.s16.len() >= 2 * nb && s.sx.len() >= nb,
        "activation sums are shorter than {} rows",
        a.rows
    );
    Some(s)
}

/// Whether the activations carry their AMX tile layout for every whole 16-row tile.
#[cfg(target_arch = "x86_64")]
fn amx_tiles_ready(a: &QuantizedActs) -> bool {
    a.k >= QBLOCK
        && !a.tiles.is_empty()
        && a.tiles.len() >= a.rows / amx::TILE_ROWS * a.blocks_per_row() * amx::TILE_ROWS * QBLOCK
}

/// Runs one packed job with the given instruction set (falls back to scalar when `isa` is not
/// compiled for this target), writing `out[m][n]` for the job's rows and its groups' output
/// columns. Panics if the job or the tile do not fit the buffers, or if the format needs the
/// activation sums and they have not been made (`QuantizedActs::sums`).
pub fn packed_job(isa: Isa, job: &PackedJob, out: &mut Tile<f32>) {
    check_job(job, out);
    let isa = isa.checked();
    if job.rows.is_empty() || job.groups.is_empty() {
        return;
    }
    let sums = job_sums(job);
    let raw = RawOut {
        base: out.raw_base(),
        ld: out.ld(),
    };
    // SAFETY (every arm): `check_job` proved that the job's reads stay inside the matrix and the
    // activations and that its writes, rows `job.rows` x columns of `job.groups`, lie inside the
    // tile we hold mutably; `Isa::checked` found the arm's instruction set on this CPU.
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni
            if job.rows.len() >= amx::TILE_ROWS
                && job.rows.start.is_multiple_of(amx::TILE_ROWS)
                && amx_serves(isa)
                && amx_tiles_ready(job.acts) =>
        {
            // Whole 16-row tiles on AMX, the remaining rows on AVX-512 (identical arithmetic).
            let full = job.rows.start + job.rows.len() / amx::TILE_ROWS * amx::TILE_ROWS;
            // SAFETY: as above; AMX permission was granted (`amx::available`), the tile layout
            // covers every whole 16-row tile (`amx_tiles_ready`), and the two sub-jobs split
            // the checked rows.
            unsafe {
                amx::packed_full_tiles(
                    &PackedJob {
                        rows: job.rows.start..full,
                        ..job.clone()
                    },
                    sums,
                    raw,
                );
                avx512::packed(
                    &PackedJob {
                        rows: full..job.rows.end,
                        ..job.clone()
                    },
                    sums,
                    raw,
                );
            }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above (checked job and tile, AVX-512 VNNI detected).
        Isa::Avx512Vnni => unsafe { avx512::packed(job, sums, raw) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above (checked job and tile, AVX2/FMA/F16C detected).
        Isa::Avx2 => unsafe { avx2::packed(job, sums, raw) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above (checked job and tile; NEON is baseline on aarch64).
        Isa::Neon => unsafe { neon::packed(job, sums, raw) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above (checked job and tile, the dot-product extension detected).
        Isa::NeonDot => unsafe { neon::packed_dot(job, sums, raw) },
        _ => scalar::packed(job, sums, out),
    }
    let first_col = job.groups.start * GROUP - out.cols().start;
    super::inject_fault(isa, out.row_mut(job.rows.start).get_mut(first_col));
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

/// Activation rows a task takes through all its columns before the next rows (a multiple of the
/// AMX tile's 16 rows, and of every kernel's row tile). A task's pass over its columns streams
/// every activation row it is given through the cache once per pair of 16-column groups; with a
/// whole 512-token prompt (1 MB of 8-bit activations at k = 2048, the size of a Zen 5 L2) that
/// traffic likely pushes the next pair's prefetched weights out before their turn. In chunks of
/// 128 rows a task reads its weights once per chunk, from the last-level cache after the first:
/// prefill 512 on a 2-core Zen 5, same run, two alternations, +1-2% (1B Q4_0), +2% (1B Q4_K_M),
/// +2-8% (3B Q4_0); the kernel alone on 512 x 65536 x 2048 (weights from memory, both threads)
/// +7% (Q4_0) and +5% (Q4_K). Chunks of 64 gained as much at 512 rows and cost 1% at 128.
/// Prompts and batches of up to 128 rows are one chunk, as before. Where AMX serves the job a task
/// keeps all its rows: each group's weights are unpacked once per call into a panel in cache that
/// every 16-row tile reads (not measured with chunks, for want of an AMX machine).
const ROW_CHUNK: usize = 128;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(ROW_CHUNK.is_multiple_of(amx::TILE_ROWS));

/// `out[m * ldo + n] = x[m] . w[n]` for all input rows and all rows of `w`, in parallel.
pub fn matmul(
    pool: &ThreadPool,
    isa: Isa,
    w: &WeightMatrix,
    x: MatmulInput,
    out: &mut [f32],
    ldo: usize,
) -> Result<(), KernelError> {
    let (x_f32, acts, rows) = (x.f32, x.quantized, x.rows);
    let bad = |message: String| KernelError::BadShape {
        op: "matmul",
        message,
    };
    let n = w.n();
    // Output columns are cut into runs of whole 16-column groups, one per task.
    let units = n.div_ceil(GROUP);
    let tasks = match w {
        WeightMatrix::Packed(p) => {
            if acts.rows != rows || acts.k != p.k {
                return Err(bad(format!(
                    "quantized activations are {} x {}, the matmul needs {rows} x {}",
                    acts.rows, acts.k, p.k
                )));
            }
            if acts.blocks != p.format.act_blocks() {
                return Err(bad(format!(
                    "activations quantized as {:?} for weights that take {:?}",
                    acts.blocks,
                    p.format.act_blocks()
                )));
            }
            task_count(pool, units, rows * p.blocks())
        }
        WeightMatrix::F32 { k, .. } => {
            if x_f32.len() < rows * k {
                return Err(bad(format!(
                    "{} input values for {rows} rows of {k}",
                    x_f32.len()
                )));
            }
            task_count(pool, units, rows * k.div_ceil(32))
        }
    };
    let col_parts: Vec<Range<usize>> = (0..tasks)
        .map(|t| {
            let g = crate::threadpool::split_range(units, tasks, t);
            g.start * GROUP..(g.end * GROUP).min(n)
        })
        .collect();
    let grid =
        TileGrid::column_parts(out, ldo, 0..rows, col_parts).map_err(|e| bad(e.to_string()))?;
    match w {
        WeightMatrix::Packed(p) => {
            // The activation sums the K-quant formats need are made here, before any task
            // starts: made on first use inside the job, one task would make them while the other
            // threads block on the lock (asleep in the kernel, woken only after it). Made first,
            // batch-1 steps ran 4-11% faster on a 1B Q4_K_M model and 15-23% on SmolLM2's (2-core
            // Zen 5, steps alternated in one process). Activations whose buffers do not match
            // their shape are left alone here: each task refuses them.
            if p.format.needs_act_sums() && acts.holds_rows() {
                acts.sums();
            }
            let chunk = if amx_serves(isa) { rows } else { ROW_CHUNK };
            pool.run(tasks, |t| {
                let groups = crate::threadpool::split_range(units, tasks, t);
                let mut tile = grid.take(0, t);
                let mut r0 = 0;
                while r0 < rows {
                    let r1 = (r0 + chunk).min(rows);
                    packed_job(
                        isa,
                        &PackedJob {
                            w: p,
                            acts,
                            groups: groups.clone(),
                            rows: r0..r1,
                        },
                        &mut tile,
                    );
                    r0 = r1;
                }
            })?
        }
        WeightMatrix::F32 { k, data, acts, .. } => {
            // F16/BF16 weights meet activations rounded to their type, as in llama.cpp.
            let rounded;
            let x = match acts {
                FloatActs::F32 => x_f32,
                FloatActs::F16 => {
                    let mut r = x_f32[..rows * k].to_vec();
                    round_through_f16(isa, &mut r);
                    rounded = r;
                    &rounded[..]
                }
                FloatActs::Bf16 => {
                    rounded = x_f32[..rows * k]
                        .iter()
                        .map(|v| half::bf16::from_f32(*v).to_f32())
                        .collect::<Vec<f32>>();
                    &rounded[..]
                }
            };
            pool.run(tasks, |t| {
                f32mm::matmul_f32(isa, data, *k, x, &mut grid.take(0, t));
            })?
        }
    }
    Ok(())
}

/// How far ahead of the block it multiplies a matmul kernel asks for weight bytes, in blocks of 32
/// values across a group's 16 rows (~5.8 KB ahead for Q4_0 at 20); the AVX-512 kernels use it.
/// Chosen with decode steps alternated in one process (`bench-model --alternate-prefetch`; a
/// 2-core Zen 5, weights on huge pages): 20 against 32 read batch-1 steps 4-5% faster on the 1B
/// and 3B Q4_0 files, 7-9% on the 3B Q4_K_M one, 2-3% on SmolLM2's in the fast-memory state
/// (0-3% in the slow one), and batch-32 steps 0.5-2% faster; 12 and 24 were 1-4% slower than 20,
/// 16 within 1%; prefill is compute-bound and did not move. `NPU_SERVING_PREFETCH` overrides it (checked at start by `kernels::check_settings`).
pub const DEFAULT_PREFETCH_BLOCKS: usize = 20;

/// The most blocks ahead `NPU_SERVING_PREFETCH` and `set_prefetch_blocks` take.
pub const MAX_PREFETCH_BLOCKS: usize = 1024;

/// The distance in force; 0 until first read (then the environment's or the default).
static PREFETCH_BLOCKS: AtomicUsize = AtomicUsize::new(0);

/// `NPU_SERVING_PREFETCH`: the prefetch distance in blocks (unset: the default).
pub fn prefetch_setting() -> Result<usize, crate::kernels::BadSetting> {
    parse_prefetch_setting(std::env::var("NPU_SERVING_PREFETCH").ok().as_deref())
}

fn parse_prefetch_setting(value: Option<&str>) -> Result<usize, crate::kernels::BadSetting> {
    let Some(v) = value else {
        return Ok(DEFAULT_PREFETCH_BLOCKS);
    };
    match v.parse::<usize>() {
        Ok(n) if (1..=MAX_PREFETCH_BLOCKS).contains(&n) => Ok(n),
        _ => Err(crate::kernels::BadSetting {
            var: "NPU_SERVING_PREFETCH",
            value: v.to_string(),
            expected: "a whole number of blocks from 1 to 1024 (the default is 20)",
        }),
    }
}

/// The prefetch distance the kernels use now, in blocks. A bad `NPU_SERVING_PREFETCH` (refused
/// at start) counts as unset here.
pub fn prefetch_blocks() -> usize {
    match PREFETCH_BLOCKS.load(Ordering::Relaxed) {
        0 => {
            let n = prefetch_setting().unwrap_or(DEFAULT_PREFETCH_BLOCKS);
            // Only the first reader sets it: a distance set meanwhile is kept.
            let _ = PREFETCH_BLOCKS.compare_exchange(0, n, Ordering::Relaxed, Ordering::Relaxed);
            PREFETCH_BLOCKS.load(Ordering::Relaxed)
        }
        n => n,
    }
}

/// Sets the prefetch distance for every later matmul of this process (clamped to
/// 1..=`MAX_PREFETCH_BLOCKS`). It changes only when bytes are asked for, never a result: for
/// benchmarks that compare distances within one run.
pub fn set_prefetch_blocks(blocks: usize) {
    PREFETCH_BLOCKS.store(blocks.clamp(1, MAX_PREFETCH_BLOCKS), Ordering::Relaxed);
}

/// How many tasks to cut `units` independent 16-column groups into, when each group costs
/// `blocks_per_unit` block products (16 x 32 multiply-adds, roughly 10 ns each).
fn task_count(pool: &ThreadPool, units: usize, blocks_per_unit: usize) -> usize {
    let threads = pool.threads();
    let work = units * blocks_per_unit.max(1);
    if threads == 1 || work < 256 {
        return 1;
    }
    // Tasks of at least ~80 us: each task's first blocks wait on memory before its prefetches
    // run ahead, so at batch 1 (weights streamed once) fewer, longer tasks ran faster (1B Q4_0
    // and Q4_K_M, three alternations: +3% against ~20 us tasks, -4% with ~5 us ones). Larger
    // jobs still get several tasks per thread, which even out uneven progress (a thread may be
    // descheduled on a busy machine).
    let tasks = (work / 8192).clamp(threads, threads * 8).min(units);
    // A whole number of tasks per thread: with 3 tasks on 2 threads (a 3B model's Q/K/V
    // projection at batch 1) one thread runs two while the other waits half the job. Batch-1
    // steps alternated in one run (`bench-model --alternate-prefetch`, a build switching this):
    // 3B Q4_0 +1.3%, 3B Q4_K_M +2.1%, 1B Q4_0 level (its counts were even already).
    let even = tasks.next_multiple_of(threads);
    if even <= units {
        even
    } else {
        tasks
    }
}

/// Whether `packed_job` may run the whole 16-row tiles of a job on the AMX tiles (any packed
/// format) with `isa`.
fn amx_serves(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        isa.checked() == Isa::Avx512Vnni && amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}

/// Whether a packed matrix's values are 4-bit.
pub fn is_nibble(w: &PackedMatrix) -> bool {
    w.format.values == Values::Q4
}

//! The routed experts' FFN as one grouped matmul per projection on the CPU: the step's (token,
//! slot) pairs sorted by expert, their rows quantized once for all experts, then one parallel
//! job over every active expert's rows and output columns (tiles of one output buffer, each
//! expert's rows a contiguous range of it), one SwiGLU over all rows, one quantization and one
//! grouped job for the down projection, and the weighted sum back in token order. Each output
//! value is computed by the same kernel over the same quantized values as an expert run alone
//! would compute it, so the result is bit for bit the per-expert loop's; what changes is that
//! a batch-32 step no longer dispatches two small matmuls (and their quantizations and
//! allocations) per active expert one after another.

use std::ops::Range;

use crate::disjoint::TileGrid;
use crate::kernels::elementwise;
use crate::kernels::matmul::{packed_job, PackedJob};
use crate::kernels::quantize::quantize_acts;
use crate::kernels::{Isa, KernelError};
use crate::quant::acts::ActBlocks;
use crate::quant::packed::{PackedMatrix, GROUP};
use crate::quant::{QuantizedActs, WeightMatrix};
use crate::threadpool::ThreadPool;

/// Activation rows one job pass takes before the next (as the matmul's `ROW_CHUNK`).
const ROW_CHUNK: usize = 128;

/// The experts' matrices of one projection when all are packed and take one activation
/// blocking (None: the per-expert path serves them).
pub(super) fn packed_all(ms: &[WeightMatrix]) -> Option<(Vec<&PackedMatrix>, ActBlocks)> {
    let mut blocks = None;
    let mut out = Vec::with_capacity(ms.len());
    for m in ms {
        let WeightMatrix::Packed(p) = m else {
            return None;
        };
        let b = p.format.act_blocks();
        if blocks.is_some_and(|x| x != b) {
            return None;
        }
        blocks = Some(b);
        out.push(p);
    }
    Some((out, blocks?))
}

/// `out[m] = x[m] . w_e` for every row m of each active expert e's range (`groups[e]`, sorted
/// and disjoint; rows `ldo` apart in `out`), all experts in one parallel job. `acts` holds the
/// rows quantized with the matrices' blocking.
pub(super) fn grouped_matmul(
    pool: &ThreadPool,
    isa: Isa,
    experts: &[&PackedMatrix],
    groups: &[Range<usize>],
    acts: &QuantizedActs,
    out: &mut [f32],
    ldo: usize,
) -> Result<(), KernelError> {
    let bad = |message: String| KernelError::BadShape {
        op: "grouped matmul",
        message,
    };
    let active: Vec<usize> = (0..groups.len())
        .filter(|&e| !groups[e].is_empty())
        .collect();
    let Some(&first) = active.first() else {
        return Ok(());
    };
    let n = experts[first].n;
    if active
        .iter()
        .any(|&e| experts[e].n != n || experts[e].k != acts.k)
    {
        return Err(bad("experts of different shapes in one projection".into()));
    }
    if experts[first].format.needs_act_sums() && acts.holds_rows() {
        acts.sums();
    }
    // Column parts: enough (expert, part) units to keep every thread busy at batch 1 (few
    // experts, one row each) and at prefill (few experts, many rows).
    let units = n.div_ceil(GROUP);
    let parts = (pool.threads() * 2).div_ceil(active.len()).clamp(1, units);
    let col_groups: Vec<Range<usize>> = (0..parts)
        .map(|j| crate::threadpool::split_range(units, parts, j))
        .collect();
    let col_parts: Vec<Range<usize>> = col_groups
        .iter()
        .map(|g| g.start * GROUP..(g.end * GROUP).min(n))
        .collect();
    let row_parts: Vec<Range<usize>> = active.iter().map(|&e| groups[e].clone()).collect();
    let grid = TileGrid::new(out, ldo, row_parts, col_parts).map_err(|e| bad(e.to_string()))?;
    // Units in order, (expert i, column part j), split over the tasks by rows times columns.
    let work: Vec<(usize, usize)> = (0..active.len())
        .flat_map(|i| (0..parts).map(move |j| (i, j)))
        .collect();
    let cost = |&(i, _): &(usize, usize)| row_parts_len(groups, active[i]);
    let total: usize = work.iter().map(cost).sum();
    let tasks = pool.threads().min(work.len()).max(1);
    let mut bounds = vec![0usize];
    let mut acc = 0;
    for (u, w) in work.iter().enumerate() {
        acc += cost(w);
        if bounds.len() < tasks && acc * tasks >= total * bounds.len() {
            bounds.push(u + 1);
        }
    }
    bounds.resize(tasks, work.len());
    bounds.push(work.len());
    pool.run(tasks, |t| {
        for &(i, j) in &work[bounds[t]..bounds[t + 1]] {
            let e = active[i];
            let mut tile = grid.take(i, j);
            let rows = groups[e].clone();
            let mut r0 = rows.start;
            while r0 < rows.end {
                let r1 = (r0 + ROW_CHUNK).min(rows.end);
                packed_job(
                    isa,
                    &PackedJob {
                        w: experts[e],
                        acts,
                        groups: col_groups[j].clone(),
                        rows: r0..r1,
                    },
                    &mut tile,
                );
                r0 = r1;
            }
        }
    })?;
    Ok(())
}

fn row_parts_len(groups: &[Range<usize>], e: usize) -> usize {
    groups[e].len().max(1)
}

/// The grouped FFN of the sorted rows `xs` (`m` rows of `h`): gate+up, SwiGLU, down, into
/// `y` (`m` rows of `h`). `acts` is the backend's scratch for quantized activations.
#[allow(clippy::too_many_arguments)]
pub(super) fn grouped_ffn(
    pool: &ThreadPool,
    isa: Isa,
    gate_up: (&[&PackedMatrix], ActBlocks),
    down: (&[&PackedMatrix], ActBlocks),
    groups: &[Range<usize>],
    xs: &[f32],
    h: usize,
    ff: usize,
    acts: &mut QuantizedActs,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let m = xs.len() / h.max(1);
    quantize_acts(pool, isa, xs, m, h, gate_up.1, acts)?;
    let mut gu = vec![0f32; m * 2 * ff];
    grouped_matmul(pool, isa, gate_up.0, groups, acts, &mut gu, 2 * ff)?;
    let mut act = vec![0f32; m * ff];
    for (r, dst) in act.chunks_exact_mut(ff).enumerate() {
        let row = &gu[r * 2 * ff..(r + 1) * 2 * ff];
        elementwise::swiglu(isa, &row[..ff], &row[ff..], dst);
    }
    quantize_acts(pool, isa, &act, m, ff, down.1, acts)?;
    grouped_matmul(pool, isa, down.0, groups, acts, y, h)
}

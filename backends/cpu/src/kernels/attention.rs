//! Paged KV cache writes and paged attention on the CPU. Within one block of one layer, K is
//! `[kv_head][head_dim][block_pos]` (so the scores of a whole block come from broadcasting one
//! query value per dimension) and V is `[kv_head][block_pos][head_dim]`, both f16; consecutive
//! blocks of a layer lie `block_stride` elements apart (the backend interleaves the layers' K
//! and V block by block). Attention reads history through each sequence's block table, with
//! causal masking inside the new chunk, grouped-query heads sharing each K/V block load; a long
//! history of a decoding sequence is split over the KV into parts merged by their softmax mass,
//! and a decoding batch takes one task per sequence for all its KV heads.

use std::cell::RefCell;
use std::sync::Mutex;

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::vecmath::{exp_approx, round_through_f16};
use super::{Isa, KernelError};
use crate::disjoint::{Tile, TileGrid};
use crate::threadpool::ThreadPool;

mod int8;
mod task;
pub use int8::{dequantize_row_i8, quantize_row_i8, I8Cache};
use task::{run_task, write_out, Task};

/// The cache a step's attention reads: f16 values, or int8 values with their scales.
#[derive(Clone, Copy)]
pub enum KvCache<'a> {
    F16 { k: &'a [f16], v: &'a [f16] },
    I8(I8Cache<'a>),
}

impl KvCache<'_> {
    /// Whole blocks of `lay` (and, int8, of the scales' layout) the cache holds.
    fn blocks(&self, lay: &KvLayout) -> usize {
        match self {
            KvCache::F16 { k, v } => k.len().min(v.len()) / lay.block_elems(),
            KvCache::I8(c) => {
                let values = c.k.len().min(c.v.len()) / lay.block_elems();
                let scales = c.ks.len().min(c.vs.len()) / c.slay.block_elems().max(1);
                values.min(scales)
            }
        }
    }
}

/// Shape of one layer's paged cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Elements from the start of one block of this layer's K (or V) to the next
    /// (`block_elems()` when the layer's blocks are packed together).
    pub block_stride: usize,
}

impl KvLayout {
    /// f16 elements of one block (all KV heads) in the K (or V) cache of one layer.
    pub fn block_elems(&self) -> usize {
        self.n_kv_heads * self.head_dim * self.block_size
    }
    #[inline]
    pub(crate) fn k_at(&self, block: usize, kvh: usize, d: usize, t: usize) -> usize {
        block * self.block_stride + (kvh * self.head_dim + d) * self.block_size + t
    }
    #[inline]
    pub(crate) fn v_at(&self, block: usize, kvh: usize, t: usize, d: usize) -> usize {
        block * self.block_stride + (kvh * self.block_size + t) * self.head_dim + d
    }
}

/// Writes the K and V of `slots.len()` new tokens into their cache slots: row `i` of `k` (rows
/// `ldk` apart) and of `v` (rows `ldv` apart) hold the token's `n_kv_heads * head_dim` values;
/// the layer's K blocks start at `cache[k_base..]`, its V blocks at `cache[v_base..]`. Panics
/// (never writes out of bounds) when a slot or a row lies outside its slice.
#[allow(clippy::too_many_arguments)]
pub fn kv_write(
    lay: &KvLayout,
    k: &[f32],
    ldk: usize,
    v: &[f32],
    ldv: usize,
    slots: &[u32],
    cache: &mut [f16],
    k_base: usize,
    v_base: usize,
) {
    let hd = lay.head_dim;
    let width = lay.n_kv_heads * hd;
    // A token's K values are converted together (vector instructions where the CPU has them,
    // the same rounding either way), then scattered down their block's columns.
    let mut k16 = vec![f16::ZERO; width];
    for (i, &slot) in slots.iter().enumerate() {
        let (block, t) = (
            slot as usize / lay.block_size,
            slot as usize % lay.block_size,
        );
        let k_row = &k[i * ldk..i * ldk + width];
        let v_row = &v[i * ldv..i * ldv + width];
        k16.convert_from_f32_slice(k_row);
        for kvh in 0..lay.n_kv_heads {
            for d in 0..hd {
                cache[k_base + lay.k_at(block, kvh, d, t)] = k16[kvh * hd + d];
            }
            let v0 = v_base + lay.v_at(block, kvh, t, 0);
            cache[v0..v0 + hd].convert_from_f32_slice(&v_row[kvh * hd..(kvh + 1) * hd]);
        }
    }
}

/// Tokens a step must write before `kv_write_parallel` splits them over the pool.
const PARALLEL_KV_WRITE_TOKENS: usize = 16;

/// `kv_write` with the tokens split over the pool: each token's K scatters down 16-position
/// block columns (a cache line per two dimensions, rarely cached), so one thread waits on its
/// misses; several threads keep more in flight. Falls back to `kv_write` (same result) for
/// few tokens, for a slot named twice (the last write wins there, as in order), or a layout
/// whose K and V block windows could overlap. Panics (never writes out of bounds) when a slot
/// or a row lies outside its slice; an error only if a task panicked (the cache then holds
/// some of the tokens).
#[allow(clippy::too_many_arguments)]
pub fn kv_write_parallel(
    pool: &ThreadPool,
    lay: &KvLayout,
    k: &[f32],
    ldk: usize,
    v: &[f32],
    ldv: usize,
    slots: &[u32],
    cache: &mut [f16],
    k_base: usize,
    v_base: usize,
) -> Result<(), KernelError> {
    let n = slots.len();
    let width = lay.n_kv_heads * lay.head_dim;
    let be = lay.block_elems();
    let stride = lay.block_stride;
    // K windows [k_base + b * stride, + be) and V windows [v_base + b * stride, + be) of all
    // blocks are pairwise disjoint when a block's window fits in the stride and the two bases
    // sit at least a window apart modulo the stride.
    let gap = k_base.abs_diff(v_base) % stride.max(1);
    let disjoint_windows = be > 0 && stride >= 2 * be && gap >= be && stride - gap >= be;
    // The slots in order, only where the write may go parallel (then checked distinct).
    let sorted = (n >= PARALLEL_KV_WRITE_TOKENS && pool.threads() > 1 && disjoint_windows)
        .then(|| {
            let mut sorted = slots.to_vec();
            sorted.sort_unstable();
            sorted
        })
        .filter(|sorted| sorted.windows(2).all(|w| w[0] != w[1]));
    let Some(sorted) = sorted else {
        kv_write(lay, k, ldk, v, ldv, slots, cache, k_base, v_base);
        return Ok(());
    };
    // Everything a task touches, checked here: the rows it reads and, for the largest slot,
    // the last element of its K and V windows (the windows grow with the block index).
    let last_row = |ld: usize| (n - 1) * ld + width;
    assert!(
        k.len() >= last_row(ldk) && v.len() >= last_row(ldv),
        "{n} K/V rows of {width} do not fit the inputs"
    );
    let max_block = *sorted.last().expect("n >= 16") as usize / lay.block_size;
    let window_end = |base: usize| {
        max_block
            .checked_mul(stride)
            .and_then(|o| o.checked_add(base))
            .and_then(|o| o.checked_add(be))
    };
    assert!(
        window_end(k_base).is_some_and(|e| e <= cache.len())
            && window_end(v_base).is_some_and(|e| e <= cache.len()),
        "slot {} lies beyond the cache",
        sorted[n - 1]
    );
    struct CachePtr(*mut f16);
    // SAFETY: the tasks write pairwise disjoint elements (below), so sharing the base pointer
    // between them is like handing each its own `&mut` elements.
    unsafe impl Sync for CachePtr {}
    let base = CachePtr(cache.as_mut_ptr());
    let tasks = pool.threads().min(n);
    pool.run(tasks, |task| {
        let base = &base;
        let mut k16 = vec![f16::ZERO; width];
        let mut v16 = vec![f16::ZERO; width];
        for i in crate::threadpool::split_range(n, tasks, task) {
            let slot = slots[i] as usize;
            let (block, t) = (slot / lay.block_size, slot % lay.block_size);
            k16.convert_from_f32_slice(&k[i * ldk..i * ldk + width]);
            v16.convert_from_f32_slice(&v[i * ldv..i * ldv + width]);
            for kvh in 0..lay.n_kv_heads {
                for d in 0..lay.head_dim {
                    let at = k_base + lay.k_at(block, kvh, d, t);
                    // SAFETY: `at` lies in block `block`'s K window (kvh, d, t inside the
                    // block), which ends inside `cache` (checked for the largest block above);
                    // slots are distinct and the K and V windows of all blocks disjoint, so
                    // no other task writes this element.
                    unsafe { *base.0.add(at) = k16[kvh * lay.head_dim + d] };
                }
                for d in 0..lay.head_dim {
                    let at = v_base + lay.v_at(block, kvh, t, d);
                    // SAFETY: as for K, in the block's V window.
                    unsafe { *base.0.add(at) = v16[kvh * lay.head_dim + d] };
                }
            }
        }
    })?;
    Ok(())
}

/// One sequence's queries in a step: rows `q_row..q_row + n_q` of the query matrix, at positions
/// `start_pos..start_pos + n_q`, attending to positions `0..=own position` through `block_table`.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    pub q_row: usize,
    pub n_q: usize,
    pub start_pos: usize,
    pub block_table: &'a [u32],
}

/// Attention parameters shared by all sequences of a step.
#[derive(Debug, Clone, Copy)]
pub struct AttnParams {
    pub lay: KvLayout,
    pub n_heads: usize,
    pub scale: f32,
    /// Sliding window: a query at position p sees positions `p + 1 - window ..= p` only.
    pub window: Option<usize>,
}

/// Query tokens per task.
const TOKENS_PER_TASK: usize = 8;

#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    /// An int8 cache's quantized queries (i16 pairs) and V weights, and their scales.
    qpairs: Vec<i32>,
    qscale: Vec<f32>,
    wpairs: Vec<i32>,
    wscale: Vec<f32>,
    scores: Vec<f32>,
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    o: Vec<f32>,
    /// Per row of the last task: its scaled score maximum and its sum of exponentials.
    row_max: Vec<f32>,
    row_sum: Vec<f64>,
}

/// A sequence's history is split over the KV, into parts of this many blocks, when one query
/// chunk would otherwise read all of a long context on one thread per KV head.
const SPLIT_BLOCKS: usize = 64;

/// The KV parts `[b0, b1)` (in blocks) that one query chunk of `s` (tokens `t0..t1`) is split
/// into: one part for short histories and for sequences of more than one chunk; else parts of
/// `SPLIT_BLOCKS` over the blocks every query row sees in full, the last part taking the rest
/// (so every row sees at least one position of every part).
/// Depends on the sequence alone (never on the rest of the batch), so a sequence's result does
/// not depend on what it is batched with.
fn kv_parts(s: &AttnSeq, t0: usize, t1: usize, bs: usize) -> Vec<(usize, usize)> {
    let n_blocks = (s.start_pos + t1).div_ceil(bs);
    // Blocks every query row sees in full.
    let full = (s.start_pos + 1) / bs;
    let parts = full.div_ceil(SPLIT_BLOCKS);
    // Only a sequence whose queries make one chunk (so `t0` is 0) is split.
    if s.n_q > TOKENS_PER_TASK || t0 != 0 || parts < 2 {
        return vec![(0, n_blocks)];
    }
    (0..parts)
        .map(|i| {
            let b1 = if i + 1 == parts {
                n_blocks
            } else {
                (i + 1) * SPLIT_BLOCKS
            };
            (i * SPLIT_BLOCKS, b1)
        })
        .collect()
}

/// What one KV part of a split task leaves for the merge: normalized outputs (rows x hd) and
/// each row's softmax statistics over the part.
#[derive(Default)]
struct Partial {
    o: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f64>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Checks what the tasks will read: the head shape, every query row, and every block a sequence
/// attends to (inside its block table and inside the caches).
#[allow(clippy::too_many_arguments)]
fn check_args(
    p: &AttnParams,
    q: &[f32],
    ldq: usize,
    seqs: &[AttnSeq],
    cache: &KvCache,
) -> Result<(), String> {
    let lay = p.lay;
    if lay.n_kv_heads == 0 || lay.head_dim == 0 || lay.block_size == 0 {
        return Err(format!("empty layout {lay:?}"));
    }
    if p.n_heads == 0 || !p.n_heads.is_multiple_of(lay.n_kv_heads) {
        return Err(format!(
            "{} query heads are not a multiple of {} KV heads",
            p.n_heads, lay.n_kv_heads
        ));
    }
    let q_cols = p.n_heads * lay.head_dim;
    if ldq < q_cols {
        return Err(format!(
            "query rows {ldq} apart hold fewer than {q_cols} values"
        ));
    }
    let cache_blocks = cache.blocks(&lay);
    for (i, s) in seqs.iter().enumerate().filter(|(_, s)| s.n_q > 0) {
        let last_row = s.q_row + s.n_q - 1;
        if last_row * ldq + q_cols > q.len() {
            return Err(format!(
                "sequence {i}: query row {last_row} is beyond the {} query values",
                q.len()
            ));
        }
        let blocks = (s.start_pos + s.n_q).div_ceil(lay.block_size);
        let Some(table) = s.block_table.get(..blocks) else {
            return Err(format!(
                "sequence {i}: {} positions need {blocks} blocks, its table has {}",
                s.start_pos + s.n_q,
                s.block_table.len()
            ));
        };
        if let Some(b) = table.iter().find(|&&b| b as usize >= cache_blocks) {
            return Err(format!(
                "sequence {i}: block {b} is beyond the cache's {cache_blocks} blocks"
            ));
        }
    }
    Ok(())
}

/// `out[row][h*hd..]` = softmax(q . K^T * scale) V for every query row and head. `q` rows are `ldq`
/// apart (queries in the first `n_heads * hd` columns), `out` rows `ldo` apart. Sequences must
/// have their own query rows (no two share one).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    pool: &ThreadPool,
    isa: Isa,
    p: &AttnParams,
    q: &[f32],
    ldq: usize,
    seqs: &[AttnSeq],
    k_cache: &[f16],
    v_cache: &[f16],
    out: &mut [f32],
    ldo: usize,
) -> Result<(), KernelError> {
    let cache = KvCache::F16 {
        k: k_cache,
        v: v_cache,
    };
    paged_attention_kv(pool, isa, p, q, ldq, seqs, cache, out, ldo)
}

/// `paged_attention` over either cache (an int8 one's kernels: `int8`).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_kv(
    pool: &ThreadPool,
    isa: Isa,
    p: &AttnParams,
    q: &[f32],
    ldq: usize,
    seqs: &[AttnSeq],
    cache: KvCache,
    out: &mut [f32],
    ldo: usize,
) -> Result<(), KernelError> {
    let bad = |message: String| KernelError::BadShape {
        op: "paged attention",
        message,
    };
    check_args(p, q, ldq, seqs, &cache).map_err(bad)?;
    let (k_cache, v_cache, i8_cache): (&[f16], &[f16], _) = match cache {
        KvCache::F16 { k, v } => (k, v, None),
        KvCache::I8(c) => (&[], &[], Some(c)),
    };
    let isa = isa.checked();
    let hd = p.lay.head_dim;
    let group = p.n_heads / p.lay.n_kv_heads;
    // Query-row chunks (output row ranges) in row order: (rows, sequence, t0, t1).
    let mut chunks = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        let mut t0 = 0;
        while t0 < s.n_q {
            let t1 = (t0 + TOKENS_PER_TASK).min(s.n_q);
            chunks.push((s.q_row + t0..s.q_row + t1, si, t0, t1));
            t0 = t1;
        }
    }
    chunks.sort_by_key(|c| c.0.start);
    // Few tasks (one sequence decoding, say): give each query head of a group its own task so
    // every thread has work; they then share K/V block reads through the cache instead — only
    // while the history is short enough to stay cached (else it would be read from memory again).
    let max_ctx = seqs.iter().map(|s| s.start_pos + s.n_q).max().unwrap_or(0);
    let per_head =
        chunks.len() * p.lay.n_kv_heads < 2 * pool.threads() && group > 1 && max_ctx <= 1024;
    // Each chunk's KV parts, with its sequence seen from each part's first block: positions
    // counted from there, its block table starting there, and how many positions it may see.
    let bs = p.lay.block_size;
    let mut windows: Vec<Vec<(AttnSeq, usize)>> = Vec::with_capacity(chunks.len());
    for &(_, si, t0, t1) in &chunks {
        let s = &seqs[si];
        if let Some(w) = p.window {
            // One part from the block holding the first position the chunk's first query sees;
            // the chunk is seen from there (its rows start at its first query, so the
            // positions stay non-negative), and each row masks what lies before its window.
            let b0 = (s.start_pos + t0 + 1).saturating_sub(w) / bs;
            let shifted = AttnSeq {
                q_row: s.q_row + t0,
                n_q: t1 - t0,
                start_pos: s.start_pos + t0 - b0 * bs,
                block_table: &s.block_table[b0..],
            };
            windows.push(vec![(shifted, usize::MAX)]);
            continue;
        }
        let parts = kv_parts(s, t0, t1, bs);
        let last = parts.len() - 1;
        windows.push(
            parts
                .into_iter()
                .enumerate()
                .map(|(i, (b0, b1))| {
                    let w = AttnSeq {
                        start_pos: s.start_pos - b0 * bs,
                        block_table: &s.block_table[b0..],
                        ..*s
                    };
                    (
                        w,
                        if i == last {
                            usize::MAX
                        } else {
                            (b1 - b0) * bs
                        },
                    )
                })
                .collect(),
        );
    }
    // Many chunks (a decoding batch), none split over the KV: one task per chunk for all its KV
    // heads in turn, so each task walks whole blocks (every KV head's K, then V, lie together)
    // and asks for the next head's K while it works on this one's V.
    let all_heads =
        !per_head && chunks.len() >= 4 * pool.threads() && windows.iter().all(|w| w.len() == 1);
    // Output columns: one part per query head, per KV head's group of query heads, or all.
    let (col_parts, heads_per_part): (Vec<_>, usize) = if per_head {
        ((0..p.n_heads).map(|h| h * hd..(h + 1) * hd).collect(), 1)
    } else if all_heads {
        (std::iter::once(0..p.n_heads * hd).collect(), p.n_heads)
    } else {
        (
            (0..p.lay.n_kv_heads)
                .map(|kvh| kvh * group * hd..(kvh + 1) * group * hd)
                .collect(),
            group,
        )
    };
    let grid = TileGrid::new(
        out,
        ldo,
        chunks.iter().map(|c| c.0.clone()).collect(),
        col_parts,
    )
    .map_err(|e| bad(e.to_string()))?;
    // Tasks: (chunk, column part, KV part); the column part's heads are g0..g0 + heads_per_part
    // of its KV head. A chunk of one KV part writes its tile; the parts of a split one leave
    // partial results, merged below.
    let n_parts = grid.n_col_parts();
    let mut tasks = Vec::new();
    for (ci, w) in windows.iter().enumerate() {
        for part in 0..n_parts {
            for kp in 0..w.len() {
                tasks.push((ci, part, kp));
            }
        }
    }
    let partials: Vec<Mutex<Partial>> = tasks
        .iter()
        .map(|_| Mutex::new(Partial::default()))
        .collect();
    // Jobs, each tasks one thread takes in turn: `(first, count, step)` over `tasks`. A split
    // chunk's KV part is one job for all its KV heads: a block holds every KV head's K (then
    // V) of a layer side by side, so one thread walks each layer-block's bytes together (one
    // run of memory instead of one KB per head, each at another time), asking for the next
    // head's K while it sums this one's V. Each task computes what it computed alone. Only with
    // at least two parts a thread, so the fewer, larger jobs still share out evenly.
    let mut jobs: Vec<(usize, usize, usize)> = Vec::with_capacity(tasks.len());
    let mut ti = 0;
    for w in &windows {
        if w.len() >= 2 * pool.threads().max(1) && n_parts > 1 && !all_heads {
            jobs.extend((0..w.len()).map(|kp| (ti + kp, n_parts, w.len())));
        } else {
            jobs.extend((ti..ti + n_parts * w.len()).map(|t| (t, 1, 1)));
        }
        ti += n_parts * w.len();
    }
    // Query heads g0..g1 of KV head `kvh` for chunk `ci`, KV part `kp`.
    let task_at = |ci: usize, kvh: usize, g0: usize, g1: usize, kp: usize| {
        let (_, _, t0, t1) = chunks[ci].clone();
        // A windowed chunk's sequence starts at the chunk's first query (see above).
        let (t0, t1) = if p.window.is_some() {
            (0, t1 - t0)
        } else {
            (t0, t1)
        };
        let (seq, cap) = &windows[ci][kp];
        Task {
            isa,
            p,
            q,
            ldq,
            seq,
            cap: *cap,
            kvh,
            t0,
            t1,
            g0,
            g1,
            next_kvh: None,
            k_cache,
            v_cache,
            i8: i8_cache,
        }
    };
    let task_of = |ci: usize, part: usize, kp: usize| {
        let first_head = part * heads_per_part;
        let (kvh, g0) = (first_head / group, first_head % group);
        task_at(ci, kvh, g0, g0 + heads_per_part, kp)
    };
    let run_one = |ti: usize, next_kvh: Option<usize>| {
        let (ci, part, kp) = tasks[ti];
        if all_heads {
            SCRATCH.with(|s| {
                let s = &mut s.borrow_mut();
                let mut tile = grid.take(ci, part);
                for kvh in 0..p.lay.n_kv_heads {
                    let task = Task {
                        next_kvh: (kvh + 1 < p.lay.n_kv_heads).then_some(kvh + 1),
                        ..task_at(ci, kvh, 0, group, kp)
                    };
                    run_task(isa, &task, s);
                    write_out(&task, &s.o, &mut tile);
                }
                if let Some(first) = tile.rows().next() {
                    super::inject_fault(isa, tile.row_mut(first).first_mut());
                }
            });
            return;
        }
        let task = Task {
            next_kvh,
            ..task_of(ci, part, kp)
        };
        SCRATCH.with(|s| {
            let s = &mut s.borrow_mut();
            run_task(isa, &task, s);
            if windows[ci].len() == 1 {
                let mut tile = grid.take(ci, part);
                write_out(&task, &s.o, &mut tile);
                if let Some(first) = tile.rows().next() {
                    super::inject_fault(isa, tile.row_mut(first).first_mut());
                }
            } else {
                let mut pt = partials[ti].lock().unwrap_or_else(|e| e.into_inner());
                pt.o.clone_from(&s.o);
                pt.max.clone_from(&s.row_max);
                pt.sum.clone_from(&s.row_sum);
            }
        });
    };
    pool.run(jobs.len(), |j| {
        let (first, count, step) = jobs[j];
        for i in 0..count {
            // The next task's KV head, when it is another head of the same blocks.
            let next = (i + 1 < count).then(|| {
                let (_, part, _) = tasks[first + (i + 1) * step];
                part * heads_per_part / group
            });
            run_one(first + i * step, next);
        }
    })?;
    // Merge the KV parts of split chunks: each part's outputs weighted by its share of the
    // softmax mass, sum_p exp(max_p - max) * sum_p, in part order.
    let mut ti = 0;
    for (ci, w) in windows.iter().enumerate() {
        for part in 0..n_parts {
            if w.len() == 1 {
                ti += 1;
                continue;
            }
            let parts: Vec<_> = partials[ti..ti + w.len()]
                .iter()
                .map(|m| std::mem::take(&mut *m.lock().unwrap_or_else(|e| e.into_inner())))
                .collect();
            ti += w.len();
            let task = task_of(ci, part, 0);
            let rows = parts[0].max.len();
            let mut merged = vec![0f32; rows * hd];
            for (r, out_r) in merged.chunks_exact_mut(hd).enumerate() {
                let m = parts
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, pt| m.max(pt.max[r]));
                let weights: Vec<f64> = parts
                    .iter()
                    .map(|pt| ((pt.max[r] - m) as f64).exp() * pt.sum[r])
                    .collect();
                let total: f64 = weights.iter().sum();
                for (d, o) in out_r.iter_mut().enumerate() {
                    let v: f64 = parts
                        .iter()
                        .zip(&weights)
                        .map(|(pt, &wt)| wt * pt.o[r * hd + d] as f64)
                        .sum();
                    *o = (v / total) as f32;
                }
            }
            let mut tile = grid.take(ci, part);
            write_out(&task, &merged, &mut tile);
            if let Some(first) = tile.rows().next() {
                super::inject_fault(isa, tile.row_mut(first).first_mut());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;

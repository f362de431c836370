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
    k_cache: &[f16],
    v_cache: &[f16],
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
    let cache_blocks = k_cache.len().min(v_cache.len()) / lay.block_elems();
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
    let bad = |message: String| KernelError::BadShape {
        op: "paged attention",
        message,
    };
    check_args(p, q, ldq, seqs, k_cache, v_cache).map_err(bad)?;
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
        }
    };
    let task_of = |ci: usize, part: usize, kp: usize| {
        let first_head = part * heads_per_part;
        let (kvh, g0) = (first_head / group, first_head % group);
        task_at(ci, kvh, g0, g0 + heads_per_part, kp)
    };
    pool.run(tasks.len(), |ti| {
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
        let task = task_of(ci, part, kp);
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

struct Task<'a> {
    isa: Isa,
    p: &'a AttnParams,
    q: &'a [f32],
    ldq: usize,
    seq: &'a AttnSeq<'a>,
    /// Positions (from the start of `seq`'s table) this task may see at most.
    cap: usize,
    kvh: usize,
    t0: usize,
    t1: usize,
    /// Query heads `g0..g1` of the KV head's group.
    g0: usize,
    g1: usize,
    /// The KV head the same thread works on next for this sequence (its K is asked for ahead
    /// where the machine has prefetch instructions we use).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    next_kvh: Option<usize>,
    k_cache: &'a [f16],
    v_cache: &'a [f16],
}

/// Computes one task into `s.o` (rows x hd, row `tok * (g1 - g0) + g - g0`) and the rows'
/// softmax statistics.
fn run_task(isa: Isa, t: &Task, s: &mut Scratch) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` passed `Isa::checked`, so the CPU has these features.
        Isa::Avx512Vnni => unsafe { task_avx512(t, s) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` passed `Isa::checked`, so the CPU has these features.
        Isa::Avx2 => unsafe { task_avx2(t, s) },
        _ => task_body(t, s),
    }
}

/// Writes a task's output rows `o` into its tile of the output.
fn write_out(t: &Task, o: &[f32], out: &mut Tile<f32>) {
    let hd = t.p.lay.head_dim;
    let group = t.p.n_heads / t.p.lay.n_kv_heads;
    let ng = t.g1 - t.g0;
    let c0 = out.cols().start;
    for tok in 0..t.t1 - t.t0 {
        let orow = out.row_mut(t.seq.q_row + t.t0 + tok);
        for g in t.g0..t.g1 {
            let h = t.kvh * group + g;
            let r = tok * ng + g - t.g0;
            orow[h * hd - c0..(h + 1) * hd - c0].copy_from_slice(&o[r * hd..(r + 1) * hd]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma,f16c")]
unsafe fn task_avx512(t: &Task, s: &mut Scratch) {
    task_body(t, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2(t: &Task, s: &mut Scratch) {
    task_body(t, s)
}

/// KV blocks asked for ahead of use (a tunable, `NPU_SERVING_ATTN_PREFETCH`).
#[cfg(target_arch = "x86_64")]
fn prefetch_blocks() -> usize {
    static BLOCKS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BLOCKS.get_or_init(|| {
        std::env::var("NPU_SERVING_ATTN_PREFETCH")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4)
    })
}

/// Lanes of the fixed-width accumulators below (one AVX-512 register).
const LANES: usize = 16;

/// Rows the portable path computes together: one K or V load feeds this many independent
/// accumulator chains (one chain per row is bound by the multiply-add's latency).
const ROW_BLOCK: usize = 4;

/// Multiplies `x` (whole chunks of `LANES`) by `scale` in place and returns each lane's maximum
/// (lane j over values j, j + LANES, ...), kept as `if v > max { v } else { max }`.
#[inline(always)]
fn scale_lane_max(fast: bool, x: &mut [f32], scale: f32) -> [f32; LANES] {
    #[cfg(target_arch = "x86_64")]
    if fast {
        // SAFETY: `fast` holds only for an instruction set that passed `Isa::checked` as AVX-512
        // VNNI, which includes AVX-512F; the function touches only whole chunks of `x`.
        return unsafe { super::attention_avx512::scale_lane_max(x, scale) };
    }
    let _ = fast;
    let mut lane_max = [f32::NEG_INFINITY; LANES];
    for c in x.chunks_exact_mut(LANES) {
        for j in 0..LANES {
            c[j] *= scale;
            lane_max[j] = if c[j] > lane_max[j] {
                c[j]
            } else {
                lane_max[j]
            };
        }
    }
    lane_max
}

/// One task: query heads `g0..g1` of KV head `kvh` for tokens `t0..t1` of one sequence (at
/// most `cap` positions of it), into `s.o` and the softmax statistics.
/// `src` widened to f32 into the front of `dst` (exact: every f16 is an f32), eight values an
/// instruction where the CPU has F16C, instead of a library call per eight values.
#[inline(always)]
fn widen_f16(src: &[f16], dst: &mut [f32]) {
    let dst = &mut dst[..src.len()];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has F16C (and AVX, which F16C's 256-bit form needs, with it); the
        // lengths are equal.
        return unsafe { widen_f16c(src, dst) };
    }
    src.convert_to_f32_slice(dst);
}

/// # Safety
/// The CPU must have AVX and F16C; `dst` must be as long as `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16c(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n8 = src.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= n8 <= len of both slices; unaligned loads and stores.
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
    }
    src[n8..].convert_to_f32_slice(&mut dst[n8..]);
}

/// Where a score tile lies: rows `r0..` of the scores (rows `span` apart), K blocks `b0..`.
#[derive(Clone, Copy)]
struct ScoreAt {
    hd: usize,
    bs: usize,
    span: usize,
    r0: usize,
    b0: usize,
}

/// Scores of `R` query rows against the `NB` K blocks widened in `kbuf` (block `i` at
/// `i * hd * bs`, `[d][t]`): `R * NB` independent accumulator chains per 16 positions, each
/// score summed over `d` in order (the same arithmetic as one row and one block at a time).
#[inline(always)]
fn score_tile<const R: usize, const NB: usize>(
    q: &[f32],
    kbuf: &[f32],
    scores: &mut [f32],
    at: ScoreAt,
) {
    let ScoreAt {
        hd,
        bs,
        span,
        r0,
        b0,
    } = at;
    let kbuf = &kbuf[..NB * hd * bs];
    let q = &q[r0 * hd..(r0 + R) * hd];
    for t0 in (0..bs).step_by(LANES) {
        let mut acc = [[[0f32; LANES]; NB]; R];
        for d in 0..hd {
            let mut kd = [[0f32; LANES]; NB];
            for (i, k) in kd.iter_mut().enumerate() {
                k.copy_from_slice(&kbuf[i * hd * bs + d * bs + t0..][..LANES]);
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let qd = q[r * hd + d];
                for (acc_ri, k) in acc_r.iter_mut().zip(&kd) {
                    for j in 0..LANES {
                        acc_ri[j] = qd.mul_add(k[j], acc_ri[j]);
                    }
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (i, acc_ri) in acc_r.iter().enumerate() {
                let o = (r0 + r) * span + (b0 + i) * bs + t0;
                scores[o..o + LANES].copy_from_slice(acc_ri);
            }
        }
    }
}

#[inline(always)]
fn task_body(t: &Task, s: &mut Scratch) {
    let lay = t.p.lay;
    let (hd, bs) = (lay.head_dim, lay.block_size);
    let group = t.p.n_heads / lay.n_kv_heads;
    let ng = t.g1 - t.g0;
    let n_tok = t.t1 - t.t0;
    let rows = n_tok * ng;
    let max_ctx = (t.seq.start_pos + t.t1).min(t.cap);
    let n_blocks = max_ctx.div_ceil(bs);
    let span = n_blocks * bs;
    s.q.resize(rows * hd, 0.0);
    s.scores.resize(rows * span, 0.0);
    s.vbuf.resize(bs * hd, 0.0);
    s.o.resize(rows * hd, 0.0);
    // Queries rounded through f16, as ggml feeds them to its f16 K cache product.
    for tok in 0..n_tok {
        let qrow = &t.q[(t.seq.q_row + t.t0 + tok) * t.ldq..];
        for g in t.g0..t.g1 {
            let h = t.kvh * group + g;
            let r = tok * ng + g - t.g0;
            s.q[r * hd..(r + 1) * hd].copy_from_slice(&qrow[h * hd..(h + 1) * hd]);
        }
    }
    round_through_f16(t.isa, &mut s.q);
    let ctx_of = |r: usize| (t.seq.start_pos + t.t0 + r / ng + 1).min(t.cap);
    // The first position each row sees (beyond 0 only through a sliding window).
    let lo_of = |r: usize| {
        t.p.window.map_or(0, |w| {
            (t.seq.start_pos + t.t0 + r / ng + 1).saturating_sub(w)
        })
    };
    s.row_max.resize(rows, 0.0);
    s.row_sum.resize(rows, 0.0);
    #[cfg(target_arch = "x86_64")]
    let fast = t.isa == Isa::Avx512Vnni && hd % LANES == 0 && bs % LANES == 0 && hd <= 256;
    #[cfg(not(target_arch = "x86_64"))]
    let fast = false;
    // Scores, one K block at a time (two at a time on the fast path).
    #[cfg(target_arch = "x86_64")]
    if fast {
        let k_ptr = |bi: usize| {
            let k0 = lay.k_at(t.seq.block_table[bi] as usize, t.kvh, 0, 0);
            t.k_cache[k0..k0 + hd * bs].as_ptr()
        };
        // The blocks of a sequence lie far apart (each holds every layer), so the hardware
        // prefetcher cannot follow the block table: the K of the next `PREFETCH_BLOCKS` blocks
        // are asked for ahead of use (and the V likewise below).
        let prefetch_k = |bi: usize| {
            if bi < n_blocks {
                super::attention_avx512::prefetch(k_ptr(bi) as *const u8, hd * bs * 2);
            }
        };
        // The V of the blocks scored now is asked for too: it is needed right after the
        // softmax, and asking early keeps more of the task's reads in flight.
        let prefetch_v = |bi: usize| {
            if bi < n_blocks {
                let v0 = lay.v_at(t.seq.block_table[bi] as usize, t.kvh, 0, 0);
                let v = t.v_cache[v0..v0 + bs * hd].as_ptr();
                super::attention_avx512::prefetch(v as *const u8, bs * hd * 2);
            }
        };
        let ahead = prefetch_blocks();
        for bi in 0..ahead {
            prefetch_k(bi);
        }
        let mut bi = 0;
        while bi < n_blocks {
            prefetch_k(bi + ahead);
            prefetch_k(bi + ahead + 1);
            prefetch_v(bi);
            prefetch_v(bi + 1);
            // SAFETY: `fast` means the CPU has AVX-512 (the isa passed `Isa::checked`) and hd, bs
            // are multiples of 16 with hd <= 256; each K pointer starts an `hd * bs` slice of the
            // cache (sliced in `k_ptr`); `s.q` holds rows x hd values; the call writes scores
            // `r * span + bi * bs + t` for r < rows, t < 2 * bs (or bs), inside the rows x span
            // buffer because bi + 2 <= n_blocks (or bi + 1) and span = n_blocks * bs.
            unsafe {
                let out = s.scores.as_mut_ptr().add(bi * bs);
                if bi + 1 < n_blocks {
                    super::attention_avx512::block_scores::<2>(
                        [k_ptr(bi), k_ptr(bi + 1)],
                        hd,
                        bs,
                        &s.q,
                        rows,
                        out,
                        span,
                    );
                    bi += 2;
                } else {
                    super::attention_avx512::block_scores::<1>(
                        [k_ptr(bi)],
                        hd,
                        bs,
                        &s.q,
                        rows,
                        out,
                        span,
                    );
                    bi += 1;
                }
            }
        }
    }
    // The portable path (nothing left to do here when the fast one ran).
    let portable_blocks = if fast { 0 } else { n_blocks };
    // Rows are taken up to ROW_BLOCK at a time; with few rows (a decoding sequence), several K
    // blocks at a time instead, so each K load feeds enough independent accumulator chains.
    let nb_group = match rows {
        1 => 4,
        2 | 3 => 2,
        _ => 1,
    };
    s.kbuf.resize(nb_group * hd * bs, 0.0);
    // One query row on AVX2: the K and V blocks are read as f16 straight into the
    // multiply-adds (same order, same bits).
    #[cfg(target_arch = "x86_64")]
    let f16c_row = t.isa == Isa::Avx2 && rows == 1 && bs % LANES == 0 && hd % 8 == 0;
    // Two to four rows of one token (a decoding sequence's query heads of one KV head, in a
    // batch): the same, each K and V load feeding every row; the rows share their context.
    #[cfg(target_arch = "x86_64")]
    let f16c_rows = t.isa == Isa::Avx2
        && n_tok == 1
        && (2..=ROW_BLOCK).contains(&rows)
        && bs % LANES == 0
        && hd % LANES == 0;
    // As on the fast path, the K of blocks ahead and the V of the blocks scored now are asked
    // for before use (the block table defeats the hardware prefetcher).
    #[cfg(target_arch = "x86_64")]
    let prefetch_kv = |bi: usize, k: bool| {
        if bi < portable_blocks {
            let blk = t.seq.block_table[bi] as usize;
            let (cache, at) = if k {
                (t.k_cache, lay.k_at(blk, t.kvh, 0, 0))
            } else {
                (t.v_cache, lay.v_at(blk, t.kvh, 0, 0))
            };
            super::attention_avx512::prefetch(
                cache[at..at + hd * bs].as_ptr() as *const u8,
                hd * bs * 2,
            );
        }
    };
    #[cfg(target_arch = "x86_64")]
    let ahead = prefetch_blocks();
    #[cfg(target_arch = "x86_64")]
    for bi in 0..ahead.min(portable_blocks) {
        prefetch_kv(bi, true);
    }
    let mut b0 = 0;
    while b0 < portable_blocks {
        let nb = nb_group.min(portable_blocks - b0);
        #[cfg(target_arch = "x86_64")]
        for i in 0..nb {
            prefetch_kv(b0 + ahead + i, true);
            prefetch_kv(b0 + i, false);
        }
        let k_block = |i: usize| {
            let k0 = lay.k_at(t.seq.block_table[b0 + i] as usize, t.kvh, 0, 0);
            &t.k_cache[k0..k0 + hd * bs]
        };
        #[cfg(target_arch = "x86_64")]
        if f16c_row {
            let out = &mut s.scores[(b0 * bs)..(b0 + nb) * bs];
            // SAFETY: `f16c_row` means the CPU has AVX2, FMA and F16C (the isa passed
            // `Isa::checked`), `bs` is a multiple of 16 and there is one query row of `hd`
            // values; each K pointer starts an `hd * bs` slice of the cache (`k_block`), and the
            // scores slice holds the `nb * bs` values written.
            unsafe {
                let q = &s.q[..hd];
                let o = out.as_mut_ptr();
                if nb == 4 {
                    let k = [0, 1, 2, 3].map(|i| k_block(i).as_ptr());
                    super::attention_avx2::row_scores::<4>(k, q, hd, bs, o);
                } else {
                    for i in 0..nb {
                        let k = [k_block(i).as_ptr()];
                        super::attention_avx2::row_scores::<1>(k, q, hd, bs, o.add(i * bs));
                    }
                }
            }
            b0 += nb;
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if f16c_rows {
            for i in 0..nb {
                let (k, q) = (k_block(i).as_ptr(), &s.q[..rows * hd]);
                let o = s.scores[(b0 + i) * bs..(rows - 1) * span + (b0 + i + 1) * bs].as_mut_ptr();
                // SAFETY: `f16c_rows`: AVX2, FMA and F16C present, `bs` a multiple of 16, `rows`
                // (2..=4) rows of `hd` query values; `k` starts an `hd * bs` slice of the cache;
                // the scores slice covers `bs` values at each of the rows, `span` apart.
                unsafe {
                    match rows {
                        2 => super::attention_avx2::rows_scores::<2>(k, q, hd, bs, o, span),
                        3 => super::attention_avx2::rows_scores::<3>(k, q, hd, bs, o, span),
                        _ => super::attention_avx2::rows_scores::<4>(k, q, hd, bs, o, span),
                    }
                }
            }
            b0 += nb;
            continue;
        }
        for i in 0..nb {
            widen_f16(k_block(i), &mut s.kbuf[i * hd * bs..(i + 1) * hd * bs]);
        }
        let mut r0 = 0;
        while r0 < rows {
            // Rows see more of the context the later their token: the group's last row decides
            // whether the blocks are needed at all (scores past a row's context are computed
            // from real cache positions and ignored by its softmax).
            let r1 = (r0 + ROW_BLOCK).min(rows);
            if b0 * bs >= ctx_of(r1 - 1) {
                r0 = r1;
                continue;
            }
            let at = ScoreAt {
                hd,
                bs,
                span,
                r0,
                b0,
            };
            if bs % LANES != 0 {
                for r in r0..r1 {
                    for i in 0..nb {
                        let sc = &mut s.scores[r * span + (b0 + i) * bs..][..bs];
                        sc.fill(0.0);
                        for d in 0..hd {
                            let qd = s.q[r * hd + d];
                            let kd = &s.kbuf[i * hd * bs + d * bs..][..bs];
                            for (o, &k) in sc.iter_mut().zip(kd) {
                                *o = qd.mul_add(k, *o);
                            }
                        }
                    }
                }
            } else {
                let (q, kb, sc) = (&s.q, &s.kbuf, &mut s.scores);
                match (r1 - r0, nb) {
                    (4, 1) => score_tile::<4, 1>(q, kb, sc, at),
                    (1, 4) => score_tile::<1, 4>(q, kb, sc, at),
                    (2, 2) => score_tile::<2, 2>(q, kb, sc, at),
                    (3, 2) => score_tile::<3, 2>(q, kb, sc, at),
                    (r, nb) => {
                        for rr in 0..r {
                            for i in 0..nb {
                                let one = ScoreAt {
                                    r0: r0 + rr,
                                    b0: b0 + i,
                                    ..at
                                };
                                score_tile::<1, 1>(q, &kb[i * hd * bs..], sc, one);
                            }
                        }
                    }
                }
            }
            r0 = r1;
        }
        b0 += nb;
    }
    // Softmax per row over its own context; probabilities rounded through f16 for the V product.
    for r in 0..rows {
        let (lo, ctx) = (lo_of(r), ctx_of(r));
        // Positions before the window weigh nothing in the V sum.
        s.scores[r * span..r * span + lo].fill(0.0);
        let sc = &mut s.scores[r * span + lo..r * span + ctx];
        // Scale and maximum, lane-wise (plain comparisons, no NaN rules).
        let whole = sc.len() / LANES * LANES;
        let lane_max = scale_lane_max(fast, &mut sc[..whole], t.p.scale);
        let mut max = lane_max
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
        for v in &mut sc[whole..] {
            *v *= t.p.scale;
            if *v > max {
                max = *v;
            }
        }
        let mut lanes = [0f32; LANES];
        let mut chunks = sc.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for j in 0..LANES {
                c[j] = exp_approx(c[j] - max);
                lanes[j] += c[j];
            }
        }
        let mut sum: f64 = lanes.iter().map(|&v| v as f64).sum();
        for v in chunks.into_remainder() {
            *v = exp_approx(*v - max);
            sum += *v as f64;
        }
        s.row_max[r] = max;
        s.row_sum[r] = sum;
        let inv = (1.0 / sum) as f32;
        for v in sc.iter_mut() {
            *v *= inv;
        }
        round_through_f16(t.isa, sc);
        // Positions this row may not see weigh nothing in the V sum.
        s.scores[r * span + ctx..(r + 1) * span].fill(0.0);
    }
    // Weighted sum of V, one block at a time; 16 dimensions per register-held accumulator.
    s.o.fill(0.0);
    // While this head's V is summed, the next head's K (same blocks) is asked for.
    #[cfg(target_arch = "x86_64")]
    let prefetch_next_k = |bi: usize| {
        if let Some(kvh) = t.next_kvh.filter(|_| bi < n_blocks) {
            let k0 = lay.k_at(t.seq.block_table[bi] as usize, kvh, 0, 0);
            let k = t.k_cache[k0..k0 + hd * bs].as_ptr();
            super::attention_avx512::prefetch(k as *const u8, hd * bs * 2);
        }
    };
    for bi in 0..n_blocks {
        let blk = t.seq.block_table[bi] as usize;
        let v0 = lay.v_at(blk, t.kvh, 0, 0);
        #[cfg(target_arch = "x86_64")]
        if fast {
            prefetch_next_k(bi);
            let n_t = (max_ctx - bi * bs).min(bs);
            // SAFETY: as for the scores: V is an `bs * hd` slice of the cache; probabilities are
            // read at `r * span + bi * bs + t` for r < rows, t < n_t <= bs, inside the scores
            // buffer; `s.o` holds rows x hd values (resized above). Probabilities beyond each
            // row's context are zero, so reading them adds nothing.
            unsafe {
                super::attention_avx512::block_pv(
                    t.v_cache[v0..v0 + bs * hd].as_ptr(),
                    hd,
                    n_t,
                    s.scores.as_ptr().add(bi * bs),
                    span,
                    rows,
                    &mut s.o,
                );
            }
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        prefetch_next_k(bi);
        #[cfg(target_arch = "x86_64")]
        if f16c_row {
            let ctx = ctx_of(0);
            if bi * bs < ctx {
                let n_t = (ctx - bi * bs).min(bs);
                let v = &t.v_cache[v0..v0 + bs * hd];
                let p = &s.scores[bi * bs..bi * bs + n_t];
                // SAFETY: `f16c_row`: AVX2, FMA and F16C present, `hd` a multiple of 8; `v` is a
                // `bs * hd` slice of the cache and `n_t <= bs`; `s.o` holds the row's `hd`
                // values.
                unsafe { super::attention_avx2::row_pv(v.as_ptr(), p, hd, &mut s.o) };
            }
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if f16c_rows {
            let ctx = ctx_of(0);
            if bi * bs < ctx {
                let n_t = (ctx - bi * bs).min(bs);
                let v = t.v_cache[v0..v0 + bs * hd].as_ptr();
                let p = s.scores[bi * bs..(rows - 1) * span + bi * bs + n_t].as_ptr();
                let o = &mut s.o[..rows * hd];
                // SAFETY: `f16c_rows`: AVX2, FMA and F16C present, `hd` a multiple of 16; `v`
                // starts a `bs * hd` slice of the cache and `n_t <= bs`; the probabilities
                // slice covers `n_t` values at each row, `span` apart; `o` holds the rows.
                unsafe {
                    match rows {
                        2 => super::attention_avx2::rows_pv::<2>(v, p, span, n_t, hd, o),
                        3 => super::attention_avx2::rows_pv::<3>(v, p, span, n_t, hd, o),
                        _ => super::attention_avx2::rows_pv::<4>(v, p, span, n_t, hd, o),
                    }
                }
            }
            continue;
        }
        widen_f16(&t.v_cache[v0..v0 + bs * hd], &mut s.vbuf);
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + ROW_BLOCK).min(rows);
            let ctx = ctx_of(r1 - 1);
            if bi * bs >= ctx {
                r0 = r1;
                continue;
            }
            if hd % LANES == 0 && r1 - r0 == ROW_BLOCK {
                // Four rows at once, up to the last row's context: the earlier rows'
                // probabilities beyond their own context are zero and add nothing.
                let n_t = (ctx - bi * bs).min(bs);
                for d0 in (0..hd).step_by(LANES) {
                    let mut acc = [[0f32; LANES]; ROW_BLOCK];
                    for (i, acc_i) in acc.iter_mut().enumerate() {
                        acc_i.copy_from_slice(&s.o[(r0 + i) * hd + d0..(r0 + i) * hd + d0 + LANES]);
                    }
                    for tt in 0..n_t {
                        let vr = &s.vbuf[tt * hd + d0..tt * hd + d0 + LANES];
                        for (i, acc_i) in acc.iter_mut().enumerate() {
                            let pt = s.scores[(r0 + i) * span + bi * bs + tt];
                            for j in 0..LANES {
                                acc_i[j] = pt.mul_add(vr[j], acc_i[j]);
                            }
                        }
                    }
                    for (i, acc_i) in acc.iter().enumerate() {
                        s.o[(r0 + i) * hd + d0..(r0 + i) * hd + d0 + LANES].copy_from_slice(acc_i);
                    }
                }
                r0 = r1;
                continue;
            }
            for r in r0..r1 {
                let ctx = ctx_of(r);
                if bi * bs >= ctx {
                    continue;
                }
                let n_t = (ctx - bi * bs).min(bs);
                let pr = &s.scores[r * span + bi * bs..r * span + bi * bs + n_t];
                let or = &mut s.o[r * hd..(r + 1) * hd];
                // Position by position over all dimensions: every dimension's chain is
                // independent of the others (each still sums its positions in order).
                for (tt, &pt) in pr.iter().enumerate() {
                    for (o, &v) in or.iter_mut().zip(&s.vbuf[tt * hd..(tt + 1) * hd]) {
                        *o = pt.mul_add(v, *o);
                    }
                }
            }
            r0 = r1;
        }
    }
}

#[cfg(test)]
mod tests;

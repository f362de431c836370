//! Long-context mode on the agent (after InfLLM): what a sequence beyond its device budget keeps
//! in host memory, and how each step attends over initial + selected + local blocks. The block
//! layout is `npu_protocol::long_context`; the scheduler maps new tokens into it.
//!
//! Per step, before the forward pass (`prepare`), for each sequence with memory:
//! - the blocks that left the local window since its last step are copied to host memory, one
//!   layer at a time, with the sum of their representative keys (`select`);
//! - the initial blocks are rewritten with their keys turned to this step's memory position;
//! - the sequence's block table is replaced by the one attention reads: initial entries, the
//!   device-cache entries, then the local window's ring entries in order, and its start position
//!   by where its first new token lies in that table (the rope still uses the true positions).
//!
//! In every layer, before attention (`before_attention`): the step's queries score the memory
//! units; the top `k` not already in that layer's device cache are loaded into it with their
//! keys turned to the memory position. Device-cache content is kept per layer and reused while
//! a unit stays selected and the memory position has not moved.

mod rotary;
pub mod select;

use half::f16;
use npu_backend::{Backend, StepInputs};
use npu_protocol::LongContextLayout;

use crate::model::ModelError;
use select::Heads;

/// Counters of the mode (for benchmarks and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LongContextStats {
    /// Layer blocks copied to host memory (one unit of one layer each).
    pub layer_blocks_offloaded: u64,
    /// Layer blocks loaded into a device cache entry.
    pub layer_blocks_loaded: u64,
    /// Steps of sequences with memory.
    pub memory_steps: u64,
}

/// What one sequence keeps in host memory.
#[derive(Default)]
struct SeqMemory {
    /// The next logical block to offload (blocks before it are in `k`/`v`).
    offloaded_upto: u64,
    /// Per layer: each unit's K rows as cached (rotated at their own positions) and V rows,
    /// `block_size * kv_width` values per unit.
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    /// Per layer: each unit's representative-key sum (unrotated), `kv_width` values per unit.
    repr: Vec<Vec<f32>>,
    /// Per layer: the initial blocks' K and V as cached at their own positions.
    init_k: Vec<Vec<f16>>,
    init_v: Vec<Vec<f16>>,
    /// The memory position the initial blocks' keys are turned to on the device (None: their
    /// own positions, as written).
    init_at: Option<u64>,
    /// Per layer, per device-cache entry: the unit it holds and the memory position its keys
    /// were turned to.
    cache: Vec<Vec<Option<(u64, u64)>>>,
}

/// A sequence of this step whose memory is active.
struct ActiveSeq {
    slot: usize,
    q_row: usize,
    n_q: usize,
    memory_pos: u64,
    /// Units to attend to (`min(k, units)`), and their device-cache blocks.
    n_sel: usize,
    cache_blocks: Vec<u32>,
}

/// The mode's state on one agent: per slot, the host memory of its sequence.
pub struct LongContext {
    layout: LongContextLayout,
    heads: Heads,
    n_layers: usize,
    seqs: Vec<SeqMemory>,
    active: Vec<ActiveSeq>,
    stats: LongContextStats,
    /// Scratch: one layer block's K and V rows, a query, scores, angles.
    k_rows: Vec<f32>,
    v_rows: Vec<f32>,
    query: Vec<f32>,
    scores: Vec<f32>,
    cs: Vec<f32>,
}

impl LongContext {
    pub fn new(layout: LongContextLayout, heads: Heads, n_layers: usize, slots: usize) -> Self {
        let w = layout.block_size as usize * heads.kv_width();
        Self {
            layout,
            heads,
            n_layers,
            seqs: (0..slots).map(|_| SeqMemory::default()).collect(),
            active: Vec::new(),
            stats: LongContextStats::default(),
            k_rows: vec![0.0; w],
            v_rows: vec![0.0; w],
            query: Vec::new(),
            scores: Vec::new(),
            cs: Vec::new(),
        }
    }

    pub fn layout(&self) -> &LongContextLayout {
        &self.layout
    }

    pub fn stats(&self) -> LongContextStats {
        self.stats
    }

    /// Bytes of host memory held for sequences' memory units and initial blocks.
    pub fn host_bytes(&self) -> usize {
        self.seqs
            .iter()
            .map(|m| {
                let f16s: usize =
                    m.k.iter()
                        .chain(&m.v)
                        .chain(&m.init_k)
                        .chain(&m.init_v)
                        .map(Vec::len)
                        .sum();
                let f32s: usize = m.repr.iter().map(Vec::len).sum();
                2 * f16s + 4 * f32s
            })
            .sum()
    }

    /// Drops what a slot's sequence kept (on admission and forget).
    pub fn reset_slot(&mut self, slot: usize) {
        if let Some(m) = self.seqs.get_mut(slot) {
            *m = SeqMemory::default();
        }
    }

    /// Whether this step has sequences with memory (the forward pass then calls
    /// `before_attention` in every layer).
    pub fn has_active(&self) -> bool {
        !self.active.is_empty()
    }

    /// Offloads, turns the initial keys and rewrites the block tables of this step's sequences
    /// with memory (see the module doc). `slots[i]` is sequence `i`'s slot. The step was checked
    /// against the layout where it was read.
    pub fn prepare<B: Backend>(
        &mut self,
        b: &mut B,
        step: &mut StepInputs,
        slots: &[u32],
    ) -> Result<(), ModelError> {
        self.active.clear();
        let l = self.layout;
        let bs = u64::from(l.block_size);
        let init = l.cfg.initial_blocks as usize;
        let mb = step.max_blocks;
        for (i, span) in step.seqs.iter_mut().enumerate() {
            let ctx = u64::from(span.start_pos);
            if !l.memory_active(ctx) {
                continue;
            }
            let slot = slots.get(i).map_or(usize::MAX, |&s| s as usize);
            if slot >= self.seqs.len() {
                return Err(ModelError::LongContext(format!(
                    "sequence {i}: slot {slot} unknown"
                )));
            }
            let table: Vec<u32> = step.block_tables[i * mb..(i + 1) * mb].to_vec();
            let lb = l.first_local_block(ctx);
            let memory_pos = l.memory_position(ctx);
            let n_sel = (l.cfg.topk_blocks as u64).min(l.memory_units(ctx)) as usize;
            self.save_initial(b, slot, &table)?;
            self.offload(b, slot, &table, lb)?;
            self.turn_initial(b, slot, &table, memory_pos)?;
            // The table attention reads: initial | selected units | local window in order.
            let last = (ctx + u64::from(span.n_q) - 1) / bs;
            let mut virt: Vec<u32> = table[..init].to_vec();
            let cache_blocks: Vec<u32> =
                (0..n_sel).map(|c| table[l.cache_index(c as u32)]).collect();
            virt.extend(&cache_blocks);
            virt.extend((lb..=last).map(|j| table[l.table_index(j)]));
            virt.resize(mb, 0);
            step.block_tables[i * mb..(i + 1) * mb].copy_from_slice(&virt);
            let virtual_start = (init + n_sel) as u64 * bs + (ctx - lb * bs);
            span.start_pos = u32::try_from(virtual_start)
                .map_err(|_| ModelError::LongContext("virtual position beyond 32 bits".into()))?;
            self.active.push(ActiveSeq {
                slot,
                q_row: span.q_row as usize,
                n_q: span.n_q as usize,
                memory_pos,
                n_sel,
                cache_blocks,
            });
            self.stats.memory_steps += 1;
        }
        Ok(())
    }

    /// Keeps the initial blocks' K and V as written, the first time memory is active.
    fn save_initial<B: Backend>(
        &mut self,
        b: &mut B,
        slot: usize,
        table: &[u32],
    ) -> Result<(), ModelError> {
        let init = self.layout.cfg.initial_blocks as usize;
        let m = &mut self.seqs[slot];
        if !m.init_k.is_empty() {
            return Ok(());
        }
        m.init_k = vec![Vec::new(); self.n_layers];
        m.init_v = vec![Vec::new(); self.n_layers];
        for layer in 0..self.n_layers {
            for &block in &table[..init] {
                b.kv_layer_block_to_host(layer, block, &mut self.k_rows, &mut self.v_rows)?;
                m.init_k[layer].extend(self.k_rows.iter().map(|&x| f16::from_f32(x)));
                m.init_v[layer].extend(self.v_rows.iter().map(|&x| f16::from_f32(x)));
            }
        }
        Ok(())
    }

    /// Copies the blocks before `lb` not yet in host memory there, with their representative sums.
    fn offload<B: Backend>(
        &mut self,
        b: &mut B,
        slot: usize,
        table: &[u32],
        lb: u64,
    ) -> Result<(), ModelError> {
        let l = self.layout;
        let (bs, w) = (u64::from(l.block_size), self.heads.kv_width());
        let r = l.cfg.representative_keys as usize;
        let m = &mut self.seqs[slot];
        if m.k.is_empty() {
            m.k = vec![Vec::new(); self.n_layers];
            m.v = vec![Vec::new(); self.n_layers];
            m.repr = vec![Vec::new(); self.n_layers];
            m.cache = vec![vec![None; l.cfg.topk_blocks as usize]; self.n_layers];
            m.offloaded_upto = u64::from(l.cfg.initial_blocks);
        }
        let mut unrotated = vec![0f32; self.k_rows.len()];
        while m.offloaded_upto < lb {
            let j = m.offloaded_upto;
            let block = table[l.table_index(j)];
            for layer in 0..self.n_layers {
                b.kv_layer_block_to_host(layer, block, &mut self.k_rows, &mut self.v_rows)?;
                m.k[layer].extend(self.k_rows.iter().map(|&x| f16::from_f32(x)));
                m.v[layer].extend(self.v_rows.iter().map(|&x| f16::from_f32(x)));
                unrotated.copy_from_slice(&self.k_rows);
                for (t, row) in unrotated.chunks_exact_mut(w).enumerate() {
                    rotary::angles(
                        &self.heads.rope,
                        -((j * bs + t as u64) as f64),
                        &mut self.cs,
                    );
                    rotary::rotate(&self.heads.rope, row, self.heads.head_dim, &self.cs);
                }
                let at = m.repr[layer].len();
                m.repr[layer].resize(at + w, 0.0);
                select::representative_sum(&unrotated, w, r, &mut m.repr[layer][at..]);
                self.stats.layer_blocks_offloaded += 1;
            }
            m.offloaded_upto += 1;
        }
        Ok(())
    }

    /// Rewrites the initial blocks with their keys at `memory_pos` (when it moved).
    fn turn_initial<B: Backend>(
        &mut self,
        b: &mut B,
        slot: usize,
        table: &[u32],
        memory_pos: u64,
    ) -> Result<(), ModelError> {
        let init = self.layout.cfg.initial_blocks as usize;
        let m = &mut self.seqs[slot];
        if m.init_at == Some(memory_pos) {
            return Ok(());
        }
        let n = self.k_rows.len();
        for layer in 0..self.n_layers {
            for (j, &block) in table[..init].iter().enumerate() {
                turned_rows(
                    &self.heads,
                    &m.init_k[layer][j * n..(j + 1) * n],
                    (j * self.layout.block_size as usize) as u64,
                    memory_pos,
                    &mut self.k_rows,
                    &mut self.cs,
                );
                for (o, x) in self
                    .v_rows
                    .iter_mut()
                    .zip(&m.init_v[layer][j * n..(j + 1) * n])
                {
                    *o = x.to_f32();
                }
                b.kv_layer_block_from_host(layer, block, &self.k_rows, &self.v_rows)?;
            }
        }
        m.init_at = Some(memory_pos);
        Ok(())
    }

    /// Selects and loads this layer's memory units for every sequence with memory. `q` holds the
    /// step's query rows (`n_heads * head_dim` each, rotated at their own positions).
    pub fn before_attention<B: Backend>(
        &mut self,
        b: &mut B,
        layer: usize,
        q: &[f32],
    ) -> Result<(), ModelError> {
        let qw = self.heads.n_heads * self.heads.head_dim;
        let n = self.k_rows.len();
        let bs = u64::from(self.layout.block_size);
        let first_unit = u64::from(self.layout.cfg.initial_blocks);
        for a in &self.active {
            if a.n_sel == 0 {
                continue;
            }
            let rows = q.get(a.q_row * qw..(a.q_row + a.n_q) * qw).ok_or_else(|| {
                ModelError::LongContext(format!(
                    "query rows of sequence at row {} missing",
                    a.q_row
                ))
            })?;
            select::memory_query(&self.heads, rows, a.memory_pos, &mut self.query);
            let m = &mut self.seqs[a.slot];
            let chosen = select::top_units(&self.query, &m.repr[layer], a.n_sel, &mut self.scores);
            let held = &mut m.cache[layer];
            // Entries keep a chosen unit turned to this memory position; the others are free.
            let mut missing = Vec::new();
            for &u in &chosen {
                if !held[..a.n_sel].contains(&Some((u, a.memory_pos))) {
                    missing.push(u);
                }
            }
            let free: Vec<usize> = (0..a.n_sel)
                .filter(|&c| match held[c] {
                    Some((u, pos)) => pos != a.memory_pos || !chosen.contains(&u),
                    None => true,
                })
                .collect();
            for (u, c) in missing.into_iter().zip(free) {
                let at = u as usize * n;
                turned_rows(
                    &self.heads,
                    &m.k[layer][at..at + n],
                    (first_unit + u) * bs,
                    a.memory_pos,
                    &mut self.k_rows,
                    &mut self.cs,
                );
                for (o, x) in self.v_rows.iter_mut().zip(&m.v[layer][at..at + n]) {
                    *o = x.to_f32();
                }
                b.kv_layer_block_from_host(layer, a.cache_blocks[c], &self.k_rows, &self.v_rows)?;
                held[c] = Some((u, a.memory_pos));
                self.stats.layer_blocks_loaded += 1;
            }
        }
        Ok(())
    }
}

/// `cached` K rows of a block whose first token is at `first_pos`, each turned from its own
/// position to `memory_pos`, into `out` as f32.
fn turned_rows(
    h: &Heads,
    cached: &[f16],
    first_pos: u64,
    memory_pos: u64,
    out: &mut [f32],
    cs: &mut Vec<f32>,
) {
    let w = h.kv_width();
    for (t, (row, src)) in out
        .chunks_exact_mut(w)
        .zip(cached.chunks_exact(w))
        .enumerate()
    {
        for (o, x) in row.iter_mut().zip(src) {
            *o = x.to_f32();
        }
        rotary::angles(
            &h.rope,
            memory_pos as f64 - (first_pos + t as u64) as f64,
            cs,
        );
        rotary::rotate(&h.rope, row, h.head_dim, cs);
    }
}

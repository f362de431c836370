//! Decode steps as device graphs (`npu_serving.graph_capture`): a decode-only step is padded up
//! to its batch bucket (1, 2, 4, 8, …) and its block tables to a power-of-two width, its inputs
//! placed at the bucket's fixed device addresses (`Backend::begin_graph_step`), and the step's
//! ops — every layer, the output head and the greedy pick — recorded once per shape
//! ([`GraphKey`]) and replayed with one call afterwards. Prefill and mixed steps, steps with
//! long-context memory and tensor-parallel ranks stay eager.
//!
//! Padded rows are sequences of one token at position 0 writing their K and V to blocks kept
//! out of the scheduler's pool for them (the pool's last blocks), each row to a slot of its own
//! (Ascend's ScatterPaKvCache refuses a slot written twice in one call), so they never touch a
//! real sequence's cache. The first step of a shape runs eagerly (in the graph's form: it warms the
//! workspaces and executors the recording then finds in place, and gives the step's answer),
//! then records the same ops; later steps of the shape replay. When a backend cannot record a
//! step (an op that reads back or allocates), graphs are turned off for the model, once, by name.

use npu_backend::{Backend, GraphKey, HostSliceMut, Readback, SeqSpan, StepInputs, View};

use super::{Model, StepOutput};
use crate::model::ModelError;

/// The default batch buckets (each at most the step's capacities).
const DEFAULT_BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The model's graph state (present when graphs are on).
pub(crate) struct StepGraphs {
    buckets: Vec<usize>,
    /// The first of the blocks padded rows write to (kept out of the scheduler's pool).
    pad_block: u32,
    /// How many blocks from `pad_block` on are kept: a slot for each padded row of the
    /// widest padding ([`pad_blocks`]).
    pad_blocks: u32,
    block_size: u32,
    /// Set while `forward_inner` runs a step's ops for a graph: it stops before the read back.
    pub(super) body_only: bool,
    /// Why graphs stopped (logged when they did); none: they are on.
    pub(super) off: Option<String>,
    /// Whether each key's graph ends in the device's greedy pick.
    picks: std::collections::HashMap<GraphKey, bool>,
    padded: StepInputs,
}

/// The default batch buckets for decode steps of at most `max_seqs` sequences (a server's
/// `decode_batch_size`, the engine's slots): the powers of two up to the first that holds
/// `max_seqs`, so no bucket is wider than a step can be (and no block is kept for padded rows
/// a step can never have: one sequence at a time needs none).
pub fn default_buckets(max_seqs: usize) -> Vec<usize> {
    let mut buckets = Vec::new();
    for b in DEFAULT_BUCKETS {
        buckets.push(b);
        if b >= max_seqs {
            break;
        }
    }
    buckets
}

/// The bucket of a decode batch of `n` sequences: the smallest of `buckets` that holds it.
fn bucket_of(buckets: &[usize], n: usize) -> Option<usize> {
    buckets.iter().copied().filter(|&b| b >= n).min()
}

/// The blocks the padded rows of `buckets` need, a slot a row: the most rows a step is padded
/// by (a step of one more sequence than the bucket below holds, padded to its bucket) over the
/// block size, rounded up. Zero when every bucket is one row wider than the one below.
fn pad_blocks(buckets: &[usize], block_size: usize) -> usize {
    let mut below = 0;
    let mut most = 0;
    for &b in buckets {
        most = most.max(b - below - 1);
        below = b;
    }
    most.div_ceil(block_size.max(1))
}

/// Checks configured buckets: positive, and within the step's capacities (`max_rows`).
pub fn check_buckets(buckets: &[usize], max_rows: usize) -> Result<Vec<usize>, ModelError> {
    if buckets.is_empty() || buckets.contains(&0) {
        return Err(ModelError::BadOptions(format!(
            "graph_capture buckets must be positive batch sizes: {buckets:?}"
        )));
    }
    let mut b: Vec<usize> = buckets.iter().copied().filter(|&b| b <= max_rows).collect();
    b.sort_unstable();
    b.dedup();
    if b.is_empty() {
        return Err(ModelError::BadOptions(format!(
            "graph_capture buckets {buckets:?}: none fits a step of at most {max_rows} sequences"
        )));
    }
    Ok(b)
}

/// `step` (decode-only, `n` sequences) padded to `key`: rows up to `key.rows` (token 0 at
/// position 0; the `j`th padded row writes slot `j` of the blocks from `pad_block` on, and its
/// table names that slot's block), every table `key.max_blocks` wide (0 past a sequence's
/// blocks), every row's logits wanted.
fn pad_step(
    step: &StepInputs,
    key: GraphKey,
    pad_block: u32,
    block_size: u32,
    out: &mut StepInputs,
) {
    let n = step.seqs.len();
    let (rows, mb) = (key.rows, key.max_blocks);
    out.tokens.clear();
    out.tokens.extend_from_slice(&step.tokens);
    out.tokens.resize(rows, 0);
    out.positions.clear();
    out.positions.extend_from_slice(&step.positions);
    out.positions.resize(rows, 0);
    out.slot_mapping.clear();
    out.slot_mapping.extend_from_slice(&step.slot_mapping);
    out.slot_mapping
        .extend((0..rows.saturating_sub(n) as u32).map(|j| pad_block * block_size + j));
    out.seqs.clear();
    out.seqs.extend_from_slice(&step.seqs);
    out.seqs.extend((n..rows).map(|i| SeqSpan {
        q_row: i as u32,
        n_q: 1,
        start_pos: 0,
    }));
    out.max_blocks = mb;
    out.block_tables.clear();
    out.block_tables.resize(rows * mb, 0);
    for i in 0..rows {
        let row = &mut out.block_tables[i * mb..(i + 1) * mb];
        if i < n {
            row[..step.max_blocks].copy_from_slice(
                &step.block_tables[i * step.max_blocks..(i + 1) * step.max_blocks],
            );
        } else {
            row[0] = pad_block + (i - n) as u32 / block_size;
        }
    }
    out.logit_rows.clear();
    out.logit_rows.extend(0..rows as u32);
}

impl<B: Backend> Model<B> {
    /// Turns graphs on for decode steps (`npu_serving.graph_capture: auto`) with these batch
    /// buckets (None: 1, 2, 4, … 256 within the step's capacities), where the backend captures
    /// and the model allows it; says why not otherwise (`Ok(Err(reason))`). Call once, after
    /// load and before any step: it keeps the pool's last blocks for padded rows, a slot a row
    /// of the widest padding (`options().num_blocks` is that much less after it).
    pub fn enable_step_graphs(
        &mut self,
        buckets: Option<&[usize]>,
    ) -> Result<Result<(), String>, ModelError> {
        if self.graphs.is_some() {
            return Ok(Ok(()));
        }
        let why = if !self.backend.step_graphs() {
            Some(format!(
                "the {} backend does not capture steps as graphs",
                self.backend.kind().name()
            ))
        } else if self.tp.is_some() {
            Some("tensor parallelism (collectives inside a step)".into())
        } else if self.local.mla.is_some() {
            Some(format!(
                "latent attention ({}): its attention takes lengths on the host",
                self.cfg.arch.name()
            ))
        } else if self.local.has_sliding_window() {
            Some("sliding-window layers (their key masks are not in the graph form yet)".into())
        } else {
            None
        };
        if let Some(why) = why {
            tracing::info!(reason = %why, "graph capture off");
            return Ok(Err(why));
        }
        let most = self.opts.max_tokens.min(self.opts.max_logit_rows);
        let buckets = match buckets {
            Some(b) => check_buckets(b, most)?,
            None => check_buckets(&DEFAULT_BUCKETS, most)?,
        };
        let pads = pad_blocks(&buckets, self.opts.block_size);
        if pads >= self.opts.num_blocks {
            let why = format!(
                "a KV pool of {} blocks (the padded rows of batch buckets {buckets:?} need {pads} \
                 of their own)",
                self.opts.num_blocks
            );
            tracing::info!(reason = %why, "graph capture off");
            return Ok(Err(why));
        }
        self.opts.num_blocks -= pads;
        tracing::info!(
            ?buckets,
            pad_blocks = pads,
            first_pad_block = self.opts.num_blocks,
            "decode steps captured as graphs per batch bucket (the pool's last blocks kept for padded rows)"
        );
        self.graphs = Some(StepGraphs {
            buckets,
            pad_block: self.opts.num_blocks as u32,
            pad_blocks: pads as u32,
            block_size: self.opts.block_size as u32,
            body_only: false,
            off: None,
            picks: Default::default(),
            padded: StepInputs::default(),
        });
        Ok(Ok(()))
    }

    /// Whether decode steps go through graphs: None when they were never turned on, else
    /// `Ok` while on or `Err(why)` once turned off.
    pub fn step_graphs_state(&self) -> Option<Result<(), &str>> {
        self.graphs.as_ref().map(|g| match &g.off {
            None => Ok(()),
            Some(why) => Err(why.as_str()),
        })
    }

    /// Blocks of the pool kept from the scheduler (the padded rows' blocks).
    pub(super) fn reserved_blocks(&self) -> usize {
        self.graphs.as_ref().map_or(0, |g| g.pad_blocks as usize)
    }

    /// The graph a step would replay: decode-only, every row's logits wanted, a bucket that
    /// holds it, no long-context memory (`lc_active`), no LoRA adapter.
    pub(super) fn graph_key(
        &self,
        step: &StepInputs,
        greedy: bool,
        lc_active: bool,
    ) -> Option<GraphKey> {
        let g = self.graphs.as_ref().filter(|g| g.off.is_none())?;
        let n = step.seqs.len();
        // A step with LoRA adapters picks them on the host per step: eager.
        if lc_active
            || !self.lora.runs().is_empty()
            || n == 0
            || step.tokens.len() != n
            || step.seqs.iter().any(|s| s.n_q != 1)
            || step.logit_rows.len() != n
            || step
                .logit_rows
                .iter()
                .enumerate()
                .any(|(i, &r)| r as usize != i)
        {
            return None;
        }
        Some(GraphKey {
            rows: bucket_of(&g.buckets, n)?,
            max_blocks: step.max_blocks.max(1).next_power_of_two(),
            picks: greedy,
        })
    }

    fn graphs_off(&mut self, why: String) {
        if let Some(g) = self.graphs.as_mut() {
            tracing::warn!(reason = %why, "graph capture turned off for this model; decode steps run eagerly");
            g.off = Some(why);
            g.body_only = false;
        }
    }

    /// One decode step through `key`'s graph: replayed, or run and recorded on first use; the
    /// step's rows read back. Falls back to the eager step (graphs off, by name) when the
    /// backend cannot record it.
    pub(super) fn forward_graph(
        &mut self,
        step: &StepInputs,
        key: GraphKey,
        greedy: bool,
        out: &mut StepOutput,
    ) -> Result<(), ModelError> {
        let g = self.graphs.as_mut().expect("graph_key checked");
        let mut padded = std::mem::take(&mut g.padded);
        pad_step(step, key, g.pad_block, g.block_size, &mut padded);
        let r = self.graph_body(&padded, key, greedy, out);
        let g = self.graphs.as_mut().expect("still on");
        g.padded = padded;
        g.body_only = false;
        match r? {
            Some(picked) => self.read_graph_rows(step.seqs.len(), picked, out),
            None => self.forward_inner(step, greedy, out, None),
        }
    }

    /// The padded step's ops: replayed, or run then recorded. `Some(picked)`: the rows are in
    /// the buffers (`picked`: as greedy picks); `None`: graphs were turned off, run it eagerly.
    fn graph_body(
        &mut self,
        padded: &StepInputs,
        key: GraphKey,
        greedy: bool,
        out: &mut StepOutput,
    ) -> Result<Option<bool>, ModelError> {
        if let Err(e) = self.backend.begin_graph_step(padded, key) {
            self.graphs_off(format!("begin_graph_step: {e}"));
            return Ok(None);
        }
        if self.backend.has_graph(key) {
            let picked = self
                .graphs
                .as_ref()
                .and_then(|g| g.picks.get(&key).copied());
            if let Some(picked) = picked {
                self.backend.replay_graph(key)?;
                return Ok(Some(picked));
            }
        }
        self.graphs.as_mut().expect("on").body_only = true;
        // The eager run in the graph's form: the step's answer, and everything warmed.
        if let Err(e) = self.forward_inner(padded, greedy, out, None) {
            self.graphs_off(format!("the decode step in the graph's form: {e}"));
            return Ok(None);
        }
        let picked = out.picked_on_device;
        if let Err(e) = self.backend.capture_begin(key) {
            self.graphs_off(format!("capture_begin: {e}"));
            return Ok(Some(picked));
        }
        if let Err(e) = self.forward_inner(padded, greedy, out, None) {
            self.backend.capture_abort();
            self.graphs_off(format!("recording the decode step: {e}"));
            return Ok(None);
        }
        if let Err(e) = self.backend.capture_end(key) {
            self.backend.capture_abort();
            self.graphs_off(format!("capture_end: {e}"));
            return Ok(None);
        }
        self.graphs.as_mut().expect("on").picks.insert(key, picked);
        Ok(Some(picked))
    }

    /// Reads the first `n` rows of a graph step's answer back into `out`.
    fn read_graph_rows(
        &mut self,
        n: usize,
        picked: bool,
        out: &mut StepOutput,
    ) -> Result<(), ModelError> {
        let b = &mut self.backend;
        let bufs = &self.bufs;
        out.picked_on_device = picked;
        out.logits.clear();
        out.ids.clear();
        out.logprobs.clear();
        if picked {
            out.ids.resize(n, 0);
            out.logprobs.resize(n, 0.0);
            b.read_back(&mut [
                Readback {
                    src: View::rows(&bufs.ids, n, 1)?,
                    dst: HostSliceMut::I32(&mut out.ids),
                },
                Readback {
                    src: View::rows(&bufs.logprobs, n, 1)?,
                    dst: HostSliceMut::F32(&mut out.logprobs),
                },
            ])?;
        } else {
            let vocab = self.local.vocab;
            out.logits.resize(n * vocab, 0.0);
            b.read_back(&mut [Readback {
                src: View::rows(&bufs.logits, n, vocab)?,
                dst: HostSliceMut::F32(&mut out.logits),
            }])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_the_smallest_that_holds_the_batch() {
        let b = check_buckets(&[8, 1, 2, 4, 4, 64], 16).unwrap();
        assert_eq!(b, vec![1, 2, 4, 8]);
        assert_eq!(bucket_of(&b, 3), Some(4));
        assert_eq!(bucket_of(&b, 8), Some(8));
        assert_eq!(bucket_of(&b, 9), None);
        assert!(check_buckets(&[0, 2], 16).is_err());
        assert!(check_buckets(&[32], 16).is_err());
    }

    #[test]
    fn padded_rows_go_to_the_pad_block_and_tables_widen() {
        let step = StepInputs {
            tokens: vec![5, 6, 7],
            positions: vec![9, 3, 17],
            slot_mapping: vec![9, 16 + 3, 32 + 1],
            seqs: (0..3)
                .map(|i| SeqSpan {
                    q_row: i,
                    n_q: 1,
                    start_pos: [9, 3, 17][i as usize],
                })
                .collect(),
            block_tables: vec![0, 0, 1, 0, 2, 3],
            max_blocks: 2,
            logit_rows: vec![0, 1, 2],
        };
        let key = GraphKey {
            rows: 4,
            max_blocks: 4,
            picks: true,
        };
        let mut p = StepInputs::default();
        pad_step(&step, key, 7, 16, &mut p);
        assert_eq!(p.tokens, vec![5, 6, 7, 0]);
        assert_eq!(p.slot_mapping, vec![9, 19, 33, 112]);
        assert_eq!(
            p.seqs[3],
            SeqSpan {
                q_row: 3,
                n_q: 1,
                start_pos: 0
            }
        );
        assert_eq!(
            p.block_tables,
            vec![0, 0, 0, 0, 1, 0, 0, 0, 2, 3, 0, 0, 7, 0, 0, 0]
        );
        assert_eq!(p.logit_rows, vec![0, 1, 2, 3]);

        // Five padded rows over blocks of 2 slots: each its own slot, across three pad blocks,
        // each row's table naming its slot's block.
        let key = GraphKey {
            rows: 8,
            max_blocks: 2,
            picks: false,
        };
        pad_step(&step, key, 7, 2, &mut p);
        assert_eq!(&p.slot_mapping[3..], &[14, 15, 16, 17, 18]);
        let firsts: Vec<u32> = (3..8).map(|i| p.block_tables[i * 2]).collect();
        assert_eq!(firsts, vec![7, 7, 8, 8, 9]);
        let mut slots = p.slot_mapping.clone();
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(
            slots.len(),
            8,
            "no slot written twice: {:?}",
            p.slot_mapping
        );
    }

    #[test]
    fn pad_blocks_hold_a_slot_for_each_row_of_the_widest_padding() {
        // 1, 2, 4, 8: at most 3 padded rows (5 sequences in the bucket of 8).
        assert_eq!(pad_blocks(&[1, 2, 4, 8], 16), 1);
        assert_eq!(pad_blocks(&[1, 2, 4, 8], 2), 2);
        // 1..256: 127 padded rows (129 sequences in the bucket of 256).
        assert_eq!(pad_blocks(&DEFAULT_BUCKETS, 16), 8);
        assert_eq!(pad_blocks(&DEFAULT_BUCKETS, 128), 1);
        // No padding at all: no block kept.
        assert_eq!(pad_blocks(&[1, 2], 16), 0);
        assert_eq!(pad_blocks(&[1], 16), 0);
        // A first bucket of 4: a single sequence is padded by 3.
        assert_eq!(pad_blocks(&[4], 2), 2);
    }

    #[test]
    fn default_buckets_stop_at_the_first_that_holds_every_slot() {
        assert_eq!(default_buckets(1), vec![1]);
        assert_eq!(default_buckets(0), vec![1]);
        assert_eq!(default_buckets(4), vec![1, 2, 4]);
        assert_eq!(default_buckets(5), vec![1, 2, 4, 8]);
        assert_eq!(default_buckets(1000), DEFAULT_BUCKETS.to_vec());
        // One sequence at a time: nothing is padded, no block kept.
        assert_eq!(pad_blocks(&default_buckets(1), 16), 0);
    }
}

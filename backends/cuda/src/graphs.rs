//! Decode steps captured as CUDA graphs and replayed (`npu_backend::Backend::step_graphs`): one
//! graph per [`GraphKey`] (batch bucket, block-table width, whether it ends in the greedy pick),
//! recorded by the device (`Gpu::capture_begin` … `capture_end`: `driver::graph` on a GPU,
//! `emu::capture` on the emulation) and replayed with one launch.
//!
//! What a graph reads never depends on a host value of the step it is replayed for:
//!
//! - **Fixed inputs.** Each key has its own step-input memory (tokens, positions, slot mapping,
//!   per-sequence (row, new tokens, start), block tables, logit rows and the attention work
//!   lists, packed as `step::pack` packs an eager step's). A decode step of `rows` sequences of
//!   one token and tables `max_blocks` wide has the same layout every time, so every offset the
//!   recorded launches carry stays right; `begin_graph_step` writes the step's values there with
//!   an ordinary host→device copy **before** the capture (never inside it: a captured copy from
//!   the pinned staging ring would read the ring's buffer as it is at each replay).
//! - **Lengths on the device.** The attention kernel reads each sequence's start position from
//!   those inputs; its split (flash-decoding partitions, `tiles_per_split`) is chosen from the
//!   table width (`max_blocks * block_size` positions), not from the step's longest context, so
//!   the recorded grid serves every step of the key (a split past a sequence's last tile writes
//!   an empty partial, which the combine leaves out).
//!
//! A graph names device memory: the KV pool, weights, activations, scratch, its inputs. The
//! device marks a graph stale when memory it names is freed (a larger scratch replacing the
//! old, a new KV pool); `has_graph` then answers false and the runner records the key again.
//! A step that cannot be recorded (an op that allocates, frees, reads back or synchronizes:
//! refused inside a capture) fails the capture; the runner calls `capture_abort` and turns
//! graphs off for the model by name. Nothing here has run on a GPU: the emulation's capture is
//! what the tests check it against.

use std::collections::HashMap;

use npu_backend::{BackendError, GraphKey, StepInputs};

use crate::backend::{CudaBackend, NAME};
use crate::buffer::DeviceMem;
use crate::gpu::{DevPtr, GraphId};
use crate::step;

/// The backend's graphs and their inputs.
#[derive(Default)]
pub(crate) struct Graphs {
    captured: HashMap<GraphKey, GraphId>,
    /// Each key's step-input memory.
    inputs: HashMap<GraphKey, DeviceMem>,
    /// Whose inputs the ops read now (`None`: the eager step's, `CudaBackend::meta`).
    pub(crate) active: Option<GraphKey>,
    capturing: Option<GraphKey>,
    pub(crate) replays: u64,
    /// Deliberately wrong (`record_input_copies`): the step's input copy is recorded too.
    record_inputs: bool,
}

impl Graphs {
    /// The step-input address of the active graph step, if one is active.
    pub(crate) fn active_inputs(&self) -> Option<DevPtr> {
        self.active
            .and_then(|k| self.inputs.get(&k))
            .map(|m| m.ptr())
    }
}

fn bad_step(m: String) -> BackendError {
    BackendError::BadStep(m)
}

impl CudaBackend {
    /// **Deliberately wrong**, for the test that the emulation catches it: with `on`, a capture
    /// also records a copy of the step's inputs into the graph (staged through the pinned ring,
    /// as every upload is), so each replay copies whatever the ring's buffer holds by then over
    /// the inputs `begin_graph_step` wrote.
    pub fn record_input_copies(&mut self, on: bool) {
        self.graphs.record_inputs = on;
    }

    pub(crate) fn graphs_on(&self) -> bool {
        self.gpu.graphs_supported()
    }

    pub(crate) fn graph_begin_step(
        &mut self,
        s: &StepInputs,
        key: GraphKey,
    ) -> Result<(), BackendError> {
        if !self.graphs_on() {
            return Err(crate::gpu::graphs_unsupported());
        }
        if self.graphs.capturing.is_some() {
            return Err(bad_step("begin_graph_step while a capture is open".into()));
        }
        let decode = s.seqs.len() == key.rows
            && s.tokens.len() == key.rows
            && s.max_blocks == key.max_blocks
            && s.seqs.iter().all(|q| q.n_q == 1)
            && s.logit_rows.iter().copied().eq(0..key.rows as u32);
        if !decode {
            return Err(bad_step(format!(
                "a step of {} sequences, {} tokens and {}-block tables for the graph of {key:?} \
                 (decode-only, every row's logits)",
                s.seqs.len(),
                s.tokens.len(),
                s.max_blocks
            )));
        }
        let spec = self.kv_pool()?.spec;
        self.layout = None;
        self.graphs.active = None;
        let mut lay = step::pack(s, Some(&spec), &mut self.meta_host)?;
        // Attention's split from the table width, the same for every step of the key (the
        // kernel reads each sequence's length from the inputs).
        lay.max_ctx = key.max_blocks * spec.block_size;
        let bytes = lay.total * 4;
        if self
            .graphs
            .inputs
            .get(&key)
            .is_none_or(|m| m.bytes() < bytes)
        {
            // A key's layout never changes: a larger one replaces memory its graph names (the
            // device marks the graph stale when it is freed).
            self.graphs.inputs.remove(&key);
            let mem = self.alloc_mem(bytes.next_power_of_two().max(256))?;
            self.graphs.inputs.insert(key, mem);
        }
        let ptr = self.graphs.inputs[&key].ptr();
        self.device_wrote();
        self.gpu.htod(ptr, bytemuck::cast_slice(&self.meta_host))?;
        self.step.clone_from(s);
        self.layout = Some(lay);
        self.graphs.active = Some(key);
        Ok(())
    }

    pub(crate) fn graph_has(&self, key: GraphKey) -> bool {
        self.graphs
            .captured
            .get(&key)
            .is_some_and(|&g| !self.gpu.graph_stale(g))
    }

    pub(crate) fn graph_capture_begin(&mut self, key: GraphKey) -> Result<(), BackendError> {
        if self.graphs.active != Some(key) {
            return Err(bad_step(format!(
                "capture of {key:?} without its begin_graph_step"
            )));
        }
        if self.graphs.capturing.is_some() {
            return Err(bad_step("a capture is already open".into()));
        }
        // The recorded ops may not lean on what the eager run left (8-bit activations ready).
        self.q8_ready = None;
        self.device_wrote();
        self.gpu.capture_begin()?;
        self.graphs.capturing = Some(key);
        if self.graphs.record_inputs {
            let ptr = self.graphs.inputs[&key].ptr();
            self.gpu.htod(ptr, bytemuck::cast_slice(&self.meta_host))?;
        }
        Ok(())
    }

    pub(crate) fn graph_capture_end(&mut self, key: GraphKey) -> Result<(), BackendError> {
        if self.graphs.capturing != Some(key) {
            return Err(bad_step(format!(
                "capture_end of {key:?}, which is not being captured"
            )));
        }
        self.graphs.capturing = None;
        let id = self.gpu.capture_end()?;
        if let Some(old) = self.graphs.captured.insert(key, id) {
            self.gpu.destroy_graph(old);
        }
        tracing::info!("{NAME}: decode step captured as a CUDA graph for {key:?}");
        Ok(())
    }

    pub(crate) fn graph_capture_abort(&mut self) {
        self.graphs.capturing = None;
        if self.gpu.capturing() {
            self.gpu.capture_abort();
        }
        self.q8_ready = None;
    }

    pub(crate) fn graph_replay(&mut self, key: GraphKey) -> Result<(), BackendError> {
        if self.graphs.active != Some(key) {
            return Err(bad_step(format!(
                "replay of {key:?} without its begin_graph_step"
            )));
        }
        let id = *self
            .graphs
            .captured
            .get(&key)
            .ok_or_else(|| bad_step(format!("no graph captured for {key:?}")))?;
        self.gpu.replay(id)?;
        self.graphs.replays += 1;
        self.q8_ready = None;
        self.device_wrote();
        Ok(())
    }

    pub(crate) fn graph_drop_all(&mut self) -> Result<(), BackendError> {
        self.graph_capture_abort();
        if self.graphs.captured.is_empty() && self.graphs.inputs.is_empty() {
            return Ok(());
        }
        self.gpu.synchronize()?;
        for (_, id) in self.graphs.captured.drain() {
            self.gpu.destroy_graph(id);
        }
        if self.graphs.active.take().is_some() {
            self.layout = None;
        }
        self.graphs.inputs.clear();
        Ok(())
    }
}

#[cfg(all(test, feature = "emulation"))]
mod tests {
    use npu_backend::{Backend, KvSpec, SeqSpan};

    use super::*;
    use crate::CudaConfig;

    fn decode(rows: usize, max_blocks: usize) -> StepInputs {
        StepInputs {
            tokens: vec![1; rows],
            positions: vec![3; rows],
            slot_mapping: (0..rows as u32).map(|i| i * 4 + 3).collect(),
            seqs: (0..rows as u32)
                .map(|i| SeqSpan {
                    q_row: i,
                    n_q: 1,
                    start_pos: 3,
                })
                .collect(),
            block_tables: (0..(rows * max_blocks) as u32).map(|b| b % 8).collect(),
            max_blocks,
            logit_rows: (0..rows as u32).collect(),
        }
    }

    /// The graph methods refuse what breaks their contract, by name, and a key's inputs stay
    /// at one address from step to step.
    #[test]
    fn the_graph_methods_refuse_steps_out_of_their_contract() {
        let mut b = match CudaBackend::emulated(CudaConfig::default()) {
            Ok(b) => b,
            Err(e) => return eprintln!("SKIPPED (no CUDA emulation): {e}"),
        };
        assert!(b.step_graphs());
        let key = GraphKey {
            rows: 2,
            max_blocks: 2,
            picks: true,
        };
        // No pool yet.
        assert!(b.begin_graph_step(&decode(2, 2), key).is_err());
        b.init_kv(KvSpec {
            n_layers: 1,
            num_blocks: 8,
            block_size: 4,
            n_kv_heads: 1,
            head_dim: 8,
        })
        .unwrap();
        // Not the key's shape: rows, table width, a prefill row, a missing logit row.
        let mut prefill = decode(2, 2);
        prefill.seqs[1].n_q = 2;
        prefill.tokens.push(1);
        prefill.positions.push(4);
        prefill.slot_mapping.push(8);
        let mut no_logits = decode(2, 2);
        no_logits.logit_rows.pop();
        for (what, s) in [
            ("rows", decode(1, 2)),
            ("width", decode(2, 1)),
            ("prefill", prefill),
            ("logit rows", no_logits),
        ] {
            let e = b.begin_graph_step(&s, key).unwrap_err().to_string();
            assert!(e.contains("for the graph of"), "{what}: {e}");
        }
        // Capture and replay need their begin_graph_step; a replay needs a graph.
        assert!(b.capture_begin(key).is_err());
        b.begin_graph_step(&decode(2, 2), key).unwrap();
        let at = b.graphs.active_inputs().unwrap();
        let e = b.replay_graph(key).unwrap_err().to_string();
        assert!(e.contains("no graph captured"), "{e}");
        assert!(!b.has_graph(key));
        let other = GraphKey { rows: 4, ..key };
        assert!(b.capture_begin(other).is_err());
        // An empty capture makes a graph; the next step of the key reuses its inputs.
        b.capture_begin(key).unwrap();
        assert!(b.capture_begin(key).is_err(), "one capture at a time");
        b.capture_end(key).unwrap();
        assert!(b.has_graph(key));
        b.begin_graph_step(&decode(2, 2), key).unwrap();
        assert_eq!(b.graphs.active_inputs(), Some(at));
        b.replay_graph(key).unwrap();
        // An eager step reads its own inputs; dropping the graphs forgets them.
        b.begin_step(&decode(2, 2)).unwrap();
        assert_ne!(b.step_meta().unwrap().1, at);
        b.drop_graphs().unwrap();
        assert!(!b.has_graph(key));
    }
}

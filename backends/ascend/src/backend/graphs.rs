//! Decode steps captured as ACL graphs and replayed (`npu_backend::Backend::step_graphs`): one
//! [`StreamGraph`] per [`GraphKey`], each with its own step-input memory (the graph reads its
//! inputs where it was recorded reading them, so an eager step that needs a bigger upload
//! never moves them), the inputs in the graph form of [`StepPlan::graph_form`] (no sequence
//! length is a host argument of a first phase).
//!
//! Staleness: the backend replaces scratch, workspaces and rotary rows when a step needs more
//! and frees the old ones at the next synchronization. A graph recorded before such a
//! replacement may still read the old memory, so at each synchronization every graph that may
//! have seen a replaced allocation is dropped (and captured again on next use); a new KV pool
//! drops them all. Sliding-window models are refused (their per-window masks are not in the
//! graph form yet).

use std::collections::HashMap;

use npu_backend::{BackendError, GraphKey, StepInputs};
use tracing::{debug, info, warn};

use super::step::StepPlan;
use super::{err, objects, AscendBackend, Mem};
use crate::graph::{self, StreamGraph};

struct Captured {
    graph: StreamGraph,
    /// Replaced allocations awaiting release when it was captured, if it was captured since
    /// the last synchronization (`None`: before it).
    retired_at_capture: Option<usize>,
}

/// The backend's captured graphs and their step inputs.
#[derive(Default)]
pub(super) struct Graphs {
    captured: HashMap<GraphKey, Captured>,
    /// Each key's step-input memory, while another step's is in `step_mem`.
    parked: HashMap<GraphKey, Mem>,
    /// The eager steps' input memory, while a graph step's is in `step_mem`.
    eager_mem: Option<Mem>,
    /// Whose memory `step_mem` is (`None`: the eager steps').
    owner: Option<GraphKey>,
    capturing: Option<GraphKey>,
    replays: u64,
}

impl Graphs {
    pub(super) fn replays(&self) -> u64 {
        self.replays
    }
}

impl AscendBackend {
    /// Allocations replaced since the last synchronization (freed at the next one).
    fn retired_count(&self) -> usize {
        self.scratch.retired.len()
            + self.retired_mem.len()
            + self.retired_bufs.len()
            + self.ops.runner.retired_workspaces()
    }

    /// Called just before a synchronization frees the replaced allocations: drops every graph
    /// that may read one of them (the sync that follows has run their replays).
    pub(super) fn graphs_before_free(&mut self) -> Vec<StreamGraph> {
        let now = self.retired_count();
        let mut stale = Vec::new();
        let keys: Vec<GraphKey> = self.graphs.captured.keys().copied().collect();
        for k in keys {
            let c = self.graphs.captured.get_mut(&k).expect("listed");
            let moved = match c.retired_at_capture {
                Some(at) => now > at,
                None => now > 0,
            };
            if moved {
                let c = self.graphs.captured.remove(&k).expect("listed");
                info!(target: "npu_serving::acl", "ascend: graph {k:?} dropped (memory it recorded was replaced)");
                stale.push(c.graph);
            } else {
                c.retired_at_capture = None;
            }
        }
        stale
    }

    /// Puts `owner`'s step-input memory into `step_mem` (parking the current one).
    fn swap_step_mem(&mut self, owner: Option<GraphKey>) {
        if self.graphs.owner == owner {
            return;
        }
        let current = self.step_mem.take();
        match self.graphs.owner {
            None => self.graphs.eager_mem = current,
            Some(k) => {
                if let Some(m) = current {
                    self.graphs.parked.insert(k, m);
                }
            }
        }
        self.step_mem = match owner {
            None => self.graphs.eager_mem.take(),
            Some(k) => self.graphs.parked.remove(&k),
        };
        self.graphs.owner = owner;
    }

    /// Before an eager step: the eager steps' input memory back in place.
    pub(super) fn eager_step_mem(&mut self) {
        self.swap_step_mem(None);
    }

    /// Drops every graph and its input memory (synchronizing first: replays may be queued).
    pub(super) fn drop_all_graphs(&mut self) -> Result<(), BackendError> {
        if self.graphs.captured.is_empty() && self.graphs.parked.is_empty() {
            return Ok(());
        }
        self.capture_abort_inner();
        self.sync()?;
        self.graphs.captured.clear();
        self.eager_step_mem();
        self.graphs.parked.clear();
        Ok(())
    }

    pub(super) fn graphs_available(&self) -> bool {
        graph::available(self.dev.acl)
    }

    pub(super) fn begin_graph_step_inner(
        &mut self,
        step: &StepInputs,
        key: GraphKey,
    ) -> Result<(), BackendError> {
        self.bind()?;
        if !self.graphs_available() {
            return Err(self.graphs_unsupported_here());
        }
        if !self.windows.is_empty() {
            return Err(BackendError::Unsupported {
                backend: super::NAME,
                what: "captured steps of a sliding-window model (its key masks are not in the \
                       graph form yet)"
                    .into(),
            });
        }
        if step.seqs.len() != key.rows || step.max_blocks != key.max_blocks {
            return Err(BackendError::BadStep(format!(
                "a step of {} sequences and {}-block tables for the graph of {key:?}",
                step.seqs.len(),
                step.max_blocks
            )));
        }
        let kv = self.kv()?.spec;
        let plan = StepPlan::graph_form(step, kv.num_blocks, kv.block_size)?;
        let bytes = plan.bytes();
        self.swap_step_mem(Some(key));
        if self
            .step_mem
            .as_ref()
            .is_none_or(|m| m.bytes() < bytes.len())
        {
            if self.graphs.captured.contains_key(&key) {
                // Its inputs' shape never changes; a larger one means the key's graph is stale.
                self.sync()?;
                self.graphs.captured.remove(&key);
            }
            self.step_mem = Some(objects::zeroed(
                &self.dev,
                bytes.len().next_power_of_two(),
                "a captured step's inputs",
            )?);
        }
        self.upload_step(plan, &bytes)
    }

    pub(super) fn has_graph_inner(&self, key: GraphKey) -> bool {
        self.graphs.captured.contains_key(&key)
    }

    pub(super) fn capture_begin_inner(&mut self, key: GraphKey) -> Result<(), BackendError> {
        if self.graphs.owner != Some(key) {
            return Err(BackendError::BadStep(format!(
                "capture of {key:?} without its begin_graph_step"
            )));
        }
        if self.graphs.capturing.is_some() {
            return Err(BackendError::BadStep("a capture is already open".into()));
        }
        // A new step serial: the recorded ops gather the rotary rows and make the picks anew
        // rather than trusting what the eager run of the same inputs left.
        self.serial += 1;
        self.picked = None;
        self.dev.capture_begin().map_err(err)?;
        self.graphs.capturing = Some(key);
        Ok(())
    }

    pub(super) fn capture_end_inner(&mut self, key: GraphKey) -> Result<(), BackendError> {
        if self.graphs.capturing != Some(key) {
            return Err(BackendError::BadStep(format!(
                "capture_end of {key:?}, which is not being captured"
            )));
        }
        self.graphs.capturing = None;
        let g = self.dev.capture_end().map_err(err)?;
        let at = self.retired_count();
        self.graphs.captured.insert(
            key,
            Captured {
                graph: g,
                retired_at_capture: Some(at),
            },
        );
        info!(target: "npu_serving::acl", "ascend: decode step captured as a graph for {key:?}");
        Ok(())
    }

    pub(super) fn capture_abort_inner(&mut self) {
        if self.graphs.capturing.take().is_some() {
            match self.dev.capture_end() {
                // Nothing of it ran; destroying it is allowed (no replay was queued).
                Ok(g) => drop(g),
                Err(e) => {
                    warn!(target: "npu_serving::acl", "ascend: ending an abandoned capture: {e}")
                }
            }
        }
    }

    pub(super) fn replay_graph_inner(&mut self, key: GraphKey) -> Result<(), BackendError> {
        if self.graphs.owner != Some(key) {
            return Err(BackendError::BadStep(format!(
                "replay of {key:?} without its begin_graph_step"
            )));
        }
        let c = self
            .graphs
            .captured
            .get_mut(&key)
            .ok_or_else(|| BackendError::BadStep(format!("no graph captured for {key:?}")))?;
        c.graph.replay(&self.dev).map_err(err)?;
        self.graphs.replays += 1;
        self.pending = true;
        // What the replay computed is not what a later pick of this serial would reuse.
        self.serial += 1;
        self.picked = None;
        Ok(())
    }

    fn graphs_unsupported_here(&self) -> BackendError {
        BackendError::Unsupported {
            backend: super::NAME,
            what: "decode steps captured as graphs: this CANN release has no ACL graph capture \
                   (aclmdlRICaptureBegin, CANN 8.1+)"
                .into(),
        }
    }
}

impl AscendBackend {
    /// `plan`'s packed arrays (`bytes`) to `step_mem` in one async copy from pinned memory, and
    /// the step begins (its serial, the last step's counts).
    pub(super) fn upload_step(&mut self, plan: StepPlan, bytes: &[u8]) -> Result<(), BackendError> {
        let staging = self.staging.get(self.dev.acl, bytes.len())?;
        staging.as_mut_slice()[..bytes.len()].copy_from_slice(bytes);
        let mem = self.step_mem.as_mut().expect("just ensured");
        mem.upload_async(0, staging, 0, bytes.len(), &self.dev)
            .map_err(err)?;
        self.staging.busy = true;
        self.pending = true;
        self.plan = plan;
        self.serial += 1;
        let stats = self.ops.take_stats();
        if self.serial > 1 {
            self.last_stats = stats;
            debug!(
                target: "npu_serving::acl",
                "step {}: aclnn first phases {}, launches {} ({} of reused executors)",
                self.serial - 1,
                stats.prepares,
                stats.launches,
                stats.reused_launches
            );
        }
        Ok(())
    }
}

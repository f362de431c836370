//! Stream capture on the emulated device, as strict as CUDA's (`cuStreamBeginCapture_v2` in
//! `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`, `cuStreamEndCapture`, `cuGraphInstantiateWithFlags`,
//! `cuGraphLaunch`, `cuGraphExecDestroy`), for the backend's decode-step graphs
//! (`crate::graphs`). Nothing here was compared with a GPU: it follows the CUDA documentation.
//!
//! - **Recorded, not run.** While a capture is open, the work queued on the stream — kernel
//!   launches with their parameter values as they were at the launch, GEMMs, device copies, a
//!   read's device→host copies and host→device copies from the pinned staging buffers — goes
//!   into the recording instead of the queue; nothing of it runs.
//! - **Refused while recording**, and the capture invalidated, as CUDA does (its
//!   `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, then `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` for
//!   every later captured call and at `cuStreamEndCapture`): synchronizing the stream (so a read
//!   back fails), allocating (`cuMemAllocAsync` would make a graph-owned allocation the backend
//!   would keep as its own), freeing memory allocated outside the graph (`cuMemFreeAsync` in a
//!   capture must name a graph allocation; the free itself happens once the capture ends), and
//!   waiting for a staging event (`cuEventSynchronize`). Ending the capture from another thread
//!   than the one that began it fails (`CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`). A staging
//!   event recorded inside the capture can never be waited for until recorded again outside
//!   (`CUDA_ERROR_CAPTURED_EVENT`).
//! - **Replay** queues the recorded work again with its recorded parameters, and it runs, in
//!   stream order, against device memory as it is then. A host→device copy recorded from a
//!   pinned staging buffer reads that buffer **when the replay runs**, as a captured
//!   `cuMemcpyHtoDAsync` from pinned memory does: whatever the ring put there since, not what
//!   it held at the capture. A graph naming an allocation freed since its capture refuses to run
//!   (on a GPU it would read freed memory).

use std::collections::{BTreeSet, HashMap};
use std::thread::ThreadId;

use npu_backend::BackendError;

use super::{emu_err, Device, Work};
use crate::gpu::{DevPtr, GraphId};
use crate::staging::STAGE_BUFFERS;

/// An open capture.
pub(super) struct Recording {
    work: Vec<Work>,
    /// Start of every allocation the recorded work names.
    named: BTreeSet<DevPtr>,
    thread: ThreadId,
    /// Why the capture was invalidated (a refused call inside it).
    invalid: Option<String>,
    /// Frees called while recording, done once it ends.
    deferred_frees: Vec<DevPtr>,
}

struct Graph {
    work: Vec<Work>,
    named: BTreeSet<DevPtr>,
    /// Set when an allocation it names is freed.
    stale: Option<String>,
}

/// The device's capture state: the open recording and the graphs made.
#[derive(Default)]
pub(super) struct Capture {
    pub(super) recording: Option<Recording>,
    graphs: HashMap<GraphId, Graph>,
    next: GraphId,
    /// Staging events last recorded inside a capture.
    pub(super) captured_events: [bool; STAGE_BUFFERS],
    /// Graphs replayed so far.
    pub(super) replays: u64,
}

fn invalidated(why: &str) -> BackendError {
    emu_err(format!(
        "the stream capture was invalidated earlier ({why}): CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"
    ))
}

impl super::EmuGpu {
    /// Graphs alive and graphs replayed so far.
    pub fn graph_counts(&self) -> (usize, u64) {
        let d = self.dev();
        (d.graphs(), d.capture.replays)
    }
}

impl Device {
    /// The allocation starts `w` names.
    fn names(&self, w: &Work) -> Vec<DevPtr> {
        let start = |p: DevPtr| self.mem.find(p, 0).map(|(s, _)| s);
        match w {
            Work::HtoD { dst, .. } => start(*dst).into_iter().collect(),
            Work::DtoD { dst, src, .. } => {
                [start(*dst), start(*src)].into_iter().flatten().collect()
            }
            Work::DtoH { src, .. } => start(*src).into_iter().collect(),
            Work::Kernel { touched, .. } => touched.clone(),
            Work::Gemm(g) => [start(g.a), start(g.b), start(g.c)]
                .into_iter()
                .flatten()
                .collect(),
            Work::Free(_) | Work::Record => Vec::new(),
        }
    }

    /// Queues `w`, or records it while a capture is open (refused once it was invalidated).
    pub(super) fn submit(&mut self, w: Work) -> Result<(), BackendError> {
        if self.capture.recording.is_none() {
            self.enqueue(w);
            return Ok(());
        }
        let named = self.names(&w);
        let r = self.capture.recording.as_mut().expect("checked");
        if let Some(why) = &r.invalid {
            return Err(invalidated(why));
        }
        r.named.extend(named);
        r.work.push(w);
        Ok(())
    }

    /// A call CUDA forbids while the stream is capturing: invalidates the capture and fails.
    /// Ok when no capture is open.
    pub(super) fn forbidden_in_capture(&mut self, call: &str) -> Result<(), BackendError> {
        let Some(r) = self.capture.recording.as_mut() else {
            return Ok(());
        };
        let why =
            format!("{call} while the stream is capturing (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)");
        r.invalid.get_or_insert_with(|| why.clone());
        Err(emu_err(format!("{why}; the capture is invalidated")))
    }

    /// `cuMemFreeAsync` of `ptr` while capturing: refused (the capture invalidated), the free
    /// done when the capture ends. False when no capture is open.
    pub(super) fn defer_free(&mut self, ptr: DevPtr) -> bool {
        let Some(r) = self.capture.recording.as_mut() else {
            return false;
        };
        r.invalid.get_or_insert_with(|| {
            format!(
                "cuMemFreeAsync of {ptr:#x}, memory allocated outside the graph, while the stream \
                 is capturing"
            )
        });
        r.deferred_frees.push(ptr);
        true
    }

    /// An allocation was freed: every graph naming it may not run again.
    pub(super) fn freed(&mut self, ptr: DevPtr) {
        for g in self.capture.graphs.values_mut() {
            if g.stale.is_none() && g.named.contains(&ptr) {
                g.stale = Some(format!("the allocation at {ptr:#x} it names was freed"));
            }
        }
    }

    /// The staging event `i` was recorded: inside a capture it becomes a captured event.
    pub(super) fn event_recorded_in_capture(&mut self, i: usize) -> bool {
        if self.capture.recording.is_some() {
            self.capture.captured_events[i] = true;
            true
        } else {
            self.capture.captured_events[i] = false;
            false
        }
    }

    /// `cuEventSynchronize` of staging event `i`: refused on an event last recorded in a
    /// capture, and while capturing.
    pub(super) fn event_wait_allowed(&mut self, i: usize) -> Result<(), BackendError> {
        if self.capture.captured_events[i] {
            return Err(emu_err(format!(
                "cuEventSynchronize of staging event {i}, last recorded inside a stream capture \
                 (CUDA_ERROR_CAPTURED_EVENT)"
            )));
        }
        self.forbidden_in_capture("cuEventSynchronize (a staging buffer's event)")
    }

    pub(super) fn capture_begin(&mut self) -> Result<(), BackendError> {
        if self.capture.recording.is_some() {
            return Err(emu_err(
                "cuStreamBeginCapture_v2 on a stream already capturing \
                 (CUDA_ERROR_ILLEGAL_STATE)"
                    .into(),
            ));
        }
        self.capture.recording = Some(Recording {
            work: Vec::new(),
            named: BTreeSet::new(),
            thread: std::thread::current().id(),
            invalid: None,
            deferred_frees: Vec::new(),
        });
        Ok(())
    }

    /// Ends the capture (`abort`: whatever it holds is discarded); the frees deferred in it are
    /// queued now.
    pub(super) fn capture_end(&mut self, abort: bool) -> Result<Option<GraphId>, BackendError> {
        let Some(r) = self.capture.recording.as_ref() else {
            if abort {
                return Ok(None);
            }
            return Err(emu_err(
                "cuStreamEndCapture on a stream not capturing (CUDA_ERROR_ILLEGAL_STATE)".into(),
            ));
        };
        if !abort && r.thread != std::thread::current().id() {
            return Err(emu_err(
                "cuStreamEndCapture from another thread than the capture's (thread-local mode: \
                 CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)"
                    .into(),
            ));
        }
        let r = self.capture.recording.take().expect("checked");
        for ptr in r.deferred_frees {
            match self.mem.release(ptr) {
                Ok(()) => {
                    self.enqueue(Work::Free(ptr));
                    self.freed(ptr);
                }
                Err(e) => self.bad_frees.push(e),
            }
        }
        if abort {
            return Ok(None);
        }
        if let Some(why) = r.invalid {
            return Err(invalidated(&why));
        }
        let id = self.capture.next;
        self.capture.next += 1;
        self.capture.graphs.insert(
            id,
            Graph {
                work: r.work,
                named: r.named,
                stale: None,
            },
        );
        Ok(Some(id))
    }

    /// `cuGraphLaunch`: the graph's recorded work queued again.
    pub(super) fn replay(&mut self, id: GraphId) -> Result<(), BackendError> {
        if self.capture.recording.is_some() {
            return Err(emu_err(
                "cuGraphLaunch while the stream is capturing (the backend never nests graphs)"
                    .into(),
            ));
        }
        let g =
            self.capture.graphs.get(&id).ok_or_else(|| {
                emu_err(format!("cuGraphLaunch of graph {id}, which does not exist"))
            })?;
        if let Some(why) = &g.stale {
            return Err(emu_err(format!(
                "cuGraphLaunch of graph {id}: {why} (on a GPU it would read freed memory: \
                 CUDA_ERROR_ILLEGAL_ADDRESS or silent corruption)"
            )));
        }
        let work = g.work.clone();
        for w in work {
            self.enqueue(w);
        }
        self.capture.replays += 1;
        Ok(())
    }

    pub(super) fn graph_stale(&self, id: GraphId) -> bool {
        self.capture
            .graphs
            .get(&id)
            .is_none_or(|g| g.stale.is_some())
    }

    pub(super) fn destroy_graph(&mut self, id: GraphId) {
        self.capture.graphs.remove(&id);
    }

    /// Graphs alive.
    pub(super) fn graphs(&self) -> usize {
        self.capture.graphs.len()
    }
}

#[cfg(test)]
#[path = "capture_tests.rs"]
mod tests;

//! ACL graph: stream capture into a model run instance (`aclmdlRICaptureBegin` /
//! `aclmdlRICaptureEnd`), its replay (`aclmdlRIExecuteAsync`) and its end (`aclmdlRIDestroy`),
//! as CANN's runtime reference documents them (a trial feature of CANN 8.1+).
//!
//! Rules, each refused with the documented status:
//! - Between begin and end, work submitted to the capturing stream (operator launches, async
//!   copies between device memory or from/to pinned host memory, async memsets) is **recorded,
//!   not run**: nothing it writes changes until the instance is executed.
//! - The unsafe functions (`aclrtMemset`, `aclrtMemcpy` — so every synchronous read back —, and
//!   here `aclrtMalloc` and `aclrtFree` as well) fail with `ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT`
//!   while a capture in `GLOBAL` mode is open (any thread) or one in `THREAD_LOCAL` mode is open
//!   on the calling thread; `RELAXED` permits them.
//! - Synchronizing the capturing stream (`aclrtSynchronizeStream`, or `aclrtSynchronizeDevice` on
//!   its device), recording or waiting for an event on it, a collective on it and destroying it
//!   fail with the same status whatever the mode (the emulation does not model captured events).
//! - `aclmdlRICaptureEnd` on a stream that is not capturing: `ACL_ERROR_RT_STREAM_NOT_CAPTURED`.
//! - A replay runs the recorded work in order on the given stream, against the **device
//!   addresses recorded at capture** (each operator's parameters as its first phase fixed them):
//!   new inputs must be written to those addresses before it. Every recorded address must still
//!   be allocated when the replay is queued; destroying an instance whose replay has not run yet
//!   is refused (synchronize first); an instance never destroyed is in the leak report.

use std::ffi::c_void;

use npu_ffi::types::*;

use crate::state::*;

/// Makes a fresh run of one recorded piece of work (a replay may run it many times).
pub type MakeTask = Box<dyn Fn() -> TaskFn + Send>;

/// One piece of recorded stream work.
pub struct Recorded {
    pub name: String,
    pub reads: Vec<(u64, u64)>,
    pub writes: Vec<(u64, u64)>,
    pub make: MakeTask,
}

/// An open capture on one stream.
pub struct Capture {
    pub mode: aclmdlRICaptureMode,
    pub thread: std::thread::ThreadId,
    pub work: Vec<Recorded>,
}

/// A model run instance made by `aclmdlRICaptureEnd`.
pub struct Graph {
    pub device: i32,
    pub work: Vec<Recorded>,
}

/// Graph replays queued in this process (emulation-only, for tests).
static REPLAYS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn tag(h: u64) -> String {
    format!("(replay of aclmdlRI {h:#x})")
}

impl State {
    /// Queues work on `stream`, or records it when the stream is capturing.
    pub fn submit(
        &mut self,
        stream: u64,
        name: String,
        reads: Vec<(u64, u64)>,
        writes: Vec<(u64, u64)>,
        make: MakeTask,
    ) {
        if let Some(c) = self.captures.get_mut(&stream) {
            c.work.push(Recorded {
                name,
                reads,
                writes,
                make,
            });
            return;
        }
        let run = make();
        self.enqueue(
            stream,
            Task {
                name,
                reads,
                writes,
                run,
            },
        );
    }

    /// Fails when an open capture's mode forbids the unsafe function `what` on this thread.
    pub fn check_unsafe_call(&self, what: &str) -> Result<(), Fail> {
        let me = std::thread::current().id();
        for (s, c) in &self.captures {
            let forbidden = match c.mode {
                ACL_MODEL_RI_CAPTURE_MODE_GLOBAL => true,
                ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL => c.thread == me,
                _ => false,
            };
            if forbidden {
                return fail(
                    ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT,
                    format!("{what} while stream {s:#x} is capturing (aclmdlRICaptureBegin mode {}): not permitted outside RELAXED mode", c.mode),
                );
            }
        }
        Ok(())
    }

    /// Fails when `stream` is capturing: `what` cannot be captured or waits for the stream.
    pub fn check_not_capturing(&self, stream: u64, what: &str) -> Result<(), Fail> {
        if self.captures.contains_key(&stream) {
            return fail(
                ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT,
                format!("{what}: stream {stream:#x} is capturing (end the capture with aclmdlRICaptureEnd first)"),
            );
        }
        Ok(())
    }

    /// Leak report lines of open captures and live model run instances.
    pub fn capture_leaks(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .captures
            .iter()
            .map(|(s, c)| {
                format!(
                    "capture on stream {s:#x} ({} recorded tasks) never ended (aclmdlRICaptureEnd)",
                    c.work.len()
                )
            })
            .collect();
        let mut graphs: Vec<_> = self.graphs.iter().collect();
        graphs.sort_by_key(|(h, _)| **h);
        for (h, g) in graphs {
            out.push(format!(
                "aclmdlRI {h:#x} ({} tasks) never destroyed (aclmdlRIDestroy)",
                g.work.len()
            ));
        }
        out
    }
}

fn run(f: impl FnOnce(&mut State) -> Result<(), Fail>) -> aclError {
    let mut st = state();
    finish(f(&mut st))
}

#[no_mangle]
pub extern "C" fn aclmdlRICaptureBegin(stream: aclrtStream, mode: aclmdlRICaptureMode) -> aclError {
    run(|st| {
        st.require_init()?;
        let s = st.resolve_stream(stream as u64)?;
        if mode > ACL_MODEL_RI_CAPTURE_MODE_RELAXED {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclmdlRICaptureBegin: mode {mode} is not an aclmdlRICaptureMode"),
            );
        }
        if st.captures.contains_key(&s) {
            return fail(
                ACL_ERROR_RT_PARAM_INVALID,
                format!("aclmdlRICaptureBegin: stream {s:#x} is already capturing"),
            );
        }
        st.captures.insert(
            s,
            Capture {
                mode,
                thread: std::thread::current().id(),
                work: Vec::new(),
            },
        );
        Ok(())
    })
}

/// # Safety
/// `modelRI` is null or a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureEnd(
    stream: aclrtStream,
    modelRI: *mut aclmdlRI,
) -> aclError {
    run(|st| {
        st.require_init()?;
        let s = st.resolve_stream(stream as u64)?;
        if modelRI.is_null() {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                "aclmdlRICaptureEnd: null modelRI out-pointer",
            );
        }
        let Some(c) = st.captures.remove(&s) else {
            return fail(
                ACL_ERROR_RT_STREAM_NOT_CAPTURED,
                format!(
                    "aclmdlRICaptureEnd: stream {s:#x} is not capturing (aclmdlRICaptureBegin)"
                ),
            );
        };
        let device = st.streams[&s].device;
        let h = st.new_handle(KIND_MODEL_RI);
        st.graphs.insert(
            h,
            Graph {
                device,
                work: c.work,
            },
        );
        // SAFETY: checked non-null; the caller passes a valid out-pointer.
        unsafe { *modelRI = h as *mut c_void };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclmdlRIExecuteAsync(modelRI: aclmdlRI, stream: aclrtStream) -> aclError {
    run(|st| {
        st.require_init()?;
        let h = modelRI as u64;
        let s = st.resolve_stream(stream as u64)?;
        st.check_not_capturing(s, "aclmdlRIExecuteAsync (a replay inside a capture)")?;
        let Some(g) = st.graphs.get(&h) else {
            return fail(
                ACL_ERROR_RT_INVALID_HANDLE,
                format!("aclmdlRIExecuteAsync: {h:#x} is not a live aclmdlRI (aclmdlRICaptureEnd)"),
            );
        };
        if g.device != st.streams[&s].device {
            return fail(
                ACL_ERROR_RT_STREAM_CONTEXT,
                format!(
                    "aclmdlRIExecuteAsync: aclmdlRI {h:#x} was captured on device {}, the stream is on device {}",
                    g.device, st.streams[&s].device
                ),
            );
        }
        for w in &g.work {
            for &(addr, len) in w.reads.iter().chain(&w.writes) {
                st.device_range(addr, len, "aclmdlRIExecuteAsync").map_err(|f| Fail {
                    code: ACL_ERROR_RT_PARAM_INVALID,
                    msg: format!(
                        "aclmdlRIExecuteAsync: recorded {} uses device memory {addr:#x}+{len} that is no longer allocated: {}",
                        w.name, f.msg
                    ),
                })?;
            }
        }
        let tasks: Vec<Task> = g
            .work
            .iter()
            .map(|w| Task {
                name: format!("{} {}", w.name, tag(h)),
                reads: w.reads.clone(),
                writes: w.writes.clone(),
                run: (w.make)(),
            })
            .collect();
        for t in tasks {
            st.enqueue(s, t);
        }
        REPLAYS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclmdlRIDestroy(modelRI: aclmdlRI) -> aclError {
    run(|st| {
        st.require_init()?;
        let h = modelRI as u64;
        if !st.graphs.contains_key(&h) {
            return fail(
                ACL_ERROR_RT_INVALID_HANDLE,
                format!("aclmdlRIDestroy: {h:#x} is not a live aclmdlRI"),
            );
        }
        let t = tag(h);
        if st
            .streams
            .values()
            .flat_map(|s| &s.queue)
            .any(|q| q.name.ends_with(&t))
        {
            return fail(
                ACL_ERROR_RT_PARAM_INVALID,
                format!("aclmdlRIDestroy: a replay of aclmdlRI {h:#x} is queued and has not run; synchronize its stream first"),
            );
        }
        st.graphs.remove(&h);
        Ok(())
    })
}

/// Emulation-only extension (not part of CANN): graph replays (`aclmdlRIExecuteAsync` calls
/// accepted) in this process.
#[no_mangle]
pub extern "C" fn ascendEmulatorGraphReplays() -> u64 {
    REPLAYS.load(std::sync::atomic::Ordering::Relaxed)
}

// The definitions above match the declared prototypes.
const _: npu_ffi::acl_rt::sig::aclmdlRICaptureBegin = aclmdlRICaptureBegin;
const _: npu_ffi::acl_rt::sig::aclmdlRICaptureEnd = aclmdlRICaptureEnd;
const _: npu_ffi::acl_rt::sig::aclmdlRIExecuteAsync = aclmdlRIExecuteAsync;
const _: npu_ffi::acl_rt::sig::aclmdlRIDestroy = aclmdlRIDestroy;

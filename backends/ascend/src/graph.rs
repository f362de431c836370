//! ACL graph: the work queued on a device's stream captured once into a model run instance
//! (`aclmdlRICaptureBegin` / `aclmdlRICaptureEnd`) and replayed with one call
//! (`aclmdlRIExecuteAsync`), destroyed with `aclmdlRIDestroy` (CANN 8.1+, documented as a trial
//! feature; the symbols are optional and their absence is [`AscendError::Unavailable`]).
//!
//! What the documentation asks of the caller, and the emulation enforces: between begin and end
//! the stream's launches and async copies are recorded, not run; no synchronous copy (so no read
//! back), memset, allocation, free or synchronization may happen on the capturing thread
//! (`THREAD_LOCAL` mode, the one used here); a replay uses the device addresses and the operator
//! parameters (first phases' host arguments included) recorded at capture, so new inputs must be
//! written to the same addresses, by async copies queued before the replay, and every buffer and
//! workspace the graph uses must stay allocated until it is destroyed.

use npu_ffi::types::*;

use crate::device::Device;
use crate::error::{AscendError, Result};
use crate::runtime::Acl;

/// A captured model run instance; destroyed on drop (its replays must have run by then: drop it
/// after a synchronization).
pub struct StreamGraph {
    acl: &'static Acl,
    ri: aclmdlRI,
    replays: u64,
}

// SAFETY: the handle is a plain identifier owned by this value; ACL calls are thread-safe.
unsafe impl Send for StreamGraph {}

fn missing(call: &str) -> AscendError {
    AscendError::Unavailable {
        missing_library: false,
        message: format!("this CANN release has no {call} (ACL graph capture, CANN 8.1+)"),
    }
}

/// Whether the loaded runtime has the four capture calls.
pub fn available(acl: &Acl) -> bool {
    let rt = &acl.api.rt;
    rt.aclmdlRICaptureBegin.is_some()
        && rt.aclmdlRICaptureEnd.is_some()
        && rt.aclmdlRIExecuteAsync.is_some()
        && rt.aclmdlRIDestroy.is_some()
}

impl Device {
    /// Starts recording this device's stream (`THREAD_LOCAL`: this thread may not call the
    /// unsafe functions until [`Device::capture_end`]).
    pub fn capture_begin(&self) -> Result<()> {
        if !available(self.acl) {
            return Err(missing("aclmdlRICaptureBegin"));
        }
        let f = self.acl.api.rt.aclmdlRICaptureBegin.expect("checked");
        self.acl.log("aclmdlRICaptureBegin", String::new);
        // SAFETY: the stream is live (owned by the device); a documented mode.
        let rc = unsafe { f(self.raw_stream(), ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL) };
        self.acl.check("aclmdlRICaptureBegin", rc)
    }

    /// Ends the recording begun by [`Device::capture_begin`]: the recorded work as a graph.
    pub fn capture_end(&self) -> Result<StreamGraph> {
        let f = self
            .acl
            .api
            .rt
            .aclmdlRICaptureEnd
            .ok_or_else(|| missing("aclmdlRICaptureEnd"))?;
        let mut ri: aclmdlRI = std::ptr::null_mut();
        // SAFETY: the stream is live; a valid out-pointer.
        let rc = unsafe { f(self.raw_stream(), &mut ri) };
        self.acl.check("aclmdlRICaptureEnd", rc)?;
        self.acl.log("aclmdlRICaptureEnd", || format!("{ri:p}"));
        Ok(StreamGraph {
            acl: self.acl,
            ri,
            replays: 0,
        })
    }
}

impl StreamGraph {
    /// Queues one run of the recorded work on `device`'s stream.
    pub fn replay(&mut self, device: &Device) -> Result<()> {
        let f = self
            .acl
            .api
            .rt
            .aclmdlRIExecuteAsync
            .ok_or_else(|| missing("aclmdlRIExecuteAsync"))?;
        let stream = device.stream();
        // SAFETY: a live model run instance (owned by self) and a live stream.
        let rc = unsafe { f(self.ri, stream) };
        self.acl.check("aclmdlRIExecuteAsync", rc)?;
        self.replays += 1;
        Ok(())
    }

    /// Replays queued so far.
    pub fn replays(&self) -> u64 {
        self.replays
    }
}

impl Drop for StreamGraph {
    fn drop(&mut self) {
        if let Some(f) = self.acl.api.rt.aclmdlRIDestroy {
            // SAFETY: a live model run instance, destroyed once.
            let rc = unsafe { f(self.ri) };
            if let Err(e) = self.acl.check("aclmdlRIDestroy", rc) {
                tracing::warn!(target: "npu_serving::acl", "{e}");
            }
        }
    }
}

//! One agent's device: its id (`start_device_id` + agent index, within the devices
//! `ASCEND_RT_VISIBLE_DEVICES` leaves visible, which ACL renumbers from 0), one context and one
//! stream, released in reverse order on drop. Device memory information comes from
//! `aclrtGetMemInfo`, which sizes the KV pool when asked.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use npu_ffi::types::*;

use crate::error::{AscendError, Result};
use crate::runtime::Acl;

/// The logical device of agent `agent` when agents start at `start_device_id`.
pub fn select_device(acl: &Acl, start_device_id: u32, agent: u32) -> Result<i32> {
    let mut count = 0u32;
    // SAFETY: valid out-pointer.
    acl.check("aclrtGetDeviceCount", unsafe {
        (acl.api.rt.aclrtGetDeviceCount)(&mut count)
    })?;
    let requested = start_device_id + agent;
    if requested >= count {
        let hint = match std::env::var("ASCEND_RT_VISIBLE_DEVICES") {
            Ok(v) => format!(" (ASCEND_RT_VISIBLE_DEVICES={v}; ids count from 0 within that list)"),
            Err(_) => String::new(),
        };
        return Err(AscendError::NoSuchDevice {
            requested,
            start: start_device_id,
            agent,
            visible: count,
            hint,
        });
    }
    Ok(requested as i32)
}

/// The physical device behind logical `id` (for logs): the `id`-th entry of
/// `ASCEND_RT_VISIBLE_DEVICES` when set.
pub fn physical_device(id: i32) -> String {
    match std::env::var("ASCEND_RT_VISIBLE_DEVICES") {
        Ok(v) => v
            .split(',')
            .nth(id as usize)
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|| id.to_string()),
        Err(_) => id.to_string(),
    }
}

pub struct Device {
    pub acl: &'static Acl,
    pub id: i32,
    context: aclrtContext,
    stream: aclrtStream,
    /// Work may have been queued on the stream since it was last synchronized: set whenever the
    /// stream handle is taken (async copies) or an operator is launched ([`Device::queue_flag`]),
    /// cleared by [`Device::synchronize`]. Lets the owners of allocations skip the wait before
    /// freeing when nothing can still use them (one sync for a whole model's weights).
    queued: Arc<AtomicBool>,
    /// Stream synchronizations made through [`Device::synchronize`].
    syncs: AtomicU64,
    /// The failure of a synchronization made before freeing memory ([`Device::quiesce`], which
    /// cannot report it): the next [`Device::synchronize`] reports it, so that failed stream
    /// work is never taken for done.
    lost: Mutex<Option<AscendError>>,
}

// SAFETY: ACL contexts and streams may be used from any thread once the context is made current
// there (`bind`); the handles are plain identifiers owned by this value.
unsafe impl Send for Device {}
// SAFETY: `&Device` only hands its handles to ACL calls, which are thread-safe; the only state
// changed after `open` is atomics and the `lost` error behind its mutex.
unsafe impl Sync for Device {}

impl Device {
    /// Opens device `id` with a new context (made current on this thread) and stream.
    pub fn open(acl: &'static Acl, id: i32) -> Result<Device> {
        acl.log("aclrtSetDevice", || {
            format!("device {id} (physical {})", physical_device(id))
        });
        // SAFETY: plain integer argument.
        acl.check("aclrtSetDevice", unsafe { (acl.api.rt.aclrtSetDevice)(id) })?;
        let mut context = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let rc = unsafe { (acl.api.rt.aclrtCreateContext)(&mut context, id) };
        if let Err(e) = acl.check("aclrtCreateContext", rc) {
            // SAFETY: undoes the aclrtSetDevice above.
            unsafe { (acl.api.rt.aclrtResetDevice)(id) };
            return Err(e);
        }
        let mut stream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the new context is current on this thread.
        let rc = unsafe { (acl.api.rt.aclrtCreateStream)(&mut stream) };
        if let Err(e) = acl.check("aclrtCreateStream", rc) {
            // SAFETY: undoes the context and device set up above.
            unsafe {
                (acl.api.rt.aclrtDestroyContext)(context);
                (acl.api.rt.aclrtResetDevice)(id);
            }
            return Err(e);
        }
        Ok(Device {
            acl,
            id,
            context,
            stream,
            queued: Arc::new(AtomicBool::new(false)),
            syncs: AtomicU64::new(0),
            lost: Mutex::new(None),
        })
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is live (owned by self).
        self.acl.check("aclrtSetCurrentContext", unsafe {
            (self.acl.api.rt.aclrtSetCurrentContext)(self.context)
        })
    }

    /// The stream handle (counted as work queued on it: see [`Device::has_queued_work`]).
    pub fn stream(&self) -> aclrtStream {
        self.queued.store(true, Ordering::SeqCst);
        self.stream
    }

    /// The stream handle for calls that queue no work (capture begin/end).
    pub(crate) fn raw_stream(&self) -> aclrtStream {
        self.stream
    }

    /// The flag an operator runner sets before each launch on this device's stream.
    pub fn queue_flag(&self) -> Arc<AtomicBool> {
        self.queued.clone()
    }

    /// Whether work may have been queued since the last [`Device::synchronize`].
    pub fn has_queued_work(&self) -> bool {
        self.queued.load(Ordering::SeqCst)
    }

    /// Waits for the stream's queued work; its results are readable afterwards. Fails if that
    /// work failed, or if a synchronization made before freeing memory failed since the last one
    /// (see [`Device::quiesce`]).
    pub fn synchronize(&self) -> Result<()> {
        self.acl.log("aclrtSynchronizeStream", String::new);
        // Cleared before the wait: work queued meanwhile (another thread) sets it again.
        self.queued.store(false, Ordering::SeqCst);
        self.syncs.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the stream is live (owned by self).
        let r = self.acl.check("aclrtSynchronizeStream", unsafe {
            (self.acl.api.rt.aclrtSynchronizeStream)(self.stream)
        });
        if r.is_err() {
            self.queued.store(true, Ordering::SeqCst);
        }
        let lost = self.lost.lock().unwrap_or_else(|e| e.into_inner()).take();
        match lost {
            Some(e) => Err(e),
            None => r,
        }
    }

    /// Stream synchronizations so far.
    pub fn synchronizations(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Before freeing memory the stream may still use: waits for queued work, if any (with this
    /// device's context current on the calling thread, as freeing needs). A failure cannot be
    /// reported here (memory is freed on drop): it is kept for the next [`Device::synchronize`].
    pub fn quiesce(&self) {
        if self.bind().is_ok() && self.has_queued_work() {
            if let Err(e) = self.synchronize() {
                self.lost
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(e);
            }
        }
    }

    /// (free, total) bytes of device memory.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        let rc = unsafe { (self.acl.api.rt.aclrtGetMemInfo)(ACL_HBM_MEM, &mut free, &mut total) };
        self.acl.check("aclrtGetMemInfo", rc)?;
        self.acl
            .log("aclrtGetMemInfo", || format!("free {free} total {total}"));
        Ok((free, total))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let rt = &self.acl.api.rt;
        // SAFETY: the handles are owned by self and released once, in reverse order of creation.
        unsafe {
            (rt.aclrtSetCurrentContext)(self.context);
            (rt.aclrtSynchronizeStream)(self.stream);
            (rt.aclrtDestroyStream)(self.stream);
            (rt.aclrtDestroyContext)(self.context);
            (rt.aclrtResetDevice)(self.id);
        }
    }
}

//! Sleep level 1 on the Ascend backend (`Backend::offload_weights` / `restore_weights`): every
//! device allocation of a weight the backend loaded (a matrix's weight, antiquant scale and
//! offset, an expert stack's, an embedding table, a vector and its 16-bit copy) is listed here
//! when it is made, by its address cell (a `Weak`: the model owns the weight; a stack shared by
//! its experts is listed once). Offload drops the captured graphs and forgets the cached
//! executors (both name device addresses), synchronizes the stream, copies each allocation to
//! host memory (`aclrtMemcpy`, device to host), frees it (`aclrtFree`) and nulls its address;
//! restore allocates each again (`aclrtMalloc`, a new address), copies the bytes back and sets
//! the address, so the model's handles stay valid and the next calls build fresh executors.
//! Steps are refused while the weights are in host memory.
//!
//! Left on the device: a symmetric INT4 expert's grouped-call scales (`grouped_scale`, copied
//! from its scales on first use; its own allocation, still valid), rotary tables, masks and
//! scratch (not weights).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Weak;

use npu_backend::BackendError;

use super::objects::{AscendBuffer, AscendEmbedding, AscendMatrix, MatrixForm};
use super::{err, AscendBackend, NAME};
use crate::memory::{self, DeviceBuffer as Mem};

/// One allocation: its address cell, size and (offloaded) its bytes.
struct Entry {
    cell: Weak<AtomicUsize>,
    bytes: usize,
    host: Vec<u8>,
}

/// The weights' allocations, and whether they are in host memory now.
#[derive(Default)]
pub(crate) struct WeightList {
    entries: Vec<Entry>,
    /// Cell address -> entry (a stack's allocation, shared by its experts, is listed once).
    index: HashMap<usize, usize>,
    offloaded: bool,
}

impl WeightList {
    fn add(&mut self, mem: &Mem) {
        let cell = mem.cell();
        let key = cell.as_ptr() as usize;
        if let Some(&i) = self.index.get(&key) {
            if self.entries[i].cell.strong_count() > 0 {
                return;
            }
            // A dropped weight's cell address, reused: the entry is this allocation's now.
            self.entries[i] = Entry {
                cell,
                bytes: mem.bytes(),
                host: Vec::new(),
            };
            return;
        }
        self.index.insert(key, self.entries.len());
        self.entries.push(Entry {
            cell,
            bytes: mem.bytes(),
            host: Vec::new(),
        });
    }

    pub(crate) fn matrix(&mut self, m: &AscendMatrix) {
        match &m.form {
            MatrixForm::Quant {
                weight,
                scale,
                offset,
                ..
            } => {
                self.add(weight);
                self.add(scale);
                if let Some(o) = offset {
                    self.add(o);
                }
            }
            MatrixForm::Half { data } => self.add(data),
        }
        if let Some((stack, _)) = &m.stack {
            self.add(&stack.weight);
            if let Some(s) = &stack.scale {
                self.add(s);
            }
        }
    }

    pub(crate) fn embedding(&mut self, e: &AscendEmbedding) {
        self.add(&e.table);
    }

    pub(crate) fn vector(&mut self, b: &AscendBuffer) {
        self.add(&b.mem);
        if let Some(h) = &b.half {
            self.add(h);
        }
    }

    pub(crate) fn offloaded(&self) -> bool {
        self.offloaded
    }
}

impl AscendBackend {
    /// Refuses a step while the weights are in host memory.
    pub(super) fn check_awake(&self) -> Result<(), BackendError> {
        if self.weights.offloaded() {
            return Err(BackendError::BadStep(
                "the weights are in host memory (sleep level 1): wake the model first".into(),
            ));
        }
        Ok(())
    }

    pub(super) fn op_offload_weights(&mut self) -> Result<u64, BackendError> {
        if self.weights.offloaded {
            return Ok(0);
        }
        self.bind()?;
        self.drop_all_graphs()?;
        self.ops.forget();
        self.picked = None;
        self.sync()?;
        let acl = self.dev.acl;
        let w = &mut self.weights;
        // Every allocation read first: a failed copy frees nothing.
        let mut hosts = Vec::with_capacity(w.entries.len());
        for e in &w.entries {
            let Some(cell) = e.cell.upgrade() else {
                hosts.push(Vec::new());
                continue;
            };
            let mut host = vec![0u8; e.bytes];
            let ptr = cell.load(Ordering::Relaxed) as *mut core::ffi::c_void;
            memory::download_raw(acl, ptr, &mut host).map_err(err)?;
            hosts.push(host);
        }
        let mut released = 0u64;
        for (e, host) in w.entries.iter_mut().zip(hosts) {
            let Some(cell) = e.cell.upgrade() else {
                continue;
            };
            let ptr = cell.swap(0, Ordering::Relaxed) as *mut core::ffi::c_void;
            memory::free(acl, ptr);
            e.host = host;
            released += e.bytes as u64;
        }
        w.offloaded = true;
        Ok(released)
    }

    pub(super) fn op_restore_weights(&mut self) -> Result<u64, BackendError> {
        if !self.weights.offloaded {
            return Ok(0);
        }
        self.bind()?;
        let acl = self.dev.acl;
        let w = &mut self.weights;
        let mut placed = Vec::new();
        let mut failure = None;
        for (i, e) in w.entries.iter().enumerate() {
            let Some(cell) = e.cell.upgrade() else {
                continue;
            };
            match memory::alloc_copy(acl, &e.host) {
                Ok(ptr) => {
                    cell.store(ptr as usize, Ordering::Relaxed);
                    placed.push(i);
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = failure {
            for &i in &placed {
                if let Some(cell) = w.entries[i].cell.upgrade() {
                    memory::free(acl, cell.swap(0, Ordering::Relaxed) as *mut _);
                }
            }
            let bytes: usize = w.entries.iter().map(|e| e.bytes).sum();
            return Err(match e {
                crate::AscendError::Call { code, .. }
                    if code == npu_ffi::types::ACL_ERROR_RT_MEMORY_ALLOCATION =>
                {
                    BackendError::OutOfMemory {
                        backend: NAME,
                        what: "the weights, back from host memory".into(),
                        bytes,
                    }
                }
                e => err(e),
            });
        }
        let mut restored = 0u64;
        for e in &mut w.entries {
            if e.cell.strong_count() > 0 {
                restored += e.bytes as u64;
            }
            e.host = Vec::new();
        }
        w.entries.retain(|e| e.cell.strong_count() > 0);
        w.index = w
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.cell.as_ptr() as usize, i))
            .collect();
        w.offloaded = false;
        Ok(restored)
    }
}

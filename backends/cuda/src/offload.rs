//! Sleep level 1 on the CUDA backend (`Backend::offload_weights` / `restore_weights`): every
//! weight the backend loaded (matrices, experts, embedding tables, vectors) is listed here when
//! it is made, by its `DeviceMem`'s address cell (a `Weak`: the model owns the weight). Offload
//! reads each one to host memory (`Gpu::read`: cuMemcpyDtoHAsync into the pinned staging buffer
//! on a GPU), then frees its device memory and sets its address to 0; restore allocates it again
//! (a new address), copies the bytes back (`Gpu::htod`) and sets the address, so the model's
//! handles stay valid. Nothing else keeps a weight's address beyond a step except captured
//! graphs (dropped here; the device marks them stale on the frees anyway) and the backend's
//! derived tables (rope factors, the GELU table: freed, uploaded again on first use); the MoE
//! experts' address table is built per step. Steps are refused while the weights are in host
//! memory (`check_awake`). On a GPU the frees are stream-ordered (`cuMemFreeAsync` into the
//! device's default pool, whose release threshold this backend leaves at 0): the memory goes
//! back to the device at the synchronization that ends the offload.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Weak;

use npu_backend::BackendError;

use crate::backend::{CudaBackend, NAME};
use crate::buffer::DeviceMem;

/// One weight's allocation: its address cell, size, and (offloaded) its bytes.
struct Entry {
    cell: Weak<AtomicU64>,
    bytes: usize,
    host: Vec<u8>,
}

/// The weights the backend loaded, and whether they are in host memory now.
#[derive(Default)]
pub(crate) struct WeightList {
    entries: Vec<Entry>,
    offloaded: bool,
}

impl WeightList {
    /// Lists a weight's memory (dropped weights' entries are pruned as new ones come).
    pub(crate) fn add(&mut self, mem: &DeviceMem) {
        if mem.bytes() == 0 {
            return;
        }
        if self.entries.len() >= 64 && self.entries.len().is_power_of_two() {
            self.entries.retain(|e| e.cell.strong_count() > 0);
        }
        self.entries.push(Entry {
            cell: mem.cell(),
            bytes: mem.bytes(),
            host: Vec::new(),
        });
    }

    pub(crate) fn offloaded(&self) -> bool {
        self.offloaded
    }
}

impl CudaBackend {
    /// Refuses a step while the weights are in host memory.
    pub(crate) fn check_awake(&self) -> Result<(), BackendError> {
        if self.weights.offloaded() {
            return Err(BackendError::BadStep(
                "the weights are in host memory (sleep level 1): wake the model first".into(),
            ));
        }
        Ok(())
    }

    pub(crate) fn op_offload_weights(&mut self) -> Result<u64, BackendError> {
        if self.weights.offloaded {
            return Ok(0);
        }
        self.graph_drop_all()?;
        self.weights.entries.retain(|e| e.cell.strong_count() > 0);
        // Every weight read first: a failed read frees nothing.
        let mut hosts = Vec::with_capacity(self.weights.entries.len());
        for e in &self.weights.entries {
            let Some(cell) = e.cell.upgrade() else {
                hosts.push(Vec::new());
                continue;
            };
            let mut host = Vec::with_capacity(e.bytes);
            self.gpu
                .read(&[(cell.load(Ordering::Relaxed), e.bytes)], &mut host)?;
            hosts.push(host);
        }
        let mut released = 0u64;
        for (e, host) in self.weights.entries.iter_mut().zip(hosts) {
            let Some(cell) = e.cell.upgrade() else {
                continue;
            };
            let ptr = cell.swap(0, Ordering::Relaxed);
            self.gpu.free(ptr, e.bytes);
            e.host = host;
            released += e.bytes as u64;
        }
        // Derived tables and work areas: made again on first use.
        released += self.release_derived();
        self.q8_ready = None;
        self.weights.offloaded = true;
        self.gpu.synchronize()?;
        Ok(released)
    }

    /// Frees the device memory the backend derived from weights or grew for steps (rope factor
    /// and GELU tables, scratch areas): each is made again when a step needs it. Its bytes.
    fn release_derived(&mut self) -> u64 {
        let mut bytes: usize = self.rope_factors.tables.iter().map(DeviceMem::bytes).sum();
        self.rope_factors = Default::default();
        bytes += self.gelu_table.take().map_or(0, |m| m.bytes());
        for s in [
            &mut self.scratch_w,
            &mut self.scratch_x,
            &mut self.scratch_attn,
        ] {
            bytes += s.release();
        }
        bytes as u64
    }

    pub(crate) fn op_restore_weights(&mut self) -> Result<u64, BackendError> {
        if !self.weights.offloaded {
            return Ok(0);
        }
        // Allocate and copy each; on a failure free what was placed and stay offloaded.
        let mut placed: Vec<usize> = Vec::new();
        let mut failure = None;
        for (i, e) in self.weights.entries.iter().enumerate() {
            let Some(cell) = e.cell.upgrade() else {
                continue;
            };
            let ptr = match self.gpu.alloc(e.bytes) {
                Ok(p) => p,
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            };
            if let Err(err) = self.gpu.htod(ptr, &e.host) {
                self.gpu.free(ptr, e.bytes);
                failure = Some(err);
                break;
            }
            cell.store(ptr, Ordering::Relaxed);
            placed.push(i);
        }
        if let Some(err) = failure {
            for &i in &placed {
                let e = &self.weights.entries[i];
                if let Some(cell) = e.cell.upgrade() {
                    self.gpu.free(cell.swap(0, Ordering::Relaxed), e.bytes);
                }
            }
            return Err(match err {
                BackendError::OutOfMemory { bytes, .. } => BackendError::OutOfMemory {
                    backend: NAME,
                    what: "the weights, back from host memory".into(),
                    bytes,
                },
                e => e,
            });
        }
        // The copies read the host bytes before `synchronize` returns; then they can go.
        self.gpu.synchronize()?;
        let mut restored = 0u64;
        for e in &mut self.weights.entries {
            if e.cell.strong_count() > 0 {
                restored += e.bytes as u64;
            }
            e.host = Vec::new();
        }
        self.weights.offloaded = false;
        self.device_wrote();
        Ok(restored)
    }
}

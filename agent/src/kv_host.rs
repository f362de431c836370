//! The agent's host KV pool: `swap_space_mb` of host memory cut into blocks of the device pool's
//! block size, the KV block copies of a step plan between it and the device pool (done in plan
//! order before the step's compute), and the measurement of block copy bandwidth at start.
//!
//! On the CPU backend the "device" pool is host memory too, so the pool is plain memory; a
//! backend whose copies need page-locked memory reports it in `KvFacts::host_page_locked`.

use std::time::Instant;

use npu_protocol::shm::HandoffRegion;
use npu_protocol::{CopyDirection, KvCopy};

use crate::device::DeviceModel;
use crate::engine::EngineError;

/// Host memory for KV blocks, `blocks` of `block_bytes` each.
pub struct HostKvPool {
    data: Vec<u8>,
    block_bytes: usize,
    blocks: u32,
}

/// What the copies of one step moved, and how long they took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyTotals {
    pub to_host_bytes: u64,
    pub to_device_bytes: u64,
    /// KV bytes copied into the handoff region, and out of it.
    pub handed_out_bytes: u64,
    pub taken_in_bytes: u64,
    pub micros: u64,
}

impl HostKvPool {
    /// A pool of `blocks` blocks; the allocation failing is an error naming the setting.
    pub fn new(blocks: u32, block_bytes: usize) -> Result<Self, EngineError> {
        let bytes = (blocks as usize).checked_mul(block_bytes).ok_or_else(|| {
            EngineError::BadConfig(format!(
                "swap_space_mb: {blocks} host KV blocks of {block_bytes} bytes overflow"
            ))
        })?;
        let mut data = Vec::new();
        data.try_reserve_exact(bytes).map_err(|_| {
            EngineError::BadConfig(format!(
                "swap_space_mb: cannot allocate {bytes} bytes of host KV memory"
            ))
        })?;
        data.resize(bytes, 0);
        Ok(Self {
            data,
            block_bytes,
            blocks,
        })
    }

    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Runs `copies` in order; those of the handoff directions go through `handoff` (the
    /// region shared with the other agents). Every id is checked first, so a bad plan copies
    /// nothing.
    pub fn run(
        &mut self,
        model: &mut DeviceModel,
        copies: &[KvCopy],
        device_blocks: u32,
        mut handoff: Option<&mut HandoffRegion>,
    ) -> Result<CopyTotals, EngineError> {
        let bb = self.block_bytes;
        let handoff_blocks = handoff.as_ref().map_or(0, |h| h.blocks(bb as u64));
        for (i, c) in copies.iter().enumerate() {
            let (what, limit) = if c.is_handoff() {
                ("handoff", handoff_blocks)
            } else {
                ("host", self.blocks)
            };
            if c.device_block >= device_blocks || c.host_block >= limit {
                return Err(EngineError::BadPlan(format!(
                    "KV copy {i}: device block {} of {device_blocks}, {what} block {} of {limit}",
                    c.device_block, c.host_block
                )));
            }
        }
        let start = Instant::now();
        let mut totals = CopyTotals::default();
        for c in copies {
            if c.is_handoff() {
                let region = handoff.as_deref_mut().ok_or_else(|| {
                    EngineError::BadPlan("a handoff copy, but no handoff region".into())
                })?;
                let block = region
                    .block_mut(c.host_block, bb)
                    .map_err(|e| EngineError::BadPlan(e.to_string()))?;
                if c.direction == CopyDirection::DeviceToHandoff {
                    model
                        .kv_to_host(&[c.device_block], block)
                        .map_err(model_err)?;
                    totals.handed_out_bytes += bb as u64;
                } else {
                    model
                        .kv_from_host(block, &[c.device_block])
                        .map_err(model_err)?;
                    totals.taken_in_bytes += bb as u64;
                }
                continue;
            }
            let h = c.host_block as usize * bb;
            let host = &mut self.data[h..h + bb];
            match c.direction {
                CopyDirection::DeviceToHost => {
                    model
                        .kv_to_host(&[c.device_block], host)
                        .map_err(model_err)?;
                    totals.to_host_bytes += bb as u64;
                }
                CopyDirection::HostToDevice => {
                    model
                        .kv_from_host(host, &[c.device_block])
                        .map_err(model_err)?;
                    totals.to_device_bytes += bb as u64;
                }
                CopyDirection::DeviceToHandoff | CopyDirection::HandoffToDevice => {}
            }
        }
        totals.micros = start.elapsed().as_micros() as u64;
        Ok(totals)
    }
}

fn model_err(e: npu_backend::BackendError) -> EngineError {
    EngineError::Model(e.into())
}

/// Block copy bandwidth, bytes per second: (device->host, host->device).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CopyBandwidth {
    pub d2h_bytes_per_s: f64,
    pub h2d_bytes_per_s: f64,
}

/// Measures whole-block copies between the device pool and host memory, one block per call as
/// the step copies do: the first `blocks` blocks out and back in, best of five rounds. The
/// blocks are written back with the bytes read from them, so the pool is unchanged.
pub fn measure_copy_bandwidth(
    model: &mut DeviceModel,
    blocks: u32,
) -> Result<CopyBandwidth, EngineError> {
    let bb = model.kv_block_bytes();
    let n = blocks as usize;
    if bb == 0 || n == 0 {
        return Ok(CopyBandwidth::default());
    }
    let mut host = vec![0u8; n * bb];
    let (mut best_out, mut best_in) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..5 {
        let t = Instant::now();
        for (b, dst) in host.chunks_exact_mut(bb).enumerate() {
            model.kv_to_host(&[b as u32], dst).map_err(model_err)?;
        }
        best_out = best_out.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for (b, src) in host.chunks_exact(bb).enumerate() {
            model.kv_from_host(src, &[b as u32]).map_err(model_err)?;
        }
        best_in = best_in.min(t.elapsed().as_secs_f64());
    }
    let bytes = (n * bb) as f64;
    let rate = |secs: f64| bytes / secs.max(1e-9);
    Ok(CopyBandwidth {
        d2h_bytes_per_s: rate(best_out),
        h2d_bytes_per_s: rate(best_in),
    })
}

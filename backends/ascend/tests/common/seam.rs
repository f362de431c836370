//! Helpers for the tests that drive `AscendBackend` through the device seam: one test at a
//! time on the shared emulated device, buffers up and down, KV specs, step inputs, RMSNorm's
//! reference.

use std::sync::{Mutex, MutexGuard};

use npu_backend::*;
use npu_backend_ascend::backend::AscendBuffer;
use npu_backend_ascend::{AscendBackend, AscendConfig};

use super::acl;

pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn backend(cfg: AscendConfig) -> AscendBackend {
    AscendBackend::with_runtime(acl(), cfg).expect("the emulated device opens")
}

pub fn default_backend() -> AscendBackend {
    backend(AscendConfig::default())
}

/// A zeroed f16 buffer holding `v` in its first rows.
pub fn up(b: &mut AscendBackend, v: &[f32], cols: usize) -> AscendBuffer {
    let mut buf = b.alloc(DType::F16, v.len()).unwrap();
    b.upload(
        HostSlice::F32(v),
        ViewMut::rows(&mut buf, v.len() / cols, cols).unwrap(),
    )
    .unwrap();
    buf
}

pub fn down(b: &mut AscendBackend, buf: &AscendBuffer, layout: Layout) -> Vec<f32> {
    let mut out = vec![0f32; layout.elements()];
    b.read_back(&mut [Readback {
        src: View::new(buf, layout).unwrap(),
        dst: HostSliceMut::F32(&mut out),
    }])
    .unwrap();
    out
}

pub fn kv_spec(block_size: usize, num_blocks: usize) -> KvSpec {
    KvSpec {
        n_layers: 2,
        num_blocks,
        block_size,
        n_kv_heads: 2,
        head_dim: 16,
    }
}

/// A step of sequences `(start_pos, n_new, blocks)`, every sequence sampled.
pub fn step_of(seqs: &[(u32, u32, Vec<u32>)], block_size: u32, tokens: &[u32]) -> StepInputs {
    let max_blocks = seqs.iter().map(|s| s.2.len()).max().unwrap();
    let mut s = StepInputs {
        max_blocks,
        ..Default::default()
    };
    let mut row = 0u32;
    for (start, n, blocks) in seqs {
        s.seqs.push(SeqSpan {
            q_row: row,
            n_q: *n,
            start_pos: *start,
        });
        s.block_tables
            .extend((0..max_blocks).map(|i| *blocks.get(i).unwrap_or(&0)));
        for j in 0..*n {
            let pos = start + j;
            s.tokens.push(tokens[(row + j) as usize % tokens.len()]);
            s.positions.push(pos);
            s.slot_mapping
                .push(blocks[(pos / block_size) as usize] * block_size + pos % block_size);
        }
        row += n;
        s.logit_rows.push(row - 1);
    }
    s
}

pub fn rms_ref(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    x.chunks(n)
        .flat_map(|r| {
            let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f32>() / n as f32 + eps).sqrt();
            r.iter().zip(w).map(move |(v, g)| v * inv * g)
        })
        .collect()
}

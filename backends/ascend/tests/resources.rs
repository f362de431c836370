//! How the backend spends synchronizations and pinned memory: dropping weights waits for the
//! stream only when work was queued since its last synchronization (once for many drops, and
//! never before a free that queued work could still read — the emulation refuses such a free),
//! and staging buffers for asynchronous copies come from a small pool instead of a fresh
//! `aclrtMallocHost` whenever the last one is still being read.

mod common;

use common::seam::*;
use common::*;
use npu_backend::*;
use npu_gguf::GgmlType;

#[test]
fn dropping_many_weights_waits_for_the_stream_at_most_once() {
    let _g = serial();
    {
        let mut b = default_backend();
        let d = 64usize;
        let bytes: Vec<u8> = rand_vec(91, d, 1.0)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let vector = |b: &mut npu_backend_ascend::AscendBackend| {
            b.load_vector(HostTensor {
                ty: GgmlType::F32,
                data: &bytes,
                rows: 1,
                cols: d,
            })
            .unwrap()
        };
        let (qd, _) = q4_1_rows(92, d, d);
        let matrix = |b: &mut npu_backend_ascend::AscendBackend| {
            b.load_matrix(&[HostTensor {
                ty: GgmlType::Q4_1,
                data: &qd,
                rows: d,
                cols: d,
            }])
            .unwrap()
            .unwrap()
        };
        let vectors: Vec<_> = (0..40).map(|_| vector(&mut b)).collect();
        let matrices: Vec<_> = (0..10).map(|_| matrix(&mut b)).collect();
        b.synchronize().unwrap();
        let before = b.device().synchronizations();
        drop(vectors);
        drop(matrices);
        assert_eq!(
            b.device().synchronizations(),
            before,
            "nothing was queued: no waits"
        );

        // Work queued that reads one of the weights: the first drop waits, the rest do not.
        let x = up(&mut b, &h(&rand_vec(93, 2 * d, 1.0)), d);
        let mut y = b.alloc(DType::F16, 2 * d).unwrap();
        b.synchronize().unwrap();
        let used = matrix(&mut b);
        let others: Vec<_> = (0..20).map(|_| vector(&mut b)).collect();
        b.matmul(
            View::rows(&x, 2, d).unwrap(),
            &used,
            ViewMut::rows(&mut y, 2, d).unwrap(),
        )
        .unwrap();
        assert!(b.device().has_queued_work());
        let before = b.device().synchronizations();
        drop(used);
        drop(others);
        assert_eq!(b.device().synchronizations(), before + 1);
        assert!(!b.device().has_queued_work());
        // The product was computed before its weight went.
        assert!(down(&mut b, &y, Layout::contiguous(2, d))
            .iter()
            .any(|&v| v != 0.0));
    }
    // Every free succeeded (a free refused for pending work would leave its allocation alive).
    assert!(leak_report().is_empty(), "{}", leak_report());
}

#[test]
fn kv_swaps_during_steps_reuse_pooled_staging_memory() {
    let _g = serial();
    let mut b = default_backend();
    b.init_kv(kv_spec(16, 8)).unwrap();
    let bb = b.kv_block_bytes();
    let blocks = vec![0x5au8; 2 * bb];
    let mut counts = Vec::new();
    for i in 0..5u32 {
        // The step's inputs go up through staging memory (still read until the step's sync),
        // then KV blocks are swapped in mid-step through another buffer.
        b.begin_step(&step_of(&[(0, 1, vec![i % 4])], 16, &[1]))
            .unwrap();
        b.kv_blocks_from_host(&blocks, &[4, 5]).unwrap();
        b.synchronize().unwrap();
        counts.push(b.pinned_allocations());
    }
    // One buffer for the step's inputs, one for the blocks.
    assert_eq!(counts[0], 2, "{counts:?}");
    assert!(
        counts.iter().all(|&c| c == counts[0]),
        "pinned allocations after each step: {counts:?}"
    );
    let mut back = vec![0u8; 2 * bb];
    b.kv_blocks_to_host(&[4, 5], &mut back).unwrap();
    assert_eq!(back, blocks);
    assert_eq!(
        b.pinned_allocations(),
        counts[0],
        "reads back through the pool too"
    );
}

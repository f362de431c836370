//! ACL graph capture through the backend's wrappers (`npu_backend_ascend::graph`) on the CANN
//! emulation: operators launched by an `OpRunner` between `capture_begin` and `capture_end` are
//! recorded, not run; a synchronization (read back) inside is refused with the documented
//! status; replays after async copies of new inputs into the same buffers give the eager
//! results, with the same workspace and no first phase.

mod common;

use common::*;
use npu_backend_ascend::memory::PinnedBuffer;
use npu_backend_ascend::ops::OpRunner;
use npu_backend_ascend::tensor::DType;
use npu_backend_ascend::AscendError;
use npu_ffi::types::*;

#[test]
fn a_captured_sequence_replays_with_new_inputs_at_the_same_addresses() {
    let dev = device();
    assert!(npu_backend_ascend::graph::available(dev.acl));
    let mut ops = OpRunner::new(&dev);
    const N: usize = 256;
    let mut x = zeros(N * 2);
    let y = upload_f16(&rand_vec(2, N, 1.0));
    let z = zeros(N * 2);
    let (tx, ty, tz) = (
        t(&x, DType::F16, &[1, N as i64]),
        t(&y, DType::F16, &[1, N as i64]),
        t(&z, DType::F16, &[1, N as i64]),
    );
    let yv = read_f16(&y, N);
    let step = |ops: &mut OpRunner| -> Result<(), AscendError> {
        ops.add(&tx, &ty, 1.0, &tz)?;
        ops.inplace_add(&tz, &ty)
    };
    let mut pinned = PinnedBuffer::alloc(dev.acl, N * 2).unwrap();
    let mut write_x = |x: &mut npu_backend_ascend::memory::DeviceBuffer, seed: u64| {
        let v = h(&rand_vec(seed, N, 1.0));
        pinned.as_mut_slice().copy_from_slice(&f16_bytes(&v));
        x.upload_async(0, &pinned, 0, N * 2, &dev).unwrap();
        v
    };
    // Eager first (the runner's workspace and executors as a decode step leaves them).
    let xv = write_x(&mut x, 1);
    step(&mut ops).unwrap();
    dev.synchronize().unwrap();
    let want: Vec<f32> = xv
        .iter()
        .zip(&yv)
        .map(|(a, b)| h(&[h(&[a + b])[0] + b])[0])
        .collect();
    assert_close(&read_f16(&z, N), &want, 0.0, "eager");

    // Capture (new inputs queued first): recorded, not run; a synchronization inside is refused.
    write_x(&mut x, 2);
    dev.capture_begin().unwrap();
    step(&mut ops).unwrap();
    match dev.synchronize() {
        Err(AscendError::Call { code, message, .. }) => {
            assert_eq!(code, ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT, "{message}")
        }
        other => panic!("a synchronization inside a capture: {other:?}"),
    }
    let mut graph = dev.capture_end().unwrap();
    dev.synchronize().unwrap();
    assert_close(&read_f16(&z, N), &want, 0.0, "nothing ran at capture");

    // Replays: inputs copied into the captured addresses first, one call each.
    ops.take_stats();
    for seed in 3..6 {
        let xv = write_x(&mut x, seed);
        graph.replay(&dev).unwrap();
        dev.synchronize().unwrap();
        let want: Vec<f32> = xv
            .iter()
            .zip(&yv)
            .map(|(a, b)| h(&[h(&[a + b])[0] + b])[0])
            .collect();
        assert_close(&read_f16(&z, N), &want, 0.0, "replay");
    }
    let after = ops.take_stats();
    assert_eq!(
        (after.prepares, after.launches),
        (0, 0),
        "a replay makes no aclnn call"
    );
    assert_eq!(graph.replays(), 3);
    drop(graph);
    drop((tx, ty, tz));
    assert!(!leak_report().contains("aclmdlRI"), "{}", leak_report());
}

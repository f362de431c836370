//! Unit tests of the CUDA emulation: what it refuses as a device would, and queued work run in order at synchronization (a read that skips it sees stale bytes).

use super::*;
use crate::kernels::{op_kernel, Op};

fn gpu() -> Option<EmuGpu> {
    match EmuGpu::new() {
        Ok(g) => Some(g),
        Err(e) if e.to_string().contains("could not run the C++ compiler") => {
            eprintln!("SKIPPED (no C++ compiler for the CUDA emulation): {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn add_args(x: u64, y: u64, cols: i32) -> Args {
    Args::new().ptr(x).i32(cols).ptr(y).i32(cols).i32(cols)
}

#[test]
fn the_emulation_refuses_what_a_device_would() {
    let Some(g) = gpu() else { return };
    let k = op_kernel(Op::Add, DType::F32);
    let x = g.alloc(64).unwrap();
    let y = g.alloc(256).unwrap();
    let ones: Vec<u8> = (0..64).flat_map(|_| 1f32.to_le_bytes()).collect();
    g.htod(y, &ones).unwrap();
    let dims = LaunchDims::linear([1, 1, 1], 32);
    // A good launch: 16 floats.
    g.launch(k, dims, &mut add_args(x, y, 16)).unwrap();
    // A missing parameter, and an i64 where the kernel takes an int.
    let e = g
        .launch(k, dims, &mut Args::new().ptr(x).i32(16).ptr(y).i32(16))
        .unwrap_err();
    assert!(e.to_string().contains("parameters of sizes"), "{e}");
    let e = g
        .launch(
            k,
            dims,
            &mut Args::new().ptr(x).i64(16).ptr(y).i32(16).i32(16),
        )
        .unwrap_err();
    assert!(e.to_string().contains("parameters of sizes"), "{e}");
    // A pointer that is not device memory.
    let host = [0f32; 16];
    let e = g
        .launch(k, dims, &mut add_args(host.as_ptr() as u64, y, 16))
        .unwrap_err();
    assert!(e.to_string().contains("not device memory"), "{e}");
    // Bad launch shapes, too much shared memory, copies outside an allocation.
    let e = g
        .launch(
            k,
            LaunchDims::linear([1, 1, 1], 2048),
            &mut add_args(y, y, 16),
        )
        .unwrap_err();
    assert!(e.to_string().contains("invalid launch"), "{e}");
    let e = g
        .launch(
            k,
            LaunchDims {
                smem: MAX_SMEM + 1,
                ..dims
            },
            &mut add_args(y, y, 16),
        )
        .unwrap_err();
    assert!(e.to_string().contains("shared memory"), "{e}");
    assert!(g.htod(y + 250, &[0u8; 8]).is_err());
    assert!(g.dtod(x, y, 65).is_err());
    let mut out = Vec::new();
    assert!(g.read(&[(y + 256, 1)], &mut out).is_err());
    // cuBLAS's leading-dimension rule.
    let e = g
        .gemm(&Gemm {
            m: 2,
            n: 2,
            k: 4,
            a: y,
            lda: 3,
            b: y,
            ldb: 4,
            c: y,
            ldc: 2,
            ab_type: DType::F32,
            c_type: DType::F32,
        })
        .unwrap_err();
    assert!(e.to_string().contains("INVALID_VALUE"), "{e}");
    g.free(y, 256);
    assert_eq!(g.live_allocations(), 1);
    // Work queued after the free may not name the freed memory.
    let e = g
        .launch(k, dims, &mut add_args(x, y, 16))
        .unwrap_err()
        .to_string();
    assert!(e.contains("already freed"), "{e}");
    assert!(g
        .dtod(x, y, 16)
        .unwrap_err()
        .to_string()
        .contains("already freed"));
    g.synchronize().unwrap();
    // Writing 32 floats into a 64-byte allocation is caught — when the stream runs it, as a
    // device reports a fault at a later synchronization — and, as a device fault on a GPU,
    // leaves the context unusable: every later call says so, naming the first fault.
    g.launch(k, dims, &mut add_args(x, x, 32)).unwrap();
    let e = g.synchronize().unwrap_err();
    assert!(e.to_string().contains("wrote past the end"), "{e}");
    assert!(e.to_string().contains("add_f32 grid [1, 1, 1]"), "{e}");
    for e in [
        g.synchronize().unwrap_err(),
        g.htod(x, &[0u8; 4]).unwrap_err(),
        g.launch(k, dims, &mut add_args(x, x, 16)).unwrap_err(),
        g.alloc(64).unwrap_err(),
    ] {
        let e = e.to_string();
        assert!(
            e.contains("unusable") && e.contains("wrote past the end"),
            "{e}"
        );
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Queued work runs when the stream is synchronized, in queue order: copies, launches and
/// frees wait in the queue, a read synchronizes before it copies, and a free leaves the
/// memory to the work queued before it.
#[test]
fn the_stream_runs_its_work_in_order_when_synchronized() {
    let Some(g) = gpu() else { return };
    let k = op_kernel(Op::Add, DType::F32);
    let dims = LaunchDims::linear([1, 1, 1], 32);
    let (x, y) = (g.alloc(64).unwrap(), g.alloc(64).unwrap());
    g.htod(x, &f32s(&[1.0; 16])).unwrap();
    g.htod(y, &f32s(&[2.0; 16])).unwrap();
    g.launch(k, dims, &mut add_args(x, y, 16)).unwrap();
    // y is freed before the launch that reads it has run: the launch still sees it.
    g.free(y, 64);
    assert!(g.queued() >= 4, "{} units queued", g.queued());
    let mut out = Vec::new();
    g.read(&[(x, 64)], &mut out).unwrap();
    assert_eq!(floats(&out), vec![3.0; 16]);
    assert_eq!(g.queued(), 0);
    // A read waits for every queued op, in order: the copy of 5s runs after the launch.
    g.launch(k, dims, &mut add_args(x, x, 16)).unwrap();
    g.htod(x, &f32s(&[5.0; 16])).unwrap();
    g.read(&[(x, 8)], &mut out).unwrap();
    assert_eq!(floats(&out), vec![5.0; 2]);
    g.free(x, 64);
    g.synchronize().unwrap();
    assert_eq!(g.live_allocations(), 0);
}

/// Uploads larger than a staging buffer go through the ring piece by piece; each piece's
/// buffer is rewritten only after the event of its previous copy, so every byte arrives
/// although the copies run late.
#[test]
fn uploads_through_the_ring_arrive_whole_although_copies_run_late() {
    let Some(g) = gpu() else { return };
    let n = 2 * STAGE_BYTES + 12345;
    let p = g.alloc(n).unwrap();
    let src: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
    g.htod(p, &src).unwrap();
    // The source may be reused at once.
    let small = vec![7u8; 100];
    g.htod(p + 1000, &small).unwrap();
    let mut out = Vec::new();
    g.read(&[(p, n)], &mut out).unwrap();
    let mut want = src.clone();
    want[1000..1100].fill(7);
    assert!(out == want, "the upload arrived damaged");
    g.free(p, n);
}

/// The deliberately wrong read of the faulty-backend test: without its synchronization a
/// read returns what the pinned buffer held (poison at first, then an older read's bytes).
#[test]
fn a_read_that_skips_its_synchronization_sees_stale_bytes() {
    let Some(g) = gpu() else { return };
    let p = g.alloc(64).unwrap();
    g.htod(p, &f32s(&[4.0; 16])).unwrap();
    g.skip_read_synchronization(true);
    let mut out = Vec::new();
    g.read(&[(p, 64)], &mut out).unwrap();
    assert!(
        floats(&out).iter().all(|v| v.is_nan()),
        "{:?}",
        floats(&out)
    );
    g.skip_read_synchronization(false);
    g.read(&[(p, 64)], &mut out).unwrap();
    assert_eq!(floats(&out), vec![4.0; 16]);
    g.free(p, 64);
}

/// The tiled tensor-core GEMM's `cp.async` copies 16 bytes between 16-byte aligned addresses;
/// the emulation copies them at once and refuses a misaligned address as the PTX ISA does.
#[test]
fn a_misaligned_cp_async_fails_the_launch() {
    let Some(g) = gpu() else { return };
    let k =
        crate::kernels::gemm_tiled_kernel(crate::kernels::WeightFormat::Q8_0, DType::F32).unwrap();
    // 8 outputs, k = 64 (2 blocks), 2 rows: Q8_0 quants, f16 scales, 8-bit rows, scale words.
    let (n, kk, rows) = (8usize, 64usize, 2usize);
    let bufs = [
        n * kk,
        n * 2 * 2,
        rows * kk + 16,
        rows * 2 * 16,
        rows * n * 4,
    ];
    let p: Vec<DevPtr> = bufs.iter().map(|&b| g.alloc(b).unwrap()).collect();
    for (&q, &b) in p.iter().zip(&bufs) {
        g.htod(q, &vec![0u8; b]).unwrap();
    }
    let args = |xq: DevPtr| {
        Args::new()
            .ptr(p[0])
            .ptr(p[1])
            .ptr(p[1])
            .i32(n as i32)
            .i32(kk as i32)
            .ptr(xq)
            .ptr(p[3])
            .i32(rows as i32)
            .ptr(p[4])
            .i32(n as i32)
    };
    let dims = LaunchDims::linear([1, 1, 1], 256);
    g.launch(k, dims, &mut args(p[2])).unwrap();
    g.synchronize().unwrap();
    let e = match g.launch(k, dims, &mut args(p[2] + 4)) {
        Err(e) => e,
        Ok(()) => g.synchronize().unwrap_err(),
    };
    assert!(e.to_string().contains("cp.async of 16 bytes"), "{e}");
}

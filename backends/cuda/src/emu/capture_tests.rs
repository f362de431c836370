//! Unit tests of the emulated stream capture: recorded work does not run, replay runs it with
//! its recorded parameters against memory as it is then, and what CUDA forbids while capturing
//! fails and invalidates the capture.

use super::super::*;
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

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn read(g: &EmuGpu, p: DevPtr, n: usize) -> Vec<f32> {
    let mut out = Vec::new();
    g.read(&[(p, 4 * n)], &mut out).unwrap();
    floats(&out)
}

#[test]
fn recorded_work_runs_only_when_replayed_against_current_memory() {
    let Some(g) = gpu() else { return };
    let k = op_kernel(Op::Add, DType::F32);
    let dims = LaunchDims::linear([1, 1, 1], 32);
    let (x, y) = (g.alloc(64).unwrap(), g.alloc(64).unwrap());
    g.htod(y, &f32s(&[1.0; 16])).unwrap();
    g.synchronize().unwrap();
    g.capture_begin().unwrap();
    assert!(g.capturing());
    g.launch(k, dims, &mut add_args(x, y, 16)).unwrap();
    g.dtod(y, x, 64).unwrap();
    let id = g.capture_end().unwrap();
    assert!(!g.capturing());
    // Nothing of it ran.
    assert_eq!(read(&g, x, 16), vec![0.0; 16]);
    assert_eq!(read(&g, y, 16), vec![1.0; 16]);
    // x += y; y = x.
    g.replay(id).unwrap();
    assert_eq!(read(&g, x, 16), vec![1.0; 16]);
    g.replay(id).unwrap();
    assert_eq!(read(&g, x, 16), vec![2.0; 16]);
    // Memory written since is what the next replay reads.
    g.htod(y, &f32s(&[10.0; 16])).unwrap();
    g.replay(id).unwrap();
    assert_eq!(read(&g, x, 16), vec![12.0; 16]);
    assert_eq!(g.graph_counts(), (1, 3));
    g.destroy_graph(id);
    assert!(g.replay(id).is_err());
    assert_eq!(g.graph_counts().0, 0);
}

/// Each call CUDA refuses on a capturing stream (or this seam refuses for the backend's sake)
/// fails, and the capture is invalidated: later captured work and the end of the capture fail
/// too, and no graph is made.
#[test]
fn forbidden_calls_fail_and_invalidate_the_capture() {
    let Some(g) = gpu() else { return };
    let k = op_kernel(Op::Add, DType::F32);
    let dims = LaunchDims::linear([1, 1, 1], 32);
    let x = g.alloc(64).unwrap();
    type Call<'a> = Box<dyn Fn(&EmuGpu) -> Option<String> + 'a>;
    let calls: Vec<(&str, Call)> = vec![
        (
            "cuStreamSynchronize",
            Box::new(|g| g.synchronize().err().map(|e| e.to_string())),
        ),
        (
            "a read back",
            Box::new(|g| {
                let mut out = Vec::new();
                g.read(&[(x, 4)], &mut out).err().map(|e| e.to_string())
            }),
        ),
        (
            "cuMemAllocAsync",
            Box::new(|g| g.alloc(64).err().map(|e| e.to_string())),
        ),
    ];
    for (what, call) in calls {
        g.capture_begin().unwrap();
        g.launch(k, dims, &mut add_args(x, x, 16)).unwrap();
        let e = call(&g).unwrap_or_else(|| panic!("{what} inside a capture was allowed"));
        assert!(e.contains("CAPTURE_UNSUPPORTED"), "{what}: {e}");
        let e = g
            .launch(k, dims, &mut add_args(x, x, 16))
            .unwrap_err()
            .to_string();
        assert!(e.contains("INVALIDATED"), "{what}: {e}");
        let e = g.capture_end().unwrap_err().to_string();
        assert!(e.contains("INVALIDATED"), "{what}: {e}");
        assert!(!g.capturing());
    }
    // A free inside a capture: refused (the capture invalid), the memory freed at its end.
    let y = g.alloc(64).unwrap();
    let live = g.live_allocations();
    g.capture_begin().unwrap();
    g.free(y, 64);
    assert_eq!(g.live_allocations(), live, "not freed while capturing");
    let e = g.capture_end().unwrap_err().to_string();
    assert!(
        e.contains("cuMemFreeAsync") && e.contains("INVALIDATED"),
        "{e}"
    );
    assert_eq!(g.live_allocations(), live - 1);
    // Ending the capture from another thread (thread-local mode).
    g.capture_begin().unwrap();
    let e = std::thread::scope(|s| s.spawn(|| g.capture_end().unwrap_err().to_string()).join())
        .unwrap();
    assert!(e.contains("WRONG_THREAD"), "{e}");
    g.capture_abort();
    assert!(!g.capturing());
    // Nothing ran of the invalid captures' launches (x + x of zeros is zeros anyway: check
    // the stream is usable and empty of them).
    assert_eq!(read(&g, x, 16), vec![0.0; 16]);
    assert_eq!(g.graph_counts(), (0, 0));
}

/// A host→device copy captured from a pinned staging buffer reads that buffer when the replay
/// runs, not what it held at the capture; its staging event, recorded inside the capture, can
/// never be waited for, so the ring's next wait on that buffer fails.
#[test]
fn a_captured_staging_copy_reads_the_pinned_buffer_at_replay() {
    let Some(g) = gpu() else { return };
    let x = g.alloc(64).unwrap();
    g.synchronize().unwrap();
    g.capture_begin().unwrap();
    g.htod(x, &f32s(&[1.0; 16])).unwrap();
    let id = g.capture_end().unwrap();
    assert_eq!(read(&g, x, 16), vec![0.0; 16], "recorded, not run");
    g.replay(id).unwrap();
    assert_eq!(read(&g, x, 16), vec![1.0; 16]);
    // The ring fills its buffers again (the next uploads, after the read drained it): the
    // replay copies what they hold now, not the 1s of the capture.
    let z = g.alloc(64).unwrap();
    for _ in 0..STAGE_BUFFERS {
        g.htod(z, &f32s(&[3.0; 16])).unwrap();
    }
    g.replay(id).unwrap();
    assert_eq!(read(&g, x, 16), vec![3.0; 16]);
    // Without a synchronization in between, the ring waits for the buffer's event before
    // reusing it: an event recorded inside a capture cannot be waited for.
    g.capture_begin().unwrap();
    g.htod(x, &f32s(&[1.0; 16])).unwrap();
    g.capture_end().unwrap();
    let mut failed = None;
    for _ in 0..STAGE_BUFFERS {
        if let Err(e) = g.htod(z, &f32s(&[4.0; 16])) {
            failed = Some(e.to_string());
        }
    }
    let e = failed.expect("a staging buffer recorded in a capture was waited for");
    assert!(e.contains("CUDA_ERROR_CAPTURED_EVENT"), "{e}");
}

/// A graph naming memory freed since its capture refuses to run; so does one not captured.
#[test]
fn a_graph_naming_freed_memory_does_not_replay() {
    let Some(g) = gpu() else { return };
    let k = op_kernel(Op::Add, DType::F32);
    let dims = LaunchDims::linear([1, 1, 1], 32);
    let (x, y, z) = (
        g.alloc(64).unwrap(),
        g.alloc(64).unwrap(),
        g.alloc(64).unwrap(),
    );
    g.capture_begin().unwrap();
    g.launch(k, dims, &mut add_args(x, y, 16)).unwrap();
    let id = g.capture_end().unwrap();
    // Freeing memory the graph does not name leaves it alone.
    g.free(z, 64);
    assert!(!g.graph_stale(id));
    g.replay(id).unwrap();
    g.free(y, 64);
    assert!(g.graph_stale(id));
    let e = g.replay(id).unwrap_err().to_string();
    assert!(e.contains("freed"), "{e}");
    // The replay queued before the free ran with y still there.
    g.synchronize().unwrap();
    assert!(g.replay(id + 1).is_err());
}

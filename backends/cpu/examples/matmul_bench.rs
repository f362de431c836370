//! Micro-benchmark of the packed matmul kernels on model-shaped matrices: prints time, GMAC/s and
//! weight bandwidth per shape and batch size. `ONLY=Q4_1` picks a type, `M=1,32` the row counts,
//! `CYCLE=60` cycles through 60 copies of each matrix so the weights stream from memory.
//! `cargo run --release -p npu-backend-cpu --example matmul_bench [threads]`.

use npu_backend_cpu::kernels::matmul::{matmul, MatmulInput};
use npu_backend_cpu::kernels::Isa;
use npu_backend_cpu::quant::{QuantizedActs, WeightMatrix};
use npu_backend_cpu::threadpool::ThreadPool;
use npu_gguf::GgmlType;
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(1);
    let pool = ThreadPool::new(threads);
    // The memory read bandwidth of these threads, beside which the weight GB/s of matrices that
    // stream from memory (`CYCLE`) compare.
    if let Ok(Some(bw)) = npu_backend_cpu::roofline::read_bandwidth_gb_s(&pool, 256 << 20) {
        println!("memory read bandwidth, {threads} thread(s): {bw:.1} GB/s");
    }
    let only = std::env::var("ONLY").ok();
    // `SHAPES=Q4_K:2048x2048,Q6_K:2048x8192` (type:n x k) replaces the default shapes.
    let mut shapes = vec![
        (GgmlType::Q4_1, 3072usize, 576usize),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q8_0, 49152, 576),
    ];
    if let Ok(v) = std::env::var("SHAPES") {
        shapes = v
            .split(',')
            .map(|s| {
                let (t, nk) = s.split_once(':').expect("type:NxK");
                let (n, k) = nk.split_once('x').expect("NxK");
                let ty = (0..32)
                    .filter_map(GgmlType::from_id)
                    .find(|ty| ty.name() == t)
                    .expect("a ggml type name");
                (ty, n.parse().unwrap(), k.parse().unwrap())
            })
            .collect();
    }
    for (ty, n, k) in shapes {
        if only.as_deref().is_some_and(|o| o != ty.name()) {
            continue;
        }
        // Random well-formed rows (finite scales) of the type.
        let bytes = npu_backend_cpu::quant::testing::random_ggml_rows(ty, n, k, 7);
        // With `CYCLE=n`, n copies of the matrix taken in turn (beyond the caches, as a model
        // step's weights are).
        let copies: usize = std::env::var("CYCLE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
            .max(1);
        let ws: Vec<WeightMatrix> = (0..copies)
            .map(|_| WeightMatrix::from_ggml_parts(&[(ty, &bytes, n)], k).unwrap())
            .collect();
        let w = &ws[0];
        let ms: Vec<usize> = match std::env::var("M") {
            Ok(v) => v.split(',').filter_map(|x| x.parse().ok()).collect(),
            Err(_) => vec![1, 4, 32, 128],
        };
        for m in ms {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.1)
                .collect();
            let mut a = QuantizedActs::new();
            a.quantize(&x, m, k);
            a.fill_tiles();
            let mut out = vec![0f32; m * n];
            let iters = (400_000_000 / (m * n * k)).max(2);
            // Best of several short windows: the machine is shared and noisy.
            let mut dt = f64::MAX;
            for _ in 0..7 {
                let t = Instant::now();
                let c0 = thread_cpu_s();
                for it in 0..iters {
                    matmul(
                        &pool,
                        Isa::active(),
                        &ws[it % copies],
                        MatmulInput {
                            f32: &x,
                            quantized: &a,
                            rows: m,
                        },
                        &mut out,
                        n,
                    )
                    .expect("benchmark matmul");
                }
                let wall = t.elapsed().as_secs_f64();
                // On one thread the caller does all the work: its CPU time ignores the time the
                // shared machine took it off the core.
                let busy = if threads == 1 {
                    thread_cpu_s() - c0
                } else {
                    wall
                };
                dt = dt.min(busy / iters as f64);
            }
            println!(
                "{} n={n} k={k} m={m}: {:.3} ms, {:.1} GMAC/s, {:.1} GB/s weights",
                ty.name(),
                dt * 1e3,
                (m * n * k) as f64 / dt / 1e9,
                w.bytes() as f64 / dt / 1e9
            );
        }
    }
}

/// CPU time of the calling thread, seconds.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

//! Micro-benchmark of paged decode attention on the default model's shape (9 query heads over 3
//! KV heads of 64, blocks of 16, the KV pool's real block stride of 30 layers): one decode token
//! for each of `batch` sequences at a given context, blocks handed out scattered as a long-running
//! server would. Prints the best time of several windows, in CPU time of this process when run
//! on one thread (a shared machine deschedules it; CPU time does not count that), else wall time.
//! `CYCLE=1` reads every layer in turn, as a model step does, so the cache streams from memory.
//! `cargo run --release -p npu-backend-cpu --example attention_bench [threads] [batch] [ctx]`.

use half::f16;
use npu_backend_cpu::kernels::attention::{paged_attention, AttnParams, AttnSeq, KvLayout};
use npu_backend_cpu::kernels::Isa;
use npu_backend_cpu::threadpool::ThreadPool;
use std::time::Instant;

/// CPU time of this process in seconds.
fn cpu_time() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the value we own.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn main() {
    let arg = |i: usize, d: usize| {
        std::env::args()
            .nth(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let (threads, batch, ctx) = (arg(1, 2), arg(2, 32), arg(3, 192));
    let pool = ThreadPool::new(threads);
    let (n_kv, hd, bs, layers, n_heads) = (3usize, 64usize, 16usize, 30usize, 9usize);
    let block_elems = n_kv * hd * bs;
    let lay = KvLayout {
        n_kv_heads: n_kv,
        head_dim: hd,
        block_size: bs,
        block_stride: 2 * layers * block_elems,
    };
    let per_seq = ctx.div_ceil(bs);
    let num_blocks = batch * per_seq;
    let len = num_blocks * lay.block_stride;
    let mut cache: Vec<f16> = Vec::with_capacity(len);
    if std::env::var_os("HUGE").is_some() {
        // As the backend's KV pool does.
        let start = (cache.as_ptr() as usize).next_multiple_of(4096);
        let end = (cache.as_ptr() as usize + len * 2) / 4096 * 4096;
        // SAFETY: advice on whole pages inside an allocation we own; contents unchanged.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
    cache.extend(
        (0..len).map(|i| f16::from_f32(((i * 2_654_435_761) % 1000) as f32 / 1000.0 - 0.5)),
    );
    // Scattered tables: block i of sequence s is s + i * batch.
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| (0..per_seq).map(|i| (s + i * batch) as u32).collect())
        .collect();
    let seqs: Vec<AttnSeq> = tables
        .iter()
        .enumerate()
        .map(|(s, t)| AttnSeq {
            q_row: s,
            n_q: 1,
            start_pos: ctx - 1,
            block_table: t,
        })
        .collect();
    let ld = n_heads * hd;
    let q: Vec<f32> = (0..batch * ld)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let mut out = vec![0f32; batch * ld];
    let p = AttnParams {
        lay,
        n_heads,
        scale: 0.125,
        window: None,
    };
    // Layer 15's K and V, as a middle layer of the model; with `CYCLE` set, every layer in turn,
    // as a model step reads them (the whole cache then streams from memory, not from the caches).
    let cycle = std::env::var_os("CYCLE").is_some();
    let bases = |it: usize| {
        let l = if cycle { it % layers } else { 15 };
        (2 * l * block_elems, (2 * l + 1) * block_elems)
    };
    let iters = (20_000_000 / (batch * ctx)).max(3);
    let mut best = f64::MAX;
    for _ in 0..9 {
        let (t, c) = (Instant::now(), cpu_time());
        for it in 0..iters {
            let (k_base, v_base) = bases(it);
            paged_attention(
                &pool,
                Isa::active(),
                &p,
                &q,
                ld,
                &seqs,
                &cache[k_base..],
                &cache[v_base..],
                &mut out,
                ld,
            )
            .expect("benchmark attention");
        }
        let dt = if threads == 1 {
            cpu_time() - c
        } else {
            t.elapsed().as_secs_f64()
        };
        best = best.min(dt / iters as f64);
    }
    let kv_bytes = batch * per_seq * 2 * block_elems * 2;
    println!(
        "attention batch {batch} ctx {ctx} threads {threads}: {:.1} us per layer, {:.1} GB/s of K/V",
        best * 1e6,
        kv_bytes as f64 / best / 1e9
    );
}

//! A timing of one decode step's attention at long context over the int8 and the f16 cache
//! (ignored by default: it allocates about 1.2 GB and measures time, so it asserts nothing).
//! `cargo test --release -p npu-backend-cpu --lib int8_decode_attention_timing -- --ignored
//! --nocapture` (`INT8_BENCH_CONTEXTS`, `INT8_BENCH_STEPS`, `INT8_BENCH_THREADS`,
//! `INT8_BENCH_HOT`).

use std::time::Instant;

use super::super::*;
use super::*;
use crate::quant::testing::TestRng;

/// The default model's attention: 30 layers, 3 KV heads of 64 dims, 9 query heads, blocks of
/// 16 positions, every layer's K and V of a block together (the backend's pool layout).
const LAYERS: usize = 30;
const NKV: usize = 3;
const HD: usize = 64;
const BS: usize = 16;
const HEADS: usize = 9;

fn env_list(var: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(var)
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

/// An empty vector with room for `len` values, on transparent huge pages where the kernel gives
/// them (as the backend's pool asks for them).
fn huge<T>(len: usize) -> Vec<T> {
    let v: Vec<T> = Vec::with_capacity(len);
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = v.as_ptr() as usize;
        let (first, end) = (
            start.next_multiple_of(PAGE),
            (start + len * std::mem::size_of::<T>()) / PAGE * PAGE,
        );
        if end > first {
            // SAFETY: whole pages inside this allocation; MADV_HUGEPAGE only changes how the
            // kernel backs them, never their contents.
            unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
        }
    }
    v
}

#[test]
#[ignore = "a timing (about 1.2 GB of caches): run by hand with --ignored --nocapture"]
fn int8_decode_attention_timing() {
    let contexts = env_list("INT8_BENCH_CONTEXTS", &[8192, 32768]);
    let steps = env_list("INT8_BENCH_STEPS", &[9])[0];
    let threads = env_list("INT8_BENCH_THREADS", &[2])[0];
    let pool = ThreadPool::new(threads);
    let isa = Isa::active();
    let be = NKV * HD * BS;
    let longest = contexts.iter().copied().max().unwrap_or(0) + 1;
    let blocks = longest.div_ceil(BS);
    let mut rng = TestRng::new(5);
    // f16 pool: per block, every layer's K then V.
    let stride16 = 2 * LAYERS * be;
    let mut f16_pool: Vec<f16> = huge(blocks * stride16);
    f16_pool.extend((0..blocks * stride16).map(|_| f16::from_f32(rng.uniform(-1.0, 1.0))));
    let mut i8_pool: Vec<i8> = huge(blocks * stride16);
    i8_pool.extend((0..blocks * stride16).map(|_| rng.uniform(-127.0, 127.0) as i8));
    let sstride = 2 * LAYERS * NKV * BS;
    let scales: Vec<f16> = (0..blocks * sstride)
        .map(|_| f16::from_f32(rng.uniform(0.001, 0.02)))
        .collect();
    let lay = KvLayout {
        n_kv_heads: NKV,
        head_dim: HD,
        block_size: BS,
        block_stride: stride16,
    };
    let slay = KvLayout {
        n_kv_heads: NKV,
        head_dim: 1,
        block_size: BS,
        block_stride: sstride,
    };
    let p = AttnParams {
        lay,
        n_heads: HEADS,
        scale: 1.0 / (HD as f32).sqrt(),
        window: None,
    };
    let ld = HEADS * HD;
    let q: Vec<f32> = (0..ld).map(|_| rng.uniform(-2.0, 2.0)).collect();
    let mut out = vec![0f32; ld];
    // Blocks in a scattered order, as a pool hands them out.
    let mut table: Vec<u32> = (0..blocks as u32).collect();
    table.sort_by_key(|b| (b * 7919) % 61);
    // `INT8_BENCH_HOT=n`: the table names only its first n blocks, over and over, so the
    // caches' reads come from the CPU's caches (the kernels' arithmetic alone).
    let hot = env_list("INT8_BENCH_HOT", &[0])[0];
    if hot > 0 {
        let first: Vec<u32> = table[..hot.min(blocks)].to_vec();
        for (i, b) in table.iter_mut().enumerate() {
            *b = first[i % first.len()];
        }
    }
    eprintln!("isa {}, {threads} threads, {LAYERS} layers", isa.name());
    for &ctx in &contexts {
        let seq = [AttnSeq {
            q_row: 0,
            n_q: 1,
            start_pos: ctx,
            block_table: &table,
        }];
        let mut step = |int8: bool| -> f64 {
            let t0 = Instant::now();
            for l in 0..LAYERS {
                let cache = if int8 {
                    let (ks, vs) = (2 * l * NKV * BS, (2 * l + 1) * NKV * BS);
                    KvCache::I8(I8Cache {
                        k: &i8_pool[2 * l * be..],
                        v: &i8_pool[(2 * l + 1) * be..],
                        ks: &scales[ks..],
                        vs: &scales[vs..],
                        slay,
                    })
                } else {
                    KvCache::F16 {
                        k: &f16_pool[2 * l * be..],
                        v: &f16_pool[(2 * l + 1) * be..],
                    }
                };
                paged_attention_kv(&pool, isa, &p, &q, ld, &seq, cache, &mut out, ld).unwrap();
            }
            t0.elapsed().as_secs_f64() * 1e3
        };
        let (mut t16, mut t8) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            t16.push(step(false));
            t8.push(step(true));
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (m16, m8) = (median(&mut t16), median(&mut t8));
        eprintln!(
            "context {ctx:>6}: attention of one decode step (all layers), median of {steps}: \
             f16 {m16:.2} ms, int8 {m8:.2} ms, f16 / int8 {:.2}x (best: f16 {:.2}, int8 {:.2})",
            m16 / m8,
            t16[0],
            t8[0]
        );
    }
}

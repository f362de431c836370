//! Measured limits of this machine, so a benchmark can print how far the kernels are from them:
//! the memory read bandwidth (every thread streaming its part of a buffer far larger than the
//! last-level cache, with and without asking for the lines ahead as the kernels do) and the int8
//! dot-product peak (every thread running independent `vpdpbusd` chains on registers, nothing
//! loaded). Both are best-of-several measurements on the caller's
//! pool; on a shared machine they read low, like everything else measured there.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::kernels::Isa;
use crate::threadpool::{split_range, PoolError, ThreadPool};

/// Bytes streamed by `read_bandwidth_gb_s`: eight times a 32 MiB last-level cache.
pub const READ_BYTES: usize = 256 << 20;

/// Reads of the whole buffer per way of reading it; the best one counts.
pub const READ_PASSES: usize = 4;

/// How far ahead of the line it sums a prefetching read asks for lines: 2 KiB. On a 2-core
/// Zen 5 (`lscpu` "AMD EPYC") plain reads measured 38-40 GB/s with both threads and reads asking
/// 0.5-4 KiB ahead 51-53 GB/s, the rate the matmul kernels (which prefetch) reach in batch-1
/// decode; the plain figure alone had decode at 117% of "the bandwidth".
const AHEAD_BYTES: usize = 2048;

/// Memory read bandwidth in GB/s (10^9 bytes per second): every thread of `pool` sums its share
/// of a `bytes`-byte buffer (touched once beforehand), plainly and asking for lines ahead, best
/// of several passes each. `bytes` is rounded down to whole 64-byte lines; a buffer the system
/// cannot allocate gives None.
pub fn read_bandwidth_gb_s(pool: &ThreadPool, bytes: usize) -> Result<Option<f64>, PoolError> {
    match ReadProbe::new(bytes) {
        Some(probe) => probe.gb_s(pool, READ_PASSES).map(Some),
        None => Ok(None),
    }
}

/// A buffer far beyond the last-level cache, filled once, whose read bandwidth can be measured
/// again and again: beside a benchmark's own steps, so both see the same memory speed (a VM's
/// can change by a third within minutes).
pub struct ReadProbe {
    buf: Vec<u64>,
}

impl ReadProbe {
    /// A probe of `bytes` (rounded down to whole 64-byte lines); None when that is nothing or
    /// the system cannot allocate it.
    pub fn new(bytes: usize) -> Option<Self> {
        let words = bytes / 64 * 8;
        let mut buf: Vec<u64> = Vec::new();
        if words == 0 || buf.try_reserve_exact(words).is_err() {
            return None;
        }
        // Backed by huge pages where the kernel allows, as the packed weights are
        // (`AlignedBytes`).
        crate::backend::advise_huge_pages(buf.as_mut_ptr() as usize, words * 8);
        buf.extend((0..words as u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        Some(Self { buf })
    }

    /// Bytes read per pass.
    pub fn bytes(&self) -> usize {
        self.buf.len() * 8
    }

    /// The read bandwidth in GB/s: the best of `passes` plain reads of the whole buffer and
    /// `passes` asking for lines ahead, alternated, every thread of `pool` summing its share.
    pub fn gb_s(&self, pool: &ThreadPool, passes: usize) -> Result<f64, PoolError> {
        let words = self.buf.len();
        let tasks = pool.threads();
        let sink = AtomicU64::new(0);
        let mut best = f64::INFINITY;
        for pass in 0..2 * passes.max(1) {
            let ahead = pass % 2 == 1;
            let t0 = Instant::now();
            pool.run(tasks, |t| {
                let lines = split_range(words / 8, tasks, t);
                let part = &self.buf[lines.start * 8..lines.end * 8];
                sink.fetch_add(sum_lines(part, ahead), Ordering::Relaxed);
            })?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        std::hint::black_box(sink.load(Ordering::Relaxed));
        Ok(self.bytes() as f64 / best / 1e9)
    }
}

/// A sum over every word, eight independent lanes (one 64-byte line per step) so the loop is
/// bound by loads, not by one addition chain; with `ahead`, each step first asks for the line
/// `AHEAD_BYTES` further on (on x86-64; elsewhere the reads are plain).
fn sum_lines(words: &[u64], ahead: bool) -> u64 {
    let mut lanes = [0u64; 8];
    for (i, line) in words.chunks_exact(8).enumerate() {
        if ahead {
            prefetch(words.as_ptr().wrapping_add(i * 8 + AHEAD_BYTES / 8));
        }
        for (l, &w) in lanes.iter_mut().zip(line) {
            *l = l.wrapping_add(w);
        }
    }
    lanes.iter().fold(0, |a, &l| a.wrapping_add(l))
}

/// Asks for the cache line at `p` (which may lie past the buffer: only ever prefetched).
#[inline(always)]
fn prefetch(p: *const u64) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, whatever the address, and is never a read the program
    // sees; SSE is baseline on x86-64.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `vpdpbusd` instructions per chain per measurement; 64 multiply-adds each.
#[cfg(target_arch = "x86_64")]
const DOT_STEPS: u64 = 1 << 22;

/// The best of three wall times, in seconds, of every thread of `pool` running `f` once (its
/// result is kept, so the work cannot be optimized away).
#[cfg(target_arch = "x86_64")]
fn best_of_three(pool: &ThreadPool, f: impl Fn() -> i32 + Sync) -> Result<f64, PoolError> {
    let tasks = pool.threads();
    let sink = AtomicU64::new(0);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = Instant::now();
        pool.run(tasks, |_| {
            sink.fetch_add(f() as u64, Ordering::Relaxed);
        })?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink.load(Ordering::Relaxed));
    Ok(best)
}

/// The int8 dot-product peak in GOP/s (one multiply-add counts as two operations): every thread
/// of `pool` runs independent chains of 512-bit `vpdpbusd` on registers, best of three. None
/// where `isa` has no 8-bit dot product measured here (only AVX-512 VNNI is).
pub fn int8_peak_gop_s(pool: &ThreadPool, isa: Isa) -> Result<Option<f64>, PoolError> {
    #[cfg(target_arch = "x86_64")]
    if isa.checked() == Isa::Avx512Vnni {
        // SAFETY: `Isa::checked` found AVX-512 F and VNNI on this CPU.
        let best = best_of_three(pool, || unsafe { vnni_chains(DOT_STEPS) })?;
        let ops = pool.threads() as f64 * DOT_STEPS as f64 * VNNI_CHAINS as f64 * 64.0 * 2.0;
        return Ok(Some(ops / best / 1e9));
    }
    let _ = (pool, isa);
    Ok(None)
}

/// The AMX int8 tile peak in GOP/s (a multiply-add counts as two): every thread of `pool` runs
/// independent `tdpbusd` chains on tiles loaded once, best of three. None where the tiles cannot
/// be used (no AMX-INT8, no OS permission, or `NPU_SERVING_AMX=0`).
pub fn amx_int8_peak_gop_s(pool: &ThreadPool) -> Result<Option<f64>, PoolError> {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::matmul::amx::available() {
        use crate::kernels::matmul::amx;
        // SAFETY: `amx::available` found AMX-INT8 and was granted the tile state.
        let best = best_of_three(pool, || unsafe { amx::peak_products(AMX_STEPS) })?;
        let macs = (AMX_STEPS * amx::PEAK_CHAINS * amx::MACS_PER_PRODUCT) as f64;
        return Ok(Some(pool.threads() as f64 * macs * 2.0 / best / 1e9));
    }
    let _ = pool;
    Ok(None)
}

/// Rounds of tile products per thread per AMX measurement (about 0.1 s at the tiles' peak).
#[cfg(target_arch = "x86_64")]
const AMX_STEPS: u64 = 1 << 19;

/// Independent accumulator chains: more than the instruction's latency times its throughput.
#[cfg(target_arch = "x86_64")]
const VNNI_CHAINS: usize = 12;

/// `steps` rounds of `VNNI_CHAINS` independent `vpdpbusd` on registers; returns a value that
/// depends on every one of them.
///
/// # Safety
/// The CPU must support AVX-512 F and VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn vnni_chains(steps: u64) -> i32 {
    use std::arch::x86_64::*;
    let a = _mm512_set1_epi8(std::hint::black_box(1));
    let b = _mm512_set1_epi8(std::hint::black_box(-1));
    let mut acc = [_mm512_setzero_si512(); VNNI_CHAINS];
    for _ in 0..steps {
        for x in acc.iter_mut() {
            *x = _mm512_dpbusd_epi32(*x, a, b);
        }
    }
    let mut total = _mm512_setzero_si512();
    for x in acc {
        total = _mm512_add_epi32(total, x);
    }
    _mm512_reduce_add_epi32(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_sum_adds_every_word() {
        let words: Vec<u64> = (1..=64).collect();
        assert_eq!(sum_lines(&words, false), 64 * 65 / 2);
        assert_eq!(sum_lines(&words, true), 64 * 65 / 2);
    }

    #[test]
    fn read_bandwidth_is_positive_and_finite() {
        let pool = ThreadPool::new(2);
        let gb_s = read_bandwidth_gb_s(&pool, 8 << 20).unwrap().unwrap();
        assert!(gb_s.is_finite() && gb_s > 0.0, "{gb_s}");
        assert_eq!(read_bandwidth_gb_s(&pool, 0).unwrap(), None);
    }

    #[test]
    fn int8_peak_is_measured_on_vnni_only() {
        let pool = ThreadPool::new(2);
        assert_eq!(int8_peak_gop_s(&pool, Isa::Scalar).unwrap(), None);
        let vnni = int8_peak_gop_s(&pool, Isa::active()).unwrap();
        assert_eq!(vnni.is_some(), Isa::active() == Isa::Avx512Vnni);
        if let Some(g) = vnni {
            assert!(g.is_finite() && g > 0.0, "{g}");
        }
    }

    /// Measured where the tiles can be used, None elsewhere (and then says why the measuring
    /// path was not run).
    #[test]
    fn amx_peak_is_measured_where_the_tiles_are() {
        let pool = ThreadPool::new(2);
        let peak = amx_int8_peak_gop_s(&pool).unwrap();
        #[cfg(target_arch = "x86_64")]
        let tiles = crate::kernels::matmul::amx::available();
        #[cfg(not(target_arch = "x86_64"))]
        let tiles = false;
        assert_eq!(peak.is_some(), tiles);
        match peak {
            Some(g) => assert!(g.is_finite() && g > 0.0, "{g}"),
            None => eprintln!("SKIPPED: no usable AMX-INT8 tiles here (or NPU_SERVING_AMX=0)"),
        }
    }

    /// The tile products compute: each of 256 sums gets 64 products of 1 x 1 per step.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn amx_peak_products_compute_the_dot_products() {
        if !crate::kernels::matmul::amx::available() {
            eprintln!("SKIPPED: no usable AMX-INT8 tiles here (or NPU_SERVING_AMX=0)");
            return;
        }
        // SAFETY: AMX is available.
        let v = unsafe { crate::kernels::matmul::amx::peak_products(10) };
        assert_eq!(v, 10 * 64 * 256);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_chains_compute_the_dot_products() {
        if Isa::active() != Isa::Avx512Vnni {
            return;
        }
        // Each step adds 4 * (1 * -1) to each of 16 lanes of each chain.
        // SAFETY: AVX-512 VNNI was detected.
        let v = unsafe { vnni_chains(10) };
        assert_eq!(v, -(10 * 4 * 16 * VNNI_CHAINS as i32));
    }
}

/// Not a test: prints how float multiplies and FMAs beside `vpdpbusd` slow it on this core (one
/// thread, eight independent `vpdpbusd` chains a round, plus `muls` multiply and `fmas` FMA
/// chains), the ceiling a block format's epilogue (`d_w·d_x` and an FMA per block) puts on the
/// packed matmul: `cargo test --release -p npu-backend-cpu --lib issue_slots -- --ignored
/// --nocapture`.
#[cfg(all(test, target_arch = "x86_64"))]
mod issue_slots {
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    /// `steps` rounds; returns a value that depends on every chain.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and VNNI, and FMA.
    #[target_feature(enable = "avx512f,avx512vnni,fma")]
    unsafe fn rounds(steps: u64, muls: usize, fmas: usize) -> f32 {
        let a = _mm512_set1_epi8(std::hint::black_box(1));
        let b = _mm512_set1_epi8(std::hint::black_box(-1));
        let x = _mm512_set1_ps(std::hint::black_box(1.000_000_1));
        let mut acc = [_mm512_setzero_si512(); 8];
        let (mut m, mut f) = ([_mm512_set1_ps(1.0); 2], [_mm512_set1_ps(1.0); 2]);
        for _ in 0..steps {
            for c in acc.iter_mut() {
                *c = _mm512_dpbusd_epi32(*c, a, b);
            }
            for v in m.iter_mut().take(muls) {
                *v = _mm512_mul_ps(*v, x);
            }
            for v in f.iter_mut().take(fmas) {
                *v = _mm512_fmadd_ps(*v, x, x);
            }
        }
        let ints = acc
            .iter()
            .fold(_mm512_setzero_si512(), |t, c| _mm512_add_epi32(t, *c));
        let floats = _mm512_add_ps(_mm512_add_ps(m[0], m[1]), _mm512_add_ps(f[0], f[1]));
        _mm512_reduce_add_ps(floats) + _mm512_reduce_add_epi32(ints) as f32
    }

    #[test]
    #[ignore]
    fn issue_slots() {
        if Isa::Avx512Vnni.checked() != Isa::Avx512Vnni {
            eprintln!("SKIPPED: no AVX-512 VNNI on this machine");
            return;
        }
        let steps = 1u64 << 24;
        for (muls, fmas) in [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)] {
            let mut best = f64::MAX;
            for _ in 0..3 {
                let t = std::time::Instant::now();
                // SAFETY: `Isa::checked` found AVX-512 VNNI (and with it F and FMA) on this CPU.
                std::hint::black_box(unsafe { rounds(steps, muls, fmas) });
                best = best.min(t.elapsed().as_secs_f64());
            }
            eprintln!(
                "8 vpdpbusd + {muls} vmulps + {fmas} vfmadd a round: {:.3} ns",
                best / steps as f64 * 1e9
            );
        }
    }
}

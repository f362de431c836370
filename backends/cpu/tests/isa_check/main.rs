//! The instruction-set check: every kernel this CPU can run with a SIMD instruction set (NEON,
//! NEON with the dot-product extension, AVX2, AVX-512) against the scalar kernel on the same
//! inputs, bit for bit: packed matmuls for every weight format, f32 matmuls, paged attention,
//! activation quantization, SwiGLU (with the vector exp) and f16 rounding.
//!
//! It runs on one thread (a pool of one thread runs its tasks inline and spawns nothing), so it
//! also runs under qemu-user, which cannot run threads: that is how the NEON kernels are checked
//! on an x86 machine. Before the real run, a self-test switches on the crate's fault injection
//! (one bit of one SIMD result flipped) and requires every check to notice.
//!
//! `cargo test --release -p npu-backend-cpu --features fault-injection --test isa_check`

mod checks;

use std::process::ExitCode;

use npu_backend_cpu::kernels::{fault, Isa};
use npu_backend_cpu::threadpool::ThreadPool;

/// Results of one run of every check.
#[derive(Default)]
pub struct Report {
    /// Per check family: comparisons made, and the mismatches found.
    families: Vec<(&'static str, usize, Vec<String>)>,
}

impl Report {
    fn family(&mut self, name: &'static str) -> &mut (&'static str, usize, Vec<String>) {
        if let Some(i) = self.families.iter().position(|f| f.0 == name) {
            &mut self.families[i]
        } else {
            self.families.push((name, 0, Vec::new()));
            self.families.last_mut().expect("just pushed")
        }
    }

    /// Compares f32 results bit for bit (NaN payloads included).
    pub fn f32s(&mut self, family: &'static str, what: &str, got: &[f32], want: &[f32]) {
        let f = self.family(family);
        f.1 += 1;
        if got.len() != want.len() {
            f.2.push(format!(
                "{what}: {} values, scalar gave {}",
                got.len(),
                want.len()
            ));
            return;
        }
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            let n_bad = (0..got.len())
                .filter(|&i| got[i].to_bits() != want[i].to_bits())
                .count();
            f.2.push(format!(
                "{what}: {n_bad} of {} values differ; first at {i}: {:e} ({:#010x}) vs scalar {:e} ({:#010x})",
                got.len(),
                got[i],
                got[i].to_bits(),
                want[i],
                want[i].to_bits()
            ));
        }
    }

    /// Compares exact values.
    pub fn exact<T: PartialEq + std::fmt::Debug>(
        &mut self,
        family: &'static str,
        what: &str,
        got: &[T],
        want: &[T],
    ) {
        let f = self.family(family);
        f.1 += 1;
        if got != want {
            let i = got.iter().zip(want).position(|(a, b)| a != b);
            f.2.push(format!(
                "{what}: differs (lengths {} and {}; first difference at {i:?})",
                got.len(),
                want.len()
            ));
        }
    }

    /// A failure that is not a comparison.
    pub fn fail(&mut self, family: &'static str, message: String) {
        let f = self.family(family);
        f.1 += 1;
        f.2.push(message);
    }
}

/// Threads of this process (Linux), to show the check spawned none.
fn thread_count() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Threads:"))?;
    line["Threads:".len()..].trim().parse().ok()
}

fn main() -> ExitCode {
    let threads_at_start = thread_count();
    let isas: Vec<Isa> = Isa::available()
        .into_iter()
        .filter(|&i| i != Isa::Scalar)
        .collect();
    println!(
        "isa_check on {}: SIMD instruction sets {:?}",
        std::env::consts::ARCH,
        isas.iter().map(|i| i.name()).collect::<Vec<_>>()
    );
    if isas.is_empty() {
        println!("no SIMD instruction set on this machine: nothing to compare");
        return ExitCode::SUCCESS;
    }
    let pool = ThreadPool::new(1);

    // Self-test: every family must notice a SIMD result that is off by one bit.
    fault::corrupt_simd_results(true);
    let mut injected = Report::default();
    checks::run_all(&pool, &isas, &mut injected);
    fault::corrupt_simd_results(false);
    let mut ok = true;
    for (name, n, bad) in &injected.families {
        if bad.is_empty() {
            println!(
                "SELF-TEST FAILED: {name} ({n} comparisons) did not notice corrupted SIMD results"
            );
            ok = false;
        } else {
            println!(
                "self-test: {name} noticed corrupted SIMD results in {} of {n} comparisons",
                bad.len()
            );
        }
    }

    let mut report = Report::default();
    checks::run_all(&pool, &isas, &mut report);
    checks::exp_accuracy(&mut report);
    for (name, n, bad) in &report.families {
        if bad.is_empty() {
            println!("ok: {name}: {n} checks passed");
        } else {
            ok = false;
            println!(
                "FAILED: {name}: {} of {n} comparisons differ from scalar",
                bad.len()
            );
            for b in bad.iter().take(20) {
                println!("    {b}");
            }
        }
    }
    let threads_at_end = thread_count();
    if threads_at_start != threads_at_end {
        println!("FAILED: the check started threads ({threads_at_start:?} at start, {threads_at_end:?} at the end)");
        ok = false;
    }
    if ok {
        println!("isa_check passed");
        ExitCode::SUCCESS
    } else {
        println!("isa_check FAILED");
        ExitCode::FAILURE
    }
}

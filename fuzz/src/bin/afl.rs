//! The AFL++ driver: `npu-fuzz-afl TARGET` runs one harness in AFL's persistent mode (built with
//! `cargo afl build --features afl`; `scripts/fuzz.sh` does both).

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    let Some(harness) = npu_fuzz::target(&name) else {
        let names: Vec<&str> = npu_fuzz::TARGETS.iter().map(|(n, _)| *n).collect();
        eprintln!("usage: npu-fuzz-afl TARGET (one of: {})", names.join(", "));
        std::process::exit(2);
    };
    // Loaded before the fork server starts, so that no run pays for it.
    npu_fuzz::warm_up(&name);
    afl::fuzz!(|data: &[u8]| {
        harness(data);
        // A chat template that ran past its time limit leaves a thread spinning, which would
        // slow every later input of this persistent process: it ends after this input, and AFL
        // starts a fresh one.
        if npu_tokenizer::overrun_template_threads() != 0 {
            std::process::exit(0);
        }
    });
}

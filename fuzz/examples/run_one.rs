//! Runs one harness on files, printing how long each took (triage of what a fuzzer saved):
//! `cargo run --release -p npu-fuzz --example run_one -- TARGET FILE...` (each time excludes the
//! fixtures' loading, which runs once first, as under the fuzzer).

fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_default();
    let Some(harness) = npu_fuzz::target(&name) else {
        eprintln!("usage: run_one TARGET FILE...");
        std::process::exit(2);
    };
    // The fixtures (tokenizers, models) load once, outside the timings, as under the fuzzer.
    npu_fuzz::warm_up(&name);
    for path in args {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let started = std::time::Instant::now();
        harness(&data);
        println!("{path}: {} bytes, {:?}", data.len(), started.elapsed());
    }
}

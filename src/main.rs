//! The one user-facing binary: parses the command line and hands over to the library crates.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "npu-serving", version, about = "LLM serving for Ascend NPUs, CUDA GPUs and CPUs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure the engine's prefill and decode speed on this machine.
    BenchModel(npu_agent::cli::bench_model::BenchModelArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::BenchModel(a) => npu_agent::cli::bench_model::run(a),
    }
}

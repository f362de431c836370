//! The one user-facing binary: parses the command line and hands over to the library crates.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "npu-serving",
    version,
    about = "LLM serving for Ascend NPUs, CUDA GPUs and CPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one worker agent (started by the server, not by hand).
    Agent(npu_agent::worker::AgentArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    match Cli::parse().command {
        Command::Agent(args) => npu_agent::worker::run(args)?,
    }
    Ok(())
}

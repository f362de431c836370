//! The one user-facing binary: parses the command line and hands over to the library crates.
//! An error ends it with its message and causes on one line (`error: ...`) and exit status 1,
//! never a backtrace, whatever RUST_BACKTRACE says (`--debug` shows the causes one per line and
//! the backtrace when one was captured); panics keep theirs. Log lines carry colour codes only
//! when stderr is a terminal.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "npu-serving",
    version,
    about = "LLM serving for Ascend NPUs, CUDA GPUs and CPUs"
)]
struct Cli {
    /// On an error, show each cause on its own line and the backtrace when RUST_BACKTRACE=1.
    #[arg(long, global = true)]
    debug: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Start the server: agents, engine loop and HTTP API (llm-serving and OpenAI).
    Serve(npu_server::serve::ServeArgs),
    /// Generate text from a prompt on this machine (no server).
    Generate(npu_agent::cli::generate::GenerateArgs),
    /// Teacher-forced scoring of a given continuation (fidelity checks).
    Score(npu_agent::cli::score::ScoreArgs),
    /// Measure the engine's prefill and decode speed on this machine.
    BenchModel(npu_agent::cli::bench_model::BenchModelArgs),
    /// Measure n-gram speculative decoding against plain decoding on this machine.
    BenchSpec(npu_agent::cli::bench_spec::BenchSpecArgs),
    /// Time the all-reduce of a tensor-parallel group between processes on this machine.
    BenchCollective(npu_agent::cli::bench_collective::BenchCollectiveArgs),
    /// Write a tiny random-weight GGUF of a model family (llama.cpp conventions) for fidelity tests.
    SynthModel(npu_agent::cli::synth::SynthArgs),
    /// Load generator against a running server (performance_serving's interface).
    Bench(client_bench::BenchArgs),
    /// Run one worker agent (started by the server, not by hand).
    Agent(npu_agent::worker::AgentArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let debug = cli.debug;
    let result = match npu_agent::device::check_settings() {
        Err(e) => Err(e.into()),
        Ok(()) => run(cli.command),
    };
    // Every command has dropped its devices by now: device runtimes can be released.
    npu_agent::device::release_runtimes();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if debug {
                eprintln!("error: {e:?}");
            } else {
                eprintln!("error: {e:#}");
            }
            ExitCode::FAILURE
        }
    }
}

/// Runs one subcommand.
fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve(a) => npu_server::serve::run(a, &npu_agent::device::built_devices()),
        Command::Generate(a) => npu_agent::cli::generate::run(a),
        Command::Score(a) => npu_agent::cli::score::run(a),
        Command::BenchModel(a) => npu_agent::cli::bench_model::run(a),
        Command::BenchSpec(a) => npu_agent::cli::bench_spec::run(a),
        Command::SynthModel(a) => npu_agent::cli::synth::run(a),
        Command::BenchCollective(a) => npu_agent::cli::bench_collective::run(a),
        Command::Bench(a) => client_bench::run(a),
        Command::Agent(a) => npu_agent::worker::run(a).map_err(Into::into),
    }
}

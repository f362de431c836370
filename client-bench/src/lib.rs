//! client-bench: the load generator behind `npu-serving bench`, a re-implementation of
//! llm-serving's performance_serving (same flags, request bodies, result files and log lines)
//! with OpenAI support, exact token counts, latency metrics, plots and sweeps.

pub mod api;
pub mod args;
pub mod arrival;
pub mod dataset;
pub mod driver;
pub mod error;
pub mod http_client;
pub mod metrics;
pub mod plots;
pub mod report;
pub mod runner;
pub mod sweep;
pub mod tokens;

pub use args::BenchArgs;
pub use driver::BenchReport;
pub use error::BenchError;

/// Runs `npu-serving bench` with parsed arguments. Fails when the arguments, dataset, tokenizer
/// or output files are unusable, or when not a single request completed.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let report = driver::execute(&args)?;
    if !report.summaries.is_empty() && report.summaries.iter().all(|s| s.completed == 0) {
        anyhow::bail!(
            "no request completed; the failure reasons are in {}",
            args.out_dir.display()
        );
    }
    Ok(())
}

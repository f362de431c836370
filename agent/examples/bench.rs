use clap::Parser;
#[derive(Parser)]
struct A {
    #[command(flatten)]
    a: npu_agent::cli::bench_model::BenchModelArgs,
}
fn main() -> anyhow::Result<()> {
    npu_agent::cli::bench_model::run(A::parse().a)
}

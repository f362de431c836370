//! Command-line arguments of `npu-serving bench` (performance_serving's -X/-P/-O/-T plus the
//! dataset, arrival, SLO, plotting and sweep options) and their validation into a typed plan.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::api::ApiKind;
use crate::arrival::{ArrivalKind, ArrivalSpec};
use crate::dataset::{DatasetFormat, LengthDist};
use crate::error::BenchError;
use crate::http_client::Timeouts;
use crate::metrics::Slo;

/// Load generator for llm-serving-compatible and OpenAI-compatible servers.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Request rate X in requests per second (sends X·T requests).
    #[arg(short = 'X', long = "qps")]
    pub qps: Option<f64>,

    /// Server port.
    #[arg(short = 'P', long = "port", default_value_t = 8835)]
    pub port: u16,

    /// Directory for result_{X}_x.json, summaries, logs and plots (created if missing).
    #[arg(
        short = 'O',
        long = "out_dir",
        alias = "out-dir",
        default_value = "bench-results"
    )]
    pub out_dir: PathBuf,

    /// Test time T in seconds: X·T requests are sent (performance_serving's default: 3600).
    #[arg(
        short = 'T',
        long = "test_time",
        alias = "test-time",
        default_value_t = 3600.0
    )]
    pub test_time: f64,

    /// Send exactly this many requests instead of X·T.
    #[arg(long)]
    pub num_requests: Option<usize>,

    /// Server host.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// API to speak.
    #[arg(long, value_enum, default_value_t = ApiKind::LlmServing)]
    pub api: ApiKind,

    /// Request path (default: /models/{name}/generate_stream or /v1/completions; a path ending
    /// in /chat/completions sends chat messages).
    #[arg(long)]
    pub endpoint: Option<String>,

    /// Model name in the path (llm-serving, default llama2) or body (OpenAI, default: the first
    /// model listed by GET /v1/models).
    #[arg(long)]
    pub served_model_name: Option<String>,

    /// Bearer token for OpenAI-compatible servers that require one.
    #[arg(long)]
    pub api_key: Option<String>,

    /// Dataset file: Alpaca JSON, ShareGPT JSON or JSONL prompts. Without it a synthetic dataset
    /// is generated from --input-len / --output-len.
    #[arg(long)]
    pub dataset: Option<PathBuf>,

    /// Layout of --dataset.
    #[arg(long, value_enum, default_value_t = DatasetFormat::Auto)]
    pub dataset_format: DatasetFormat,

    /// Synthetic prompt lengths in tokens: fixed:N, uniform:A,B, normal:MEAN,STD or exp:MEAN.
    #[arg(long, default_value = "uniform:32,128")]
    pub input_len: LengthDist,

    /// Synthetic max_new_tokens: fixed:N, uniform:A,B, normal:MEAN,STD or exp:MEAN.
    #[arg(long, default_value = "uniform:16,128")]
    pub output_len: LengthDist,

    /// Ask every request for exactly this many new tokens (overrides the dataset).
    #[arg(long)]
    pub max_new_tokens: Option<usize>,

    /// max_new_tokens for dataset entries that give neither an output nor a count.
    #[arg(long, default_value_t = 128)]
    pub default_output_len: usize,

    /// Ask the server to ignore end-of-sequence (sends "ignore_eos": true).
    #[arg(long)]
    pub ignore_eos: bool,

    /// A JSON Schema file every reply must follow (structured output: OpenAI's response_format
    /// json_schema, or TGI's parameters.grammar on the llm-serving API); compare its TPOT with
    /// a run without it.
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<std::path::PathBuf>,

    /// Arrival process of requests.
    #[arg(long, value_enum, default_value_t = ArrivalKind::Poisson)]
    pub arrival: ArrivalKind,

    /// Coefficient of variation of gaps for --arrival gamma (1 = Poisson, >1 burstier).
    #[arg(long, default_value_t = 1.0)]
    pub cv: f64,

    /// Requests per burst for --arrival burst.
    #[arg(long, default_value_t = 8)]
    pub burst_size: usize,

    /// At most this many requests in flight; later arrivals wait for a free slot.
    #[arg(long)]
    pub max_concurrency: Option<usize>,

    /// Seed of arrivals and the synthetic dataset.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Requests sent one at a time before the measured run (not recorded).
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,

    /// TTFT objective in ms for goodput.
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,

    /// TPOT objective in ms for goodput.
    #[arg(long)]
    pub slo_tpot_ms: Option<f64>,

    /// GGUF model whose tokenizer counts tokens (default: the default model).
    #[arg(long)]
    pub model: Option<PathBuf>,

    /// Limit in seconds on one request, from connect to the last byte.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,

    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,

    /// No SVG plots.
    #[arg(long)]
    pub no_plots: bool,

    /// Run several rates, e.g. 1,2,4,8; writes a sweep table and a throughput–latency curve.
    #[arg(long, value_delimiter = ',')]
    pub sweep_qps: Option<Vec<f64>>,

    /// Start the server per setting of a grid of YAML overrides and run the same load on each,
    /// e.g. "model_config.decode_batch_size=16,32;pa_config.block_size=16,32".
    #[arg(long)]
    pub sweep_config: Option<String>,

    /// Runs of the whole --sweep-config grid, one round after another, so that every setting
    /// meets the machine at several moments; the best setting is chosen by median goodput.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub sweep_rounds: u32,

    /// Base server config for --sweep-config.
    #[arg(long, default_value = "configs/smollm2-cpu.yaml")]
    pub config: PathBuf,

    /// Server binary for --sweep-config (default: this executable), run as
    /// `<bin> serve --config <yaml> --port 0`.
    #[arg(long)]
    pub server_bin: Option<PathBuf>,

    /// Seconds to wait for a --sweep-config server to print its address and pass /health.
    #[arg(long, default_value_t = 600.0)]
    pub server_start_timeout: f64,
}

/// Validated settings shared by every run of an invocation.
#[derive(Debug, Clone)]
pub struct BenchPlan {
    /// Rates to run, in order (one unless --sweep-qps).
    pub rates: Vec<f64>,
    pub test_time: f64,
    pub num_requests: Option<usize>,
    pub arrival_kind: ArrivalKind,
    pub cv: f64,
    pub burst_size: usize,
    pub slo: Slo,
    pub timeouts: Timeouts,
    pub server_start_timeout: Duration,
}

impl BenchPlan {
    /// Requests to send at rate `x`: --num-requests, else ⌊X·T⌋ (as performance_serving's
    /// `int(test_time * x)`).
    pub fn requests_at(&self, x: f64) -> usize {
        self.num_requests
            .unwrap_or_else(|| (x * self.test_time).floor() as usize)
    }

    /// The arrival process at rate `x`.
    pub fn arrival_at(&self, x: f64) -> ArrivalSpec {
        ArrivalSpec {
            kind: self.arrival_kind,
            rate: x,
            cv: self.cv,
            burst_size: self.burst_size,
        }
    }
}

fn positive(flag: &'static str, x: f64) -> Result<f64, BenchError> {
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(BenchError::arg(
            flag,
            format!("{x} must be a positive number"),
        ))
    }
}

impl BenchArgs {
    /// Checks every value and builds the plan; errors name the flag.
    pub fn validate(&self) -> Result<BenchPlan, BenchError> {
        let rates = match (&self.sweep_qps, self.qps) {
            (Some(list), _) if list.is_empty() => {
                return Err(BenchError::arg("--sweep-qps", "needs at least one rate"))
            }
            (Some(list), _) => list.clone(),
            (None, Some(x)) => vec![x],
            (None, None) => {
                return Err(BenchError::arg(
                    "--qps",
                    "give a rate with -X/--qps (or several with --sweep-qps)",
                ))
            }
        };
        let test_time = positive("--test_time", self.test_time)?;
        let plan = BenchPlan {
            rates,
            test_time,
            num_requests: self.num_requests,
            arrival_kind: self.arrival,
            cv: self.cv,
            burst_size: self.burst_size,
            slo: Slo {
                ttft_ms: self
                    .slo_ttft_ms
                    .map(|x| positive("--slo-ttft-ms", x))
                    .transpose()?,
                tpot_ms: self
                    .slo_tpot_ms
                    .map(|x| positive("--slo-tpot-ms", x))
                    .transpose()?,
            },
            timeouts: Timeouts {
                connect: Duration::from_secs(10),
                total: Duration::from_secs_f64(positive(
                    "--request-timeout",
                    self.request_timeout,
                )?),
            },
            server_start_timeout: Duration::from_secs_f64(positive(
                "--server-start-timeout",
                self.server_start_timeout,
            )?),
        };
        for &x in &plan.rates {
            plan.arrival_at(x)
                .validate()
                .map_err(|(flag, m)| BenchError::arg(flag, m))?;
            if plan.requests_at(x) == 0 {
                return Err(BenchError::arg(
                    "--test_time",
                    format!(
                        "X·T = {x}·{} sends no request; raise -X or -T or give --num-requests",
                        self.test_time
                    ),
                ));
            }
        }
        if self.max_concurrency == Some(0) {
            return Err(BenchError::arg("--max-concurrency", "must be at least 1"));
        }
        if self.max_new_tokens == Some(0) {
            return Err(BenchError::arg("--max-new-tokens", "must be at least 1"));
        }
        if self.default_output_len == 0 {
            return Err(BenchError::arg(
                "--default-output-len",
                "must be at least 1",
            ));
        }
        if let Some(ep) = &self.endpoint {
            if !ep.starts_with('/') {
                return Err(BenchError::arg(
                    "--endpoint",
                    format!("{ep:?} must start with '/'"),
                ));
            }
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> BenchArgs {
        let mut v = vec!["bench"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v).expect("parses").bench
    }

    #[test]
    fn performance_serving_flags() {
        let a = parse(&["-X", "2", "-P", "8835", "-O", "./out", "-T", "750"]);
        assert_eq!(a.qps, Some(2.0));
        assert_eq!(a.port, 8835);
        assert_eq!(a.out_dir, PathBuf::from("./out"));
        let plan = a.validate().unwrap();
        assert_eq!(plan.requests_at(2.0), 1500);
        let a = parse(&[
            "--qps",
            "0.625",
            "--port",
            "1",
            "--out_dir",
            "o",
            "--test_time",
            "3",
        ]);
        // int(3 * 0.625) = int(1.875) = 1
        assert_eq!(a.validate().unwrap().requests_at(0.625), 1);
    }

    #[test]
    fn sweep_and_options() {
        let a = parse(&[
            "--sweep-qps",
            "1,2,4",
            "--api",
            "openai",
            "--arrival",
            "gamma",
            "--cv",
            "2.5",
            "--input-len",
            "fixed:16",
            "--slo-ttft-ms",
            "500",
        ]);
        let plan = a.validate().unwrap();
        assert_eq!(plan.rates, vec![1.0, 2.0, 4.0]);
        assert_eq!(a.api, ApiKind::OpenAi);
        assert_eq!(plan.arrival_at(4.0).cv, 2.5);
        assert_eq!(a.input_len, LengthDist::Fixed(16));
        assert_eq!(plan.slo.ttft_ms, Some(500.0));
    }

    #[test]
    fn bad_values_name_their_flag() {
        let msg = |args: &[&str]| parse(args).validate().unwrap_err().to_string();
        assert!(msg(&[]).contains("--qps"));
        assert!(msg(&["--qps=-1"]).contains("--qps"));
        assert!(msg(&["-X", "1", "-T", "0.5"]).contains("--test_time"));
        assert!(msg(&["-X", "1", "--arrival", "gamma", "--cv", "0"]).contains("--cv"));
        assert!(msg(&["-X", "1", "--max-concurrency", "0"]).contains("--max-concurrency"));
        assert!(msg(&["-X", "1", "--slo-tpot-ms", "0"]).contains("--slo-tpot-ms"));
        assert!(msg(&["-X", "1", "--endpoint", "v1/x"]).contains("--endpoint"));
        let bad_dist = Cli::try_parse_from(["bench", "-X", "1", "--input-len", "uniform:5"]);
        assert!(bad_dist.is_err());
    }
}

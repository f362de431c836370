//! Puts a bench invocation together: prepares the dataset and tokenizer, runs each rate (files,
//! table, plots), and the two sweeps (--sweep-qps table and curve; --sweep-config servers per
//! grid point and the best setting by goodput).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use crate::api::{ApiKind, ApiSettings};
use crate::args::{BenchArgs, BenchPlan};
use crate::dataset::{read_dataset, resolve_samples, synthetic, Sample};
use crate::error::BenchError;
use crate::http_client::{self, fetch_text, HttpRequest, HttpTarget, Timeouts};
use crate::metrics::{summarize, Summary};
use crate::plots::{write_run_plots, write_sweep_plot};
use crate::report::{
    csv_header, csv_line, csv_row, qps_label, write_results, write_summary, RunLog,
};
use crate::runner::{run_load, RunConfig};
use crate::sweep::{grid_points, parse_grid, point_label, write_point_config, ServerProcess};
use crate::tokens::TokenCounter;

/// Most distinct synthetic prompts generated; longer runs cycle through them.
const MAX_SYNTHETIC_PROMPTS: usize = 4096;

/// How long the one connection check before a run may take.
const REACHABLE_TIMEOUT: Duration = Duration::from_secs(2);

/// What a whole invocation measured.
#[derive(Debug, Clone)]
pub struct BenchReport {
    /// One summary per run (rate, or grid point × rate), in run order.
    pub summaries: Vec<Summary>,
    /// For --sweep-config: the best setting's label and summary (highest goodput).
    pub best_config: Option<(String, Summary)>,
}

/// Runs the invocation described by `args`.
pub fn execute(args: &BenchArgs) -> Result<BenchReport, BenchError> {
    let plan = args.validate()?;
    if args.sweep_config.is_none() {
        // A server that is not there (wrong port, not started) fails the run at once, rather
        // than after a timed run of requests that all fail the same way.
        let target = HttpTarget::new(args.host.clone(), args.port);
        http_client::check_reachable(&target, REACHABLE_TIMEOUT).map_err(|reason| {
            BenchError::Unreachable {
                addr: target.authority(),
                reason,
            }
        })?;
    }
    std::fs::create_dir_all(&args.out_dir)
        .map_err(|e| BenchError::io("creating", &args.out_dir, e))?;
    let counter = TokenCounter::load(args.model.as_deref())?;
    tracing::info!("counting tokens with {}", counter.model_path().display());
    let samples = prepare_samples(args, &plan, &counter)?;
    match &args.sweep_config {
        Some(grid) => run_config_sweep(args, &plan, grid, &samples, &counter),
        None => {
            let target = HttpTarget::new(args.host.clone(), args.port);
            let summaries = run_rates(args, &plan, &target, &args.out_dir, &samples, &counter)?;
            Ok(BenchReport {
                summaries,
                best_config: None,
            })
        }
    }
}

fn prepare_samples(
    args: &BenchArgs,
    plan: &BenchPlan,
    counter: &TokenCounter,
) -> Result<Vec<Sample>, BenchError> {
    match &args.dataset {
        Some(path) => {
            let raw = read_dataset(path, args.dataset_format)?;
            resolve_samples(raw, counter, args.default_output_len, args.max_new_tokens)
        }
        None => {
            let most = plan
                .rates
                .iter()
                .map(|&x| plan.requests_at(x))
                .max()
                .unwrap_or(1);
            let mut s = synthetic(
                most.clamp(1, MAX_SYNTHETIC_PROMPTS),
                args.input_len,
                args.output_len,
                args.seed,
                counter,
            )?;
            if let Some(n) = args.max_new_tokens {
                s.iter_mut().for_each(|x| x.max_new_tokens = n);
            }
            Ok(s)
        }
    }
}

/// API settings for a server; asks an OpenAI server for its model name when none was given.
fn api_settings(args: &BenchArgs, target: &HttpTarget) -> Result<ApiSettings, BenchError> {
    let model_name = match (&args.served_model_name, args.api) {
        (Some(n), _) => n.clone(),
        (None, ApiKind::LlmServing) => "llama2".to_string(),
        (None, ApiKind::OpenAi) => first_listed_model(target).unwrap_or_else(|| {
            tracing::warn!("GET /v1/models gave no model id; sending model \"default\"");
            "default".to_string()
        }),
    };
    let path = args
        .endpoint
        .clone()
        .unwrap_or_else(|| ApiSettings::default_path(args.api, &model_name));
    let json_schema = match &args.json_schema {
        None => None,
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|e| BenchError::InvalidArgument {
                flag: "--json-schema",
                message: format!("{}: {e}", p.display()),
            })?;
            Some(
                serde_json::from_str(&text).map_err(|e| BenchError::InvalidArgument {
                    flag: "--json-schema",
                    message: format!("{} is not JSON: {e}", p.display()),
                })?,
            )
        }
    };
    Ok(ApiSettings {
        kind: args.api,
        chat: path.trim_end_matches('/').ends_with("/chat/completions"),
        path,
        model_name,
        ignore_eos: args.ignore_eos,
        api_key: args.api_key.clone(),
        json_schema,
    })
}

fn first_listed_model(target: &HttpTarget) -> Option<String> {
    let req = HttpRequest {
        method: "GET",
        path: "/v1/models",
        headers: &[],
        body: &[],
    };
    let timeouts = Timeouts {
        connect: Duration::from_secs(5),
        total: Duration::from_secs(10),
    };
    let (status, body) = fetch_text(target, &req, timeouts).ok()?;
    if status != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    v["data"][0]["id"].as_str().map(str::to_string)
}

/// Runs every rate of the plan against `target`, writing files into `out_dir`.
fn run_rates(
    args: &BenchArgs,
    plan: &BenchPlan,
    target: &HttpTarget,
    out_dir: &Path,
    samples: &[Sample],
    counter: &TokenCounter,
) -> Result<Vec<Summary>, BenchError> {
    let api = api_settings(args, target)?;
    let mut summaries = Vec::new();
    for &x in &plan.rates {
        let cfg = RunConfig {
            target: target.clone(),
            api: api.clone(),
            arrival: plan.arrival_at(x),
            num_requests: plan.requests_at(x),
            max_concurrency: args.max_concurrency,
            seed: args.seed,
            warmup: args.warmup,
            timeouts: plan.timeouts,
            show_progress: !args.no_progress,
        };
        let mut log = RunLog::create(out_dir, x)?;
        println!(
            "Sending {} requests at {} req/s ({} arrivals) to http://{}{}",
            cfg.num_requests,
            x,
            clap::ValueEnum::to_possible_value(&plan.arrival_kind)
                .map_or_else(String::new, |v| v.get_name().to_string()),
            target.authority(),
            api.path
        );
        let outcome = run_load(&cfg, samples, counter, &mut log);
        log.all_done(outcome.duration_s);
        let results = write_results(out_dir, x, &outcome.records)?;
        let summary = summarize(&outcome.records, outcome.duration_s, x, plan.slo);
        let (summary_json, _) = write_summary(out_dir, &summary)?;
        if !args.no_plots {
            write_run_plots(out_dir, &qps_label(x), &outcome.records, outcome.duration_s)?;
        }
        print!("{}", crate::report::summary_table(&summary));
        println!(
            "results: {}\nsummary: {}\nlog: {}",
            results.display(),
            summary_json.display(),
            log.path().display()
        );
        summaries.push(summary);
    }
    if plan.rates.len() > 1 {
        write_rate_sweep(args, out_dir, &summaries)?;
    }
    Ok(summaries)
}

fn write_text(path: &Path, text: &str) -> Result<(), BenchError> {
    std::fs::write(path, text).map_err(|e| BenchError::io("writing", path, e))
}

/// `sweep_qps.csv`, `sweep_qps.json` and `sweep_throughput_latency.svg`, plus a compact table.
fn write_rate_sweep(
    args: &BenchArgs,
    out_dir: &Path,
    summaries: &[Summary],
) -> Result<(), BenchError> {
    let mut csv = csv_line(&csv_header()) + "\n";
    for s in summaries {
        csv.push_str(&(csv_line(&csv_row(s)) + "\n"));
    }
    write_text(&out_dir.join("sweep_qps.csv"), &csv)?;
    write_text(
        &out_dir.join("sweep_qps.json"),
        &serde_json::to_string_pretty(summaries)?,
    )?;
    if !args.no_plots {
        write_sweep_plot(&out_dir.join("sweep_throughput_latency.svg"), summaries)?;
    }
    println!("{}", sweep_table(summaries));
    Ok(())
}

/// Compact one-line-per-run table of a sweep.
pub fn sweep_table(summaries: &[Summary]) -> String {
    let mut t = format!(
        "{:>8} {:>6} {:>6} {:>9} {:>10} {:>10} {:>10} {:>10} {:>9}\n",
        "qps", "done", "failed", "req/s", "out tok/s", "TTFT p50", "TPOT p50", "E2E p99", "goodput"
    );
    let med = |s: &Option<crate::metrics::Stats>, p99: bool| {
        s.as_ref().map_or("n/a".to_string(), |x| {
            format!("{:.1}", if p99 { x.p99 } else { x.median })
        })
    };
    for s in summaries {
        t.push_str(&format!(
            "{:>8} {:>6} {:>6} {:>9.3} {:>10.2} {:>10} {:>10} {:>10} {:>9.3}\n",
            s.qps,
            s.completed,
            s.failed,
            s.request_throughput,
            s.output_throughput,
            med(&s.ttft_ms, false),
            med(&s.tpot_ms, false),
            med(&s.e2e_ms, true),
            s.goodput
        ));
    }
    t
}

fn server_binary(args: &BenchArgs) -> Result<PathBuf, BenchError> {
    match &args.server_bin {
        Some(p) => Ok(p.clone()),
        None => std::env::current_exe()
            .map_err(|e| BenchError::Sweep(format!("cannot find this executable: {e}"))),
    }
}

/// Starts the server for every grid point (in `--sweep-rounds` rounds over the grid), runs the
/// load, and picks the best setting: the highest median goodput over the rounds.
fn run_config_sweep(
    args: &BenchArgs,
    plan: &BenchPlan,
    grid: &str,
    samples: &[Sample],
    counter: &TokenCounter,
) -> Result<BenchReport, BenchError> {
    let axes = parse_grid(grid)?;
    if !args.config.is_file() {
        return Err(BenchError::arg(
            "--config",
            format!("base config {} not found", args.config.display()),
        ));
    }
    let bin = server_binary(args)?;
    let points = grid_points(&axes);
    let rounds = args.sweep_rounds.max(1) as usize;
    let mut rows: Vec<serde_json::Value> = Vec::new();
    let mut csv = csv_line(
        &[
            "config_index".to_string(),
            "setting".to_string(),
            "round".to_string(),
        ]
        .into_iter()
        .chain(csv_header())
        .chain(["error".to_string()])
        .collect::<Vec<_>>(),
    ) + "\n";
    let mut all = Vec::new();
    // Per (grid point, rate): the summaries of its rounds.
    let mut runs: Vec<((usize, f64), Vec<Summary>)> = Vec::new();
    for (i, point) in points.iter().enumerate() {
        let dir = args.out_dir.join(format!("config_{i}"));
        std::fs::create_dir_all(&dir).map_err(|e| BenchError::io("creating", &dir, e))?;
        write_point_config(&args.config, point, &dir.join("config.yaml"))?;
    }
    for round in 0..rounds {
        for (i, point) in points.iter().enumerate() {
            let label = point_label(point);
            let point_dir = args.out_dir.join(format!("config_{i}"));
            let dir = if rounds == 1 {
                point_dir.clone()
            } else {
                point_dir.join(format!("round_{round}"))
            };
            std::fs::create_dir_all(&dir).map_err(|e| BenchError::io("creating", &dir, e))?;
            println!(
                "[{}/{}] {label}",
                round * points.len() + i + 1,
                rounds * points.len()
            );
            let yaml = point_dir.join("config.yaml");
            let row_start = vec![i.to_string(), label.clone(), round.to_string()];
            match run_point(args, plan, &bin, &yaml, &dir, samples, counter) {
                Ok(summaries) => {
                    for s in &summaries {
                        let mut cells = row_start.clone();
                        cells.extend(csv_row(s));
                        cells.push(String::new());
                        csv.push_str(&(csv_line(&cells) + "\n"));
                        match runs.iter_mut().find(|(key, _)| *key == (i, s.qps)) {
                            Some((_, same)) => same.push(s.clone()),
                            None => runs.push(((i, s.qps), vec![s.clone()])),
                        }
                    }
                    rows.push(
                        json!({"index": i, "setting": label, "round": round, "runs": summaries}),
                    );
                    all.extend(summaries);
                }
                Err(e) => {
                    tracing::warn!("grid point {label} failed: {e}");
                    let mut cells = row_start;
                    cells.extend(std::iter::repeat_n(String::new(), csv_header().len()));
                    cells.push(e.to_string());
                    csv.push_str(&(csv_line(&cells) + "\n"));
                    rows.push(
                        json!({"index": i, "setting": label, "round": round, "error": e.to_string()}),
                    );
                }
            }
        }
    }
    // The best (point, rate) by median goodput; its median round stands for it.
    let mut best: Option<(String, Summary, Vec<f64>)> = None;
    for ((i, _), summaries) in &runs {
        let (median, goodputs) = median_run(summaries);
        if best
            .as_ref()
            .is_none_or(|(_, b, _)| median.goodput > b.goodput)
        {
            best = Some((point_label(&points[*i]), median.clone(), goodputs));
        }
    }
    write_text(&args.out_dir.join("sweep_config.csv"), &csv)?;
    let best_json = best.as_ref().map(|(l, s, g)| {
        json!({"setting": l, "qps": s.qps, "goodput": s.goodput, "goodput_by_round": g})
    });
    write_text(
        &args.out_dir.join("sweep_config.json"),
        &serde_json::to_string_pretty(&json!({
            "grid": grid,
            "rounds": rounds,
            "slo_ttft_ms": plan.slo.ttft_ms,
            "slo_tpot_ms": plan.slo.tpot_ms,
            "points": rows,
            "best": best_json,
        }))?,
    )?;
    match &best {
        Some((label, s, g)) if rounds > 1 => println!(
            "Best setting by median goodput over {rounds} rounds ({:.3} req/s at {} req/s offered; \
             rounds {g:.3?}): {label}",
            s.goodput, s.qps
        ),
        Some((label, s, _)) => println!(
            "Best setting by goodput ({:.3} req/s at {} req/s offered): {label}",
            s.goodput, s.qps
        ),
        None => println!("No grid point produced a run."),
    }
    Ok(BenchReport {
        summaries: all,
        best_config: best.map(|(l, s, _)| (l, s)),
    })
}

/// The run with the median goodput (the lower middle one for an even count) and every run's
/// goodput in run order. `runs` is not empty.
fn median_run(runs: &[Summary]) -> (&Summary, Vec<f64>) {
    let goodputs: Vec<f64> = runs.iter().map(|s| s.goodput).collect();
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|&a, &b| goodputs[a].total_cmp(&goodputs[b]));
    (&runs[order[(runs.len() - 1) / 2]], goodputs)
}

/// One grid point: start, wait for health, run the rates, stop.
fn run_point(
    args: &BenchArgs,
    plan: &BenchPlan,
    bin: &Path,
    yaml: &Path,
    dir: &Path,
    samples: &[Sample],
    counter: &TokenCounter,
) -> Result<Vec<Summary>, BenchError> {
    let mut server = ServerProcess::start(
        bin,
        yaml,
        &dir.join("server.log"),
        plan.server_start_timeout,
    )?;
    server.wait_healthy(plan.server_start_timeout)?;
    let target = server.target.clone();
    let result = run_rates(args, plan, &target, dir, samples, counter);
    let status = server.stop(Duration::from_secs(30))?;
    if !status.success() {
        tracing::warn!("server for {} exited with {status}", yaml.display());
    }
    result
}

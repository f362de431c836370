//! --sweep-config end to end: per grid point a YAML is written, a server process is started with
//! `serve --config <yaml> --port 0`, its `listening on HOST:PORT` line is read, /health is
//! awaited, the load runs, and the process is stopped with SIGTERM. The server here is
//! tests/data/sweep_peer_server.py, an HTTP peer that reports which config it got (the real
//! server is exercised in live_server.rs).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use clap::Parser;
use client_bench::driver::execute;
use client_bench::BenchArgs;
use serde_json::Value;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

/// A scratch folder holding the peer server script and a base config; the paths of the folder,
/// the script, the base config and the out dir.
fn scratch(name: &str, base_yaml: &str) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("peer_server.py");
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/sweep_peer_server.py");
    std::fs::copy(&src, &script).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let base = dir.join("base.yaml");
    std::fs::write(&base, base_yaml).unwrap();
    let out = dir.join("out");
    (dir, script, base, out)
}

/// A small load (3 requests at 20 req/s) against the peer server, plus `extra` flags.
fn sweep_args(out: &Path, base: &Path, script: &Path, extra: &[&str]) -> Cli {
    let mut argv = vec![
        "bench",
        "--no-progress",
        "--no-plots",
        "-X",
        "20",
        "--num-requests",
        "3",
        "--input-len",
        "fixed:4",
        "--output-len",
        "fixed:3",
        "-O",
        out.to_str().unwrap(),
        "--config",
        base.to_str().unwrap(),
        "--server-bin",
        script.to_str().unwrap(),
        "--server-start-timeout",
        "60",
    ];
    argv.extend_from_slice(extra);
    Cli::try_parse_from(argv).unwrap()
}

#[test]
fn config_sweep_runs_each_point_and_picks_the_best() {
    let (dir, script, base, out) = scratch(
        "bench-sweep-config",
        "model_config:\n  model_name: x\n  decode_batch_size: [50]\npa_config:\n  block_size: 16\n",
    );
    let cli = sweep_args(
        &out,
        &base,
        &script,
        &[
            "--sweep-config",
            "model_config.decode_batch_size=4,16;pa_config.block_size=32",
        ],
    );
    let report = execute(&cli.bench).unwrap();
    assert_eq!(report.summaries.len(), 2);
    assert_eq!(report.summaries[0].completed, 0);
    assert_eq!(report.summaries[0].failed, 3);
    assert_eq!(report.summaries[1].completed, 3);
    let (best, best_summary) = report.best_config.unwrap();
    assert_eq!(
        best,
        "model_config.decode_batch_size=16;pa_config.block_size=32"
    );
    assert_eq!(best_summary.completed, 3);

    for (i, bs) in [(0, 4), (1, 16)] {
        let point = out.join(format!("config_{i}"));
        let yaml = std::fs::read_to_string(point.join("config.yaml")).unwrap();
        assert!(yaml.contains(&format!("decode_batch_size: {bs}")), "{yaml}");
        assert!(yaml.contains("block_size: 32"), "{yaml}");
        assert!(yaml.contains("model_name: x"), "{yaml}");
        let log = std::fs::read_to_string(point.join("server.log")).unwrap();
        assert!(
            log.contains(&format!("starting with decode_batch_size={bs}")),
            "{log}"
        );
        let results: Value =
            serde_json::from_slice(&std::fs::read(point.join("result_20.0_x.json")).unwrap())
                .unwrap();
        assert_eq!(results.as_array().unwrap().len(), 3);
    }
    let results: Value =
        serde_json::from_slice(&std::fs::read(out.join("config_1/result_20.0_x.json")).unwrap())
            .unwrap();
    assert_eq!(results[0]["resp_text"], " bs16 bs16 bs16");
    let csv = std::fs::read_to_string(out.join("sweep_config.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("sweep_config.json")).unwrap()).unwrap();
    assert_eq!(summary["best"]["setting"], best.as_str());
    std::fs::remove_dir_all(&dir).ok();
}

/// --sweep-rounds: the grid runs round after round (each point's runs in round_N folders), and
/// the best setting is chosen by median goodput over the rounds.
#[test]
fn config_sweep_in_rounds_picks_by_median_goodput() {
    let (dir, script, base, out) =
        scratch("bench-sweep-rounds", "model_config:\n  model_name: x\n");
    let cli = sweep_args(
        &out,
        &base,
        &script,
        &[
            "--sweep-rounds",
            "2",
            "--sweep-config",
            "model_config.decode_batch_size=4,16",
        ],
    );
    let report = execute(&cli.bench).unwrap();
    // Two rounds of two points; the peer refuses every request at decode_batch_size 4.
    assert_eq!(report.summaries.len(), 4);
    let (best, best_summary) = report.best_config.unwrap();
    assert_eq!(best, "model_config.decode_batch_size=16");
    assert_eq!(best_summary.completed, 3);
    for i in 0..2 {
        assert!(out.join(format!("config_{i}/config.yaml")).is_file());
        for r in 0..2 {
            let run = out.join(format!("config_{i}/round_{r}/result_20.0_x.json"));
            assert!(run.is_file(), "{}", run.display());
        }
    }
    let csv = std::fs::read_to_string(out.join("sweep_config.csv")).unwrap();
    assert_eq!(csv.lines().count(), 5, "{csv}");
    assert!(csv.starts_with("config_index,setting,round,"), "{csv}");
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("sweep_config.json")).unwrap()).unwrap();
    assert_eq!(summary["rounds"], 2);
    assert_eq!(summary["best"]["setting"], best.as_str());
    assert_eq!(
        summary["best"]["goodput_by_round"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    std::fs::remove_dir_all(&dir).ok();
}

//! The bench against the real `npu-serving serve` on loopback (configs/smollm2-cpu.yaml, port 0):
//! a short llm-serving run and an OpenAI run with file and count checks, and a two-point
//! --sweep-config. Needs the `npu-serving` binary with its `serve` subcommand (built on demand
//! with cargo when absent, or named by $NPU_SERVING_BIN) and the default model.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use clap::Parser;
use client_bench::driver::execute;
use client_bench::sweep::ServerProcess;
use client_bench::BenchArgs;
use serde_json::Value;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("client-bench sits in the workspace")
        .to_path_buf()
}

/// $NPU_SERVING_BIN, else `<target>/<profile>/npu-serving` beside this test binary (built with
/// cargo if missing).
fn server_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("NPU_SERVING_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
    let bin = profile_dir.join("npu-serving");
    if !bin.is_file() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(workspace_root()).args([
            "build",
            "-p",
            "npu-serving",
            "--bin",
            "npu-serving",
        ]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build");
        assert!(status.success(), "building npu-serving failed");
    }
    bin
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("bench-live-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

fn args(list: &[&str]) -> BenchArgs {
    let mut v = vec!["bench", "--no-progress"];
    v.extend_from_slice(list);
    Cli::try_parse_from(v).unwrap().bench
}

/// One server at a time: the machine's cores are few, and the tests compare runs.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn config_path() -> PathBuf {
    workspace_root().join("configs/smollm2-cpu.yaml")
}

fn start_server(dir: &Path) -> ServerProcess {
    let mut server = ServerProcess::start(
        &server_bin(),
        &config_path(),
        &dir.join("server.log"),
        Duration::from_secs(600),
    )
    .expect("server starts and prints `listening on HOST:PORT`");
    server
        .wait_healthy(Duration::from_secs(600))
        .expect("GET /health becomes 200");
    server
}

fn check_run_files(out: &Path, label: &str, n: usize) -> Value {
    let results: Value =
        serde_json::from_slice(&std::fs::read(out.join(format!("result_{label}_x.json"))).unwrap())
            .unwrap();
    let arr = results.as_array().unwrap();
    assert_eq!(arr.len(), n);
    for r in arr {
        assert_eq!(r["success"], true, "request failed: {r}");
        assert!(!r["resp_text"].as_str().unwrap().is_empty());
        assert!(r["output_tokens"].as_u64().unwrap() >= 1);
        assert!(r["first_token_time"].as_f64().unwrap() <= r["res_time"].as_f64().unwrap());
    }
    let log = std::fs::read_to_string(out.join(format!("test_performance_{label}.log"))).unwrap();
    assert!(log.contains("All Tasks Done; Exec Time is "));
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join(format!("summary_{label}.json"))).unwrap())
            .unwrap();
    assert_eq!(summary["completed"], n);
    assert_eq!(summary["failed"], 0);
    assert!(out.join(format!("summary_{label}.csv")).is_file());
    assert!(out.join(format!("latency_cdf_{label}.svg")).is_file());
    summary
}

#[test]
fn short_runs_against_the_real_server() {
    let _serial = serial();
    let dir = temp_dir("runs");
    let mut server = start_server(&dir);
    let port = server.target.port.to_string();
    let out = dir.join("llm");
    let a = args(&[
        "-X",
        "2",
        "-T",
        "3",
        "-P",
        &port,
        "-O",
        out.to_str().unwrap(),
        "--input-len",
        "uniform:8,32",
        "--max-new-tokens",
        "8",
    ]);
    let report = execute(&a).expect("llm-serving run");
    assert_eq!(report.summaries[0].completed, 6);
    let s = check_run_files(&out, "2.0", 6);
    assert!(s["ttft_ms"]["median"].as_f64().unwrap() > 0.0);

    let out = dir.join("openai");
    let a = args(&[
        "--api",
        "openai",
        "-X",
        "2",
        "-T",
        "2",
        "-P",
        &port,
        "-O",
        out.to_str().unwrap(),
        "--input-len",
        "fixed:16",
        "--max-new-tokens",
        "6",
    ]);
    let report = execute(&a).expect("openai run");
    assert_eq!(report.summaries[0].completed, 4);
    check_run_files(&out, "2.0", 4);
    let _ = server.wait_healthy(Duration::from_secs(5));
    server.stop(Duration::from_secs(30)).unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn config_sweep_starts_a_server_per_point() {
    let _serial = serial();
    let dir = temp_dir("sweep");
    let out = dir.join("out");
    let bin = server_bin();
    let a = args(&[
        "-X",
        "2",
        "-T",
        "2",
        "-O",
        out.to_str().unwrap(),
        "--max-new-tokens",
        "4",
        "--input-len",
        "fixed:8",
        "--no-plots",
        "--config",
        config_path().to_str().unwrap(),
        "--server-bin",
        bin.to_str().unwrap(),
        "--sweep-config",
        "model_config.decode_batch_size=4,8",
    ]);
    let report = execute(&a).expect("config sweep");
    assert_eq!(report.summaries.len(), 2);
    assert!(report.summaries.iter().all(|s| s.completed == 4));
    let (best, _) = report.best_config.expect("a best setting");
    assert!(best.starts_with("model_config.decode_batch_size="));
    let csv = std::fs::read_to_string(out.join("sweep_config.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3);
    for i in 0..2 {
        let yaml = std::fs::read_to_string(out.join(format!("config_{i}/config.yaml"))).unwrap();
        assert!(
            yaml.contains(&format!("decode_batch_size: {}", [4, 8][i])),
            "{yaml}"
        );
        assert!(out.join(format!("config_{i}/result_2.0_x.json")).is_file());
    }
    std::fs::remove_dir_all(&dir).ok();
}

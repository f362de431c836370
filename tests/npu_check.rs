//! `scripts/npu-check.sh --dry-run` end to end over the strict CANN emulation, cut down to fit CI
//! (the conformance step left out, three families and the default model on one prompt of 8
//! tokens, no shaped models): the report names the emulation, judges the families the Ascend
//! backend runs (qwen3moe included, gemma3 in bf16 with its own margin), runs the bench table's code
//! as a smoke run and marks the hardware-only steps SKIPPED; without `--dry-run` the script
//! refuses to run over the emulation. Built with the `ascend` feature (the binary under test is
//! this build's `npu-serving`).

#![cfg(feature = "ascend")]

use std::path::{Path, PathBuf};
use std::process::Command;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/npu-check.sh");

/// The kit's helper beside this build's binary (`cargo test --workspace` builds it), built here
/// when a narrower `cargo test` did not.
fn gpu_kit_tool(bin_dir: &Path) -> PathBuf {
    let tool = bin_dir.join("examples/gpu_kit_tool");
    if !tool.is_file() {
        let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        c.args([
            "build",
            "-p",
            "npu-backend-cuda",
            "--example",
            "gpu_kit_tool",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
        if bin_dir.ends_with("release") {
            c.arg("--release");
        }
        assert!(
            c.status().expect("cargo runs").success(),
            "building gpu_kit_tool failed"
        );
    }
    assert!(tool.is_file(), "no {}", tool.display());
    tool
}

/// The CANN emulation's directory (`ASCEND_HOME_PATH` when set, as scripts/test.sh sets it).
fn emulation() -> PathBuf {
    if let Some(p) = std::env::var_os("ASCEND_HOME_PATH") {
        return PathBuf::from(p);
    }
    let out = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/ascend-emulator.sh"
        ))
        .output()
        .expect("bash runs scripts/ascend-emulator.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

#[test]
fn the_dry_run_checks_fidelity_on_the_emulation_and_skips_the_hardware_steps() {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_npu-serving"));
    let tool = gpu_kit_tool(bin.parent().unwrap());
    let dir = std::env::temp_dir().join(format!("npu-check-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let started = std::time::Instant::now();
    let out = Command::new("bash")
        .arg(SCRIPT)
        .args(["--dry-run", "--no-conformance", "--budget", "240"])
        .arg("--bin")
        .arg(&bin)
        .arg("--tool")
        .arg(&tool)
        .arg("--out")
        .arg(dir.join("out"))
        .env("ASCEND_HOME_PATH", emulation())
        .env("NPU_CHECK_WORK", dir.join("work"))
        .env("NPU_CHECK_FAMILIES", "llama qwen3moe gemma3")
        .env("NPU_CHECK_PROMPTS", "0")
        .env("NPU_CHECK_TOKENS", "8")
        .env("NPU_CHECK_SHAPES", "")
        .output()
        .expect("bash runs scripts/npu-check.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report = std::fs::read_to_string(dir.join("out/report.md")).unwrap_or_default();
    eprintln!("{report}\n({:.0} s)", started.elapsed().as_secs_f64());
    assert!(
        out.status.success(),
        "npu-check.sh failed:\n{stderr}\n{report}"
    );
    let has = |s: &str| assert!(report.contains(s), "the report lacks {s:?}:\n{report}");
    has("# npu-serving NPU check (DRY RUN over the strict CANN emulation (not an NPU))");
    has("- environment: CANN 8.3.RC1");
    has("- conformance: SKIPPED (left out (--no-conformance))");
    has("| llama | 0 | PASS greedy 8/8 as the CPU backend");
    has("llama.cpp's greedy tokens 8/32");
    has("| qwen3moe | 0 | PASS greedy 8/8 as the CPU backend");
    has("| gemma3 | 0 | PASS ");
    has("model sha256 0eaeb36a155b…: the file of llama.cpp's references");
    has("0 refused as expected");
    has("| smoke: tiny llama, on the CANN emulation (not a measurement) |");
    has("SKIPPED: dry run: bench-model on the 1B- and 8B-shaped models measures an NPU");
    has("- **npu-check: no step failed;");
    assert_eq!(
        report.matches("(expected today: ").count(),
        0,
        "no refusal is expected (gemma3 runs in bf16):\n{report}"
    );
    assert!(!report.contains("FAIL"), "{report}");

    // Over the emulation, a run that is not a dry run is refused before anything is built.
    let out = Command::new("bash")
        .arg(SCRIPT)
        .args(["--bin"])
        .arg(&bin)
        .arg("--out")
        .arg(dir.join("refused"))
        .env("ASCEND_HOME_PATH", emulation())
        .env("NPU_CHECK_WORK", dir.join("work"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("is the CANN emulation, not CANN"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

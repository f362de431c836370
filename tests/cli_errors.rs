//! How the binary reports trouble to a person: user-facing errors (a bad config value, a file
//! that is not a model, a misused command line) print their message and causes without a
//! backtrace even under RUST_BACKTRACE=1, exit 1 (usage errors: clap's 2); `--debug` shows the
//! causes one per line; log lines carry no colour codes when stderr is not a terminal.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("npu-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs the binary with piped stdout/stderr (not terminals) and RUST_BACKTRACE=1.
fn run(args: &[&str]) -> (Output, String) {
    run_with_env(args, &[])
}

/// `run` with these environment variables set too.
fn run_with_env(args: &[&str], vars: &[(&str, &str)]) -> (Output, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_npu-serving"))
        .args(args)
        .envs(vars.iter().copied())
        .env("RUST_BACKTRACE", "1")
        .env("RUST_LIB_BACKTRACE", "1")
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("npu-serving runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stderr)
}

fn assert_plain_error(out: &Output, stderr: &str, code: i32) {
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    assert!(!stderr.contains('\x1b'), "colour codes: {stderr:?}");
    for noise in ["backtrace", "Backtrace", "Caused by", "panicked"] {
        assert!(!stderr.contains(noise), "{noise:?} in {stderr}");
    }
}

/// The default config with a key llm-serving's section does not know (a warning, so that a log
/// line is written before a later error), and `from` replaced by `to`.
fn config_with_warning(d: &std::path::Path, from: &str, to: &str) -> PathBuf {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/smollm2-cpu.yaml"
    ))
    .unwrap();
    assert!(text.contains(from), "{from:?}");
    let text = text
        .replace(
            "model_config:\n",
            "model_config:\n    no_such_key_here: 1\n",
        )
        .replace(from, to);
    let path = d.join("config.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_bad_config_value_is_one_plain_line_and_exit_1() {
    let d = dir("badvalue");
    let cfg = config_with_warning(&d, "max_queue: 1024", "max_queue: -3");
    let (out, stderr) = run(&["serve", "--config", cfg.to_str().unwrap()]);
    assert_plain_error(&out, &stderr, 1);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.starts_with("error: config "), "{stderr}");
    assert!(last.contains("max_queue"), "{stderr}");
    // The chain on one line: the context, then the cause.
    assert!(last.contains(cfg.to_str().unwrap()), "{stderr}");

    // --debug: the causes one per line (anyhow's report).
    let (out, stderr) = run(&["--debug", "serve", "--config", cfg.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("Caused by:"), "{stderr}");
    assert!(stderr.contains("max_queue"), "{stderr}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_file_that_is_not_a_model_is_a_plain_error_after_uncoloured_log_lines() {
    let d = dir("notamodel");
    let cfg = config_with_warning(&d, "max_queue: 1024", "max_queue: 1024");
    let model = d.join("model.gguf");
    std::fs::write(&model, b"this is not a GGUF file at all").unwrap();
    let (out, stderr) = run(&[
        "serve",
        "--config",
        cfg.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
    ]);
    assert_plain_error(&out, &stderr, 1);
    // The config warning was logged first, without colour codes (stderr is a pipe).
    assert!(
        stderr.contains("WARN") && stderr.contains("no_such_key_here"),
        "{stderr}"
    );
    assert!(!stderr.contains("\x1b["), "{stderr:?}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.starts_with("error: "), "{stderr}");
    assert!(last.contains("model.gguf"), "{stderr}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn command_line_misuse_is_a_usage_message_without_backtrace() {
    let (out, stderr) = run(&["serve", "--no-such-flag"]);
    assert_plain_error(&out, &stderr, 2);
    assert!(stderr.contains("--no-such-flag"), "{stderr}");
    let (out, stderr) = run(&["no-such-command"]);
    assert_plain_error(&out, &stderr, 2);
    assert!(stderr.contains("no-such-command"), "{stderr}");
}

/// A kernel setting with a value it does not take is refused at start, naming the variable,
/// before any model is loaded (so no download, no silent change of kernels).
#[test]
fn a_bad_amx_setting_is_refused_by_name() {
    let out = Command::new(env!("CARGO_BIN_EXE_npu-serving"))
        .args([
            "generate",
            "--model",
            "/no/such/model.gguf",
            "--prompt",
            "x",
        ])
        .env("NPU_SERVING_AMX", "on")
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("npu-serving runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_plain_error(&out, &stderr, 1);
    assert!(stderr.contains("NPU_SERVING_AMX=\"on\""), "{stderr}");
    assert!(!stderr.contains("/no/such/model.gguf"), "{stderr}");
}

#[test]
fn a_bad_prefetch_distance_is_refused_by_name() {
    for bad in ["0", "far", "5000"] {
        let (out, stderr) = run_with_env(
            &[
                "generate",
                "--model",
                "/no/such/model.gguf",
                "--prompt",
                "x",
            ],
            &[("NPU_SERVING_PREFETCH", bad)],
        );
        assert_plain_error(&out, &stderr, 1);
        assert!(
            stderr.contains(&format!("NPU_SERVING_PREFETCH=\"{bad}\"")),
            "{stderr}"
        );
        assert!(stderr.contains("from 1 to 1024"), "{stderr}");
    }
}

/// `bench-model --long-prompts` takes lengths one sequence of its KV pool holds: anything else is
/// refused naming the flag, before any model loads.
#[test]
fn a_bad_long_prompt_length_is_refused() {
    for value in ["0", "9501", "2048,100000"] {
        let (out, stderr) = run(&[
            "bench-model",
            "--model",
            "/no/such/model.gguf",
            "--long-prompts",
            value,
        ]);
        assert_plain_error(&out, &stderr, 1);
        assert!(
            stderr.contains("--long-prompts takes prompt lengths from 1 to 9500 tokens"),
            "{value}: {stderr}"
        );
        assert!(!stderr.contains("/no/such/model.gguf"), "{value}: {stderr}");
    }
}

/// `bench-model --bandwidth-rounds` takes 1 to 64 rounds, and only on the CPU: refused before any
/// model loads.
#[test]
fn bad_bandwidth_rounds_are_refused() {
    for (args, says) in [
        (&["--bandwidth-rounds", "0"][..], "takes 1 to 64 rounds"),
        (&["--bandwidth-rounds", "65"][..], "takes 1 to 64 rounds"),
        (
            &["--bandwidth-rounds", "4", "--device", "cuda"][..],
            "use --device cpu",
        ),
    ] {
        let mut all = vec!["bench-model", "--model", "/no/such/model.gguf"];
        all.extend_from_slice(args);
        let (out, stderr) = run(&all);
        assert_plain_error(&out, &stderr, 1);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

/// `bench-model --alternate-prefetch` takes two distances in range, and only on the CPU: refused
/// before any model loads.
#[test]
fn a_bad_alternate_prefetch_pair_is_refused() {
    for (args, says) in [
        (&["--alternate-prefetch", "20"][..], "takes two distances"),
        (&["--alternate-prefetch", "20,0"][..], "takes two distances"),
        (
            &["--alternate-prefetch", "20,32,64"][..],
            "takes two distances",
        ),
        (
            &["--alternate-prefetch", "20,32", "--device", "cuda"][..],
            "use --device cpu",
        ),
    ] {
        let mut all = vec!["bench-model", "--model", "/no/such/model.gguf"];
        all.extend_from_slice(args);
        let (out, stderr) = run(&all);
        assert_plain_error(&out, &stderr, 1);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("/no/such/model.gguf"),
            "{args:?}: {stderr}"
        );
    }
}

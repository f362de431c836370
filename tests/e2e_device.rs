//! End to end: the device an agent runs on comes from the config (`npu_serving.device`) or
//! `--device`; a device whose backend this binary was not built with is refused at start with
//! the cargo feature that builds it, before any agent starts; a device that is built in but whose
//! vendor libraries this machine lacks (CUDA, CANN) fails at start naming the missing library,
//! never with a panic.

mod e2e_support;

use std::process::Command;

use e2e_support::*;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_npu-serving"))
}

/// Runs `npu-serving` with `args`; (success, stderr).
fn run(args: &[&str]) -> (bool, String) {
    let out = bin().args(args).output().expect("npu-serving runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn serve_refuses_a_device_not_built_in_naming_its_feature() {
    let _serial = serial();
    for (device, feature) in [("cuda", "cuda"), ("ascend", "ascend"), ("npu", "ascend")] {
        if cfg!(feature = "cuda") && feature == "cuda"
            || cfg!(feature = "ascend") && feature == "ascend"
        {
            continue;
        }
        let dir =
            std::env::temp_dir().join(format!("npu-e2e-device-{device}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("config.yaml");
        let opts = ServerOpts {
            device,
            ..ServerOpts::default()
        };
        std::fs::write(&config, opts.yaml()).unwrap();
        let (ok, err) = run(&["serve", "--config", config.to_str().unwrap(), "--port", "0"]);
        assert!(!ok, "serve started on {device}");
        assert!(err.contains("npu_serving.device"), "{err}");
        assert!(err.contains(&format!("--features {feature}")), "{err}");
        assert!(!err.contains("starting agents"), "agents started: {err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn local_commands_take_a_device_and_refuse_one_not_built_in() {
    let _serial = serial();
    if cfg!(feature = "cuda") {
        return;
    }
    for cmd in [
        vec!["generate", "--prompt", "Hi", "--max-tokens", "2"],
        vec!["score", "--prompt", "Hi", "--continuation-ids", "1"],
        vec![
            "bench-model",
            "--skip-long",
            "--skip-prefill",
            "--batches",
            "1",
        ],
    ] {
        let mut args = cmd.clone();
        args.extend(["--device", "cuda"]);
        let (ok, err) = run(&args);
        assert!(!ok, "{cmd:?} ran on cuda");
        assert!(err.contains("--features cuda"), "{cmd:?}: {err}");
    }
    let (ok, err) = run(&["generate", "--prompt", "Hi", "--device", "tpu"]);
    assert!(!ok);
    assert!(err.contains("not a device"), "{err}");
    // The CPU runs, with the same flag.
    let (ok, err) = run(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "3",
        "--device",
        "cpu",
        "--device-id",
        "0",
        "--json",
    ]);
    assert!(ok, "{err}");
}

/// Whether this machine has the NVIDIA driver's CUDA library where the loader looks by default.
#[cfg(feature = "cuda")]
fn cuda_driver_present() -> bool {
    [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/cuda/lib64",
        "/usr/lib/wsl/lib",
    ]
    .iter()
    .any(|d| std::path::Path::new(d).join("libcuda.so.1").exists())
}

#[cfg(feature = "cuda")]
#[test]
fn serve_on_cuda_without_cuda_fails_at_start_naming_the_library() {
    let _serial = serial();
    if cuda_driver_present() {
        eprintln!("SKIPPED: this machine has a CUDA driver (libcuda.so.1), so CUDA is not missing");
        return;
    }
    let opts = ServerOpts {
        device: "cuda",
        ..ServerOpts::default()
    };
    let (status, err) = serve_refused_env(
        "cuda-missing",
        &opts.yaml(),
        &[],
        &[("NPU_SERVING_CUDA_LIB_DIR", None)],
    );
    assert!(!status.success());
    assert_eq!(
        status.code(),
        Some(1),
        "not a clean error exit: {status:?}\n{err}"
    );
    assert!(err.contains("libcuda.so"), "{err}");
    assert!(err.contains("NVIDIA driver"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[cfg(feature = "ascend")]
#[test]
fn serve_on_ascend_without_cann_fails_at_start_naming_the_library_and_set_env() {
    let _serial = serial();
    if std::path::Path::new("/usr/local/Ascend").exists() {
        eprintln!("SKIPPED: CANN is installed at its default path on this machine");
        return;
    }
    let opts = ServerOpts {
        device: "ascend",
        ..ServerOpts::default()
    };
    let (status, err) = serve_refused_env(
        "ascend-missing",
        &opts.yaml(),
        &[],
        &[
            ("ASCEND_HOME_PATH", None),
            ("ASCEND_TOOLKIT_HOME", None),
            ("LD_LIBRARY_PATH", None),
        ],
    );
    assert!(!status.success());
    assert_eq!(
        status.code(),
        Some(1),
        "not a clean error exit: {status:?}\n{err}"
    );
    assert!(err.contains("libascendcl.so"), "{err}");
    assert!(err.contains("set_env.sh"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

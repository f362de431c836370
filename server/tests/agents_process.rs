//! Agent links against the real `npu-serving agent` binary: start-up failures (a model that
//! cannot load, a bad command line) and the end-to-end test with the real model (step, kill -9,
//! detect, restart, SIGSTOP hang).
//!
//! The binary: `$NPU_SERVING_BIN` if set, otherwise it is built with cargo into this test's
//! own target directory (fast when it is up to date).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use npu_protocol::agent::{AgentEngineConfig, DeviceKind};
use npu_protocol::shm::names::pid_alive;
use npu_protocol::shm::SEGMENT_PREFIX;
use npu_protocol::{Admission, SamplingParams, SeqStep, StepPlan};
use npu_server::agents::{AgentFailure, AgentLaunch, AgentLink, AgentSpec};

/// The `npu-serving` executable under test.
fn npu_serving_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("NPU_SERVING_BIN") {
            return PathBuf::from(bin);
        }
        // This test runs from <target>/<profile>/deps/; the binary goes to <target>/<profile>/.
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
        let target_dir = profile_dir.parent().unwrap();
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .args([
                "build",
                "--quiet",
                "-p",
                "npu-serving",
                "--bin",
                "npu-serving",
            ])
            .arg("--target-dir")
            .arg(target_dir)
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cargo.arg("--release");
        }
        let status = cargo
            .status()
            .expect("cannot run cargo to build npu-serving");
        assert!(status.success(), "building npu-serving failed");
        profile_dir.join("npu-serving")
    })
    .clone()
}

fn launch() -> AgentLaunch {
    AgentLaunch {
        exe: Some(npu_serving_bin()),
        startup_timeout: Duration::from_secs(300),
        ..AgentLaunch::default()
    }
}

fn engine_config(model_path: PathBuf) -> AgentEngineConfig {
    AgentEngineConfig {
        swap_space_mb: 0,
        handoff: None,
        kv_memory_fraction: None,
        tensor_parallel: None,
        device: DeviceKind::Cpu,
        device_id: 0,
        model_path,
        num_blocks: 64,
        block_size: 16,
        max_slots: 4,
        max_tokens_per_step: 64,
        max_blocks_per_seq: 16,
        threads: 1,
        long_context: None,
        quantize: None,
        kv_cache_dtype: Default::default(),
        graph_capture: Default::default(),
    }
}

fn our_segments(agent_id: u32) -> Vec<String> {
    let prefix = format!("{SEGMENT_PREFIX}{}-{agent_id}-", std::process::id());
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

#[test]
fn the_real_agent_reports_an_engine_that_cannot_load_as_a_handshake_failure() {
    let missing = PathBuf::from("/nonexistent/npu-serving-test/model.gguf");
    let spec = AgentSpec::new(30, engine_config(missing));
    let err = AgentLink::start(spec, launch()).unwrap_err();
    match &err {
        AgentFailure::StartFailed {
            agent_id: 30,
            reason,
        } => assert!(reason.starts_with("engine: "), "{reason}"),
        other => panic!("expected StartFailed, got {other}"),
    }
    assert!(err.agent_is_down());
    assert!(our_segments(30).is_empty());
}

#[test]
fn the_real_agent_refuses_a_bad_command_line() {
    // The agent never says hello: clap rejects the arguments and the process exits.
    let spec = AgentSpec::new(31, engine_config("/unused".into()));
    let mut bad = launch();
    bad.leading_args = vec!["agent".into(), "--no-such-flag".into()];
    let err = AgentLink::start(spec, bad).unwrap_err();
    assert!(
        matches!(&err, AgentFailure::StartFailed { reason, .. } if reason.contains("exited")),
        "{err}"
    );
}

/// The reference prompt "The capital of France is" and llama.cpp's first greedy tokens on
/// SmolLM2-135M-Instruct Q4_1 (from agent/tests/data/greedy_smollm2_q4_1.jsonl).
const PROMPT_IDS: [u32; 5] = [504, 3575, 282, 4649, 314];
const GREEDY_IDS: [u32; 3] = [7042, 30, 198];

fn model_path() -> PathBuf {
    if let Some(path) = std::env::var_os("NPU_SERVING_MODEL") {
        return path.into();
    }
    let home = std::env::var_os("HOME").expect("HOME is not set");
    Path::new(&home).join(".cache/npu-serving/models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A prefill of the prompt in slot `slot` (blocks 0.. of the sequence are `first_block`..).
fn prefill(step_id: u64, slot: u32, first_block: u32) -> StepPlan {
    let n = PROMPT_IDS.len() as u32;
    StepPlan {
        masks: Vec::new(),
        kv_copies: Vec::new(),
        step_id,
        forget: Vec::new(),
        admit: vec![Admission {
            slot,
            params: SamplingParams {
                top_n: 2,
                ..SamplingParams::greedy()
            },
            lora: None,
        }],
        seqs: vec![SeqStep {
            slot,
            tokens: PROMPT_IDS.to_vec(),
            start_pos: 0,
            block_table: vec![first_block],
            slot_mapping: (0..n).map(|p| first_block * 16 + p).collect(),
            sample: true,
            n_prompt_tokens: n,
            n_draft: 0,
        }],
    }
}

/// The next decode step of slot `slot` after `pos` tokens.
fn decode(step_id: u64, slot: u32, first_block: u32, token: u32, pos: u32) -> StepPlan {
    StepPlan {
        masks: Vec::new(),
        kv_copies: Vec::new(),
        step_id,
        forget: Vec::new(),
        admit: Vec::new(),
        seqs: vec![SeqStep {
            slot,
            tokens: vec![token],
            start_pos: pos,
            block_table: vec![first_block],
            slot_mapping: vec![first_block * 16 + pos],
            sample: true,
            n_prompt_tokens: 0,
            n_draft: 0,
        }],
    }
}

fn kill(pid: u32, signal: i32) {
    // SAFETY: sending a signal to a child process we spawned.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0);
}

/// SIGKILL, then waits until the process is dead (a zombie until the link reaps it).
fn kill_9(pid: u32) {
    kill(pid, libc::SIGKILL);
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat.is_empty()
            || stat
                .rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        {
            return;
        }
        assert!(std::time::Instant::now() < until, "agent {pid} did not die");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// SIGSTOP is delivered asynchronously: waits until every thread of `pid` is stopped.
fn stop(pid: u32) {
    kill(pid, libc::SIGSTOP);
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
        let all_stopped = tasks.filter_map(|t| t.ok()).all(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
            // The state follows the parenthesised command name.
            stat.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('T'))
        });
        if all_stopped {
            return;
        }
        assert!(
            std::time::Instant::now() < until,
            "agent {pid} did not stop"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn end_to_end_with_the_real_model_step_kill_restart() {
    let deadline = Duration::from_secs(120);
    let spec = AgentSpec::new(32, engine_config(model_path()));
    let mut link = AgentLink::start(spec, launch()).unwrap();
    let facts = link.facts().clone();
    assert_eq!(
        (facts.vocab_size, facts.n_layers, facts.n_kv_heads),
        (49152, 30, 3)
    );

    // Greedy prefill and two decode steps match the reference tokens.
    let first = link.step(&prefill(1, 0, 0), deadline).unwrap();
    assert_eq!(first.seqs.len(), 1);
    let token = first.seqs[0].token;
    assert_eq!(token.token, GREEDY_IDS[0]);
    assert!(token.logprob < 0.0 && token.logprob.is_finite());
    assert_eq!(first.seqs[0].top.len(), 2);
    assert_eq!(first.seqs[0].top[0].token, GREEDY_IDS[0]);
    let mut last = token.token;
    for (i, expected) in GREEDY_IDS[1..].iter().enumerate() {
        let pos = PROMPT_IDS.len() as u32 + i as u32;
        let r = link
            .step(&decode(2 + i as u64, 0, 0, last, pos), deadline)
            .unwrap();
        assert_eq!(r.seqs[0].token.token, *expected);
        last = r.seqs[0].token.token;
    }
    link.ping().unwrap();
    link.reset().unwrap();

    // kill -9: detected at the next step, the agent is down, its segment removed.
    let pid = link.pid().unwrap();
    kill_9(pid);
    let err = link.step(&prefill(10, 0, 0), deadline).unwrap_err();
    assert!(err.agent_is_down(), "{err}");
    assert!(!link.is_up());
    assert!(our_segments(32).is_empty());

    // Restart: a fresh agent recomputes the same greedy token.
    link.restart().unwrap();
    assert_ne!(link.pid().unwrap(), pid);
    let again = link.step(&prefill(11, 1, 1), deadline).unwrap();
    assert_eq!(again.seqs[0].token.token, GREEDY_IDS[0]);

    // A stopped (hung) agent is killed at the step deadline.
    let pid = link.pid().unwrap();
    stop(pid);
    let err = link
        .step(
            &decode(12, 1, 1, GREEDY_IDS[0], PROMPT_IDS.len() as u32),
            Duration::from_secs(1),
        )
        .unwrap_err();
    assert!(matches!(err, AgentFailure::Hung { .. }), "{err}");
    assert!(!pid_alive(pid));

    link.restart().unwrap();
    let pid = link.pid().unwrap();
    link.shutdown();
    assert!(!pid_alive(pid));
    assert!(our_segments(32).is_empty());
}

#[test]
fn a_kv_pool_sized_from_free_memory_is_capped_reported_and_pinned_across_restarts() {
    let deadline = Duration::from_secs(120);
    // Half of this host's free memory holds far more than 40 blocks: the cap binds.
    let mut cfg = engine_config(model_path());
    cfg.num_blocks = 40;
    cfg.kv_memory_fraction = Some(0.5);
    let mut link = AgentLink::start(AgentSpec::new(33, cfg), launch()).unwrap();
    assert_eq!(link.facts().kv.device_blocks, 40);
    // Without a cap binding, the pool is the fraction of free memory in whole blocks: a
    // fraction this small of what /proc/meminfo says is free gives a handful of blocks.
    let block_bytes = link.facts().kv.block_bytes;
    assert_eq!(block_bytes, 30 * 2 * 16 * 3 * 64 * 2);

    // Pinned: a restart allocates exactly the pinned pool and still computes the reference.
    link.pin_kv_blocks(24);
    assert_eq!(link.spec().engine.kv_memory_fraction, None);
    let pid = link.pid().unwrap();
    kill_9(pid);
    assert!(link
        .step(&prefill(1, 0, 0), deadline)
        .unwrap_err()
        .agent_is_down());
    link.restart().unwrap();
    assert_eq!(link.facts().kv.device_blocks, 24);
    let r = link.step(&prefill(2, 0, 23), deadline).unwrap();
    assert_eq!(r.seqs[0].token.token, GREEDY_IDS[0]);
    link.shutdown();

    // The fraction of free memory sets the pool when the cap is out of reach.
    let free = meminfo_available();
    let mut cfg = engine_config(model_path());
    cfg.num_blocks = u32::MAX;
    cfg.kv_memory_fraction = Some(20.0 * block_bytes as f64 / free as f64);
    let mut link = AgentLink::start(AgentSpec::new(34, cfg), launch()).unwrap();
    let got = link.facts().kv.device_blocks;
    // Free memory moves between our reading and the agent's (other processes, the agent's own
    // weights): within a factor of two of 20 blocks.
    assert!(
        (10..=40).contains(&got),
        "{got} blocks from a fraction sized for 20"
    );
    let r = link.step(&prefill(1, 0, 3), deadline).unwrap();
    assert_eq!(r.seqs[0].token.token, GREEDY_IDS[0]);
    link.shutdown();

    // Not one block fits: the handshake fails naming the setting.
    let mut cfg = engine_config(model_path());
    cfg.kv_memory_fraction = Some(1e-12);
    let err = AgentLink::start(AgentSpec::new(35, cfg), launch()).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("kv_cache_memory_fraction"), "{text}");
    assert!(text.contains("less than one KV block"), "{text}");
    assert!(our_segments(35).is_empty());
}

/// MemAvailable from /proc/meminfo, bytes: what the CPU backend counts as free device memory.
fn meminfo_available() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .map(|v| v.trim().parse().unwrap())
        .unwrap();
    kb * 1024
}

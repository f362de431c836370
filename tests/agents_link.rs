//! Agent links against real agent processes: the server side spawns this test executable again
//! as the agent (`child_agent` below), which runs the real worker (`npu_agent::worker::run_with`:
//! handshake, shared memory, step loop) around a small deterministic engine, so spawn,
//! handshake, steps, kill -9 and SIGSTOP detection (busy and idle), restart and shutdown are
//! exercised with no model. The same flow with the real model lives in agents_process.rs.

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use npu_agent::engine::{AgentEngineConfig, EngineError, FollowingMasks, ModelFacts};
use npu_agent::worker::{run_with, AgentArgs, StepExecutor};
use npu_protocol::agent::DeviceKind;
use npu_protocol::frame::Hello;
use npu_protocol::shm::names::pid_alive;
use npu_protocol::shm::{
    segment_name, ShmCapacities, ShmLayout, ShmSegment, PROTOCOL_VERSION, SEGMENT_PREFIX,
};
use npu_protocol::{
    Admission, PlanSource, SamplingParams, SeqResult, SeqStep, StepPlan, StepResult, StepTiming,
    TokenLogprob, TokenMask,
};
use npu_server::agents::{
    validate_hello, AgentFailure, AgentLaunch, AgentLink, AgentPool, AgentSpec,
};

const MODE_VAR: &str = "NPU_SERVING_TEST_AGENT_MODE";

/// A stand-in model: the next token of a slot is its last token plus the slot number (under a
/// token mask, the lowest token it allows; words that follow the plan are waited for after
/// the "forward pass"); slots must be admitted first; slot 13 always fails.
struct EchoEngine {
    facts: ModelFacts,
    admitted: HashSet<u32>,
}

impl StepExecutor for EchoEngine {
    fn facts(&self) -> &ModelFacts {
        &self.facts
    }

    fn step(
        &mut self,
        plan: &dyn PlanSource,
        following: FollowingMasks<'_>,
    ) -> Result<StepResult, EngineError> {
        let mut plan = plan.to_plan();
        for slot in &plan.forget {
            self.admitted.remove(slot);
        }
        self.admitted.extend(plan.admit.iter().map(|a| a.slot));
        if plan.masks_follow() {
            plan.masks = following().map_err(EngineError::MasksLost)?;
        }
        let lowest_allowed = |slot: u32| {
            let m = plan.masks.iter().find(|m| m.slot == slot)?;
            (0..m.words.len() as u32 * 32)
                .find(|&t| m.words[(t / 32) as usize] >> (t % 32) & 1 == 1)
        };
        let mut seqs = Vec::new();
        for seq in &plan.seqs {
            if seq.slot == 13 {
                return Err(EngineError::BadPlan("slot 13 always fails".into()));
            }
            if !self.admitted.contains(&seq.slot) {
                return Err(EngineError::BadPlan(format!(
                    "slot {} not admitted",
                    seq.slot
                )));
            }
            if seq.sample {
                let token = lowest_allowed(seq.slot)
                    .unwrap_or(seq.tokens.last().copied().unwrap_or(0) + seq.slot);
                seqs.push(SeqResult {
                    slot: seq.slot,
                    token: TokenLogprob {
                        token,
                        logprob: -0.5,
                    },
                    top: vec![TokenLogprob {
                        token,
                        logprob: -0.5,
                    }],
                    extra: Vec::new(),
                });
            }
        }
        Ok(StepResult {
            transfer: Default::default(),
            failed: Vec::new(),
            step_id: plan.step_id,
            seqs,
            timing: StepTiming {
                forward_us: 1,
                sample_us: 1,
                total_us: 2,
            },
        })
    }

    fn reset(&mut self) {
        self.admitted.clear();
    }
}

fn echo_facts() -> ModelFacts {
    ModelFacts {
        kv: Default::default(),
        name: "echo".into(),
        architecture: "test".into(),
        vocab_size: 1 << 20,
        n_layers: 1,
        hidden: 1,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 1,
        context_length: 4096,
        eos_ids: vec![0],
        bos_id: None,
        backend: "echo".into(),
    }
}

/// Entry point of the agent processes the tests spawn; does nothing in a normal test run.
#[test]
#[ignore = "entry point of the child agent processes, not a test by itself"]
fn child_agent() {
    let Some(mode) = std::env::var_os(MODE_VAR) else {
        return;
    };
    let argv: Vec<String> = std::env::args().collect();
    let rest = argv
        .iter()
        .position(|a| a == "--")
        .map_or(&[][..], |i| &argv[i + 1..]);
    let args = parse_agent_args(rest);
    let outcome = match mode.to_str() {
        Some("echo") => run_with(args, |_cfg: &AgentEngineConfig| {
            Ok(EchoEngine {
                facts: echo_facts(),
                admitted: HashSet::new(),
            })
        }),
        Some("load-fails") => run_with(args, |cfg: &AgentEngineConfig| {
            Err::<EchoEngine, _>(EngineError::BadConfig(format!(
                "cannot load {}",
                cfg.model_path.display()
            )))
        }),
        other => panic!("unknown child mode {other:?}"),
    };
    std::process::exit(if outcome.is_ok() { 0 } else { 1 });
}

fn parse_agent_args(rest: &[String]) -> AgentArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: AgentArgs,
    }
    let argv = std::iter::once("agent".to_string()).chain(rest.iter().cloned());
    Cli::parse_from(argv).args
}

fn launch(mode: &str) -> AgentLaunch {
    AgentLaunch {
        exe: Some(std::env::current_exe().unwrap()),
        leading_args: ["child_agent", "--exact", "--include-ignored", "-q", "--"]
            .map(OsString::from)
            .to_vec(),
        env: vec![(MODE_VAR.into(), mode.into())],
        startup_timeout: Duration::from_secs(30),
        shutdown_grace: Duration::from_secs(5),
        ..AgentLaunch::default()
    }
}

fn spec(agent_id: u32) -> AgentSpec {
    AgentSpec::new(
        agent_id,
        AgentEngineConfig {
            swap_space_mb: 0,
            handoff: None,
            kv_memory_fraction: None,
            tensor_parallel: None,
            device: DeviceKind::Cpu,
            device_id: 0,
            model_path: PathBuf::from("/echo/model.gguf"),
            num_blocks: 64,
            block_size: 16,
            max_slots: 16,
            max_tokens_per_step: 64,
            max_blocks_per_seq: 8,
            threads: 1,
            long_context: None,
            quantize: None,
            kv_cache_dtype: Default::default(),
            graph_capture: Default::default(),
        },
    )
}

fn plan(step_id: u64, admit: &[u32], seqs: &[(u32, u32)]) -> StepPlan {
    StepPlan {
        kv_copies: Vec::new(),
        masks: Vec::new(),
        step_id,
        forget: Vec::new(),
        admit: admit
            .iter()
            .map(|&slot| Admission {
                slot,
                params: SamplingParams::greedy(),
                lora: None,
            })
            .collect(),
        seqs: seqs
            .iter()
            .map(|&(slot, token)| SeqStep {
                slot,
                tokens: vec![token],
                start_pos: 0,
                block_table: vec![slot],
                slot_mapping: vec![slot * 16],
                sample: true,
                n_prompt_tokens: 1,
                n_draft: 0,
            })
            .collect(),
    }
}

/// Segments in /dev/shm created by this process for `agent_id`.
fn our_segments(agent_id: u32) -> Vec<String> {
    let prefix = format!("{SEGMENT_PREFIX}{}-{agent_id}-", std::process::id());
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

fn kill(pid: u32, signal: i32) {
    // SAFETY: sending a signal to a child process we spawned.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0);
}

/// SIGKILL, then waits until the process is dead (a zombie until the link reaps it): its
/// leader a zombie and no other thread left, since the leader turns zombie while other threads
/// may still be exiting with the process's descriptors open.
fn kill_9(pid: u32) {
    kill(pid, libc::SIGKILL);
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
        if stat.is_empty()
            || (threads <= 1
                && stat
                    .rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z')))
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

const STEP_DEADLINE: Duration = Duration::from_secs(30);

#[test]
fn steps_resets_pings_and_shutdown_with_a_real_agent_process() {
    let mut link = AgentLink::start(spec(10), launch("echo")).unwrap();
    assert_eq!(link.facts(), &echo_facts());
    assert_eq!(our_segments(10).len(), 1);
    let pid = link.pid().unwrap();
    assert_ne!(pid, std::process::id());

    let result = link
        .step(&plan(1, &[2, 3], &[(2, 100), (3, 200)]), STEP_DEADLINE)
        .unwrap();
    assert_eq!(result.step_id, 1);
    let tokens: Vec<(u32, u32)> = result
        .seqs
        .iter()
        .map(|s| (s.slot, s.token.token))
        .collect();
    assert_eq!(tokens, vec![(2, 102), (3, 203)]);
    assert_eq!(result.timing.total_us, 2);

    // Submit now, complete later.
    link.submit(&plan(2, &[], &[(3, 7)])).unwrap();
    assert_eq!(link.in_flight(), Some(2));
    assert!(matches!(
        link.submit(&plan(3, &[], &[(3, 7)])),
        Err(AgentFailure::Busy { step_id: 2, .. })
    ));
    assert!(matches!(link.ping(), Err(AgentFailure::Busy { .. })));
    let until = Instant::now() + STEP_DEADLINE;
    let result = loop {
        if let Some(result) = link.try_complete().unwrap() {
            break result;
        }
        assert!(
            Instant::now() < until,
            "no result before the safety deadline"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!((result.step_id, result.seqs[0].token.token), (2, 10));
    assert!(matches!(
        link.try_complete(),
        Err(AgentFailure::NothingInFlight { .. })
    ));

    // A step the engine fails is reported; the agent stays up.
    let err = link
        .step(&plan(4, &[13], &[(13, 1)]), STEP_DEADLINE)
        .unwrap_err();
    assert!(
        matches!(&err, AgentFailure::StepFailed { step_id: 4, message, .. } if message.contains("slot 13")),
        "{err}"
    );
    assert!(!err.agent_is_down());
    // A plan over capacity is refused before it is sent; the agent stays up.
    let big = plan(5, &[], &[(2, 1); 17]);
    let err = link.step(&big, STEP_DEADLINE).unwrap_err();
    assert!(
        matches!(err, AgentFailure::PlanRefused { step_id: 5, .. }),
        "{err}"
    );
    assert!(link.is_up());

    link.ping().unwrap();
    link.reset().unwrap();
    // After the reset the engine has forgotten slot 2.
    let err = link
        .step(&plan(6, &[], &[(2, 1)]), STEP_DEADLINE)
        .unwrap_err();
    assert!(
        matches!(&err, AgentFailure::StepFailed { message, .. } if message.contains("not admitted"))
    );

    link.shutdown();
    assert!(!link.is_up());
    assert!(!pid_alive(pid), "the agent process is still there");
    assert!(our_segments(10).is_empty());
    assert!(matches!(link.ping(), Err(AgentFailure::Down { .. })));
}

#[test]
fn a_killed_agent_is_detected_and_restarted() {
    let mut link = AgentLink::start(spec(11), launch("echo")).unwrap();
    link.step(&plan(1, &[1], &[(1, 5)]), STEP_DEADLINE).unwrap();
    let old_pid = link.pid().unwrap();
    let old_segment = link.segment_name().unwrap().to_string();
    kill_9(old_pid);

    let err = link
        .step(&plan(2, &[], &[(1, 5)]), STEP_DEADLINE)
        .unwrap_err();
    assert!(err.agent_is_down(), "{err}");
    assert!(
        matches!(&err, AgentFailure::Exited { status, .. } if status.contains("9"))
            || matches!(err, AgentFailure::Disconnected { .. }),
        "{err}"
    );
    assert!(!link.is_up());
    assert!(
        our_segments(11).is_empty(),
        "the dead agent's segment was kept"
    );
    assert!(matches!(
        link.step(&plan(3, &[], &[(1, 5)]), STEP_DEADLINE),
        Err(AgentFailure::Down { .. })
    ));

    link.restart().unwrap();
    assert_eq!(link.restarts(), 1);
    assert_ne!(link.pid().unwrap(), old_pid);
    assert_ne!(link.segment_name().unwrap(), old_segment);
    assert_eq!(our_segments(11).len(), 1);
    // The new agent starts empty: the request must be admitted again.
    let result = link.step(&plan(4, &[1], &[(1, 5)]), STEP_DEADLINE).unwrap();
    assert_eq!(result.seqs[0].token.token, 6);
}

#[test]
fn an_idle_agent_that_dies_is_noticed_without_a_step_and_reaped() {
    let mut link = AgentLink::start(spec(21), launch("echo")).unwrap();
    link.step(&plan(1, &[1], &[(1, 5)]), STEP_DEADLINE).unwrap();
    assert!(link.check_idle().is_none(), "a live idle agent is fine");
    let pid = link.pid().unwrap();
    kill_9(pid);
    // The socket closes with the process: the very first look sees it.
    let seen = Instant::now();
    let err = link
        .check_idle()
        .expect("the death is noticed at the first look");
    assert!(
        seen.elapsed() < Duration::from_secs(1),
        "{:?}",
        seen.elapsed()
    );
    assert!(err.agent_is_down(), "{err}");
    assert!(
        matches!(&err, AgentFailure::Exited { status, .. } if status.contains("9")),
        "{err}"
    );
    assert!(!link.is_up());
    assert!(
        !pid_alive(pid),
        "the dead agent was not reaped (a zombie is left)"
    );
    assert!(our_segments(21).is_empty());
    // Once down, it is not reported again.
    assert!(link.check_idle().is_none());
    link.restart().unwrap();
    assert!(link.check_idle().is_none());
    link.step(&plan(2, &[1], &[(1, 5)]), STEP_DEADLINE).unwrap();
}

/// The open descriptors of a process, as their /proc link targets (e.g. `socket:[123]`).
fn open_fds(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|t| t.to_string_lossy().into_owned())
        .collect()
}

#[test]
fn the_agent_learns_its_segment_and_secret_from_its_socket_not_its_command_line() {
    let link = AgentLink::start(spec(22), launch("echo")).unwrap();
    let pid = link.pid().unwrap();
    let segment = link.segment_name().unwrap().to_string();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert!(cmdline.contains("--agent-id 22 --control-fd "), "{cmdline}");
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    let bare = segment.trim_start_matches('/');
    for (what, text) in [("command line", &*cmdline), ("environment", &*environ)] {
        assert!(!text.contains(bare), "the segment name is in the {what}");
        assert!(
            !text.contains("model_path"),
            "the engine config is in the {what}"
        );
    }
    // Its only socket is its end of the pair (no listener, no other connection).
    let sockets: Vec<String> = open_fds(pid)
        .into_iter()
        .filter(|t| t.starts_with("socket:"))
        .collect();
    assert_eq!(sockets.len(), 1, "{sockets:?}");
    // And this process has no listening socket for agents: nothing to squat on.
    let listening = std::fs::read_to_string("/proc/net/unix").unwrap();
    let ours: Vec<String> = open_fds(std::process::id())
        .into_iter()
        .filter_map(|t| {
            t.strip_prefix("socket:[")
                .map(|i| i.trim_end_matches(']').to_string())
        })
        .collect();
    for line in listening.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        // Fields: Num RefCount Protocol Flags Type St Inode [Path]; flag 0x10000 = listening.
        let listens = u32::from_str_radix(f[3], 16).unwrap_or(0) & 0x10000 != 0;
        assert!(
            !(listens && ours.contains(&f[6].to_string())),
            "a listening Unix socket: {line}"
        );
    }
}

/// Mask words that follow the plan reach a real agent process through its segment and a
/// `Masks` frame; words never handed over take the agent down (it waits for them mid-step),
/// and it comes back.
#[test]
fn mask_words_follow_the_plan_to_a_real_agent_process() {
    let mut link = AgentLink::start(spec(23).with_token_masks(256), launch("echo")).unwrap();
    let masked = |step_id, admit: &[u32]| {
        let mut p = plan(step_id, admit, &[(2, 100), (3, 200)]);
        p.masks = vec![TokenMask {
            slot: 3,
            words: Vec::new(),
        }];
        p
    };
    let (tx, rx) = crossbeam_channel::bounded(1);
    let mut words = vec![0u32; 8];
    words[1] = 1 << 9; // token 41 alone
    tx.send(vec![TokenMask { slot: 3, words }]).unwrap();
    let result = link
        .step_with_masks(&masked(1, &[2, 3]), Some(&rx), STEP_DEADLINE)
        .unwrap();
    let tokens: Vec<(u32, u32)> = result
        .seqs
        .iter()
        .map(|s| (s.slot, s.token.token))
        .collect();
    assert_eq!(tokens, vec![(2, 102), (3, 41)]);
    // Words for another slot than the plan masks are refused before they reach the agent.
    let (tx, rx) = crossbeam_channel::bounded(1);
    tx.send(vec![TokenMask {
        slot: 2,
        words: vec![1; 8],
    }])
    .unwrap();
    let err = link
        .step_with_masks(&masked(2, &[]), Some(&rx), STEP_DEADLINE)
        .unwrap_err();
    assert!(
        matches!(err, AgentFailure::PlanRefused { step_id: 2, .. }),
        "{err}"
    );
    assert!(!link.is_up());
    link.restart().unwrap();
    // The engine drops the words: the agent is stopped, not left waiting.
    let (tx, rx) = crossbeam_channel::bounded::<Vec<TokenMask>>(1);
    drop(tx);
    let pid = link.pid().unwrap();
    let err = link
        .step_with_masks(&masked(3, &[2, 3]), Some(&rx), STEP_DEADLINE)
        .unwrap_err();
    assert!(
        matches!(err, AgentFailure::MasksLost { step_id: 3, .. }),
        "{err}"
    );
    assert!(
        !pid_alive(pid),
        "the agent waiting for its masks was not stopped"
    );
    link.restart().unwrap();
    link.step(&plan(4, &[1], &[(1, 5)]), STEP_DEADLINE).unwrap();
}

#[test]
fn a_hung_agent_is_killed_at_the_deadline() {
    let mut link = AgentLink::start(spec(12), launch("echo")).unwrap();
    let pid = link.pid().unwrap();
    stop(pid);
    let err = link
        .step(&plan(1, &[1], &[(1, 5)]), Duration::from_millis(300))
        .unwrap_err();
    assert!(
        matches!(&err, AgentFailure::Hung { what, .. } if what == "step 1"),
        "{err}"
    );
    assert!(!pid_alive(pid), "the hung agent was not killed");
    link.restart().unwrap();
    link.step(&plan(2, &[1], &[(1, 5)]), STEP_DEADLINE).unwrap();
}

#[test]
fn polling_notices_an_agent_that_dies_mid_step() {
    let mut link = AgentLink::start(spec(13), launch("echo")).unwrap();
    let pid = link.pid().unwrap();
    stop(pid);
    link.submit(&plan(1, &[1], &[(1, 5)])).unwrap();
    assert!(link.try_complete().unwrap().is_none());
    kill(pid, libc::SIGKILL);
    let until = Instant::now() + STEP_DEADLINE;
    let err = loop {
        match link.try_complete() {
            Ok(None) => {}
            Ok(Some(r)) => panic!("a stopped agent answered {r:?}"),
            Err(e) => break e,
        }
        assert!(
            Instant::now() < until,
            "death not noticed before the safety deadline"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(err.agent_is_down(), "{err}");
    assert!(!link.is_up());
}

#[test]
fn an_engine_that_cannot_load_fails_the_handshake_clearly() {
    let err = AgentLink::start(spec(14), launch("load-fails")).unwrap_err();
    match &err {
        AgentFailure::StartFailed {
            agent_id: 14,
            reason,
        } => {
            assert!(reason.contains("cannot load /echo/model.gguf"), "{reason}")
        }
        other => panic!("expected StartFailed, got {other}"),
    }
    assert!(our_segments(14).is_empty());
}

#[test]
fn processes_that_never_become_agents_are_refused() {
    let mut bad = launch("echo");
    bad.exe = Some("/nonexistent/npu-serving".into());
    let err = AgentLink::start(spec(15), bad).unwrap_err();
    assert!(
        matches!(err, AgentFailure::Spawn { agent_id: 15, .. }),
        "{err}"
    );

    let mut exits = launch("echo");
    exits.exe = Some("false".into());
    exits.leading_args.clear();
    let err = AgentLink::start(spec(15), exits).unwrap_err();
    assert!(
        matches!(&err, AgentFailure::StartFailed { reason, .. } if reason.contains("exited")),
        "{err}"
    );

    let mut silent = launch("echo");
    silent.exe = Some("sh".into());
    silent.leading_args = ["-c", "exec sleep 30"].map(OsString::from).to_vec();
    silent.startup_timeout = Duration::from_millis(300);
    let err = AgentLink::start(spec(15), silent).unwrap_err();
    assert!(matches!(err, AgentFailure::StartTimeout { .. }), "{err}");
    assert!(our_segments(15).is_empty());
}

#[test]
fn a_pool_steps_agents_together_and_cleans_up() {
    let mut pool = AgentPool::start(vec![spec(16), spec(17)], launch("echo")).unwrap();
    assert_eq!(pool.len(), 2);
    let plans = vec![
        Some(plan(1, &[1], &[(1, 10)])),
        Some(plan(1, &[2], &[(2, 20)])),
    ];
    let outcomes = pool.step_all(&plans, STEP_DEADLINE);
    let tokens: Vec<u32> = outcomes
        .into_iter()
        .map(|o| o.unwrap().unwrap().seqs[0].token.token)
        .collect();
    assert_eq!(tokens, vec![11, 22]);
    let outcomes = pool.step_all(&[None, Some(plan(2, &[], &[(2, 1)]))], STEP_DEADLINE);
    assert!(outcomes[0].is_none());
    assert_eq!(outcomes[1].as_ref().unwrap().as_ref().unwrap().step_id, 2);
    pool.shutdown();
    assert!(our_segments(16).is_empty() && our_segments(17).is_empty());
}

#[test]
fn a_pool_start_removes_stale_segments_and_fails_as_a_whole() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let random = segment_name(0)
        .unwrap()
        .rsplit('-')
        .next()
        .unwrap()
        .to_string();
    let stale = format!("/{SEGMENT_PREFIX}{dead}-0-{random}");
    let layout = ShmLayout::new(ShmCapacities::default()).unwrap();
    std::mem::forget(ShmSegment::create(&stale, &layout).unwrap());

    let mut specs = vec![spec(18), spec(19)];
    specs[1].engine.model_path = "/echo/other.gguf".into();
    let err = AgentPool::start(specs, launch("load-fails")).unwrap_err();
    assert_eq!(err.agent_id(), 18);
    assert!(!std::path::Path::new(&format!("/dev/shm{stale}")).exists());
    assert!(our_segments(18).is_empty() && our_segments(19).is_empty());
}

type HelloEdit = fn(&mut Hello);

#[test]
fn hellos_that_do_not_match_the_server_are_refused() {
    let layout = ShmLayout::new(spec(20).capacities).unwrap();
    let seg = ShmSegment::create(&segment_name(20).unwrap(), &layout).unwrap();
    let good = Hello {
        agent_id: 20,
        pid: 777,
        protocol_version: PROTOCOL_VERSION,
        launch_token: 0xfeed,
        layout_hash: layout.hash(),
        segment_name: seg.name().to_string(),
        model_facts_json: serde_json::to_string(&echo_facts()).unwrap(),
    };
    assert_eq!(
        validate_hello(&good, 20, 777, &seg, 0xfeed).unwrap(),
        echo_facts()
    );
    let cases: [(&str, HelloEdit); 7] = [
        ("protocol version", |h| h.protocol_version += 1),
        ("secret", |h| h.launch_token ^= 1),
        ("agent 21", |h| h.agent_id = 21),
        ("pid", |h| h.pid = 1),
        ("segment", |h| h.segment_name = "/other".into()),
        ("layout hash", |h| h.layout_hash ^= 1),
        ("model facts", |h| h.model_facts_json = "{}".into()),
    ];
    for (what, break_it) in cases {
        let mut hello = good.clone();
        break_it(&mut hello);
        let reason = validate_hello(&hello, 20, 777, &seg, 0xfeed).unwrap_err();
        assert!(reason.contains(what), "{what}: {reason}");
    }
}

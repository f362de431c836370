//! The agent process (`npu-serving agent --agent-id N --control-fd FD`): takes over the private
//! control socket the server handed down (one end of a Unix socket pair, inherited at spawn;
//! nobody else can reach it), reads the server's `Setup` frame (its segment, engine config and
//! launch secret: nothing secret is on the command line), opens the shared-memory segment the
//! server created, loads the engine, says Hello, then serves steps until Shutdown or until the
//! server goes away. The step loop itself lives in `serve`.

mod serve;

use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use npu_protocol::agent::{AgentLoraConfig, LORA_CONFIG_KEY};
use npu_protocol::frame::{read_frame, write_frame, Frame, FrameError, Hello, Setup};
use npu_protocol::shm::{ShmError, ShmSegment, PROTOCOL_VERSION};
use thiserror::Error;

use crate::engine::{AgentEngine, AgentEngineConfig, EngineError};

pub use serve::{resident_bytes, serve, serve_reloading, Reload, StepExecutor};

pub use npu_protocol::agent::AgentArgs;

/// Why the agent process stopped with an error.
#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("bad engine config from the server: {0}")]
    Config(#[from] serde_json::Error),
    #[error(
        "--control-fd {fd}: {reason} (agents are started by `npu-serving serve`, not by hand)"
    )]
    ControlFd { fd: RawFd, reason: String },
    #[error("shared memory: {0}")]
    Shm(#[from] ShmError),
    #[error("segment capacity {what} = {segment} exceeds the engine's {engine}")]
    CapacityMismatch {
        what: &'static str,
        segment: u32,
        engine: u32,
    },
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    #[error("control connection: {0}")]
    Frame(#[from] FrameError),
    #[error("the server refused this agent: {0}")]
    Refused(String),
    #[error("protocol error: {0}")]
    Protocol(String),
}

/// How long the agent waits for the server's Setup, and for its answer to Hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs the agent process to completion with the real engine. Returns Ok after Shutdown or
/// when the server closes the connection; start-up errors are also reported to the server
/// (StartFailed) before return.
pub fn run(args: AgentArgs) -> Result<(), WorkerError> {
    run_with(args, AgentEngine::load)
}

/// `run` with the engine built by `load` from the config (the real one is `AgentEngine::load`).
pub fn run_with<E, L>(args: AgentArgs, load: L) -> Result<(), WorkerError>
where
    E: StepExecutor,
    L: FnMut(&AgentEngineConfig) -> Result<E, EngineError>,
{
    let mut stream = control_socket(args.control_fd)?;
    stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(FrameError::Io)?;
    let setup = match read_frame(&mut stream)? {
        Frame::Setup(setup) => setup,
        other => {
            return Err(WorkerError::Protocol(format!(
                "expected Setup, got {}",
                other.kind()
            )))
        }
    };
    // LoRA settings ride in the same config JSON (`AgentLoraConfig`); every load (at start
    // and when waking from a sleep that dropped the engine) turns them on.
    let lora = AgentLoraConfig::read_from(&setup.config_json).map_err(|e| e.to_string());
    let mut inner = load;
    let mut load = move |cfg: &AgentEngineConfig| -> Result<E, EngineError> {
        let lora = lora.clone().map_err(|e| {
            EngineError::BadConfig(format!("the LoRA settings ({LORA_CONFIG_KEY}): {e}"))
        })?;
        let mut engine = inner(cfg)?;
        if let Some(l) = &lora {
            engine.enable_lora(l)?;
        }
        Ok(engine)
    };
    let (segment, engine) = match start(&args, &setup, &mut load) {
        Ok(started) => started,
        Err(e) => {
            let _ = write_frame(
                &mut stream,
                &Frame::StartFailed {
                    reason: e.to_string(),
                },
            );
            return Err(e);
        }
    };
    let facts_json = serde_json::to_string(engine.facts())?;
    write_frame(
        &mut stream,
        &Frame::Hello(Hello {
            agent_id: args.agent_id,
            pid: std::process::id(),
            protocol_version: PROTOCOL_VERSION,
            launch_token: setup.launch_token,
            layout_hash: segment.layout().hash(),
            segment_name: segment.name().to_string(),
            model_facts_json: facts_json,
        }),
    )?;
    match read_frame(&mut stream)? {
        Frame::Welcome => {}
        Frame::Refuse { reason } => return Err(WorkerError::Refused(reason)),
        other => {
            return Err(WorkerError::Protocol(format!(
                "expected Welcome or Refuse, got {}",
                other.kind()
            )))
        }
    }
    stream.set_read_timeout(None).map_err(FrameError::Io)?;
    tracing::info!(agent = args.agent_id, "agent ready");
    // Waking from a sleep that dropped the engine loads it as here (the same config).
    // The pool keeps the blocks it got at start (the server's block manager is sized to them),
    // not sized from free memory again.
    let mut cfg: AgentEngineConfig = serde_json::from_str(&setup.config_json)?;
    let blocks = engine.facts().kv.device_blocks;
    if blocks > 0 {
        cfg.num_blocks = blocks;
        cfg.kv_memory_fraction = None;
    }
    let mut reload = || load(&cfg);
    serve_reloading(&mut stream, segment, engine, Some(&mut reload))
}

/// Takes ownership of the inherited control socket `fd` after checking that it is an open Unix
/// stream socket (a wrong number fails here, not in some later read), and keeps it from leaking
/// into any process this one might start.
fn control_socket(fd: RawFd) -> Result<UnixStream, WorkerError> {
    let refuse = |reason: String| WorkerError::ControlFd { fd, reason };
    if fd < 3 {
        return Err(refuse("0, 1 and 2 are the standard streams".into()));
    }
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one `stat` through a valid pointer; a bad fd is an error, not UB.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(refuse(format!("not an open file descriptor ({e})")));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(refuse("not a socket".into()));
    }
    for (opt, want, what) in [
        (libc::SO_DOMAIN, libc::AF_UNIX, "a Unix-domain socket"),
        (libc::SO_TYPE, libc::SOCK_STREAM, "a stream socket"),
    ] {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into the c_int `v` points at.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc != 0 || v != want {
            return Err(refuse(format!("not {what}")));
        }
    }
    // SAFETY: fcntl on an open fd (checked above) with integer arguments only.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(refuse(format!("cannot set close-on-exec ({e})")));
    }
    // SAFETY: `fd` is an open Unix stream socket (checked above) that the server handed to this
    // process for this one use; nothing else here owns it, so the stream becomes its one owner.
    Ok(unsafe { UnixStream::from_raw_fd(fd) })
}

/// Checks the Setup, opens and checks the segment, then loads the engine for it.
fn start<E, L>(
    args: &AgentArgs,
    setup: &Setup,
    load: &mut L,
) -> Result<(ShmSegment, E), WorkerError>
where
    L: FnMut(&AgentEngineConfig) -> Result<E, EngineError>,
{
    if setup.agent_id != args.agent_id {
        return Err(WorkerError::Protocol(format!(
            "Setup is for agent {}, this is agent {}",
            setup.agent_id, args.agent_id
        )));
    }
    let cfg: AgentEngineConfig = serde_json::from_str(&setup.config_json)?;
    let segment = ShmSegment::open(&setup.segment_name)?;
    check_capacities(&segment, &cfg)?;
    let engine = load(&cfg)?;
    Ok((segment, engine))
}

/// The segment must not carry more than the engine was sized for.
fn check_capacities(segment: &ShmSegment, cfg: &AgentEngineConfig) -> Result<(), WorkerError> {
    let caps = segment.layout().capacities();
    let pairs = [
        ("max_slots", caps.max_slots, cfg.max_slots),
        (
            "max_tokens_per_step",
            caps.max_tokens_per_step,
            cfg.max_tokens_per_step,
        ),
        (
            "max_blocks_per_seq",
            caps.max_blocks_per_seq,
            cfg.max_blocks_per_seq,
        ),
    ];
    for (what, segment, engine) in pairs {
        if segment > engine {
            return Err(WorkerError::CapacityMismatch {
                what,
                segment,
                engine,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Start-up of the real `run` over a real socket pair: each start-up failure reaches the
    //! server as a StartFailed frame that says what went wrong; a descriptor that is not a
    //! control socket is refused before anything is read from it.

    use std::os::fd::IntoRawFd;
    use std::thread;

    use npu_protocol::shm::{segment_name, ShmCapacities, ShmLayout};

    use super::*;
    use npu_protocol::agent::DeviceKind;

    fn engine_config(max_tokens_per_step: u32) -> AgentEngineConfig {
        AgentEngineConfig {
            swap_space_mb: 0,
            handoff: None,
            kv_memory_fraction: None,
            tensor_parallel: None,
            device: DeviceKind::Cpu,
            device_id: 0,
            model_path: "/nonexistent/npu-serving-test/model.gguf".into(),
            num_blocks: 64,
            block_size: 16,
            max_slots: 8,
            max_tokens_per_step,
            max_blocks_per_seq: 16,
            threads: 1,
            long_context: None,
            quantize: None,
            kv_cache_dtype: Default::default(),
            graph_capture: Default::default(),
        }
    }

    /// Runs the agent in a thread on one end of a fresh socket pair and sends it a Setup for
    /// agent `setup_agent`; returns the first frame it answers and the agent's outcome.
    fn start_agent(
        setup_agent: u32,
        shm: &str,
        config_json: String,
    ) -> (Frame, Result<(), WorkerError>) {
        let (mut server, agent_end) = UnixStream::pair().unwrap();
        let args = AgentArgs {
            agent_id: 4,
            control_fd: agent_end.into_raw_fd(),
        };
        let agent = thread::spawn(move || run(args));
        let setup = Setup {
            agent_id: setup_agent,
            launch_token: 77,
            segment_name: shm.to_string(),
            config_json,
        };
        write_frame(&mut server, &Frame::Setup(setup)).unwrap();
        let frame = read_frame(&mut server).unwrap();
        (frame, agent.join().unwrap())
    }

    fn segment() -> ShmSegment {
        let layout = ShmLayout::new(ShmCapacities {
            max_kv_copies: 0,
            max_slots: 8,
            max_seqs_per_step: 8,
            max_tokens_per_step: 128,
            max_blocks_per_seq: 16,
            max_admissions: 8,
            max_forget: 8,
            max_top_n: 4,
            max_masks: 0,
            mask_words: 0,
        })
        .unwrap();
        ShmSegment::create(&segment_name(4).unwrap(), &layout).unwrap()
    }

    fn start_failed(frame: Frame) -> String {
        match frame {
            Frame::StartFailed { reason } => reason,
            other => panic!("expected StartFailed, got {other:?}"),
        }
    }

    #[test]
    fn an_engine_that_cannot_load_is_reported_to_the_server() {
        let seg = segment();
        let cfg = serde_json::to_string(&engine_config(128)).unwrap();
        let (frame, outcome) = start_agent(4, seg.name(), cfg);
        let reason = start_failed(frame);
        assert!(reason.starts_with("engine: "), "{reason}");
        assert!(
            matches!(outcome, Err(WorkerError::Engine(_))),
            "{outcome:?}"
        );
    }

    #[test]
    fn a_missing_segment_is_reported_to_the_server() {
        let cfg = serde_json::to_string(&engine_config(128)).unwrap();
        let (frame, outcome) = start_agent(4, "/npu-serving-test-missing-segment", cfg);
        let reason = start_failed(frame);
        assert!(reason.contains("shm_open"), "{reason}");
        assert!(matches!(outcome, Err(WorkerError::Shm(_))), "{outcome:?}");
    }

    #[test]
    fn a_segment_larger_than_the_engine_is_reported_to_the_server() {
        let seg = segment();
        let cfg = serde_json::to_string(&engine_config(64)).unwrap();
        let (frame, outcome) = start_agent(4, seg.name(), cfg);
        let reason = start_failed(frame);
        assert!(reason.contains("max_tokens_per_step = 128"), "{reason}");
        assert!(matches!(outcome, Err(WorkerError::CapacityMismatch { .. })));
    }

    #[test]
    fn bad_config_json_is_reported_to_the_server() {
        let seg = segment();
        let (frame, outcome) = start_agent(4, seg.name(), "{\"model_path\": 3}".into());
        assert!(start_failed(frame).starts_with("bad engine config"));
        assert!(matches!(outcome, Err(WorkerError::Config(_))));
    }

    #[test]
    fn a_setup_for_another_agent_is_reported_to_the_server() {
        let seg = segment();
        let cfg = serde_json::to_string(&engine_config(128)).unwrap();
        let (frame, outcome) = start_agent(5, seg.name(), cfg);
        let reason = start_failed(frame);
        assert!(reason.contains("Setup is for agent 5"), "{reason}");
        assert!(matches!(outcome, Err(WorkerError::Protocol(_))));
    }

    #[test]
    fn a_descriptor_that_is_not_a_control_socket_is_refused() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (dgram, _peer) = std::os::unix::net::UnixDatagram::pair().unwrap();
        // Far above any descriptor a test process opens (a closed low number could be reused
        // by another test thread meanwhile).
        let closed = 999_999;
        use std::os::fd::AsRawFd;
        let cases = [
            (1, "standard streams"),
            (file.as_raw_fd(), "not a socket"),
            (tcp.as_raw_fd(), "not a Unix-domain socket"),
            (dgram.as_raw_fd(), "not a stream socket"),
            (closed, "not an open file descriptor"),
        ];
        for (fd, why) in cases {
            let args = AgentArgs {
                agent_id: 0,
                control_fd: fd,
            };
            match run(args) {
                Err(e @ WorkerError::ControlFd { .. }) => {
                    let msg = e.to_string();
                    assert!(msg.contains(why), "fd {fd}: {msg}");
                    assert!(msg.contains("not by hand"), "{msg}");
                }
                other => panic!("fd {fd}: expected ControlFd, got {other:?}"),
            }
        }
    }

    #[test]
    fn command_line_round_trips_through_clap_and_carries_no_secret() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: AgentArgs,
        }
        let args = AgentArgs {
            agent_id: 2,
            control_fd: 7,
        };
        let line = args.to_command_line();
        assert_eq!(line, ["--agent-id", "2", "--control-fd", "7"]);
        let mut argv = vec!["agent".to_string()];
        argv.extend(line);
        assert_eq!(Cli::parse_from(argv).args, args);
    }
}

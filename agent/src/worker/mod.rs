//! The agent process (`npu-serving agent ...`): connects to the server's control port, opens the
//! shared-memory segment the server created, loads the engine, says Hello, then serves steps
//! until Shutdown or until the server goes away. The step loop itself lives in `serve`.

mod serve;

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use npu_protocol::frame::{read_frame, write_frame, Frame, FrameError, Hello};
use npu_protocol::shm::{ShmError, ShmSegment, PROTOCOL_VERSION};
use thiserror::Error;

use crate::engine::{AgentEngine, AgentEngineConfig, EngineError};

pub use serve::{serve, StepExecutor};

pub use npu_protocol::agent::AgentArgs;

/// Why the agent process stopped with an error.
#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("bad --config-json: {0}")]
    Config(#[from] serde_json::Error),
    #[error("cannot reach the server at {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
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

/// How long the agent waits for the server's answer to Hello.
const WELCOME_TIMEOUT: Duration = Duration::from_secs(30);

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
    L: FnOnce(&AgentEngineConfig) -> Result<E, EngineError>,
{
    let addr = resolve(&args.control)?;
    let mut stream = TcpStream::connect(addr).map_err(|source| WorkerError::Connect {
        addr: args.control.clone(),
        source,
    })?;
    let _ = stream.set_nodelay(true);
    let (segment, engine) = match start(&args, load) {
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
            layout_hash: segment.layout().hash(),
            segment_name: segment.name().to_string(),
            model_facts_json: facts_json,
        }),
    )?;
    stream
        .set_read_timeout(Some(WELCOME_TIMEOUT))
        .map_err(FrameError::Io)?;
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
    serve(&mut stream, segment, engine)
}

/// Opens and checks the segment, then loads the engine for it.
fn start<E, L>(args: &AgentArgs, load: L) -> Result<(ShmSegment, E), WorkerError>
where
    L: FnOnce(&AgentEngineConfig) -> Result<E, EngineError>,
{
    let cfg: AgentEngineConfig = serde_json::from_str(&args.config_json)?;
    let segment = ShmSegment::open(&args.shm)?;
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

fn resolve(control: &str) -> Result<SocketAddr, WorkerError> {
    let unresolved = |source| WorkerError::Connect {
        addr: control.to_string(),
        source,
    };
    control
        .to_socket_addrs()
        .map_err(unresolved)?
        .next()
        .ok_or_else(|| {
            unresolved(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "address resolves to nothing",
            ))
        })
}

#[cfg(test)]
mod tests {
    //! Start-up of the real `run` against a listening socket: each start-up failure reaches the
    //! server as a StartFailed frame that says what went wrong.

    use std::net::TcpListener;
    use std::thread;

    use npu_protocol::shm::{segment_name, ShmCapacities, ShmLayout};

    use super::*;

    fn engine_config(max_tokens_per_step: u32) -> AgentEngineConfig {
        AgentEngineConfig {
            model_path: "/nonexistent/npu-serving-test/model.gguf".into(),
            num_blocks: 64,
            block_size: 16,
            max_slots: 8,
            max_tokens_per_step,
            max_blocks_per_seq: 16,
            threads: 1,
        }
    }

    /// Runs the agent in a thread against a fresh listener; returns the first frame it sends
    /// and the agent's outcome.
    fn start_agent(shm: &str, config_json: String) -> (Frame, Result<(), WorkerError>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let args = AgentArgs {
            agent_id: 4,
            control: listener.local_addr().unwrap().to_string(),
            shm: shm.to_string(),
            config_json,
        };
        let agent = thread::spawn(move || run(args));
        let (mut conn, _) = listener.accept().unwrap();
        let frame = read_frame(&mut conn).unwrap();
        (frame, agent.join().unwrap())
    }

    fn segment() -> ShmSegment {
        let layout = ShmLayout::new(ShmCapacities {
            max_slots: 8,
            max_seqs_per_step: 8,
            max_tokens_per_step: 128,
            max_blocks_per_seq: 16,
            max_admissions: 8,
            max_forget: 8,
            max_top_n: 4,
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
        let (frame, outcome) = start_agent(seg.name(), cfg);
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
        let (frame, outcome) = start_agent("/npu-serving-test-missing-segment", cfg);
        let reason = start_failed(frame);
        assert!(reason.contains("shm_open"), "{reason}");
        assert!(matches!(outcome, Err(WorkerError::Shm(_))), "{outcome:?}");
    }

    #[test]
    fn a_segment_larger_than_the_engine_is_reported_to_the_server() {
        let seg = segment();
        let cfg = serde_json::to_string(&engine_config(64)).unwrap();
        let (frame, outcome) = start_agent(seg.name(), cfg);
        let reason = start_failed(frame);
        assert!(reason.contains("max_tokens_per_step = 128"), "{reason}");
        assert!(matches!(outcome, Err(WorkerError::CapacityMismatch { .. })));
    }

    #[test]
    fn bad_config_json_is_reported_to_the_server() {
        let seg = segment();
        let (frame, outcome) = start_agent(seg.name(), "{\"model_path\": 3}".into());
        assert!(start_failed(frame).starts_with("bad --config-json"));
        assert!(matches!(outcome, Err(WorkerError::Config(_))));
    }

    #[test]
    fn an_unreachable_server_is_a_connect_error() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let args = AgentArgs {
            agent_id: 0,
            control: format!("127.0.0.1:{port}"),
            shm: "/unused".into(),
            config_json: "{}".into(),
        };
        assert!(matches!(run(args), Err(WorkerError::Connect { .. })));
    }

    #[test]
    fn command_line_round_trips_through_clap() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: AgentArgs,
        }
        let args = AgentArgs {
            agent_id: 2,
            control: "127.0.0.1:9000".into(),
            shm: "/npu-serving-1-2-ab".into(),
            config_json: "{\"a\": 1}".into(),
        };
        let mut argv = vec!["agent".to_string()];
        argv.extend(args.to_command_line());
        assert_eq!(Cli::parse_from(argv).args, args);
    }
}

//! The server's agents: spawning agent processes, the handshake, one link per agent (segment +
//! control socket + child process) to drive steps, failure detection and restart, shutdown.
//! `launch` says how agents start, `link` drives one, `pool` holds them all.
//!
//! The control link is private: for each launch the server creates a Unix socket pair and the
//! agent inherits one end (the only descriptor it inherits); nothing listens, so no other
//! process can connect, squat on or stall it. The agent learns its segment, config and a
//! per-launch secret from the first frame on that socket (never from its command line) and
//! echoes the secret in its Hello. Its death shows at once as end-of-file on the socket.

mod control;
pub mod group;
pub mod launch;
pub mod link;
pub mod pool;

use std::path::PathBuf;
use std::time::Duration;

use npu_protocol::frame::FrameError;
use npu_protocol::shm::ShmError;
use thiserror::Error;

pub use group::GroupLink;
pub use launch::{validate_hello, AgentLaunch, AgentSpec};
pub use link::AgentLink;
pub use pool::AgentPool;

/// Why an agent could not start, or failed or refused a step.
#[derive(Debug, Error)]
pub enum AgentFailure {
    #[error("agent {agent_id}: cannot create its control socket: {source}")]
    Socket {
        agent_id: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("agent {agent_id}: cannot start {}: {source}", exe.display())]
    Spawn {
        agent_id: u32,
        exe: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("agent {agent_id}: shared memory: {source}")]
    Shm {
        agent_id: u32,
        #[source]
        source: ShmError,
    },
    #[error("agent {agent_id} failed to start: {reason}")]
    StartFailed { agent_id: u32, reason: String },
    #[error("agent {agent_id} did not complete its handshake within {waited:?}; killed")]
    StartTimeout { agent_id: u32, waited: Duration },
    #[error("agent {agent_id} refused at handshake: {reason}")]
    Refused { agent_id: u32, reason: String },
    #[error("agent {agent_id} exited: {status}")]
    Exited { agent_id: u32, status: String },
    #[error("agent {agent_id} closed its control connection")]
    Disconnected { agent_id: u32 },
    #[error("agent {agent_id} did not finish {what} within {waited:?}; killed")]
    Hung {
        agent_id: u32,
        what: String,
        waited: Duration,
    },
    #[error("agent {agent_id} broke the control protocol: {detail}")]
    Protocol { agent_id: u32, detail: String },
    #[error("agent {agent_id}: control socket: {source}")]
    Io {
        agent_id: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("agent {agent_id} failed step {step_id}: {message}")]
    StepFailed {
        agent_id: u32,
        step_id: u64,
        message: String,
    },
    #[error("agent {agent_id}: plan of step {step_id} refused: {source}")]
    PlanRefused {
        agent_id: u32,
        step_id: u64,
        #[source]
        source: ShmError,
    },
    /// The engine thread did not hand over the mask words a plan said would follow it; the
    /// agent, stuck waiting for them, is taken down.
    #[error("agent {agent_id}: the token masks of step {step_id} never came ({reason}); stopped")]
    MasksLost {
        agent_id: u32,
        step_id: u64,
        reason: String,
    },
    #[error("agent {agent_id} is down; restart it first")]
    Down { agent_id: u32 },
    #[error("agent {agent_id} already has step {step_id} in flight")]
    Busy { agent_id: u32, step_id: u64 },
    #[error("agent {agent_id} has no step in flight")]
    NothingInFlight { agent_id: u32 },
    /// A rank of a tensor-parallel group failed: the whole group is down.
    #[error("tensor-parallel group {group} is down (rank {rank}): {failure}")]
    Rank {
        group: u32,
        rank: u32,
        failure: Box<AgentFailure>,
    },
}

impl AgentFailure {
    pub fn agent_id(&self) -> u32 {
        match self {
            AgentFailure::Socket { agent_id, .. }
            | AgentFailure::Spawn { agent_id, .. }
            | AgentFailure::Shm { agent_id, .. }
            | AgentFailure::StartFailed { agent_id, .. }
            | AgentFailure::StartTimeout { agent_id, .. }
            | AgentFailure::Refused { agent_id, .. }
            | AgentFailure::Exited { agent_id, .. }
            | AgentFailure::Disconnected { agent_id }
            | AgentFailure::Hung { agent_id, .. }
            | AgentFailure::Protocol { agent_id, .. }
            | AgentFailure::Io { agent_id, .. }
            | AgentFailure::StepFailed { agent_id, .. }
            | AgentFailure::PlanRefused { agent_id, .. }
            | AgentFailure::MasksLost { agent_id, .. }
            | AgentFailure::Down { agent_id }
            | AgentFailure::Busy { agent_id, .. }
            | AgentFailure::NothingInFlight { agent_id } => *agent_id,
            AgentFailure::Rank { failure, .. } => failure.agent_id(),
        }
    }

    /// True when the agent is down after this failure: its in-flight requests are lost with it
    /// and must be re-queued, and the link needs `restart`. False for a step the agent itself
    /// reported as failed, a plan refused before sending, and calls made out of turn.
    pub fn agent_is_down(&self) -> bool {
        !matches!(
            self,
            AgentFailure::StepFailed { .. }
                | AgentFailure::PlanRefused { .. }
                | AgentFailure::Busy { .. }
                | AgentFailure::NothingInFlight { .. }
        )
    }

    pub(crate) fn from_frame(agent_id: u32, e: FrameError) -> Self {
        match e {
            FrameError::Io(source) => AgentFailure::Io { agent_id, source },
            FrameError::Closed | FrameError::ClosedMidFrame => {
                AgentFailure::Disconnected { agent_id }
            }
            other => AgentFailure::Protocol {
                agent_id,
                detail: other.to_string(),
            },
        }
    }
}

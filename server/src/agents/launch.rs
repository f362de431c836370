//! How an agent process is started: which executable and arguments, where its control port
//! listens, what it is sized for, the time limits, and the checks its Hello must pass.

use std::ffi::OsString;
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use npu_protocol::agent::AgentArgs;
use npu_protocol::agent::{AgentEngineConfig, ModelFacts};
use npu_protocol::frame::Hello;
use npu_protocol::shm::{ShmCapacities, ShmSegment, PROTOCOL_VERSION};
use npu_protocol::MAX_TOP_N;

/// Process-level settings shared by every agent of a pool.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentLaunch {
    /// The executable to run; None: this process's own binary (`std::env::current_exe`).
    pub exe: Option<PathBuf>,
    /// Arguments before the agent's own (`--agent-id ...`); normally the `agent` subcommand.
    pub leading_args: Vec<OsString>,
    /// Extra environment variables for the agent.
    pub env: Vec<(OsString, OsString)>,
    /// Address the control ports listen on (`serving_config.agent_ip`).
    pub agent_ip: IpAddr,
    /// From spawn to an accepted Hello (the agent loads its model in this time).
    pub startup_timeout: Duration,
    /// How long a Shutdown may take before the agent is killed.
    pub shutdown_grace: Duration,
    /// How long a Reset or Ping may take.
    pub control_timeout: Duration,
    /// Longest sleep between checks of the child process while waiting.
    pub poll_slice: Duration,
}

impl Default for AgentLaunch {
    fn default() -> Self {
        Self {
            exe: None,
            leading_args: vec!["agent".into()],
            env: Vec::new(),
            agent_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            startup_timeout: Duration::from_secs(120),
            shutdown_grace: Duration::from_secs(3),
            control_timeout: Duration::from_secs(10),
            poll_slice: Duration::from_millis(20),
        }
    }
}

/// What one agent is: its index, control port, engine settings and segment capacities.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentSpec {
    pub agent_id: u32,
    /// Control port (`serving_config.agent_ports[agent_id]`); 0 lets the OS choose.
    pub port: u16,
    pub engine: AgentEngineConfig,
    pub capacities: ShmCapacities,
}

impl AgentSpec {
    /// A spec whose segment capacities follow the engine config: every slot may be in one step,
    /// be admitted and be forgotten in one step, and ask for up to `MAX_TOP_N` alternatives.
    pub fn new(agent_id: u32, port: u16, engine: AgentEngineConfig) -> Self {
        let capacities = ShmCapacities {
            max_slots: engine.max_slots,
            max_seqs_per_step: engine.max_slots,
            max_tokens_per_step: engine.max_tokens_per_step,
            max_blocks_per_seq: engine.max_blocks_per_seq,
            max_admissions: engine.max_slots,
            max_forget: engine.max_slots,
            max_top_n: MAX_TOP_N as u32,
        };
        Self {
            agent_id,
            port,
            engine,
            capacities,
        }
    }
}

/// Starts the agent process for `spec`, told to connect to `control` and open `segment`.
pub(crate) fn spawn_agent(
    launch: &AgentLaunch,
    spec: &AgentSpec,
    control: std::net::SocketAddr,
    segment: &ShmSegment,
) -> Result<(Child, PathBuf), (PathBuf, std::io::Error)> {
    let exe = match &launch.exe {
        Some(exe) => exe.clone(),
        None => std::env::current_exe().map_err(|e| (PathBuf::from("<current exe>"), e))?,
    };
    let config_json =
        serde_json::to_string(&spec.engine).map_err(|e| (exe.clone(), std::io::Error::other(e)))?;
    let args = AgentArgs {
        agent_id: spec.agent_id,
        control: control.to_string(),
        shm: segment.name().to_string(),
        config_json,
    };
    // Its own process group: a Ctrl-C in the terminal reaches the server, which drains and
    // then stops its agents, instead of killing the agents under running requests.
    let child = Command::new(&exe)
        .process_group(0)
        .args(&launch.leading_args)
        .args(args.to_command_line())
        .envs(launch.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| (exe.clone(), e))?;
    Ok((child, exe))
}

/// Checks an agent's Hello against what the server set up; the error says what differs.
pub fn validate_hello(
    hello: &Hello,
    agent_id: u32,
    child_pid: u32,
    segment: &ShmSegment,
) -> Result<ModelFacts, String> {
    if hello.protocol_version != PROTOCOL_VERSION {
        return Err(format!(
            "agent speaks protocol version {}, the server speaks {PROTOCOL_VERSION}",
            hello.protocol_version
        ));
    }
    if hello.agent_id != agent_id {
        return Err(format!(
            "agent says it is agent {}, expected agent {agent_id}",
            hello.agent_id
        ));
    }
    if hello.pid != child_pid {
        return Err(format!(
            "hello from pid {}, but the agent process is pid {child_pid}",
            hello.pid
        ));
    }
    if hello.segment_name != segment.name() {
        return Err(format!(
            "agent opened segment {}, expected {}",
            hello.segment_name,
            segment.name()
        ));
    }
    let expected = segment.layout().hash();
    if hello.layout_hash != expected {
        return Err(format!(
            "agent's layout hash {:#018x} differs from the server's {expected:#018x}",
            hello.layout_hash
        ));
    }
    serde_json::from_str(&hello.model_facts_json)
        .map_err(|e| format!("agent's model facts are not valid: {e}"))
}

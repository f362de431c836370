//! How an agent process is started: which executable and arguments, the control socket it
//! inherits (its end of a Unix socket pair, the only descriptor passed down), what it is sized
//! for, the time limits, the per-launch secret, and the checks its Hello must pass.

use std::ffi::OsString;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
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
            startup_timeout: Duration::from_secs(120),
            shutdown_grace: Duration::from_secs(3),
            control_timeout: Duration::from_secs(10),
            poll_slice: Duration::from_millis(20),
        }
    }
}

/// What one agent is: its index, engine settings and segment capacities.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentSpec {
    pub agent_id: u32,
    pub engine: AgentEngineConfig,
    pub capacities: ShmCapacities,
    /// LoRA adapter slots (None: the agent takes no adapters); sent beside `engine` in the
    /// Setup's config JSON.
    pub lora: Option<npu_protocol::agent::AgentLoraConfig>,
}

impl AgentSpec {
    /// A spec whose segment capacities follow the engine config: every slot may be in one step,
    /// be admitted and be forgotten in one step, and ask for up to `MAX_TOP_N` alternatives.
    pub fn new(agent_id: u32, engine: AgentEngineConfig) -> Self {
        let capacities = ShmCapacities {
            max_slots: engine.max_slots,
            max_seqs_per_step: engine.max_slots,
            max_tokens_per_step: engine.max_tokens_per_step,
            max_blocks_per_seq: engine.max_blocks_per_seq,
            max_admissions: engine.max_slots,
            max_forget: engine.max_slots,
            max_top_n: MAX_TOP_N as u32,
            max_kv_copies: engine.max_kv_copies(),
            max_masks: 0,
            mask_words: 0,
        };
        Self {
            agent_id,
            engine,
            capacities,
            lora: None,
        }
    }

    /// Room in the segment for a token mask per slot over a vocabulary of `vocab` tokens
    /// (structured output); without it a constrained request is refused.
    pub fn with_token_masks(mut self, vocab: u32) -> Self {
        if vocab > 0 {
            self.capacities.max_masks = self.capacities.max_seqs_per_step;
            self.capacities.mask_words = vocab.div_ceil(32);
        }
        self
    }
}

/// Starts the agent process for `spec` with `control` (the agent's end of its socket pair) as
/// its one inherited descriptor. The command line carries only the agent id and that
/// descriptor's number; the segment name, engine config and launch secret follow in the Setup
/// frame.
pub(crate) fn spawn_agent(
    launch: &AgentLaunch,
    spec: &AgentSpec,
    control: &OwnedFd,
) -> Result<(Child, PathBuf), (PathBuf, std::io::Error)> {
    let exe = match &launch.exe {
        Some(exe) => exe.clone(),
        None => std::env::current_exe().map_err(|e| (PathBuf::from("<current exe>"), e))?,
    };
    let fd = control.as_raw_fd();
    let args = AgentArgs {
        agent_id: spec.agent_id,
        control_fd: fd,
    };
    let mut command = Command::new(&exe);
    // Its own process group: a Ctrl-C in the terminal reaches the server, which drains and
    // then stops its agents, instead of killing the agents under running requests.
    command
        .process_group(0)
        .args(&launch.leading_args)
        .args(args.to_command_line())
        .envs(launch.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null());
    // Every descriptor this process opens is close-on-exec; the child's copy of `fd` alone is
    // made inheritable, in the child, between fork and exec.
    // SAFETY: the closure runs in the forked child before exec and only calls fcntl(2), which is
    // async-signal-safe; it allocates nothing and touches no lock.
    unsafe {
        command.pre_exec(move || {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = command.spawn().map_err(|e| (exe.clone(), e))?;
    Ok((child, exe))
}

/// A fresh secret for one launch (128 bits from the kernel's random source).
pub(crate) fn launch_token() -> std::io::Result<u128> {
    let mut bits = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bits)?;
    Ok(u128::from_le_bytes(bits))
}

/// Checks an agent's Hello against what the server set up; the error says what differs.
pub fn validate_hello(
    hello: &Hello,
    agent_id: u32,
    child_pid: u32,
    segment: &ShmSegment,
    launch_token: u128,
) -> Result<ModelFacts, String> {
    if hello.protocol_version != PROTOCOL_VERSION {
        return Err(format!(
            "agent speaks protocol version {}, the server speaks {PROTOCOL_VERSION}",
            hello.protocol_version
        ));
    }
    if hello.launch_token != launch_token {
        return Err("the hello does not carry this launch's secret".into());
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

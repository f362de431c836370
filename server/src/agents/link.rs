//! One agent as the server sees it: while it runs, its child process, private control channel
//! (a Unix socket pair made for this launch) and shared-memory segment. Drives steps (blocking,
//! or submit now and complete later), detects death (socket closed, child exit), hangs and
//! protocol breaks, also while the agent is idle (`check_idle`), restarts, and shuts down.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::process::Child;
use std::time::{Duration, Instant};

use npu_protocol::agent::ModelFacts;
use npu_protocol::frame::{Frame, Setup, SleepDone, StepStatus};
use npu_protocol::shm::{segment_name, ShmLayout, ShmSegment};
use npu_protocol::{StepPlan, StepResult, TokenMask};

use super::control::{ChannelError, ControlChannel};
use super::launch::{launch_token, spawn_agent, validate_hello, AgentLaunch, AgentSpec};
use super::AgentFailure;

/// A running agent.
struct Running {
    child: Child,
    channel: ControlChannel,
    segment: ShmSegment,
}

/// The step currently sent to the agent and not yet answered.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    step_id: u64,
    since: Instant,
}

pub struct AgentLink {
    spec: AgentSpec,
    launch: AgentLaunch,
    running: Option<Running>,
    facts: ModelFacts,
    in_flight: Option<InFlight>,
    restarts: u32,
    pings: u64,
}

impl std::fmt::Debug for AgentLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentLink")
            .field("agent_id", &self.spec.agent_id)
            .field("pid", &self.pid())
            .field("in_flight", &self.in_flight.map(|f| f.step_id))
            .field("restarts", &self.restarts)
            .finish()
    }
}

impl AgentLink {
    /// Creates the agent's segment and control socket pair, spawns it and completes the
    /// handshake within `launch.startup_timeout`.
    pub fn start(spec: AgentSpec, launch: AgentLaunch) -> Result<Self, AgentFailure> {
        let (running, facts) = launch_and_handshake(&spec, &launch)?;
        Ok(Self {
            spec,
            launch,
            running: Some(running),
            facts,
            in_flight: None,
            restarts: 0,
            pings: 0,
        })
    }

    pub fn agent_id(&self) -> u32 {
        self.spec.agent_id
    }

    pub fn spec(&self) -> &AgentSpec {
        &self.spec
    }

    /// Fixes the agent's KV pool at `blocks` for every later start (a restart allocates exactly
    /// that, instead of sizing it from free memory again). The segment keeps its capacities.
    pub fn pin_kv_blocks(&mut self, blocks: u32) {
        self.spec.engine.num_blocks = blocks;
        self.spec.engine.kv_memory_fraction = None;
    }

    /// Points every later start at a fresh region of its tensor-parallel group (the server
    /// makes a new one for each restart of the group).
    pub fn set_group_region(&mut self, name: &str) {
        if let Some(tp) = self.spec.engine.tensor_parallel.as_mut() {
            tp.region = name.to_string();
        }
    }

    /// Kills and reaps the agent now (no Shutdown, no grace: its tensor-parallel group is
    /// going down) and removes its segment. Nothing when it is down already.
    pub fn kill_now(&mut self) {
        self.kill();
    }

    /// What the agent reported about its model at the last handshake.
    pub fn facts(&self) -> &ModelFacts {
        &self.facts
    }

    /// The agent's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.running.as_ref().map(|r| r.child.id())
    }

    /// The segment's name while the agent runs.
    pub fn segment_name(&self) -> Option<&str> {
        self.running.as_ref().map(|r| r.segment.name())
    }

    /// The control socket's fd while the agent runs, to wait on several agents with poll(2).
    pub fn control_fd(&self) -> Option<i32> {
        self.running.as_ref().map(|r| r.channel.raw_fd())
    }

    pub fn is_up(&self) -> bool {
        self.running.is_some()
    }

    /// The step sent and not yet completed, if any.
    pub fn in_flight(&self) -> Option<u64> {
        self.in_flight.map(|f| f.step_id)
    }

    /// How many times `restart` has brought the agent back.
    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    /// Runs one step: submit, then wait for its result at most `deadline`. A hung agent is
    /// killed when the deadline passes.
    pub fn step(
        &mut self,
        plan: &StepPlan,
        deadline: Duration,
    ) -> Result<StepResult, AgentFailure> {
        self.submit(plan)?;
        self.wait_complete(Instant::now() + deadline)
    }

    /// `step` for a plan whose mask words may follow it (`StepPlan::masks_follow`): submit,
    /// hand the words on when they arrive on `masks` (the agent runs the forward pass
    /// meanwhile), then wait for the result; the whole within `deadline`.
    pub fn step_with_masks(
        &mut self,
        plan: &StepPlan,
        masks: Option<&crossbeam_channel::Receiver<Vec<TokenMask>>>,
        deadline: Duration,
    ) -> Result<StepResult, AgentFailure> {
        let until = Instant::now() + deadline;
        self.submit(plan)?;
        if plan.masks_follow() {
            let words = receive_masks(masks, until, self.spec.agent_id, plan.step_id)
                .map_err(|f| self.fail(f))?;
            self.send_masks(&words)?;
        }
        self.wait_complete(until)
    }

    /// Writes the words of the masks that follow the plan in flight into the segment and
    /// announces them. A refusal takes the agent down: it is waiting for them mid-step.
    pub fn send_masks(&mut self, masks: &[TokenMask]) -> Result<(), AgentFailure> {
        let agent_id = self.spec.agent_id;
        let step_id = self
            .in_flight
            .ok_or(AgentFailure::NothingInFlight { agent_id })?
            .step_id;
        let running = self
            .running
            .as_mut()
            .ok_or(AgentFailure::Down { agent_id })?;
        if let Err(source) = running.segment.write_mask_words(masks) {
            return Err(self.fail(AgentFailure::PlanRefused {
                agent_id,
                step_id,
                source,
            }));
        }
        let deadline = Instant::now() + self.launch.control_timeout;
        if let Err(e) = running.channel.send(&Frame::Masks { step_id }, deadline) {
            return Err(self.channel_failure(e, &format!("sending the masks of step {step_id}")));
        }
        Ok(())
    }

    /// Writes the plan into the segment and tells the agent to run it; returns at once.
    pub fn submit(&mut self, plan: &StepPlan) -> Result<(), AgentFailure> {
        let agent_id = self.spec.agent_id;
        if let Some(f) = self.in_flight {
            return Err(AgentFailure::Busy {
                agent_id,
                step_id: f.step_id,
            });
        }
        let running = self
            .running
            .as_mut()
            .ok_or(AgentFailure::Down { agent_id })?;
        running
            .segment
            .write_plan(plan)
            .map_err(|source| AgentFailure::PlanRefused {
                agent_id,
                step_id: plan.step_id,
                source,
            })?;
        let deadline = Instant::now() + self.launch.control_timeout;
        let step = Frame::Step {
            step_id: plan.step_id,
        };
        if let Err(e) = running.channel.send(&step, deadline) {
            let what = format!("sending step {}", plan.step_id);
            return Err(self.channel_failure(e, &what));
        }
        self.in_flight = Some(InFlight {
            step_id: plan.step_id,
            since: Instant::now(),
        });
        Ok(())
    }

    /// The result of the step in flight if it has arrived; never blocks. Also notices a dead
    /// agent.
    pub fn try_complete(&mut self) -> Result<Option<StepResult>, AgentFailure> {
        let agent_id = self.spec.agent_id;
        if self.in_flight.is_none() {
            return Err(AgentFailure::NothingInFlight { agent_id });
        }
        let running = self
            .running
            .as_mut()
            .ok_or(AgentFailure::Down { agent_id })?;
        loop {
            match running.channel.try_recv() {
                Ok(Some(Frame::Pong { .. })) => continue,
                Ok(Some(frame)) => return self.on_step_frame(frame).map(Some),
                Ok(None) => break,
                Err(e) => return Err(self.channel_failure(e, "a step")),
            }
        }
        if let Ok(Some(status)) = running.child.try_wait() {
            return Err(self.fail(AgentFailure::Exited {
                agent_id,
                status: status.to_string(),
            }));
        }
        Ok(None)
    }

    /// Looks at an idle agent without blocking: an exited process, a closed control socket or a
    /// frame nobody asked for is a failure, and the agent is taken down (killed, reaped, its
    /// segment removed). None while it is fine, while a step is in flight (the step's own wait
    /// notices), and once it is down already.
    pub fn check_idle(&mut self) -> Option<AgentFailure> {
        let agent_id = self.spec.agent_id;
        if self.in_flight.is_some() {
            return None;
        }
        let running = self.running.as_mut()?;
        match running.channel.try_recv() {
            Ok(None) => {}
            // A Pong that arrived after its exchange timed out: harmless.
            Ok(Some(Frame::Pong { .. })) => {}
            Ok(Some(frame)) => return Some(self.unexpected(&frame, "nothing (idle)")),
            Err(e) => return Some(self.channel_failure(e, "waiting idle")),
        }
        let running = self.running.as_mut()?;
        if let Ok(Some(status)) = running.child.try_wait() {
            return Some(self.fail(AgentFailure::Exited {
                agent_id,
                status: status.to_string(),
            }));
        }
        None
    }

    /// Waits for the result of the step in flight until `deadline`; a hung agent is killed.
    pub fn wait_complete(&mut self, deadline: Instant) -> Result<StepResult, AgentFailure> {
        let agent_id = self.spec.agent_id;
        let Some(in_flight) = self.in_flight else {
            return Err(AgentFailure::NothingInFlight { agent_id });
        };
        loop {
            let frame = self.recv_until(deadline)?;
            match frame {
                Ok(Frame::Pong { .. }) => continue,
                Ok(frame) => return self.on_step_frame(frame),
                Err(ChannelError::Timeout) => {
                    let waited = in_flight.since.elapsed();
                    return Err(self.fail(AgentFailure::Hung {
                        agent_id,
                        what: format!("step {}", in_flight.step_id),
                        waited,
                    }));
                }
                Err(e) => {
                    let what = format!("step {}", in_flight.step_id);
                    return Err(self.channel_failure(e, &what));
                }
            }
        }
    }

    /// Tells the agent to forget every slot and waits for it to confirm.
    pub fn reset(&mut self) -> Result<(), AgentFailure> {
        match self.exchange(Frame::Reset, "reset")? {
            Frame::ResetDone => Ok(()),
            other => Err(self.unexpected(&other, "ResetDone")),
        }
    }

    /// Puts the agent to sleep at `level` (1: KV pool released, weights kept; 2: model
    /// dropped) and waits for it to confirm. An agent that answers with an error is taken down
    /// (a restart brings it back awake).
    pub fn sleep(&mut self, level: u8) -> Result<SleepDone, AgentFailure> {
        let timeout = self.launch.control_timeout;
        match self.exchange_within(Frame::Sleep { level }, "sleep", timeout)? {
            Frame::SleepDone(d) if d.error.is_empty() => Ok(d),
            Frame::SleepDone(d) => Err(self.sleep_failed("sleep", d.error)),
            other => Err(self.unexpected(&other, "SleepDone")),
        }
    }

    /// Wakes the agent (a reload of the model may take as long as a start) and waits for it
    /// to confirm; an error takes it down.
    pub fn wake(&mut self) -> Result<SleepDone, AgentFailure> {
        let timeout = self.launch.startup_timeout;
        match self.exchange_within(Frame::Wake, "wake", timeout)? {
            Frame::WakeDone(d) if d.error.is_empty() => Ok(d),
            Frame::WakeDone(d) => Err(self.sleep_failed("wake", d.error)),
            other => Err(self.unexpected(&other, "WakeDone")),
        }
    }

    fn sleep_failed(&mut self, what: &str, message: String) -> AgentFailure {
        let agent_id = self.spec.agent_id;
        self.fail(AgentFailure::Protocol {
            agent_id,
            detail: format!("{what} failed: {message}"),
        })
    }

    /// Round trip of a Ping; returns how long it took.
    pub fn ping(&mut self) -> Result<Duration, AgentFailure> {
        let started = Instant::now();
        self.pings += 1;
        let nonce = self.pings;
        match self.exchange(Frame::Ping { nonce }, "ping")? {
            Frame::Pong { nonce: n } if n == nonce => Ok(started.elapsed()),
            other => Err(self.unexpected(&other, "the matching Pong")),
        }
    }

    /// Kills whatever is left of the agent, creates a fresh segment, spawns a new agent and
    /// completes a new handshake. The step that was in flight is gone.
    pub fn restart(&mut self) -> Result<(), AgentFailure> {
        self.kill();
        let (running, facts) = launch_and_handshake(&self.spec, &self.launch)?;
        self.running = Some(running);
        self.facts = facts;
        self.restarts += 1;
        Ok(())
    }

    /// Asks the agent to exit, waits up to `shutdown_grace`, kills it if needed, and removes its
    /// segment. Does nothing when the agent is already down.
    pub fn shutdown(&mut self) {
        let Some(mut running) = self.running.take() else {
            return;
        };
        self.in_flight = None;
        let deadline = Instant::now() + self.launch.shutdown_grace;
        let _ = running.channel.send(&Frame::Shutdown, deadline);
        loop {
            match running.child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(self.launch.poll_slice),
                _ => {
                    tracing::warn!(
                        agent = self.spec.agent_id,
                        "agent ignored Shutdown; killing"
                    );
                    let _ = running.child.kill();
                    let _ = running.child.wait();
                    break;
                }
            }
        }
        // Dropping `running` unlinks the segment.
    }

    /// Sends a control frame (no step may be in flight) and waits for the next non-Pong answer.
    fn exchange(&mut self, frame: Frame, what: &str) -> Result<Frame, AgentFailure> {
        self.exchange_within(frame, what, self.launch.control_timeout)
    }

    /// `exchange` with its own time limit.
    fn exchange_within(
        &mut self,
        frame: Frame,
        what: &str,
        timeout: Duration,
    ) -> Result<Frame, AgentFailure> {
        let agent_id = self.spec.agent_id;
        if let Some(f) = self.in_flight {
            return Err(AgentFailure::Busy {
                agent_id,
                step_id: f.step_id,
            });
        }
        let running = self
            .running
            .as_mut()
            .ok_or(AgentFailure::Down { agent_id })?;
        let deadline = Instant::now() + timeout;
        if let Err(e) = running.channel.send(&frame, deadline) {
            return Err(self.channel_failure(e, what));
        }
        let started = Instant::now();
        let ping = matches!(frame, Frame::Ping { .. });
        loop {
            match self.recv_until(deadline)? {
                Ok(Frame::Pong { .. }) if !ping => continue,
                Ok(answer) => return Ok(answer),
                Err(ChannelError::Timeout) => {
                    return Err(self.fail(AgentFailure::Hung {
                        agent_id,
                        what: what.to_string(),
                        waited: started.elapsed(),
                    }))
                }
                Err(e) => return Err(self.channel_failure(e, what)),
            }
        }
    }

    /// Waits for a frame, watching the child process; its exit is a failure.
    fn recv_until(
        &mut self,
        deadline: Instant,
    ) -> Result<Result<Frame, ChannelError>, AgentFailure> {
        let agent_id = self.spec.agent_id;
        let slice = self.launch.poll_slice;
        let running = self
            .running
            .as_mut()
            .ok_or(AgentFailure::Down { agent_id })?;
        let Running { child, channel, .. } = running;
        let outcome = channel.recv_until(deadline, slice, || match child.try_wait() {
            Ok(Some(status)) => Err(status.to_string()),
            _ => Ok(()),
        });
        outcome.map_err(|status| self.fail(AgentFailure::Exited { agent_id, status }))
    }

    /// Handles the answer to a step.
    fn on_step_frame(&mut self, frame: Frame) -> Result<StepResult, AgentFailure> {
        let agent_id = self.spec.agent_id;
        let Some(in_flight) = self.in_flight else {
            return Err(AgentFailure::NothingInFlight { agent_id });
        };
        let Frame::StepDone(done) = frame else {
            return Err(self.unexpected(&frame, "StepDone"));
        };
        if done.step_id != in_flight.step_id {
            return Err(self.fail(AgentFailure::Protocol {
                agent_id,
                detail: format!(
                    "StepDone for step {} while step {} is in flight",
                    done.step_id, in_flight.step_id
                ),
            }));
        }
        self.in_flight = None;
        if done.status == StepStatus::Failed {
            return Err(AgentFailure::StepFailed {
                agent_id,
                step_id: done.step_id,
                message: done.error,
            });
        }
        let Some(running) = self.running.as_ref() else {
            return Err(AgentFailure::Down { agent_id });
        };
        match running.segment.read_result() {
            Ok(mut result) if result.step_id == done.step_id => {
                // The sequences it could not run come in the frame.
                result.failed = done.failed;
                Ok(result)
            }
            Ok(result) => Err(self.fail(AgentFailure::Protocol {
                agent_id,
                detail: format!(
                    "the segment holds the result of step {} for StepDone {}",
                    result.step_id, done.step_id
                ),
            })),
            Err(source) => Err(self.fail(AgentFailure::Protocol {
                agent_id,
                detail: format!("result of step {}: {source}", done.step_id),
            })),
        }
    }

    fn unexpected(&mut self, frame: &Frame, expected: &str) -> AgentFailure {
        let agent_id = self.spec.agent_id;
        self.fail(AgentFailure::Protocol {
            agent_id,
            detail: format!("got {} while waiting for {expected}", frame.kind()),
        })
    }

    /// Turns a channel error into the failure it means, taking the agent down.
    fn channel_failure(&mut self, e: ChannelError, what: &str) -> AgentFailure {
        let agent_id = self.spec.agent_id;
        let failure = match e {
            ChannelError::Closed => match self.exit_status_soon() {
                Some(status) => AgentFailure::Exited { agent_id, status },
                None => AgentFailure::Disconnected { agent_id },
            },
            ChannelError::Timeout => AgentFailure::Hung {
                agent_id,
                what: what.to_string(),
                waited: self.launch.control_timeout,
            },
            ChannelError::Frame(e) => AgentFailure::from_frame(agent_id, e),
            ChannelError::Io(source) => AgentFailure::Io { agent_id, source },
        };
        self.fail(failure)
    }

    /// After the socket closed: the child's exit status if it exits within a short while.
    fn exit_status_soon(&mut self) -> Option<String> {
        let running = self.running.as_mut()?;
        let deadline = Instant::now() + Duration::from_millis(500);
        loop {
            if let Ok(Some(status)) = running.child.try_wait() {
                return Some(status.to_string());
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Takes the agent down (kills and reaps it, removes its segment) and returns `failure`.
    fn fail(&mut self, failure: AgentFailure) -> AgentFailure {
        tracing::warn!(agent = self.spec.agent_id, %failure, "agent down");
        self.kill();
        failure
    }

    fn kill(&mut self) {
        self.in_flight = None;
        if let Some(mut running) = self.running.take() {
            let _ = running.child.kill();
            let _ = running.child.wait();
        }
    }
}

/// The mask words of step `step_id` from the engine thread, waited for until `until`.
pub(crate) fn receive_masks(
    masks: Option<&crossbeam_channel::Receiver<Vec<TokenMask>>>,
    until: Instant,
    agent_id: u32,
    step_id: u64,
) -> Result<Vec<TokenMask>, AgentFailure> {
    let lost = |reason: &str| AgentFailure::MasksLost {
        agent_id,
        step_id,
        reason: reason.into(),
    };
    let rx = masks.ok_or_else(|| lost("nothing was to deliver them"))?;
    rx.recv_deadline(until).map_err(|e| match e {
        crossbeam_channel::RecvTimeoutError::Timeout => lost("not made before the step deadline"),
        crossbeam_channel::RecvTimeoutError::Disconnected => lost("the engine dropped them"),
    })
}

impl Drop for AgentLink {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Creates the segment and the control socket pair, spawns the agent with its end, sends the
/// Setup and runs the handshake; on failure nothing is left.
fn launch_and_handshake(
    spec: &AgentSpec,
    launch: &AgentLaunch,
) -> Result<(Running, ModelFacts), AgentFailure> {
    let agent_id = spec.agent_id;
    let shm = |source| AgentFailure::Shm { agent_id, source };
    let socket = |source| AgentFailure::Socket { agent_id, source };
    let layout = ShmLayout::new(spec.capacities).map_err(shm)?;
    let segment =
        ShmSegment::create(&segment_name(agent_id).map_err(shm)?, &layout).map_err(shm)?;
    let token = launch_token().map_err(socket)?;
    // Both ends are close-on-exec; `spawn_agent` lets the child keep its end only.
    let (server_end, agent_end) = UnixStream::pair().map_err(socket)?;
    let agent_end = OwnedFd::from(agent_end);
    let spawned = spawn_agent(launch, spec, &agent_end);
    // The child has its copy now: ours must go, or the agent's death would not close the socket.
    drop(agent_end);
    let (mut child, _exe) = spawned.map_err(|(exe, source)| AgentFailure::Spawn {
        agent_id,
        exe,
        source,
    })?;
    let deadline = Instant::now() + launch.startup_timeout;
    let setup = Setup {
        agent_id,
        launch_token: token,
        segment_name: segment.name().to_string(),
        config_json: serde_json::to_string(&spec.engine)
            .and_then(|json| {
                npu_protocol::agent::AgentLoraConfig::add_to(spec.lora.as_ref(), &json)
            })
            .map_err(|e| AgentFailure::StartFailed {
                agent_id,
                reason: format!("engine config cannot be encoded: {e}"),
            })?,
    };
    let outcome = ControlChannel::new(server_end)
        .map_err(|source| AgentFailure::Io { agent_id, source })
        .and_then(|channel| {
            handshake(
                spec, launch, channel, &mut child, &segment, &setup, deadline,
            )
        });
    match outcome {
        Ok((channel, facts)) => Ok((
            Running {
                child,
                channel,
                segment,
            },
            facts,
        )),
        Err(failure) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(failure)
        }
    }
}

fn handshake(
    spec: &AgentSpec,
    launch: &AgentLaunch,
    mut channel: ControlChannel,
    child: &mut Child,
    segment: &ShmSegment,
    setup: &Setup,
    deadline: Instant,
) -> Result<(ControlChannel, ModelFacts), AgentFailure> {
    let agent_id = spec.agent_id;
    let started = Instant::now();
    let io = |source| AgentFailure::Io { agent_id, source };
    let exited = |child: &mut Child, when: &str| -> Option<AgentFailure> {
        match child.try_wait() {
            Ok(Some(status)) => Some(AgentFailure::StartFailed {
                agent_id,
                reason: format!("agent process exited ({status}) {when}"),
            }),
            _ => None,
        }
    };
    let timeout = || AgentFailure::StartTimeout {
        agent_id,
        waited: launch.startup_timeout,
    };
    // A closed socket here means the agent died before it read its Setup: report the exit.
    let closed_early = |child: &mut Child, when: &str| {
        let grace = Instant::now() + Duration::from_millis(500);
        while Instant::now() < grace {
            if let Some(failure) = exited(child, when) {
                return failure;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        AgentFailure::Disconnected { agent_id }
    };
    match channel.send(&Frame::Setup(setup.clone()), deadline) {
        Ok(()) => {}
        Err(ChannelError::Closed) => return Err(closed_early(child, "before its setup")),
        Err(ChannelError::Timeout) => return Err(timeout()),
        Err(ChannelError::Frame(e)) => return Err(AgentFailure::from_frame(agent_id, e)),
        Err(ChannelError::Io(e)) => return Err(io(e)),
    }
    let watch_child = || match child.try_wait() {
        Ok(Some(status)) => Err(status.to_string()),
        _ => Ok(()),
    };
    let first = match channel.recv_until(deadline, launch.poll_slice, watch_child) {
        Ok(first) => first,
        Err(status) => {
            return Err(AgentFailure::StartFailed {
                agent_id,
                reason: format!("agent process exited ({status}) before its hello"),
            })
        }
    };
    let hello = match first {
        Ok(Frame::Hello(hello)) => hello,
        Ok(Frame::StartFailed { reason }) => {
            return Err(AgentFailure::StartFailed { agent_id, reason })
        }
        Ok(other) => {
            return Err(AgentFailure::Protocol {
                agent_id,
                detail: format!("expected Hello, got {}", other.kind()),
            })
        }
        Err(ChannelError::Timeout) => return Err(timeout()),
        Err(ChannelError::Closed) => return Err(closed_early(child, "before its hello")),
        Err(ChannelError::Frame(e)) => return Err(AgentFailure::from_frame(agent_id, e)),
        Err(ChannelError::Io(e)) => return Err(io(e)),
    };
    let facts = match validate_hello(&hello, agent_id, child.id(), segment, setup.launch_token) {
        Ok(facts) => facts,
        Err(reason) => {
            let _ = channel.send(
                &Frame::Refuse {
                    reason: reason.clone(),
                },
                Instant::now() + launch.control_timeout,
            );
            return Err(AgentFailure::Refused { agent_id, reason });
        }
    };
    channel
        .send(
            &Frame::Welcome,
            deadline.max(Instant::now() + launch.control_timeout),
        )
        .map_err(|e| match e {
            ChannelError::Io(source) => io(source),
            _ => AgentFailure::Disconnected { agent_id },
        })?;
    tracing::info!(
        agent = agent_id,
        pid = child.id(),
        model = %facts.name,
        took_ms = started.elapsed().as_millis() as u64,
        "agent ready"
    );
    Ok((channel, facts))
}

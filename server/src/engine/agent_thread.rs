//! One thread per agent: it owns the agent's connection, runs each step plan the engine sends
//! under the step deadline, watches the agent while it is idle (a death is reported when it
//! happens, not at the next request), restarts the agent when asked (at once, then with
//! growing pauses for as long as the server lives), shuts it down, and reports every outcome
//! on a channel shared by all agents. A plan whose token-mask words follow it comes with the
//! channel they arrive on: the thread submits the plan, hands the words on when the engine
//! thread has made them (the agent runs the forward pass meanwhile), then waits for the result.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use npu_protocol::frame::SleepDone;
use npu_protocol::{StepPlan, StepResult, TokenMask};

use crate::agents::{AgentFailure, AgentLink, GroupLink};

/// Where the words of a plan's token masks come from when they follow it (see
/// `StepPlan::masks_follow`): the engine thread sends them, in the plan's mask order, once the
/// requests' grammars have made them.
pub type FollowingMasks = Receiver<Vec<TokenMask>>;

/// What the engine needs from an agent: run a step, come back after a failure, stop.
/// `AgentLink` (a real agent process) in production.
pub trait StepAgent: Send {
    /// Runs one step and waits at most `deadline` for its result; when the plan's mask words
    /// follow it, they arrive on `masks` (within the same deadline) and are handed on.
    fn step(
        &mut self,
        plan: &StepPlan,
        masks: Option<&FollowingMasks>,
        deadline: Duration,
    ) -> Result<StepResult, AgentFailure>;
    /// Brings a failed agent back with an empty KV pool and no slots.
    fn restart(&mut self) -> Result<(), AgentFailure>;
    /// Stops the agent for good (its resources are released).
    fn shutdown(&mut self);
    /// Called while no step runs: the failure that took the agent down if it died (or broke
    /// the protocol) since the last look; None while it is fine or already known to be down.
    fn check_idle(&mut self) -> Option<AgentFailure> {
        None
    }
    /// The agent's process id while it runs, when it has one (logs, tests).
    fn pid(&self) -> Option<u32> {
        None
    }
    /// Puts the agent to sleep at `level` (1: KV memory released, weights kept; 2: the model
    /// dropped, reloaded on wake). No slot may be in use.
    fn sleep(&mut self, level: u8) -> Result<SleepDone, AgentFailure> {
        Ok(SleepDone {
            level,
            ..SleepDone::default()
        })
    }
    /// Brings the agent back from `sleep` (nothing to do when awake).
    fn wake(&mut self) -> Result<SleepDone, AgentFailure> {
        Ok(SleepDone::default())
    }
}

impl StepAgent for AgentLink {
    fn step(
        &mut self,
        plan: &StepPlan,
        masks: Option<&FollowingMasks>,
        deadline: Duration,
    ) -> Result<StepResult, AgentFailure> {
        AgentLink::step_with_masks(self, plan, masks, deadline)
    }
    fn restart(&mut self) -> Result<(), AgentFailure> {
        AgentLink::restart(self)
    }
    fn shutdown(&mut self) {
        AgentLink::shutdown(self)
    }
    fn check_idle(&mut self) -> Option<AgentFailure> {
        AgentLink::check_idle(self)
    }
    fn pid(&self) -> Option<u32> {
        AgentLink::pid(self)
    }
    fn sleep(&mut self, level: u8) -> Result<SleepDone, AgentFailure> {
        AgentLink::sleep(self, level)
    }
    fn wake(&mut self) -> Result<SleepDone, AgentFailure> {
        AgentLink::wake(self)
    }
}

/// A tensor-parallel group is driven as one agent: every rank runs each step, rank 0 answers,
/// and a rank's failure takes (and a restart brings back) the whole group.
impl StepAgent for GroupLink {
    fn step(
        &mut self,
        plan: &StepPlan,
        masks: Option<&FollowingMasks>,
        deadline: Duration,
    ) -> Result<StepResult, AgentFailure> {
        GroupLink::step_with_masks(self, plan, masks, deadline)
    }
    fn restart(&mut self) -> Result<(), AgentFailure> {
        GroupLink::restart(self)
    }
    fn shutdown(&mut self) {
        GroupLink::shutdown(self)
    }
    fn check_idle(&mut self) -> Option<AgentFailure> {
        GroupLink::check_idle(self)
    }
    fn pid(&self) -> Option<u32> {
        GroupLink::pid(self)
    }
    fn sleep(&mut self, level: u8) -> Result<SleepDone, AgentFailure> {
        GroupLink::sleep(self, level)
    }
    fn wake(&mut self) -> Result<SleepDone, AgentFailure> {
        GroupLink::wake(self)
    }
}

/// How the agent thread runs steps, watches an idle agent and restarts it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AgentThreadSettings {
    /// A step taking longer counts as a hung agent (it is killed).
    pub step_deadline: Duration,
    /// Wait after the first failed restart attempt; doubled after each further one.
    pub restart_backoff: Duration,
    /// The longest wait between two restart attempts (they never stop while the server runs).
    pub restart_backoff_max: Duration,
    /// How often an idle agent is looked at (process exit, closed socket).
    pub watch_interval: Duration,
}

/// Work for an agent thread.
#[derive(Debug)]
pub(crate) enum AgentJob {
    /// A plan, and where its mask words come from when they follow it.
    Step(StepPlan, Option<FollowingMasks>),
    Restart,
    /// Sleep at this level (the engine sends it only while the agent holds no request).
    Sleep(u8),
    Wake,
    Shutdown,
}

/// What an agent thread reports.
#[derive(Debug)]
pub(crate) enum AgentEvent {
    Stepped {
        step_id: u64,
        outcome: Result<StepResult, AgentFailure>,
        took: Duration,
    },
    /// The agent died (or broke the protocol) while no step was running; it is down.
    Died(AgentFailure),
    /// The agent is back after `attempt` attempts.
    Restarted { attempt: u32 },
    /// Restart attempt `attempt` failed; the next one follows after `retry_in`.
    RestartFailed {
        failure: AgentFailure,
        attempt: u32,
        retry_in: Duration,
    },
    /// The answer to `AgentJob::Sleep` (`wake`: false) or `AgentJob::Wake` (true), and the
    /// round trip's time.
    SleptOrWoke {
        wake: bool,
        outcome: Result<SleepDone, AgentFailure>,
        took: Duration,
    },
}

#[derive(Debug)]
pub(crate) struct AgentReport {
    /// Index of the agent in the engine.
    pub agent: usize,
    pub event: AgentEvent,
}

/// The engine's end of one agent thread.
pub(crate) struct AgentWorker {
    jobs: Sender<AgentJob>,
    thread: Option<JoinHandle<()>>,
}

impl AgentWorker {
    pub fn spawn(
        index: usize,
        agent: Box<dyn StepAgent>,
        reports: Sender<AgentReport>,
        settings: AgentThreadSettings,
    ) -> std::io::Result<Self> {
        let (jobs, rx) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name(format!("agent-{index}"))
            .spawn(move || agent_loop(index, agent, rx, reports, settings))?;
        Ok(Self {
            jobs,
            thread: Some(thread),
        })
    }

    /// Hands a job to the thread; false if the thread is gone.
    pub fn send(&self, job: AgentJob) -> bool {
        self.jobs.send(job).is_ok()
    }

    /// Shuts the agent down and waits for its thread.
    pub fn stop(&mut self) {
        let _ = self.jobs.send(AgentJob::Shutdown);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("an agent thread panicked");
            }
        }
    }
}

impl Drop for AgentWorker {
    fn drop(&mut self) {
        self.stop();
    }
}

fn agent_loop(
    index: usize,
    mut agent: Box<dyn StepAgent>,
    jobs: Receiver<AgentJob>,
    reports: Sender<AgentReport>,
    settings: AgentThreadSettings,
) {
    let report = |event| {
        // The engine is gone when this fails; the next recv ends the loop.
        let _ = reports.send(AgentReport {
            agent: index,
            event,
        });
    };
    loop {
        let job = match jobs.recv_timeout(settings.watch_interval) {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
                if let Some(failure) = agent.check_idle() {
                    report(AgentEvent::Died(failure));
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        match job {
            AgentJob::Step(plan, masks) => {
                let started = Instant::now();
                let outcome = agent.step(&plan, masks.as_ref(), settings.step_deadline);
                report(AgentEvent::Stepped {
                    step_id: plan.step_id,
                    outcome,
                    took: started.elapsed(),
                });
            }
            AgentJob::Restart => {
                if !restart(index, agent.as_mut(), &jobs, settings, &report) {
                    break;
                }
            }
            AgentJob::Sleep(level) => {
                let started = Instant::now();
                let outcome = agent.sleep(level);
                report(AgentEvent::SleptOrWoke {
                    wake: false,
                    outcome,
                    took: started.elapsed(),
                });
            }
            AgentJob::Wake => {
                let started = Instant::now();
                let outcome = agent.wake();
                report(AgentEvent::SleptOrWoke {
                    wake: true,
                    outcome,
                    took: started.elapsed(),
                });
            }
            AgentJob::Shutdown => break,
        }
    }
    agent.shutdown();
}

/// Restarts the agent until it is back: at once, then after `restart_backoff`, doubling up to
/// `restart_backoff_max`. Every failed attempt is logged and reported with its cause. Returns
/// false when a Shutdown (or the engine's end) came while it was waiting to try again.
fn restart(
    index: usize,
    agent: &mut dyn StepAgent,
    jobs: &Receiver<AgentJob>,
    settings: AgentThreadSettings,
    report: &dyn Fn(AgentEvent),
) -> bool {
    let mut wait = settings.restart_backoff;
    let mut attempt = 1;
    loop {
        match agent.restart() {
            Ok(()) => {
                tracing::info!(agent = index, pid = ?agent.pid(), attempt, "agent restarted");
                report(AgentEvent::Restarted { attempt });
                return true;
            }
            Err(failure) => {
                tracing::warn!(
                    agent = index,
                    attempt,
                    retry_in_ms = wait.as_millis() as u64,
                    %failure,
                    "agent restart failed; trying again"
                );
                report(AgentEvent::RestartFailed {
                    failure,
                    attempt,
                    retry_in: wait,
                });
                if !pause_unless_shutdown(index, jobs, wait, report) {
                    return false;
                }
                wait = wait.saturating_mul(2).min(settings.restart_backoff_max);
                attempt += 1;
            }
        }
    }
}

/// Waits `pause`, but returns false at once on Shutdown or when the engine is gone. Other jobs
/// cannot be served by a down agent: a stray step is answered as failed.
fn pause_unless_shutdown(
    index: usize,
    jobs: &Receiver<AgentJob>,
    pause: Duration,
    report: &dyn Fn(AgentEvent),
) -> bool {
    let until = Instant::now() + pause;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match jobs.recv_timeout(left) {
            Err(RecvTimeoutError::Timeout) => return true,
            Ok(AgentJob::Shutdown) | Err(RecvTimeoutError::Disconnected) => return false,
            Ok(AgentJob::Restart) => {}
            Ok(job @ (AgentJob::Sleep(_) | AgentJob::Wake)) => report(AgentEvent::SleptOrWoke {
                wake: matches!(job, AgentJob::Wake),
                outcome: Err(AgentFailure::Down {
                    agent_id: index as u32,
                }),
                took: Duration::ZERO,
            }),
            Ok(AgentJob::Step(plan, _)) => report(AgentEvent::Stepped {
                step_id: plan.step_id,
                outcome: Err(AgentFailure::Down {
                    agent_id: index as u32,
                }),
                took: Duration::ZERO,
            }),
        }
    }
}

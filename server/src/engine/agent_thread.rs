//! One thread per agent: it owns the agent's connection, runs each step plan the engine sends
//! under the step deadline, restarts the agent when asked (with a few attempts), shuts it down,
//! and reports every outcome on a channel shared by all agents.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use npu_protocol::{StepPlan, StepResult};

use crate::agents::{AgentFailure, AgentLink};

/// What the engine needs from an agent: run a step, come back after a failure, stop.
/// `AgentLink` (a real agent process) in production.
pub trait StepAgent: Send {
    /// Runs one step and waits at most `deadline` for its result.
    fn step(&mut self, plan: &StepPlan, deadline: Duration) -> Result<StepResult, AgentFailure>;
    /// Brings a failed agent back with an empty KV pool and no slots.
    fn restart(&mut self) -> Result<(), AgentFailure>;
    /// Stops the agent for good (its resources are released).
    fn shutdown(&mut self);
    /// The agent's process id while it runs, when it has one (logs, tests).
    fn pid(&self) -> Option<u32> {
        None
    }
}

impl StepAgent for AgentLink {
    fn step(&mut self, plan: &StepPlan, deadline: Duration) -> Result<StepResult, AgentFailure> {
        AgentLink::step(self, plan, deadline)
    }
    fn restart(&mut self) -> Result<(), AgentFailure> {
        AgentLink::restart(self)
    }
    fn shutdown(&mut self) {
        AgentLink::shutdown(self)
    }
    fn pid(&self) -> Option<u32> {
        AgentLink::pid(self)
    }
}

/// How the agent thread runs steps and restarts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AgentThreadSettings {
    /// A step taking longer counts as a hung agent (it is killed).
    pub step_deadline: Duration,
    /// Restart attempts before the agent is given up.
    pub restart_attempts: u32,
    /// Wait before the second attempt; doubled after each failed attempt.
    pub restart_backoff: Duration,
}

/// Work for an agent thread.
#[derive(Debug)]
pub(crate) enum AgentJob {
    Step(StepPlan),
    Restart,
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
    /// The outcome of the last restart attempt.
    Restarted(Result<(), AgentFailure>),
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
    while let Ok(job) = jobs.recv() {
        match job {
            AgentJob::Step(plan) => {
                let started = Instant::now();
                let outcome = agent.step(&plan, settings.step_deadline);
                report(AgentEvent::Stepped {
                    step_id: plan.step_id,
                    outcome,
                    took: started.elapsed(),
                });
            }
            AgentJob::Restart => report(AgentEvent::Restarted(restart(
                index,
                agent.as_mut(),
                settings,
            ))),
            AgentJob::Shutdown => break,
        }
    }
    agent.shutdown();
}

fn restart(
    index: usize,
    agent: &mut dyn StepAgent,
    settings: AgentThreadSettings,
) -> Result<(), AgentFailure> {
    let attempts = settings.restart_attempts.max(1);
    let mut wait = settings.restart_backoff;
    let mut attempt = 1;
    loop {
        match agent.restart() {
            Ok(()) => {
                tracing::info!(agent = index, pid = ?agent.pid(), attempt, "agent restarted");
                return Ok(());
            }
            Err(failure) if attempt >= attempts => return Err(failure),
            Err(failure) => {
                tracing::warn!(agent = index, attempt, %failure, "agent restart failed; retrying");
                std::thread::sleep(wait);
                wait = wait.saturating_mul(2);
                attempt += 1;
            }
        }
    }
}

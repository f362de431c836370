//! Sleep and wake in the engine (`POST /sleep`, `/wake_up`, `npu_serving.sleep_idle_seconds`).
//! A sleep waits for the steps in flight, forgets every scheduler's blocks (the agents' KV pools
//! are freed, their contents gone) and sends Sleep to every agent; the model is asleep once all
//! have answered. A request that arrives while the model sleeps (or falls asleep, or wakes) is
//! held in the engine's queue and wakes the agents; once every agent has answered Wake, the
//! queue is dispatched. Nothing is refused for being asleep.

use std::time::{Duration, Instant};

use npu_protocol::frame::SleepDone;
use serde_json::json;

use super::{Engine, Health};
use crate::agents::AgentFailure;
use crate::engine::agent_thread::AgentJob;
use crate::engine::handle::{ControlReply, EngineStats};
use crate::engine::types::{FinishReason, GenEvent, RequestId, Usage};

/// Where the model is between awake and asleep.
#[derive(Debug, Default)]
pub(super) enum SleepState {
    #[default]
    Awake,
    /// Asked to sleep: waits for the steps in flight to come back, then sends Sleep.
    Wanted {
        level: u8,
        by_idle: bool,
    },
    /// Sleep sent; `left` agents have not answered.
    Falling {
        level: u8,
        left: usize,
        started: Instant,
        by_idle: bool,
    },
    Asleep {
        level: u8,
        since: Instant,
    },
    /// Wake sent; `left` agents have not answered.
    Waking {
        level: u8,
        left: usize,
        started: Instant,
    },
}

/// The engine's sleep bookkeeping.
#[derive(Debug)]
pub(super) struct SleepControl {
    pub state: SleepState,
    /// Who waits for the sleep under way, and for the wake under way (or to come).
    sleep_replies: Vec<RequestId>,
    wake_replies: Vec<RequestId>,
    /// Wake as soon as the sleep under way is done (a request or /wake_up came meanwhile).
    wake_after: bool,
    /// Since when no request has arrived or ended (the idle timeout counts from here).
    pub last_activity: Instant,
    /// The agents' reports of the sleep or wake under way: bytes, the slowest agent's time,
    /// and failures.
    bytes: u64,
    slowest_agent: Duration,
    errors: Vec<String>,
}

impl Default for SleepControl {
    fn default() -> Self {
        Self {
            state: SleepState::Awake,
            sleep_replies: Vec::new(),
            wake_replies: Vec::new(),
            wake_after: false,
            last_activity: Instant::now(),
            bytes: 0,
            slowest_agent: Duration::ZERO,
            errors: Vec::new(),
        }
    }
}

impl SleepControl {
    /// Requests are held, not dispatched (asleep, or on the way in or out of it).
    pub fn holds_requests(&self) -> bool {
        !matches!(self.state, SleepState::Awake)
    }
}

impl Engine {
    fn control_reply(&mut self, id: RequestId, status: u16, body: serde_json::Value) {
        let reply = ControlReply { status, body };
        let message = serde_json::to_string(&reply).unwrap_or_default();
        let reason = if status < 400 {
            FinishReason::Stop
        } else {
            FinishReason::Error
        };
        self.events.push((
            id,
            GenEvent::Finished {
                reason,
                usage: Usage::default(),
                message: Some(message),
            },
        ));
    }

    fn conflict(&mut self, id: RequestId, message: String) {
        self.control_reply(
            id,
            409,
            json!({"error": {"message": message, "type": "conflict", "code": 409}}),
        );
    }

    /// `POST /sleep` at `level`.
    pub(super) fn on_sleep_command(&mut self, id: RequestId, level: u8) {
        if !(1..=2).contains(&level) {
            let message = format!("level {level}: 1 or 2");
            return self.control_reply(
                id,
                400,
                json!({"error": {"message": message, "type": "invalid_request_error", "param": "level"}}),
            );
        }
        if self.drain_deadline.is_some() {
            return self.control_reply(
                id,
                503,
                json!({"error": {"message": "the server is shutting down", "type": "unavailable"}}),
            );
        }
        match self.sleep.state {
            SleepState::Asleep { level: now, .. } if level <= now => {
                let body = json!({"is_sleeping": true, "level": now, "already_sleeping": true});
                return self.control_reply(id, 200, body);
            }
            SleepState::Wanted { .. } | SleepState::Falling { .. } => {
                return self.sleep.sleep_replies.push(id);
            }
            SleepState::Waking { .. } => {
                let msg = "the model is waking up; ask again once it is awake".to_string();
                return self.conflict(id, msg);
            }
            SleepState::Awake | SleepState::Asleep { .. } => {}
        }
        let busy = self.requests.len() + self.pending.len();
        if busy > 0 {
            let msg =
                format!("{busy} requests are running or waiting; the model sleeps only while idle");
            return self.conflict(id, msg);
        }
        if let Some(i) = self.agents.iter().position(|a| a.health != Health::Up) {
            let msg = format!("agent {i} is down; the model sleeps only with every agent up");
            return self.conflict(id, msg);
        }
        self.sleep.sleep_replies.push(id);
        self.sleep.state = SleepState::Wanted {
            level,
            by_idle: false,
        };
        self.advance_sleep();
    }

    /// `POST /wake_up`, or a request arriving while the model sleeps (`reply` None).
    pub(super) fn begin_wake(&mut self, reply: Option<RequestId>) {
        match self.sleep.state {
            SleepState::Awake => {
                if let Some(id) = reply {
                    let body = json!({"is_sleeping": false, "already_awake": true});
                    self.control_reply(id, 200, body);
                }
            }
            SleepState::Wanted { .. } | SleepState::Falling { .. } => {
                self.sleep.wake_after = true;
                self.sleep.wake_replies.extend(reply);
            }
            SleepState::Waking { .. } => self.sleep.wake_replies.extend(reply),
            SleepState::Asleep { level, since } => {
                self.sleep.wake_replies.extend(reply);
                self.sleep.wake_after = false;
                self.sleep.bytes = 0;
                self.sleep.slowest_agent = Duration::ZERO;
                self.sleep.errors.clear();
                let mut left = 0;
                for a in &mut self.agents {
                    if !matches!(a.health, Health::Failed(_)) && a.worker.send(AgentJob::Wake) {
                        left += 1;
                    }
                }
                tracing::info!(
                    level,
                    agents = left,
                    asleep_s = since.elapsed().as_secs_f64(),
                    "waking the model"
                );
                self.sleep.state = SleepState::Waking {
                    level,
                    left,
                    started: Instant::now(),
                };
                if left == 0 {
                    self.finish_wake();
                }
            }
        }
    }

    /// Starts the idle timeout's sleep when it is due, and sends a wanted sleep once no step is
    /// in flight. Called every loop turn.
    pub(super) fn advance_sleep(&mut self) {
        if let (SleepState::Awake, Some(idle)) = (&self.sleep.state, self.cfg.sleep.idle) {
            let idle_now = self.requests.is_empty()
                && self.pending.is_empty()
                && self.drain_deadline.is_none()
                && !self.agents_stopped
                && self.agents.iter().all(|a| a.health == Health::Up);
            if !idle_now {
                self.sleep.last_activity = Instant::now();
            } else if self.sleep.last_activity.elapsed() >= idle {
                tracing::info!(
                    idle_s = idle.as_secs_f64(),
                    level = self.cfg.sleep.idle_level,
                    "no request for npu_serving.sleep_idle_seconds: going to sleep"
                );
                self.sleep.state = SleepState::Wanted {
                    level: self.cfg.sleep.idle_level,
                    by_idle: true,
                };
            }
        }
        let SleepState::Wanted { level, by_idle } = self.sleep.state else {
            return;
        };
        if self.agents.iter().any(|a| a.step_in_flight.is_some()) {
            return;
        }
        self.sleep.bytes = 0;
        self.sleep.slowest_agent = Duration::ZERO;
        self.sleep.errors.clear();
        let mut left = 0;
        for a in &mut self.agents {
            // Idle (checked when the sleep was asked for): nothing is recovered; the blocks and
            // the prefix cache go, their KV is freed on the agent.
            let _ = a.sched.take_all();
            if a.health == Health::Up && a.worker.send(AgentJob::Sleep(level)) {
                left += 1;
            }
        }
        EngineStats::set(&self.stats.sleep.level, u64::from(level));
        tracing::info!(level, agents = left, by_idle, "putting the model to sleep");
        self.sleep.state = SleepState::Falling {
            level,
            left,
            started: Instant::now(),
            by_idle,
        };
        if left == 0 {
            self.finish_sleep();
        }
    }

    /// An agent's answer to Sleep or Wake.
    pub(super) fn on_slept_or_woke(
        &mut self,
        i: usize,
        wake: bool,
        outcome: Result<SleepDone, AgentFailure>,
        took: Duration,
    ) {
        match outcome {
            Ok(done) => {
                self.sleep.bytes += done.bytes;
                self.sleep.slowest_agent = self.sleep.slowest_agent.max(took);
            }
            Err(failure) => {
                tracing::warn!(agent = i, wake, %failure, "sleep or wake failed; restarting the agent");
                self.sleep.errors.push(format!("agent {i}: {failure}"));
                if failure.agent_is_down() {
                    self.agent_down(i, failure);
                }
            }
        }
        match &mut self.sleep.state {
            SleepState::Falling { left, .. } if !wake => {
                *left = left.saturating_sub(1);
                if *left == 0 {
                    self.finish_sleep();
                }
            }
            SleepState::Waking { left, .. } if wake => {
                *left = left.saturating_sub(1);
                if *left == 0 {
                    self.finish_wake();
                }
            }
            _ => tracing::debug!(agent = i, wake, "a late answer to sleep or wake ignored"),
        }
    }

    fn finish_sleep(&mut self) {
        let SleepState::Falling {
            level,
            started,
            by_idle,
            ..
        } = self.sleep.state
        else {
            return;
        };
        let took = started.elapsed();
        self.sleep.state = SleepState::Asleep {
            level,
            since: Instant::now(),
        };
        let s = &self.stats.sleep;
        EngineStats::add(&s.sleeps_total, 1);
        if by_idle {
            EngineStats::add(&s.idle_sleeps_total, 1);
        }
        tracing::info!(
            level,
            sleep_s = took.as_secs_f64(),
            released_bytes = self.sleep.bytes,
            errors = ?self.sleep.errors,
            "the model is asleep"
        );
        let body = json!({
            "is_sleeping": true,
            "level": level,
            "sleep_seconds": took.as_secs_f64(),
            "released_bytes": self.sleep.bytes,
            "agent_errors": self.sleep.errors,
        });
        for id in std::mem::take(&mut self.sleep.sleep_replies) {
            self.control_reply(id, 200, body.clone());
        }
        if std::mem::take(&mut self.sleep.wake_after) || !self.pending.is_empty() {
            self.begin_wake(None);
        }
    }

    fn finish_wake(&mut self) {
        let SleepState::Waking { level, started, .. } = self.sleep.state else {
            return;
        };
        let took = started.elapsed();
        self.sleep.state = SleepState::Awake;
        self.sleep.last_activity = Instant::now();
        let s = &self.stats.sleep;
        EngineStats::set(&s.level, 0);
        EngineStats::add(&s.wakes_total, 1);
        EngineStats::set(&s.last_wake_us, took.as_micros() as u64);
        self.metrics.wake_duration.observe(took);
        let cold = EngineStats::get(&s.cold_start_us) as f64 / 1e6;
        tracing::info!(
            level,
            wake_s = took.as_secs_f64(),
            slowest_agent_s = self.sleep.slowest_agent.as_secs_f64(),
            cold_start_s = cold,
            held_requests = self.pending.len(),
            errors = ?self.sleep.errors,
            "the model is awake"
        );
        let body = json!({
            "is_sleeping": false,
            "woke_from_level": level,
            "wake_seconds": took.as_secs_f64(),
            "slowest_agent_seconds": self.sleep.slowest_agent.as_secs_f64(),
            "cold_start_seconds": cold,
            "agent_errors": self.sleep.errors,
        });
        for id in std::mem::take(&mut self.sleep.wake_replies) {
            self.control_reply(id, 200, body.clone());
        }
        for p in std::mem::take(&mut self.pending) {
            self.dispatch(p);
        }
    }

    /// How long the loop may wait before the idle timeout is due (None: not counting).
    pub(super) fn idle_sleep_due_in(&self) -> Option<Duration> {
        let idle = self.cfg.sleep.idle?;
        if !matches!(self.sleep.state, SleepState::Awake) || !self.requests.is_empty() {
            return None;
        }
        Some(idle.saturating_sub(self.sleep.last_activity.elapsed()))
    }
}

//! The engine thread, the one owner of every scheduler and request: it takes commands from the
//! HTTP side, dispatches each request to the least-loaded live agent, keeps every agent busy
//! with the next step as soon as its last one comes back, turns results into events, recovers
//! the requests of a failed agent (busy or idle when it died) on a restarted (or another)
//! agent, and drains on shutdown. With prefill/decode disaggregation (`handoff`), new requests
//! go to agents that prefill and their KV is handed over to agents that decode.

mod handoff;
mod lora;
mod sleep;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{select, Receiver};
use npu_protocol::StepResult;
use npu_tokenizer::Tokenizer;
use thiserror::Error;

use super::agent_thread::{AgentEvent, AgentJob, AgentReport, AgentWorker, StepAgent};
use super::config::EngineConfig;
use super::events::EventOutput;
use super::handle::{EngineCommand, EngineHandle, EngineStats, TaggedEvent};
use super::requests::RequestEntry;
use super::scheduler::{RecoveredRequest, SchedError, Scheduler};
use super::types::{FinishReason, GenerateRequest, RequestId};
use crate::agents::AgentFailure;
use crate::config::AgentRole;
use crate::http::ShutdownSignal;
use crate::kv_events::{KvEventBatch, KvEventSender};
use crate::metrics::Metrics;
use handoff::{AgentHandoffs, HandoffBlocks, PdTotals};
use sleep::SleepControl;

/// Why the engine could not start.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error("engine: no agents to drive")]
    NoAgents,
    #[error("engine: {0}")]
    Scheduler(#[from] SchedError),
    #[error("engine: cannot start a thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// A running engine thread and the handle the HTTP side uses.
pub struct RunningEngine {
    pub handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

impl RunningEngine {
    /// Asks the engine to drain (as a shutdown signal does) and waits for its thread, which ends
    /// once every request is over, the agents are stopped and every clone of the handle (the
    /// HTTP server's too) is dropped.
    pub fn shutdown_and_join(self) {
        let RunningEngine { handle, thread } = self;
        let _ = handle.commands.send(EngineCommand::Shutdown);
        drop(handle);
        if let Some(t) = thread {
            if t.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
    }
}

/// Starts the engine thread over `agents` (one scheduler each). Events go to `out`; a
/// triggered `shutdown` starts the drain like `EngineCommand::Shutdown`.
pub fn start_engine(
    cfg: EngineConfig,
    agents: Vec<Box<dyn StepAgent>>,
    tokenizer: Tokenizer,
    out: Box<dyn EventOutput>,
    metrics: Arc<Metrics>,
    shutdown: Option<ShutdownSignal>,
    kv_events: Option<KvEventSender>,
) -> Result<RunningEngine, EngineError> {
    if agents.is_empty() {
        return Err(EngineError::NoAgents);
    }
    let (reports_tx, reports) = crossbeam_channel::unbounded();
    let mut states = Vec::with_capacity(agents.len());
    for (i, agent) in agents.into_iter().enumerate() {
        let mut sched = Scheduler::new(cfg.scheduler.clone())?;
        if let Some(l) = &cfg.lora {
            sched.set_max_loras(l.0.max_loras as usize);
        }
        if kv_events.is_some() {
            sched.record_kv_events();
        }
        let worker = AgentWorker::spawn(i, agent, reports_tx.clone(), cfg.thread_settings())?;
        states.push(AgentState {
            sched,
            worker,
            health: Health::Up,
            step_in_flight: None,
            time: StepTimes::default(),
            role: cfg.roles.get(i).copied().unwrap_or_default(),
            handoffs: AgentHandoffs::default(),
        });
    }
    let (commands_tx, commands) = crossbeam_channel::unbounded();
    let stats = Arc::new(EngineStats::default());
    let handle = EngineHandle {
        commands: commands_tx,
        stats: stats.clone(),
    };
    let engine = Engine {
        handoff: HandoffBlocks::new(cfg.handoff_blocks),
        cfg,
        agents: states,
        commands,
        reports,
        requests: HashMap::new(),
        pending: VecDeque::new(),
        tokenizer,
        out,
        events: Vec::new(),
        stats,
        metrics,
        shutdown,
        drain_deadline: None,
        agents_stopped: false,
        constrained: 0,
        commands_closed: false,
        kv_events,
        sleep: SleepControl::default(),
        loras: HashMap::new(),
        lora_loads: crossbeam_channel::unbounded(),
    };
    engine.publish_stats();
    let thread = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || engine.run())?;
    Ok(RunningEngine {
        handle,
        thread: Some(thread),
    })
}

#[derive(Debug, Clone, PartialEq)]
enum Health {
    Up,
    /// Its thread is restarting it; `failed_attempts` attempts have failed so far, the last
    /// for `last_failure`. Requests wait for it only while no attempt has failed.
    Restarting {
        failed_attempts: u32,
        last_failure: Option<String>,
    },
    /// Its thread is gone: it cannot come back; the message says why.
    Failed(String),
}

impl Health {
    /// Down, and the restart under way has not failed yet: worth waiting for.
    fn coming_back(&self) -> bool {
        matches!(
            self,
            Health::Restarting {
                failed_attempts: 0,
                ..
            }
        )
    }
}

struct AgentState {
    sched: Scheduler,
    worker: AgentWorker,
    health: Health,
    step_in_flight: Option<u64>,
    time: StepTimes,
    /// What it does with requests (prefill/decode disaggregation; `Both` when colocated).
    role: AgentRole,
    handoffs: AgentHandoffs,
}

/// Where an agent's time went, for the log at shutdown: how much of the steps' round trips the
/// agent spent computing, and how long it sat without a step while requests were running.
#[derive(Debug, Default)]
struct StepTimes {
    steps: u64,
    round_trip: Duration,
    agent: Duration,
    /// Since the last result, while the agent held requests (None: no result pending use).
    idle_since: Option<Instant>,
    idle_with_work: Duration,
    /// Making the token masks of its steps' constrained requests (while the agent computes).
    masks: Duration,
}

/// A request no agent holds right now (none was up when it came, or its agent failed).
enum Pending {
    Fresh(GenerateRequest),
    Recovered(RecoveredRequest),
}

impl Pending {
    fn id(&self) -> RequestId {
        match self {
            Pending::Fresh(r) => r.id,
            Pending::Recovered(r) => r.request.id,
        }
    }
}

struct Engine {
    cfg: EngineConfig,
    agents: Vec<AgentState>,
    commands: Receiver<EngineCommand>,
    reports: Receiver<AgentReport>,
    requests: HashMap<RequestId, RequestEntry>,
    pending: VecDeque<Pending>,
    tokenizer: Tokenizer,
    out: Box<dyn EventOutput>,
    /// Events of this loop turn, sent together at its end.
    events: Vec<TaggedEvent>,
    stats: Arc<EngineStats>,
    metrics: Arc<Metrics>,
    shutdown: Option<ShutdownSignal>,
    /// Set once draining: requests still running then are ended with `Shutdown`.
    drain_deadline: Option<Instant>,
    agents_stopped: bool,
    /// Live requests with a grammar: steps look for token masks only while there are some.
    constrained: usize,
    commands_closed: bool,
    /// The handoff region's blocks (none when prefill and decode are colocated).
    handoff: HandoffBlocks,
    /// Where the prefix caches' KV events go (None: not published).
    kv_events: Option<KvEventSender>,
    /// Sleep and wake (`POST /sleep`, `/wake_up`, the idle timeout).
    sleep: SleepControl,
    /// The adapter of each live request that runs under one.
    loras: HashMap<RequestId, npu_protocol::LoraRequest>,
    /// Answers of adapter loads read on threads of their own (`POST /v1/load_lora_adapter`).
    lora_loads: lora::LoraLoads,
}

impl Engine {
    fn run(mut self) {
        loop {
            let timeout = self.wait_timeout();
            select! {
                recv(self.commands) -> cmd => match cmd {
                    Ok(cmd) => self.on_command(cmd),
                    Err(_) => self.on_commands_closed(),
                },
                recv(self.reports) -> rep => {
                    if let Ok(rep) = rep {
                        self.on_report(rep);
                    }
                },
                recv(self.lora_loads.1) -> done => {
                    if let Ok((id, reply)) = done {
                        self.lora_loaded(id, reply);
                    }
                },
                default(timeout) => {},
            }
            // Everything that has arrived joins the next steps.
            while let Ok(cmd) = self.commands.try_recv() {
                self.on_command(cmd);
            }
            while let Ok(rep) = self.reports.try_recv() {
                self.on_report(rep);
            }
            self.check_drain();
            self.advance_sleep();
            self.kick_idle_agents();
            self.flush_events();
            self.publish_kv_events();
            self.publish_stats();
            if self.commands_closed && self.agents_stopped {
                return;
            }
        }
    }

    /// Hands each agent's KV events of this turn to the publisher (one batch per agent).
    fn publish_kv_events(&mut self) {
        let Some(tx) = &self.kv_events else {
            return;
        };
        for (i, a) in self.agents.iter_mut().enumerate() {
            let events = a.sched.take_kv_events();
            if !events.is_empty() {
                tx.send(KvEventBatch::now(i as u32, events));
            }
        }
    }

    fn wait_timeout(&self) -> Duration {
        let mut t = if self.shutdown.is_some() && self.drain_deadline.is_none() {
            self.cfg.idle_tick
        } else {
            Duration::from_secs(3600)
        };
        if let Some(d) = self.drain_deadline {
            t = t.min(
                d.saturating_duration_since(Instant::now())
                    .max(self.cfg.idle_tick),
            );
        }
        if let Some(due) = self.idle_sleep_due_in() {
            t = t.min(due.max(self.cfg.idle_tick));
        }
        t
    }

    fn emit_finished(&mut self, id: RequestId, reason: FinishReason, message: Option<String>) {
        self.sleep.last_activity = Instant::now();
        self.loras.remove(&id);
        if let Some(entry) = self.requests.remove(&id) {
            if entry.constraint.is_some() {
                self.constrained -= 1;
            }
            self.events.push(entry.finished(id, reason, message));
            EngineStats::add(&self.stats.requests_finished_total, 1);
        }
    }

    fn submit(
        &mut self,
        mut req: GenerateRequest,
        constraint: Option<Box<npu_structured::Constraint>>,
    ) {
        let id = req.id;
        // A grammar's mask is made for one token at a time: nothing to draft against.
        req.speculative &= constraint.is_none();
        if self.requests.contains_key(&id) {
            tracing::error!(request = id, "a request id was submitted twice; ignored");
            return;
        }
        self.sleep.last_activity = Instant::now();
        let mut entry = RequestEntry::new(&req, &self.tokenizer);
        self.constrained += usize::from(constraint.is_some());
        entry.constraint = constraint;
        self.requests.insert(id, entry);
        if self.drain_deadline.is_some() {
            let msg = "the server is shutting down".to_string();
            return self.emit_finished(id, FinishReason::Shutdown, Some(msg));
        }
        EngineStats::add(&self.stats.prompt_tokens_total, req.prompt_ids.len() as u64);
        self.dispatch(Pending::Fresh(req));
    }

    /// Names in `plan` the slots of the constrained requests that sample in it, their mask
    /// words to follow (`StepPlan::masks_follow`); returns them with their requests.
    fn announce_masks(&self, i: usize, plan: &mut npu_protocol::StepPlan) -> Vec<(u32, RequestId)> {
        let masked: Vec<(u32, RequestId)> = self.agents[i]
            .sched
            .sampling_in(plan.step_id)
            .into_iter()
            .filter(|(_, id)| {
                self.requests
                    .get(id)
                    .is_some_and(|e| e.constraint.is_some())
            })
            .collect();
        plan.masks
            .extend(masked.iter().map(|&(slot, _)| npu_protocol::TokenMask {
                slot,
                words: Vec::new(),
            }));
        masked
    }

    /// The token masks of `masked` requests, made now that their last token is known (each
    /// grammar runs here, on the engine thread, while the agent runs the forward pass).
    fn make_masks(&mut self, masked: &[(u32, RequestId)]) -> Vec<npu_protocol::TokenMask> {
        masked
            .iter()
            .filter_map(|&(slot, id)| {
                let words = self.requests.get_mut(&id)?.next_mask()?;
                Some(npu_protocol::TokenMask { slot, words })
            })
            .collect()
    }

    fn on_command(&mut self, cmd: EngineCommand) {
        match cmd {
            EngineCommand::Submit(req) => self.submit(req, None),
            EngineCommand::SubmitConstrained(req, c) => self.submit(req, Some(c)),
            EngineCommand::Abort(id) => {
                let Some(entry) = self.requests.get(&id) else {
                    return;
                };
                match entry.agent {
                    Some(i) => {
                        self.agents[i].sched.abort(id);
                        self.emit_finished(id, FinishReason::Aborted, None);
                        return self.release_taken_in(i);
                    }
                    None => self.pending.retain(|p| p.id() != id),
                }
                self.emit_finished(id, FinishReason::Aborted, None);
            }
            EngineCommand::Shutdown => self.begin_drain(),
            EngineCommand::Sleep { id, level } => self.on_sleep_command(id, level),
            EngineCommand::Wake { id } => self.begin_wake(Some(id)),
            EngineCommand::SubmitLora(req, c, lora) => self.submit_lora(req, c, lora),
            EngineCommand::LoadLora { id, name, path } => self.load_lora(id, &name, &path),
        }
    }

    /// The HTTP side is gone: nobody will read events any more; end everything now.
    fn on_commands_closed(&mut self) {
        self.commands_closed = true;
        self.commands = crossbeam_channel::never();
        if self.drain_deadline.is_none() {
            self.begin_drain();
        }
        self.drain_deadline = Some(Instant::now());
    }

    fn begin_drain(&mut self) {
        if self.drain_deadline.is_some() {
            return;
        }
        tracing::info!(
            running = self.requests.len(),
            grace_ms = self.cfg.shutdown_grace.as_millis() as u64,
            "engine: draining; new requests are refused"
        );
        self.drain_deadline = Some(Instant::now() + self.cfg.shutdown_grace);
        self.stats.draining.store(true, Ordering::Relaxed);
    }

    /// Starts the drain on a shutdown signal, ends what is left when the grace is over, and
    /// stops the agents once nothing is left.
    fn check_drain(&mut self) {
        if self.drain_deadline.is_none() && self.shutdown.as_ref().is_some_and(|s| s.is_triggered())
        {
            self.begin_drain();
        }
        let Some(deadline) = self.drain_deadline else {
            return;
        };
        if Instant::now() >= deadline && !self.requests.is_empty() {
            let ids: Vec<RequestId> = self.requests.keys().copied().collect();
            tracing::info!(
                left = ids.len(),
                "engine: shutdown grace is over; ending the requests left"
            );
            for id in ids {
                if let Some(i) = self.requests.get(&id).and_then(|e| e.agent) {
                    self.agents[i].sched.abort(id);
                }
                let msg = "the server shut down before the request could finish".to_string();
                self.emit_finished(id, FinishReason::Shutdown, Some(msg));
            }
            self.pending.clear();
        }
        if self.requests.is_empty() && !self.agents_stopped {
            for (i, a) in self.agents.iter_mut().enumerate() {
                a.worker.stop();
                let t = &a.time;
                tracing::info!(
                    agent = i,
                    steps = t.steps,
                    round_trip_s = t.round_trip.as_secs_f64(),
                    agent_compute_s = t.agent.as_secs_f64(),
                    idle_between_steps_s = t.idle_with_work.as_secs_f64(),
                    token_masks_s = t.masks.as_secs_f64(),
                    "engine: step times"
                );
            }
            self.agents_stopped = true;
            tracing::info!("engine: agents stopped");
        }
    }

    /// Gives a request to the least-loaded live agent, or parks it until one is up.
    fn dispatch(&mut self, p: Pending) {
        if self.sleep.holds_requests() {
            // Asleep (or on the way in or out of it): held until every agent is awake.
            self.pending.push_back(p);
            return self.begin_wake(None);
        }
        let id = p.id();
        // Prompts (and recomputations) are computed only where the role allows it.
        let target = self
            .agents
            .iter()
            .enumerate()
            .filter(|(_, a)| a.health == Health::Up && a.role.prefills())
            .min_by_key(|(_, a)| a.sched.load())
            .map(|(i, _)| i);
        let Some(i) = target else {
            if self
                .agents
                .iter()
                .any(|a| a.health.coming_back() && a.role.prefills())
            {
                self.pending.push_back(p);
            } else {
                let msg = format!("no agent can serve requests: {}", self.failures());
                self.emit_finished(id, FinishReason::Error, Some(msg));
            }
            return;
        };
        let fresh = matches!(p, Pending::Fresh(_));
        let sched = &mut self.agents[i].sched;
        let added = match p {
            Pending::Fresh(req) => sched.add(&req),
            Pending::Recovered(rec) => sched.add_recovered(rec),
        };
        let added = added.and_then(|()| match self.loras.get(&id) {
            Some(l) => self.agents[i]
                .sched
                .set_lora(id, l.clone())
                .inspect_err(|_| {
                    self.agents[i].sched.abort(id);
                }),
            None => Ok(()),
        });
        match added {
            Ok(()) => {
                if let Some(e) = self.requests.get_mut(&id) {
                    e.agent = Some(i);
                }
            }
            // A new request that can never run is refused, not answered with empty text (the
            // API checks the same limits first, so this is a last line of defence).
            Err(e @ (SchedError::TooLong { .. } | SchedError::ExceedsPool { .. })) if fresh => {
                self.emit_finished(id, FinishReason::Rejected, Some(e.to_string()))
            }
            Err(e @ (SchedError::TooLong { .. } | SchedError::ExceedsPool { .. })) => {
                self.emit_finished(id, FinishReason::ContextLength, Some(e.to_string()))
            }
            Err(e @ SchedError::AlreadyComplete { .. }) => {
                self.emit_finished(id, FinishReason::Length, Some(e.to_string()))
            }
            Err(e) => self.emit_finished(id, FinishReason::Error, Some(e.to_string())),
        }
    }

    fn failures(&self) -> String {
        let list: Vec<String> = self
            .agents
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match &a.health {
                Health::Failed(why) => Some(format!("agent {i}: {why}")),
                Health::Restarting {
                    failed_attempts,
                    last_failure: Some(why),
                } => Some(format!(
                    "agent {i}: {why} (restart attempt {failed_attempts} failed; still trying)"
                )),
                _ => None,
            })
            .collect();
        if list.is_empty() {
            "every agent is down".into()
        } else {
            list.join("; ")
        }
    }

    /// Sends the next step to every live agent that has none in flight; then makes the token
    /// masks of the constrained requests in them, which the agents wait for only once their
    /// forward passes are done.
    fn kick_idle_agents(&mut self) {
        if self.agents_stopped || self.sleep.holds_requests() {
            return;
        }
        let mut following = Vec::new();
        for i in 0..self.agents.len() {
            if self.agents[i].health != Health::Up || self.agents[i].step_in_flight.is_some() {
                continue;
            }
            self.hand_over_ready(i);
            let a = &mut self.agents[i];
            let idle_since = a.time.idle_since.take();
            if let Some(mut plan) = a.sched.schedule() {
                let step_id = plan.step_id;
                let masked = if self.constrained > 0 {
                    self.announce_masks(i, &mut plan)
                } else {
                    Vec::new()
                };
                let (tx, rx) = match masked.is_empty() {
                    true => (None, None),
                    false => {
                        let (tx, rx) = crossbeam_channel::bounded(1);
                        (Some(tx), Some(rx))
                    }
                };
                let a = &mut self.agents[i];
                if a.worker.send(AgentJob::Step(plan, rx)) {
                    a.step_in_flight = Some(step_id);
                    if let Some(since) = idle_since {
                        a.time.idle_with_work += since.elapsed();
                    }
                    following.extend(tx.map(|tx| (i, tx, masked)));
                }
            }
        }
        for (i, tx, masked) in following {
            let started = Instant::now();
            let masks = self.make_masks(&masked);
            self.agents[i].time.masks += started.elapsed();
            // A send fails only when the agent's thread gave the step up (the agent is down).
            let _ = tx.send(masks);
        }
    }

    fn on_report(&mut self, rep: AgentReport) {
        let i = rep.agent;
        match rep.event {
            AgentEvent::Stepped {
                step_id,
                outcome,
                took,
            } => {
                if self.agents[i].step_in_flight != Some(step_id) {
                    // A step sent before the agent was found dead: its requests are already
                    // recovered elsewhere.
                    tracing::debug!(agent = i, step_id, "outcome of an abandoned step ignored");
                    return;
                }
                self.agents[i].step_in_flight = None;
                match outcome {
                    Ok(result) => {
                        let t = &mut self.agents[i].time;
                        t.steps += 1;
                        t.round_trip += took;
                        t.agent += Duration::from_micros(result.timing.total_us);
                        let (kv, tr) = (&self.stats.kv, &result.transfer);
                        EngineStats::add(&kv.step_input_bytes_total, tr.input_bytes);
                        EngineStats::add(&kv.copy_us_total, tr.copy_us);
                        if !result.seqs.is_empty() || tr.input_bytes > 0 {
                            EngineStats::set(&kv.last_step_input_bytes, tr.input_bytes);
                            EngineStats::set(&kv.last_step_block_table_bytes, tr.block_table_bytes);
                        }
                        self.metrics.step_time.observe(took);
                        EngineStats::add(&self.stats.steps_total, 1);
                        let arrived = Instant::now();
                        self.on_step_result(i, &result);
                        if self.agents[i].health == Health::Up {
                            self.deliver_handed_over(i);
                            self.release_taken_in(i);
                        }
                        let a = &mut self.agents[i];
                        if !a.sched.is_idle() {
                            a.time.idle_since = Some(arrived);
                        }
                    }
                    Err(failure) => self.on_step_failure(i, step_id, failure),
                }
            }
            AgentEvent::SleptOrWoke {
                wake,
                outcome,
                took,
            } => self.on_slept_or_woke(i, wake, outcome, took),
            AgentEvent::Died(failure) => {
                if self.agents[i].health == Health::Up {
                    self.agent_down(i, failure);
                }
            }
            AgentEvent::Restarted { attempt } => {
                self.agents[i].health = Health::Up;
                EngineStats::add(&self.stats.agent_restarts_total, 1);
                tracing::info!(agent = i, attempt, "agent is back; serving");
                for p in std::mem::take(&mut self.pending) {
                    self.dispatch(p);
                }
            }
            AgentEvent::RestartFailed {
                failure,
                attempt,
                retry_in,
            } => {
                self.agents[i].health = Health::Restarting {
                    failed_attempts: attempt,
                    last_failure: Some(failure.to_string()),
                };
                if !self
                    .agents
                    .iter()
                    .any(|a| a.health == Health::Up || a.health.coming_back())
                    && !self.pending.is_empty()
                {
                    let msg = format!("no agent can serve requests: {}", self.failures());
                    tracing::error!(
                        agent = i,
                        attempt,
                        retry_in_ms = retry_in.as_millis() as u64,
                        requests = self.pending.len(),
                        "no agent is up and a restart failed: ending the waiting requests"
                    );
                    for p in std::mem::take(&mut self.pending) {
                        self.emit_finished(p.id(), FinishReason::Error, Some(msg.clone()));
                    }
                }
            }
        }
    }

    fn on_step_result(&mut self, i: usize, result: &StepResult) {
        self.end_failed_seqs(i, result);
        let outs = match self.agents[i].sched.on_result(result) {
            Ok(outs) => outs,
            Err(e) => {
                // The agent answered something its plan did not ask for: do not trust it.
                let failure = AgentFailure::Protocol {
                    agent_id: i as u32,
                    detail: e.to_string(),
                };
                return self.agent_down(i, failure);
            }
        };
        EngineStats::add(&self.stats.generated_tokens_total, outs.len() as u64);
        for out in &outs {
            let Some(entry) = self.requests.get_mut(&out.id) else {
                continue;
            };
            if let Some(reason) = entry.on_token(out.id, out, &mut self.events) {
                let message = entry.failure.take();
                if out.finished.is_none() {
                    self.agents[i].sched.finish(out.id, reason);
                }
                self.emit_finished(out.id, reason, message);
            }
        }
    }

    fn on_step_failure(&mut self, i: usize, step_id: u64, failure: AgentFailure) {
        if failure.agent_is_down() {
            return self.agent_down(i, failure);
        }
        // The agent is up but could not run this step: the requests in it cannot go on.
        tracing::error!(agent = i, %failure, "step failed; ending its requests");
        self.handoffs_lost(i, false);
        let ids = self.agents[i].sched.step_failed(step_id);
        for id in ids {
            self.agents[i].sched.abort(id);
            self.emit_finished(id, FinishReason::Error, Some(failure.to_string()));
        }
        self.release_taken_in(i);
    }

    /// The agent is gone: its requests (with the tokens they have) move to live agents or wait
    /// for it to come back, and its thread restarts it.
    fn agent_down(&mut self, i: usize, failure: AgentFailure) {
        if self.agents[i].health != Health::Up {
            return;
        }
        tracing::warn!(agent = i, %failure, "agent down; restarting it and re-queueing its requests");
        let a = &mut self.agents[i];
        a.health = Health::Restarting {
            failed_attempts: 0,
            last_failure: None,
        };
        a.step_in_flight = None;
        let recovered = a.sched.take_all();
        if !a.worker.send(AgentJob::Restart) {
            a.health = Health::Failed(format!("{failure}; its thread is gone"));
        }
        self.handoffs_lost(i, true);
        for rec in recovered {
            if let Some(e) = self.requests.get_mut(&rec.request.id) {
                e.agent = None;
            }
            self.dispatch(Pending::Recovered(rec));
        }
    }

    fn flush_events(&mut self) {
        if !self.events.is_empty() {
            let events = std::mem::take(&mut self.events);
            self.out.send_all(events);
        }
    }

    fn publish_stats(&self) {
        self.publish_lora_activity();
        let s = &self.stats;
        let (mut running, mut waiting, mut used, mut total, mut preempted) = (0, 0, 0, 0, 0);
        let (mut queried, mut hit) = (0, 0);
        let (mut drafted, mut kept) = (0, 0);
        let mut kv = [0u64; 10];
        let mut pd = PdTotals::default();
        for a in &self.agents {
            let st = a.sched.stats();
            pd.add(a.role, &st);
            for (acc, v) in kv.iter_mut().zip([
                st.preemptions_swap,
                st.swap_out_blocks,
                st.swap_in_blocks,
                st.swap_out_blocks * st.block_bytes,
                st.swap_in_blocks * st.block_bytes,
                st.prefix_hit_tokens_host,
                st.host_spilled_blocks,
                st.host_blocks_total as u64,
                st.host_blocks_cached as u64,
                st.host_blocks_swapped as u64,
            ]) {
                *acc += v;
            }
            running += st.running as u64;
            waiting += st.waiting as u64;
            used += st.blocks_used as u64;
            total += st.blocks_total as u64;
            preempted += st.preemptions;
            queried += st.prefix_query_tokens;
            hit += st.prefix_hit_tokens;
            drafted += st.spec_drafted_tokens;
            kept += st.spec_accepted_tokens;
        }
        waiting += self.pending.len() as u64;
        let up = self
            .agents
            .iter()
            .filter(|a| a.health == Health::Up)
            .count() as u64;
        EngineStats::set(&s.running, running);
        EngineStats::set(&s.waiting, waiting);
        EngineStats::set(&s.kv_blocks_used, used);
        EngineStats::set(&s.kv_blocks_total, total);
        EngineStats::set(&s.preemptions_total, preempted);
        EngineStats::set(&s.prefix_cache_queried_tokens_total, queried);
        EngineStats::set(&s.prefix_cache_hit_tokens_total, hit);
        EngineStats::set(&s.spec_draft_tokens_total, drafted);
        EngineStats::set(&s.spec_accepted_tokens_total, kept);
        let k = &s.kv;
        for (stat, v) in [
            &k.preemptions_swap_total,
            &k.swap_out_blocks_total,
            &k.swap_in_blocks_total,
            &k.swap_out_bytes_total,
            &k.swap_in_bytes_total,
            &k.prefix_hit_tokens_host_total,
            &k.host_spilled_blocks_total,
            &k.host_blocks_total,
            &k.host_blocks_cached,
            &k.host_blocks_swapped,
        ]
        .into_iter()
        .zip(kv)
        {
            EngineStats::set(stat, v);
        }
        pd.publish(&s.pd, &self.handoff, self.cfg.handoff_block_bytes);
        let up = if self.agents_stopped { 0 } else { up };
        // Each engine agent is a group of `tp` agent processes (one without tensor parallelism).
        let tp = u64::from(self.cfg.tensor_parallel_size.max(1));
        EngineStats::set(&s.groups_total, self.agents.len() as u64);
        EngineStats::set(&s.groups_up, up);
        EngineStats::set(&s.tensor_parallel_size, tp);
        EngineStats::set(&s.agents_total, self.agents.len() as u64 * tp);
        EngineStats::set(&s.agents_up, up * tp);
        s.ready
            .store(up == self.agents.len() as u64, Ordering::Relaxed);
    }
}

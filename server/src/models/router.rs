//! The model router: with several models configured, it is the engine the HTTP loop talks to.
//! It owns one engine (with its agents) per loaded model, forwards each request to the engine of
//! the model it names, holds the requests of a model that is not loaded (never fails them) while
//! that model loads, and unloads the least recently used model when loading another would put
//! more than `max_resident_models` in memory. A model with requests running is never unloaded
//! under them: once chosen to make room, its new requests are held and it is unloaded when the
//! ones running have finished. Loads and unloads run on their own threads; the router's loop
//! never waits for one.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use npu_tokenizer::Tokenizer;

use super::status::{ModelState, ModelsStatus};
use crate::config::ServerConfig;
use crate::engine::{
    EngineCommand, EngineConfig, EngineHandle, EngineStats, EventOutput, FinishReason, GenEvent,
    GenerateRequest, RequestId, RunningEngine, TaggedEvent, Usage,
};
use crate::http::{EventSink, ShutdownSignal};
use crate::metrics::Metrics;

/// How often the loop wakes without a message (shutdown signal, stats).
const TICK: Duration = Duration::from_millis(20);
/// A routing note the HTTP loop never followed with a submission (it answered 429) is dropped
/// after this long.
const NOTE_TTL: Duration = Duration::from_secs(120);

/// What the router needs to start one model: its config, file, tokenizer and engine settings,
/// all read and checked at server start.
pub(crate) struct ModelSpec {
    pub name: String,
    pub cfg: ServerConfig,
    pub path: PathBuf,
    pub tokenizer: Tokenizer,
    pub engine: EngineConfig,
    /// The model's own context length (for a KV pool sized by the agents).
    pub context: u32,
}

/// Which model a submission is for, noted by the HTTP handler before it returns the submission:
/// the model and how many more choices (`n > 1`) follow it. The HTTP loop sends a submission's
/// choices one after another from its single thread, so the `more` submissions that follow the
/// noted one, ids not noted, belong to the same model.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Note {
    pub model: usize,
    pub more: usize,
    pub at: Instant,
}

pub(crate) type Notes = Arc<Mutex<HashMap<RequestId, Note>>>;

/// What load, unload and event threads tell the router.
enum Internal {
    Finished(usize, RequestId),
    Loaded {
        model: usize,
        result: Result<RunningEngine, String>,
        took: Duration,
    },
    Unloaded {
        model: usize,
        stats: Arc<EngineStats>,
    },
}

/// A request held until its model is loaded.
enum Held {
    Plain(GenerateRequest),
    Constrained(GenerateRequest, Box<npu_structured::Constraint>),
}

impl Held {
    fn id(&self) -> RequestId {
        match self {
            Self::Plain(r) | Self::Constrained(r, _) => r.id,
        }
    }

    fn into_command(self) -> EngineCommand {
        match self {
            Self::Plain(r) => EngineCommand::Submit(r),
            Self::Constrained(r, c) => EngineCommand::SubmitConstrained(r, c),
        }
    }
}

/// The engine's counters summed over the engines a model has had (they restart at 0 with each
/// load).
const COUNTERS: usize = 10;
fn counters(s: &EngineStats) -> [&AtomicU64; COUNTERS] {
    [
        &s.prompt_tokens_total,
        &s.generated_tokens_total,
        &s.requests_finished_total,
        &s.preemptions_total,
        &s.prefix_cache_queried_tokens_total,
        &s.prefix_cache_hit_tokens_total,
        &s.agent_restarts_total,
        &s.steps_total,
        &s.spec_draft_tokens_total,
        &s.spec_accepted_tokens_total,
    ]
}

/// The gauges summed over the loaded engines.
const GAUGES: usize = 8;
fn gauges(s: &EngineStats) -> [&AtomicU64; GAUGES] {
    [
        &s.agents_total,
        &s.agents_up,
        &s.groups_total,
        &s.groups_up,
        &s.running,
        &s.waiting,
        &s.kv_blocks_used,
        &s.kv_blocks_total,
    ]
}
/// Where `waiting` is in `gauges`.
const WAITING: usize = 5;

/// One configured model as the router sees it.
struct Slot {
    spec: Arc<ModelSpec>,
    engine: Option<RunningEngine>,
    /// The engine's counters of the models' earlier loads.
    base: [u64; COUNTERS],
    held: VecDeque<Held>,
    /// When its oldest held request arrived (the order in which waiting models load).
    held_since: Option<Instant>,
    /// Requests forwarded to its engine and not finished yet.
    inflight: HashSet<RequestId>,
    last_used: Instant,
    /// Chosen to be unloaded: new requests are held, and it goes once `inflight` is empty.
    make_room: bool,
    /// The figures of its engine while that engine stops (then added to `base`).
    retiring: Option<Arc<EngineStats>>,
    /// Its load failed while other models were loaded (perhaps for want of memory): they are
    /// unloaded and the load is tried once more before its held requests get the error.
    retry_alone: bool,
    /// This load is that second try.
    retrying: bool,
}

/// The router thread, seen from `serve`: its handle (what the HTTP loop sends to) and the
/// thread.
pub(crate) struct Router {
    pub handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

impl Router {
    pub fn start(
        specs: Vec<ModelSpec>,
        status: Arc<ModelsStatus>,
        out: EventSink,
        metrics: Arc<Metrics>,
        shutdown: ShutdownSignal,
        notes: Notes,
    ) -> std::io::Result<Self> {
        let (commands_tx, commands) = crossbeam_channel::unbounded();
        let (internal_tx, internal) = crossbeam_channel::unbounded();
        let stats = Arc::new(EngineStats::default());
        stats.ready.store(true, Ordering::Relaxed);
        EngineStats::set(&stats.tensor_parallel_size, 1);
        let now = Instant::now();
        let slots = specs
            .into_iter()
            .map(|spec| Slot {
                spec: Arc::new(spec),
                engine: None,
                base: [0; COUNTERS],
                held: VecDeque::new(),
                held_since: None,
                inflight: HashSet::new(),
                last_used: now,
                make_room: false,
                retiring: None,
                retry_alone: false,
                retrying: false,
            })
            .collect();
        let lp = RouterLoop {
            slots,
            status,
            commands,
            commands_closed: false,
            internal_tx,
            internal,
            out,
            metrics,
            shutdown,
            notes,
            owner: HashMap::new(),
            more: None,
            stats: stats.clone(),
            stopping: false,
        };
        let thread = std::thread::Builder::new()
            .name("model-router".into())
            .spawn(move || lp.run())?;
        Ok(Self {
            handle: EngineHandle {
                commands: commands_tx,
                stats,
            },
            thread: Some(thread),
        })
    }

    /// Stops every model's engine (running requests drain as at any shutdown) and waits for
    /// the router's thread.
    pub fn shutdown_and_join(self) {
        let Router { handle, thread } = self;
        let _ = handle.commands.send(EngineCommand::Shutdown);
        drop(handle);
        if let Some(t) = thread {
            if t.join().is_err() {
                tracing::error!("the model router's thread panicked");
            }
        }
    }
}

/// A loaded model's engine sends its events here: on to the HTTP loop, and each request's end
/// to the router (which then knows the model is idle).
struct RouterSink {
    inner: EventSink,
    model: usize,
    tx: Sender<Internal>,
}

impl EventOutput for RouterSink {
    fn send_all(&self, events: Vec<TaggedEvent>) -> bool {
        for (id, e) in &events {
            if matches!(e, GenEvent::Finished { .. }) {
                let _ = self.tx.send(Internal::Finished(self.model, *id));
            }
        }
        self.inner.send_all(events)
    }
}

struct RouterLoop {
    slots: Vec<Slot>,
    status: Arc<ModelsStatus>,
    commands: Receiver<EngineCommand>,
    commands_closed: bool,
    internal_tx: Sender<Internal>,
    internal: Receiver<Internal>,
    out: EventSink,
    metrics: Arc<Metrics>,
    shutdown: ShutdownSignal,
    notes: Notes,
    /// The model of every request held or running.
    owner: HashMap<RequestId, usize>,
    /// Choices of the last noted submission still to come: the model and how many.
    more: Option<(usize, usize)>,
    /// What the HTTP side reads: the loaded engines' figures summed, held requests as waiting.
    stats: Arc<EngineStats>,
    stopping: bool,
}

impl RouterLoop {
    fn run(mut self) {
        let mut last_sweep = Instant::now();
        // Handles of the two channels, so that the select does not borrow `self`.
        let (commands, internal) = (self.commands.clone(), self.internal.clone());
        loop {
            if self.commands_closed {
                if let Ok(m) = internal.recv_timeout(TICK) {
                    self.internal(m);
                }
            } else {
                crossbeam_channel::select! {
                    recv(commands) -> c => match c {
                        Ok(c) => self.command(c),
                        Err(_) => {
                            self.commands_closed = true;
                            self.stopping = true;
                        }
                    },
                    recv(internal) -> m => {
                        if let Ok(m) = m {
                            self.internal(m);
                        }
                    }
                    default(TICK) => {}
                }
            }
            if self.shutdown.is_triggered() && !self.stopping {
                self.stopping = true;
            }
            if self.stopping {
                self.end_held(FinishReason::Shutdown, "the server is shutting down");
            }
            self.schedule();
            self.publish();
            if last_sweep.elapsed() > NOTE_TTL {
                last_sweep = Instant::now();
                if let Ok(mut notes) = self.notes.lock() {
                    notes.retain(|_, n| n.at.elapsed() < NOTE_TTL);
                }
            }
            if self.stopping && self.commands_closed && self.transitions() == 0 {
                break;
            }
        }
        for (m, slot) in self.slots.iter_mut().enumerate() {
            if let Some(engine) = slot.engine.take() {
                tracing::info!(model = %slot.spec.name, "stopping the model's engine");
                engine.shutdown_and_join();
                self.status.models[m].set_state(ModelState::Unloaded);
            }
        }
        tracing::info!("model router stopped");
    }

    /// Models loading or unloading now.
    fn transitions(&self) -> usize {
        self.status
            .models
            .iter()
            .filter(|m| matches!(m.state(), ModelState::Loading | ModelState::Unloading))
            .count()
    }

    fn finish(&self, id: RequestId, reason: FinishReason, message: Option<String>) {
        let usage = Usage::default();
        let event = GenEvent::Finished {
            reason,
            usage,
            message,
        };
        let _ = self.out.send_all(vec![(id, event)]);
    }

    fn command(&mut self, c: EngineCommand) {
        match c {
            EngineCommand::Submit(r) => self.submit(Held::Plain(r)),
            EngineCommand::SubmitConstrained(r, c) => self.submit(Held::Constrained(r, c)),
            EngineCommand::Abort(id) => self.abort(id),
            EngineCommand::Shutdown => self.stopping = true,
            EngineCommand::Sleep { id, .. } | EngineCommand::Wake { id } => {
                // The handler refuses these routes; nothing else sends them.
                let msg = "sleep and wake are not available with npu_serving.models".to_string();
                self.finish(id, FinishReason::Error, Some(msg));
            }
            EngineCommand::SubmitLora(r, ..) => {
                // No handler sends these with npu_serving.models (the config refuses LoRA).
                let msg = "LoRA adapters are not available with npu_serving.models".to_string();
                self.finish(r.id, FinishReason::Error, Some(msg));
            }
            EngineCommand::LoadLora { id, .. } => {
                let msg = "LoRA adapters are not available with npu_serving.models".to_string();
                self.finish(id, FinishReason::Error, Some(msg));
            }
        }
    }

    /// The model a submission is for (see `Note`).
    fn model_of(&mut self, id: RequestId) -> Option<usize> {
        let note = self.notes.lock().ok().and_then(|mut n| n.remove(&id));
        if let Some(n) = note {
            self.more = (n.more > 0).then_some((n.model, n.more));
            return Some(n.model);
        }
        let (m, left) = self.more?;
        self.more = (left > 1).then_some((m, left - 1));
        Some(m)
    }

    fn submit(&mut self, h: Held) {
        let id = h.id();
        let Some(m) = self.model_of(id) else {
            tracing::error!(
                request = id,
                "a submission no handler routed to a model; ended"
            );
            let msg = "internal error: the request was not routed to a model".to_string();
            return self.finish(id, FinishReason::Error, Some(msg));
        };
        let st = &self.status.models[m];
        st.requests_total.fetch_add(1, Ordering::Relaxed);
        if self.stopping {
            let msg = "the server is shutting down".to_string();
            return self.finish(id, FinishReason::Shutdown, Some(msg));
        }
        self.owner.insert(id, m);
        let slot = &mut self.slots[m];
        if slot.engine.is_some() && !slot.make_room && slot.held.is_empty() {
            return self.forward(m, h);
        }
        st.held_total.fetch_add(1, Ordering::Relaxed);
        if slot.held.is_empty() {
            slot.held_since = Some(Instant::now());
        }
        slot.held.push_back(h);
    }

    fn forward(&mut self, m: usize, h: Held) {
        let id = h.id();
        let slot = &mut self.slots[m];
        slot.last_used = Instant::now();
        let sent = slot
            .engine
            .as_ref()
            .is_some_and(|e| e.handle.commands.send(h.into_command()).is_ok());
        if sent {
            slot.inflight.insert(id);
        } else {
            self.owner.remove(&id);
            let msg = format!("the engine of model {} is not running", slot.spec.name);
            self.finish(id, FinishReason::Error, Some(msg));
        }
    }

    fn abort(&mut self, id: RequestId) {
        let Some(&m) = self.owner.get(&id) else {
            return;
        };
        let slot = &mut self.slots[m];
        if let Some(pos) = slot.held.iter().position(|h| h.id() == id) {
            slot.held.remove(pos);
            if slot.held.is_empty() {
                slot.held_since = None;
            }
            self.owner.remove(&id);
            return self.finish(id, FinishReason::Aborted, None);
        }
        if let Some(e) = &slot.engine {
            let _ = e.handle.commands.send(EngineCommand::Abort(id));
        }
    }

    fn end_held(&mut self, reason: FinishReason, message: &str) {
        let mut ended = Vec::new();
        for slot in &mut self.slots {
            ended.extend(slot.held.drain(..).map(|h| h.id()));
            slot.held_since = None;
        }
        for id in ended {
            self.owner.remove(&id);
            self.finish(id, reason, Some(message.to_string()));
        }
    }

    fn internal(&mut self, m: Internal) {
        match m {
            Internal::Finished(model, id) => {
                self.slots[model].inflight.remove(&id);
                self.owner.remove(&id);
            }
            Internal::Loaded {
                model,
                result,
                took,
            } => self.loaded(model, result, took),
            Internal::Unloaded { model, stats } => {
                let slot = &mut self.slots[model];
                for (b, c) in slot.base.iter_mut().zip(counters(&stats)) {
                    *b += EngineStats::get(c);
                }
                slot.retiring = None;
                let st = &self.status.models[model];
                st.set_state(ModelState::Unloaded);
                st.evictions_total.fetch_add(1, Ordering::Relaxed);
                tracing::info!(model = %slot.spec.name, "model unloaded");
            }
        }
    }

    fn loaded(&mut self, m: usize, result: Result<RunningEngine, String>, took: Duration) {
        let st = &self.status.models[m];
        let slot = &mut self.slots[m];
        match result {
            Ok(engine) => {
                let us = took.as_micros() as u64;
                st.loads_total.fetch_add(1, Ordering::Relaxed);
                st.load_us_total.fetch_add(us, Ordering::Relaxed);
                st.last_load_us.store(us, Ordering::Relaxed);
                st.set_state(ModelState::Loaded);
                tracing::info!(
                    model = %slot.spec.name,
                    load_s = took.as_secs_f64(),
                    held = slot.held.len(),
                    "model loaded"
                );
                slot.engine = Some(engine);
                slot.last_used = Instant::now();
                slot.retrying = false;
            }
            Err(e) => {
                st.load_failures_total.fetch_add(1, Ordering::Relaxed);
                st.set_state(ModelState::Unloaded);
                let retrying = std::mem::take(&mut slot.retrying);
                let others = self.slots.iter().any(|s| s.engine.is_some());
                let slot = &mut self.slots[m];
                if !retrying && others && !self.stopping {
                    tracing::warn!(
                        model = %slot.spec.name,
                        error = %e,
                        "loading the model failed while other models are loaded: they are \
                         unloaded and the load tried once more"
                    );
                    slot.retry_alone = true;
                    return;
                }
                tracing::error!(model = %slot.spec.name, error = %e, "loading the model failed");
                let msg = format!("model {} could not be loaded: {e}", slot.spec.name);
                let ended: Vec<RequestId> = slot.held.drain(..).map(|h| h.id()).collect();
                slot.held_since = None;
                for id in ended {
                    self.owner.remove(&id);
                    self.finish(id, FinishReason::Error, Some(msg.clone()));
                }
            }
        }
    }

    /// Forwards what loaded models hold, unloads the ones chosen to make room once idle, and
    /// starts loading the model that has waited longest when there is room (else chooses
    /// which model makes room).
    fn schedule(&mut self) {
        for m in 0..self.slots.len() {
            let slot = &mut self.slots[m];
            if slot.engine.is_none() {
                continue;
            }
            if !slot.make_room {
                let held: Vec<Held> = slot.held.drain(..).collect();
                slot.held_since = None;
                for h in held {
                    self.forward(m, h);
                }
            } else if slot.inflight.is_empty() {
                self.unload(m);
            }
        }
        if self.stopping {
            return;
        }
        let mut waiting: Vec<(Instant, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(m, s)| {
                !s.held.is_empty() && self.status.models[*m].state() == ModelState::Unloaded
            })
            .map(|(m, s)| (s.held_since.unwrap_or_else(Instant::now), m))
            .collect();
        waiting.sort();
        for (_, m) in waiting {
            if self.slots[m].retry_alone {
                // Its last load failed beside other models: it loads again alone.
                if self.slots.iter().any(|s| s.engine.is_some()) || self.transitions() > 0 {
                    self.make_room();
                    return;
                }
                let slot = &mut self.slots[m];
                slot.retry_alone = false;
                slot.retrying = true;
                self.load(m);
                return;
            }
            let occupied = self
                .status
                .models
                .iter()
                .filter(|s| s.state() != ModelState::Unloaded)
                .count();
            if occupied < self.status.max_resident as usize {
                self.load(m);
                continue;
            }
            tracing::info!(
                load = %self.slots[m].spec.name,
                "max_resident_models reached: the least recently used model is unloaded once \
                 its running requests finish"
            );
            self.make_room();
            return;
        }
    }

    /// Unless room is being made already, the least recently used loaded model (an idle one
    /// before a busy one) is chosen to go: now if idle, else once its running requests finish.
    fn make_room(&mut self) {
        if self.slots.iter().any(|s| s.make_room) || self.transitions() > 0 {
            return;
        }
        let victim = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.engine.is_some())
            .min_by_key(|(_, s)| (!s.inflight.is_empty(), s.last_used))
            .map(|(v, _)| v);
        if let Some(v) = victim {
            tracing::info!(
                unload = %self.slots[v].spec.name,
                running = self.slots[v].inflight.len(),
                "making room: unloading the least recently used model"
            );
            self.slots[v].make_room = true;
            if self.slots[v].inflight.is_empty() {
                self.unload(v);
            }
        }
    }

    fn load(&mut self, m: usize) {
        self.status.models[m].set_state(ModelState::Loading);
        let spec = self.slots[m].spec.clone();
        tracing::info!(model = %spec.name, held = self.slots[m].held.len(), "loading the model");
        let sink = RouterSink {
            inner: self.out.clone(),
            model: m,
            tx: self.internal_tx.clone(),
        };
        let (tx, metrics, shutdown) = (
            self.internal_tx.clone(),
            self.metrics.clone(),
            self.shutdown.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name(format!("load-model-{m}"))
            .spawn(move || {
                let started = Instant::now();
                let result = super::start_model(&spec, Box::new(sink), metrics, shutdown)
                    .map_err(|e| format!("{e:#}"));
                let took = started.elapsed();
                let _ = tx.send(Internal::Loaded {
                    model: m,
                    result,
                    took,
                });
            });
        if let Err(e) = spawned {
            self.loaded(
                m,
                Err(format!("cannot start a loading thread: {e}")),
                Duration::ZERO,
            );
        }
    }

    fn unload(&mut self, m: usize) {
        let slot = &mut self.slots[m];
        slot.make_room = false;
        let Some(engine) = slot.engine.take() else {
            return;
        };
        self.status.models[m].set_state(ModelState::Unloading);
        tracing::info!(model = %slot.spec.name, "unloading the model (its agents stop)");
        let stats = engine.handle.stats.clone();
        slot.retiring = Some(stats.clone());
        let tx = self.internal_tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("unload-model-{m}"))
            .spawn(move || {
                engine.shutdown_and_join();
                let _ = tx.send(Internal::Unloaded { model: m, stats });
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start an unloading thread; the model stays");
            // The engine moved into the closure that was not run: it is dropped, its thread
            // ends when its command channel closes.
            self.status.models[m].set_state(ModelState::Unloaded);
        }
    }

    /// The loaded engines' figures summed into what the HTTP side reads.
    fn publish(&self) {
        let mut c = [0u64; COUNTERS];
        let mut g = [0u64; GAUGES];
        for slot in &self.slots {
            for (t, b) in c.iter_mut().zip(slot.base) {
                *t += b;
            }
            if let Some(r) = &slot.retiring {
                for (t, v) in c.iter_mut().zip(counters(r)) {
                    *t += EngineStats::get(v);
                }
            }
            if let Some(e) = &slot.engine {
                for (t, v) in c.iter_mut().zip(counters(&e.handle.stats)) {
                    *t += EngineStats::get(v);
                }
                for (t, v) in g.iter_mut().zip(gauges(&e.handle.stats)) {
                    *t += EngineStats::get(v);
                }
            }
            g[WAITING] += slot.held.len() as u64;
        }
        for (v, x) in counters(&self.stats).into_iter().zip(c) {
            EngineStats::set(v, x);
        }
        for (v, x) in gauges(&self.stats).into_iter().zip(g) {
            EngineStats::set(v, x);
        }
        let draining = self.stopping || self.shutdown.is_triggered();
        self.stats.draining.store(draining, Ordering::Relaxed);
    }
}

//! Engine loop tests with the real model on an in-process agent (`AgentEngine` itself, no
//! process), failures injected at the agent boundary: tokens to events and finish reasons,
//! stop strings, aborts, a failed step, an agent that dies and comes back (its requests resume
//! without repeating a token), one that dies while idle, one whose restarts fail for a while
//! (requests are not left waiting; attempts go on until it is back), requests that cannot fit,
//! the drain.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use npu_agent::engine::{AgentEngine, AgentEngineConfig};
use npu_gguf::GgufFile;
use npu_protocol::agent::DeviceKind;
use npu_protocol::{SamplingParams, StepPlan, StepResult};
use npu_tokenizer::Tokenizer;

use npu_server::agents::AgentFailure;
use npu_server::engine::*;
use npu_server::metrics::Metrics;

/// "The capital of France is" and llama.cpp's greedy tokens up to the first near-tie.
const PROMPT: [u32; 5] = [504, 3575, 282, 4649, 314];
const GREEDY: [u32; 14] = [
    7042, 30, 198, 198, 504, 1797, 1918, 553, 253, 2155, 282, 4723, 216, 35,
];

fn model() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| npu_gguf::store::resolve_model(None).expect("the default model"))
        .clone()
}

fn tokenizer() -> Tokenizer {
    let gguf = GgufFile::open(model()).unwrap();
    Tokenizer::for_model(&gguf, &model()).unwrap()
}

/// When the in-process agent fails (counted in step calls, from 1).
#[derive(Default)]
struct Faults {
    calls: usize,
    /// The agent dies in this call (as after kill -9).
    die_at: Option<usize>,
    /// The agent reports that it could not run the step of this call (it stays up).
    fail_step_at: Option<usize>,
    /// Every restart fails (while set).
    restart_fails: bool,
    /// Restart attempts so far.
    restarts_tried: usize,
    /// The agent is found dead at the next idle check (as after kill -9 of an idle agent).
    die_idle: bool,
}

struct InProcessAgent {
    cfg: AgentEngineConfig,
    engine: Option<AgentEngine>,
    faults: Arc<Mutex<Faults>>,
}

impl StepAgent for InProcessAgent {
    fn step(
        &mut self,
        plan: &StepPlan,
        masks: Option<&crossbeam_channel::Receiver<Vec<npu_protocol::TokenMask>>>,
        _deadline: Duration,
    ) -> Result<StepResult, AgentFailure> {
        let mut f = self.faults.lock().unwrap();
        f.calls += 1;
        if f.die_at == Some(f.calls) {
            self.engine = None;
            return Err(AgentFailure::Exited {
                agent_id: 0,
                status: "signal: 9 (SIGKILL)".into(),
            });
        }
        if f.fail_step_at == Some(f.calls) {
            return Err(AgentFailure::StepFailed {
                agent_id: 0,
                step_id: plan.step_id,
                message: "injected step failure".into(),
            });
        }
        let engine = self
            .engine
            .as_mut()
            .ok_or(AgentFailure::Down { agent_id: 0 })?;
        let mut following = || {
            let rx = masks.ok_or("no channel for the masks")?;
            rx.recv().map_err(|e| e.to_string())
        };
        engine
            .step_with_masks(plan, Some(&mut following))
            .map_err(|e| AgentFailure::StepFailed {
                agent_id: 0,
                step_id: plan.step_id,
                message: e.to_string(),
            })
    }

    fn restart(&mut self) -> Result<(), AgentFailure> {
        let fails = {
            let mut f = self.faults.lock().unwrap();
            f.restarts_tried += 1;
            f.restart_fails
        };
        if fails {
            return Err(AgentFailure::StartFailed {
                agent_id: 0,
                reason: "injected: the model cannot be loaded".into(),
            });
        }
        let engine = AgentEngine::load(&self.cfg).map_err(|e| AgentFailure::StartFailed {
            agent_id: 0,
            reason: e.to_string(),
        })?;
        self.engine = Some(engine);
        Ok(())
    }

    fn shutdown(&mut self) {
        self.engine = None;
    }

    fn check_idle(&mut self) -> Option<AgentFailure> {
        let mut f = self.faults.lock().unwrap();
        if !std::mem::take(&mut f.die_idle) || self.engine.is_none() {
            return None;
        }
        self.engine = None;
        Some(AgentFailure::Exited {
            agent_id: 0,
            status: "signal: 9 (SIGKILL)".into(),
        })
    }
}

fn engine_config() -> EngineConfig {
    let mut cfg = EngineConfig {
        restart_backoff: Duration::from_millis(10),
        restart_backoff_max: Duration::from_millis(40),
        agent_watch_interval: Duration::from_millis(10),
        shutdown_grace: Duration::from_secs(2),
        ..EngineConfig::default()
    };
    let s = &mut cfg.scheduler;
    s.num_blocks = 128;
    s.block_size = 16;
    s.max_running = 8;
    s.max_tokens_per_step = 128;
    s.max_model_len = 1024;
    s.max_blocks_per_seq = 64;
    s.eos_ids = tokenizer().eos_ids().to_vec();
    cfg
}

struct Harness {
    engine: Option<RunningEngine>,
    events: Receiver<TaggedEvent>,
    faults: Arc<Mutex<Faults>>,
    tokenizer: Tokenizer,
}

/// What a request produced.
#[derive(Debug, Default)]
struct Outcome {
    tokens: Vec<u32>,
    text: String,
    finished: Vec<(FinishReason, Usage, Option<String>)>,
}

impl Harness {
    fn start(cfg: EngineConfig, faults: Faults) -> Self {
        let s = &cfg.scheduler;
        let agent_cfg = AgentEngineConfig {
            swap_space_mb: 0,
            handoff: None,
            kv_memory_fraction: None,
            tensor_parallel: None,
            device: DeviceKind::Cpu,
            device_id: 0,
            model_path: model(),
            num_blocks: s.num_blocks as u32,
            block_size: s.block_size as u32,
            max_slots: s.slots() as u32,
            max_tokens_per_step: s.max_tokens_per_step as u32,
            max_blocks_per_seq: s.max_blocks_per_seq as u32,
            threads: 1,
            long_context: None,
            quantize: None,
            kv_cache_dtype: Default::default(),
            graph_capture: Default::default(),
        };
        let faults = Arc::new(Mutex::new(faults));
        let agent = InProcessAgent {
            engine: Some(AgentEngine::load(&agent_cfg).unwrap()),
            cfg: agent_cfg,
            faults: faults.clone(),
        };
        let (tx, events) = crossbeam_channel::unbounded();
        let tokenizer = tokenizer();
        let engine = start_engine(
            cfg,
            vec![Box::new(agent)],
            tokenizer.clone(),
            Box::new(tx),
            Arc::new(Metrics::default()),
            None,
            None,
        )
        .unwrap();
        Self {
            engine: Some(engine),
            events,
            faults,
            tokenizer,
        }
    }

    fn handle(&self) -> &EngineHandle {
        &self.engine.as_ref().unwrap().handle
    }

    fn stats(&self) -> &EngineStats {
        &self.handle().stats
    }

    fn submit(
        &self,
        id: RequestId,
        prompt: &[u32],
        max_new: u32,
        tweak: impl Fn(&mut GenerateRequest),
    ) {
        let mut req = GenerateRequest {
            id,
            prompt_ids: prompt.to_vec(),
            params: SamplingParams::greedy(),
            max_new_tokens: max_new,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            speculative: true,
        };
        tweak(&mut req);
        self.handle()
            .commands
            .send(EngineCommand::Submit(req))
            .unwrap();
    }

    fn command(&self, cmd: EngineCommand) {
        self.handle().commands.send(cmd).unwrap();
    }

    /// Reads events until each of `ids` has finished (or `until` returns true for the
    /// outcomes so far).
    fn run_until(
        &self,
        outcomes: &mut HashMap<RequestId, Outcome>,
        until: impl Fn(&HashMap<RequestId, Outcome>) -> bool,
    ) {
        let deadline = Instant::now() + Duration::from_secs(300);
        while !until(outcomes) {
            let left = deadline.saturating_duration_since(Instant::now());
            let (id, ev) = self.events.recv_timeout(left).expect("engine events");
            let o = outcomes.entry(id).or_default();
            match ev {
                GenEvent::Token { token, text, .. } => {
                    assert!(
                        o.finished.is_empty(),
                        "request {id}: a token after Finished"
                    );
                    o.tokens.push(token.token);
                    o.text.push_str(&text);
                }
                GenEvent::Finished {
                    reason,
                    usage,
                    message,
                } => o.finished.push((reason, usage, message)),
            }
        }
    }

    fn finish_all(&self, ids: &[RequestId]) -> HashMap<RequestId, Outcome> {
        let mut out = HashMap::new();
        self.run_until(&mut out, |o| {
            ids.iter()
                .all(|id| o.get(id).is_some_and(|x| !x.finished.is_empty()))
        });
        out
    }

    /// Waits until the engine's published stats satisfy `ok`.
    fn wait_stats(&self, ok: impl Fn(&EngineStats) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ok(self.stats()) {
            assert!(
                Instant::now() < deadline,
                "stats never settled: {:?}",
                self.stats()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn blocks_used(&self) -> u64 {
        EngineStats::get(&self.stats().kv_blocks_used)
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(e) = self.engine.take() {
            e.shutdown_and_join();
        }
    }
}

fn only_finish(o: &Outcome) -> (FinishReason, Usage, Option<String>) {
    assert_eq!(
        o.finished.len(),
        1,
        "exactly one Finished: {:?}",
        o.finished
    );
    o.finished[0].clone()
}

#[test]
fn tokens_become_text_events_and_requests_end_with_their_reason() {
    let h = Harness::start(engine_config(), Faults::default());
    h.submit(1, &PROMPT, 14, |_| {});
    h.submit(2, &PROMPT, 14, |r| r.stop = vec!["\n".into()]);
    h.submit(3, &PROMPT, 14, |r| r.stop = vec!["ted States".into()]);
    h.submit(4, &PROMPT, 14, |r| r.stop_token_ids = vec![198]);
    let out = h.finish_all(&[1, 2, 3, 4]);

    let (reason, usage, _) = only_finish(&out[&1]);
    assert_eq!(out[&1].tokens, GREEDY);
    assert_eq!(out[&1].text, h.tokenizer.decode_continuation(&GREEDY, true));
    assert_eq!(
        (reason, usage.prompt_tokens, usage.completion_tokens),
        (FinishReason::Length, 5, 14)
    );

    // A stop string ends the request; it is not sent, nor is what the same token adds after it.
    let (reason, usage, _) = only_finish(&out[&2]);
    assert_eq!(
        (out[&2].text.as_str(), reason),
        (" Paris.", FinishReason::Stop)
    );
    assert_eq!(usage.completion_tokens, 3);
    let (reason, _, _) = only_finish(&out[&3]);
    assert_eq!(out[&3].text, " Paris.\n\nThe Uni");
    assert_eq!(reason, FinishReason::Stop);
    // A stop token id ends it as EOS does.
    let (reason, usage, _) = only_finish(&out[&4]);
    assert_eq!((reason, usage.completion_tokens), (FinishReason::Eos, 3));
    assert_eq!(out[&4].tokens, GREEDY[..3]);

    h.wait_stats(|s| EngineStats::get(&s.requests_finished_total) == 4);
    h.wait_stats(|s| EngineStats::get(&s.running) == 0);
    assert_eq!(h.blocks_used(), 0);
    assert_eq!(
        EngineStats::get(&h.stats().generated_tokens_total),
        14 + 3 + 7 + 3
    );
    assert!(h.stats().ready.load(std::sync::atomic::Ordering::Relaxed));
}

#[test]
fn aborted_requests_end_once_and_give_their_blocks_back() {
    let h = Harness::start(engine_config(), Faults::default());
    for id in 1..=4 {
        h.submit(id, &PROMPT, 500, |r| r.ignore_eos = true);
    }
    // A request still waiting (the pool holds 8): queued behind 8 running ones.
    for id in 5..=12 {
        h.submit(id, &PROMPT, 500, |r| r.ignore_eos = true);
    }
    let mut out = HashMap::new();
    h.run_until(&mut out, |o| {
        (1..=4).all(|id| o.get(&id).is_some_and(|x| x.tokens.len() >= 2))
    });
    assert!(h.blocks_used() > 0);
    h.command(EngineCommand::Abort(2));
    h.command(EngineCommand::Abort(12)); // waiting
    h.command(EngineCommand::Abort(99)); // unknown: ignored
    h.run_until(&mut out, |o| {
        [2, 12]
            .iter()
            .all(|id| o.get(id).is_some_and(|x| !x.finished.is_empty()))
    });
    assert_eq!(only_finish(&out[&2]).0, FinishReason::Aborted);
    assert_eq!(only_finish(&out[&12]).0, FinishReason::Aborted);
    // The others go on.
    let n1 = out[&1].tokens.len();
    h.run_until(&mut out, |o| o[&1].tokens.len() >= n1 + 3);
    for id in [1, 3, 4, 5, 6, 7, 8, 9, 10, 11] {
        h.command(EngineCommand::Abort(id));
    }
    let all: Vec<RequestId> = (1..=12).collect();
    h.run_until(&mut out, |o| {
        all.iter()
            .all(|id| o.get(id).is_some_and(|x| !x.finished.is_empty()))
    });
    for id in all {
        assert_eq!(
            only_finish(&out[&id]).0,
            FinishReason::Aborted,
            "request {id}"
        );
    }
    h.wait_stats(|s| EngineStats::get(&s.kv_blocks_used) == 0 && EngineStats::get(&s.running) == 0);
    assert_eq!(EngineStats::get(&h.stats().waiting), 0);
    // Nothing more arrives for them.
    std::thread::sleep(Duration::from_millis(200));
    assert!(h.events.try_recv().is_err());
}

#[test]
fn a_dead_agent_is_restarted_and_its_requests_resume_without_repeats() {
    let faults = Faults {
        die_at: Some(6),
        ..Faults::default()
    };
    let h = Harness::start(engine_config(), faults);
    for id in 1..=3 {
        h.submit(id, &PROMPT, 14, |_| {});
    }
    let out = h.finish_all(&[1, 2, 3]);
    for id in 1..=3 {
        let (reason, usage, _) = only_finish(&out[&id]);
        assert_eq!(out[&id].tokens, GREEDY, "request {id} resumed exactly");
        assert_eq!(
            (reason, usage.completion_tokens),
            (FinishReason::Length, 14)
        );
    }
    assert!(
        h.faults.lock().unwrap().calls > 6,
        "the agent died mid-generation"
    );
    h.wait_stats(|s| EngineStats::get(&s.agent_restarts_total) == 1);
    h.wait_stats(|s| s.ready.load(std::sync::atomic::Ordering::Relaxed));
    assert_eq!(h.blocks_used(), 0);
}

#[test]
fn an_agent_that_dies_while_idle_is_restarted_before_the_next_request() {
    let h = Harness::start(engine_config(), Faults::default());
    h.submit(1, &PROMPT, 3, |_| {});
    h.finish_all(&[1]);
    let ready = |s: &EngineStats| s.ready.load(std::sync::atomic::Ordering::Relaxed);
    h.wait_stats(ready);
    h.faults.lock().unwrap().die_idle = true;
    // No request is running: the death is seen by the idle watch, and the agent comes back.
    h.wait_stats(|s| EngineStats::get(&s.agent_restarts_total) == 1 && ready(s));
    assert_eq!(h.faults.lock().unwrap().restarts_tried, 1);
    h.submit(2, &PROMPT, 14, |_| {});
    let out = h.finish_all(&[2]);
    assert_eq!(out[&2].tokens, GREEDY);
}

#[test]
fn restarts_go_on_until_the_agent_is_back_and_waiting_requests_are_not_left_hanging() {
    let faults = Faults {
        die_at: Some(3),
        restart_fails: true,
        ..Faults::default()
    };
    let h = Harness::start(engine_config(), faults);
    h.submit(1, &PROMPT, 14, |_| {});
    h.submit(2, &PROMPT, 14, |_| {});
    // A restart attempt failed and no agent is up: the requests end, naming the cause.
    let out = h.finish_all(&[1, 2]);
    for id in [1, 2] {
        let (reason, _, message) = only_finish(&out[&id]);
        assert_eq!(reason, FinishReason::Error);
        let message = message.expect("a message");
        assert!(message.contains("cannot be loaded"), "{message}");
        assert!(message.contains("still trying"), "{message}");
    }
    assert!(!h.stats().ready.load(std::sync::atomic::Ordering::Relaxed));
    assert_eq!(EngineStats::get(&h.stats().agents_up), 0);
    // New requests are refused the same way, right away, while the attempts keep failing.
    h.submit(3, &PROMPT, 4, |_| {});
    let out = h.finish_all(&[3]);
    assert_eq!(only_finish(&out[&3]).0, FinishReason::Error);
    // No final give-up: once the model can load again, the agent is back and serves.
    h.wait_stats(|_| h.faults.lock().unwrap().restarts_tried >= 3);
    h.faults.lock().unwrap().restart_fails = false;
    h.wait_stats(|s| s.ready.load(std::sync::atomic::Ordering::Relaxed));
    assert_eq!(EngineStats::get(&h.stats().agent_restarts_total), 1);
    h.submit(4, &PROMPT, 14, |_| {});
    let out = h.finish_all(&[4]);
    assert_eq!(out[&4].tokens, GREEDY);
}

#[test]
fn a_failed_step_ends_only_the_requests_it_carried() {
    let h = Harness::start(engine_config(), Faults::default());
    h.submit(1, &PROMPT, 14, |_| {});
    let mut out = HashMap::new();
    h.run_until(&mut out, |o| {
        o.get(&1).is_some_and(|x| !x.tokens.is_empty())
    });
    {
        let mut f = h.faults.lock().unwrap();
        f.fail_step_at = Some(f.calls + 1);
    }
    h.run_until(&mut out, |o| !o[&1].finished.is_empty());
    let (reason, _, message) = only_finish(&out[&1]);
    assert_eq!(reason, FinishReason::Error);
    assert!(message.unwrap().contains("injected step failure"));
    // The agent is still up and serves the next request.
    h.submit(2, &PROMPT, 14, |_| {});
    let out = h.finish_all(&[2]);
    assert_eq!(out[&2].tokens, GREEDY);
    h.wait_stats(|s| EngineStats::get(&s.kv_blocks_used) == 0);
    assert_eq!(EngineStats::get(&h.stats().agent_restarts_total), 0);
}

#[test]
fn requests_that_cannot_fit_are_rejected_and_those_that_fill_the_pool_end_with_context_length() {
    let mut cfg = engine_config();
    cfg.scheduler.num_blocks = 2; // 32 tokens in the whole pool
    cfg.scheduler.max_model_len = 64;
    let h = Harness::start(cfg, Faults::default());
    let long: Vec<u32> = PROMPT.iter().copied().cycle().take(40).collect();
    h.submit(1, &long, 8, |_| {});
    // Fits, but reaches the pool's limit before max_new_tokens.
    h.submit(2, &PROMPT, 60, |r| r.ignore_eos = true);
    let out = h.finish_all(&[1, 2]);
    let (reason, usage, message) = only_finish(&out[&1]);
    assert_eq!(
        (reason, usage.completion_tokens),
        (FinishReason::Rejected, 0)
    );
    assert!(message.unwrap().contains("KV blocks"));
    let (reason, usage, _) = only_finish(&out[&2]);
    assert_eq!(
        (reason, usage.completion_tokens),
        (FinishReason::ContextLength, 32 - 5)
    );
}

#[test]
fn shutdown_finishes_what_it_can_and_ends_the_rest_with_the_reason() {
    let mut cfg = engine_config();
    cfg.shutdown_grace = Duration::from_millis(1500);
    let mut h = Harness::start(cfg, Faults::default());
    h.submit(1, &PROMPT, 6, |_| {});
    h.submit(2, &PROMPT, 900, |r| r.ignore_eos = true);
    let mut out = HashMap::new();
    h.run_until(&mut out, |o| {
        o.get(&2).is_some_and(|x| !x.tokens.is_empty())
    });
    h.command(EngineCommand::Shutdown);
    h.submit(3, &PROMPT, 4, |_| {});
    h.run_until(&mut out, |o| {
        [1, 2, 3]
            .iter()
            .all(|id| o.get(id).is_some_and(|x| !x.finished.is_empty()))
    });
    assert_eq!(only_finish(&out[&1]).0, FinishReason::Length);
    assert_eq!(out[&1].tokens, GREEDY[..6]);
    let (reason, _, message) = only_finish(&out[&2]);
    assert_eq!(reason, FinishReason::Shutdown);
    assert!(message.unwrap().contains("shut down"));
    assert_eq!(only_finish(&out[&3]).0, FinishReason::Shutdown);
    h.wait_stats(|s| EngineStats::get(&s.agents_up) == 0);
    // The thread ends once the handle is gone.
    h.engine.take().unwrap().shutdown_and_join();
}

//! The agent's step loop: Step -> the engine reads the plan where it lies in the segment and runs
//! it -> write the result -> StepDone; Reset -> forget every slot -> ResetDone; Ping -> Pong; Shutdown or a
//! closed connection ends it. A failing step is reported in StepDone and the loop goes on.
//! When a plan's token-mask words follow it, the engine runs the forward pass first and then
//! waits here for the server's `Masks` frame (answering pings meanwhile) before it samples.
//!
//! Sleep -> SleepDone, Wake -> WakeDone: at level 1 the engine lets go of its KV pool and keeps
//! its weights (`StepExecutor::release_kv`): in place on the CPU, copied to host memory with
//! their device memory freed on a device whose backend can (CUDA, Ascend); an engine that
//! cannot (a tensor-parallel rank) is dropped as at level 2. At level 2 the engine is dropped
//! whole and Wake loads it again through the same load path as at start. Steps while asleep
//! fail, naming the sleep. A level-1 SleepDone/WakeDone carries the bytes the engine released
//! or allocated again (device memory and the host KV pool); a level-2 one the process's
//! resident memory change.

use std::io::{Read, Write};
use std::time::Instant;

use npu_protocol::agent::AgentLoraConfig;
use npu_protocol::frame::{
    read_frame, write_frame, Frame, FrameError, SleepDone, StepDone, StepStatus,
};
use npu_protocol::shm::ShmSegment;
use npu_protocol::{PlanSource, StepResult, StepTiming};

use super::WorkerError;
use crate::engine::{AgentEngine, EngineError, FollowingMasks, ModelFacts};

/// What the agent process needs from an engine: `AgentEngine` in production.
pub trait StepExecutor {
    /// What the handshake tells the server about the model.
    fn facts(&self) -> &ModelFacts;
    /// Runs the step `plan` describes (read in place; the executor checks what it needs).
    /// When the plan's mask words follow it, `following` waits for them (call it once, as late
    /// as possible: after the forward pass).
    fn step(
        &mut self,
        plan: &dyn PlanSource,
        following: FollowingMasks<'_>,
    ) -> Result<StepResult, EngineError>;
    fn reset(&mut self);
    /// Sleep level 1: forget every slot and let go of the KV memory, keeping the weights (on a
    /// device: in host memory). Returns the bytes released, or None when the weights cannot be
    /// kept: the caller then drops the executor as at level 2.
    fn release_kv(&mut self) -> Result<Option<u64>, EngineError> {
        self.reset();
        Ok(Some(0))
    }
    /// Wakes from `release_kv` (weights back on the device first); returns the bytes allocated
    /// again.
    fn restore_kv(&mut self) -> Result<u64, EngineError> {
        Ok(0)
    }
    /// Turns LoRA adapters on (the server's `npu_serving.max_loras`); refused by an executor
    /// that cannot run them.
    fn enable_lora(&mut self, cfg: &AgentLoraConfig) -> Result<(), EngineError> {
        Err(EngineError::BadConfig(format!(
            "LoRA adapters (max_loras {}): this engine cannot run them",
            cfg.max_loras
        )))
    }
}

impl<E: StepExecutor + ?Sized> StepExecutor for &mut E {
    fn facts(&self) -> &ModelFacts {
        (**self).facts()
    }

    fn step(
        &mut self,
        plan: &dyn PlanSource,
        following: FollowingMasks<'_>,
    ) -> Result<StepResult, EngineError> {
        (**self).step(plan, following)
    }

    fn reset(&mut self) {
        (**self).reset()
    }

    fn release_kv(&mut self) -> Result<Option<u64>, EngineError> {
        (**self).release_kv()
    }

    fn restore_kv(&mut self) -> Result<u64, EngineError> {
        (**self).restore_kv()
    }

    fn enable_lora(&mut self, cfg: &AgentLoraConfig) -> Result<(), EngineError> {
        (**self).enable_lora(cfg)
    }
}

impl StepExecutor for AgentEngine {
    fn facts(&self) -> &ModelFacts {
        AgentEngine::facts(self)
    }

    fn step(
        &mut self,
        plan: &dyn PlanSource,
        following: FollowingMasks<'_>,
    ) -> Result<StepResult, EngineError> {
        AgentEngine::step_with_masks(self, plan, Some(following))
    }

    fn reset(&mut self) {
        AgentEngine::reset(self)
    }

    fn release_kv(&mut self) -> Result<Option<u64>, EngineError> {
        AgentEngine::release_kv(self)
    }

    fn restore_kv(&mut self) -> Result<u64, EngineError> {
        AgentEngine::restore_kv(self)
    }
    fn enable_lora(&mut self, cfg: &AgentLoraConfig) -> Result<(), EngineError> {
        AgentEngine::enable_lora(self, cfg)
    }
}

/// Serves control frames until Shutdown (Ok) or until the server closes the connection (Ok).
/// Errors: a broken connection or a frame the agent must never receive. This engine cannot be
/// loaded again: a Sleep at level 2 (or at level 1 where the engine cannot keep its weights)
/// is answered with an error and the engine stays.
pub fn serve<S, E>(stream: &mut S, segment: ShmSegment, engine: E) -> Result<(), WorkerError>
where
    S: Read + Write,
    E: StepExecutor,
{
    serve_reloading(stream, segment, engine, None)
}

/// Loads the engine again (the same load path as at start).
pub type Reload<'a, E> = Option<&'a mut dyn FnMut() -> Result<E, EngineError>>;

/// Where the engine is while the agent sleeps.
enum Held<E> {
    Awake(E),
    /// Level 1: the engine, its KV memory released.
    KvReleased(E),
    /// Level 2 (or level 1 on a device): dropped; Wake loads it again.
    Dropped {
        level: u8,
    },
}

/// Resident memory of this process (`/proc/self/statm`), 0 where it cannot be read.
pub fn resident_bytes() -> u64 {
    let page = 4096u64;
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page)
}

/// `serve`, with `reload` loading the engine again (the same load path as at start) when the
/// agent wakes from a sleep that dropped it.
pub fn serve_reloading<S, E>(
    stream: &mut S,
    mut segment: ShmSegment,
    engine: E,
    mut reload: Reload<'_, E>,
) -> Result<(), WorkerError>
where
    S: Read + Write,
    E: StepExecutor,
{
    // The latest step announced: a Masks frame for it may come after the step ended early
    // (it failed before it waited for them), and is dropped.
    let mut last_step = None;
    let mut held = Held::Awake(engine);
    loop {
        let frame = match read_frame(stream) {
            Ok(frame) => frame,
            Err(FrameError::Closed) => {
                tracing::info!("server closed the control connection; exiting");
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        };
        match frame {
            Frame::Masks { step_id } if Some(step_id) == last_step => {}
            Frame::Step { step_id } => {
                last_step = Some(step_id);
                let done = match &mut held {
                    Held::Awake(engine) => run_step(step_id, stream, &mut segment, engine),
                    Held::KvReleased(_) | Held::Dropped { .. } => StepDone {
                        step_id,
                        status: StepStatus::Failed,
                        timing: StepTiming::default(),
                        error: "the agent is asleep (wake it first)".into(),
                        failed: Vec::new(),
                    },
                };
                if let Some(error) = (!done.error.is_empty()).then_some(&done.error) {
                    tracing::warn!(step_id, %error, "step failed");
                }
                write_frame(stream, &Frame::StepDone(done))?;
            }
            Frame::Reset => {
                if let Held::Awake(engine) | Held::KvReleased(engine) = &mut held {
                    engine.reset();
                }
                write_frame(stream, &Frame::ResetDone)?;
            }
            Frame::Sleep { level } => {
                let (next, done) = sleep(held, level, &mut reload);
                held = next;
                if !done.error.is_empty() {
                    tracing::warn!(level, error = %done.error, "sleep failed");
                }
                write_frame(stream, &Frame::SleepDone(done))?;
            }
            Frame::Wake => {
                let (next, done) = wake(held, &mut reload);
                held = next;
                if !done.error.is_empty() {
                    tracing::warn!(error = %done.error, "wake failed");
                }
                write_frame(stream, &Frame::WakeDone(done))?;
            }
            Frame::Ping { nonce } => write_frame(stream, &Frame::Pong { nonce })?,
            Frame::Shutdown => {
                tracing::info!("shutdown requested");
                return Ok(());
            }
            other => {
                return Err(WorkerError::Protocol(format!(
                    "unexpected {} frame from the server",
                    other.kind()
                )))
            }
        }
    }
}

/// Puts the engine to sleep at `level` (1 or 2). A level the agent cannot reload from
/// (`serve` without a loader) leaves it awake with an error. Sleeping deeper than now drops
/// what is still held; sleeping at the same or a lower level changes nothing.
fn sleep<E: StepExecutor>(
    held: Held<E>,
    level: u8,
    reload: &mut Reload<'_, E>,
) -> (Held<E>, SleepDone) {
    let started = Instant::now();
    let rss = resident_bytes();
    let done = |level: u8, error: String| SleepDone {
        level,
        bytes: rss.saturating_sub(resident_bytes()),
        took_us: started.elapsed().as_micros() as u64,
        error,
    };
    if !(1..=2).contains(&level) {
        let now = match &held {
            Held::Awake(_) => 0,
            Held::KvReleased(_) => 1,
            Held::Dropped { level } => *level,
        };
        return (held, done(now, format!("sleep level {level}: 1 or 2")));
    }
    match held {
        Held::Dropped { level: now } => (
            Held::Dropped {
                level: now.max(level),
            },
            done(now.max(level), String::new()),
        ),
        Held::KvReleased(engine) if level == 1 => {
            (Held::KvReleased(engine), done(1, String::new()))
        }
        Held::Awake(mut engine) if level == 1 => match engine.release_kv() {
            Ok(Some(released)) => {
                tracing::info!(
                    released_bytes = released,
                    took_ms = started.elapsed().as_millis() as u64,
                    "asleep at level 1: KV pool released, weights kept in this process"
                );
                let d = SleepDone {
                    bytes: released,
                    ..done(1, String::new())
                };
                (Held::KvReleased(engine), d)
            }
            Ok(None) => drop_engine(engine, 1, reload, started, rss),
            Err(e) => (Held::Awake(engine), done(0, e.to_string())),
        },
        Held::Awake(engine) | Held::KvReleased(engine) => {
            drop_engine(engine, level, reload, started, rss)
        }
    }
}

/// Drops the engine (the model and its pools) when it can be loaded again; else keeps it awake
/// and says why.
fn drop_engine<E: StepExecutor>(
    mut engine: E,
    level: u8,
    reload: &mut Reload<'_, E>,
    started: Instant,
    rss: u64,
) -> (Held<E>, SleepDone) {
    if reload.is_none() {
        // A level-1 attempt that got here freed the KV pool already: bring it back.
        let _ = engine.restore_kv();
        return (
            Held::Awake(engine),
            SleepDone {
                level: 0,
                bytes: 0,
                took_us: started.elapsed().as_micros() as u64,
                error: format!("sleep level {level}: this agent cannot load its engine again"),
            },
        );
    }
    drop(engine);
    let freed = rss.saturating_sub(resident_bytes());
    tracing::info!(
        level,
        released_bytes = freed,
        took_ms = started.elapsed().as_millis() as u64,
        "asleep: the model and its KV pool dropped (wake loads them from the checkpoint)"
    );
    (
        Held::Dropped { level },
        SleepDone {
            level,
            bytes: freed,
            took_us: started.elapsed().as_micros() as u64,
            error: String::new(),
        },
    )
}

/// Wakes the engine: loads it again when the sleep dropped it, allocates its KV pool again when
/// it was released. Awake already: nothing to do.
fn wake<E: StepExecutor>(held: Held<E>, reload: &mut Reload<'_, E>) -> (Held<E>, SleepDone) {
    let started = Instant::now();
    let rss = resident_bytes();
    let done = |level: u8, error: String| SleepDone {
        level,
        bytes: resident_bytes().saturating_sub(rss),
        took_us: started.elapsed().as_micros() as u64,
        error,
    };
    match held {
        Held::Awake(engine) => (Held::Awake(engine), done(0, String::new())),
        Held::KvReleased(mut engine) => match engine.restore_kv() {
            Ok(allocated) => {
                tracing::info!(
                    allocated_bytes = allocated,
                    took_ms = started.elapsed().as_millis() as u64,
                    "awake from level 1: weights (if moved) and KV pool on the device again"
                );
                let d = SleepDone {
                    bytes: allocated,
                    ..done(0, String::new())
                };
                (Held::Awake(engine), d)
            }
            Err(e) => (Held::KvReleased(engine), done(1, e.to_string())),
        },
        Held::Dropped { level } => match reload.as_mut().map(|r| r()) {
            None => (
                Held::Dropped { level },
                done(level, "this agent cannot load its engine again".into()),
            ),
            Some(loaded) => match loaded {
                Ok(engine) => {
                    tracing::info!(
                        level,
                        took_ms = started.elapsed().as_millis() as u64,
                        "awake: the model loaded again from the checkpoint"
                    );
                    (Held::Awake(engine), done(0, String::new()))
                }
                Err(e) => (
                    Held::Dropped { level },
                    done(level, format!("loading the model: {e}")),
                ),
            },
        },
    }
}

/// One step; any failure becomes a Failed StepDone with the reason. Sequences the engine could
/// not run while the rest ran travel in the Ok StepDone.
fn run_step<S: Read + Write, E: StepExecutor>(
    step_id: u64,
    stream: &mut S,
    segment: &mut ShmSegment,
    engine: &mut E,
) -> StepDone {
    let started = Instant::now();
    let outcome = (|| {
        let mut result = {
            let seg: &ShmSegment = segment;
            let plan = seg.plan_view().map_err(|e| e.to_string())?;
            if plan.step_id() != step_id {
                return Err(format!(
                    "the segment holds plan {} but step {step_id} was announced",
                    plan.step_id()
                ));
            }
            let mut following = || wait_for_masks(step_id, stream, seg);
            engine
                .step(&plan, &mut following)
                .map_err(|e| e.to_string())?
        };
        if result.step_id != step_id {
            return Err(format!(
                "the engine answered step {} for step {step_id}",
                result.step_id
            ));
        }
        if result.timing.total_us == 0 {
            result.timing.total_us = started.elapsed().as_micros() as u64;
        }
        segment.write_result(&result).map_err(|e| e.to_string())?;
        for f in &result.failed {
            tracing::warn!(step_id, slot = f.slot, error = %f.error, "sequence failed");
        }
        Ok((result.timing, result.failed))
    })();
    match outcome {
        Ok((timing, failed)) => StepDone {
            step_id,
            status: StepStatus::Ok,
            timing,
            error: String::new(),
            failed,
        },
        Err(error) => StepDone {
            step_id,
            status: StepStatus::Failed,
            timing: StepTiming {
                total_us: started.elapsed().as_micros() as u64,
                ..StepTiming::default()
            },
            error,
            failed: Vec::new(),
        },
    }
}

/// Waits for the `Masks` frame of step `step_id` (answering pings meanwhile), then reads the
/// mask words the server wrote into the segment.
fn wait_for_masks<S: Read + Write>(
    step_id: u64,
    stream: &mut S,
    segment: &ShmSegment,
) -> Result<Vec<npu_protocol::TokenMask>, String> {
    loop {
        match read_frame(stream) {
            Ok(Frame::Masks { step_id: s }) if s == step_id => {
                return segment.read_mask_words().map_err(|e| e.to_string())
            }
            Ok(Frame::Ping { nonce }) => {
                write_frame(stream, &Frame::Pong { nonce }).map_err(|e| e.to_string())?
            }
            Ok(other) => {
                return Err(format!(
                    "a {} frame came while step {step_id} waited for its masks",
                    other.kind()
                ))
            }
            Err(e) => return Err(format!("waiting for the masks of step {step_id}: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The loop over a real socket and a real segment. The executor here is a small
    //! deterministic stand-in for the model (next token = last token + slot), so the tests are
    //! about the loop, not about the model.

    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::thread;

    use npu_protocol::shm::{segment_name, ShmCapacities, ShmLayout};
    use npu_protocol::{SeqResult, SeqStep, StepPlan, TokenLogprob};

    use super::*;

    struct Echo {
        resets: usize,
        facts: ModelFacts,
        /// Steps whose "forward pass" (everything before sampling) is done.
        forwarded: Arc<AtomicU64>,
    }

    impl StepExecutor for Echo {
        fn facts(&self) -> &ModelFacts {
            &self.facts
        }

        /// A masked slot answers the lowest token its mask allows (its words waited for after
        /// the forward pass when they follow the plan).
        fn step(
            &mut self,
            plan: &dyn PlanSource,
            following: FollowingMasks<'_>,
        ) -> Result<StepResult, EngineError> {
            let mut plan = plan.to_plan();
            if plan.seqs.iter().any(|s| s.slot == 13) {
                return Err(EngineError::BadPlan("slot 13 is unlucky".into()));
            }
            self.forwarded.fetch_add(1, Ordering::SeqCst);
            if plan.masks_follow() {
                plan.masks = following().map_err(EngineError::MasksLost)?;
            }
            let masked = |slot: u32| {
                let m = plan.masks.iter().find(|m| m.slot == slot)?;
                (0..m.words.len() as u32 * 32)
                    .find(|&t| m.words[(t / 32) as usize] >> (t % 32) & 1 == 1)
            };
            Ok(StepResult {
                transfer: Default::default(),
                step_id: plan.step_id,
                seqs: plan
                    .seqs
                    .iter()
                    .filter(|s| s.sample)
                    .map(|s| SeqResult {
                        slot: s.slot,
                        token: TokenLogprob {
                            token: masked(s.slot)
                                .unwrap_or(s.tokens.last().copied().unwrap_or(0) + s.slot),
                            logprob: -0.5,
                        },
                        top: Vec::new(),
                        extra: Vec::new(),
                    })
                    .collect(),
                timing: StepTiming::default(),
                failed: Vec::new(),
            })
        }

        fn reset(&mut self) {
            self.resets += 1;
        }
    }

    fn plan(step_id: u64, slot: u32, token: u32) -> StepPlan {
        StepPlan {
            step_id,
            seqs: vec![SeqStep {
                slot,
                tokens: vec![token],
                start_pos: 0,
                block_table: vec![0],
                slot_mapping: vec![0],
                sample: true,
                n_prompt_tokens: 1,
                n_draft: 0,
            }],
            ..Default::default()
        }
    }

    type AgentThread = thread::JoinHandle<(Result<(), WorkerError>, usize)>;

    /// (server side of the socket, server's segment, agent thread returning the loop's outcome)
    fn start() -> (TcpStream, ShmSegment, AgentThread) {
        let (server, seg, agent, _) = start_counting();
        (server, seg, agent)
    }

    /// `start`, and the count of steps whose forward pass is done.
    fn start_counting() -> (TcpStream, ShmSegment, AgentThread, Arc<AtomicU64>) {
        let caps = ShmCapacities {
            max_slots: 16,
            max_masks: 2,
            mask_words: 4,
            ..ShmCapacities::default()
        };
        let forwarded = Arc::new(AtomicU64::new(0));
        let counted = forwarded.clone();
        let layout = ShmLayout::new(caps).unwrap();
        let server_seg = ShmSegment::create(&segment_name(0).unwrap(), &layout).unwrap();
        let agent_seg = ShmSegment::open(server_seg.name()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let agent = thread::spawn(move || {
            let mut stream = TcpStream::connect(addr).unwrap();
            let mut engine = Echo {
                forwarded: counted,
                resets: 0,
                facts: ModelFacts {
                    kv: Default::default(),
                    name: "echo".into(),
                    architecture: "none".into(),
                    vocab_size: 1 << 20,
                    n_layers: 0,
                    hidden: 0,
                    n_heads: 0,
                    n_kv_heads: 0,
                    head_dim: 0,
                    context_length: 0,
                    eos_ids: Vec::new(),
                    bos_id: None,
                    backend: "test".into(),
                },
            };
            let outcome = serve(&mut stream, agent_seg, &mut engine);
            (outcome, engine.resets)
        });
        let (server, _) = listener.accept().unwrap();
        (server, server_seg, agent, forwarded)
    }

    fn step_done(server: &mut TcpStream) -> StepDone {
        match read_frame(server).unwrap() {
            Frame::StepDone(done) => done,
            other => panic!("expected StepDone, got {other:?}"),
        }
    }

    #[test]
    fn steps_resets_pings_and_shutdown() {
        let (mut server, mut seg, agent) = start();
        for (step_id, slot, token) in [(1, 2, 10), (2, 3, 20)] {
            seg.write_plan(&plan(step_id, slot, token)).unwrap();
            write_frame(&mut server, &Frame::Step { step_id }).unwrap();
            let done = step_done(&mut server);
            assert_eq!((done.step_id, done.status), (step_id, StepStatus::Ok));
            assert!(done.error.is_empty());
            let result = seg.read_result().unwrap();
            assert_eq!(result.step_id, step_id);
            assert_eq!(result.seqs[0].token.token, token + slot);
        }
        write_frame(&mut server, &Frame::Reset).unwrap();
        assert_eq!(read_frame(&mut server).unwrap(), Frame::ResetDone);
        write_frame(&mut server, &Frame::Ping { nonce: 99 }).unwrap();
        assert_eq!(read_frame(&mut server).unwrap(), Frame::Pong { nonce: 99 });
        write_frame(&mut server, &Frame::Shutdown).unwrap();
        let (outcome, resets) = agent.join().unwrap();
        outcome.unwrap();
        assert_eq!(resets, 1);
        assert!(matches!(read_frame(&mut server), Err(FrameError::Closed)));
    }

    fn sleep_done(server: &mut TcpStream, wake: bool) -> SleepDone {
        match (read_frame(server).unwrap(), wake) {
            (Frame::SleepDone(d), false) | (Frame::WakeDone(d), true) => d,
            (other, _) => panic!(
                "expected {}, got {other:?}",
                ["SleepDone", "WakeDone"][wake as usize]
            ),
        }
    }

    /// Level 1 keeps the engine (its KV released), steps fail while asleep and work after
    /// Wake; level 2 without a loader is refused and the engine stays awake.
    #[test]
    fn sleep_and_wake() {
        let (mut server, mut seg, agent) = start();
        write_frame(&mut server, &Frame::Sleep { level: 1 }).unwrap();
        let d = sleep_done(&mut server, false);
        assert_eq!((d.level, d.error.as_str()), (1, ""));
        seg.write_plan(&plan(1, 2, 10)).unwrap();
        write_frame(&mut server, &Frame::Step { step_id: 1 }).unwrap();
        let done = step_done(&mut server);
        assert_eq!(done.status, StepStatus::Failed);
        assert!(done.error.contains("asleep"), "{}", done.error);
        write_frame(&mut server, &Frame::Wake).unwrap();
        let d = sleep_done(&mut server, true);
        assert_eq!((d.level, d.error.as_str()), (0, ""));
        write_frame(&mut server, &Frame::Step { step_id: 1 }).unwrap();
        assert_eq!(step_done(&mut server).status, StepStatus::Ok);
        write_frame(&mut server, &Frame::Sleep { level: 2 }).unwrap();
        let d = sleep_done(&mut server, false);
        assert_eq!(d.level, 0);
        assert!(
            d.error.contains("cannot load its engine again"),
            "{}",
            d.error
        );
        write_frame(&mut server, &Frame::Sleep { level: 3 }).unwrap();
        assert!(sleep_done(&mut server, false).error.contains("1 or 2"));
        // Awake: Wake does nothing.
        write_frame(&mut server, &Frame::Wake).unwrap();
        assert_eq!(sleep_done(&mut server, true).level, 0);
        write_frame(&mut server, &Frame::Shutdown).unwrap();
        let (outcome, resets) = agent.join().unwrap();
        outcome.unwrap();
        assert_eq!(resets, 1, "level 1 forgets every slot");
    }

    #[test]
    fn failing_steps_are_reported_and_the_loop_goes_on() {
        let (mut server, mut seg, agent) = start();
        // The engine refuses the plan.
        seg.write_plan(&plan(1, 13, 0)).unwrap();
        write_frame(&mut server, &Frame::Step { step_id: 1 }).unwrap();
        let done = step_done(&mut server);
        assert_eq!(done.status, StepStatus::Failed);
        assert!(done.error.contains("slot 13 is unlucky"), "{}", done.error);
        // The announced step is not the one in the segment.
        seg.write_plan(&plan(2, 1, 0)).unwrap();
        write_frame(&mut server, &Frame::Step { step_id: 3 }).unwrap();
        let done = step_done(&mut server);
        assert_eq!((done.step_id, done.status), (3, StepStatus::Failed));
        assert!(done.error.contains("holds plan 2"), "{}", done.error);
        // A corrupt segment: the plan header claims more sequences than fit.
        let meta = seg
            .layout()
            .region(npu_protocol::shm::Region::PlanMeta)
            .offset;
        let path = format!("/dev/shm{}", seg.name());
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[meta as usize + 8..meta as usize + 12].copy_from_slice(&u32::MAX.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        write_frame(&mut server, &Frame::Step { step_id: 2 }).unwrap();
        let done = step_done(&mut server);
        assert_eq!(done.status, StepStatus::Failed);
        assert!(done.error.contains("corrupt segment"), "{}", done.error);
        // Still serving.
        seg.write_plan(&plan(4, 1, 5)).unwrap();
        write_frame(&mut server, &Frame::Step { step_id: 4 }).unwrap();
        assert_eq!(step_done(&mut server).status, StepStatus::Ok);
        drop(server);
        let (outcome, _) = agent.join().unwrap();
        outcome.unwrap();
    }

    /// A plan whose mask words follow it: the forward pass runs before they exist, pings are
    /// answered while the step waits, and the words written later are the ones sampled under.
    #[test]
    fn mask_words_that_follow_the_plan_are_waited_for_after_the_forward_pass() {
        let (mut server, mut seg, agent, forwarded) = start_counting();
        let mut p = plan(1, 2, 10);
        p.masks = vec![npu_protocol::TokenMask {
            slot: 2,
            words: Vec::new(),
        }];
        seg.write_plan(&p).unwrap();
        write_frame(&mut server, &Frame::Step { step_id: 1 }).unwrap();
        let until = Instant::now() + std::time::Duration::from_secs(20);
        while forwarded.load(Ordering::SeqCst) == 0 {
            assert!(
                Instant::now() < until,
                "the forward pass waited for the masks"
            );
            thread::sleep(std::time::Duration::from_millis(1));
        }
        write_frame(&mut server, &Frame::Ping { nonce: 5 }).unwrap();
        assert_eq!(read_frame(&mut server).unwrap(), Frame::Pong { nonce: 5 });
        // Only token 70 allowed.
        let mut words = vec![0u32; 4];
        words[2] = 1 << 6;
        seg.write_mask_words(&[npu_protocol::TokenMask { slot: 2, words }])
            .unwrap();
        write_frame(&mut server, &Frame::Masks { step_id: 1 }).unwrap();
        let done = step_done(&mut server);
        assert_eq!(done.status, StepStatus::Ok, "{}", done.error);
        assert_eq!(seg.read_result().unwrap().seqs[0].token.token, 70);
        // A step that fails before it waits: its late Masks frame is dropped, the loop goes on.
        let mut p = plan(2, 13, 0);
        p.masks = vec![npu_protocol::TokenMask {
            slot: 13,
            words: Vec::new(),
        }];
        seg.write_plan(&p).unwrap();
        write_frame(&mut server, &Frame::Step { step_id: 2 }).unwrap();
        assert_eq!(step_done(&mut server).status, StepStatus::Failed);
        write_frame(&mut server, &Frame::Masks { step_id: 2 }).unwrap();
        // Masks announced for another step than the one waiting: the step fails, naming it.
        let mut p = plan(3, 1, 4);
        p.masks = vec![npu_protocol::TokenMask {
            slot: 1,
            words: Vec::new(),
        }];
        seg.write_plan(&p).unwrap();
        write_frame(&mut server, &Frame::Step { step_id: 3 }).unwrap();
        write_frame(&mut server, &Frame::Masks { step_id: 9 }).unwrap();
        let done = step_done(&mut server);
        assert_eq!(done.status, StepStatus::Failed);
        assert!(
            done.error.contains("waited for its masks"),
            "{}",
            done.error
        );
        // Still serving.
        seg.write_plan(&plan(4, 1, 5)).unwrap();
        write_frame(&mut server, &Frame::Step { step_id: 4 }).unwrap();
        assert_eq!(step_done(&mut server).status, StepStatus::Ok);
        drop(server);
        let (outcome, _) = agent.join().unwrap();
        outcome.unwrap();
    }

    #[test]
    fn an_unexpected_frame_ends_the_loop_with_a_protocol_error() {
        let (mut server, _seg, agent) = start();
        write_frame(&mut server, &Frame::Welcome).unwrap();
        let (outcome, _) = agent.join().unwrap();
        assert!(
            matches!(outcome, Err(WorkerError::Protocol(_))),
            "{outcome:?}"
        );
    }

    #[test]
    fn a_garbled_frame_ends_the_loop_with_a_frame_error() {
        let (mut server, _seg, agent) = start();
        server.write_all(&[3, 0, 0, 0, 200, 1, 2]).unwrap();
        let (outcome, _) = agent.join().unwrap();
        assert!(
            matches!(
                outcome,
                Err(WorkerError::Frame(FrameError::UnknownType(200)))
            ),
            "{outcome:?}"
        );
    }
}

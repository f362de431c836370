//! Sleep level 1 on the device backends (`AgentEngine::release_kv` / `restore_kv`, what the
//! agent's Sleep { level: 1 } and Wake frames run): on the CUDA backend over the CPU emulation
//! of its kernels and on the Ascend backend over the strict CANN emulation, opened as the agent
//! opens them (`NPU_SERVING_CUDA_EMULATION=1`, `ASCEND_HOME_PATH`), on the tiny random-weight
//! models (Q8_0): llama, and the MoE, Gemma 3 and DeepSeek ones. The engine is kept; its weights go to host memory and their
//! device memory is freed (the emulations count every allocation: the free memory they report
//! must grow by the bytes the engine says it released, at least the matrices'), a step while asleep fails with an error naming
//! the sleep, and after Wake the greedy tokens are those before the sleep, with decode graphs
//! off and on (`graph_capture: auto`: graphs captured before the sleep name freed memory and
//! must not be replayed). Built with the `cuda` and `ascend` features.

#![cfg(all(feature = "cuda", feature = "ascend"))]

mod common;

use std::path::PathBuf;

use npu_agent::engine::{AgentEngine, AgentEngineConfig};
use npu_agent::inproc;
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};
use npu_protocol::agent::{DeviceKind, GraphCapture};
use npu_protocol::SamplingParams;
use npu_scheduler::{GenerateRequest, Scheduler, SchedulerConfig};

/// The tiny random-weight model of `family` (Q8_0), written to a temporary file of its own.
fn tiny(family: Family, tag: &str) -> PathBuf {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let bytes = synth::synth_model(family, 1, GgmlType::Q8_0, &donor).unwrap();
    let file = std::env::temp_dir().join(format!(
        "npu-sleep-devices-{tag}-{}.gguf",
        std::process::id()
    ));
    std::fs::write(&file, bytes).unwrap();
    file
}

fn request(id: u64, prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        id,
        prompt_ids: prompt,
        params: SamplingParams::greedy(),
        max_new_tokens: 12,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: true,
        speculative: false,
    }
}

/// Two prompts run together to the end, greedy: each one's tokens.
fn greedy(engine: &mut AgentEngine, sched_cfg: &SchedulerConfig) -> Vec<Vec<u32>> {
    let mut sched = Scheduler::new(sched_cfg.clone()).unwrap();
    let prompts = [
        (0..23).map(|k| 100 + 7 * k).collect::<Vec<u32>>(),
        (0..9).map(|k| 300 + 13 * k).collect(),
    ];
    for (i, p) in prompts.iter().enumerate() {
        sched.add(&request(i as u64, p.clone())).unwrap();
    }
    let mut out = vec![Vec::new(); prompts.len()];
    while !sched.is_idle() {
        let plan = sched.schedule().expect("work to plan");
        let res = engine.step(&plan).unwrap();
        for o in sched.on_result(&res).unwrap() {
            out[o.id as usize].push(o.token.token);
        }
    }
    out
}

fn free_bytes(engine: &AgentEngine) -> u64 {
    engine.device_model().mem_info().unwrap().free
}

/// Loads the tiny model on `device`, sleeps at level 1 and wakes; checks the memory, the
/// refused step and the tokens.
fn sleep_and_wake(device: DeviceKind, family: Family, graph_capture: GraphCapture) {
    // The CANN emulation's device is one for the whole process: the free memory it reports
    // moves with every test's allocations, so the Ascend runs take turns.
    static ASCEND: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn =
        (device == DeviceKind::Ascend).then(|| ASCEND.lock().unwrap_or_else(|e| e.into_inner()));
    let tag = format!("{}-{}-{graph_capture:?}", device.name(), family.name());
    let model = tiny(family, &tag);
    let cfg = AgentEngineConfig {
        device,
        model_path: model.clone(),
        graph_capture,
        ..common::engine_config(2, 32)
    };
    let sched_cfg = inproc::scheduler_config(&cfg);
    let started = std::time::Instant::now();
    let mut e = AgentEngine::load(&cfg).expect("the model loads on the emulation");
    let cold = started.elapsed();
    let before = greedy(&mut e, &sched_cfg);
    let replays = |e: &AgentEngine| e.device_model().op_counts().unwrap().graph_replays;
    let replayed_before = replays(&e);
    if graph_capture == GraphCapture::Auto {
        assert!(
            replayed_before > 0,
            "{tag}: no decode step replayed a graph"
        );
    }
    let weights = e
        .device_model()
        .weight_bytes_per_step()
        .expect("the backend says its matrices' bytes");
    let awake_free = free_bytes(&e);

    let released = e
        .release_kv()
        .unwrap()
        .expect("level 1 keeps the engine on this device");
    let asleep_free = free_bytes(&e);
    eprintln!(
        "{tag}: {released} bytes released ({weights} of matrices); free {awake_free} -> \
         {asleep_free}"
    );
    assert!(
        released >= weights,
        "{tag}: {released} bytes released, the matrices alone are {weights}"
    );
    // Exactly what the engine reports, but for the graphs' step inputs (freed with the graphs,
    // not counted: a few hundred bytes here).
    let freed = asleep_free - awake_free;
    assert!(
        (released..=released + (64 << 10)).contains(&freed),
        "{tag}: {freed} bytes of device memory freed, {released} reported released"
    );
    // A step while asleep fails cleanly, naming the sleep.
    let mut sched = Scheduler::new(sched_cfg.clone()).unwrap();
    sched.add(&request(0, vec![5, 6, 7])).unwrap();
    let plan = sched.schedule().unwrap();
    let err = e.step(&plan).expect_err("a step while asleep").to_string();
    assert!(err.contains("sleep level 1"), "{tag}: {err}");

    let started = std::time::Instant::now();
    let allocated = e.restore_kv().unwrap();
    let wake = started.elapsed();
    // Printed, not judged here: at this size fixed costs dominate both (tests/e2e_ascend.rs
    // judges the wake against the served model's cold load).
    eprintln!("{tag}: cold load {cold:?}, wake from level 1 {wake:?}");
    assert!(allocated >= weights, "{tag}: {allocated} bytes allocated");
    let woken_free = free_bytes(&e);
    assert!(
        woken_free + weights <= asleep_free,
        "{tag}: free memory {asleep_free} asleep, {woken_free} awake again"
    );
    let after = greedy(&mut e, &sched_cfg);
    assert_eq!(
        after, before,
        "{tag}: greedy tokens after sleep level 1 and wake"
    );
    if graph_capture == GraphCapture::Auto {
        assert!(
            replays(&e) > replayed_before,
            "{tag}: no graph replayed after the wake (captured again over the new addresses)"
        );
    }
    // And a second time (the list of weights survives a round trip).
    e.release_kv().unwrap().unwrap();
    e.restore_kv().unwrap();
    assert_eq!(greedy(&mut e, &sched_cfg), before, "{tag}: second wake");
    // Level 2 from level 1 drops the engine while its weights are in host memory: nothing is
    // freed twice (the emulations refuse a free of an address they do not hold).
    e.release_kv().unwrap().unwrap();
    drop(e);
    let _ = std::fs::remove_file(&model);
}

/// The emulations as the agent finds them: both variables set once, before either test opens a
/// device.
fn emulations() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let root = common::devices::cann_root();
        std::env::set_var("NPU_SERVING_CUDA_EMULATION", "1");
        std::env::set_var("ASCEND_HOME_PATH", root);
    });
}

#[test]
fn cuda_level_one_moves_weights_to_host_and_back() {
    emulations();
    sleep_and_wake(DeviceKind::Cuda, Family::Llama, GraphCapture::Off);
    sleep_and_wake(DeviceKind::Cuda, Family::Llama, GraphCapture::Auto);
}

#[test]
fn ascend_level_one_moves_weights_to_host_and_back() {
    emulations();
    sleep_and_wake(DeviceKind::Ascend, Family::Llama, GraphCapture::Off);
    sleep_and_wake(DeviceKind::Ascend, Family::Llama, GraphCapture::Auto);
}

/// The families whose weights take other forms: experts (Qwen3-MoE: one stack a projection on
/// Ascend), Gemma 3's norms, GELU table and bf16 activations on Ascend, DeepSeek's latent
/// attention and scored routing.
const FAMILIES: [Family; 3] = [Family::Qwen3Moe, Family::Gemma3, Family::Deepseek2];

#[test]
fn cuda_level_one_round_trips_every_family_form() {
    emulations();
    for family in FAMILIES {
        sleep_and_wake(DeviceKind::Cuda, family, GraphCapture::Off);
    }
}

#[test]
fn ascend_level_one_round_trips_every_family_form() {
    emulations();
    for family in FAMILIES {
        sleep_and_wake(DeviceKind::Ascend, family, GraphCapture::Off);
    }
}

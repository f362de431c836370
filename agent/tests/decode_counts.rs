//! What `npu-serving bench-model` counts per batch-1 decode step (`count_decode`, and the weight
//! bytes beside the file's), on the CUDA backend over the CPU emulation of its kernels and on the
//! Ascend backend over the strict CANN emulation, opened as the CLI opens them
//! (`NPU_SERVING_CUDA_EMULATION=1`, `ASCEND_HOME_PATH`), on the tiny random-weight llama model
//! (Q8_0, 2 layers; `npu-serving synth-model --arch llama --seed 1 --type q8_0`). The launch
//! counts are pinned: a change in how many kernels or operators a decode step launches shows
//! here, and the new number goes into docs/devices.md with it. Built with the `cuda` and `ascend`
//! features.

#![cfg(all(feature = "cuda", feature = "ascend"))]

mod common;

use std::path::PathBuf;

use npu_agent::cli::bench_model::{count_decode, file_weight_bytes, DecodeCounts};
use npu_agent::engine::{AgentEngine, AgentEngineConfig};
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};
use npu_protocol::agent::{DeviceKind, GraphCapture};

/// Layers of the tiny llama model.
const LAYERS: usize = 2;
/// Kernel launches of one batch-1 decode step of it on the CUDA backend (f32 activations,
/// quantized matmuls, folded launches on: `CudaConfig::fuse` and `fold_gemv`): 7 a layer (Q/K/V
/// GEMV with the attention RMS norm folded in; `rope_kv_write` (folded into the GEMV too with
/// `NPU_SERVING_CUDA_FUSE=3`, opt-in: tests/cuda_fused.rs); attention; 8-bit
/// quantization of its output; output GEMV with the residual add folded in; gate/up GEMV
/// with the FFN norm and SwiGLU folded in, writing the down GEMV's 8-bit activations; down GEMV
/// with the residual add folded in: backends/cuda/src/fold.rs), and 5 for the rest (embedding,
/// logit-row gather, the head's GEMV with the final norm folded in, argmax and its
/// log-probability). This model's
/// head size (16) is not a multiple of 32, so attention does not write the output projection's
/// 8-bit activations: with head sizes of 32 and more (every real model), 6 a layer
/// (tests/cuda_fused.rs). Without the GEMV folds (`NPU_SERVING_CUDA_FUSE=1`): 10 a layer, the
/// last layer's residual add alone and 6 for the rest, the final norm apart (27); before any
/// fold: 16 a layer and 7 for the rest (39).
const CUDA_LAYER_LAUNCHES: u64 = 7;
const CUDA_LAUNCHES: u64 = LAYERS as u64 * CUDA_LAYER_LAUNCHES + 5;
/// aclnn launches of one batch-1 decode step of it on the Ascend backend: 11 a layer
/// (WeightQuantBatchMatmulV2 per projection, RotaryPositionEmbedding and the copy back — this
/// model's rope is interleaved, which ApplyRotaryPosEmb does not rotate in place —,
/// ScatterPaKvCache, FusedInferAttentionScoreV2, SwiGlu, and the two residual adds each folded
/// into the norm after it as one AddRmsNorm; the last layer's second add, with no norm after
/// it, an InplaceAdd), the first layer's RmsNorm, and 12 for the rest; and their first phases
/// (the matmuls' and SwiGlu's executors reused: 6 a layer, 1 + 9 the rest). Before AddRmsNorm:
/// 13 a layer (an InplaceAdd and an RmsNorm for each fold) and 12 for the rest, 38 launches and
/// 25 first phases; a fold undone shows here.
const ASCEND_LAYER_LAUNCHES: u64 = 11;
const ASCEND_LAUNCHES: u64 = LAYERS as u64 * ASCEND_LAYER_LAUNCHES + 1 + 12;
const ASCEND_FIRST_PHASES: u64 = LAYERS as u64 * 6 + 1 + 9;
/// The tiny Qwen3 model's (`synth-model --arch qwen3`: 3 layers, per-head q/k norms, NeoX rope
/// of head size 32): 13 a layer — the Llama layer's 11 and one RmsNorm each for the q and the k
/// heads (their weights differ, so the two norms cannot be one RmsNorm call) — and 13 for the
/// rest (the same 12 and the first layer's RmsNorm). At Qwen3's real head size of 128 the rope
/// is one ApplyRotaryPosEmb call (backends/ascend/tests/fused.rs): 12 a layer. Before: 15.
const QWEN3_LAYERS: usize = 3;
/// The tiny Qwen3 model's on the CUDA backend (folds on): 6 a layer, as a Llama layer of head
/// size 32 — the q and k head norms with rope and the KV write in `norm_rope_kv_write` (in the
/// Q/K/V GEMV's launch with the opt-in rope fold: 5) — and the same 5 outside (9 a layer and 1 + 6 outside without the
/// GEMV folds; 11 a layer before `norm_rope_kv_write`).
const CUDA_QWEN3_LAUNCHES: u64 = QWEN3_LAYERS as u64 * 6 + 5;
const ASCEND_QWEN3_LAUNCHES: u64 = QWEN3_LAYERS as u64 * 13 + 13;

/// The tiny llama model, written to a temporary file (one per call: tests run in parallel).
fn tiny_llama(device: &str) -> PathBuf {
    tiny(Family::Llama, device)
}

/// A tiny random-weight model of `family` (Q8_0), written to a temporary file.
fn tiny(family: Family, device: &str) -> PathBuf {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let bytes = synth::synth_model(family, 1, GgmlType::Q8_0, &donor).unwrap();
    let file = std::env::temp_dir().join(format!(
        "npu-decode-counts-{device}-{}.gguf",
        std::process::id()
    ));
    std::fs::write(&file, bytes).unwrap();
    file
}

/// Opens the device as `bench-model --device` does, and counts 3 decode steps.
fn counts(device: DeviceKind, model: PathBuf) -> (DecodeCounts, Option<u64>, u64) {
    counts_with(device, model, GraphCapture::Off)
}

/// `counts` with `bench-model --graph-capture`'s setting.
fn counts_with(
    device: DeviceKind,
    model: PathBuf,
    graph_capture: GraphCapture,
) -> (DecodeCounts, Option<u64>, u64) {
    let cfg = AgentEngineConfig {
        device,
        model_path: model.clone(),
        graph_capture,
        ..common::engine_config(4, 64)
    };
    let mut engine = AgentEngine::load(&cfg).expect("the model loads on the emulation");
    let c = count_decode(&mut engine, &cfg, 3, 7)
        .unwrap()
        .expect("the backend counts its launches");
    let device_bytes = engine.device_model().weight_bytes_per_step();
    let file_bytes = file_weight_bytes(&model).unwrap();
    drop(engine);
    let _ = std::fs::remove_file(&model);
    (c, device_bytes, file_bytes)
}

fn check(device: &str, c: &DecodeCounts, device_bytes: Option<u64>, file_bytes: u64) {
    check_layers(device, c, device_bytes, file_bytes, LAYERS)
}

fn check_layers(
    device: &str,
    c: &DecodeCounts,
    device_bytes: Option<u64>,
    file_bytes: u64,
    layers: usize,
) {
    eprintln!(
        "{device}: {c:?}; weight bytes per decode step {device_bytes:?}, in the file {file_bytes}"
    );
    assert_eq!(c.steps, 3, "{device}: {c:?}");
    assert!(c.launches_per_step > 0.0, "{device}: {c:?}");
    assert_eq!(c.min_launches, c.max_launches, "{device}: {c:?}");
    assert_eq!(c.graph_replays_per_step, 0.0, "{device}: {c:?}");
    assert_eq!(
        c.launches_per_layer,
        c.launches_per_step / layers as f64,
        "{device}: {c:?}"
    );
    let d = device_bytes.expect("the backend says its matrices' bytes") as f64;
    let f = file_bytes as f64;
    assert!(
        (d - f).abs() <= 0.01 * f,
        "{device}: {d} weight bytes on the device, {f} in the file"
    );
}

/// The emulations as the CLI finds them: both variables set once, before either test opens a
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
fn cuda_emulation_counts_decode_launches() {
    emulations();
    let (c, d, f) = counts(DeviceKind::Cuda, tiny_llama("cuda"));
    check("cuda", &c, d, f);
    assert_eq!(c.first_phases_per_step, 0.0, "{c:?}");
    assert_eq!(c.min_launches, CUDA_LAUNCHES, "{c:?}");
}

#[test]
fn cuda_emulation_counts_qwen3_decode_launches() {
    emulations();
    let (c, d, f) = counts(DeviceKind::Cuda, tiny(Family::Qwen3, "cuda-qwen3"));
    check_layers("cuda qwen3", &c, d, f, QWEN3_LAYERS);
    assert_eq!(c.min_launches, CUDA_QWEN3_LAUNCHES, "{c:?}");
}

#[test]
fn ascend_emulation_counts_decode_launches() {
    emulations();
    let (c, d, f) = counts(DeviceKind::Ascend, tiny_llama("ascend"));
    check("ascend", &c, d, f);
    assert_eq!(c.min_launches, ASCEND_LAUNCHES, "{c:?}");
    assert_eq!(c.first_phases_per_step, ASCEND_FIRST_PHASES as f64, "{c:?}");
}

#[test]
fn ascend_emulation_counts_qwen3_decode_launches() {
    emulations();
    let (c, d, f) = counts(DeviceKind::Ascend, tiny(Family::Qwen3, "ascend-qwen3"));
    check_layers("ascend qwen3", &c, d, f, QWEN3_LAYERS);
    assert_eq!(c.min_launches, ASCEND_QWEN3_LAUNCHES, "{c:?}");
}

/// With `graph_capture: auto` the first decode step (uncounted) runs and records the step's
/// graph (batch 1, the sequence's block-table width); every counted step is that graph's one
/// replay, with no operator launched or first phase made outside it.
#[test]
fn ascend_emulation_replays_one_graph_per_decode_step() {
    emulations();
    let (c, _, _) = counts_with(
        DeviceKind::Ascend,
        tiny_llama("ascend-graphs"),
        GraphCapture::Auto,
    );
    eprintln!("ascend with graphs: {c:?}");
    assert_eq!(c.steps, 3, "{c:?}");
    assert_eq!(c.graph_replays_per_step, 1.0, "{c:?}");
    assert_eq!((c.min_launches, c.max_launches), (0, 0), "{c:?}");
    assert_eq!(c.first_phases_per_step, 0.0, "{c:?}");
}

/// The same on the CUDA backend over the emulation's strict stream capture: with
/// `graph_capture: auto` every counted decode step is its graph's one replay (the first,
/// uncounted step ran eagerly and recorded it), with no kernel launched outside it.
#[test]
fn cuda_emulation_replays_one_graph_per_decode_step() {
    emulations();
    let (c, _, _) = counts_with(
        DeviceKind::Cuda,
        tiny_llama("cuda-graphs"),
        GraphCapture::Auto,
    );
    eprintln!("cuda with graphs: {c:?}");
    assert_eq!(c.steps, 3, "{c:?}");
    assert_eq!(c.graph_replays_per_step, 1.0, "{c:?}");
    assert_eq!((c.min_launches, c.max_launches), (0, 0), "{c:?}");
}

/// Set in the child process `cuda_emulation_counts_three_launches_a_layer_at_fuse_4` starts.
const LEVEL_4_CHILD: &str = "NPU_DECODE_COUNTS_LEVEL_4_CHILD";

/// `NPU_SERVING_CUDA_FUSE=4` (the default, set explicitly here): rope and the KV write folded into the Q/K/V GEMV, decode
/// attention with the output projection and the residual add in one launch (`fold_attn_out`),
/// and the whole feed-forward block in one launch (`fold_ffn`): **3 launches a layer** and the
/// same 5 outside, on the tiny llama (2 layers) and Qwen3 (3 layers) models; a fold that stops
/// being taken shows here. The CUDA settings come from the environment, which the other tests
/// of this binary share, so the count runs in a child process of this binary with the variable
/// set; the parent checks that the child ran this test and passed.
#[test]
fn cuda_emulation_counts_three_launches_a_layer_at_fuse_4() {
    if std::env::var_os(LEVEL_4_CHILD).is_some() {
        assert_eq!(
            std::env::var("NPU_SERVING_CUDA_FUSE").as_deref(),
            Ok("4"),
            "the child runs at level 4"
        );
        emulations();
        let (c, d, f) = counts(DeviceKind::Cuda, tiny_llama("cuda-fuse4"));
        check("cuda level 4", &c, d, f);
        assert_eq!(c.min_launches, LAYERS as u64 * 3 + 5, "{c:?}");
        let (c, d, f) = counts(DeviceKind::Cuda, tiny(Family::Qwen3, "cuda-qwen3-fuse4"));
        check_layers("cuda qwen3 level 4", &c, d, f, QWEN3_LAYERS);
        assert_eq!(c.min_launches, QWEN3_LAYERS as u64 * 3 + 5, "{c:?}");
        return;
    }
    let name = "cuda_emulation_counts_three_launches_a_layer_at_fuse_4";
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(LEVEL_4_CHILD, "1")
        .env("NPU_SERVING_CUDA_FUSE", "4")
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "level-4 child: {}\n{stdout}\n{stderr}",
        out.status
    );
}

/// Set in the child process of `cuda_emulation_reads_the_files_k_quant_bytes_when_packed`.
const KQUANTS_CHILD: &str = "NPU_DECODE_COUNTS_KQUANTS_CHILD";

/// With `NPU_SERVING_CUDA_KQUANTS=packed` (the default, set explicitly here), a Q4_K model's
/// matrices hold the file's bytes on the CUDA device (`f16` dequantizes them to F16: about 3.6
/// times as many). A
/// tiny llama with every matrix's inputs whole Q4_K blocks (hidden 256, feed-forward 512). The
/// variable is read from the environment, which this binary's other tests share, so the count
/// runs in a child process of this binary with it set (as the level-4 test does).
#[test]
fn cuda_emulation_reads_the_files_k_quant_bytes_when_packed() {
    if std::env::var_os(KQUANTS_CHILD).is_some() {
        emulations();
        let donor = GgufFile::open(common::model_path()).unwrap();
        let mut shape = Family::Llama.shape();
        shape.hidden = 256;
        shape.heads = 8;
        shape.head_dim = 32;
        shape.ff = 512;
        let layers = shape.layers;
        let bytes =
            synth::synth_model_shaped(Family::Llama, shape, 1, GgmlType::Q4K, &donor).unwrap();
        let file = std::env::temp_dir().join(format!(
            "npu-decode-counts-cuda-q4k-{}.gguf",
            std::process::id()
        ));
        std::fs::write(&file, bytes).unwrap();
        let (c, d, f) = counts(DeviceKind::Cuda, file);
        check_layers("cuda packed Q4_K", &c, d, f, layers);
        assert_eq!(d, Some(f), "the file's bytes exactly");
        return;
    }
    let name = "cuda_emulation_reads_the_files_k_quant_bytes_when_packed";
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(KQUANTS_CHILD, "1")
        .env("NPU_SERVING_CUDA_KQUANTS", "packed")
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "packed K-quants child: {}\n{stdout}\n{stderr}",
        out.status
    );
}

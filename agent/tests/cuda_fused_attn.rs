//! Decode attention with the output projection and the residual add in one launch
//! (`CudaConfig::fold_attn_out`, part of `NPU_SERVING_CUDA_FUSE=4`; backends/cuda/src/
//! fold_attn.rs) in whole models: tiny random-weight llama and qwen3 models (Q8_0; llama's heads
//! of 16 in groups of 2, qwen3's of 32 with its head norms), run by the agent's own model on the
//! CPU emulation of the kernels, give FUSE=3's greedy ids, log-probabilities within 1e-3 and
//! logits within a small tolerance (the fused product adds its terms in another order: not bit
//! for bit), the same bits on a second run, one launch fewer per layer for llama3 and qwen3
//! (two for llama, whose separate attention output needs `quantize_q8`), and with decode steps
//! captured as CUDA graphs (tables wide enough that the graph's attention splits, merged inside
//! the fused launch) the eager steps' greedy tokens, every later step a replay. Nothing here ran
//! on a GPU. Built with the `cuda` and `ascend` features (the shared device helpers need both).

#![cfg(all(feature = "cuda", feature = "ascend"))]

mod common;

use common::devices::cuda;
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, SeqSpan, StepInputs};
use npu_backend_cuda::CudaBackend;
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};

const BLOCK: usize = 16;

fn options(num_blocks: usize) -> ModelOptions {
    ModelOptions {
        max_tokens: 64,
        max_logit_rows: 4,
        num_blocks,
        block_size: BLOCK,
        kv_memory_fraction: None,
    }
}

/// The emulation at `NPU_SERVING_CUDA_FUSE=3`, with the attention fold on or off.
fn device(attn_fold: bool) -> CudaBackend {
    let mut b = cuda();
    b.set_fuse(true);
    b.set_fold_rope(true);
    b.set_fold_attn_out(attn_fold);
    b
}

fn model(family: Family) -> GgufFile {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let bytes = synth::synth_model(family, 1, GgmlType::Q8_0, &donor).unwrap();
    // One file per call: the tests run in parallel, and each maps its file (rewriting one that
    // another maps would pull its pages away).
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!(
        "npu-cuda-fused-attn-{}-{}-{call}.gguf",
        family.name(),
        std::process::id()
    ));
    std::fs::write(&path, bytes).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    f
}

/// The step feeding `new` tokens of one sequence after `start` cached ones (slot = position).
fn seq_step(new: &[u32], start: usize) -> StepInputs {
    let max_blocks = 8;
    StepInputs {
        tokens: new.to_vec(),
        positions: (start..start + new.len()).map(|p| p as u32).collect(),
        slot_mapping: (start..start + new.len()).map(|p| p as u32).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: new.len() as u32,
            start_pos: start as u32,
        }],
        block_tables: (0..max_blocks as u32).collect(),
        max_blocks,
        logit_rows: vec![new.len() as u32 - 1],
    }
}

/// Each greedy step's id and log-probability, each logit step's logits, and the launches of
/// each single-token greedy step.
#[derive(Debug, PartialEq)]
struct Run {
    picks: Vec<(i32, f32)>,
    logits: Vec<Vec<f32>>,
    decode_launches: Vec<u64>,
}

/// A prompt in one step, then 6 greedy single-token steps; then logits (the host's pick) along
/// the greedy tokens.
fn run(file: &GgufFile, attn_fold: bool) -> Run {
    let mut m = Model::load(file, device(attn_fold), options(8)).unwrap();
    let prompt = [1u32, 15, 27, 3, 99];
    let mut out = StepOutput::default();
    let mut r = Run {
        picks: Vec::new(),
        logits: Vec::new(),
        decode_launches: Vec::new(),
    };
    let (mut pos, mut next) = (0, prompt.to_vec());
    let mut tokens = Vec::new();
    for _ in 0..7 {
        let before = m.backend().op_counts().unwrap().launches;
        m.forward(&seq_step(&next, pos), true, &mut out).unwrap();
        assert!(out.picked_on_device);
        if next.len() == 1 {
            r.decode_launches
                .push(m.backend().op_counts().unwrap().launches - before);
        }
        pos += next.len();
        r.picks.push((out.ids[0], out.logprobs[0]));
        next = vec![out.ids[0] as u32];
        tokens.push(out.ids[0] as u32);
    }
    let (mut pos, mut next) = (0, prompt.to_vec());
    for &t in &tokens[..4] {
        let mut s = seq_step(&next, pos);
        s.slot_mapping.iter_mut().for_each(|x| *x += 64);
        s.block_tables = (4..12).map(|b| b % 8).collect();
        m.forward(&s, false, &mut out).unwrap();
        r.logits.push(out.logits.clone());
        pos += next.len();
        next = vec![t];
    }
    r
}

fn bits(r: &Run) -> (Vec<(i32, u32)>, Vec<Vec<u32>>) {
    (
        r.picks.iter().map(|&(i, l)| (i, l.to_bits())).collect(),
        r.logits
            .iter()
            .map(|v| v.iter().map(|x| x.to_bits()).collect())
            .collect(),
    )
}

/// `per_layer_saved`: launches a decode layer saves with the fold.
fn check(family: Family, per_layer_saved: u64) {
    let file = model(family);
    let layers = family.shape().layers as u64;
    let name = family.name();
    let three = run(&file, false);
    let four = run(&file, true);
    let again = run(&file, true);
    assert_eq!(bits(&four), bits(&again), "{name}: two runs, the same bits");
    let ids = |r: &Run| r.picks.iter().map(|p| p.0).collect::<Vec<_>>();
    assert_eq!(ids(&four), ids(&three), "{name}: greedy ids against FUSE=3");
    for (a, b) in four.picks.iter().zip(&three.picks) {
        assert!(
            (a.1 - b.1).abs() <= 1e-3,
            "{name}: log-probability {a:?} vs {b:?}"
        );
    }
    for (step, (a, b)) in four.logits.iter().zip(&three.logits).enumerate() {
        let top = b.iter().fold(1f32, |m, v| m.max(v.abs()));
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-3 * top,
            "{name}: logits of step {step} differ by {worst} (largest {top})"
        );
    }
    eprintln!(
        "{name}: decode launches a step, FUSE=3 {:?}, with the attention fold {:?}",
        three.decode_launches, four.decode_launches
    );
    for (a, b) in four.decode_launches.iter().zip(&three.decode_launches) {
        assert_eq!(
            *a + per_layer_saved * layers,
            *b,
            "{name}: the fused attention launch is taken in every layer"
        );
    }
}

#[test]
fn fused_attention_answers_as_fuse_three() {
    check(Family::Llama, 2);
    check(Family::Qwen3, 1);
}

/// Three sequences of different lengths prefilled eagerly, then decoded together 6 times, with
/// tables of 16 blocks (the graph's attention splits in two, from the table width); greedy
/// tokens.
fn batch_run(m: &mut Model<CudaBackend>) -> Vec<Vec<u32>> {
    const MB: usize = 16;
    let prompts: Vec<Vec<u32>> = vec![vec![1, 15, 27, 3, 99], vec![7, 8], (40..69).collect()];
    let table = |s: usize| (0..MB).map(move |b| (s * MB + b) as u32);
    let slot = |s: usize, p: usize| (s * MB + p / BLOCK) as u32 * BLOCK as u32 + (p % BLOCK) as u32;
    let mut out = StepOutput::default();
    let mut last = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let n = p.len();
        let step = StepInputs {
            tokens: p.clone(),
            positions: (0..n as u32).collect(),
            slot_mapping: (0..n).map(|q| slot(i, q)).collect(),
            seqs: vec![SeqSpan {
                q_row: 0,
                n_q: n as u32,
                start_pos: 0,
            }],
            block_tables: table(i).collect(),
            max_blocks: MB,
            logit_rows: vec![n as u32 - 1],
        };
        m.forward(&step, true, &mut out).unwrap();
        last.push(out.ids[0] as u32);
    }
    let mut lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let mut steps = vec![last.clone()];
    for _ in 0..6 {
        let n = prompts.len();
        let step = StepInputs {
            tokens: last.clone(),
            positions: lens.iter().map(|&l| l as u32).collect(),
            slot_mapping: lens.iter().enumerate().map(|(i, &l)| slot(i, l)).collect(),
            seqs: (0..n)
                .map(|i| SeqSpan {
                    q_row: i as u32,
                    n_q: 1,
                    start_pos: lens[i] as u32,
                })
                .collect(),
            block_tables: (0..n).flat_map(table).collect(),
            max_blocks: MB,
            logit_rows: (0..n as u32).collect(),
        };
        m.forward(&step, true, &mut out).unwrap();
        last = out.ids[..n].iter().map(|&i| i as u32).collect();
        lens.iter_mut().for_each(|l| *l += 1);
        steps.push(last.clone());
    }
    steps
}

#[test]
fn fused_attention_steps_replay_as_cuda_graphs() {
    for family in [Family::Llama, Family::Qwen3] {
        let name = family.name();
        let f = model(family);
        let mut eager = Model::load(&f, device(true), options(3 * 16 + 4)).unwrap();
        let want = batch_run(&mut eager);
        let eager_launches = eager.backend().op_counts().unwrap().launches;
        let mut plain = Model::load(&f, device(false), options(3 * 16 + 4)).unwrap();
        assert_eq!(batch_run(&mut plain), want, "{name}: FUSE=3's tokens");
        let plain_launches = plain.backend().op_counts().unwrap().launches;
        assert!(
            eager_launches < plain_launches,
            "{name}: the fused launch is taken ({eager_launches} vs {plain_launches})"
        );
        let mut graphed = Model::load(&f, device(true), options(3 * 16 + 4)).unwrap();
        assert_eq!(graphed.enable_step_graphs(None).unwrap(), Ok(()));
        let got = batch_run(&mut graphed);
        assert_eq!(
            got, want,
            "{name}: greedy tokens with graphs against without"
        );
        assert_eq!(
            graphed.step_graphs_state(),
            Some(Ok(())),
            "{name}: graphs stay on"
        );
        // The first decode step runs and records; the other five replay.
        let replays = graphed.backend().op_counts().unwrap().graph_replays;
        assert_eq!(replays, 5, "{name}: replays");
    }
}

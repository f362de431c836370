//! The CUDA backend's one-launch feed-forward block (`CudaConfig::fold_ffn`, part of
//! `NPU_SERVING_CUDA_FUSE=4`; backends/cuda/src/fold_ffn.rs) through the agent's own model:
//! tiny random-weight llama, llama3 and qwen3 models (Q8_0) run on the CPU emulation of the
//! kernels give the same greedy ids as at `NPU_SERVING_CUDA_FUSE=3`, log-probabilities and
//! logits within a tolerance (the down product's sum is taken in another fixed order, so not bit
//! for bit), the same bits on a second run, and every layer's feed-forward block in one
//! `ffn_fused_*` launch: one launch fewer a layer. Decode steps captured as CUDA graphs and
//! replayed (the emulation's strict capture) give the eager steps' bits with the fold on: the
//! scratch and the reduction's counters (one a group of blocks, one global) stay at fixed
//! addresses and are back at 0 after every launch. Built with the `cuda` and `ascend` features
//! (the emulations' shared test helpers). Nothing here ran on a GPU.

#![cfg(all(feature = "cuda", feature = "ascend"))]

mod common;

use common::devices::cuda;
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, SeqSpan, StepInputs};
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};

fn options() -> ModelOptions {
    ModelOptions {
        max_tokens: 64,
        max_logit_rows: 1,
        num_blocks: 8,
        block_size: 16,
        kv_memory_fraction: None,
    }
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

/// Each greedy step's id and log-probability, each logit step's logits, and for each
/// single-token greedy step its launches, its `ffn_fused_*` launches and its layers (one
/// attention launch a layer at these levels).
#[derive(Debug, PartialEq)]
struct Run {
    picks: Vec<(i32, f32)>,
    logits: Vec<Vec<f32>>,
    decode: Vec<(u64, usize, usize)>,
}

/// A prompt in one step, then 6 greedy single-token steps; then logits along the greedy tokens.
/// `ffn`: the one-launch feed-forward block on top of `NPU_SERVING_CUDA_FUSE=3`.
fn run(file: &GgufFile, ffn: bool) -> Run {
    let mut b = cuda();
    b.set_fuse(true);
    b.set_fold_rope(true);
    b.set_fold_ffn(ffn);
    let mut m = Model::load(file, b, options()).unwrap();
    let prompt = [1u32, 15, 27, 3, 99];
    let mut out = StepOutput::default();
    let mut r = Run {
        picks: Vec::new(),
        logits: Vec::new(),
        decode: Vec::new(),
    };
    let emu = |m: &Model<npu_backend_cuda::CudaBackend>| {
        let e = m.backend().emulation().expect("the emulation");
        let l = e.launched();
        e.clear_launched();
        l
    };
    let (mut pos, mut next) = (0, prompt.to_vec());
    let mut tokens = Vec::new();
    for _ in 0..7 {
        let before = m.backend().op_counts().unwrap().launches;
        emu(&m);
        m.forward(&seq_step(&next, pos), true, &mut out).unwrap();
        let names = emu(&m);
        if next.len() == 1 {
            let n = m.backend().op_counts().unwrap().launches - before;
            let fused = names.iter().filter(|l| l.starts_with("ffn_fused_")).count();
            let layers = names.iter().filter(|l| *l == "attention_f32").count();
            r.decode.push((n, fused, layers));
        }
        pos += next.len();
        r.picks.push((out.ids[0], out.logprobs[0]));
        next = vec![out.ids[0] as u32];
        tokens.push(out.ids[0] as u32);
    }
    let (mut pos, mut next) = (0, prompt.to_vec());
    for &t in &tokens[..3] {
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

/// |a - b| <= tol (1 + |b|) everywhere.
fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
}

fn check(family: Family) {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let bytes = synth::synth_model(family, 1, GgmlType::Q8_0, &donor).unwrap();
    let path = std::env::temp_dir().join(format!(
        "npu-cuda-fused-ffn-{}-{}.gguf",
        family.name(),
        std::process::id()
    ));
    std::fs::write(&path, bytes).unwrap();
    let file = GgufFile::open(&path).unwrap();
    let level3 = run(&file, false);
    let ffn = run(&file, true);
    let again = run(&file, true);
    let _ = std::fs::remove_file(&path);
    let name = family.name();
    let ids = |r: &Run| r.picks.iter().map(|p| p.0).collect::<Vec<_>>();
    assert_eq!(ids(&ffn), ids(&level3), "{name}: greedy ids");
    // f32 activations: the down products' sums in another order move a logit by a few ulps of
    // the largest terms; 1e-4 relative is far above that and far below a wrong block.
    let lp = |r: &Run| r.picks.iter().map(|p| p.1).collect::<Vec<_>>();
    assert!(
        close(&lp(&ffn), &lp(&level3), 1e-4),
        "{name}: log-probabilities {:?} against {:?}",
        lp(&ffn),
        lp(&level3)
    );
    for (a, b) in ffn.logits.iter().zip(&level3.logits) {
        assert!(close(a, b, 1e-4), "{name}: logits off the FUSE=3 ones");
    }
    let bits = |r: &Run| {
        let mut v: Vec<u32> = r.picks.iter().map(|p| p.1.to_bits()).collect();
        v.extend(r.logits.iter().flatten().map(|x| x.to_bits()));
        v
    };
    assert!(bits(&ffn) == bits(&again), "{name}: two runs differ");
    eprintln!(
        "{name}: decode (launches, ffn_fused, layers) FUSE=3 {:?}, with the FFN in one launch {:?}",
        level3.decode, ffn.decode
    );
    for (f, l) in ffn.decode.iter().zip(&level3.decode) {
        let layers = l.2;
        assert!(layers > 0 && f.2 == layers, "{name}: layers {f:?} {l:?}");
        assert_eq!(f.1, layers, "{name}: one ffn_fused launch a layer");
        assert_eq!(l.1, 0, "{name}: no ffn_fused launch at FUSE=3");
        assert_eq!(f.0 + layers as u64, l.0, "{name}: one launch fewer a layer");
    }
}

#[test]
fn one_launch_ffn_answers_as_fuse_3() {
    check(Family::Llama);
    check(Family::Llama3);
    check(Family::Qwen3);
}

/// A prompt, then 6 decode steps, with the FFN fold on, eagerly or as graphs: odd steps read
/// the logits back (a graph ending in the logit rows), even ones pick on the device. Each
/// step's picks (id, log-probability bits) or logits bits, the graph replays, and the
/// `ffn_fused_*` launches the emulation saw.
fn graph_run(file: &GgufFile, graphs: bool) -> (Vec<Vec<u32>>, u64, usize) {
    let mut b = cuda();
    b.set_fuse(true);
    b.set_fold_rope(true);
    b.set_fold_ffn(true);
    let opts = ModelOptions {
        num_blocks: 9,
        ..options()
    };
    let mut m = Model::load(file, b, opts).unwrap();
    if graphs {
        assert_eq!(
            m.enable_step_graphs(None).unwrap(),
            Ok(()),
            "graphs turn on"
        );
    }
    let mut out = StepOutput::default();
    let mut steps = Vec::new();
    let (mut pos, mut next) = (0, vec![1u32, 15, 27, 3, 99]);
    for s in 0..7 {
        let greedy = next.len() > 1 || s % 2 == 0;
        m.forward(&seq_step(&next, pos), greedy, &mut out).unwrap();
        let id = if greedy {
            steps.push(vec![out.ids[0] as u32, out.logprobs[0].to_bits()]);
            out.ids[0] as u32
        } else {
            steps.push(out.logits.iter().map(|v| v.to_bits()).collect());
            let l = &out.logits;
            (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32
        };
        pos += next.len();
        next = vec![id];
    }
    if graphs {
        assert_eq!(m.step_graphs_state(), Some(Ok(())), "graphs stay on");
    }
    let replays = m.backend().op_counts().unwrap().graph_replays;
    let e = m.backend().emulation().expect("the emulation");
    let fused = e
        .launched()
        .iter()
        .filter(|l| l.starts_with("ffn_fused_"))
        .count();
    (steps, replays, fused)
}

#[test]
fn graph_replays_of_the_one_launch_ffn_give_the_eager_bits() {
    for family in [Family::Llama, Family::Qwen3] {
        let donor = GgufFile::open(common::model_path()).unwrap();
        let bytes = synth::synth_model(family, 1, GgmlType::Q8_0, &donor).unwrap();
        let path = std::env::temp_dir().join(format!(
            "npu-cuda-fused-ffn-graphs-{}-{}.gguf",
            family.name(),
            std::process::id()
        ));
        std::fs::write(&path, bytes).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let name = family.name();
        let (eager, eager_replays, eager_fused) = graph_run(&file, false);
        let (graphed, replays, _) = graph_run(&file, true);
        assert!(
            eager_fused > 0,
            "{name}: the eager steps took the one-launch FFN"
        );
        assert_eq!(eager_replays, 0, "{name}");
        // The first decode step of each graph (one ending in the pick, one in the logits)
        // runs and records; the 4 later ones replay.
        assert_eq!(replays, 4, "{name}: graph replays");
        assert!(
            eager == graphed,
            "{name}: graph replays differ from the eager steps"
        );
    }
}

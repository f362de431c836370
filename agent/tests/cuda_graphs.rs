//! Decode steps captured as CUDA graphs and replayed (`npu_serving.graph_capture: auto`) on the
//! CUDA backend over the CPU emulation of its kernels, whose stream capture is strict (recorded
//! work does not run; a synchronization, allocation, free, read back or staging-event wait
//! inside a capture fails; a replay runs the recorded launches with their recorded parameters
//! against memory as it is then): for the tiny random-weight llama and qwen3 models, three
//! sequences of different lengths (a batch padded to the bucket of 4) prefilled eagerly and
//! then decoded together, greedy (on the device every other step, from the logits read back
//! between), the same steps with graphs and without. The tokens must be the same, and the graph
//! model must replay once per decode step after each shape's first (which runs eagerly and
//! records): a replay that did nothing would leave the previous step's answer in the output
//! buffers. Nothing here ran on a GPU. Built with the `cuda` and `ascend` features
//! (the shared device helpers need both).

#![cfg(all(feature = "cuda", feature = "ascend"))]

mod common;

use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, KvDtype, SeqSpan, StepInputs};
use npu_backend_cuda::CudaBackend;
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};

const BLOCK: usize = 16;
const DECODE_STEPS: usize = 6;

thread_local! {
    /// Blocks per sequence's table in this test's thread (each sequence owns blocks
    /// `i * max_blocks() ..`).
    static MAX_BLOCKS: std::cell::Cell<usize> = const { std::cell::Cell::new(4) };
}

fn max_blocks() -> usize {
    MAX_BLOCKS.with(|m| m.get())
}

thread_local! {
    /// The KV cache's type in this test's thread.
    static KV_DTYPE: std::cell::Cell<KvDtype> = const { std::cell::Cell::new(KvDtype::F16) };
}

/// The CUDA emulation with this thread's KV cache type.
fn device() -> CudaBackend {
    let mut b = common::devices::cuda();
    b.set_kv_dtype(KV_DTYPE.with(|k| k.get())).unwrap();
    b
}

fn options() -> ModelOptions {
    ModelOptions {
        max_tokens: 64,
        max_logit_rows: 8,
        num_blocks: 3 * max_blocks() + 4,
        block_size: BLOCK,
        kv_memory_fraction: None,
    }
}

fn table(seq: usize) -> Vec<u32> {
    (0..max_blocks())
        .map(|b| (seq * max_blocks() + b) as u32)
        .collect()
}

fn slot(seq: usize, pos: usize) -> u32 {
    table(seq)[pos / BLOCK] * BLOCK as u32 + (pos % BLOCK) as u32
}

/// Sequence `seq`'s prompt as one eager prefill step; its greedy next token.
fn prefill<B: Backend>(m: &mut Model<B>, seq: usize, prompt: &[u32]) -> u32 {
    let n = prompt.len();
    let step = StepInputs {
        tokens: prompt.to_vec(),
        positions: (0..n as u32).collect(),
        slot_mapping: (0..n).map(|p| slot(seq, p)).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: n as u32,
            start_pos: 0,
        }],
        block_tables: table(seq),
        max_blocks: max_blocks(),
        logit_rows: vec![n as u32 - 1],
    };
    let mut out = StepOutput::default();
    m.forward(&step, true, &mut out).unwrap();
    pick(&out, 0, 1)
}

/// Row `row` of `n`'s greedy pick: the device's, or the first largest logit of the row read
/// back.
fn pick(out: &StepOutput, row: usize, n: usize) -> u32 {
    if out.picked_on_device {
        return out.ids[row] as u32;
    }
    let vocab = out.logits.len() / n;
    let r = &out.logits[row * vocab..(row + 1) * vocab];
    (0..r.len()).fold(0, |b, i| if r[i] > r[b] { i } else { b }) as u32
}

/// Prefills the prompts, then decodes them together `DECODE_STEPS` times: every step's greedy
/// tokens.
fn run<B: Backend>(m: &mut Model<B>, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let mut last: Vec<u32> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| prefill(m, i, p))
        .collect();
    let mut lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    let mut steps = vec![last.clone()];
    let mut out = StepOutput::default();
    for s in 0..DECODE_STEPS {
        // Odd steps read the logits back (a graph ending in the logit rows), even ones pick on
        // the device.
        let greedy = s % 2 == 0;
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
            max_blocks: max_blocks(),
            logit_rows: (0..n as u32).collect(),
        };
        m.forward(&step, greedy, &mut out).unwrap();
        assert_eq!(out.picked_on_device, greedy);
        assert_eq!(out.ids.len() + out.logits.len() / m.cfg.vocab, n);
        last = (0..n).map(|r| pick(&out, r, n)).collect();
        for l in &mut lens {
            *l += 1;
        }
        steps.push(last.clone());
    }
    steps
}

fn model(family: Family) -> GgufFile {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let bytes = synth::synth_model(family, 1, GgmlType::Q8_0, &donor).unwrap();
    // One file per call: tests of one family run in parallel, and each maps its file.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = std::env::temp_dir().join(format!(
        "npu-cuda-graphs-{}-{}-{call}.gguf",
        family.name(),
        std::process::id()
    ));
    std::fs::write(&file, bytes).unwrap();
    let f = GgufFile::open(&file).unwrap();
    let _ = std::fs::remove_file(&file);
    f
}

fn replays(m: &Model<CudaBackend>) -> u64 {
    m.backend().op_counts().unwrap().graph_replays
}

/// Greedy tokens with graphs on and off; (tokens equal, replays, why graphs went off).
fn compare(family: Family) -> (u64, Option<String>) {
    let f = model(family);
    let prompts = vec![
        vec![1u32, 15, 27, 3, 99],
        vec![7u32, 8],
        // 29 positions: its decode steps cross into a second attention tile after the graphs
        // were recorded (a split sized from the recording step's lengths would miss it).
        (40u32..69).collect(),
    ];
    let mut eager = Model::load(&f, device(), options()).unwrap();
    let want = run(&mut eager, &prompts);
    drop(eager);
    let mut graphed = Model::load(&f, device(), options()).unwrap();
    assert_eq!(
        graphed.enable_step_graphs(None).unwrap(),
        Ok(()),
        "{}: graphs turn on",
        family.name()
    );
    assert_eq!(
        graphed.opts.num_blocks,
        options().num_blocks - 1,
        "one block kept for padding"
    );
    let got = run(&mut graphed, &prompts);
    assert_eq!(
        got,
        want,
        "{}: greedy tokens with graphs against without",
        family.name()
    );
    let off = graphed
        .step_graphs_state()
        .expect("turned on")
        .err()
        .map(str::to_string);
    (replays(&graphed), off)
}

#[test]
fn captured_decode_steps_match_eager_ones_on_the_cuda_emulation() {
    for family in [Family::Llama, Family::Qwen3] {
        let (replays, off) = compare(family);
        assert_eq!(off, None, "{}: graphs stay on", family.name());
        // The first decode step of each graph (batch 3 in the bucket of 4, 4-block tables; one
        // ending in the greedy pick, one in the logits) runs and records; every later one
        // replays.
        assert_eq!(replays, DECODE_STEPS as u64 - 2, "{}", family.name());
    }
}

/// Tables 16 blocks wide (256 positions, 8 attention tiles): the graph's attention splits each
/// sequence's context in two (the split comes from the table width, the lengths from the
/// device), where the eager steps of these short sequences run one split. The greedy tokens
/// are the same.
#[test]
fn wide_tables_split_attention_in_the_graph_and_match_eager_steps() {
    MAX_BLOCKS.with(|m| m.set(16));
    let (replays, off) = compare(Family::Llama);
    assert_eq!(off, None);
    assert_eq!(replays, DECODE_STEPS as u64 - 2);
}

/// With the int8 KV cache (`kv_cache_dtype: int8`): its writes and attention read lengths from
/// the step inputs too, so the graphs give the eager int8 steps' tokens.
#[test]
fn int8_kv_cache_steps_replay_with_the_eager_tokens() {
    KV_DTYPE.with(|k| k.set(KvDtype::Int8));
    let (replays, off) = compare(Family::Llama);
    assert_eq!(off, None);
    assert_eq!(replays, DECODE_STEPS as u64 - 2);
}

/// Qwen3-MoE's expert FFN allocates its routing plan per call on this backend: inside a
/// capture that is refused (the capture invalidated), so graphs turn off by name and its steps
/// stay eager, with the eager tokens.
#[test]
fn moe_steps_that_cannot_be_recorded_turn_graphs_off_by_name() {
    let (replays, off) = compare(Family::Qwen3Moe);
    eprintln!("qwen3moe: replays {replays}, graphs off: {off:?}");
    let off = off.expect("qwen3moe's expert FFN allocates: its step cannot be recorded");
    assert_eq!(replays, 0);
    assert!(off.contains("recording the decode step"), "{off}");
    assert!(off.contains("capturing"), "{off}");
}

/// A backend that records the step's input copy into the graph (from the pinned staging ring,
/// as every upload goes) replays the copy of the step it was captured at, over the inputs
/// `begin_graph_step` wrote: the emulation reads the pinned buffer when the replay runs, as a
/// captured `cuMemcpyHtoDAsync` does, so the tokens go wrong. The emulation must catch it.
#[test]
fn a_recorded_input_copy_is_caught_by_the_emulation() {
    let f = model(Family::Llama);
    let prompts = vec![
        vec![1u32, 15, 27, 3, 99],
        vec![7u32, 8],
        vec![40u32, 41, 42],
    ];
    let mut eager = Model::load(&f, device(), options()).unwrap();
    let want = run(&mut eager, &prompts);
    drop(eager);
    let mut wrong = Model::load(&f, device(), options()).unwrap();
    wrong.backend_mut().record_input_copies(true);
    assert_eq!(wrong.enable_step_graphs(None).unwrap(), Ok(()));
    let got = run(&mut wrong, &prompts);
    assert!(replays(&wrong) > 0, "the wrong graphs were replayed");
    assert_ne!(
        got, want,
        "a graph copying stale step inputs at replay gave the eager tokens"
    );
}

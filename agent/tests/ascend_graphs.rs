//! Decode steps captured as ACL graphs and replayed (`npu_serving.graph_capture: auto`) on the
//! Ascend backend over the strict CANN emulation (which refuses a synchronization, allocation,
//! memset or read back inside a capture, and replays against the addresses recorded): for the
//! tiny random-weight llama, qwen3 and qwen3moe models, five sequences of different lengths
//! (a batch padded to the bucket of 8: three padded rows, which must write three distinct
//! slots, as ScatterPaKvCache refuses a slot written twice) prefilled eagerly and then decoded together, greedy (on
//! the device every other step, from the logits read back between), the same steps with graphs
//! and without. The tokens must be the same, and the graph model
//! must replay once per decode step after each shape's first (which runs eagerly and records).
//! Qwen3-MoE's experts (the synth file's Q8_0, loaded as f16 stacks) run as one grouped matmul
//! per projection with nothing read back, so its decode steps record and replay too.
//! Built with the `cuda` and `ascend` features (the shared device helpers need both).

#![cfg(all(feature = "cuda", feature = "ascend"))]

mod common;

use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, SeqSpan, StepInputs};
use npu_backend_ascend::AscendBackend;
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};

const BLOCK: usize = 16;
/// Blocks per sequence's table (each sequence owns blocks `i * MAX_BLOCKS ..`).
const MAX_BLOCKS: usize = 4;
const DECODE_STEPS: usize = 6;

fn options() -> ModelOptions {
    ModelOptions {
        max_tokens: 64,
        max_logit_rows: 8,
        num_blocks: 24,
        block_size: BLOCK,
        kv_memory_fraction: None,
    }
}

fn table(seq: usize) -> Vec<u32> {
    (0..MAX_BLOCKS)
        .map(|b| (seq * MAX_BLOCKS + b) as u32)
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
        max_blocks: MAX_BLOCKS,
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
            max_blocks: MAX_BLOCKS,
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
    let file = std::env::temp_dir().join(format!(
        "npu-ascend-graphs-{}-{}.gguf",
        family.name(),
        std::process::id()
    ));
    std::fs::write(&file, bytes).unwrap();
    let f = GgufFile::open(&file).unwrap();
    let _ = std::fs::remove_file(&file);
    f
}

fn replays(m: &Model<AscendBackend>) -> u64 {
    m.backend().op_counts().unwrap().graph_replays
}

/// Greedy tokens with graphs on and off; (tokens equal, replays, why graphs went off).
fn compare(family: Family) -> (u64, Option<String>) {
    let f = model(family);
    let prompts = vec![
        vec![1u32, 15, 27, 3, 99],
        vec![7u32, 8],
        vec![
            40u32, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57,
        ],
        vec![3u32, 5, 8],
        vec![200u32],
    ];
    let mut eager = Model::load(&f, common::devices::ascend(), options()).unwrap();
    let want = run(&mut eager, &prompts);
    drop(eager);
    let mut graphed = Model::load(&f, common::devices::ascend(), options()).unwrap();
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
fn captured_decode_steps_match_eager_ones_on_the_ascend_emulation() {
    for family in [Family::Llama, Family::Qwen3] {
        let (replays, off) = compare(family);
        assert_eq!(off, None, "{}: graphs stay on", family.name());
        // The first decode step of each graph (batch 5 in the bucket of 8: three padded rows,
        // each writing a slot of its own, which ScatterPaKvCache requires; 4-block tables; one
        // ending in the greedy pick, one in the logits) runs and records; every later one
        // replays.
        assert_eq!(replays, DECODE_STEPS as u64 - 2, "{}", family.name());
    }
}

#[test]
fn moe_decode_steps_with_grouped_experts_record_and_replay() {
    // The synth file's Q8_0 experts load as f16 stacks (`load_experts`): one GroupedMatmulV4
    // per projection, nothing read back, so the step records like the dense families'.
    let (replays, off) = compare(Family::Qwen3Moe);
    assert_eq!(off, None, "qwen3moe: graphs stay on");
    assert_eq!(replays, DECODE_STEPS as u64 - 2, "qwen3moe");
}

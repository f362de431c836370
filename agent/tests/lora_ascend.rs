//! Multi-LoRA on the Ascend backend over the strict CANN emulation (`common::devices::ascend`,
//! f16 activations; backends/ascend/src/backend/lora_ops.rs: Matmul, Matmul and InplaceAdd per
//! adapter group): two PEFT adapters (rank 16 f32 on every projection, rank 8 bf16 rsLoRA on
//! attention) and the base model in one batch, every step. Teacher-forced along the CPU
//! backend's greedy tokens for the same model and adapters, every device logit lies within the
//! f16 margin (`act_margin` of the device's own logits) of the CPU backend's, and the device's
//! top-1 is the CPU backend's token at every step the CPU backend decides by more than that
//! margin; the adapters move the logits by far more than the margin (else the check proves
//! nothing) and change the device's own greedy tokens. With decode graphs on, steps with adapter
//! rows run eagerly and give the same tokens. Nothing here ran on an NPU. Built with the `cuda`
//! and `ascend` features (the shared device helpers need both).

#![cfg(all(feature = "cuda", feature = "ascend"))]

mod common;

use std::path::PathBuf;

use common::devices::{act_margin, ascend};
use npu_agent::model::lora::adapter::read_peft;
use npu_agent::model::lora::synth::{write_peft, SynthAdapter};
use npu_agent::model::lora::{HostAdapter, Target};
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, DType, SeqSpan, StepInputs};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};

const BLOCK: u32 = 16;
const BLOCKS_PER_SEQ: u32 = 4;
const STEPS: usize = 8;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("npu-lora-ascend-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn options() -> ModelOptions {
    ModelOptions {
        max_tokens: 256,
        max_logit_rows: 8,
        num_blocks: (8 * BLOCKS_PER_SEQ) as usize,
        block_size: BLOCK as usize,
        kv_memory_fraction: None,
    }
}

/// Per prompt: the picked tokens and each step's logits.
type Run = Vec<(Vec<u32>, Vec<Vec<f32>>)>;

/// Greedy generation of every prompt in one batch: prompt `i` on adapter slot `slots[i]` (0:
/// base). With `forced`, step `s > 0` feeds prompt `i` the token `forced[i].0[s - 1]` instead of
/// its own pick (teacher forcing).
fn generate<B: Backend>(
    model: &mut Model<B>,
    prompts: &[Vec<u32>],
    slots: &[u16],
    forced: Option<&Run>,
) -> Run {
    let vocab = model.cfg.vocab;
    let mut res: Run = vec![(Vec::new(), Vec::new()); prompts.len()];
    let mut out = StepOutput::default();
    for step in 0..STEPS {
        let mut s = StepInputs {
            max_blocks: BLOCKS_PER_SEQ as usize,
            ..StepInputs::default()
        };
        let mut per_token = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let (start, toks): (u32, Vec<u32>) = if step == 0 {
                (0, p.clone())
            } else {
                let prev = forced.unwrap_or(&res)[i].0[step - 1];
                ((p.len() + step - 1) as u32, vec![prev])
            };
            let row0 = s.tokens.len() as u32;
            let table: Vec<u32> = (0..BLOCKS_PER_SEQ)
                .map(|b| i as u32 * BLOCKS_PER_SEQ + b)
                .collect();
            for (k, &tok) in toks.iter().enumerate() {
                let pos = start + k as u32;
                s.tokens.push(tok);
                s.positions.push(pos);
                s.slot_mapping
                    .push(table[(pos / BLOCK) as usize] * BLOCK + pos % BLOCK);
                per_token.push(slots[i]);
            }
            s.seqs.push(SeqSpan {
                q_row: row0,
                n_q: toks.len() as u32,
                start_pos: start,
            });
            s.block_tables.extend(&table);
            s.logit_rows.push(row0 + toks.len() as u32 - 1);
        }
        model.set_step_lora(&per_token, s.tokens.len()).unwrap();
        model.forward(&s, false, &mut out).unwrap();
        for (i, row) in out.logits.chunks(vocab).enumerate() {
            res[i].0.push(argmax(row) as u32);
            res[i].1.push(row.to_vec());
        }
    }
    res
}

/// The first index of the largest value (as the device's greedy pick breaks ties).
fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b })
}

/// The top-1/top-2 gap of a row.
fn top_gap(row: &[f32]) -> f32 {
    let b = argmax(row);
    let second = (0..row.len())
        .filter(|&i| i != b)
        .fold(f32::NEG_INFINITY, |m, i| m.max(row[i]));
    row[b] - second
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Two adapter slots filled.
fn fill<B: Backend>(m: &mut Model<B>, a: &HostAdapter, b: &HostAdapter) {
    m.enable_lora(2, 16).unwrap();
    m.load_lora(0, a).unwrap();
    m.load_lora(1, b).unwrap();
}

#[test]
fn two_adapters_and_the_base_in_one_batch_follow_the_cpu_backend() {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let bytes = synth::synth_model(Family::Llama, 7, GgmlType::F32, &donor).unwrap();
    let file = GgufFile::from_bytes("base.gguf", &bytes).unwrap();
    let mut cpu = Model::load(
        &file,
        CpuBackend::new(CpuConfig {
            threads: 2,
            f32_reference: false,
        }),
        options(),
    )
    .unwrap();
    let mut dev = Model::load(&file, ascend(), options()).unwrap();
    let act = DType::F16;
    let cfg = cpu.cfg.clone();

    let dir = TempDir::new("two");
    let (ad1, ad2) = (dir.0.join("ad1"), dir.0.join("ad2"));
    let spec1 = SynthAdapter {
        rank: 16,
        alpha: 32.0,
        use_rslora: false,
        targets: Target::ALL.to_vec(),
        seed: 21,
        a_range: 0.15,
        b_range: 0.15,
        bf16: false,
    };
    let spec2 = SynthAdapter {
        rank: 8,
        alpha: 8.0,
        use_rslora: true,
        targets: vec![Target::Q, Target::K, Target::V, Target::O],
        seed: 22,
        a_range: 0.2,
        b_range: 0.2,
        bf16: true,
    };
    write_peft(&ad1, &cfg, &spec1).unwrap();
    write_peft(&ad2, &cfg, &spec2).unwrap();
    let host1 = read_peft(&ad1, &cfg, 16).unwrap();
    let host2 = read_peft(&ad2, &cfg, 16).unwrap();
    assert!(!host1.all_bf16 && host2.all_bf16);
    fill(&mut cpu, &host1, &host2);
    fill(&mut dev, &host1, &host2);

    let prompts: Vec<Vec<u32>> = vec![
        vec![1, 504, 2116, 314, 4649, 314],
        vec![1, 1073, 7385, 28, 5248],
        vec![1, 36, 9410, 3937, 30, 216, 77, 5],
        vec![1, 6431, 42, 9000],
    ];
    // One batch: base, adapter 1, adapter 2, adapter 1 again (two runs of the same slot).
    let slots = [0u16, 1, 2, 1];
    let want = generate(&mut cpu, &prompts, &slots, None);
    let cpu_base = generate(&mut cpu, &prompts, &[0; 4], Some(&want));
    let forced = generate(&mut dev, &prompts, &slots, Some(&want));
    let mut decided = 0;
    for (i, &slot) in slots.iter().enumerate() {
        let (mut worst, mut effect) = (0f32, 0f32);
        for s in 0..STEPS {
            let (d, c) = (&forced[i].1[s], &want[i].1[s]);
            let margin = act_margin(act, d);
            let diff = max_diff(d, c);
            worst = worst.max(diff / margin);
            assert!(
                diff < margin,
                "prompt {i} on slot {slot}, step {s}: a logit {diff} from the CPU backend's \
                 (margin {margin})"
            );
            if top_gap(c) >= margin {
                decided += 1;
                assert_eq!(
                    forced[i].0[s],
                    want[i].0[s],
                    "prompt {i} on slot {slot}, step {s}: top-1 differs where the CPU backend \
                     decides by {} (margin {margin})",
                    top_gap(c)
                );
            }
            effect = effect.max(max_diff(c, &cpu_base[i].1[s]) / margin);
        }
        eprintln!(
            "prompt {i} on slot {slot}: largest logit difference {worst:.3} of the f16 margin; \
             the adapter moves a logit by up to {effect:.1} margins; tokens {:?}",
            want[i].0
        );
        if slot == 0 {
            assert_eq!(
                effect, 0.0,
                "prompt {i}: the base rows' logits are the base model's"
            );
        } else {
            assert!(
                effect > 4.0,
                "prompt {i}: adapter slot {slot} moves the logits by only {effect} margins"
            );
        }
    }
    eprintln!(
        "{decided} of {} steps decided beyond the f16 margin",
        4 * STEPS
    );
    assert!(
        decided >= 2 * STEPS,
        "only {decided} steps decided beyond the f16 margin"
    );

    // Free-running on the device: the adapters change the tokens; the base row is the base
    // model's in the mixed batch too.
    let got = generate(&mut dev, &prompts, &slots, None);
    let base = generate(&mut dev, &prompts, &[0; 4], None);
    for (i, &slot) in slots.iter().enumerate().skip(1) {
        assert_ne!(
            got[i].0, base[i].0,
            "prompt {i}: adapter slot {slot} gives the base model's tokens on the device"
        );
    }
    assert_eq!(got[0].0, base[0].0);

    // With decode graphs on, steps with adapter rows stay eager (a graph would replay without
    // the adapters), and base-only decode steps still replay graphs.
    let mut graphed = Model::load(&file, ascend(), options()).unwrap();
    graphed.enable_step_graphs(Some(&[4])).unwrap().unwrap();
    fill(&mut graphed, &host1, &host2);
    let g = generate(&mut graphed, &prompts, &slots, None);
    let gb = generate(&mut graphed, &prompts, &[0; 4], None);
    for i in 0..prompts.len() {
        assert_eq!(g[i].0, got[i].0, "prompt {i}: graphs on, adapters mixed");
        assert_eq!(gb[i].0, base[i].0, "prompt {i}: graphs on, base only");
    }
    assert!(
        matches!(graphed.step_graphs_state(), Some(Ok(()))),
        "graphs stay on: {:?}",
        graphed.step_graphs_state()
    );
}

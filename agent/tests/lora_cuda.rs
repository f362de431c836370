//! Multi-LoRA on the CUDA backend over the CPU emulation of its kernels (kernels/lora.cu): two
//! PEFT adapters and the base model in one batch, every step, give the CPU backend's greedy
//! tokens for the same model and adapters, up to near-ties; and the adapters change the tokens
//! (else the check proves nothing). With decode graphs on, steps with adapter rows run eagerly
//! and give the same tokens. The CPU backend's own fidelity against merged models is
//! tests/lora.rs. Built with the `cuda` feature; nothing here ran on a GPU.

#![cfg(feature = "cuda")]

mod common;

use std::path::PathBuf;

use npu_agent::model::lora::adapter::read_peft;
use npu_agent::model::lora::synth::{write_peft, SynthAdapter};
use npu_agent::model::lora::Target;
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, DType, SeqSpan, StepInputs};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_backend_cuda::{CudaBackend, CudaConfig, MatmulMode};
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};

const BLOCK: u32 = 16;
const BLOCKS_PER_SEQ: u32 = 4;
/// A step whose top two logits are closer than this may pick either.
const NEAR_TIE: f32 = 0.05;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("npu-lora-cuda-{}-{name}", std::process::id()));
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

fn cuda() -> CudaBackend {
    CudaBackend::emulated(CudaConfig {
        act_dtype: DType::F32,
        matmul: MatmulMode::Auto,
        gemv_max_rows: 8,
        kernel_cache: None,
        lib_dirs: Vec::new(),
        int8_mma: true,
        fuse: true,
        fold_gemv: true,
        fold_rope: false,
        fold_ffn: false,
        fold_attn_out: false,
        kquants: npu_backend_cuda::KQuants::F16,
    })
    .expect("the CUDA emulation opens (a C++ compiler is needed)")
}

/// Greedy generation of every prompt in one batch: prompt `i` on adapter slot `slots[i]`
/// (0: base). Per prompt: the picked tokens and each step's top-1/top-2 gap.
fn generate<B: Backend>(
    model: &mut Model<B>,
    prompts: &[Vec<u32>],
    slots: &[u16],
    steps: usize,
) -> Vec<(Vec<u32>, Vec<f32>)> {
    let vocab = model.cfg.vocab;
    let mut res: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); prompts.len()];
    let mut out = StepOutput::default();
    for step in 0..steps {
        let mut s = StepInputs {
            max_blocks: BLOCKS_PER_SEQ as usize,
            ..StepInputs::default()
        };
        let mut per_token = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let (start, toks): (u32, Vec<u32>) = if step == 0 {
                (0, p.clone())
            } else {
                ((p.len() + step - 1) as u32, vec![*res[i].0.last().unwrap()])
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
            let mut best = (0usize, f32::NEG_INFINITY);
            let mut second = f32::NEG_INFINITY;
            for (j, &v) in row.iter().enumerate() {
                if v > best.1 {
                    second = best.1;
                    best = (j, v);
                } else if v > second {
                    second = v;
                }
            }
            res[i].0.push(best.0 as u32);
            res[i].1.push(best.1 - second);
        }
    }
    res
}

/// Asserts `got` follows `want` up to the first near-tie of either; returns the steps compared.
fn agree(what: &str, got: &(Vec<u32>, Vec<f32>), want: &(Vec<u32>, Vec<f32>)) -> usize {
    for i in 0..want.0.len() {
        if got.0[i] != want.0[i] {
            assert!(
                want.1[i] < NEAR_TIE || got.1[i] < NEAR_TIE,
                "{what}: step {i} picked {} where the CPU backend picks {} (gaps {} and {}); \
                 tokens {:?} vs {:?}",
                got.0[i],
                want.0[i],
                got.1[i],
                want.1[i],
                got.0,
                want.0
            );
            return i;
        }
        if got.1[i] < NEAR_TIE || want.1[i] < NEAR_TIE {
            return i + 1;
        }
    }
    want.0.len()
}

#[test]
fn two_adapters_and_the_base_in_one_batch_give_the_cpu_backends_tokens() {
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
    let mut dev = Model::load(&file, cuda(), options()).unwrap();
    let cfg = cpu.cfg.clone();

    // Adapter 1: every projection, rank 16, f32; adapter 2: attention only, rank 8, rsLoRA,
    // bf16 (kept in bf16 on the device).
    let dir = TempDir::new("two");
    let (ad1, ad2) = (dir.0.join("ad1"), dir.0.join("ad2"));
    let spec1 = SynthAdapter {
        rank: 16,
        alpha: 32.0,
        use_rslora: false,
        targets: Target::ALL.to_vec(),
        seed: 21,
        a_range: 0.3,
        b_range: 0.3,
        bf16: false,
    };
    let spec2 = SynthAdapter {
        rank: 8,
        alpha: 8.0,
        use_rslora: true,
        targets: vec![Target::Q, Target::K, Target::V, Target::O],
        seed: 22,
        a_range: 0.4,
        b_range: 0.4,
        bf16: true,
    };
    write_peft(&ad1, &cfg, &spec1).unwrap();
    write_peft(&ad2, &cfg, &spec2).unwrap();
    let host1 = read_peft(&ad1, &cfg, 16).unwrap();
    let host2 = read_peft(&ad2, &cfg, 16).unwrap();
    assert!(!host1.all_bf16 && host2.all_bf16);
    for m in [&mut cpu as &mut dyn LoraModel, &mut dev] {
        m.slots(&host1, &host2);
    }

    let prompts: Vec<Vec<u32>> = vec![
        vec![1, 504, 2116, 314, 4649, 314],
        vec![1, 1073, 7385, 28, 5248],
        vec![1, 36, 9410, 3937, 30, 216, 77, 5],
        vec![1, 6431, 42, 9000],
    ];
    let steps = 8;
    // One batch: base, adapter 1, adapter 2, adapter 1 again (two runs of the same slot).
    let slots = [0u16, 1, 2, 1];
    let want = generate(&mut cpu, &prompts, &slots, steps);
    let got = generate(&mut dev, &prompts, &slots, steps);
    let base = generate(&mut dev, &prompts, &[0, 0, 0, 0], steps);
    let mut compared = 0;
    for (i, &slot) in slots.iter().enumerate() {
        let n = agree(&format!("prompt {i} on slot {slot}"), &got[i], &want[i]);
        eprintln!(
            "prompt {i} on slot {slot}: {n} of {steps} steps compared, tokens {:?}",
            got[i].0
        );
        compared += n;
    }
    assert!(
        compared >= 3 * steps,
        "only {compared} steps compared before near-ties"
    );
    for (i, &slot) in slots.iter().enumerate().skip(1) {
        assert_ne!(
            got[i].0, base[i].0,
            "prompt {i}: adapter slot {slot} gives the base model's tokens on the device"
        );
    }
    // The base prompt is the base model's in the mixed batch too.
    assert_eq!(got[0].0, base[0].0);

    // With decode graphs on, steps with adapter rows stay eager (a graph would replay without
    // the adapters: the base model's tokens), and base-only decode steps still replay graphs.
    let mut graphed = Model::load(&file, cuda(), options()).unwrap();
    graphed.enable_step_graphs(Some(&[4])).unwrap().unwrap();
    graphed.slots(&host1, &host2);
    let g = generate(&mut graphed, &prompts, &slots, steps);
    let gb = generate(&mut graphed, &prompts, &[0, 0, 0, 0], steps);
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

/// Two adapter slots filled, on either backend's model.
trait LoraModel {
    fn slots(
        &mut self,
        a: &npu_agent::model::lora::HostAdapter,
        b: &npu_agent::model::lora::HostAdapter,
    );
}

impl<B: Backend> LoraModel for Model<B> {
    fn slots(
        &mut self,
        a: &npu_agent::model::lora::HostAdapter,
        b: &npu_agent::model::lora::HostAdapter,
    ) {
        self.enable_lora(2, 16).unwrap();
        self.load_lora(0, a).unwrap();
        self.load_lora(1, b).unwrap();
    }
}

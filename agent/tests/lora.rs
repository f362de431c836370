//! Multi-LoRA fidelity on real files: random PEFT adapters for a random-weight Llama model,
//! applied at run time (two adapters and the base model in one batch, every step), give the
//! greedy tokens of the adapters merged into the weights (`W + scale * B A`, written as new
//! model files), up to near-ties. One merge is made in the engine's row order (GGUF); the
//! other in Hugging Face's order on the model's safetensors twin, read back through the
//! checkpoint loader, so the adapter reader's Llama Q/K row permutation is checked against the
//! loader's own. Also: what the adapter reader refuses, by name.

mod common;

use std::path::{Path, PathBuf};

use npu_agent::cli::synth_hf::{write_hf_twin, HfDtype};
use npu_agent::model::lora::adapter::read_peft;
use npu_agent::model::lora::merge::merge_into_gguf;
use npu_agent::model::lora::synth::{write_peft, SynthAdapter};
use npu_agent::model::lora::Target;
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{SeqSpan, StepInputs};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::synth::{self, Family};
use npu_gguf::{GgmlType, GgufFile};
use npu_model::Checkpoint;

const BLOCK: u32 = 16;
const BLOCKS_PER_SEQ: u32 = 4;
/// A step whose top two logits are closer than this may pick either.
const NEAR_TIE: f32 = 0.05;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("npu-lora-{}-{name}", std::process::id()));
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

fn backend() -> CpuBackend {
    CpuBackend::new(CpuConfig {
        threads: 2,
        f32_reference: false,
    })
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

/// Greedy generation of every prompt in one batch: prompt `i` on adapter slot `slots[i]`
/// (0: base). Per prompt: the picked tokens and each step's top-1/top-2 gap.
fn generate(
    model: &mut Model<CpuBackend>,
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
                let last = *res[i].0.last().unwrap();
                ((p.len() + step - 1) as u32, vec![last])
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
            let (top, gap) = top2(row);
            res[i].0.push(top);
            res[i].1.push(gap);
        }
    }
    res
}

fn top2(row: &[f32]) -> (u32, f32) {
    let mut best = (0usize, f32::NEG_INFINITY);
    let mut second = f32::NEG_INFINITY;
    for (i, &v) in row.iter().enumerate() {
        if v > best.1 {
            second = best.1;
            best = (i, v);
        } else if v > second {
            second = v;
        }
    }
    (best.0 as u32, best.1 - second)
}

/// Asserts `got` follows `want` up to the first near-tie of either (then stops comparing).
/// Returns the steps compared.
fn agree(what: &str, got: &(Vec<u32>, Vec<f32>), want: &(Vec<u32>, Vec<f32>)) -> usize {
    for i in 0..want.0.len() {
        if got.0[i] != want.0[i] {
            assert!(
                want.1[i] < NEAR_TIE || got.1[i] < NEAR_TIE,
                "{what}: step {i} picked {} where the merged model picks {} (gaps {} and {}); \
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

fn read_f32_safetensors(path: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    npu_hf::parse("x.safetensors", &bytes, 0)
        .unwrap()
        .into_iter()
        .map(|m| {
            let raw = &bytes[m.start..m.end];
            let v = match m.dtype {
                npu_hf::Dtype::F32 => raw
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
                npu_hf::Dtype::BF16 => raw
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                other => panic!("{}: {other}", m.name),
            };
            (m.name, m.shape, v)
        })
        .collect()
}

/// Merges a PEFT adapter into a Hugging Face model directory's `model.safetensors` in Hugging
/// Face's own row order, straight from the adapter's files (none of the engine's adapter code).
fn merge_hf(model_dir: &Path, adapter_dir: &Path, scale: f32) {
    let st = model_dir.join("model.safetensors");
    let mut model = read_f32_safetensors(&st);
    let ad = read_f32_safetensors(&adapter_dir.join("adapter_model.safetensors"));
    let mut merged = 0;
    for (name, shape, w) in model.iter_mut() {
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        let a_name = format!("base_model.model.{stem}.lora_A.weight");
        let b_name = format!("base_model.model.{stem}.lora_B.weight");
        let (Some(a), Some(b)) = (
            ad.iter().find(|t| t.0 == a_name),
            ad.iter().find(|t| t.0 == b_name),
        ) else {
            continue;
        };
        let (n_out, n_in, r) = (shape[0], shape[1], a.1[0]);
        for o in 0..n_out {
            for i in 0..n_in {
                let d: f32 = (0..r).map(|k| b.2[o * r + k] * a.2[k * n_in + i]).sum();
                w[o * n_in + i] += scale * d;
            }
        }
        merged += 1;
    }
    assert!(merged > 0, "nothing merged");
    let views: Vec<npu_hf::WriteTensor> = model
        .iter()
        .map(|(name, shape, v)| npu_hf::WriteTensor {
            name,
            dtype: npu_hf::Dtype::F32,
            shape,
            data: bytemuck_f32(v),
        })
        .collect();
    npu_hf::write_file(&st, &views, &[("format", "pt")]).unwrap();
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern of it is readable as bytes; the slice
    // covers exactly the vector's initialised elements, and u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

#[test]
fn two_adapters_and_the_base_in_one_batch_match_their_merged_models() {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let bytes = synth::synth_model(Family::Llama, 7, GgmlType::F32, &donor).unwrap();
    let dir = TempDir::new("two");
    let base_path = dir.0.join("base.gguf");
    std::fs::write(&base_path, &bytes).unwrap();
    let base_file = GgufFile::open(&base_path).unwrap();
    let mut model = Model::load(&base_file, backend(), options()).unwrap();
    let cfg = model.cfg.clone();

    // Adapter 1: every projection, plain scale, f32; adapter 2: attention only, rsLoRA, bf16
    // (kept in bf16 on the backend).
    let ad1 = dir.0.join("ad1");
    let ad2 = dir.0.join("ad2");
    let spec1 = SynthAdapter {
        rank: 8,
        alpha: 16.0,
        use_rslora: false,
        targets: Target::ALL.to_vec(),
        seed: 11,
        a_range: 0.3,
        b_range: 0.3,
        bf16: false,
    };
    let spec2 = SynthAdapter {
        rank: 4,
        alpha: 8.0,
        use_rslora: true,
        targets: vec![Target::Q, Target::K, Target::V, Target::O],
        seed: 12,
        a_range: 0.4,
        b_range: 0.4,
        bf16: true,
    };
    write_peft(&ad1, &cfg, &spec1).unwrap();
    write_peft(&ad2, &cfg, &spec2).unwrap();
    let host1 = read_peft(&ad1, &cfg, 16).unwrap();
    let host2 = read_peft(&ad2, &cfg, 16).unwrap();
    assert_eq!(host1.scale, 2.0);
    assert_eq!(host2.scale, 8.0 / 2.0, "rsLoRA: alpha / sqrt(r)");
    assert!(!host1.all_bf16 && host2.all_bf16);

    // The merged models: adapter 1 in GGUF (engine order), adapter 2 in Hugging Face order
    // through the safetensors twin and the checkpoint loader.
    let merged1 = dir.0.join("merged1.gguf");
    merge_into_gguf(&base_file, &host1, &merged1).unwrap();
    let twin = dir.0.join("merged2-hf");
    write_hf_twin(&base_file, &twin, HfDtype::F32, None).unwrap();
    merge_hf(&twin, &ad2, host2.scale);

    let prompts: Vec<Vec<u32>> = vec![
        vec![1, 504, 2116, 314, 4649, 314],
        vec![1, 1073, 7385, 28, 5248],
        vec![1, 36, 9410, 3937, 30, 216, 77, 5],
        vec![1, 6431, 42, 9000],
    ];
    let steps = 12;
    model.enable_lora(2, 16).unwrap();
    model.load_lora(0, &host1).unwrap();
    model.load_lora(1, &host2).unwrap();
    // One batch: base, adapter 1, adapter 2, adapter 1 again (two runs of the same slot).
    let slots = [0u16, 1, 2, 1];
    let mixed = generate(&mut model, &prompts, &slots, steps);

    let alone = |m: &mut Model<CpuBackend>| generate(m, &prompts, &[0, 0, 0, 0], steps);
    let base = alone(&mut model);
    let mut m1 = Model::load(&GgufFile::open(&merged1).unwrap(), backend(), options()).unwrap();
    let want1 = alone(&mut m1);
    let ck2 = Checkpoint::open(&twin).unwrap();
    let mut m2 = Model::load_checkpoint(&ck2, backend(), options(), None).unwrap();
    let want2 = alone(&mut m2);

    let mut compared = 0;
    for (i, &slot) in slots.iter().enumerate() {
        let (what, want) = match slot {
            0 => ("base", &base[i]),
            1 => ("adapter 1 (GGUF merge)", &want1[i]),
            _ => ("adapter 2 (Hugging Face merge)", &want2[i]),
        };
        let n = agree(&format!("prompt {i} on {what}"), &mixed[i], want);
        eprintln!(
            "prompt {i} on {what}: {n} of {steps} steps compared, tokens {:?}",
            mixed[i].0
        );
        compared += n;
    }
    assert!(
        compared >= 3 * steps,
        "only {compared} steps compared before near-ties"
    );
    // The adapters change the model (else the check above proves nothing).
    for (i, &slot) in slots.iter().enumerate().skip(1) {
        assert_ne!(
            mixed[i].0, base[i].0,
            "prompt {i}: adapter slot {slot} gives the base model's tokens"
        );
    }
    // A step without adapters after adapter steps is the base model again.
    assert_eq!(alone(&mut model)[0].0, base[0].0);
}

#[test]
fn bad_adapters_are_refused_by_name() {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let bytes = synth::synth_model(Family::Llama, 7, GgmlType::F32, &donor).unwrap();
    let gguf = GgufFile::from_bytes("m.gguf", &bytes).unwrap();
    let cfg = Checkpoint::from(&gguf).config().unwrap();
    let dir = TempDir::new("bad");
    let spec = SynthAdapter {
        rank: 32,
        alpha: 16.0,
        use_rslora: false,
        targets: vec![Target::Q],
        seed: 1,
        a_range: 0.1,
        b_range: 0.1,
        bf16: false,
    };
    let ad = dir.0.join("r32");
    write_peft(&ad, &cfg, &spec).unwrap();
    let e = read_peft(&ad, &cfg, 16).unwrap_err().to_string();
    assert!(e.contains("max_lora_rank"), "{e}");

    let conf = ad.join("adapter_config.json");
    let text = std::fs::read_to_string(&conf).unwrap();
    std::fs::write(&conf, text.replace("\"q_proj\"", "\"lm_head\"")).unwrap();
    let e = read_peft(&ad, &cfg, 64).unwrap_err().to_string();
    assert!(e.contains("\"lm_head\""), "{e}");
    std::fs::write(
        &conf,
        text.replace("\"use_dora\": false", "\"use_dora\": true"),
    )
    .unwrap();
    let e = read_peft(&ad, &cfg, 64).unwrap_err().to_string();
    assert!(e.contains("use_dora"), "{e}");

    // An adapter made for another shape.
    let mut other = cfg.clone();
    other.hidden *= 2;
    let ad2 = dir.0.join("wide");
    write_peft(&ad2, &other, &SynthAdapter { rank: 4, ..spec }).unwrap();
    let e = read_peft(&ad2, &cfg, 64).unwrap_err().to_string();
    assert!(e.contains("q_proj") && e.contains("needs"), "{e}");
    std::fs::remove_file(ad2.join("adapter_model.safetensors")).unwrap();
    let e = read_peft(&ad2, &cfg, 64).unwrap_err().to_string();
    assert!(e.contains("adapter_model.safetensors"), "{e}");
}

/// A GGUF LoRA file in llama.cpp's layout (written here from a PEFT adapter's engine-order
/// values: `lora_a` dims `[in, r]`, `lora_b` `[r, out]`, `adapter.lora.alpha`) reads back as
/// the same adapter; a file that is not an adapter is refused by name. Not checked against a
/// file from llama.cpp's own `convert_lora_to_gguf.py`.
#[test]
fn gguf_lora_files_read_as_the_same_adapter() {
    use npu_agent::model::lora::gguf_adapter::read_gguf_lora;
    use npu_gguf::writer::GgufWriter;
    use npu_gguf::MetaValue;

    let donor = GgufFile::open(common::model_path()).unwrap();
    let bytes = synth::synth_model(Family::Llama, 7, GgmlType::F32, &donor).unwrap();
    let gguf = GgufFile::from_bytes("m.gguf", &bytes).unwrap();
    let cfg = Checkpoint::from(&gguf).config().unwrap();
    let dir = TempDir::new("gguf");
    let peft = dir.0.join("peft");
    let spec = SynthAdapter {
        rank: 4,
        alpha: 12.0,
        use_rslora: false,
        targets: Target::ALL.to_vec(),
        seed: 5,
        a_range: 0.2,
        b_range: 0.2,
        bf16: false,
    };
    write_peft(&peft, &cfg, &spec).unwrap();
    let want = read_peft(&peft, &cfg, 16).unwrap();
    let write = |general_type: &str, path: &Path| {
        let mut w = GgufWriter::new();
        w.add_meta("general.architecture", MetaValue::String("llama".into()));
        w.add_meta("general.type", MetaValue::String(general_type.into()));
        w.add_meta("adapter.type", MetaValue::String("lora".into()));
        w.add_meta("adapter.lora.alpha", MetaValue::F32(12.0));
        let g = [
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ];
        for (il, l) in want.layers.iter().enumerate() {
            for t in Target::ALL {
                let lr = l[t.index()].as_ref().unwrap();
                let (n_in, n_out) = t.dims(&cfg);
                let r = want.rank;
                let name = format!("blk.{il}.{}.weight", g[t.index()]);
                w.add_f32_tensor(format!("{name}.lora_a"), &[n_in as u64, r as u64], &lr.a);
                let mut b = vec![0f32; n_out * r];
                for o in 0..n_out {
                    for k in 0..r {
                        b[o * r + k] = lr.b_t[k * n_out + o];
                    }
                }
                w.add_f32_tensor(format!("{name}.lora_b"), &[r as u64, n_out as u64], &b);
            }
        }
        w.write_to(path).unwrap();
    };
    let file = dir.0.join("lora.gguf");
    write("adapter", &file);
    let got = read_gguf_lora(&file, &cfg, 16).unwrap();
    assert_eq!((got.rank, got.scale), (want.rank, want.scale));
    assert_eq!(got.layers, want.layers);
    let e = read_gguf_lora(&file, &cfg, 2).unwrap_err().to_string();
    assert!(e.contains("max_lora_rank"), "{e}");
    let not = dir.0.join("model.gguf");
    write("model", &not);
    let e = read_gguf_lora(&not, &cfg, 16).unwrap_err().to_string();
    assert!(e.contains("general.type"), "{e}");
}

//! Quantized Hugging Face checkpoints: FP8 e4m3 with 128x128 block scales (`quant_method: fp8`,
//! `weight_scale_inv`, as DeepSeek and Qwen3-FP8 ship), int8 with per-channel scales and
//! dynamic per-token activations in compressed-tensors' layout and in msmodelslim's
//! (`quant_model_description.json`, W8A8_DYNAMIC, with `weight_offset`).
//!
//! Each is made here from the f32 twin of a fidelity-sweep model (Llama, whose Q/K rows the
//! loader permutes after dequantizing; Qwen2 with biases; Qwen3-MoE, whose every expert is
//! quantized; DeepSeek, whose `kv_b_proj` the loader splits and transposes after dequantizing),
//! beside a directory holding the dequantized values rounded to bf16. The loader
//! widens quantized weights to bf16: every weight it hands over equals that directory's, byte for
//! byte (so the logits are equal bit for bit), and is within bf16's rounding (relative 2^-8) of
//! the exact dequantized value. Static activation scales are refused by name.

mod common;

use std::path::{Path, PathBuf};

use npu_agent::cli::synth_hf::{write_hf_twin, HfDtype};
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{SeqSpan, StepInputs};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::synth::{self, sweep, Family};
use npu_gguf::{GgmlType, GgufFile};
use npu_hf::{Dtype, Shards, WriteTensor};
use npu_model::Checkpoint;
use serde_json::{json, Value};

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("npu-hfq-{name}-{}", std::process::id()));
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

/// The scheme a test directory is written in.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Scheme {
    Fp8Block,
    CompressedInt8,
    MsmodelslimInt8,
}

/// The f32 value of an e4m3 code.
fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0x0F) as i32;
    let man = (b & 7) as f32;
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// The nearest e4m3 code of `x` (|x| <= 448), ties to the even code.
fn to_e4m3(x: f32, table: &[(f32, u8)]) -> u8 {
    let a = x.abs();
    let i = table.partition_point(|&(v, _)| v < a);
    let code = match (table.get(i.wrapping_sub(1)), table.get(i)) {
        (Some(&(lo, cl)), Some(&(hi, ch))) => {
            if a - lo < hi - a || (a - lo == hi - a && cl % 2 == 0) {
                cl
            } else {
                ch
            }
        }
        (Some(&(_, c)), None) => c,
        (None, Some(&(_, c))) => c,
        (None, None) => 0,
    };
    if x < 0.0 {
        code | 0x80
    } else {
        code
    }
}

/// A quantized matrix: stored codes, its scale tensor (and offsets), and the dequantized f32.
struct Quantized {
    codes: Vec<u8>,
    dtype: Dtype,
    scale: Vec<f32>,
    scale_shape: Vec<usize>,
    dequantized: Vec<f32>,
}

fn quantize(w: &[f32], out: usize, inp: usize, scheme: Scheme, table: &[(f32, u8)]) -> Quantized {
    match scheme {
        Scheme::Fp8Block => {
            let (br, bc) = (out.div_ceil(128), inp.div_ceil(128));
            let mut scale = vec![0f32; br * bc];
            for r in 0..out {
                for c in 0..inp {
                    let s = &mut scale[(r / 128) * bc + c / 128];
                    *s = s.max(w[r * inp + c].abs() / 448.0);
                }
            }
            scale
                .iter_mut()
                .for_each(|s| *s = if *s == 0.0 { 1.0 } else { *s });
            let mut codes = vec![0u8; out * inp];
            let mut deq = vec![0f32; out * inp];
            for r in 0..out {
                for c in 0..inp {
                    let s = scale[(r / 128) * bc + c / 128];
                    let code = to_e4m3(w[r * inp + c] / s, table);
                    codes[r * inp + c] = code;
                    deq[r * inp + c] = e4m3(code) * s;
                }
            }
            Quantized {
                codes,
                dtype: Dtype::F8E4M3,
                scale,
                scale_shape: vec![br, bc],
                dequantized: deq,
            }
        }
        Scheme::CompressedInt8 | Scheme::MsmodelslimInt8 => {
            let mut scale = vec![0f32; out];
            let mut codes = vec![0u8; out * inp];
            let mut deq = vec![0f32; out * inp];
            for r in 0..out {
                let row = &w[r * inp..(r + 1) * inp];
                let m = row.iter().fold(0f32, |m, x| m.max(x.abs()));
                let s = if m == 0.0 { 1.0 } else { m / 127.0 };
                scale[r] = s;
                for (c, x) in row.iter().enumerate() {
                    let q = (x / s).round().clamp(-127.0, 127.0) as i8;
                    codes[r * inp + c] = q as u8;
                    deq[r * inp + c] = q as f32 * s;
                }
            }
            Quantized {
                codes,
                dtype: Dtype::I8,
                scale,
                scale_shape: vec![out, 1],
                dequantized: deq,
            }
        }
    }
}

/// Whether an HF tensor is one of the quantized linear layers (as llm-compressor and
/// msmodelslim leave the embedding, the head, the norms and the MoE router in floats).
fn quantized_linear(name: &str) -> bool {
    name.starts_with("model.layers.")
        && name.ends_with("_proj.weight")
        && !name.contains("mlp.gate.")
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn copy_side_files(from: &Path, to: &Path) {
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        if from.join(f).exists() {
            std::fs::copy(from.join(f), to.join(f)).unwrap();
        }
    }
}

/// Writes `scheme`'s quantized directory and the f32 directory of its dequantized values from
/// the f32 twin `src`; returns the quantized tensors' dequantized values by HF name.
fn write_pair(src: &Path, quant: &Path, deq: &Path, scheme: Scheme) -> Vec<(String, Vec<f32>)> {
    let mut table: Vec<(f32, u8)> = (0u8..0x7F).map(|c| (e4m3(c), c)).collect();
    table.sort_by(|a, b| a.0.total_cmp(&b.0));
    let shards = Shards::open(src).unwrap();
    let mut q_tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut d_tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut dequantized = Vec::new();
    for t in shards.tensors() {
        let data = shards.data(t).to_vec();
        if !quantized_linear(&t.name) {
            q_tensors.push((t.name.clone(), t.dtype, t.shape.clone(), data.clone()));
            d_tensors.push((t.name.clone(), t.dtype, t.shape.clone(), data));
            continue;
        }
        assert_eq!(t.dtype, Dtype::F32);
        let (out, inp) = (t.shape[0], t.shape[1]);
        let q = quantize(&f32s(&data), out, inp, scheme, &table);
        let base = t.name.strip_suffix(".weight").unwrap();
        let scale_name = match scheme {
            Scheme::Fp8Block => format!("{base}.weight_scale_inv"),
            _ => format!("{base}.weight_scale"),
        };
        q_tensors.push((t.name.clone(), q.dtype, t.shape.clone(), q.codes));
        q_tensors.push((
            scale_name,
            Dtype::F32,
            q.scale_shape.clone(),
            bytemuck::cast_slice(&q.scale).to_vec(),
        ));
        if scheme == Scheme::MsmodelslimInt8 {
            let zeros = vec![0f32; q.scale.len()];
            q_tensors.push((
                format!("{base}.weight_offset"),
                Dtype::F32,
                q.scale_shape.clone(),
                bytemuck::cast_slice(&zeros).to_vec(),
            ));
        }
        // The reference holds the dequantized values rounded to bf16 (round to nearest even),
        // what the loader widens quantized weights to.
        let bf16: Vec<u8> = q
            .dequantized
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect();
        d_tensors.push((t.name.clone(), Dtype::BF16, t.shape.clone(), bf16));
        dequantized.push((t.name.clone(), q.dequantized));
    }
    let write = |dir: &Path, ts: &[(String, Dtype, Vec<usize>, Vec<u8>)]| {
        let views: Vec<WriteTensor> = ts
            .iter()
            .map(|(n, d, s, b)| WriteTensor {
                name: n,
                dtype: *d,
                shape: s,
                data: b,
            })
            .collect();
        npu_hf::write_model(dir, &views, None).unwrap();
        copy_side_files(src, dir);
    };
    write(quant, &q_tensors);
    write(deq, &d_tensors);
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    std::fs::write(deq.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    match scheme {
        Scheme::Fp8Block => {
            cfg["quantization_config"] = json!({
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]
            });
        }
        Scheme::CompressedInt8 => {
            cfg["quantization_config"] = json!({
                "quant_method": "compressed-tensors", "format": "int-quantized",
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "int", "symmetric": true,
                                "strategy": "channel", "dynamic": false},
                    "input_activations": {"num_bits": 8, "type": "int", "symmetric": true,
                                          "strategy": "token", "dynamic": true}
                }},
                "ignore": ["lm_head"]
            });
        }
        Scheme::MsmodelslimInt8 => {
            let mut desc = serde_json::Map::new();
            desc.insert("model_quant_type".into(), "W8A8_DYNAMIC".into());
            for (n, _, _, _) in &q_tensors {
                let kind = if quantized_linear(n) {
                    "W8A8_DYNAMIC"
                } else {
                    "FLOAT"
                };
                desc.insert(n.clone(), kind.into());
            }
            std::fs::write(
                quant.join("quant_model_description.json"),
                serde_json::to_vec(&Value::Object(desc)).unwrap(),
            )
            .unwrap();
        }
    }
    std::fs::write(quant.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    dequantized
}

fn options() -> ModelOptions {
    ModelOptions {
        max_tokens: 64,
        max_logit_rows: 64,
        num_blocks: 4,
        block_size: 16,
        kv_memory_fraction: None,
    }
}

fn logits(ck: &Checkpoint, tokens: &[u32]) -> Vec<f32> {
    let b = CpuBackend::new(CpuConfig {
        threads: 0,
        f32_reference: false,
    });
    let mut m = Model::load_checkpoint(ck, b, options(), None).unwrap();
    let n = tokens.len();
    let step = StepInputs {
        positions: (0..n as u32).collect(),
        slot_mapping: (0..n as u32).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: n as u32,
            start_pos: 0,
        }],
        block_tables: (0..n.div_ceil(16) as u32).collect(),
        max_blocks: n.div_ceil(16),
        logit_rows: (0..n as u32 - 1).collect(),
        tokens: tokens.to_vec(),
    };
    let mut out = StepOutput::default();
    m.forward(&step, false, &mut out).unwrap();
    out.logits
}

#[test]
fn quantized_checkpoints_load_as_their_dequantized_weights() {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let picks = [
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3Moe,
        Family::Deepseek2,
    ];
    let mut checked = 0;
    for family in picks {
        let v = sweep::variants()
            .into_iter()
            .find(|v| v.family == family && v.ty == GgmlType::F32)
            .unwrap();
        let bytes = synth::synth_model_shaped(v.family, v.shape, v.seed, v.ty, &donor).unwrap();
        let gguf = GgufFile::from_bytes("m.gguf", &bytes).unwrap();
        let src = TempDir::new(&format!("{}-src", v.name));
        write_hf_twin(&gguf, &src.0, HfDtype::F32, None).unwrap();
        for scheme in [
            Scheme::Fp8Block,
            Scheme::CompressedInt8,
            Scheme::MsmodelslimInt8,
        ] {
            let what = format!("{} {scheme:?}", v.name);
            let q = TempDir::new(&format!("{}-{scheme:?}-q", v.name));
            let d = TempDir::new(&format!("{}-{scheme:?}-d", v.name));
            let deq = write_pair(&src.0, &q.0, &d.0, scheme);
            let qck = Checkpoint::open(&q.0).unwrap_or_else(|e| panic!("{what}: {e}"));
            let dck = Checkpoint::open(&d.0).unwrap();
            assert_eq!(qck.config().unwrap(), dck.config().unwrap(), "{what}");
            // Every weight the loader hands over equals the reference's bytes: the quantized
            // ones widened to bf16 are the dequantized values rounded to bf16 (Llama's Q/K
            // rows after the loader's permutation, which it applies after dequantizing).
            assert!(!deq.is_empty());
            for name in qck.tensor_names() {
                let (qi, qb) = qck.tensor(&name).unwrap();
                let (di, db) = dck.tensor(&name).unwrap();
                assert_eq!((qi.ty, &qi.dims), (di.ty, &di.dims), "{what}: {name}");
                assert!(
                    qb == db,
                    "{what}: {name} differs from its dequantized bf16 values"
                );
            }
            // And those are within bf16's rounding of the exact dequantized values.
            for (name, exact) in &deq {
                let st = Shards::open(&d.0).unwrap();
                let m = st.get(name).unwrap();
                for (c, w) in st.data(m).chunks_exact(2).zip(exact) {
                    let got = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                    assert!(
                        (got - w).abs() <= w.abs() / 256.0,
                        "{what}: {name}: {got} vs {w}"
                    );
                }
            }
            let vocab = qck.config().unwrap().vocab;
            let toks: Vec<u32> = (0..32u64)
                .map(|i| ((i * 7919 + 5) % vocab as u64) as u32)
                .collect();
            let (lq, ld) = (logits(&qck, &toks), logits(&dck, &toks));
            let same = lq.iter().zip(&ld).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: logits differ from the dequantized model's");
            checked += 1;
        }
    }
    assert_eq!(checked, 12);
}

#[test]
fn static_activation_scales_and_unknown_schemes_are_refused_by_name() {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let v = sweep::variants()
        .into_iter()
        .find(|v| v.family == Family::Qwen2 && v.ty == GgmlType::F32)
        .unwrap();
    let bytes = synth::synth_model_shaped(v.family, v.shape, v.seed, v.ty, &donor).unwrap();
    let gguf = GgufFile::from_bytes("m.gguf", &bytes).unwrap();
    let src = TempDir::new("refuse-src");
    write_hf_twin(&gguf, &src.0, HfDtype::F32, None).unwrap();
    let q = TempDir::new("refuse-q");
    let d = TempDir::new("refuse-d");
    write_pair(&src.0, &q.0, &d.0, Scheme::CompressedInt8);
    let cfg_path = q.0.join("config.json");
    let cfg: Value = serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    let refused = |c: &Value, needles: &[&str]| {
        std::fs::write(&cfg_path, serde_json::to_vec(c).unwrap()).unwrap();
        let e = match Checkpoint::open(&q.0) {
            Ok(_) => panic!("opened {c}"),
            Err(e) => e.to_string(),
        };
        for n in needles {
            assert!(e.contains(n), "{e:?} does not say {n:?}");
        }
    };
    let mut c = cfg.clone();
    c["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] =
        false.into();
    refused(&c, &["input_activations.dynamic", "static"]);
    let mut c = cfg.clone();
    c["quantization_config"] = json!({"quant_method": "awq", "bits": 4});
    refused(&c, &["quant_method", "awq"]);
    // Int8 weights with no scheme at all.
    let mut c = cfg.clone();
    c.as_object_mut().unwrap().remove("quantization_config");
    refused(&c, &["I8", "quantization_config"]);
}

//! Hugging Face model directories feed the same model as their GGUF twins.
//!
//! Every float model of the fidelity sweep (`npu_gguf::synth::sweep`: every family, head sizes,
//! grouped-query ratios, Qwen2 biases, Llama 3's rope scaling, tied and untied heads) is written
//! as the directory transformers would save (`npu_agent::cli::synth_hf`: config.json,
//! safetensors, tokenizer files; Llama's Q/K rows un-permuted, Gemma's norms minus one, experts
//! unstacked, DeepSeek's `attn_k_b`/`attn_v_b` joined into `kv_b_proj`, its YaRN, groups,
//! correction bias and shared experts in DeepSeek's config.json), then loaded through the
//! directory reader:
//!
//! - its model description equals the GGUF file's, field for field;
//! - its logits equal the GGUF file's bit for bit (f32 and f16 twins), over a teacher-forced
//!   continuation of llama.cpp's tokens;
//! - a bf16 directory quantized at load (`quantize: q8_0`) holds exactly the Q8_0 bytes the
//!   sweep's Q8_0 file holds (the same bytes `llama-quantize --pure` writes), so it computes that
//!   file's logits bit for bit;
//! - damaged directories are refused naming the file and what is wrong.
//!
//! The variants with arbitrary rope factors cannot be written as a config.json (transformers
//! has no such rope type): their refusal is checked too.

mod common;

use std::path::{Path, PathBuf};

use npu_agent::cli::synth_hf::{write_hf_twin, HfDtype};
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, SeqSpan, StepInputs};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::synth::{self, sweep, RopeFactors};
use npu_gguf::{GgmlType, GgufFile};
use npu_model::{Checkpoint, LoadOptions};

/// A temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("npu-hf-{name}-{}", std::process::id()));
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
        max_tokens: 64,
        max_logit_rows: 64,
        num_blocks: 4,
        block_size: 16,
        kv_memory_fraction: None,
    }
}

fn cpu() -> CpuBackend {
    CpuBackend::new(CpuConfig {
        threads: 0,
        f32_reference: false,
    })
}

/// The logits after each of `tokens` but the last, in one step.
fn logits<B: Backend>(m: &mut Model<B>, tokens: &[u32]) -> Vec<f32> {
    let n = tokens.len();
    let blocks = n.div_ceil(16);
    let step = StepInputs {
        positions: (0..n as u32).collect(),
        slot_mapping: (0..n as u32).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: n as u32,
            start_pos: 0,
        }],
        block_tables: (0..blocks as u32).collect(),
        max_blocks: blocks,
        logit_rows: (0..n as u32 - 1).collect(),
        tokens: tokens.to_vec(),
    };
    let mut out = StepOutput::default();
    m.forward(&step, false, &mut out).unwrap();
    out.logits
}

/// Tokens spread over the vocabulary (the sweep's models share the default model's).
fn tokens(vocab: usize) -> Vec<u32> {
    (0..40u64)
        .map(|i| ((i * 7919 + 13) % vocab as u64) as u32)
        .collect()
}

fn gguf_of(v: &sweep::Variant, ty: GgmlType, donor: &GgufFile) -> GgufFile {
    let bytes = synth::synth_model_shaped(v.family, v.shape, v.seed, ty, donor).unwrap();
    GgufFile::from_bytes(&format!("{}.gguf", v.name), &bytes).unwrap()
}

/// Where two logit vectors first differ in any bit.
fn bit_difference(a: &[f32], b: &[f32], what: &str) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("{what}: {} logits vs {}", a.len(), b.len()));
    }
    let i = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())?;
    Some(format!(
        "{what}: logit {i} differs: {} (directory) vs {} (GGUF)",
        a[i], b[i]
    ))
}

fn assert_same_bits(a: &[f32], b: &[f32], what: &str) {
    if let Some(d) = bit_difference(a, b, what) {
        panic!("{d}");
    }
}

#[test]
fn every_float_sweep_model_loads_from_its_directory_bit_for_bit() {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let mut checked = Vec::new();
    let mut differ = Vec::new();
    for v in sweep::variants() {
        let dtype = match v.ty {
            GgmlType::F32 => HfDtype::F32,
            GgmlType::F16 => HfDtype::F16,
            _ => continue,
        };
        let gguf = gguf_of(&v, v.ty, &donor);
        let dir = TempDir::new(&v.name);
        // Sharded, to read through the index.
        let written = write_hf_twin(&gguf, &dir.0, dtype, Some(1 << 20));
        if v.shape.rope_factors == RopeFactors::Arbitrary {
            let e = written.expect_err("arbitrary rope factors have no config.json form");
            eprintln!("{}: refused as expected: {e}", v.name);
            continue;
        }
        written.unwrap_or_else(|e| panic!("{}: {e}", v.name));
        let ck = Checkpoint::open(&dir.0).unwrap_or_else(|e| panic!("{}: {e}", v.name));
        let from_dir = ck.config().unwrap();
        let from_gguf = npu_model::ModelConfig::from_gguf(&gguf).unwrap();
        // The name comes from different places (general.name, _name_or_path).
        let mut from_dir_named = npu_model::ModelConfig {
            name: from_gguf.name.clone(),
            ..from_dir
        };
        // Llama 3's frequency factors: the directory's are computed from rope_scaling in f32
        // (as transformers and convert_hf_to_gguf.py compute them), the sweep file's in f64;
        // they agree to f32 rounding.
        let formula = v.shape.rope_factors == RopeFactors::Formula;
        if formula {
            let (a, b) = (from_dir_named.rope.factors, from_gguf.rope.factors);
            let (a, b) = (a.expect("factors"), b.expect("factors"));
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 2e-6 * y, "{}: factor {x} vs {y}", v.name);
            }
            from_dir_named.rope.factors = from_gguf.rope.factors;
            for l in &mut from_dir_named.layers {
                l.rope.factors = from_gguf.rope.factors;
            }
        }
        assert_eq!(
            from_dir_named, from_gguf,
            "{}: model descriptions differ",
            v.name
        );
        let toks = tokens(from_gguf.vocab);
        let mut a = Model::load_checkpoint(&ck, cpu(), options(), None).unwrap();
        let mut b = Model::load(&gguf, cpu(), options()).unwrap();
        let (la, lb) = (logits(&mut a, &toks), logits(&mut b, &toks));
        if formula {
            // Not bit for bit: the same top-1 wherever the GGUF's is decided.
            for (ra, rb) in la
                .chunks_exact(from_gguf.vocab)
                .zip(lb.chunks_exact(from_gguf.vocab))
            {
                let top = |r: &[f32]| (0..r.len()).fold(0, |m, i| if r[i] > r[m] { i } else { m });
                let (ta, tb) = (top(ra), top(rb));
                let gap = rb[tb]
                    - rb.iter()
                        .enumerate()
                        .filter(|&(i, _)| i != tb)
                        .fold(f32::NEG_INFINITY, |m, (_, &x)| m.max(x));
                assert!(ta == tb || gap < 0.01, "{}: top-1 {ta} vs {tb}", v.name);
            }
            checked.push(format!("{} (factors to f32 rounding)", v.name));
            continue;
        }
        match bit_difference(&la, &lb, &v.name) {
            None => checked.push(v.name.clone()),
            Some(d) => differ.push(d),
        }
    }
    eprintln!("bit for bit: {checked:?}");
    assert!(differ.is_empty(), "{differ:#?}");
    for family in [
        "llama",
        "llama3",
        "qwen2",
        "qwen3",
        "qwen3moe",
        "gemma3",
        "deepseek2",
    ] {
        assert!(
            checked.iter().any(|n| n.starts_with(family)),
            "no {family} directory was checked: {checked:?}"
        );
    }
    // Every float deepseek2 file: DeepSeek-V2's schema and V3's, YaRN, groups, the correction
    // bias, shared experts, the full and the low-rank query.
    let ds = checked
        .iter()
        .filter(|n| n.starts_with("deepseek2"))
        .count();
    assert_eq!(ds, 3, "deepseek2 directories checked: {checked:?}");
}

/// Quantize at load on the f32 twin of each Q8_0 variant's values (the sweep writes its Q8_0
/// files as `llama-quantize --pure` quantizes the same values; `scripts/fidelity-refs.sh` checks
/// that byte for byte).
#[test]
fn quantize_at_load_writes_the_bytes_llama_quantize_writes() {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let (mut checked, mut deepseek2) = (0, 0);
    for v in sweep::variants() {
        if v.ty != GgmlType::Q8_0 || v.shape.rope_factors == RopeFactors::Arbitrary {
            continue;
        }
        let f32_file = gguf_of(&v, GgmlType::F32, &donor);
        let q8_file = gguf_of(&v, GgmlType::Q8_0, &donor);
        let dir = TempDir::new(&format!("{}-q", v.name));
        write_hf_twin(&f32_file, &dir.0, HfDtype::F32, None)
            .unwrap_or_else(|e| panic!("{}: {e}", v.name));
        let opts = LoadOptions {
            quantize: Some(GgmlType::Q8_0),
        };
        let ck = Checkpoint::open_with(&dir.0, opts).unwrap();
        for t in q8_file.tensors() {
            let (info, data) = ck.tensor(&t.name).unwrap();
            let (_, want) = q8_file.tensor(&t.name).unwrap();
            assert_eq!(info.ty, t.ty, "{}: {} type", v.name, t.name);
            assert!(
                data.as_ref() == want,
                "{}: {} bytes differ from the Q8_0 file's",
                v.name,
                t.name
            );
        }
        let toks = tokens(ck.config().unwrap().vocab);
        let mut a = Model::load_checkpoint(&ck, cpu(), options(), None).unwrap();
        let mut b = Model::load(&q8_file, cpu(), options()).unwrap();
        assert_same_bits(&logits(&mut a, &toks), &logits(&mut b, &toks), &v.name);
        checked += 1;
        deepseek2 += usize::from(v.family == synth::Family::Deepseek2);
    }
    assert!(checked >= 3, "only {checked} Q8_0 variants checked");
    assert_eq!(deepseek2, 2, "deepseek2 Q8_0 variants checked");
}

fn refused(dir: &Path, needles: &[&str]) {
    let e = match Checkpoint::open(dir) {
        Ok(_) => panic!("{}: opened a damaged directory", dir.display()),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(e.contains(n), "{e:?} does not say {n:?}");
    }
}

#[test]
fn damaged_directories_are_refused_naming_what_is_wrong() {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let v = sweep::variants()
        .into_iter()
        .find(|v| v.family == synth::Family::Qwen2 && v.ty == GgmlType::F32)
        .unwrap();
    let gguf = gguf_of(&v, GgmlType::F32, &donor);
    let fresh = |name: &str, shards: Option<u64>| {
        let d = TempDir::new(name);
        write_hf_twin(&gguf, &d.0, HfDtype::F32, shards).unwrap();
        d
    };
    let cfg = |d: &TempDir| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(d.0.join("config.json")).unwrap()).unwrap()
    };
    let put = |d: &TempDir, v: &serde_json::Value| {
        std::fs::write(d.0.join("config.json"), serde_json::to_vec(v).unwrap()).unwrap();
    };
    // A config key that changes the maths and is not applied.
    let d = fresh("softcap", None);
    let mut c = cfg(&d);
    c["final_logit_softcapping"] = 30.0.into();
    put(&d, &c);
    refused(&d.0, &["final_logit_softcapping", "soft-capping"]);
    let mut c = cfg(&d);
    c.as_object_mut().unwrap().remove("final_logit_softcapping");
    c["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    put(&d, &c);
    refused(&d.0, &["rope_scaling.rope_type", "yarn"]);
    // A required key missing.
    let mut c = cfg(&d);
    c.as_object_mut().unwrap().remove("rope_scaling");
    c.as_object_mut().unwrap().remove("num_hidden_layers");
    put(&d, &c);
    refused(&d.0, &["num_hidden_layers"]);
    // An unknown family.
    let mut c = cfg(&fresh("arch", None));
    c["model_type"] = "falcon".into();
    let d = fresh("arch2", None);
    put(&d, &c);
    refused(&d.0, &["model_type", "falcon"]);
    // A missing shard.
    let d = fresh("shard", Some(1 << 20));
    let shard = std::fs::read_dir(&d.0)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("-of-0000"))
        .expect("a shard");
    std::fs::remove_file(&shard).unwrap();
    refused(&d.0, &[shard.file_name().unwrap().to_str().unwrap()]);
    // A truncated file.
    let d = fresh("trunc", None);
    let st = d.0.join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&st).unwrap();
    f.set_len(len - 100).unwrap();
    refused(&d.0, &["model.safetensors"]);
    // A tensor of the wrong shape: the loader names it.
    let d = fresh("shape", None);
    let mut c = cfg(&d);
    c["intermediate_size"] = (c["intermediate_size"].as_u64().unwrap() * 2).into();
    put(&d, &c);
    let ck = Checkpoint::open(&d.0).unwrap();
    let e = match Model::load_checkpoint(&ck, cpu(), options(), None) {
        Ok(_) => panic!("loaded a directory whose FFN tensors do not match its config"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("ffn_gate.weight") && e.contains("shape"), "{e}");
}

/// On the device backends (the CUDA backend over the emulation of its kernels, the Ascend
/// backend over the strict CANN emulation), a directory's logits equal its GGUF twin's bit for
/// bit, family by family where the backend runs the family.
#[cfg(all(feature = "cuda", feature = "ascend"))]
#[test]
fn directories_load_on_the_device_emulations_as_their_gguf_twins() {
    let donor = GgufFile::open(common::model_path()).unwrap();
    // deepseek2's f32 twin (softmax scores with 3 of 4 groups) runs on the CUDA emulation; the
    // Ascend backend refuses softmax with groups by name on the emulated CANN 8.3
    // (aclnnMoeGatingTopK takes it from 8.5), so there it is skipped.
    for (device, skip) in [
        ("cuda", &["qwen3moe"][..]),
        ("ascend", &["qwen3moe", "gemma3", "deepseek2"][..]),
    ] {
        let mut checked = Vec::new();
        for v in sweep::variants() {
            if v.ty != GgmlType::F32
                || v.shape.rope_factors != RopeFactors::None
                || skip.contains(&v.family.name())
            {
                continue;
            }
            let gguf = gguf_of(&v, v.ty, &donor);
            let dir = TempDir::new(&format!("{}-{device}", v.name));
            write_hf_twin(&gguf, &dir.0, HfDtype::F32, None).unwrap();
            let ck = Checkpoint::open(&dir.0).unwrap();
            let toks = tokens(ck.config().unwrap().vocab)[..12].to_vec();
            // One device model alive at a time (the emulated Ascend runtime holds one current
            // context per thread, as the real one).
            let twin = Checkpoint::from(&gguf);
            let run = |c: &Checkpoint| {
                if device == "cuda" {
                    let mut m = Model::load_checkpoint(c, common::devices::cuda(), options(), None)
                        .unwrap();
                    logits(&mut m, &toks)
                } else {
                    let mut m =
                        Model::load_checkpoint(c, common::devices::ascend(), options(), None)
                            .unwrap();
                    logits(&mut m, &toks)
                }
            };
            let la = run(&ck);
            let lb = run(&twin);
            assert_same_bits(&la, &lb, &format!("{} on {device}", v.name));
            checked.push(v.name.clone());
        }
        eprintln!("{device}: bit for bit: {checked:?}");
        assert!(checked.len() >= 3, "{device}: only {checked:?}");
    }
}

/// llama.cpp on `convert_hf_to_gguf.py`'s conversion of each directory (recorded by
/// `scripts/hf-refs.sh` in tests/data/hf_sweep.jsonl): fed llama.cpp's greedy tokens, the
/// directory's top-1 is llama.cpp's at every step llama.cpp decided by at least 0.15.
#[test]
fn directories_give_llama_cpps_tokens_on_their_conversions() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf_sweep.jsonl");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (write it with scripts/hf-refs.sh)", path.display()));
    let donor = GgufFile::open(common::model_path()).unwrap();
    let mut by_variant: std::collections::BTreeMap<String, Vec<serde_json::Value>> =
        Default::default();
    for l in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        by_variant
            .entry(v["variant"].as_str().unwrap().to_string())
            .or_default()
            .push(v);
    }
    let (mut decided, mut misses) = (0, Vec::new());
    for (name, lines) in &by_variant {
        let v = sweep::variant(name).unwrap_or_else(|| panic!("{name}: not a sweep variant"));
        let dtype = match v.ty {
            GgmlType::F32 => HfDtype::F32,
            GgmlType::F16 => HfDtype::F16,
            other => panic!("{name}: a {} reference", other.name()),
        };
        let gguf = gguf_of(&v, v.ty, &donor);
        let dir = TempDir::new(&format!("{name}-refs"));
        write_hf_twin(&gguf, &dir.0, dtype, None).unwrap();
        let ck = Checkpoint::open(&dir.0).unwrap();
        let vocab = ck.config().unwrap().vocab;
        let opts = ModelOptions {
            max_tokens: 128,
            max_logit_rows: 128,
            num_blocks: 8,
            ..options()
        };
        let mut m = Model::load_checkpoint(&ck, cpu(), opts, None).unwrap();
        for r in lines {
            let ids = |k: &str| -> Vec<u32> {
                r[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            };
            let (prompt, out) = (ids("prompt_ids"), ids("output_ids"));
            let gaps: Vec<f64> = r["top1_top2_logit_gap"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            let steps = out.len().min(24);
            let toks: Vec<u32> = prompt.iter().chain(&out[..steps]).copied().collect();
            let all = logits(&mut m, &toks);
            for s in 0..steps {
                let row = &all[(prompt.len() - 1 + s) * vocab..][..vocab];
                if gaps[s] < 0.15 {
                    continue;
                }
                decided += 1;
                let top = (0..vocab).fold(0, |b, i| if row[i] > row[b] { i } else { b });
                if top as u32 != out[s] {
                    misses.push(format!("{name} step {s}: {top}, llama.cpp {}", out[s]));
                }
            }
        }
    }
    eprintln!("{} directories, {decided} decided steps", by_variant.len());
    assert!(
        by_variant.len() >= 10 && decided >= 500,
        "{decided} decided steps"
    );
    assert!(misses.is_empty(), "{misses:#?}");
}

/// A directory's tensors: name, dtype, shape and bytes.
type Tensors = Vec<(String, npu_hf::Dtype, Vec<usize>, Vec<u8>)>;

/// The tensors of `dir`'s model rewritten in place after `edit`.
fn rewrite_tensors(dir: &Path, edit: impl FnOnce(&mut Tensors)) {
    let mut all: Tensors = {
        let shards = npu_hf::Shards::open(dir).unwrap();
        shards
            .tensors()
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.dtype,
                    t.shape.clone(),
                    shards.data(t).to_vec(),
                )
            })
            .collect()
    };
    edit(&mut all);
    let views: Vec<npu_hf::WriteTensor> = all
        .iter()
        .map(|(name, dtype, shape, data)| npu_hf::WriteTensor {
            name,
            dtype: *dtype,
            shape,
            data,
        })
        .collect();
    npu_hf::write_model(dir, &views, None).unwrap();
}

/// A DeepSeek directory whose config.json asks for maths the engine does not apply, or whose
/// tensors do not fit it, is refused naming the key or the tensor; the multi-token-prediction
/// layer beyond num_hidden_layers is skipped (as convert_hf_to_gguf.py skips it).
#[test]
fn damaged_deepseek_directories_are_refused_naming_what_is_wrong() {
    let donor = GgufFile::open(common::model_path()).unwrap();
    // YaRN, 2 of 4 groups, the correction bias, the low-rank query, a dense lead.
    let v = sweep::variant("deepseek2_v3_groups2of4_bias_yarn8_tied_q8_0").unwrap();
    let gguf = gguf_of(&v, GgmlType::F32, &donor);
    let d = TempDir::new("deepseek-damaged");
    write_hf_twin(&gguf, &d.0, HfDtype::F32, None).unwrap();
    let original: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.0.join("config.json")).unwrap()).unwrap();
    let with = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut c = original.clone();
        edit(&mut c);
        std::fs::write(d.0.join("config.json"), serde_json::to_vec(&c).unwrap()).unwrap();
    };
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(Edit, &[&str])> = vec![
        (
            Box::new(|c| c["topk_method"] = "group_limited_greedy".into()),
            &["topk_method", "group_limited_greedy", "n_group"],
        ),
        (
            Box::new(|c| c["scoring_func"] = "sqrtsoftplus".into()),
            &["scoring_func", "sqrtsoftplus"],
        ),
        (
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("scoring_func");
            }),
            &["scoring_func", "absent"],
        ),
        (
            Box::new(|c| c["moe_layer_freq"] = 2.into()),
            &["moe_layer_freq = 2"],
        ),
        (
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("q_lora_rank");
            }),
            &["q_lora_rank", "missing"],
        ),
        (
            Box::new(|c| c["rope_scaling"]["mscale"] = 0.707.into()),
            &["rope_scaling", "mscale"],
        ),
        (
            Box::new(|c| c["rope_scaling"]["beta_fast"] = 64.into()),
            &["rope_scaling.beta_fast = 64"],
        ),
        (Box::new(|c| c["n_group"] = 3.into()), &["n_group = 3"]),
        (
            Box::new(|c| c["rope_interleave"] = false.into()),
            &["rope_interleave"],
        ),
        (
            Box::new(|c| c["kv_lora_rank"] = 32.into()),
            &["kv_b_proj", "kv_lora_rank"],
        ),
        (
            Box::new(|c| c["num_key_value_heads"] = 1.into()),
            &["num_key_value_heads"],
        ),
    ];
    for (edit, needles) in cases {
        with(&*edit);
        refused(&d.0, needles);
    }
    with(&|_| {});
    Checkpoint::open(&d.0).unwrap();

    // An MTP layer (model.layers.N of N layers) is skipped; a tensor the family does not use
    // is refused naming it; a missing kv_b_proj stops the load naming its key half.
    let n = v.shape.layers;
    rewrite_tensors(&d.0, |all| {
        let (_, dt, sh, data) = all
            .iter()
            .find(|t| t.0 == "model.layers.1.self_attn.kv_b_proj.weight")
            .unwrap()
            .clone();
        all.push((
            format!("model.layers.{n}.self_attn.kv_b_proj.weight"),
            dt,
            sh,
            data,
        ));
        let norm = all
            .iter()
            .find(|t| t.0 == "model.norm.weight")
            .unwrap()
            .clone();
        all.push((
            format!("model.layers.{n}.enorm.weight"),
            norm.1,
            norm.2,
            norm.3,
        ));
    });
    let ck = Checkpoint::open(&d.0).unwrap();
    assert!(ck
        .tensor_names()
        .iter()
        .all(|t| !t.starts_with(&format!("blk.{n}."))));
    rewrite_tensors(&d.0, |all| {
        let norm = all
            .iter()
            .find(|t| t.0 == "model.norm.weight")
            .unwrap()
            .clone();
        all.push((
            "model.layers.1.mlp.gate.bias".into(),
            norm.1,
            norm.2,
            norm.3,
        ));
    });
    refused(&d.0, &["mlp.gate.bias"]);
    rewrite_tensors(&d.0, |all| {
        all.retain(|t| {
            t.0 != "model.layers.1.mlp.gate.bias"
                && t.0 != "model.layers.2.self_attn.kv_b_proj.weight"
        });
    });
    let ck = Checkpoint::open(&d.0).unwrap();
    let e = match Model::load_checkpoint(&ck, cpu(), options(), None) {
        Ok(_) => panic!("loaded a DeepSeek directory without a kv_b_proj"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("blk.2.attn_k_b.weight"), "{e}");
}

//! Model-family fidelity without real weights: for each family, the tiny random-weight model of
//! `npu_gguf::synth` is regenerated from the seed recorded in tests/data/family_<family>.jsonl
//! (its sha256 must equal the recorded one, so a generator change is noticed), loaded on the CPU
//! backend, and checked against llama.cpp's greedy tokens (written by scripts/family-refs.sh) up
//! to each prompt's first near-tie, alone and batched with chunked prefill; the tokenizer must
//! give llama.cpp's prompt ids. A missing reference file fails.

mod common;

use std::path::PathBuf;

use common::engine_config;
use npu_agent::engine::AgentEngine;
use npu_agent::inproc::{self, Arrival};
use npu_gguf::synth::{self, Family};
use npu_gguf::GgufFile;
use npu_protocol::SamplingParams;
use npu_scheduler::GenerateRequest;
use npu_tokenizer::Tokenizer;
use serde_json::Value;

struct FamilyRef {
    prompt: String,
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
    first_near_tie: Option<usize>,
    seed: u64,
    weight_type: String,
    sha256: String,
}

fn refs(family: &str) -> Vec<FamilyRef> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(format!("family_{family}.jsonl"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (write it with scripts/family-refs.sh {family})",
            path.display()
        )
    });
    let refs: Vec<FamilyRef> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let ids = |k: &str| -> Vec<u32> {
                v[k].as_array()
                    .unwrap_or_else(|| panic!("{}: no {k}", path.display()))
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            };
            assert_eq!(v["arch"].as_str(), Some(family), "{}", path.display());
            FamilyRef {
                prompt: v["prompt"].as_str().unwrap().to_string(),
                prompt_ids: ids("prompt_ids"),
                output_ids: ids("output_ids"),
                first_near_tie: v["first_near_tie"].as_u64().map(|x| x as usize),
                seed: v["seed"].as_u64().unwrap(),
                weight_type: v["weight_type"].as_str().unwrap().to_string(),
                sha256: v["model_sha256"].as_str().unwrap().to_string(),
            }
        })
        .collect();
    assert!(refs.len() >= 3, "{}: fewer than 3 prompts", path.display());
    refs
}

/// A synthesized model file, removed when dropped.
struct TempModel(PathBuf);

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Regenerates the family's model from the reference's parameters and checks its sha256.
fn regenerate(family: Family, r: &FamilyRef) -> TempModel {
    let donor = GgufFile::open(common::model_path()).unwrap();
    let ty = synth::weight_type(&r.weight_type).unwrap();
    let bytes = synth::synth_model(family, r.seed, ty, &donor).unwrap();
    assert_eq!(
        synth::sha256_hex(&bytes),
        r.sha256,
        "the {} model of seed {} is not the file llama.cpp ran: the generator (or the donor) \
         changed; rerun scripts/family-refs.sh {}",
        family.name(),
        r.seed,
        family.name()
    );
    let path = std::env::temp_dir().join(format!(
        "npu-family-{}-{}-{}.gguf",
        family.name(),
        r.seed,
        std::process::id()
    ));
    std::fs::write(&path, &bytes).unwrap();
    TempModel(path)
}

fn greedy(id: u64, prompt: &[u32], n: usize, at_step: usize) -> Arrival {
    Arrival {
        request: GenerateRequest {
            id,
            prompt_ids: prompt.to_vec(),
            params: SamplingParams::greedy(),
            max_new_tokens: n as u32,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            speculative: true,
        },
        at_step,
    }
}

fn check_prefix(family: &str, r: &FamilyRef, got: &[u32], what: &str) {
    let n = r
        .first_near_tie
        .unwrap_or(r.output_ids.len())
        .min(got.len());
    assert_eq!(
        &got[..n],
        &r.output_ids[..n],
        "{family} {what}: {:?} differs from llama.cpp before its first near-tie (step {n})",
        r.prompt
    );
}

fn check(family_name: &str) {
    let family = Family::from_name(family_name).unwrap();
    let refs = refs(family_name);
    let first = &refs[0];
    assert!(
        refs.iter().all(|r| (r.seed, &r.weight_type, &r.sha256)
            == (first.seed, &first.weight_type, &first.sha256)),
        "family_{family_name}.jsonl mixes models"
    );
    let model = regenerate(family, first);

    let tok = Tokenizer::from_gguf(&GgufFile::open(&model.0).unwrap()).unwrap();
    for r in &refs {
        assert_eq!(
            tok.encode(&r.prompt).unwrap(),
            r.prompt_ids,
            "{family_name}: tokens of {:?}",
            r.prompt
        );
    }

    let mut cfg = engine_config(8, 64);
    cfg.model_path = model.0.clone();
    let mut eng = AgentEngine::load(&cfg).expect("loading the synthetic model");
    let n = first.output_ids.len();
    let alone: Vec<Vec<u32>> = refs
        .iter()
        .map(|r| {
            let (out, _) = inproc::run(
                &mut eng,
                inproc::scheduler_config(&cfg),
                &[greedy(0, &r.prompt_ids, n, 0)],
                &mut |_, _| {},
            )
            .unwrap();
            let got = out[0].token_ids();
            check_prefix(family_name, r, &got, "alone");
            got
        })
        .collect();

    // All prompts together, staggered, with prefill split into 7-token chunks (across sliding
    // windows and KV blocks): the same tokens as alone.
    let reqs: Vec<Arrival> = refs
        .iter()
        .enumerate()
        .map(|(i, r)| greedy(i as u64, &r.prompt_ids, n, i * 2))
        .collect();
    let mut sched = inproc::scheduler_config(&cfg);
    sched.max_tokens_per_step = 7;
    let (out, _) = inproc::run(&mut eng, sched.clone(), &reqs, &mut |_, _| {}).unwrap();
    for (i, o) in out.iter().enumerate() {
        assert_eq!(
            o.token_ids(),
            alone[i],
            "{family_name}: {:?} batched vs alone",
            refs[i].prompt
        );
    }
    drop(eng);

    // Split over a tensor-parallel group of two ranks (each its heads or KV-head replica, half
    // of the FFN or of each expert, half of the vocabulary): llama.cpp's tokens up to the
    // near-ties, batched as alone (deepseek2: each rank its query heads, caching the whole
    // latent; its share of every expert's, the shared experts' and the dense FFN's columns).
    let mut group = npu_agent::tp::LocalGroup::load(&cfg, 2).expect("two ranks of the model");
    let run = sched.clone();
    let (out, _) = inproc::run_steps(&mut |p| group.step(p), run, &reqs, &mut |_, _| {}).unwrap();
    for (r, o) in refs.iter().zip(&out) {
        check_prefix(family_name, r, &o.token_ids(), "tensor-parallel 2, batched");
    }
    drop(group);
    // An MoE model split by whole experts (`moe_tensor_parallel: whole_experts`: each rank half
    // of the experts, whole, running only the routed slots it holds): the same.
    if ["qwen3moe", "deepseek2"].contains(&family_name) {
        let whole = npu_model::shard::ExpertSplit::WholeExperts;
        let mut group = npu_agent::tp::LocalGroup::load_split(&cfg, 2, whole)
            .expect("two ranks of whole experts");
        let (out, _) =
            inproc::run_steps(&mut |p| group.step(p), sched, &reqs, &mut |_, _| {}).unwrap();
        for (r, o) in refs.iter().zip(&out) {
            let what = "tensor-parallel 2 by whole experts, batched";
            check_prefix(family_name, r, &o.token_ids(), what);
        }
    }
}

#[test]
fn llama() {
    check("llama");
}

#[test]
fn llama3() {
    check("llama3");
}

#[test]
fn qwen2() {
    check("qwen2");
}

#[test]
fn qwen3() {
    check("qwen3");
}

#[test]
fn qwen3moe() {
    check("qwen3moe");
}

#[test]
fn gemma3() {
    check("gemma3");
}

#[test]
fn deepseek2() {
    check("deepseek2");
}

/// Every family has its reference file (a missing one fails here even while its test is
/// ignored), and llama.cpp's run was decided on most steps.
#[test]
fn every_family_has_references() {
    for f in Family::ALL {
        let refs = refs(f.name());
        let decided: usize = refs
            .iter()
            .map(|r| r.first_near_tie.unwrap_or(r.output_ids.len()))
            .sum();
        assert!(
            decided * 2 >= refs.len() * refs[0].output_ids.len(),
            "{}: llama.cpp's first near-ties come too early to test much ({decided} steps)",
            f.name()
        );
    }
}

//! Speculative decoding on the real default model: with n-gram drafts on, every request's
//! tokens are exactly those without them — greedy and sampled (with penalties), alone and
//! batched — while drafts are made and kept. The agent samples after each draft as it would one
//! step at a time; this checks that the logits of a verified row equal those of a decode row.

mod common;

use common::{engine, engine_config, model_path, refs};
use npu_agent::inproc::{self, Arrival, RunOutput, RunTiming};
use npu_gguf::GgufFile;
use npu_protocol::agent::DeviceKind;
use npu_protocol::SamplingParams;
use npu_scheduler::{GenerateRequest, SpeculativeConfig};
use npu_tokenizer::Tokenizer;

/// A prompt whose answer repeats its input: an edit of a small code file.
const EDIT_PROMPT: &str = "Rename the variable `total` to `sum` in this Python code and print \
the whole file again.\n\n```python\ndef average(values):\n    total = 0\n    for v in values:\n        \
total += v\n    return total / len(values)\n\n\ndef main():\n    values = [1, 2, 3, 4]\n    \
print(average(values))\n```\n\nHere is the file with `total` renamed:\n\n```python\n";

fn prompts() -> Vec<Vec<u32>> {
    let path = model_path();
    let gguf = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::for_model(&gguf, &path).unwrap();
    let mut p: Vec<Vec<u32>> = refs().into_iter().take(3).map(|r| r.prompt_ids).collect();
    p.push(tok.encode(EDIT_PROMPT).unwrap());
    p
}

fn request(id: u64, prompt: &[u32], params: &SamplingParams, n: u32) -> Arrival {
    Arrival {
        request: GenerateRequest {
            id,
            prompt_ids: prompt.to_vec(),
            params: params.clone(),
            max_new_tokens: n,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            speculative: true,
        },
        at_step: id as usize,
    }
}

fn run(
    speculative: Option<SpeculativeConfig>,
    arrivals: &[Arrival],
    slots: u32,
) -> (Vec<RunOutput>, RunTiming) {
    run_on(DeviceKind::Cpu, speculative, arrivals, slots)
}

fn run_on(
    device: DeviceKind,
    speculative: Option<SpeculativeConfig>,
    arrivals: &[Arrival],
    slots: u32,
) -> (Vec<RunOutput>, RunTiming) {
    let mut cfg = engine_config(slots, 96);
    cfg.device = device;
    let mut eng = engine(&cfg);
    let mut sched = inproc::scheduler_config(&cfg);
    sched.speculative = speculative;
    inproc::run(&mut eng, sched, arrivals, &mut |_, _| {}).unwrap()
}

fn spec() -> Option<SpeculativeConfig> {
    Some(SpeculativeConfig {
        max_batch: 8,
        // Keep drafting whatever the acceptance: every step verifies.
        min_acceptance: 0.0,
        ..SpeculativeConfig::default()
    })
}

fn same_tokens(params: SamplingParams, what: &str) {
    let prompts = prompts();
    let n = 48;
    let mut drafted = 0;
    let mut accepted = 0;
    // Alone, one after the other.
    for (i, p) in prompts.iter().enumerate() {
        let one = [request(0, p, &params, n)];
        let (plain, _) = run(None, &one, 1);
        let (spec_out, t) = run(spec(), &one, 1);
        assert_eq!(
            spec_out[0].tokens, plain[0].tokens,
            "{what}, prompt {i} alone: tokens (and log-probabilities) differ with drafts"
        );
        drafted += t.drafted_tokens;
        accepted += t.accepted_tokens;
    }
    // All together, arriving one step apart: drafts verified beside other sequences' decode
    // and prefill rows.
    let all: Vec<Arrival> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| request(i as u64, p, &params, n))
        .collect();
    let (plain, _) = run(None, &all, 4);
    let (spec_out, t) = run(spec(), &all, 4);
    for i in 0..all.len() {
        assert_eq!(
            spec_out[i].token_ids(),
            plain[i].token_ids(),
            "{what}, prompt {i} batched: tokens differ with drafts"
        );
    }
    drafted += t.drafted_tokens;
    accepted += t.accepted_tokens;
    assert!(
        drafted > 0 && accepted > 0,
        "{what}: {drafted} drafted, {accepted} kept"
    );
    eprintln!("{what}: {drafted} tokens drafted, {accepted} kept");
}

#[test]
fn greedy_tokens_are_the_same_with_drafts() {
    same_tokens(SamplingParams::greedy(), "greedy");
}

#[test]
fn sampled_tokens_with_penalties_are_the_same_with_drafts() {
    let params = SamplingParams {
        do_sample: true,
        temperature: 0.7,
        top_p: 0.95,
        repetition_penalty: 1.1,
        frequency_penalty: 0.2,
        seed: 11,
        ..SamplingParams::default()
    };
    same_tokens(params, "sampled");
}

/// The same on the Ascend backend (over the CANN install `ASCEND_HOME_PATH` names: the strict
/// emulation in the test suite): its verified rows give the tokens its decode rows give.
#[cfg(feature = "ascend")]
#[test]
fn greedy_tokens_are_the_same_with_drafts_on_the_ascend_backend() {
    assert!(
        std::env::var_os("ASCEND_HOME_PATH").is_some(),
        "ASCEND_HOME_PATH must name a CANN install (scripts/ascend-emulator.sh builds the emulation)"
    );
    let prompts = prompts();
    let params = SamplingParams::greedy();
    let all: Vec<Arrival> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| request(i as u64, p, &params, 24))
        .collect();
    let (plain, _) = run_on(DeviceKind::Ascend, None, &all, 4);
    let (drafted, t) = run_on(DeviceKind::Ascend, spec(), &all, 4);
    for i in 0..all.len() {
        assert_eq!(
            drafted[i].token_ids(),
            plain[i].token_ids(),
            "prompt {i}: tokens differ with drafts on the Ascend backend"
        );
    }
    assert!(
        t.accepted_tokens > 0,
        "{} drafted, none kept",
        t.drafted_tokens
    );
}

//! Passkey retrieval (the InfLLM paper's test) at 1x, 2x and 4x the model's training context,
//! with long-context mode on and off: a five-digit key hidden at a random depth in filler text,
//! asked for at the end; greedy output must contain it. It prints the accuracy of each setting.
//! The default model is tiny, so the figures are reported, not required: the test fails only
//! when a run fails. Ignored by default (a 4x context is tens of thousands of tokens of prefill
//! per prompt on two cores); run it with
//! `cargo test --release -p npu-agent --test passkey -- --ignored --nocapture`.
//! `PASSKEY_TRIALS` (default 3), `PASSKEY_MULTIPLES` (default `1,2,4`) and `PASSKEY_MODES`
//! (default `on,off`) narrow it; `PASSKEY_CONTEXT` replaces the training context as the unit
//! (a quick look at shorter prompts).

mod common;

use common::model_path;
use npu_agent::engine::{AgentEngine, AgentEngineConfig};
use npu_agent::inproc::{self, Arrival};
use npu_gguf::GgufFile;
use npu_protocol::agent::DeviceKind;
use npu_protocol::{LongContextConfig, SamplingParams};
use npu_scheduler::GenerateRequest;
use npu_tokenizer::Tokenizer;

const FILLER: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and \
                      back again. ";

fn env_list(key: &str, default: &str) -> Vec<String> {
    std::env::var(key)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// A passkey prompt of about `tokens` tokens with `key` at `depth` (0..1) of the filler.
fn passkey_prompt(tok: &Tokenizer, tokens: usize, key: u32, depth: f64) -> Vec<u32> {
    let head = "There is an important piece of information hidden inside a lot of irrelevant \
                text. Find it and memorize it. I will quiz you about it.\n";
    let needle = format!("The pass key is {key}. Remember it. {key} is the pass key. ");
    let tail = "\nWhat is the pass key? The pass key is";
    let per_filler = tok.encode(FILLER).unwrap().len().max(1);
    let fixed = tok.encode(&format!("{head}{needle}{tail}")).unwrap().len();
    let n = tokens.saturating_sub(fixed) / per_filler;
    let at = ((n as f64) * depth) as usize;
    let mut text = String::from(head);
    for i in 0..n {
        if i == at {
            text.push_str(&needle);
        }
        text.push_str(FILLER);
    }
    if at >= n {
        text.push_str(&needle);
    }
    text.push_str(tail);
    tok.encode(&text).unwrap()
}

fn engine_config(tokens: usize, long: bool) -> AgentEngineConfig {
    let lc = LongContextConfig::default();
    let blocks = if long {
        lc.device_blocks
    } else {
        (tokens as u32 + 64).div_ceil(16)
    };
    AgentEngineConfig {
        device: DeviceKind::Cpu,
        device_id: 0,
        model_path: model_path(),
        num_blocks: blocks,
        block_size: 16,
        max_slots: 1,
        max_tokens_per_step: 512,
        max_blocks_per_seq: blocks,
        threads: 0,
        swap_space_mb: 0,
        long_context: long.then_some(lc),
        handoff: None,
        kv_memory_fraction: None,
        tensor_parallel: None,
        quantize: None,
        kv_cache_dtype: Default::default(),
        graph_capture: Default::default(),
    }
}

#[test]
#[ignore = "minutes to hours of prefill on two cores; run by hand (see the module doc)"]
fn passkey_retrieval_with_the_mode_on_and_off() {
    let path = model_path();
    let gguf = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::for_model(&gguf, &path).unwrap();
    let trials: usize = std::env::var("PASSKEY_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let mut seed = 0x5eed_u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let context = std::env::var("PASSKEY_CONTEXT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(
            npu_model::ModelConfig::from_gguf(&gguf)
                .unwrap()
                .context_length,
        );
    assert!(context > 0);
    for multiple in env_list("PASSKEY_MULTIPLES", "1,2,4") {
        let multiple: usize = multiple.parse().expect("PASSKEY_MULTIPLES: numbers");
        for mode in env_list("PASSKEY_MODES", "on,off") {
            let long = mode == "on";
            let tokens = context * multiple;
            let cfg = engine_config(tokens, long);
            let mut eng = AgentEngine::load(&cfg).unwrap();
            let mut hits = 0;
            let t0 = std::time::Instant::now();
            for trial in 0..trials {
                let key = 10_000 + (next() % 90_000) as u32;
                let depth = (trial as f64 + 0.5) / trials as f64;
                let prompt = passkey_prompt(&tok, tokens, key, depth);
                let (out, _) = inproc::run(
                    &mut eng,
                    inproc::scheduler_config(&cfg),
                    &[Arrival {
                        request: GenerateRequest {
                            id: trial as u64,
                            prompt_ids: prompt,
                            params: SamplingParams::greedy(),
                            max_new_tokens: 8,
                            stop: Vec::new(),
                            stop_token_ids: Vec::new(),
                            ignore_eos: true,
                            speculative: true,
                        },
                        at_step: 0,
                    }],
                    &mut |_, _| {},
                )
                .unwrap();
                let text = tok.decode(&out[0].token_ids(), true);
                let hit = text.contains(&key.to_string());
                hits += usize::from(hit);
                println!(
                    "passkey {multiple}x ({tokens} tokens) mode {mode} depth {depth:.2}: key \
                     {key}, answer {text:?} {}",
                    if hit { "HIT" } else { "miss" }
                );
            }
            println!(
                "PASSKEY {multiple}x training context ({tokens} tokens), long_context {mode}: \
                 {hits}/{trials} ({:.0} s)",
                t0.elapsed().as_secs_f64()
            );
        }
    }
}

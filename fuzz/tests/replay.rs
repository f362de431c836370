//! Every committed input replayed through its harness: the seed corpus (`fuzz/corpus/<target>/`)
//! and what the fuzzers found (`fuzz/regressions/<target>/`, each file named for what it caught).
//! An input that panics fails its target's test; so does one that takes more than a few seconds
//! (the fuzzer's hang limit is 1 s; the margin absorbs a loaded test machine).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const SLOW: Duration = Duration::from_secs(5);

fn inputs(target: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        for e in entries.flatten() {
            if e.path().is_file() {
                files.push(e.path());
            }
        }
    }
    files.sort();
    files
}

fn replay(target: &str) {
    let harness = npu_fuzz::target(target).expect("a known target");
    let files = inputs(target);
    assert!(!files.is_empty(), "no corpus for {target}");
    // The fixtures (tokenizers, models) load once before the timings, as under the fuzzer: on a
    // busy machine their loading alone can take seconds.
    npu_fuzz::warm_up(target);
    let mut slow = Vec::new();
    for path in &files {
        let data = std::fs::read(path).expect("read corpus file");
        let started = Instant::now();
        let outcome = std::panic::catch_unwind(|| harness(&data));
        if outcome.is_err() {
            panic!("{target}: {} panics", path.display());
        }
        if started.elapsed() > SLOW {
            slow.push(format!("{} ({:?})", path.display(), started.elapsed()));
        }
    }
    assert!(slow.is_empty(), "{target}: slow inputs: {slow:?}");
    eprintln!("{target}: {} inputs replayed", files.len());
}

#[test]
fn http_corpus() {
    replay("http");
}

#[test]
fn api_bodies_corpus() {
    replay("api_bodies");
}

#[test]
fn anthropic_bodies_corpus() {
    replay("anthropic_bodies");
}

#[test]
fn responses_bodies_corpus() {
    replay("responses_bodies");
}

#[test]
fn tokenize_bodies_corpus() {
    replay("tokenize_bodies");
}

#[test]
fn gguf_corpus() {
    replay("gguf");
}

#[test]
fn tokenizer_corpus() {
    replay("tokenizer");
}

#[test]
fn chat_template_corpus() {
    replay("chat_template");
}

#[test]
fn config_yaml_corpus() {
    replay("config_yaml");
}

#[test]
fn agent_link_corpus() {
    replay("agent_link");
}

#[test]
fn every_target_has_a_test() {
    let src = include_str!("replay.rs");
    for (name, _) in npu_fuzz::TARGETS {
        assert!(
            src.contains(&format!("fn {name}_corpus()")),
            "target {name} has no replay test"
        );
    }
}

#[test]
fn kv_subscriber_corpus() {
    replay("kv_subscriber");
}

#[test]
fn safetensors_corpus() {
    replay("safetensors");
}

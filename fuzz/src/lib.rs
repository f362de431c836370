//! The fuzz harnesses: one function from bytes to each public entry point that reads bytes from
//! outside the process (an HTTP client, a request body, a downloaded GGUF, a tokenizer's input,
//! a chat template inside a GGUF, a YAML config, an agent's frames and step results, a KV-event
//! subscriber's handshake and subscriptions, a safetensors file). A harness
//! returns normally whatever the input; a panic, an abort, a hang or an allocation beyond the
//! input's size is a finding.
//!
//! The same harnesses run under AFL++ (`src/bin/afl.rs`, through `scripts/fuzz.sh`) and as plain
//! tests over the committed corpus (`tests/replay.rs`): every file under `fuzz/corpus/<target>/`
//! and `fuzz/regressions/<target>/` is replayed by the test command.

pub mod fixtures;
pub mod targets;

/// A harness: bytes in, nothing out; it must not panic.
pub type Harness = fn(&[u8]);

/// Every target, by the name `scripts/fuzz.sh` and the corpus directories use.
pub const TARGETS: &[(&str, Harness)] = &[
    ("http", targets::http::run),
    ("api_bodies", targets::api::run),
    ("responses_bodies", targets::responses::run),
    ("anthropic_bodies", targets::anthropic::run),
    ("tokenize_bodies", targets::tokenize::run),
    ("gguf", targets::gguf::run),
    ("tokenizer", targets::tokenizer::run),
    ("chat_template", targets::chat::run),
    ("config_yaml", targets::config::run),
    ("agent_link", targets::agent_link::run),
    ("kv_subscriber", targets::kv_subscriber::run),
    ("safetensors", targets::safetensors::run),
];

/// The harness named `name`.
pub fn target(name: &str) -> Option<Harness> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, h)| *h)
}

/// Runs `name`'s harness over its committed corpus, so that what the harness loads once (models'
/// tokenizers, the grammar compiler) is loaded before the fuzzer forks its runs: the AFL driver
/// calls this before its fork server starts.
pub fn warm_up(name: &str) {
    let Some(harness) = target(name) else {
        return;
    };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(name);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if let Ok(data) = std::fs::read(e.path()) {
            let _ = std::panic::catch_unwind(|| harness(&data));
        }
    }
}

/// Splits `data` at the first `sep`: (before, after); without one, (data, empty).
pub fn split_once(data: &[u8], sep: u8) -> (&[u8], &[u8]) {
    match data.iter().position(|&b| b == sep) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[]),
    }
}

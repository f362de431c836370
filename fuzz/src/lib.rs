//! The fuzz harnesses: one function from bytes to each public entry point that reads bytes from
//! outside the process (an HTTP client, a request body, a downloaded GGUF, a tokenizer's input,
//! a chat template inside a GGUF, a YAML config, an agent's frames and step results). A harness
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
    ("gguf", targets::gguf::run),
    ("tokenizer", targets::tokenizer::run),
    ("chat_template", targets::chat::run),
    ("config_yaml", targets::config::run),
    ("agent_link", targets::agent_link::run),
];

/// The harness named `name`.
pub fn target(name: &str) -> Option<Harness> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, h)| *h)
}

/// Splits `data` at the first `sep`: (before, after); without one, (data, empty).
pub fn split_once(data: &[u8], sep: u8) -> (&[u8], &[u8]) {
    match data.iter().position(|&b| b == sep) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[]),
    }
}

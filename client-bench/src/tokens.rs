//! Token counting with the served model's own tokenizer (never whitespace splitting): prompt and
//! output lengths, and cutting synthetic prompts to an exact token length.

use std::path::{Path, PathBuf};

use npu_gguf::GgufFile;
use npu_tokenizer::Tokenizer;

use crate::error::BenchError;

/// The model's tokenizer, shared by all request threads.
#[derive(Clone)]
pub struct TokenCounter {
    tokenizer: Tokenizer,
    model_path: PathBuf,
}

impl TokenCounter {
    /// Loads the tokenizer of `model` (a GGUF file), or of the default model when `None`
    /// (fetched into the cache if absent).
    pub fn load(model: Option<&Path>) -> Result<Self, BenchError> {
        let path = npu_gguf::store::resolve_model(model)
            .map_err(|e| BenchError::Tokenizer(format!("locating the model: {e}")))?;
        let gguf = GgufFile::open(&path)
            .map_err(|e| BenchError::Tokenizer(format!("{}: {e}", path.display())))?;
        let tokenizer = Tokenizer::for_model(&gguf, &path)
            .map_err(|e| BenchError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(TokenCounter {
            tokenizer,
            model_path: path,
        })
    }

    /// The GGUF file the tokenizer came from.
    pub fn model_path(&self) -> &Path {
        &self.model_path
    }

    /// Tokens the server sees for this prompt (with BOS when the model adds one).
    pub fn prompt_tokens(&self, text: &str) -> Result<usize, String> {
        self.tokenizer
            .encode(text)
            .map(|ids| ids.len())
            .map_err(|e| format!("tokenizing a prompt: {e}"))
    }

    /// Tokens of generated text (no BOS; special-token text counts as one token each).
    pub fn output_tokens(&self, text: &str) -> Result<usize, String> {
        if text.is_empty() {
            return Ok(0);
        }
        self.tokenizer
            .encode_with(text, false, true)
            .map(|ids| ids.len())
            .map_err(|e| format!("tokenizing output text: {e}"))
    }

    /// The longest prefix of `text` that is at most `n` tokens, cut on a token boundary and
    /// decoded back to text.
    pub fn truncate_to_tokens(&self, text: &str, n: usize) -> Result<String, String> {
        let ids = self
            .tokenizer
            .encode_with(text, false, false)
            .map_err(|e| format!("tokenizing synthetic text: {e}"))?;
        let take = n.min(ids.len());
        Ok(self.tokenizer.decode(&ids[..take], true))
    }
}

//! Tokenizer of the served model: text to token ids and back, built from GGUF metadata (or a
//! `tokenizer.json` beside the model, or a Hugging Face model directory), matching llama.cpp's
//! ids; special tokens written in text, end-of-generation ids, exact streaming detokenization
//! and the model's chat template.

mod chat;
mod decode_stream;
mod gguf_to_json;
mod gguf_vocab;
mod hf_dir;
mod hf_json;
mod pieces;
mod pretokenize;
mod special;
mod spm;

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use chat::{
    overrun_template_threads, ChatMessage, ChatTemplate, MAX_RENDERED_BYTES, RENDER_FUEL,
    RENDER_TIME_LIMIT,
};
pub use decode_stream::DecodeStream;
pub use gguf_to_json::{tokenizer_config_from_gguf, tokenizer_json_from_gguf};
pub use pieces::TokenKind;
pub use pretokenize::PreTokenizerKind;

use npu_gguf::GgufFile;
use pieces::PieceStyle;
use special::{Fragment, SpecialMatcher, SpecialToken};

/// Errors of building or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("GGUF tokenizer metadata {key:?}: {problem}")]
    Metadata { key: String, problem: String },
    #[error(
        "unsupported tokenizer model {0:?} (supported: \"gpt2\" byte-level BPE, \"llama\" SentencePiece)"
    )]
    UnsupportedModel(String),
    #[error("tokenizer file {path}: {message}")]
    TokenizerFile { path: PathBuf, message: String },
    #[error("building the tokenizer: {0}")]
    Build(String),
    #[error("encoding text: {0}")]
    Encode(String),
    #[error("chat template: {0}")]
    Template(String),
}

/// How raw text is prepared before the vocabulary model sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FragmentPrefix {
    /// Passed as is (byte-level BPE, tokenizer.json pipelines).
    None,
    /// SentencePiece: spaces become "▁".
    SpaceMarker,
    /// SentencePiece with `add_space_prefix`: also a leading "▁" on every text fragment.
    SpaceMarkerWithPrefix,
}

/// Text fragments that mark the end of generation when they are special tokens (as llama.cpp
/// recognises them when the metadata does not name them).
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
];

/// Everything a tokenizer is assembled from, whatever the source.
pub(crate) struct VocabParts {
    pub tokens: Vec<String>,
    pub kinds: Vec<TokenKind>,
    pub style: PieceStyle,
    pub encoder: tokenizers::Tokenizer,
    pub fragment_prefix: FragmentPrefix,
    pub strip_leading_space: bool,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    /// Further end-of-generation ids (a directory's generation_config.json `eos_token_id`).
    pub extra_eos: Vec<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// Per-token (lstrip, rstrip) for special tokens that strip neighbouring whitespace.
    pub strip_flags: HashMap<u32, (bool, bool)>,
    pub chat_template: Option<String>,
    pub description: String,
}

impl VocabParts {
    pub fn new(
        tokens: Vec<String>,
        kinds: Vec<TokenKind>,
        style: PieceStyle,
        encoder: tokenizers::Tokenizer,
    ) -> Self {
        Self {
            tokens,
            kinds,
            style,
            encoder,
            fragment_prefix: FragmentPrefix::None,
            strip_leading_space: false,
            bos: None,
            eos: None,
            eot: None,
            eom: None,
            extra_eos: Vec::new(),
            unk: None,
            pad: None,
            add_bos: false,
            add_eos: false,
            strip_flags: HashMap::new(),
            chat_template: None,
            description: String::new(),
        }
    }
}

struct Inner {
    encoder: tokenizers::Tokenizer,
    fragment_prefix: FragmentPrefix,
    specials: SpecialMatcher,
    tokens: Vec<String>,
    kinds: Vec<TokenKind>,
    pieces: Vec<Box<[u8]>>,
    by_text: HashMap<String, u32>,
    strip_leading_space: bool,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    chat_template: Option<String>,
    description: String,
}

/// The tokenizer of one model. Cheap to clone (shared), safe to use from many threads.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

/// UTF-8 of U+FFFD, shown for ids outside the vocabulary.
const REPLACEMENT: &[u8] = "\u{fffd}".as_bytes();

impl Tokenizer {
    /// Builds the tokenizer described by the GGUF `tokenizer.ggml.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TokenizerError> {
        Self::assemble(gguf_vocab::read(gguf)?)
    }

    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_tokenizer_json(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        Self::assemble(hf_json::read(path.as_ref())?)
    }

    /// The tokenizer for a model file: a `tokenizer.json` in the same directory when present
    /// (with the GGUF's chat template and end-of-generation tokens), else the GGUF metadata.
    /// A tokenizer.json whose vocabulary disagrees with the GGUF's is an error.
    pub fn for_model(gguf: &GgufFile, model_path: &Path) -> Result<Self, TokenizerError> {
        let dir = model_path.parent().unwrap_or(Path::new("."));
        let json = dir.join("tokenizer.json");
        if !json.is_file() {
            return Self::from_gguf(gguf);
        }
        tracing::info!(path = %json.display(), "using tokenizer.json beside the model");
        let mut parts = hf_json::read(&json)?;
        hf_json::adopt_gguf_facts(&mut parts, gguf, &json)?;
        Self::assemble(parts)
    }

    /// The tokenizer of a Hugging Face model directory without a GGUF: its `tokenizer.json`, with
    /// the special tokens, BOS/EOS flags and chat template of `tokenizer_config.json`, a
    /// `chat_template.jinja` (which wins) and `generation_config.json`'s `eos_token_id`, as
    /// transformers and vLLM read them (see `hf_dir`).
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        Self::assemble(hf_dir::read(dir)?)
    }

    fn assemble(p: VocabParts) -> Result<Self, TokenizerError> {
        let n = p.tokens.len();
        if p.kinds.len() != n {
            return Err(TokenizerError::Build(format!(
                "{} token kinds for {n} tokens",
                p.kinds.len()
            )));
        }
        if p.add_bos && p.bos.is_none() {
            return Err(TokenizerError::Metadata {
                key: "tokenizer.ggml.add_bos_token".into(),
                problem: "BOS is to be added but the vocabulary has no BOS token".into(),
            });
        }
        if p.add_eos && p.eos.is_none() {
            return Err(TokenizerError::Metadata {
                key: "tokenizer.ggml.add_eos_token".into(),
                problem: "EOS is to be added but the vocabulary has no EOS token".into(),
            });
        }
        let pieces = p
            .tokens
            .iter()
            .zip(&p.kinds)
            .map(|(t, &k)| pieces::token_piece(t, k, p.style).into_boxed_slice())
            .collect();
        let mut specials = Vec::new();
        let mut by_text = HashMap::with_capacity(n);
        let mut end_texts = Vec::new();
        for (id, (text, &kind)) in p.tokens.iter().zip(&p.kinds).enumerate() {
            let id = id as u32;
            by_text.insert(text.clone(), id);
            if !matches!(
                kind,
                TokenKind::Control | TokenKind::Unknown | TokenKind::UserDefined
            ) {
                continue;
            }
            let (lstrip, rstrip) = p.strip_flags.get(&id).copied().unwrap_or((false, false));
            specials.push(SpecialToken {
                text: text.clone(),
                id,
                always: kind == TokenKind::UserDefined,
                lstrip,
                rstrip,
            });
            if END_OF_GENERATION_TEXTS.contains(&text.as_str()) {
                end_texts.push(id);
            }
        }
        let mut eos_ids = Vec::new();
        let named = [p.eos, p.eot, p.eom].into_iter().flatten();
        for id in named.chain(p.extra_eos.iter().copied()).chain(end_texts) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        Ok(Self {
            inner: Arc::new(Inner {
                encoder: p.encoder,
                fragment_prefix: p.fragment_prefix,
                specials: SpecialMatcher::new(specials),
                tokens: p.tokens,
                kinds: p.kinds,
                pieces,
                by_text,
                strip_leading_space: p.strip_leading_space,
                bos: p.bos,
                eos: p.eos,
                unk: p.unk,
                pad: p.pad,
                eos_ids,
                add_bos: p.add_bos,
                add_eos: p.add_eos,
                chat_template: p.chat_template,
                description: p.description,
            }),
        })
    }

    /// Tokenizes raw text: special tokens written in it (e.g. `<|im_start|>`) become their ids,
    /// and BOS/EOS are added when the vocabulary asks for them.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, true, true)
    }

    /// Tokenizes with explicit choices: `add_special` adds BOS/EOS as configured; `parse_special`
    /// turns control-token texts into their ids (user-defined tokens are always recognised).
    pub fn encode_with(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let inner = &*self.inner;
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && inner.add_bos {
            out.extend(inner.bos);
        }
        for fragment in inner.specials.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(t) => self.encode_fragment(t, &mut out)?,
            }
        }
        if add_special && inner.add_eos {
            out.extend(inner.eos);
        }
        Ok(out)
    }

    fn encode_fragment(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let prepared: Cow<str> = match self.inner.fragment_prefix {
            FragmentPrefix::None => Cow::Borrowed(text),
            FragmentPrefix::SpaceMarker => Cow::Owned(text.replace(' ', "\u{2581}")),
            FragmentPrefix::SpaceMarkerWithPrefix => {
                Cow::Owned(format!("\u{2581}{}", text.replace(' ', "\u{2581}")))
            }
        };
        let encoding = self
            .inner
            .encoder
            .encode_fast(prepared.as_ref(), false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        out.extend_from_slice(encoding.get_ids());
        Ok(())
    }

    /// The text of a whole sequence. Special tokens are hidden with `skip_special`; ids outside
    /// the vocabulary show as U+FFFD; bytes that are not valid UTF-8 are replaced (lossy).
    /// SentencePiece vocabularies with a space prefix drop the one leading space of the text.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        self.decode_impl(ids, skip_special, self.inner.strip_leading_space)
    }

    /// The text of tokens that continue earlier text (generated after a prompt): as `decode`,
    /// but a leading space is always kept.
    pub fn decode_continuation(&self, ids: &[u32], skip_special: bool) -> String {
        self.decode_impl(ids, skip_special, false)
    }

    fn decode_impl(&self, ids: &[u32], skip_special: bool, strip_leading_space: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut strip = strip_leading_space;
        for &id in ids {
            let piece = self.output_piece(id, skip_special);
            if piece.is_empty() {
                continue;
            }
            bytes.extend_from_slice(take_leading_space(piece, &mut strip));
        }
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    /// Bytes `id` contributes to output text (empty when hidden).
    pub(crate) fn output_piece(&self, id: u32, skip_special: bool) -> &[u8] {
        let inner = &*self.inner;
        match inner.pieces.get(id as usize) {
            None => REPLACEMENT,
            Some(_) if skip_special && inner.kinds[id as usize].is_special() => &[],
            Some(p) => p,
        }
    }

    /// An incremental detokenizer for one sequence, equal to `decode` of all pushed ids.
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream {
        DecodeStream::new(self.clone(), skip_special, self.inner.strip_leading_space)
    }

    /// An incremental detokenizer for generated tokens, equal to `decode_continuation`.
    pub fn decode_stream_continuation(&self, skip_special: bool) -> DecodeStream {
        DecodeStream::new(self.clone(), skip_special, false)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.tokens.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.inner.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.inner.eos
    }

    /// Tokens that end generation: EOS, then EOT / EOM when named, then a model directory's
    /// generation_config.json `eos_token_id`s, then special tokens whose text marks an end of
    /// turn or text (such as `<|im_end|>` or `<|endoftext|>`).
    pub fn eos_ids(&self) -> &[u32] {
        &self.inner.eos_ids
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.inner.eos_ids.contains(&id)
    }

    pub fn unk_id(&self) -> Option<u32> {
        self.inner.unk
    }

    pub fn pad_id(&self) -> Option<u32> {
        self.inner.pad
    }

    /// Whether `encode` puts BOS first.
    pub fn adds_bos(&self) -> bool {
        self.inner.add_bos
    }

    /// The vocabulary text of a token (byte-level or "▁" form, as stored).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.inner.tokens.get(id as usize).map(String::as_str)
    }

    /// The id whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.by_text.get(text).copied()
    }

    /// The bytes a token decodes to (special tokens as their text).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.inner.pieces.get(id as usize).map(|p| &p[..])
    }

    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.inner.kinds.get(id as usize).copied()
    }

    /// Control and unknown tokens (hidden by `skip_special`).
    pub fn is_special(&self, id: u32) -> bool {
        self.token_kind(id).is_some_and(TokenKind::is_special)
    }

    /// The model's Jinja chat template source, when it has one.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.inner.chat_template.as_deref()
    }

    /// The model's chat template; without one, Gemma's turn format when the vocabulary has its
    /// turn tokens, else ChatML.
    pub fn chat_template(&self) -> Result<ChatTemplate, TokenizerError> {
        let token = |id: Option<u32>| {
            id.and_then(|i| self.token_text(i))
                .unwrap_or_default()
                .to_string()
        };
        let (bos, eos) = (token(self.inner.bos), token(self.inner.eos));
        match &self.inner.chat_template {
            Some(source) => ChatTemplate::new(source.clone(), bos, eos),
            None if self.token_id("<start_of_turn>").is_some()
                && self.token_id("<end_of_turn>").is_some() =>
            {
                Ok(ChatTemplate::gemma(bos, eos))
            }
            None => Ok(ChatTemplate::chatml(bos, eos)),
        }
    }

    /// A short description of the vocabulary type (for logs).
    pub fn description(&self) -> &str {
        &self.inner.description
    }
}

/// Removes one leading space from the first non-empty piece of a text.
fn take_leading_space<'a>(piece: &'a [u8], strip: &mut bool) -> &'a [u8] {
    if !std::mem::take(strip) {
        return piece;
    }
    piece.strip_prefix(b" ").unwrap_or(piece)
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.inner.description)
            .field("vocab_size", &self.vocab_size())
            .field("special_tokens", &self.inner.specials.len())
            .field("bos", &self.inner.bos)
            .field("eos_ids", &self.inner.eos_ids)
            .field("add_bos", &self.inner.add_bos)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_types_are_thread_safe() {
        fn shared<T: Send + Sync + Clone>() {}
        fn movable<T: Send>() {}
        shared::<Tokenizer>();
        shared::<ChatTemplate>();
        movable::<DecodeStream>();
    }

    #[test]
    fn leading_space_is_taken_once() {
        let mut strip = true;
        assert_eq!(take_leading_space(b"  a", &mut strip), b" a");
        assert_eq!(take_leading_space(b" b", &mut strip), b" b");
        let mut strip = true;
        assert_eq!(take_leading_space(b"x", &mut strip), b"x");
        assert!(!strip);
    }
}

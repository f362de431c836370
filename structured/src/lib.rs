//! Structured output: what a constrained request asks for (`ConstraintSpec`: a JSON Schema, any
//! JSON object, a regular expression, a Lark grammar or a list of choices), compiled once per
//! request by `Grammars` (llguidance over the served model's tokenizer) into a `Constraint`,
//! which gives the mask of tokens allowed next and is advanced by each token the request
//! generates. The server owns every constraint: masks cross to the agent in the step plan, and
//! a request recomputed after preemption, swap or an agent restart keeps its constraint's
//! state, since only tokens that reached the client advance it.

mod strict;

pub use strict::closed as closed_schema;

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use npu_tokenizer::Tokenizer;
use serde_json::Value;
use thiserror::Error;

/// Errors of this layer.
#[derive(Debug, Error, PartialEq)]
pub enum StructuredError {
    /// The request's grammar (schema, regex, Lark source, choices) was refused; the text says
    /// why, in llguidance's words.
    #[error("{what}: {reason}")]
    Invalid { what: &'static str, reason: String },
    /// The tokenizer cannot back a grammar (no end-of-sequence token, ...).
    #[error("structured output is not available for this model: {0}")]
    Unavailable(String),
    /// A generated token that the mask did not allow, or the matcher's own failure.
    #[error("the constrained output went wrong: {0}")]
    Matcher(String),
}

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON Schema (`response_format: {"type": "json_schema", ...}`).
    JsonSchema(Value),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A Lark-style grammar (llguidance's dialect).
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl ConstraintSpec {
    /// The field a problem with it is reported against.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonObject => "json_object",
            Self::JsonSchema(_) => "json_schema",
            Self::Regex(_) => "regex",
            Self::Lark(_) => "grammar",
            Self::Choice(_) => "choice",
        }
    }
}

/// The served model's tokenizer as llguidance sees it: each token's bytes (special tokens marked
/// as llguidance expects), and our tokenizer for turning bytes into tokens.
struct ModelTokEnv {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for ModelTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s))
            .unwrap_or_default()
    }
}

/// Compiles constraints for one model. Built once (it indexes the vocabulary); shared.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
    vocab: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl Grammars {
    /// Indexes `tokenizer`'s vocabulary for grammars.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, StructuredError> {
        let vocab = tokenizer.vocab_size();
        let eos = tokenizer
            .eos_id()
            .ok_or_else(|| StructuredError::Unavailable("the tokenizer has no end token".into()))?;
        let mut words = Vec::with_capacity(vocab);
        for id in 0..vocab as u32 {
            let bytes = tokenizer.token_bytes(id).unwrap_or(&[]);
            if tokenizer.is_special(id) {
                // llguidance's convention: a special token is 0xFF followed by its name, so no
                // text can spell it.
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(tokenizer.token_text(id).unwrap_or("").as_bytes());
                words.push(w);
            } else {
                words.push(bytes.to_vec());
            }
        }
        let mut info = TokRxInfo::new(vocab as u32, eos);
        info.tok_bos = tokenizer.bos_id();
        info.tok_unk = tokenizer.unk_id();
        info.tok_pad = tokenizer.pad_id();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ModelTokEnv {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let caps = InferenceCapabilities {
            ff_tokens: false,
            backtrack: false,
            conditional_ff_tokens: false,
            fork: false,
        };
        let mut factory = ParserFactory::new(&env, caps, &SlicedBiasComputer::general_slices())
            .map_err(|e| StructuredError::Unavailable(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
            vocab,
        })
    }

    /// Words of a token mask over this vocabulary.
    pub fn mask_words(&self) -> usize {
        self.vocab.div_ceil(32)
    }

    /// Compiles `spec`; a grammar llguidance refuses is `Invalid`, naming the spec's kind.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Constraint, StructuredError> {
        let what = spec.kind();
        let grammar = match spec {
            ConstraintSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            ConstraintSpec::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(StructuredError::Invalid {
                        what,
                        reason: "a schema is a JSON object".into(),
                    });
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            ConstraintSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            ConstraintSpec::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
            ConstraintSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(StructuredError::Invalid {
                        what,
                        reason: "no choices given".into(),
                    });
                }
                let alts: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::to_string(c).unwrap_or_default())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| StructuredError::Invalid {
                what,
                reason: e.to_string(),
            })?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(StructuredError::Invalid { what, reason: e });
        }
        // The first mask is computed here, so that a grammar that cannot start fails the
        // request (a 400) instead of its first step.
        let first = matcher
            .compute_mask()
            .map_err(|e| StructuredError::Invalid {
                what,
                reason: e.to_string(),
            })?;
        Ok(Constraint {
            matcher,
            words: self.mask_words(),
            next: Some(first.as_slice().to_vec()),
        })
    }
}

/// JSON without optional whitespace: outputs stay short, and a sampled run of spaces cannot eat
/// the token budget. A schema's own `x-guidance` options win.
fn compact(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// What committing a token did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// More tokens may follow.
    Continue,
    /// The grammar is complete: nothing but the end may follow.
    Done,
}

/// One request's grammar state.
pub struct Constraint {
    matcher: Matcher,
    words: usize,
    /// The mask for the next token, when already computed.
    next: Option<Vec<u32>>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// Words of this constraint's masks.
    pub fn mask_words(&self) -> usize {
        self.words
    }

    /// The tokens allowed next, as `mask_words` u32 words (bit `t % 32` of word `t / 32`).
    pub fn mask(&mut self) -> Result<Vec<u32>, StructuredError> {
        let mut words = match self.next.take() {
            Some(w) => w,
            None => self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| StructuredError::Matcher(e.to_string()))?
                .as_slice()
                .to_vec(),
        };
        words.resize(self.words, 0);
        self.next = Some(words.clone());
        Ok(words)
    }

    /// Advances the grammar by a generated token.
    pub fn commit(&mut self, token: u32) -> Result<Commit, StructuredError> {
        self.next = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| StructuredError::Matcher(e.to_string()))?;
        Ok(if self.matcher.is_stopped() {
            Commit::Done
        } else {
            Commit::Continue
        })
    }

    /// Whether the output so far is a complete match (the end token would be allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }
}

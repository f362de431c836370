//! Reading the tokenizer out of GGUF metadata (`tokenizer.ggml.*`): token texts, kinds, scores,
//! merges, special ids and flags, with the defaults llama.cpp uses when a key is absent, and
//! building the matching `tokenizers` model for "gpt2" (byte-level BPE) and "llama" (SentencePiece).

use std::collections::HashSet;

use tokenizers::models::bpe::{Vocab, BPE};

use super::pieces::{PieceStyle, TokenKind};
use super::pretokenize::PreTokenizerKind;
use super::{spm, FragmentPrefix, TokenizerError, VocabParts};
use npu_gguf::{GgufFile, MetaValue};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

fn meta_err(key: &str, problem: impl Into<String>) -> TokenizerError {
    TokenizerError::Metadata {
        key: key.to_string(),
        problem: problem.into(),
    }
}

/// An array of numbers, or None when the key is absent.
fn number_array<T>(
    gguf: &GgufFile,
    key: &str,
    convert: impl Fn(&MetaValue) -> Option<T>,
) -> Result<Option<Vec<T>>, TokenizerError> {
    let Some(v) = gguf.get(key) else {
        return Ok(None);
    };
    let arr = v
        .as_array()
        .ok_or_else(|| meta_err(key, format!("expected an array, found {}", v.type_name())))?;
    arr.iter()
        .enumerate()
        .map(|(i, e)| {
            convert(e).ok_or_else(|| {
                meta_err(
                    key,
                    format!("element {i} is a {}, not a number", e.type_name()),
                )
            })
        })
        .collect::<Result<Vec<T>, _>>()
        .map(Some)
}

/// A token id key: absent, or present but unusable (warned and ignored, as llama.cpp does).
fn token_id(gguf: &GgufFile, key: &str, n_tokens: usize) -> Option<u32> {
    let v = gguf.get(key)?;
    match v.as_u64() {
        Some(id) if (id as usize) < n_tokens => Some(id as u32),
        Some(id) => {
            tracing::warn!(key, id, n_tokens, "special token id out of range; ignored");
            None
        }
        None => {
            tracing::warn!(
                key,
                found = v.type_name(),
                "special token id is not an integer; ignored"
            );
            None
        }
    }
}

fn flag(gguf: &GgufFile, key: &str, default: bool) -> bool {
    match gguf.get(key) {
        None => default,
        Some(v) => v.as_bool().unwrap_or_else(|| {
            tracing::warn!(
                key,
                found = v.type_name(),
                default,
                "flag is not a boolean; using default"
            );
            default
        }),
    }
}

/// Reads the vocabulary of `gguf` and builds its parts.
pub(crate) fn read(gguf: &GgufFile) -> Result<VocabParts, TokenizerError> {
    let model = gguf
        .get_str(KEY_MODEL)
        .ok_or_else(|| meta_err(KEY_MODEL, "missing (no tokenizer in this GGUF file)"))?;
    let raw_tokens = gguf
        .get_str_array(KEY_TOKENS)
        .map_err(|e| meta_err(KEY_TOKENS, e.to_string()))?
        .ok_or_else(|| meta_err(KEY_TOKENS, "missing"))?;
    if raw_tokens.is_empty() {
        return Err(meta_err(KEY_TOKENS, "the vocabulary is empty"));
    }
    let n = raw_tokens.len();
    let tokens: Vec<String> = raw_tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                t.to_string()
            }
        })
        .collect();
    let kinds: Vec<TokenKind> = match number_array(gguf, KEY_TYPES, MetaValue::as_i64)? {
        None => vec![TokenKind::Normal; n],
        Some(types) if types.len() == n => {
            types.into_iter().map(TokenKind::from_gguf_type).collect()
        }
        Some(types) => {
            return Err(meta_err(
                KEY_TYPES,
                format!("{} entries for {n} tokens", types.len()),
            ))
        }
    };

    let mut parts = match model {
        "gpt2" => read_byte_level_bpe(gguf, tokens, kinds)?,
        "llama" => read_sentencepiece(gguf, tokens, kinds)?,
        other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
    };
    parts.eot = token_id(gguf, "tokenizer.ggml.eot_token_id", n);
    parts.eom = token_id(gguf, "tokenizer.ggml.eom_token_id", n);
    parts.pad = token_id(gguf, "tokenizer.ggml.padding_token_id", n);
    parts.add_eos = flag(gguf, "tokenizer.ggml.add_eos_token", false);
    parts.chat_template = gguf.get_str(KEY_CHAT_TEMPLATE).map(str::to_string);
    Ok(parts)
}

fn read_byte_level_bpe(
    gguf: &GgufFile,
    tokens: Vec<String>,
    kinds: Vec<TokenKind>,
) -> Result<VocabParts, TokenizerError> {
    let n = tokens.len();
    let pre_name = gguf.get_str(KEY_PRE);
    let choice = PreTokenizerKind::from_gguf_name(pre_name);
    let raw_merges = gguf
        .get_str_array(KEY_MERGES)
        .map_err(|e| meta_err(KEY_MERGES, e.to_string()))?
        .ok_or_else(|| meta_err(KEY_MERGES, "missing (required by \"gpt2\" vocabularies)"))?;

    let mut vocab = Vocab::default();
    for (id, text) in tokens.iter().enumerate() {
        vocab.insert(text.clone(), id as u32);
    }
    let missing_bytes = (0..=255u8)
        .filter(|&b| {
            let c = super::pieces::byte_to_byte_level_char(b);
            !vocab.contains_key(c.encode_utf8(&mut [0; 4]) as &str)
        })
        .count();
    if missing_bytes > 0 {
        tracing::debug!(
            missing_bytes,
            "byte-level vocabulary lacks some single-byte tokens; text with those bytes loses them"
        );
    }

    let mut merges = Vec::with_capacity(raw_merges.len());
    let mut seen = HashSet::with_capacity(raw_merges.len());
    let mut dropped = 0usize;
    for m in &raw_merges {
        // Split at the first space after the first character.
        let Some((at, _)) = m.char_indices().skip(1).find(|&(_, c)| c == ' ') else {
            dropped += 1;
            continue;
        };
        let (left, right) = (&m[..at], &m[at + 1..]);
        let joined = format!("{left}{right}");
        let usable = vocab.contains_key(left)
            && vocab.contains_key(right)
            && vocab.contains_key(joined.as_str());
        // A repeated pair keeps its first (best) rank.
        if usable && seen.insert((left, right)) {
            merges.push((left.to_string(), right.to_string()));
        } else {
            dropped += 1;
        }
    }
    if dropped > 0 {
        tracing::warn!(
            dropped,
            total = raw_merges.len(),
            "merges that are malformed, repeated or name tokens outside the vocabulary were skipped"
        );
    }
    let model = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(choice.ignore_merges)
        .build()
        .map_err(|e| TokenizerError::Build(format!("byte-level BPE: {e}")))?;
    let mut encoder = tokenizers::Tokenizer::new(model);
    encoder.with_pre_tokenizer(Some(choice.kind.build()?));

    let add_bos = flag(gguf, "tokenizer.ggml.add_bos_token", choice.add_bos_default);
    Ok(VocabParts {
        bos: token_id(gguf, "tokenizer.ggml.bos_token_id", n),
        eos: token_id(gguf, "tokenizer.ggml.eos_token_id", n),
        unk: token_id(gguf, "tokenizer.ggml.unknown_token_id", n),
        add_bos,
        description: format!("gpt2 byte-level BPE, pre-tokenizer {:?}", choice.kind),
        ..VocabParts::new(tokens, kinds, PieceStyle::ByteLevel, encoder)
    })
}

fn read_sentencepiece(
    gguf: &GgufFile,
    tokens: Vec<String>,
    mut kinds: Vec<TokenKind>,
) -> Result<VocabParts, TokenizerError> {
    let n = tokens.len();
    let scores: Vec<f32> = match number_array(gguf, KEY_SCORES, MetaValue::as_f64)? {
        Some(s) if s.len() == n => s.into_iter().map(|x| x as f32).collect(),
        Some(s) => {
            return Err(meta_err(
                KEY_SCORES,
                format!("{} scores for {n} tokens", s.len()),
            ))
        }
        None => {
            tracing::warn!("SentencePiece vocabulary without scores; merges follow token order");
            (0..n).map(|i| -(i as f32)).collect()
        }
    };
    // Older conversions carry no token types: recognise byte tokens by their text.
    if gguf.get(KEY_TYPES).is_none() {
        for (k, t) in kinds.iter_mut().zip(&tokens) {
            if super::pieces::parse_byte_token(t).is_some() {
                *k = TokenKind::Byte;
            }
        }
    }
    // llama.cpp's defaults for SentencePiece vocabularies when the ids are not given.
    let default_id = |id: u32| ((id as usize) < n).then_some(id);
    let key_present = |k: &str| gguf.get(k).is_some();
    let bos = if key_present("tokenizer.ggml.bos_token_id") {
        token_id(gguf, "tokenizer.ggml.bos_token_id", n)
    } else {
        default_id(1)
    };
    let eos = if key_present("tokenizer.ggml.eos_token_id") {
        token_id(gguf, "tokenizer.ggml.eos_token_id", n)
    } else {
        default_id(2)
    };
    let unk = if key_present("tokenizer.ggml.unknown_token_id") {
        token_id(gguf, "tokenizer.ggml.unknown_token_id", n)
    } else {
        default_id(0)
    };
    let model = spm::build_model(&tokens, &kinds, &scores, unk)?;
    let encoder = tokenizers::Tokenizer::new(model);
    let add_space_prefix = flag(gguf, "tokenizer.ggml.add_space_prefix", true);
    Ok(VocabParts {
        bos,
        eos,
        unk,
        add_bos: flag(gguf, "tokenizer.ggml.add_bos_token", true),
        fragment_prefix: if add_space_prefix {
            FragmentPrefix::SpaceMarkerWithPrefix
        } else {
            FragmentPrefix::SpaceMarker
        },
        strip_leading_space: add_space_prefix,
        description: "llama SentencePiece (score-ranked BPE)".to_string(),
        ..VocabParts::new(tokens, kinds, PieceStyle::SentencePiece, encoder)
    })
}

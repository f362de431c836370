//! Loading a Hugging Face `tokenizer.json`: its own pipeline encodes raw text, while special-token
//! matching, decoding pieces (chosen from the declared decoder) and BOS/EOS handling follow the
//! same rules as GGUF vocabularies; the GGUF can still supply the chat template and end tokens.

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;

use serde_json::Value;

use super::pieces::{parse_byte_token, PieceStyle, TokenKind};
use super::{TokenizerError, VocabParts};
use npu_gguf::GgufFile;

fn file_err(path: &Path, message: impl Into<String>) -> TokenizerError {
    TokenizerError::TokenizerFile {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// What the declared decoder does: how normal tokens become bytes, and whether the first
/// leading space of a text is dropped.
#[derive(Default)]
struct DecoderTraits {
    byte_level: bool,
    space_marker: bool,
    byte_fallback: bool,
    strip_leading_space: bool,
}

fn scan_decoder(v: &Value, t: &mut DecoderTraits) {
    match v.get("type").and_then(Value::as_str) {
        Some("ByteLevel") => t.byte_level = true,
        Some("ByteFallback") => t.byte_fallback = true,
        Some("Metaspace") => {
            t.space_marker = true;
            let scheme = v.get("prepend_scheme").and_then(Value::as_str);
            let legacy = v.get("add_prefix_space").and_then(Value::as_bool);
            if matches!(scheme, Some("always" | "first")) || legacy == Some(true) {
                t.strip_leading_space = true;
            }
        }
        Some("Replace") => {
            let pattern = v.pointer("/pattern/String").and_then(Value::as_str);
            if pattern == Some("\u{2581}") {
                t.space_marker = true;
            }
        }
        Some("Strip") => {
            let content = v.get("content").and_then(Value::as_str);
            let start = v.get("start").and_then(Value::as_u64).unwrap_or(0);
            if content == Some(" ") && start >= 1 {
                t.strip_leading_space = true;
            }
        }
        Some("Sequence") => {
            for d in v
                .get("decoders")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                scan_decoder(d, t);
            }
        }
        _ => {}
    }
}

/// Reads `path` into tokenizer parts.
pub(crate) fn read(path: &Path) -> Result<VocabParts, TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|e| file_err(path, e.to_string()))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| file_err(path, format!("not JSON: {e}")))?;
    let mut encoder = tokenizers::Tokenizer::from_str(&text)
        .map_err(|e| file_err(path, format!("not a tokenizer: {e}")))?;

    let mut traits = DecoderTraits::default();
    if let Some(d) = json.get("decoder") {
        scan_decoder(d, &mut traits);
    }
    let style = if traits.byte_level {
        PieceStyle::ByteLevel
    } else if traits.space_marker || traits.byte_fallback {
        PieceStyle::SentencePiece
    } else {
        tracing::warn!(
            path = %path.display(),
            "tokenizer.json decoder is neither byte-level nor SentencePiece; token texts are output as is"
        );
        PieceStyle::Plain
    };

    let vocab = encoder.get_vocab(true);
    let n = vocab.values().max().map_or(0, |&m| m as usize + 1);
    if n == 0 {
        return Err(file_err(path, "the vocabulary is empty"));
    }
    let mut tokens = vec![String::new(); n];
    let mut kinds = vec![TokenKind::Unused; n];
    for (t, &id) in &vocab {
        tokens[id as usize] = t.clone();
        kinds[id as usize] = TokenKind::Normal;
    }
    if traits.byte_fallback {
        for (t, k) in tokens.iter().zip(kinds.iter_mut()) {
            if *k == TokenKind::Normal && parse_byte_token(t).is_some() {
                *k = TokenKind::Byte;
            }
        }
    }
    let mut strip_flags = HashMap::new();
    for (id, added) in encoder.get_added_tokens_decoder() {
        let Some(kind) = kinds.get_mut(id as usize) else {
            continue;
        };
        *kind = if added.special {
            TokenKind::Control
        } else {
            TokenKind::UserDefined
        };
        if added.lstrip || added.rstrip {
            strip_flags.insert(id, (added.lstrip, added.rstrip));
        }
    }

    // What the post-processor adds around a sequence tells BOS and EOS.
    encoder
        .with_truncation(None)
        .map_err(|e| file_err(path, e.to_string()))?;
    encoder.with_padding(None);
    let probe = |add: bool| -> Result<Vec<u32>, TokenizerError> {
        encoder
            .encode_fast("a", add)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| file_err(path, format!("cannot encode a probe text: {e}")))
    };
    let (with, without) = (probe(true)?, probe(false)?);
    let bos = (with.len() > without.len() && with.first() != without.first()).then(|| with[0]);
    let eos =
        (with.len() > without.len() && with.last() != without.last()).then(|| with[with.len() - 1]);
    // Our own matcher handles special tokens, honouring parse_special.
    encoder.set_encode_special_tokens(true);

    let mut parts = VocabParts::new(tokens, kinds, style, encoder);
    parts.bos = bos;
    parts.eos = eos;
    parts.add_bos = bos.is_some();
    parts.add_eos = eos.is_some();
    parts.strip_leading_space = traits.strip_leading_space;
    parts.strip_flags = strip_flags;
    parts.description = format!("tokenizer.json ({})", path.display());
    Ok(parts)
}

/// Checks that the tokenizer.json describes the same vocabulary as the GGUF (same text at the
/// same id, allowing for a few renamed entries), then takes the chat template and the BOS / EOS /
/// EOT / EOM tokens the tokenizer.json does not name from the GGUF metadata.
pub(crate) fn adopt_gguf_facts(
    parts: &mut VocabParts,
    gguf: &GgufFile,
    json_path: &Path,
) -> Result<(), TokenizerError> {
    if parts.chat_template.is_none() {
        parts.chat_template = gguf.get_str("tokenizer.chat_template").map(str::to_string);
    }
    let Ok(Some(gguf_tokens)) = gguf.get_str_array("tokenizer.ggml.tokens") else {
        return Ok(());
    };
    let common = gguf_tokens.len().min(parts.tokens.len());
    let differing: Vec<usize> = (0..common)
        .filter(|&i| parts.kinds[i] != TokenKind::Unused && parts.tokens[i] != gguf_tokens[i])
        .collect();
    if let Some(&first) = differing.first() {
        let detail = format!(
            "{} of {common} tokens differ from the model's GGUF vocabulary (id {first}: {:?} here, \
             {:?} in the GGUF)",
            differing.len(),
            parts.tokens[first],
            gguf_tokens[first]
        );
        if differing.len() * 100 > common {
            return Err(file_err(
                json_path,
                format!("belongs to another model: {detail}"),
            ));
        }
        tracing::warn!(path = %json_path.display(), "{detail}");
    }
    let by_text: HashMap<&str, u32> = parts
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i as u32))
        .collect();
    let mapped = |key: &str| -> Option<u32> {
        let id = gguf.get_u64(key)? as usize;
        by_text.get(gguf_tokens.get(id)?).copied()
    };
    let slots = [
        ("tokenizer.ggml.bos_token_id", &mut parts.bos),
        ("tokenizer.ggml.eos_token_id", &mut parts.eos),
        ("tokenizer.ggml.eot_token_id", &mut parts.eot),
        ("tokenizer.ggml.eom_token_id", &mut parts.eom),
    ];
    for (key, slot) in slots {
        if slot.is_none() {
            *slot = mapped(key);
        }
    }
    Ok(())
}

//! Writing a GGUF vocabulary out as Hugging Face tokenizer files: the `tokenizer.json` of a
//! "gpt2" byte-level BPE vocabulary (the same BPE model and pre-tokenizer this crate builds
//! from the GGUF, its special tokens as added tokens, a ByteLevel decoder, BOS / EOS added by a
//! TemplateProcessing when the GGUF asks for them) and the matching `tokenizer_config.json`.
//! For test model directories and tools that make one from a GGUF file.

use serde_json::{json, Map, Value};
use tokenizers::AddedToken;

use super::pieces::TokenKind;
use super::{gguf_vocab, TokenizerError, VocabParts};
use npu_gguf::GgufFile;

const KEY_MODEL: &str = "tokenizer.ggml.model";

/// The `tokenizer.json` of a GGUF "gpt2" (byte-level BPE) vocabulary. Loaded back with
/// `Tokenizer::from_tokenizer_json` it encodes and decodes as `Tokenizer::from_gguf` does.
/// SentencePiece ("llama") vocabularies are refused: their GGUF form has no tokenizer.json
/// pipeline here.
pub fn tokenizer_json_from_gguf(gguf: &GgufFile) -> Result<Value, TokenizerError> {
    match gguf.get_str(KEY_MODEL) {
        Some("gpt2") => {}
        Some(other) => {
            return Err(TokenizerError::Metadata {
                key: KEY_MODEL.into(),
                problem: format!(
                    "{other:?}: only \"gpt2\" byte-level BPE vocabularies can be written as a \
                     tokenizer.json"
                ),
            })
        }
        None => {
            return Err(TokenizerError::Metadata {
                key: KEY_MODEL.into(),
                problem: "missing (no tokenizer in this GGUF file)".into(),
            })
        }
    }
    let parts = gguf_vocab::read(gguf)?;
    let mut encoder = parts.encoder;
    let added = |special: bool| {
        parts
            .tokens
            .iter()
            .zip(&parts.kinds)
            .filter(move |(_, &k)| match special {
                true => matches!(k, TokenKind::Control | TokenKind::Unknown),
                false => k == TokenKind::UserDefined,
            })
            .map(move |(t, _)| AddedToken::from(t.clone(), special).normalized(false))
            .collect::<Vec<_>>()
    };
    let build = |e: tokenizers::Error| TokenizerError::Build(format!("added tokens: {e}"));
    encoder.add_special_tokens(added(true)).map_err(build)?;
    encoder.add_tokens(added(false)).map_err(build)?;
    let text = encoder
        .to_string(false)
        .map_err(|e| TokenizerError::Build(format!("writing tokenizer.json: {e}")))?;
    let mut json: Value = serde_json::from_str(&text)
        .map_err(|e| TokenizerError::Build(format!("writing tokenizer.json: {e}")))?;
    json["decoder"] = json!({
        "type": "ByteLevel",
        "add_prefix_space": true,
        "trim_offsets": true,
        "use_regex": true
    });
    json["post_processor"] = post_processor(
        &parts.tokens,
        parts.bos,
        parts.eos,
        parts.add_bos,
        parts.add_eos,
    );
    Ok(json)
}

/// A TemplateProcessing adding BOS / EOS as the GGUF asks, else none.
fn post_processor(
    tokens: &[String],
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
) -> Value {
    let bos = bos.filter(|_| add_bos);
    let eos = eos.filter(|_| add_eos);
    if bos.is_none() && eos.is_none() {
        return Value::Null;
    }
    let mut special = Map::new();
    let mut piece = |id: u32| {
        let text = tokens[id as usize].clone();
        special.insert(
            text.clone(),
            json!({"id": text, "ids": [id], "tokens": [text]}),
        );
        json!({"SpecialToken": {"id": text, "type_id": 0}})
    };
    let seq = |name: &str| json!({"Sequence": {"id": name, "type_id": 0}});
    let mut single: Vec<Value> = bos.map(&mut piece).into_iter().collect();
    single.push(seq("A"));
    single.extend(eos.map(&mut piece));
    let mut pair = single.clone();
    pair.extend(bos.map(&mut piece));
    pair.push(seq("B"));
    pair.extend(eos.map(&mut piece));
    json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": special
    })
}

/// The `tokenizer_config.json` matching [`tokenizer_json_from_gguf`]: BOS / EOS / UNK / PAD
/// token texts, `add_bos_token` / `add_eos_token` and the GGUF's chat template.
pub fn tokenizer_config_from_gguf(gguf: &GgufFile) -> Result<Value, TokenizerError> {
    let parts: VocabParts = gguf_vocab::read(gguf)?;
    let text = |id: Option<u32>| {
        id.and_then(|i| parts.tokens.get(i as usize))
            .map_or(Value::Null, |t| Value::String(t.clone()))
    };
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": parts.add_bos,
        "add_eos_token": parts.add_eos,
        "bos_token": text(parts.bos),
        "eos_token": text(parts.eos),
        "unk_token": text(parts.unk),
        "pad_token": text(parts.pad),
        "clean_up_tokenization_spaces": false,
    });
    if let Some(template) = parts.chat_template {
        config["chat_template"] = Value::String(template);
    }
    Ok(config)
}

//! The tokenizer files of a Hugging Face twin, built from the GGUF's own `tokenizer.*` metadata:
//! `tokenizer.json` of a "gpt2" byte-level BPE vocabulary laid out as the SmolLM2 donor's own
//! (BPE vocab and merges, control tokens as special added tokens, the pre-tokenizer its
//! `tokenizer.ggml.pre` names, ByteLevel post-processor and decoder), and `tokenizer_config.json`
//! (special token texts, `add_bos_token`, the chat template, `added_tokens_decoder`) as
//! transformers saves them. llama.cpp's converter recognises the pre-tokenizer by how the
//! tokenizer splits a fixed text, so its layout must match the original model's exactly.

use serde_json::{json, Map, Value};

use npu_gguf::{GgufFile, MetaValue};

use super::HfTwinError;

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

fn err(problem: impl Into<String>) -> HfTwinError {
    HfTwinError::Tokenizer(problem.into())
}

/// Token texts and types of the GGUF's vocabulary ("gpt2" only).
fn vocab(g: &GgufFile) -> Result<(Vec<&str>, Vec<i64>), HfTwinError> {
    match g.get_str("tokenizer.ggml.model") {
        Some("gpt2") => {}
        Some(other) => {
            return Err(err(format!(
                "tokenizer.ggml.model {other:?}: only \"gpt2\" byte-level BPE vocabularies are \
                 written as tokenizer.json here"
            )))
        }
        None => {
            return Err(err(
                "tokenizer.ggml.model missing: the GGUF has no tokenizer",
            ))
        }
    }
    let tokens = g
        .get_str_array("tokenizer.ggml.tokens")
        .map_err(|e| err(e.to_string()))?
        .ok_or_else(|| err("tokenizer.ggml.tokens missing"))?;
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(v) => v
            .as_array()
            .ok_or_else(|| err("tokenizer.ggml.token_type is not an array"))?
            .iter()
            .map(|t| t.as_i64().unwrap_or(1))
            .collect(),
    };
    if types.len() != tokens.len() {
        return Err(err(format!(
            "{} token types for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    Ok((tokens, types))
}

/// The pre-tokenizer `tokenizer.ggml.pre` names, as the original models' tokenizer.json holds it.
fn pre_tokenizer(pre: &str) -> Result<Value, HfTwinError> {
    let byte_level = json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": true,
        "use_regex": true
    });
    match pre {
        // SmolLM / SmolLM2 and StarCoder: every digit alone, then GPT-2's split.
        "smollm" | "starcoder" => Ok(json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level
            ]
        })),
        "gpt-2" | "default" => Ok(byte_level),
        other => Err(err(format!(
            "tokenizer.ggml.pre {other:?}: no tokenizer.json pre-tokenizer is written for it \
             (smollm, starcoder, gpt-2)"
        ))),
    }
}

fn added_token(id: usize, text: &str, special: bool) -> Value {
    json!({
        "id": id,
        "content": text,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": !special,
        "special": special
    })
}

/// Whether a token of this type is an added token, and if so whether special.
fn added_kind(ty: i64) -> Option<bool> {
    match ty {
        CONTROL | UNKNOWN => Some(true),
        USER_DEFINED => Some(false),
        _ => None,
    }
}

pub(super) fn tokenizer_json(g: &GgufFile) -> Result<Value, HfTwinError> {
    let (tokens, types) = vocab(g)?;
    let pre = pre_tokenizer(g.get_str("tokenizer.ggml.pre").unwrap_or("default"))?;
    let merges: Vec<Value> = g
        .get_str_array("tokenizer.ggml.merges")
        .map_err(|e| err(e.to_string()))?
        .ok_or_else(|| err("tokenizer.ggml.merges missing"))?
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| err(format!("merge {m:?} is not two tokens")))
        })
        .collect::<Result<_, _>>()?;
    let mut vocab = Map::new();
    for (id, t) in tokens.iter().enumerate() {
        if vocab.insert(t.to_string(), json!(id)).is_some() {
            return Err(err(format!("token {t:?} appears twice")));
        }
    }
    let added: Vec<Value> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter_map(|(id, (t, &ty))| added_kind(ty).map(|s| added_token(id, t, s)))
        .collect();
    let byte_level = |prefix: bool, trim: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": trim,
               "use_regex": true})
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre,
        "post_processor": byte_level(true, false),
        "decoder": byte_level(true, true),
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges
        }
    }))
}

pub(super) fn tokenizer_config_json(g: &GgufFile) -> Result<Value, HfTwinError> {
    let (tokens, types) = vocab(g)?;
    let text = |key: &str| {
        g.get_u64(key)
            .and_then(|id| tokens.get(id as usize))
            .map_or(Value::Null, |t| json!(t))
    };
    let mut decoder = Map::new();
    for (id, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        if let Some(special) = added_kind(ty) {
            let mut a = added_token(id, t, special);
            a.as_object_mut().expect("an object").remove("id");
            decoder.insert(id.to_string(), a);
        }
    }
    let flag =
        |key: &str, default: bool| g.get(key).and_then(MetaValue::as_bool).unwrap_or(default);
    let mut c = json!({
        "add_prefix_space": false,
        "add_bos_token": flag("tokenizer.ggml.add_bos_token", false),
        "add_eos_token": flag("tokenizer.ggml.add_eos_token", false),
        "added_tokens_decoder": decoder,
        "bos_token": text("tokenizer.ggml.bos_token_id"),
        "eos_token": text("tokenizer.ggml.eos_token_id"),
        "unk_token": text("tokenizer.ggml.unknown_token_id"),
        "pad_token": text("tokenizer.ggml.padding_token_id"),
        "clean_up_tokenization_spaces": false,
        "model_max_length": 8192,
        "tokenizer_class": "GPT2Tokenizer",
        "vocab_size": tokens.len(),
    });
    if let Some(t) = g.get_str("tokenizer.chat_template") {
        c["chat_template"] = json!(t);
    }
    Ok(c)
}

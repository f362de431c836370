//! The tokenizer of a Hugging Face model directory with no GGUF, read as transformers and vLLM
//! read it: `tokenizer.json` (required) for the vocabulary and its pipeline;
//! `tokenizer_config.json` for the BOS / EOS / UNK / PAD tokens, `add_bos_token` /
//! `add_eos_token` and the chat template; `chat_template.jinja`, which wins over the config's
//! template; and `generation_config.json`'s `eos_token_id`, whose ids also end generation.
//!
//! End of generation: the config's `eos_token`, then generation_config's ids, then, as for GGUF
//! files, every special token whose text marks an end of turn or text (`<|im_end|>`,
//! `<|endoftext|>`, `<end_of_turn>`, `<|eot_id|>`, ...). vLLM stops on the first two only; the
//! third is what llama.cpp (and this crate for GGUF files) adds.
//!
//! BOS / EOS follow transformers 5: `add_bos_token` / `add_eos_token` when given, else what
//! tokenizer.json's post-processor adds. `clean_up_tokenization_spaces: true` is accepted for BPE
//! models, for which transformers skips the clean-up too (and vLLM's streamed text never has
//! it), and refused for others (WordPiece, Unigram), whose decoding here would differ.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use tokenizers::models::ModelWrapper;

use super::chat::ChatTemplate;
use super::{hf_json, TokenizerError, VocabParts};

const TOKENIZER_JSON: &str = "tokenizer.json";
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";
const GENERATION_CONFIG: &str = "generation_config.json";
const SENTENCEPIECE_MODEL: &str = "tokenizer.model";

fn file_err(path: &Path, message: impl Into<String>) -> TokenizerError {
    TokenizerError::TokenizerFile {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// What a JSON value is, for error messages.
fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A JSON file of the directory holding an object, or None when the file is absent.
fn read_object(path: &Path) -> Result<Option<Map<String, Value>>, TokenizerError> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| file_err(path, e.to_string()))?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(map)) => Ok(Some(map)),
        Ok(other) => Err(file_err(
            path,
            format!("expected a JSON object, found {}", json_type(&other)),
        )),
        Err(e) => Err(file_err(path, format!("not JSON: {e}"))),
    }
}

/// One JSON file's keys, read with errors that name the file and the key.
struct ConfigFile {
    path: PathBuf,
    map: Map<String, Value>,
}

impl ConfigFile {
    /// The value of `key`, None when absent or null (transformers treats both as unset).
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn key_err(&self, key: &str, problem: impl std::fmt::Display) -> TokenizerError {
        file_err(&self.path, format!("{key:?}: {problem}"))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, TokenizerError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.key_err(
                key,
                format!("expected true or false, found {}", json_type(v)),
            )),
        }
    }

    /// A special token: a string, or an AddedToken object `{"content": "...", ...}`.
    fn token_text(&self, key: &str) -> Result<Option<&str>, TokenizerError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(Value::Object(o)) => match o.get("content") {
                Some(Value::String(s)) => Ok(Some(s)),
                _ => Err(self.key_err(key, "an AddedToken object without a string \"content\"")),
            },
            Some(v) => Err(self.key_err(
                key,
                format!(
                    "expected a token string or an AddedToken object {{\"content\": ...}}, \
                     found {}",
                    json_type(v)
                ),
            )),
        }
    }

    /// The chat template: a string, or a list of `{name, template}` of which "default" is used.
    fn chat_template(&self, key: &str) -> Result<Option<String>, TokenizerError> {
        let list = match self.get(key) {
            None => return Ok(None),
            Some(Value::String(s)) => return Ok(Some(s.clone())),
            Some(Value::Array(list)) => list,
            Some(v) => {
                return Err(self.key_err(
                    key,
                    format!(
                        "expected a template string or a list of {{\"name\", \"template\"}}, \
                         found {}",
                        json_type(v)
                    ),
                ))
            }
        };
        let mut names = Vec::with_capacity(list.len());
        let mut default = None;
        for (i, entry) in list.iter().enumerate() {
            let name = entry.get("name").and_then(Value::as_str);
            let template = entry.get("template").and_then(Value::as_str);
            let (Some(name), Some(template)) = (name, template) else {
                return Err(self.key_err(
                    key,
                    format!("entry {i} is not an object with string \"name\" and \"template\""),
                ));
            };
            if name == "default" {
                default = Some(template.to_string());
            }
            names.push(name);
        }
        match default {
            Some(t) => Ok(Some(t)),
            None => Err(self.key_err(
                key,
                format!(
                    "a list of named templates ({}) without one named \"default\"",
                    names.join(", ")
                ),
            )),
        }
    }
}

/// Reads a model directory's tokenizer files into tokenizer parts.
pub(crate) fn read(dir: &Path) -> Result<VocabParts, TokenizerError> {
    if !dir.is_dir() {
        return Err(file_err(dir, "not a directory"));
    }
    let json_path = dir.join(TOKENIZER_JSON);
    if !json_path.is_file() {
        let message = if dir.join(SENTENCEPIECE_MODEL).is_file() {
            format!(
                "missing: the model directory {} has only a SentencePiece {SENTENCEPIECE_MODEL}, \
                 which is not supported; a {TOKENIZER_JSON} is needed (transformers writes one \
                 with AutoTokenizer.from_pretrained(dir).save_pretrained(dir))",
                dir.display()
            )
        } else {
            format!(
                "missing: the model directory {} has no {TOKENIZER_JSON}",
                dir.display()
            )
        };
        return Err(file_err(&json_path, message));
    }
    let mut parts = hf_json::read(&json_path)?;
    let config = read_object(&dir.join(TOKENIZER_CONFIG))?.map(|map| ConfigFile {
        path: dir.join(TOKENIZER_CONFIG),
        map,
    });
    if let Some(config) = &config {
        apply_tokenizer_config(&mut parts, config)?;
    }

    let jinja_path = dir.join(CHAT_TEMPLATE_JINJA);
    if jinja_path.exists() {
        let source = std::fs::read_to_string(&jinja_path)
            .map_err(|e| file_err(&jinja_path, e.to_string()))?;
        check_template(&jinja_path, &source)?;
        parts.chat_template = Some(source);
    } else if let Some(config) = &config {
        if let Some(source) = config.chat_template("chat_template")? {
            check_template(&config.path, &source)?;
            parts.chat_template = Some(source);
        }
    }

    let generation_path = dir.join(GENERATION_CONFIG);
    if let Some(map) = read_object(&generation_path)? {
        let generation = ConfigFile {
            path: generation_path,
            map,
        };
        parts.extra_eos = generation_eos_ids(&generation, parts.tokens.len())?;
    }
    parts.description = format!("Hugging Face model directory {}", dir.display());
    Ok(parts)
}

/// Takes the special tokens and BOS / EOS flags of tokenizer_config.json.
///
/// `bos_token` / `eos_token` name the tokens; `add_bos_token` / `add_eos_token`, when given,
/// decide whether they are added (as transformers rebuilds the post-processor from them; a flag
/// without its token adds nothing), otherwise tokenizer.json's post-processor decides (what
/// `hf_json::read` found by probing). A post-processor that adds a token other than the
/// config's is refused: one BOS serves both adding and the chat template's `bos_token`.
fn apply_tokenizer_config(
    parts: &mut VocabParts,
    config: &ConfigFile,
) -> Result<(), TokenizerError> {
    let id_of = |key: &str| -> Result<Option<u32>, TokenizerError> {
        let Some(text) = config.token_text(key)? else {
            return Ok(None);
        };
        match parts.encoder.token_to_id(text) {
            Some(id) => Ok(Some(id)),
            None => Err(config.key_err(
                key,
                format!("the token {text:?} is not in the vocabulary of {TOKENIZER_JSON}"),
            )),
        }
    };
    let (bos, eos) = (id_of("bos_token")?, id_of("eos_token")?);
    let (unk, pad) = (id_of("unk_token")?, id_of("pad_token")?);
    let slots = [
        (
            "bos_token",
            "add_bos_token",
            bos,
            &mut parts.bos,
            &mut parts.add_bos,
        ),
        (
            "eos_token",
            "add_eos_token",
            eos,
            &mut parts.eos,
            &mut parts.add_eos,
        ),
    ];
    for (token_key, flag_key, configured, slot, add) in slots {
        let post_processed = *slot;
        match config.bool(flag_key)? {
            Some(flag) => *add = flag,
            None => {
                if let (Some(p), Some(c)) = (post_processed, configured) {
                    if p != c {
                        return Err(config.key_err(
                            token_key,
                            format!(
                                "id {c} ({:?}), but {TOKENIZER_JSON}'s post_processor adds id {p} \
                                 ({:?}) and {flag_key:?} does not say otherwise",
                                parts.tokens[c as usize], parts.tokens[p as usize]
                            ),
                        ));
                    }
                }
            }
        }
        *slot = configured.or(post_processed);
        if *add && slot.is_none() {
            // transformers drops the flag when there is no token to add.
            tracing::warn!(
                path = %config.path.display(),
                "{flag_key} is true but there is no {token_key}; nothing is added"
            );
            *add = false;
        }
    }
    parts.unk = unk.or(parts.unk);
    parts.pad = pad.or(parts.pad);

    // transformers skips the clean-up for BPE models (it would remove real spaces before
    // punctuation), and vLLM's streamed text never has it; other models would need it.
    let cleanup = "clean_up_tokenization_spaces";
    if config.bool(cleanup)? == Some(true)
        && !matches!(parts.encoder.get_model(), ModelWrapper::BPE(_))
    {
        return Err(config.key_err(
            cleanup,
            format!(
                "true for a {TOKENIZER_JSON} model that is not BPE: removing spaces before \
                 punctuation when decoding is not supported"
            ),
        ));
    }
    Ok(())
}

/// Compiles a chat template once at load, so that a broken one is reported with its file.
fn check_template(path: &Path, source: &str) -> Result<(), TokenizerError> {
    match ChatTemplate::new(source, "", "") {
        Ok(_) => Ok(()),
        Err(e) => Err(file_err(path, format!("chat template: {e}"))),
    }
}

/// generation_config.json's `eos_token_id`: an id or a list of ids (absent or null: none).
fn generation_eos_ids(
    generation: &ConfigFile,
    vocab_size: usize,
) -> Result<Vec<u32>, TokenizerError> {
    const KEY: &str = "eos_token_id";
    let one = |v: &Value| -> Result<u32, TokenizerError> {
        match v.as_u64().and_then(|id| u32::try_from(id).ok()) {
            Some(id) => Ok(id),
            None => Err(generation.key_err(
                KEY,
                format!(
                    "expected a token id or a list of token ids, found {} ({v})",
                    json_type(v)
                ),
            )),
        }
    };
    let ids = match generation.get(KEY) {
        None => Vec::new(),
        Some(Value::Array(list)) => list.iter().map(one).collect::<Result<_, _>>()?,
        Some(v) => vec![one(v)?],
    };
    let mut seen = HashSet::new();
    let ids: Vec<u32> = ids.into_iter().filter(|id| seen.insert(*id)).collect();
    for &id in &ids {
        if id as usize >= vocab_size {
            // The model's embedding can be larger than the tokenizer's vocabulary; such an id
            // still ends generation if the model produces it.
            tracing::warn!(
                path = %generation.path.display(),
                id,
                vocab_size,
                "eos_token_id is outside the tokenizer's vocabulary"
            );
        }
    }
    Ok(ids)
}

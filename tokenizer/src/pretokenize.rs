//! Pre-tokenizers of GPT-2 style byte-level BPE vocabularies, chosen by GGUF `tokenizer.ggml.pre`.
//! Each kind reproduces the word splitting llama.cpp applies for that name, built from the
//! `tokenizers` crate's Split / Digits / ByteLevel pre-tokenizers.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use super::TokenizerError;

/// GPT-2's word pattern (contractions, letters, numbers, other symbols, whitespace runs), as
/// llama.cpp's "default" list writes it (without the final `|\s+`, which never changes splits
/// because unmatched text is kept as its own piece).
const GPT2_WORDS: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3 word pattern with the case-insensitive contractions spelled out as llama.cpp does.
const LLAMA3_WORDS: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2 word pattern: as Llama 3 but every digit stands alone.
const QWEN2_WORDS: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a byte-level BPE vocabulary splits text into words before merging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// GPT-2 regex ("gpt-2", "mpt", "olmo", "phi-2", ...; also the fallback for unknown names).
    Gpt2,
    /// llama.cpp's "default": punctuation runs, GPT-2 words, number runs, then groups of 3 digits.
    LlamaCppDefault,
    /// Every digit alone, then the GPT-2 regex ("smollm", "starcoder", "refact", "command-r", ...).
    DigitsThenGpt2,
    /// Llama 3 regex ("llama3", "llama-bpe", "llama-v3", "falcon3", "dbrx", "smaug-bpe", ...).
    Llama3,
    /// Qwen2 regex ("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez", ...).
    Qwen2,
}

/// What a `tokenizer.ggml.pre` name implies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PreTokenizerChoice {
    pub kind: PreTokenizerKind,
    /// Whole words found in the vocabulary skip merging (Llama 3 family).
    pub ignore_merges: bool,
    /// BOS is added unless `tokenizer.ggml.add_bos_token` says otherwise.
    pub add_bos_default: bool,
}

impl PreTokenizerKind {
    /// Maps a GGUF pre-tokenizer name; unknown or missing names fall back to GPT-2 with a warning.
    pub(crate) fn from_gguf_name(name: Option<&str>) -> PreTokenizerChoice {
        let plain = |kind| PreTokenizerChoice {
            kind,
            ignore_merges: false,
            add_bos_default: false,
        };
        match name {
            Some("default") => plain(Self::LlamaCppDefault),
            Some(
                "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "gigachat" | "trillion" | "exaone4"
                | "granite-docling" | "mellum" | "jina-es" | "jina-de" | "a.x-4.0",
            ) => plain(Self::Gpt2),
            Some(
                "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
                | "minerva-7b",
            ) => plain(Self::DigitsThenGpt2),
            Some(
                "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
                | "midm-2.0" | "lfm2",
            ) => PreTokenizerChoice {
                kind: Self::Llama3,
                ignore_merges: true,
                add_bos_default: true,
            },
            Some("dbrx" | "smaug-bpe") => plain(Self::Llama3),
            Some(
                "qwen2" | "deepseek-r1-qwen" | "kormo" | "stablelm2" | "megrez" | "hunyuan"
                | "solar-open",
            ) => plain(Self::Qwen2),
            other => {
                tracing::warn!(
                    pre = other.unwrap_or("<missing>"),
                    "unknown tokenizer.ggml.pre; splitting words with the GPT-2 pattern, \
                     token ids may differ from the model's own tokenizer"
                );
                plain(Self::Gpt2)
            }
        }
    }

    /// The `tokenizers` pre-tokenizer that splits words and maps bytes to byte-level characters.
    pub(crate) fn build(self) -> Result<PreTokenizerWrapper, TokenizerError> {
        let regex = |pattern: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
            let split = Split::new(
                SplitPattern::Regex(pattern.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TokenizerError::Build(format!("pre-tokenizer regex {pattern:?}: {e}")))?;
            Ok(split.into())
        };
        // Byte mapping only; the splitting is done by the steps before it.
        let bytes_only = || -> PreTokenizerWrapper { ByteLevel::new(false, false, false).into() };
        let steps: Vec<PreTokenizerWrapper> = match self {
            // ByteLevel's own regex is the GPT-2 pattern.
            Self::Gpt2 => vec![ByteLevel::new(false, false, true).into()],
            Self::DigitsThenGpt2 => vec![
                Digits::new(true).into(),
                ByteLevel::new(false, false, true).into(),
            ],
            Self::LlamaCppDefault => vec![
                regex(r"[\p{P}\$\+<=>\^~\|]+")?,
                regex(GPT2_WORDS)?,
                regex(r"\p{N}+")?,
                regex(r"[0-9][0-9][0-9]")?,
                bytes_only(),
            ],
            Self::Llama3 => vec![regex(LLAMA3_WORDS)?, bytes_only()],
            Self::Qwen2 => vec![regex(QWEN2_WORDS)?, bytes_only()],
        };
        Ok(Sequence::new(steps).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn words(kind: PreTokenizerKind, text: &str) -> Vec<String> {
        let pt = kind.build().unwrap();
        let mut s = PreTokenizedString::from(text);
        pt.pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(w, _, _)| w.to_string())
            .collect()
    }

    #[test]
    fn names_map_to_kinds() {
        let c = PreTokenizerKind::from_gguf_name(Some("smollm"));
        assert_eq!(c.kind, PreTokenizerKind::DigitsThenGpt2);
        assert!(!c.add_bos_default && !c.ignore_merges);
        let c = PreTokenizerKind::from_gguf_name(Some("llama-bpe"));
        assert_eq!(c.kind, PreTokenizerKind::Llama3);
        assert!(c.add_bos_default && c.ignore_merges);
        assert_eq!(
            PreTokenizerKind::from_gguf_name(Some("no-such-pre")).kind,
            PreTokenizerKind::Gpt2
        );
        assert_eq!(
            PreTokenizerKind::from_gguf_name(None).kind,
            PreTokenizerKind::Gpt2
        );
    }

    #[test]
    fn digits_then_gpt2_isolates_each_digit() {
        // 'Ġ' is the byte-level form of a space.
        assert_eq!(
            words(PreTokenizerKind::DigitsThenGpt2, "ab 123, x"),
            vec!["ab", "Ġ", "1", "2", "3", ",", "Ġx"]
        );
        assert_eq!(
            words(PreTokenizerKind::Gpt2, "ab 123, x"),
            vec!["ab", "Ġ123", ",", "Ġx"]
        );
    }

    #[test]
    fn llama3_groups_three_digits_and_keeps_newlines_together() {
        assert_eq!(
            words(PreTokenizerKind::Llama3, "12345 I'M\n\nok"),
            vec!["123", "45", "ĠI", "'M", "ĊĊ", "ok"]
        );
        assert_eq!(
            words(PreTokenizerKind::Qwen2, "123 a"),
            vec!["1", "2", "3", "Ġa"]
        );
    }

    #[test]
    fn llama_cpp_default_splits_punctuation_and_digit_groups() {
        assert_eq!(
            words(PreTokenizerKind::LlamaCppDefault, "x!! 12345"),
            vec!["x", "!!", "Ġ", "123", "45"]
        );
    }
}

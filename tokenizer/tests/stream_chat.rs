//! Streaming detokenization and the chat template of the default model (SmolLM2-135M-Instruct):
//! token-by-token text equals whole decoding, split characters are held back, and the model's
//! own ChatML template renders exactly.

use std::path::PathBuf;
use std::sync::OnceLock;

use npu_gguf::GgufFile;
use npu_tokenizer::{ChatMessage, Tokenizer};
use proptest::prelude::*;
use serde_json::Value;

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model file, or None (after a loud notice) when it is absent and that is allowed.
fn model_path() -> Option<PathBuf> {
    let path = match std::env::var_os("NPU_SERVING_MODEL") {
        Some(p) => PathBuf::from(p),
        None => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/npu-serving/models").join(MODEL_FILE)
        }
    };
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("NPU_SERVING_ALLOW_NO_MODEL").as_deref() == Ok("1") {
        eprintln!(
            "\n!!!!! SKIPPING tokenizer stream/chat test: model not found at {} !!!!!\n",
            path.display()
        );
        return None;
    }
    panic!(
        "model not found at {}: set NPU_SERVING_MODEL, or NPU_SERVING_ALLOW_NO_MODEL=1 to skip",
        path.display()
    );
}

fn tokenizer() -> Option<&'static Tokenizer> {
    static TOK: OnceLock<Option<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = model_path()?;
        let gguf = GgufFile::open(&path).expect("open model");
        Some(Tokenizer::from_gguf(&gguf).expect("tokenizer from GGUF"))
    })
    .as_ref()
}

fn mixed_texts() -> Vec<(String, String)> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/mixed_oracle.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).expect("oracle JSON");
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["text"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Pushes every id, checking the held-back state stays within one character.
fn stream_text(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> (Vec<String>, String) {
    let mut stream = tok.decode_stream(skip_special);
    let mut chunks = Vec::with_capacity(ids.len());
    for &id in ids {
        chunks.push(stream.push(id));
        assert!(stream.pending_bytes().len() <= 3, "{stream:?}");
    }
    let rest = stream.flush();
    assert!(stream.pending_bytes().is_empty());
    (chunks, rest)
}

#[test]
fn stream_of_mixed_text_equals_whole_decode() {
    let Some(tok) = tokenizer() else { return };
    let mut held_back_somewhere = false;
    for (name, text) in mixed_texts() {
        let ids = tok.encode(&text).unwrap();
        for skip in [false, true] {
            let (chunks, rest) = stream_text(tok, &ids, skip);
            assert_eq!(rest, "", "case {name}: valid text leaves nothing to flush");
            assert!(
                chunks.iter().all(|c| !c.contains('\u{fffd}')),
                "case {name}: a chunk has a replacement character"
            );
            let joined: String = chunks.concat();
            assert_eq!(joined, tok.decode(&ids, skip), "case {name}");
            if !skip {
                assert_eq!(joined, text, "case {name}");
            }
            // A token that adds bytes but yields no text holds part of a character.
            held_back_somewhere |= ids
                .iter()
                .zip(&chunks)
                .any(|(&id, c)| c.is_empty() && !tok.token_bytes(id).unwrap().is_empty());
        }
    }
    assert!(held_back_somewhere, "no character was split over tokens");
}

#[test]
fn emoji_split_over_byte_tokens_is_held_until_complete() {
    let Some(tok) = tokenizer() else { return };
    // A rare emoji comes out as several tokens, none of which is a whole character.
    let text = "x \u{1F9EC} y";
    let ids = tok.encode(text).unwrap();
    let (chunks, rest) = stream_text(tok, &ids, true);
    assert_eq!(rest, "");
    assert_eq!(chunks.concat(), text);
    let emoji_chunk = chunks.iter().position(|c| c.contains('\u{1F9EC}')).unwrap();
    assert!(
        chunks[..emoji_chunk]
            .iter()
            .rev()
            .take_while(|c| c.is_empty())
            .count()
            >= 1,
        "emoji bytes were spread over tokens: {chunks:?}"
    );
}

#[test]
fn default_chat_template_renders_chatml() {
    let Some(tok) = tokenizer() else { return };
    let template = tok.chat_template().unwrap();
    assert!(!template.is_fallback());
    let conversation = [
        ChatMessage::system("You are a pirate."),
        ChatMessage::user("Where is the treasure?"),
    ];
    let prompt = template.render(&conversation, true).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a pirate.<|im_end|>\n\
         <|im_start|>user\nWhere is the treasure?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    // Without a system message the template supplies its own.
    let prompt = template.render(&[ChatMessage::user("Hi")], false).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n"
    );
    // The rendered prompt tokenizes with the control tokens recognised.
    let ids = tok.encode(&prompt).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 2);
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 2);
    assert_eq!(tok.decode(&ids, false), prompt);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn stream_equals_decode_for_any_ids(
        ids in proptest::collection::vec(0u32..49_200, 0..48),
        skip in any::<bool>(),
    ) {
        let Some(tok) = tokenizer() else { return Ok(()) };
        let (chunks, rest) = stream_text(tok, &ids, skip);
        prop_assert_eq!(chunks.concat() + &rest, tok.decode(&ids, skip));
        let mut cont = tok.decode_stream_continuation(skip);
        let mut text: String = ids.iter().map(|&id| cont.push(id)).collect();
        text.push_str(&cont.flush());
        prop_assert_eq!(text, tok.decode_continuation(&ids, skip));
    }
}

//! Tokenizers built from small synthetic GGUF files written here: a SentencePiece ("llama")
//! vocabulary with scores and byte fallback, a tiny byte-level BPE, metadata errors, and a
//! `tokenizer.json` beside the model taking precedence. Expected ids are worked out by hand; the
//! SentencePiece ones were also confirmed with llama.cpp (llama-cpp-python 0.3.36, vocab only)
//! on a GGUF holding the same vocabulary.

use std::path::{Path, PathBuf};

use npu_gguf::GgufFile;
use npu_tokenizer::{TokenKind, Tokenizer, TokenizerError};

// ---------------------------------------------------------------- minimal GGUF writer

enum Meta {
    Str(String),
    U32(u32),
    Bool(bool),
    StrArr(Vec<String>),
    I32Arr(Vec<i32>),
    F32Arr(Vec<f32>),
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_array_header(buf: &mut Vec<u8>, elem_type: u32, n: usize) {
    buf.extend_from_slice(&9u32.to_le_bytes());
    buf.extend_from_slice(&elem_type.to_le_bytes());
    buf.extend_from_slice(&(n as u64).to_le_bytes());
}

/// GGUF v3 bytes with the given metadata and no tensors.
fn gguf_bytes(kvs: &[(&str, Meta)]) -> Vec<u8> {
    let mut buf = b"GGUF".to_vec();
    buf.extend_from_slice(&3u32.to_le_bytes());
    buf.extend_from_slice(&0u64.to_le_bytes());
    buf.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for (key, value) in kvs {
        put_str(&mut buf, key);
        match value {
            Meta::Str(s) => {
                buf.extend_from_slice(&8u32.to_le_bytes());
                put_str(&mut buf, s);
            }
            Meta::U32(v) => {
                buf.extend_from_slice(&4u32.to_le_bytes());
                buf.extend_from_slice(&v.to_le_bytes());
            }
            Meta::Bool(v) => {
                buf.extend_from_slice(&7u32.to_le_bytes());
                buf.push(*v as u8);
            }
            Meta::StrArr(items) => {
                put_array_header(&mut buf, 8, items.len());
                for s in items {
                    put_str(&mut buf, s);
                }
            }
            Meta::I32Arr(items) => {
                put_array_header(&mut buf, 5, items.len());
                for v in items {
                    buf.extend_from_slice(&v.to_le_bytes());
                }
            }
            Meta::F32Arr(items) => {
                put_array_header(&mut buf, 6, items.len());
                for v in items {
                    buf.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    buf
}

/// A scratch directory unique to one test.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("npu-tokenizer-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_gguf(dir: &Path, kvs: &[(&str, Meta)]) -> PathBuf {
    let path = dir.join("model.gguf");
    std::fs::write(&path, gguf_bytes(kvs)).unwrap();
    path
}

fn open(name: &str, kvs: &[(&str, Meta)]) -> Result<Tokenizer, TokenizerError> {
    let dir = scratch_dir(name);
    let gguf = GgufFile::open(write_gguf(&dir, kvs)).expect("synthetic GGUF opens");
    let result = Tokenizer::from_gguf(&gguf);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn strs(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

// ---------------------------------------------------------------- SentencePiece vocabulary

/// Ids: 0 <unk>, 1 <s>, 2 </s>, 3..=258 byte tokens <0x00>..<0xFF>, then the pieces below.
const SPM_PIECES: &[(&str, f32)] = &[
    ("\u{2581}", -1.0),       // 259
    ("h", -2.0),              // 260
    ("e", -2.0),              // 261
    ("l", -2.0),              // 262
    ("o", -2.0),              // 263
    ("w", -2.0),              // 264
    ("r", -2.0),              // 265
    ("d", -2.0),              // 266
    ("a", -2.0),              // 267
    ("b", -2.0),              // 268
    ("c", -2.0),              // 269
    ("he", -10.0),            // 270
    ("ll", -11.0),            // 271
    ("hell", -12.0),          // 272
    ("hello", -13.0),         // 273
    ("\u{2581}hello", -14.0), // 274
    ("or", -15.0),            // 275
    ("ld", -16.0),            // 276
    ("\u{2581}w", -20.0),     // 277
    ("\u{2581}wor", -21.0),   // 278
    ("\u{2581}world", -22.0), // 279
    ("ab", -30.0),            // 280
    ("bc", -29.0),            // 281
    ("<tool>", 0.0),          // 282, user-defined
];

const BYTE0: u32 = 3;
const SPACE: u32 = 259;
const H: u32 = 260;
const A: u32 = 267;
const HELLO: u32 = 273;
const SP_HELLO: u32 = 274;
const SP_WORLD: u32 = 279;
const BC: u32 = 281;
const TOOL: u32 = 282;

fn spm_metadata(add_space_prefix: Option<bool>) -> Vec<(&'static str, Meta)> {
    let mut tokens = strs(&["<unk>", "<s>", "</s>"]);
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for &(text, score) in SPM_PIECES {
        tokens.push(text.to_string());
        types.push(if text == "<tool>" { 4 } else { 1 });
        scores.push(score);
    }
    let mut kvs = vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("tokenizer.ggml.model", Meta::Str("llama".into())),
        ("tokenizer.ggml.tokens", Meta::StrArr(tokens)),
        ("tokenizer.ggml.scores", Meta::F32Arr(scores)),
        ("tokenizer.ggml.token_type", Meta::I32Arr(types)),
        ("tokenizer.ggml.bos_token_id", Meta::U32(1)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(2)),
        ("tokenizer.ggml.unknown_token_id", Meta::U32(0)),
    ];
    if let Some(flag) = add_space_prefix {
        kvs.push(("tokenizer.ggml.add_space_prefix", Meta::Bool(flag)));
    }
    kvs
}

fn byte(b: u8) -> u32 {
    BYTE0 + b as u32
}

#[test]
fn spm_merges_follow_scores() {
    let tok = open("spm-merge", &spm_metadata(None)).unwrap();
    assert_eq!(tok.vocab_size(), 283);
    // "▁hello▁world": he, ll, hell, hello, ▁hello, or, ld, ▁w, ▁wor, ▁world (by score).
    assert_eq!(
        tok.encode_with("hello world", false, true).unwrap(),
        vec![SP_HELLO, SP_WORLD]
    );
    // BOS is added by default for SentencePiece vocabularies.
    assert!(tok.adds_bos());
    assert_eq!(
        tok.encode("hello world").unwrap(),
        vec![1, SP_HELLO, SP_WORLD]
    );
    // "bc" scores better than "ab": a + bc, not ab + c.
    assert_eq!(
        tok.encode_with("abc", false, true).unwrap(),
        vec![SPACE, A, BC]
    );
}

#[test]
fn spm_unknown_characters_fall_back_to_bytes() {
    let tok = open("spm-bytes", &spm_metadata(None)).unwrap();
    // 'i' is not a piece: its byte token; "😀" is four byte tokens.
    assert_eq!(
        tok.encode_with("hi \u{1F600}", false, true).unwrap(),
        vec![
            SPACE,
            H,
            byte(b'i'),
            SPACE,
            byte(0xF0),
            byte(0x9F),
            byte(0x98),
            byte(0x80)
        ]
    );
    let ids = tok.encode_with("hi \u{1F600}", false, true).unwrap();
    assert_eq!(tok.decode(&ids, false), "hi \u{1F600}");
    assert_eq!(tok.token_kind(byte(b'i')), Some(TokenKind::Byte));
    // Streaming holds the emoji's bytes until the last one arrives.
    let mut stream = tok.decode_stream(true);
    let chunks: Vec<String> = ids.iter().map(|&id| stream.push(id)).collect();
    assert_eq!(chunks, vec!["", "h", "i", " ", "", "", "", "\u{1F600}"]);
    assert_eq!(stream.flush(), "");
}

#[test]
fn spm_special_and_user_defined_tokens() {
    let tok = open("spm-special", &spm_metadata(None)).unwrap();
    // Every text fragment gets the space prefix, also after a special token.
    assert_eq!(
        tok.encode_with("<s>hello</s>", false, true).unwrap(),
        vec![1, SP_HELLO, 2]
    );
    // Without special parsing "<s>" is text (bytes here), but "<tool>" is user-defined and
    // always matched.
    assert_eq!(
        tok.encode_with("<s><tool>", false, false).unwrap(),
        vec![SPACE, byte(b'<'), byte(b's'), byte(b'>'), TOOL]
    );
    assert!(tok.is_special(1) && !tok.is_special(TOOL));
    assert_eq!(tok.eos_ids(), &[2]);
}

#[test]
fn spm_decoding_drops_the_prefix_space_once() {
    let tok = open("spm-decode", &spm_metadata(None)).unwrap();
    let ids = [1, SP_HELLO, SP_WORLD, 2];
    assert_eq!(tok.decode(&ids, true), "hello world");
    assert_eq!(tok.decode(&ids, false), "<s> hello world</s>");
    assert_eq!(tok.decode_continuation(&ids[1..3], true), " hello world");
    for skip in [false, true] {
        let mut stream = tok.decode_stream(skip);
        let mut text: String = ids.iter().map(|&id| stream.push(id)).collect();
        text.push_str(&stream.flush());
        assert_eq!(text, tok.decode(&ids, skip));
    }
}

#[test]
fn spm_without_space_prefix() {
    let tok = open("spm-noprefix", &spm_metadata(Some(false))).unwrap();
    assert_eq!(
        tok.encode_with("hello world", false, true).unwrap(),
        vec![HELLO, SP_WORLD]
    );
    assert_eq!(tok.decode(&[HELLO, SP_WORLD], true), "hello world");
}

// ---------------------------------------------------------------- tiny byte-level BPE

/// Ids 0..=255: the byte-level character of each byte (in byte order); then merged tokens and
/// specials.
fn byte_level_char(b: u8) -> char {
    let printable = |x: u32| {
        (0x21..=0x7e).contains(&x) || (0xa1..=0xac).contains(&x) || (0xae..=0xff).contains(&x)
    };
    if printable(b as u32) {
        return b as char;
    }
    let n = (0..b as u32).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(0x100 + n).unwrap()
}

const G_T: u32 = 256; // "Ġt"
const HE: u32 = 257; // "he"
const G_THE: u32 = 258; // "Ġthe"
const END: u32 = 259; // "<|end|>" control
const TOOL_BPE: u32 = 260; // "<tool>" user-defined

fn bpe_metadata(pre: Option<&str>, merges: &[&str]) -> Vec<(&'static str, Meta)> {
    let mut tokens: Vec<String> = (0..=255u8)
        .map(|b| byte_level_char(b).to_string())
        .collect();
    tokens.extend(strs(&["\u{120}t", "he", "\u{120}the", "<|end|>", "<tool>"]));
    let mut types = vec![1; 259];
    types.extend([3, 4]);
    let mut kvs = vec![
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.tokens", Meta::StrArr(tokens)),
        ("tokenizer.ggml.token_type", Meta::I32Arr(types)),
        ("tokenizer.ggml.merges", Meta::StrArr(strs(merges))),
        ("tokenizer.ggml.eos_token_id", Meta::U32(END)),
        ("tokenizer.ggml.bos_token_id", Meta::U32(END)),
        (
            "tokenizer.chat_template",
            Meta::Str("{{ messages[0].content }}!".into()),
        ),
    ];
    if let Some(pre) = pre {
        kvs.push(("tokenizer.ggml.pre", Meta::Str(pre.into())));
    }
    kvs
}

const MERGES: &[&str] = &["\u{120} t", "h e", "\u{120}t he"];

#[test]
fn byte_level_bpe_merges_and_specials() {
    let tok = open("bpe", &bpe_metadata(Some("gpt-2"), MERGES)).unwrap();
    assert!(!tok.adds_bos());
    assert_eq!(tok.encode(" the").unwrap(), vec![G_THE]);
    assert_eq!(tok.encode("the").unwrap(), vec![b't' as u32, HE]);
    assert_eq!(
        tok.encode("x<|end|> the<tool>").unwrap(),
        vec![b'x' as u32, END, G_THE, TOOL_BPE]
    );
    // Without special parsing the control text is plain bytes; user-defined still matches.
    let plain = tok.encode_with("<|end|><tool>", false, false).unwrap();
    assert_eq!(plain.len(), 8);
    assert_eq!(plain[7], TOOL_BPE);
    assert_eq!(tok.decode(&plain, true), "<|end|><tool>");
    assert_eq!(tok.decode(&[G_THE, END], false), " the<|end|>");
    assert_eq!(tok.decode(&[G_THE, END, TOOL_BPE], true), " the<tool>");
    assert_eq!(tok.eos_ids(), &[END]);
    // Digits are not split for "gpt-2" but are for "smollm".
    assert_eq!(tok.encode("12").unwrap().len(), 2); // no "12" token either way
    let smol = open("bpe-smol", &bpe_metadata(Some("smollm"), MERGES)).unwrap();
    assert_eq!(smol.encode(" the").unwrap(), vec![G_THE]);
}

#[test]
fn byte_level_bpe_unknown_pre_falls_back_and_bad_merges_are_skipped() {
    let merges = &["\u{120} t", "h e", "\u{120}t he", "no-space", "x y", "h e"];
    let tok = open("bpe-unknown", &bpe_metadata(Some("no-such-pre"), merges)).unwrap();
    assert_eq!(tok.encode(" the").unwrap(), vec![G_THE]);
    let tok = open("bpe-nopre", &bpe_metadata(None, MERGES)).unwrap();
    assert_eq!(tok.encode(" the").unwrap(), vec![G_THE]);
}

#[test]
fn byte_level_stream_holds_split_characters() {
    let tok = open("bpe-stream", &bpe_metadata(Some("gpt-2"), MERGES)).unwrap();
    // "é" is two bytes; as single-byte tokens the first must be held back.
    let ids = tok.encode("é").unwrap();
    assert_eq!(ids, vec![0xC3, 0xA9]);
    let mut stream = tok.decode_stream(false);
    assert_eq!(stream.push(ids[0]), "");
    assert_eq!(stream.pending_bytes(), &[0xC3]);
    assert_eq!(stream.push(ids[1]), "é");
    // An invalid sequence becomes U+FFFD as in decode; a dangling byte is flushed lossily.
    let odd = [0xC3, b'a' as u32, 0xC3];
    let mut stream = tok.decode_stream(false);
    let mut text: String = odd.iter().map(|&id| stream.push(id)).collect();
    assert_eq!(text, "\u{fffd}a");
    text.push_str(&stream.flush());
    assert_eq!(text, tok.decode(&odd, false));
    assert_eq!(text, "\u{fffd}a\u{fffd}");
}

#[test]
fn chat_template_comes_from_metadata() {
    let tok = open("bpe-chat", &bpe_metadata(Some("gpt-2"), MERGES)).unwrap();
    let t = tok.chat_template().unwrap();
    assert!(!t.is_fallback());
    let msg = npu_tokenizer::ChatMessage::user("hey");
    assert_eq!(t.render(&[msg], true).unwrap(), "hey!");
}

// ---------------------------------------------------------------- metadata errors

fn expect_metadata_error(name: &str, kvs: &[(&str, Meta)], key: &str) {
    match open(name, kvs) {
        Err(TokenizerError::Metadata { key: k, problem }) => {
            assert_eq!(k, key, "problem: {problem}")
        }
        Err(other) => panic!("{name}: expected a metadata error on {key}, got {other}"),
        Ok(_) => panic!("{name}: expected a metadata error on {key}, got a tokenizer"),
    }
}

#[test]
fn bad_metadata_is_a_clear_error() {
    expect_metadata_error(
        "err-nomodel",
        &[("tokenizer.ggml.tokens", Meta::StrArr(strs(&["a"])))],
        "tokenizer.ggml.model",
    );
    expect_metadata_error(
        "err-notokens",
        &[("tokenizer.ggml.model", Meta::Str("gpt2".into()))],
        "tokenizer.ggml.tokens",
    );
    expect_metadata_error(
        "err-tokens-type",
        &[
            ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
            ("tokenizer.ggml.tokens", Meta::I32Arr(vec![1, 2])),
        ],
        "tokenizer.ggml.tokens",
    );
    expect_metadata_error(
        "err-types-len",
        &[
            ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
            ("tokenizer.ggml.tokens", Meta::StrArr(strs(&["a", "b"]))),
            ("tokenizer.ggml.token_type", Meta::I32Arr(vec![1])),
        ],
        "tokenizer.ggml.token_type",
    );
    expect_metadata_error(
        "err-nomerges",
        &[
            ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
            ("tokenizer.ggml.tokens", Meta::StrArr(strs(&["a", "b"]))),
        ],
        "tokenizer.ggml.merges",
    );
    expect_metadata_error(
        "err-scores-len",
        &[
            ("tokenizer.ggml.model", Meta::Str("llama".into())),
            ("tokenizer.ggml.tokens", Meta::StrArr(strs(&["a", "b"]))),
            ("tokenizer.ggml.scores", Meta::F32Arr(vec![0.0])),
        ],
        "tokenizer.ggml.scores",
    );
    // BOS requested but the vocabulary is too small to have the default BOS id 1.
    expect_metadata_error(
        "err-bos",
        &[
            ("tokenizer.ggml.model", Meta::Str("llama".into())),
            ("tokenizer.ggml.tokens", Meta::StrArr(strs(&["a"]))),
        ],
        "tokenizer.ggml.add_bos_token",
    );
    match open(
        "err-model",
        &[
            ("tokenizer.ggml.model", Meta::Str("bert".into())),
            ("tokenizer.ggml.tokens", Meta::StrArr(strs(&["a"]))),
        ],
    ) {
        Err(TokenizerError::UnsupportedModel(m)) => assert_eq!(m, "bert"),
        other => panic!("expected UnsupportedModel, got {other:?}"),
    }
}

// ---------------------------------------------------------------- tokenizer.json beside the model

/// A tokenizer.json with the same byte-level vocabulary but without the "Ġt he" merge;
/// `shift` moves the byte tokens to other ids (a vocabulary of another model).
fn tokenizer_json(shift: u8) -> String {
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(
            byte_level_char(b.wrapping_add(shift)).to_string(),
            (b as u32).into(),
        );
    }
    vocab.insert("\u{120}t".into(), G_T.into());
    vocab.insert("he".into(), HE.into());
    vocab.insert("\u{120}the".into(), G_THE.into());
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            {"id": END, "content": "<|end|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true},
            {"id": TOOL_BPE, "content": "<tool>", "single_word": false, "lstrip": false,
             "rstrip": true, "normalized": false, "special": false}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                          "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": [["\u{120}", "t"], ["h", "e"]]}
    });
    serde_json::to_string(&json).unwrap()
}

#[test]
fn tokenizer_json_beside_the_model_is_preferred() {
    let dir = scratch_dir("json");
    let model = write_gguf(&dir, &bpe_metadata(Some("gpt-2"), MERGES));
    let gguf = GgufFile::open(&model).unwrap();
    // Without tokenizer.json: the GGUF vocabulary (with the "Ġt he" merge).
    let from_gguf = Tokenizer::for_model(&gguf, &model).unwrap();
    assert_eq!(from_gguf.encode(" the").unwrap(), vec![G_THE]);

    std::fs::write(dir.join("tokenizer.json"), tokenizer_json(0)).unwrap();
    let tok = Tokenizer::for_model(&gguf, &model).unwrap();
    assert_eq!(tok.encode(" the").unwrap(), vec![G_T, HE]);
    assert_eq!(tok.vocab_size(), 261);
    // Added tokens: special is control (needs parse_special), non-special is user-defined and
    // strips whitespace after it (rstrip).
    assert_eq!(
        tok.encode("<|end|><tool>  the").unwrap(),
        vec![END, TOOL_BPE, b't' as u32, HE]
    );
    assert_eq!(tok.encode_with("<|end|>", false, false).unwrap().len(), 7);
    assert!(tok.is_special(END) && !tok.is_special(TOOL_BPE));
    assert_eq!(tok.decode(&[G_T, HE, END], true), " the");
    // EOS and the chat template come from the GGUF.
    assert_eq!(tok.eos_ids(), &[END]);
    assert_eq!(
        tok.chat_template()
            .unwrap()
            .render(&[npu_tokenizer::ChatMessage::user("a")], false)
            .unwrap(),
        "a!"
    );
    let direct = Tokenizer::from_tokenizer_json(dir.join("tokenizer.json")).unwrap();
    assert_eq!(direct.encode(" the").unwrap(), vec![G_T, HE]);
    // Without the GGUF no EOS is named, but "<|end|>" is recognised by its text.
    assert_eq!(direct.eos_id(), None);
    assert_eq!(direct.eos_ids(), &[END]);

    // A tokenizer.json of another vocabulary is refused.
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json(1)).unwrap();
    let err = Tokenizer::for_model(&gguf, &model).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::TokenizerFile { message, .. } if message.contains("another model")),
        "{err}"
    );
    std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
    let err = Tokenizer::for_model(&gguf, &model).unwrap_err();
    assert!(matches!(err, TokenizerError::TokenizerFile { .. }), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

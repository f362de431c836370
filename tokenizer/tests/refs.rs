//! Tokenizer of the default model (SmolLM2-135M-Instruct GGUF) against llama.cpp: the greedy
//! reference prompts and outputs, an exact-ids oracle over mixed text (also with the vocabulary
//! declared under other pre-tokenizer names), and round trips.

use std::path::PathBuf;
use std::sync::OnceLock;

use npu_gguf::{GgufFile, MetaValue};
use npu_tokenizer::{TokenKind, Tokenizer};
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
            "\n!!!!! SKIPPING tokenizer reference test: model not found at {} !!!!!\n",
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

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer")
}

/// llama.cpp's greedy references for the default model, kept with these tests.
fn refs_lines() -> Vec<Value> {
    let path = data_dir().join("greedy_smollm2_q4_1.jsonl");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let lines: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("reference line is JSON"))
        .collect();
    assert!(!lines.is_empty(), "{} has no references", path.display());
    lines
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn oracle_cases() -> Vec<Value> {
    let path = data_dir().join("mixed_oracle.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).expect("oracle JSON");
    v["cases"].as_array().expect("cases").clone()
}

#[test]
fn reference_prompts_encode_to_llama_cpp_ids() {
    let refs = refs_lines();
    let Some(tok) = tokenizer() else { return };
    for line in refs {
        let prompt = line["prompt"].as_str().expect("prompt");
        assert_eq!(
            tok.encode(prompt).unwrap(),
            ids(&line["prompt_ids"]),
            "prompt {prompt:?}"
        );
    }
}

#[test]
fn reference_outputs_decode_to_llama_cpp_text() {
    let refs = refs_lines();
    let Some(tok) = tokenizer() else { return };
    for line in refs {
        let output = ids(&line["output_ids"]);
        let expected = line["output_text"].as_str().expect("output_text");
        assert_eq!(tok.decode(&output, true), expected);
        assert_eq!(tok.decode_continuation(&output, true), expected);
        let mut stream = tok.decode_stream_continuation(true);
        let mut streamed: String = output.iter().map(|&id| stream.push(id)).collect();
        streamed.push_str(&stream.flush());
        assert_eq!(streamed, expected);
    }
}

#[test]
fn mixed_text_encodes_to_llama_cpp_ids() {
    let Some(tok) = tokenizer() else { return };
    let cases = oracle_cases();
    assert!(cases.len() >= 10, "oracle has {} cases", cases.len());
    let mut total_bytes = 0;
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        total_bytes += text.len();
        let got = tok.encode(text).unwrap();
        let want = ids(&case["ids"]);
        if got != want {
            let first = got.iter().zip(&want).position(|(a, b)| a != b);
            panic!(
                "case {name}: ids differ (first difference at {first:?}; {} vs {} ids)\n got: {got:?}\nwant: {want:?}",
                got.len(),
                want.len()
            );
        }
        if let Some(plain) = case.get("ids_no_special") {
            assert_eq!(
                tok.encode_with(text, false, false).unwrap(),
                ids(plain),
                "case {name} without special-token parsing"
            );
        }
    }
    assert!(
        total_bytes >= 3000,
        "oracle covers only {total_bytes} bytes"
    );
}

#[test]
fn mixed_text_round_trips() {
    let Some(tok) = tokenizer() else { return };
    let mut all = String::new();
    for case in oracle_cases() {
        let text = case["text"].as_str().unwrap();
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids, false), text, "case {}", case["name"]);
        all.push_str(text);
    }
    let ids = tok.encode(&all).unwrap();
    assert_eq!(tok.decode(&ids, false), all);
    // Without parsing special tokens their texts are ordinary text and still round trip.
    let plain = tok.encode_with(&all, false, false).unwrap();
    assert!(plain.iter().all(|&id| !tok.is_special(id)));
    assert_eq!(tok.decode(&plain, true), all);
}

#[test]
fn default_model_vocabulary_facts() {
    let Some(tok) = tokenizer() else { return };
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
    assert!(!tok.adds_bos());
    assert_eq!(tok.eos_ids()[0], 2, "EOS first");
    assert!(tok.is_eos(0), "<|endoftext|> also ends generation");
    assert!(!tok.is_eos(1));
    assert_eq!(tok.token_text(1), Some("<|im_start|>"));
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert_eq!(tok.token_kind(2), Some(TokenKind::Control));
    assert!(tok.is_special(1) && !tok.is_special(504));
    assert_eq!(tok.token_text(49152), None);
    // Special tokens are recognised in text; BOS is not added for this model.
    assert_eq!(tok.encode("<|im_start|>").unwrap(), vec![1]);
    assert_eq!(tok.encode("").unwrap(), Vec::<u32>::new());
    // Special tokens show only when not skipped; unknown ids show as U+FFFD.
    assert_eq!(tok.decode(&[1, 504, 2], false), "<|im_start|>The<|im_end|>");
    assert_eq!(tok.decode(&[1, 504, 2], true), "The");
    assert_eq!(tok.decode(&[504, 1_000_000], true), "The\u{fffd}");
}

// ------------------------------------------------- the same vocabulary under other `pre` names

/// GGUF type code and encoding of a metadata value.
fn put_value(buf: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => buf.push(*x),
        MetaValue::I8(x) => buf.push(*x as u8),
        MetaValue::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => buf.push(*x as u8),
        MetaValue::String(s) => {
            buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
            buf.extend_from_slice(s.as_bytes());
        }
        MetaValue::Array(items) => {
            let elem = items.first().map_or(0, type_code);
            buf.extend_from_slice(&elem.to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(buf, item);
            }
        }
    }
}

fn type_code(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

/// The model's metadata with `tokenizer.ggml.pre` replaced, as a GGUF without tensors.
fn metadata_with_pre(model: &GgufFile, pre: &str) -> Vec<u8> {
    let mut buf = b"GGUF".to_vec();
    buf.extend_from_slice(&3u32.to_le_bytes());
    buf.extend_from_slice(&0u64.to_le_bytes());
    buf.extend_from_slice(&(model.keys().len() as u64).to_le_bytes());
    let replacement = MetaValue::String(pre.to_string());
    for key in model.keys() {
        let value = if key == "tokenizer.ggml.pre" {
            &replacement
        } else {
            model.get(key).unwrap()
        };
        buf.extend_from_slice(&(key.len() as u64).to_le_bytes());
        buf.extend_from_slice(key.as_bytes());
        buf.extend_from_slice(&type_code(value).to_le_bytes());
        put_value(&mut buf, value);
    }
    buf
}

#[test]
fn other_pre_tokenizers_match_llama_cpp() {
    let Some(path) = model_path() else { return };
    let model = GgufFile::open(&path).unwrap();
    let oracle: Value = serde_json::from_str(
        &std::fs::read_to_string(data_dir().join("mixed_oracle.json")).unwrap(),
    )
    .unwrap();
    let pres: Vec<&str> = oracle["other_pres"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(
        pres.contains(&"llama-bpe") && pres.contains(&"qwen2"),
        "{pres:?}"
    );
    let dir = std::env::temp_dir().join(format!("npu-tokenizer-pre-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for pre in pres {
        let file = dir.join(format!("{pre}.gguf"));
        std::fs::write(&file, metadata_with_pre(&model, pre)).unwrap();
        let tok = Tokenizer::from_gguf(&GgufFile::open(&file).unwrap()).unwrap();
        let mut differing_cases = 0;
        for case in oracle["cases"].as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            let text = case["text"].as_str().unwrap();
            let own = case["ids_by_pre"].get(pre);
            differing_cases += own.is_some() as usize;
            let want = ids(own.unwrap_or(&case["ids"]));
            assert_eq!(tok.encode(text).unwrap(), want, "pre {pre}, case {name}");
        }
        assert!(differing_cases > 0, "pre {pre} never changes the ids");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

//! Grammars over the default model's real tokenizer (SmolLM2): each kind compiles, its masks
//! walked with a deterministic pseudo-random pick among the allowed tokens always give text the
//! grammar accepts, and bad grammars are refused naming their kind.

use std::path::PathBuf;
use std::sync::OnceLock;

use npu_gguf::GgufFile;
use npu_structured::{Commit, ConstraintSpec, Grammars, StructuredError};
use npu_tokenizer::Tokenizer;
use serde_json::{json, Value};

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn tokenizer() -> Option<&'static Tokenizer> {
    static TOK: OnceLock<Option<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = match std::env::var_os("NPU_SERVING_MODEL") {
            Some(p) => PathBuf::from(p),
            None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/npu-serving/models")
                .join(MODEL_FILE),
        };
        if !path.is_file() {
            assert_eq!(
                std::env::var("NPU_SERVING_ALLOW_NO_MODEL").as_deref(),
                Ok("1"),
                "model not found at {}: set NPU_SERVING_MODEL, or NPU_SERVING_ALLOW_NO_MODEL=1 to skip",
                path.display()
            );
            eprintln!("SKIPPED: no model at {}", path.display());
            return None;
        }
        let gguf = GgufFile::open(&path).expect("open model");
        Some(Tokenizer::for_model(&gguf, &path).expect("tokenizer"))
    })
    .as_ref()
}

fn grammars() -> Option<&'static Grammars> {
    static G: OnceLock<Option<Grammars>> = OnceLock::new();
    G.get_or_init(|| tokenizer().map(|t| Grammars::new(t).expect("grammars")))
        .as_ref()
}

/// Generates up to `max` tokens under `spec`, picking among the allowed tokens with a seeded
/// generator (biased towards the end token once allowed, as a model would end); returns the
/// text and whether the grammar finished.
fn walk(spec: &ConstraintSpec, seed: u64, max: usize) -> (String, bool) {
    let (g, tok) = (grammars().unwrap(), tokenizer().unwrap());
    let mut c = g.compile(spec).expect("compiles");
    let eos = tok.eos_id().unwrap();
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut ids = Vec::new();
    for _ in 0..max {
        let mask = c.mask().unwrap();
        assert_eq!(mask.len(), g.mask_words());
        let allowed: Vec<u32> = (0..tok.vocab_size() as u32)
            .filter(|&t| mask[(t / 32) as usize] & (1 << (t % 32)) != 0)
            .collect();
        assert!(!allowed.is_empty(), "a mask allowed nothing after {ids:?}");
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let r = (state >> 33) as usize;
        let t = if allowed.contains(&eos) && r.is_multiple_of(3) {
            eos
        } else {
            allowed[r % allowed.len()]
        };
        if t == eos {
            return (tok.decode(&ids, true), true);
        }
        ids.push(t);
        if c.commit(t).unwrap() == Commit::Done {
            return (tok.decode(&ids, true), true);
        }
    }
    (tok.decode(&ids, true), false)
}

#[test]
fn json_schema_outputs_validate() {
    if grammars().is_none() {
        return;
    }
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    });
    let spec = ConstraintSpec::JsonSchema(schema);
    let mut finished = 0;
    for seed in 0..12 {
        let (text, done) = walk(&spec, seed, 120);
        if !done {
            continue;
        }
        finished += 1;
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 3, "{text}");
        assert!(o["name"].as_str().unwrap().chars().count() <= 12, "{text}");
        let age = o["age"].as_i64().unwrap();
        assert!((0..=150).contains(&age), "{text}");
        let tags = o["tags"].as_array().unwrap();
        assert!(
            tags.len() <= 3
                && tags
                    .iter()
                    .all(|t| ["a", "b", "c"].contains(&t.as_str().unwrap())),
            "{text}"
        );
        assert!(
            !text.contains(' ') || o["name"].as_str().unwrap().contains(' '),
            "compact: {text}"
        );
    }
    assert!(finished >= 6, "only {finished} of 12 walks finished");
}

#[test]
fn regex_choice_and_json_object() {
    if grammars().is_none() {
        return;
    }
    for seed in 0..6 {
        let (text, done) = walk(
            &ConstraintSpec::Regex(r"[0-9]{3}-[a-z]{2}".into()),
            seed,
            20,
        );
        assert!(done, "{text}");
        let b = text.as_bytes();
        assert!(
            b.len() == 6
                && b[..3].iter().all(u8::is_ascii_digit)
                && b[3] == b'-'
                && b[4..].iter().all(u8::is_ascii_lowercase),
            "{text:?}"
        );
        let choices = vec!["yes".to_string(), "no".to_string(), "maybe so".to_string()];
        let (text, done) = walk(&ConstraintSpec::Choice(choices.clone()), seed, 20);
        assert!(done && choices.contains(&text), "{text:?}");
        let (text, done) = walk(&ConstraintSpec::JsonObject, seed, 200);
        if done {
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(v.is_object(), "{text}");
        }
    }
}

#[test]
fn bad_grammars_are_refused_naming_their_kind() {
    let Some(g) = grammars() else {
        return;
    };
    let cases = [
        ConstraintSpec::Regex("([a-z".into()),
        ConstraintSpec::JsonSchema(json!({"type": "no-such-type"})),
        ConstraintSpec::JsonSchema(json!("not a schema")),
        ConstraintSpec::Lark("start: missing_rule".into()),
        ConstraintSpec::Choice(Vec::new()),
    ];
    for spec in cases {
        match g.compile(&spec) {
            Err(StructuredError::Invalid { what, reason }) => {
                assert_eq!(what, spec.kind());
                assert!(!reason.is_empty());
            }
            other => panic!("{spec:?}: {other:?}"),
        }
    }
}

/// Whether `spec` admits `text` whole: each of its tokens allowed by the mask in turn, and the
/// grammar complete at the end.
fn admits(spec: &ConstraintSpec, text: &str) -> bool {
    let (g, tok) = (grammars().unwrap(), tokenizer().unwrap());
    let mut c = g.compile(spec).expect("compiles");
    for id in tok.encode(text).expect("tokenizes") {
        let mask = c.mask().unwrap();
        if mask[id as usize / 32] & (1 << (id % 32)) == 0 || c.commit(id).is_err() {
            return false;
        }
    }
    c.is_accepting()
}

#[test]
fn closed_schemas_admit_only_the_properties_they_name() {
    if grammars().is_none() {
        return;
    }
    let params = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "at": {"type": "object", "properties": {"lat": {"type": "number"}}}
        },
        "required": ["city"]
    });
    let open = ConstraintSpec::JsonSchema(params.clone());
    let strict = ConstraintSpec::JsonSchema(npu_structured::closed_schema(&params));
    let extra = r#"{"city":"Paris","type":"string"}"#;
    let nested_extra = r#"{"city":"Paris","at":{"lat":1,"lon":2}}"#;
    let good = r#"{"city":"Paris","at":{"lat":1.5}}"#;
    assert!(admits(&open, extra), "JSON Schema's default admits more");
    assert!(!admits(&strict, extra));
    assert!(!admits(&strict, nested_extra));
    assert!(admits(&strict, good));
    assert!(admits(&strict, r#"{"city":"Paris"}"#));
    // As the tool-call grammar embeds it (Lark's %json).
    let lark = ConstraintSpec::Lark(format!(
        "start: \"<tool_call>\" body \"</tool_call>\"\nbody: %json {}\n",
        npu_structured::closed_schema(&params)
    ));
    assert!(!admits(&lark, &format!("<tool_call>{extra}</tool_call>")));
    assert!(admits(&lark, &format!("<tool_call>{good}</tool_call>")));
    // A schema that asks for more keeps it.
    let free = json!({"type": "object", "properties": {"a": {}}, "additionalProperties": true});
    let free = ConstraintSpec::JsonSchema(npu_structured::closed_schema(&free));
    assert!(admits(&free, r#"{"a":1,"b":2}"#));
}

//! `generation_config.json` parsing.

use serde_json::json;

use super::{err, TempDir};
use crate::GenerationConfig;

#[test]
fn llama_style_config() {
    let v = json!({
        "_from_model_config": false,
        "bos_token_id": 128000,
        "do_sample": true,
        "eos_token_id": [128001, 128008, 128009],
        "temperature": 0.6,
        "top_p": 0.9,
        "transformers_version": "4.45.0"
    });
    let c = GenerationConfig::from_json(&v).unwrap();
    assert_eq!(c.eos_token_ids, [128001, 128008, 128009]);
    assert_eq!(c.bos_token_id, Some(128000));
    assert_eq!(c.temperature, Some(0.6));
    assert_eq!(c.top_p, Some(0.9));
    assert_eq!(c.do_sample, Some(true));
    assert_eq!(c.top_k, None);
    assert!(!c.is_greedy());
}

#[test]
fn single_eos_and_other_keys() {
    let v = json!({
        "eos_token_id": 2, "pad_token_id": 0, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.05, "max_new_tokens": 2048, "unknown": [1, 2]
    });
    let c = GenerationConfig::from_json(&v).unwrap();
    assert_eq!(c.eos_token_ids, [2]);
    assert_eq!(c.pad_token_id, Some(0));
    assert_eq!(c.top_k, Some(20));
    assert_eq!(c.min_p, Some(0.05));
    assert_eq!(c.repetition_penalty, Some(1.05));
    assert_eq!(c.max_new_tokens, Some(2048));
}

#[test]
fn top_k_off_nulls_and_float_integers() {
    for off in [0, -1] {
        let c = GenerationConfig::from_json(&json!({ "top_k": off })).unwrap();
        assert_eq!(c.top_k, None);
    }
    let c = GenerationConfig::from_json(
        &json!({ "temperature": null, "eos_token_id": null, "bos_token_id": 1.0 }),
    )
    .unwrap();
    assert_eq!(
        c,
        GenerationConfig {
            bos_token_id: Some(1),
            ..Default::default()
        }
    );
    let c = GenerationConfig::from_json(&json!({ "eos_token_id": [7, 7, 8] })).unwrap();
    assert_eq!(c.eos_token_ids, [7, 8]);
}

#[test]
fn do_sample_false_is_greedy() {
    let v = json!({ "do_sample": false, "temperature": 0.7, "top_p": 0.8, "top_k": 40, "repetition_penalty": 1.1 });
    let c = GenerationConfig::from_json(&v).unwrap();
    assert_eq!(c.temperature, Some(0.0));
    assert_eq!((c.top_p, c.top_k, c.min_p), (None, None, None));
    assert_eq!(c.repetition_penalty, Some(1.1));
    assert!(c.is_greedy());
}

#[test]
fn bad_values_name_their_key() {
    let cases = [
        (
            json!({ "temperature": -0.5 }),
            "\"temperature\": -0.5 is out of range: it must be at least 0",
        ),
        (
            json!({ "top_p": 0.0 }),
            "\"top_p\": 0.0 is out of range: it must be in (0, 1]",
        ),
        (json!({ "top_p": 1.5 }), "\"top_p\": 1.5 is out of range"),
        (json!({ "top_k": -2 }), "\"top_k\": -2 is out of range"),
        (
            json!({ "top_k": 2.5 }),
            "\"top_k\": 2.5 is a number, not an integer",
        ),
        (json!({ "min_p": 2 }), "\"min_p\": 2 is out of range"),
        (
            json!({ "repetition_penalty": 0 }),
            "\"repetition_penalty\": 0 is out of range",
        ),
        (
            json!({ "temperature": "hot" }),
            "\"temperature\": \"hot\" is a string, not a number",
        ),
        (
            json!({ "eos_token_id": -1 }),
            "\"eos_token_id\": -1 is not a token id",
        ),
        (
            json!({ "eos_token_id": [1, "x"] }),
            "\"eos_token_id\": \"x\" is a string, not a token id",
        ),
        (
            json!({ "bos_token_id": 5000000000u64 }),
            "\"bos_token_id\": 5000000000 is not a token id",
        ),
        (
            json!({ "max_new_tokens": 0 }),
            "\"max_new_tokens\": 0 must be at least 1",
        ),
        (
            json!({ "do_sample": "yes" }),
            "\"do_sample\": \"yes\" is a string, not a boolean",
        ),
        (
            json!({ "temperature": 1e300 }),
            "\"temperature\": 1e+300 is out of range of a 32-bit float",
        ),
        (json!([1]), "the file holds an array, not an object"),
    ];
    for (v, want) in cases {
        let e = err(GenerationConfig::from_json(&v));
        assert!(e.starts_with("generation_config.json: "), "{e}");
        assert!(e.contains(want), "{v}: {e}");
    }
}

#[test]
fn read_from_a_directory() {
    let dir = TempDir::new("gen");
    assert_eq!(GenerationConfig::read(dir.path()).unwrap(), None);
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": 3}"#,
    )
    .unwrap();
    let c = GenerationConfig::read(dir.path()).unwrap().unwrap();
    assert_eq!(c.eos_token_ids, [3]);
    std::fs::write(
        dir.path().join("generation_config.json"),
        "{\n\"eos_token_id\": 3,\n}",
    )
    .unwrap();
    let e = err(GenerationConfig::read(dir.path()));
    assert!(
        e.contains("generation_config.json: invalid JSON at line 3, column 1"),
        "{e}"
    );
}

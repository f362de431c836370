//! Config of speculative decoding: `npu_serving.speculative` is a mapping of its settings (absent
//! keys take their defaults, `{}` is all defaults), absent for off; every bad value is refused
//! naming its full key.

use npu_server::config::ServerConfig;
use npu_server::engine::scheduler::SpeculativeConfig;

fn load(yaml: &str) -> Result<ServerConfig, npu_server::config::ConfigError> {
    ServerConfig::from_yaml_str(yaml)
}

#[test]
fn speculation_is_off_by_default_and_read_from_its_mapping() {
    assert_eq!(load("{}").unwrap().npu_serving.speculative, None);
    let cfg = load("npu_serving:\n  speculative: {}\n").unwrap();
    assert_eq!(
        cfg.npu_serving.speculative,
        Some(SpeculativeConfig::default())
    );
    // Over tensor-parallel groups too (rank 0 verifies the drafts from the gathered rows).
    let cfg = load(
        "serving_config:\n  agent_ports: [0, 0]\nnpu_serving:\n  speculative: {}\n  \
         tensor_parallel_size: 2\n",
    )
    .unwrap();
    assert!(cfg.npu_serving.speculative.is_some());
    let cfg = load(
        "npu_serving:\n  speculative:\n    method: ngram\n    num_speculative_tokens: 5\n    \
         prompt_lookup_max: 3\n    prompt_lookup_min: 1\n    max_batch: 2\n    \
         min_acceptance: 0.5\n",
    )
    .unwrap();
    assert_eq!(
        cfg.npu_serving.speculative,
        Some(SpeculativeConfig {
            num_speculative_tokens: 5,
            prompt_lookup_max: 3,
            prompt_lookup_min: 1,
            max_batch: 2,
            min_acceptance: 0.5,
        })
    );
}

#[test]
fn bad_settings_are_refused_naming_their_key() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "npu_serving:\n  speculative:\n    num_speculative_tokens: 0\n",
            "npu_serving.speculative.num_speculative_tokens",
            "1..=16",
        ),
        (
            "npu_serving:\n  speculative:\n    num_speculative_tokens: 17\n",
            "npu_serving.speculative.num_speculative_tokens",
            "1..=16",
        ),
        (
            "npu_serving:\n  speculative:\n    prompt_lookup_min: 5\n",
            "npu_serving.speculative.prompt_lookup_min",
            "prompt_lookup_max",
        ),
        (
            "npu_serving:\n  speculative:\n    max_batch: 0\n",
            "npu_serving.speculative.max_batch",
            "at least 1",
        ),
        (
            "npu_serving:\n  speculative:\n    min_acceptance: 2\n",
            "npu_serving.speculative.min_acceptance",
            "0..=1",
        ),
        (
            "npu_serving:\n  speculative:\n    method: eagle\n",
            "npu_serving.speculative.method",
            "ngram",
        ),
        (
            "npu_serving:\n  speculative:\n    num_spec_tokens: 4\n",
            "npu_serving.speculative.num_spec_tokens",
            "unknown key",
        ),
        (
            "npu_serving:\n  speculative: 4\n",
            "npu_serving.speculative",
            "",
        ),
        (
            "npu_serving:\n  speculative: {}\n  long_context: {}\n",
            "npu_serving.speculative",
            "long-context",
        ),
    ];
    for (yaml, key, says) in cases {
        let e = load(yaml).expect_err(yaml);
        assert_eq!(e.key_path(), Some(*key), "{yaml}: {e}");
        let text = e.to_string();
        assert!(text.contains(says), "{yaml}: {text}");
    }
}

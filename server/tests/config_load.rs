//! Config loading: the shipped configs load (with the warnings they should give), every
//! validation error names its key, bucket lists accept a scalar or a list, unknown keys warn in
//! llm-serving's sections (with a suggestion when one is close) and are errors in npu_serving
//! and under strict loading, a KV pool too small for one sequence is refused naming both keys.

use std::path::PathBuf;

use npu_server::config::{BatchingStrategy, ConfigError, DeviceKind, ServerConfig};

fn repo_file(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(rel)
}

fn warned(cfg: &ServerConfig, path: &str) -> bool {
    cfg.warnings.iter().any(|w| w.path == path)
}

#[test]
fn default_config_loads_without_warnings() {
    let cfg = ServerConfig::from_yaml_file(repo_file("configs/smollm2-cpu.yaml")).unwrap();
    assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
    assert_eq!(cfg.num_agents(), 1);
    assert_eq!(cfg.server_addr(), "127.0.0.1:8835");
    assert_eq!(cfg.decode_batch_size(), 64);
    assert_eq!(cfg.npu_serving.max_tokens_per_step, 128);
    assert_eq!(cfg.npu_serving.model_file, None);
    assert_eq!(cfg.npu_serving.device, DeviceKind::Cpu);
    // 64 concurrent requests of 512 tokens fit the KV pool.
    let blocks_needed = 64 * 512 / cfg.pa_config.block_size;
    assert!(cfg.pa_config.num_blocks >= blocks_needed);
    assert_eq!(cfg.max_model_len(8192), 2048);
}

#[test]
fn llm_serving_config_loads_with_one_warning_per_ignored_key() {
    let cfg = ServerConfig::from_yaml_file(repo_file("configs/llama_7b_kbk_pa_dyn.yaml")).unwrap();
    for key in [
        "model_config.zactivate_len",
        "model_config.model_type",
        "model_config.seq_type",
        "model_config.current_index",
        "model_config.model_dtype",
        "model_config.pad_token_id",
        "model_config.backend",
        "model_config.model_cfg_path",
        "serving_config.enable_host_post_sampling",
        "tokenizer.type",
        "tokenizer.vocab_file",
        "basic_inputs",
        "extra_inputs",
        "warmup_inputs",
        "model_path",
    ] {
        let n = cfg.warnings.iter().filter(|w| w.path == key).count();
        assert_eq!(n, 1, "{key}: {:?}", cfg.warnings);
    }
    // Waiting times of 0 and page_attention: True are what we do anyway: no warning.
    assert!(!warned(&cfg, "model_config.batch_waiting_time"));
    assert!(!warned(&cfg, "model_config.page_attention"));
    assert_eq!(cfg.model_name(), "llama_7b");
    assert_eq!(cfg.end_token_ids(), &[2]);
    assert_eq!(cfg.decode_batch_size(), 50);
    assert_eq!(cfg.prefill_batch_size(), 10);
    assert_eq!(cfg.max_generate_length(), Some(4096));
    assert_eq!(
        cfg.model_config.batching_strategy,
        BatchingStrategy::Continuous
    );
    assert_eq!(
        cfg.model_config.model_dtype.as_deref(),
        Some("DataType.FLOAT32")
    );
    assert_eq!(cfg.pa_config.num_blocks, 1024);
    assert_eq!(cfg.max_model_len(8192), 4096);
    let model = cfg.npu_serving.model_file.clone().unwrap();
    assert!(model.ends_with(".cache/npu-serving/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(!model.starts_with("~"), "home is expanded: {model:?}");
    // Against the SmolLM2 model: vocab_size 32000 is overridden by the model's 49152.
    let w = cfg.model_warnings(49152, 8192);
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!(w[0].path, "model_config.vocab_size");
}

#[test]
fn empty_document_gives_defaults() {
    let cfg = ServerConfig::from_yaml_str("").unwrap();
    assert_eq!(cfg, ServerConfig::default());
    assert_eq!(cfg.decode_batch_size(), 64);
    assert_eq!(cfg.max_model_len(8192), 8192);
    assert_eq!(cfg.http_limits().max_body_bytes, 1 << 20);
}

#[test]
fn buckets_accept_scalar_or_list_and_use_the_largest() {
    let cfg = ServerConfig::from_yaml_str(
        "model_config:\n  seq_length: 1024\n  decode_batch_size: [8, 32, 16]\n  prefill_batch_size: [4]\n",
    )
    .unwrap();
    assert_eq!(cfg.seq_length(), Some(1024));
    assert_eq!(cfg.decode_batch_size(), 32);
    assert_eq!(cfg.prefill_batch_size(), 4);
    // Several buckets: one warning saying the largest is used; one bucket: none.
    let w: Vec<_> = cfg.warnings.iter().map(|w| w.path.as_str()).collect();
    assert_eq!(w, ["model_config.decode_batch_size"]);
    assert!(cfg.warnings[0].message.contains("32"));
}

#[test]
fn unknown_keys_warn_with_their_full_path_and_a_suggestion_when_one_is_close() {
    let yaml = "model_config:\n  model_name: x\n  fancy: 1\n  seq_lenght: 512\nserving_config:\n  agent_ports: [1]\n  agent_typo: 2\nnew_section: {a: 1}\nmodel_confg: {seq_length: 512}\n";
    let cfg = ServerConfig::from_yaml_str(yaml).unwrap();
    for key in [
        "model_config.fancy",
        "model_config.seq_lenght",
        "serving_config.agent_typo",
        "new_section",
        "model_confg",
    ] {
        assert!(warned(&cfg, key), "{key}: {:?}", cfg.warnings);
    }
    assert_eq!(cfg.warnings.len(), 5);
    let message = |path: &str| {
        let w = cfg.warnings.iter().find(|w| w.path == path).unwrap();
        w.message.clone()
    };
    assert_eq!(
        message("model_confg"),
        "unknown key, ignored (did you mean model_config?)"
    );
    assert_eq!(
        message("model_config.seq_lenght"),
        "unknown key, ignored (did you mean seq_length?)"
    );
    assert_eq!(message("model_config.fancy"), "unknown key, ignored");
    assert_eq!(message("new_section"), "unknown key, ignored");

    // --strict-config: the first unknown key is an error, with the same suggestion.
    let e = ServerConfig::from_yaml_str_with(yaml, true).unwrap_err();
    assert!(matches!(e, ConfigError::UnknownKey { .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "model_config.fancy: unknown key; --strict-config refuses unknown keys"
    );
    let e = ServerConfig::from_yaml_str_with("model_confg: {seq_length: 512}\n", true).unwrap_err();
    assert_eq!(
        e.to_string(),
        "model_confg: unknown key (did you mean model_config?); --strict-config refuses unknown keys"
    );
    // Strict loading accepts the shipped configs (their llm-serving keys are known, if ignored).
    for file in [
        "configs/smollm2-cpu.yaml",
        "configs/llama_7b_kbk_pa_dyn.yaml",
    ] {
        ServerConfig::from_yaml_file_with(repo_file(file), true).unwrap();
    }
}

#[test]
fn unknown_keys_in_npu_serving_are_errors_with_a_suggestion() {
    let e = err("npu_serving:\n  prefix_cahce: false\n");
    assert_eq!(e.key_path(), Some("npu_serving.prefix_cahce"));
    assert_eq!(
        e.to_string(),
        "npu_serving.prefix_cahce: unknown key (did you mean prefix_cache?); npu_serving holds \
         this server's own settings and refuses unknown keys"
    );
    let e = err("npu_serving:\n  turbo: true\n");
    assert_eq!(
        e.to_string(),
        "npu_serving.turbo: unknown key; npu_serving holds this server's own settings and \
         refuses unknown keys"
    );
}

#[test]
fn agent_ports_only_count_agents() {
    // No port is opened for agents: 0, repeats and a port equal to the server's are fine.
    let cfg = ServerConfig::from_yaml_str(
        "serving_config:\n  agent_ports: [0, 0, 8835]\n  server_port: 8835\n",
    )
    .unwrap();
    assert_eq!(cfg.num_agents(), 3);
    assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
    let cfg = ServerConfig::from_yaml_str("serving_config:\n  agent_ip: '10.0.0.1'\n").unwrap();
    assert!(warned(&cfg, "serving_config.agent_ip"));
    assert_eq!(cfg.num_agents(), 1);
}

#[test]
fn a_kv_pool_that_cannot_hold_one_sequence_is_refused_naming_both_keys() {
    let cfg = ServerConfig::from_yaml_str(
        "model_config:\n  seq_length: 2048\npa_config:\n  num_blocks: 64\n",
    )
    .unwrap();
    let e = cfg.check_kv_pool(8192).unwrap_err();
    assert_eq!(e.key_path(), Some("pa_config.num_blocks"));
    assert_eq!(
        e.to_string(),
        "pa_config.num_blocks: 64 blocks x pa_config.block_size 16 = 1024 token slots per agent \
         cannot hold one sequence of model_config.seq_length = 2048 tokens; raise \
         pa_config.num_blocks to at least 128 or lower model_config.seq_length to at most 1024"
    );
    // Exactly one sequence fits: accepted.
    let cfg = ServerConfig::from_yaml_str(
        "model_config:\n  seq_length: 1024\npa_config:\n  num_blocks: 64\n",
    )
    .unwrap();
    cfg.check_kv_pool(8192).unwrap();
    // Without seq_length the model's context is the limit; a smaller max_generate_length or
    // max_model_len is what counts when set.
    let cfg = ServerConfig::from_yaml_str("pa_config:\n  num_blocks: 64\n").unwrap();
    let msg = cfg.check_kv_pool(8192).unwrap_err().to_string();
    assert!(msg.contains("the model's context length = 8192"), "{msg}");
    assert!(
        msg.contains("lower model_config.seq_length to at most 1024"),
        "{msg}"
    );
    let cfg = ServerConfig::from_yaml_str(
        "model_config:\n  max_generate_length: 1000\npa_config:\n  num_blocks: 64\n",
    )
    .unwrap();
    cfg.check_kv_pool(8192).unwrap();
    let cfg = ServerConfig::from_yaml_str(
        "npu_serving:\n  max_model_len: 4096\npa_config:\n  num_blocks: 64\n",
    )
    .unwrap();
    let msg = cfg.check_kv_pool(8192).unwrap_err().to_string();
    assert!(msg.contains("npu_serving.max_model_len = 4096"), "{msg}");
    // The shipped configs fit.
    for file in [
        "configs/smollm2-cpu.yaml",
        "configs/llama_7b_kbk_pa_dyn.yaml",
    ] {
        let cfg = ServerConfig::from_yaml_file(repo_file(file)).unwrap();
        cfg.check_kv_pool(8192).unwrap();
    }
}

#[test]
fn served_model_names_default_to_the_model_name_and_are_checked() {
    let cfg = ServerConfig::from_yaml_str("model_config:\n  model_name: m1\n").unwrap();
    assert_eq!(cfg.served_model_names(), ["m1"]);
    let cfg = ServerConfig::from_yaml_str(
        "model_config:\n  model_name: m1\nnpu_serving:\n  served_model_names: [smol, gpt-4o-mini]\n",
    )
    .unwrap();
    assert_eq!(cfg.served_model_names(), ["smol", "gpt-4o-mini"]);
    let cfg = ServerConfig::from_yaml_str("npu_serving:\n  served_model_names: smol\n").unwrap();
    assert_eq!(cfg.served_model_names(), ["smol"]);
    for (yaml, words) in [
        ("npu_serving:\n  served_model_names: []\n", "empty"),
        ("npu_serving:\n  served_model_names: [a, a]\n", "twice"),
        (
            "npu_serving:\n  served_model_names: ['a b']\n",
            "whitespace",
        ),
        ("npu_serving:\n  served_model_names: [a, 3]\n", "[1]"),
    ] {
        let e = err(yaml);
        assert!(
            e.key_path()
                .unwrap()
                .starts_with("npu_serving.served_model_names"),
            "{e}"
        );
        assert!(e.to_string().contains(words), "{e}");
    }
}

#[test]
fn booleans_may_be_python_style_or_strings() {
    let cfg = ServerConfig::from_yaml_str("npu_serving:\n  prefix_cache: False\n").unwrap();
    assert!(!cfg.npu_serving.prefix_cache);
    let cfg = ServerConfig::from_yaml_str("npu_serving:\n  prefix_cache: 'True'\n").unwrap();
    assert!(cfg.npu_serving.prefix_cache);
}

fn err(yaml: &str) -> ConfigError {
    match ServerConfig::from_yaml_str(yaml) {
        Ok(c) => panic!("accepted: {yaml}\n{c:?}"),
        Err(e) => e,
    }
}

#[test]
fn every_validation_error_names_its_key_value_and_what_is_allowed() {
    let cases: &[(&str, &str, &[&str])] = &[
        (
            "pa_config:\n  block_size: 0\n",
            "pa_config.block_size",
            &["0 is not allowed", "1..=256", "power of two"],
        ),
        (
            "pa_config:\n  block_size: 24\n",
            "pa_config.block_size",
            &["24"],
        ),
        (
            "pa_config:\n  block_size: 512\n",
            "pa_config.block_size",
            &["512"],
        ),
        (
            "pa_config:\n  num_blocks: 0\n",
            "pa_config.num_blocks",
            &["0"],
        ),
        (
            "pa_config:\n  decode_seq_length: 1\n",
            "pa_config.decode_seq_length",
            &["1"],
        ),
        (
            "serving_config:\n  agent_ports: []\n",
            "serving_config.agent_ports",
            &["empty"],
        ),
        (
            "serving_config:\n  agent_ports: [70000]\n",
            "serving_config.agent_ports",
            &["70000", "0..=65535"],
        ),
        (
            "serving_config:\n  server_port: 99999\n",
            "serving_config.server_port",
            &["99999"],
        ),
        (
            "serving_config:\n  server_ip: 'not an ip'\n",
            "serving_config.server_ip",
            &["not an ip"],
        ),
        (
            "model_config:\n  seq_length: []\n",
            "model_config.seq_length",
            &["empty"],
        ),
        (
            "model_config:\n  decode_batch_size: [8, 0]\n",
            "model_config.decode_batch_size[1]",
            &["0"],
        ),
        (
            "model_config:\n  prefill_batch_size: 0\n",
            "model_config.prefill_batch_size",
            &["0"],
        ),
        (
            "model_config:\n  batching_strategy: 'greedy'\n",
            "model_config.batching_strategy",
            &["greedy", "continuous"],
        ),
        (
            "model_config:\n  model_name: ''\n",
            "model_config.model_name",
            &["empty"],
        ),
        (
            "model_config:\n  max_generate_length: 1\n",
            "model_config.max_generate_length",
            &["1"],
        ),
        (
            "model_config:\n  batch_waiting_time: -1.0\n",
            "model_config.batch_waiting_time",
            &["-1"],
        ),
        (
            "npu_serving:\n  device: tpu\n",
            "npu_serving.device",
            &["tpu", "cpu, cuda, ascend"],
        ),
        (
            "npu_serving:\n  max_tokens_per_step: 0\n",
            "npu_serving.max_tokens_per_step",
            &["0"],
        ),
        (
            "npu_serving:\n  swap_space_mb: 2000000\n",
            "npu_serving.swap_space_mb",
            &["2000000", "0..=1048576"],
        ),
        (
            "npu_serving:\n  max_queue: 0\n",
            "npu_serving.max_queue",
            &["0"],
        ),
        (
            "npu_serving:\n  max_body_bytes: 10\n",
            "npu_serving.max_body_bytes",
            &["10"],
        ),
        (
            "npu_serving:\n  header_timeout_ms: 0\n",
            "npu_serving.header_timeout_ms",
            &["0"],
        ),
        (
            "npu_serving:\n  step_deadline_ms: 0\n",
            "npu_serving.step_deadline_ms",
            &["0"],
        ),
        (
            "npu_serving:\n  max_new_tokens_default: 0\n",
            "npu_serving.max_new_tokens_default",
            &["0"],
        ),
        (
            "npu_serving:\n  max_model_len: 1\n",
            "npu_serving.max_model_len",
            &["1"],
        ),
        (
            "npu_serving:\n  model_file: ''\n",
            "npu_serving.model_file",
            &["empty"],
        ),
    ];
    for (yaml, key, words) in cases {
        let e = err(yaml);
        assert_eq!(e.key_path(), Some(*key), "{yaml}: {e}");
        let msg = e.to_string();
        assert!(msg.starts_with(&format!("{key}: ")), "{msg}");
        for w in *words {
            assert!(msg.contains(w), "{yaml}: {msg:?} lacks {w:?}");
        }
    }
    assert_eq!(
        err("pa_config:\n  block_size: 0\n").to_string(),
        "pa_config.block_size: 0 is not allowed (must be 1..=256 and a power of two)"
    );
    assert_eq!(
        err("serving_config:\n  agent_ports: []\n").to_string(),
        "serving_config.agent_ports: empty (one entry per agent)"
    );
}

#[test]
fn wrong_yaml_types_name_the_key() {
    let cases: &[(&str, &str)] = &[
        ("pa_config:\n  num_blocks: 'many'\n", "pa_config.num_blocks"),
        ("pa_config:\n  block_size: 16.5\n", "pa_config.block_size"),
        (
            "model_config:\n  seq_length: {a: 1}\n",
            "model_config.seq_length",
        ),
        (
            "model_config:\n  decode_batch_size: [8, 'x']\n",
            "model_config.decode_batch_size[1]",
        ),
        (
            "model_config:\n  model_name: [1]\n",
            "model_config.model_name",
        ),
        (
            "serving_config:\n  agent_ports: '16002'\n",
            "serving_config.agent_ports",
        ),
        (
            "npu_serving:\n  prefix_cache: 3\n",
            "npu_serving.prefix_cache",
        ),
        ("npu_serving: 5\n", "npu_serving"),
        ("tokenizer: [a]\n", "tokenizer"),
    ];
    for (yaml, key) in cases {
        let e = err(yaml);
        assert!(matches!(e, ConfigError::WrongType { .. }), "{yaml}: {e}");
        assert_eq!(e.key_path(), Some(*key), "{yaml}: {e}");
        assert!(e.to_string().contains("expected"), "{e}");
    }
    assert!(matches!(err("- a\n- b\n"), ConfigError::NotAMapping { .. }));
    assert!(matches!(err("a: [\n"), ConfigError::Yaml(_)));
    // Deep flow nesting is refused before the YAML reader's parse (quadratic in the depth):
    // 30,000 open brackets come back at once, naming the line.
    let started = std::time::Instant::now();
    let deep = format!("model_config:\n  seq_length: {}", "[".repeat(30_000));
    let e = err(&deep);
    assert!(
        e.to_string().contains("line 2") && e.to_string().contains("128"),
        "{e}"
    );
    assert!(started.elapsed() < std::time::Duration::from_millis(500));
    // Brackets in quoted strings and comments do not count; 128 real levels still parse.
    let quoted = format!(
        "model_config:\n  model_name: '{}' # {}\n",
        "[".repeat(300),
        "{".repeat(300)
    );
    assert!(ServerConfig::from_yaml_str(&quoted).is_ok());
    let nested = format!("x: {}{}\n", "[".repeat(120), "]".repeat(120));
    assert!(ServerConfig::from_yaml_str(&nested).is_ok());
    assert!(matches!(
        ServerConfig::from_yaml_file("/nonexistent/x.yaml"),
        Err(ConfigError::Io { .. })
    ));
}

#[test]
fn nonzero_waiting_times_and_disabled_paging_are_warned_ignored() {
    let cfg = ServerConfig::from_yaml_str(
        "model_config:\n  batch_waiting_time: 0.5\n  page_attention: False\nserving_config:\n  decode_batch_waiting_time: 0.1\n",
    )
    .unwrap();
    assert!(warned(&cfg, "model_config.batch_waiting_time"));
    assert!(warned(&cfg, "model_config.page_attention"));
    assert!(warned(&cfg, "serving_config.decode_batch_waiting_time"));
}

#[test]
fn long_context_is_a_checked_mapping_of_its_settings() {
    let cfg = ServerConfig::from_yaml_str(
        "pa_config:\n  num_blocks: 64\nnpu_serving:\n  long_context:\n    topk_blocks: 8\n    \
         device_blocks: 40\n",
    )
    .unwrap();
    let lc = cfg.npu_serving.long_context.expect("on");
    assert_eq!((lc.initial_blocks, lc.local_blocks), (1, 16));
    assert_eq!((lc.topk_blocks, lc.device_blocks), (8, 40));
    // The model's training context no longer caps the context.
    assert_eq!(
        cfg.max_model_len(8192),
        npu_server::config::LONG_CONTEXT_MAX_LEN
    );
    cfg.check_kv_pool(8192).unwrap();
    assert_eq!(
        ServerConfig::from_yaml_str("")
            .unwrap()
            .npu_serving
            .long_context,
        None
    );

    let e = err("npu_serving:\n  long_context:\n    topk_blocks: 0\n");
    assert_eq!(e.key_path(), Some("npu_serving.long_context.topk_blocks"));
    assert!(e.to_string().contains("at least 1"), "{e}");
    let e = err("npu_serving:\n  long_context:\n    device_blocks: 20\n");
    assert_eq!(e.key_path(), Some("npu_serving.long_context.device_blocks"));
    assert!(e.to_string().contains("34"), "{e}");
    let e = err(
        "pa_config:\n  block_size: 4\nnpu_serving:\n  long_context:\n    representative_keys: 5\n",
    );
    assert_eq!(
        e.key_path(),
        Some("npu_serving.long_context.representative_keys")
    );
    let e = err("npu_serving:\n  long_context:\n    topk: 3\n");
    assert_eq!(e.key_path(), Some("npu_serving.long_context.topk"));
    let e = err("npu_serving:\n  long_context: 3\n");
    assert!(e.to_string().contains("npu_serving.long_context"), "{e}");
    // A pool smaller than one sequence's budget.
    let cfg = ServerConfig::from_yaml_str(
        "pa_config:\n  num_blocks: 32\nnpu_serving:\n  long_context:\n    device_blocks: 40\n",
    )
    .unwrap();
    let e = cfg.check_kv_pool(8192).unwrap_err();
    assert_eq!(e.key_path(), Some("npu_serving.long_context.device_blocks"));
}

#[test]
fn ascend_refuses_block_sizes_that_are_not_a_multiple_of_16_naming_the_key() {
    for bs in [1, 2, 4, 8] {
        let yaml = format!("pa_config:\n  block_size: {bs}\nnpu_serving:\n  device: ascend\n");
        let e = err(&yaml);
        assert_eq!(e.key_path(), Some("pa_config.block_size"), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("{bs} is not allowed"))
                && msg.contains("multiple of 16")
                && msg.contains("ascend"),
            "{msg}"
        );
        // The same size is fine on the CPU.
        let cpu = format!("pa_config:\n  block_size: {bs}\nnpu_serving:\n  device: cpu\n");
        assert!(ServerConfig::from_yaml_str(&cpu).is_ok());
    }
    for bs in [16, 32, 128, 256] {
        let yaml = format!("pa_config:\n  block_size: {bs}\nnpu_serving:\n  device: ascend\n");
        let cfg = ServerConfig::from_yaml_str(&yaml).unwrap();
        assert_eq!(cfg.pa_config.block_size, bs);
    }
}

#[test]
fn a_kv_pool_sized_from_free_memory_is_planned_at_its_cap_and_checked_once_sized() {
    let cfg = ServerConfig::from_yaml_str("").unwrap();
    assert_eq!(cfg.npu_serving.kv_cache_memory_fraction, None);
    assert_eq!(cfg.kv_pool_blocks_planned(), 2048);

    // No num_blocks: the agents may take up to the automatic cap.
    let cfg =
        ServerConfig::from_yaml_str("npu_serving:\n  kv_cache_memory_fraction: 0.9\n").unwrap();
    assert_eq!(cfg.npu_serving.kv_cache_memory_fraction, Some(0.9));
    assert_eq!(
        cfg.kv_pool_blocks_planned(),
        npu_protocol::agent::KV_AUTO_MAX_BLOCKS
    );
    // Not checked before the agents have sized their pools; afterwards on the blocks they have,
    // naming the fraction.
    cfg.check_kv_pool(8192).unwrap();
    let e = cfg.check_kv_pool_blocks(8192, 100).unwrap_err();
    assert_eq!(e.key_path(), Some("npu_serving.kv_cache_memory_fraction"));
    assert_eq!(
        e.to_string(),
        "npu_serving.kv_cache_memory_fraction: 100 blocks x pa_config.block_size 16 = 1600 token \
         slots per agent cannot hold one sequence of the model's context length = 8192 tokens; \
         raise npu_serving.kv_cache_memory_fraction (or free device memory) so the pool has at \
         least 512 or lower model_config.seq_length to at most 1600"
    );
    cfg.check_kv_pool_blocks(8192, 512).unwrap();

    // num_blocks given: the most blocks the pool may have.
    let cfg = ServerConfig::from_yaml_str(
        "pa_config:\n  num_blocks: 300\nnpu_serving:\n  kv_cache_memory_fraction: 0.5\n",
    )
    .unwrap();
    assert_eq!(cfg.kv_pool_blocks_planned(), 300);

    for bad in ["0", "-0.1", "1.0", "1.5", "'lots'"] {
        let e = err(&format!(
            "npu_serving:\n  kv_cache_memory_fraction: {bad}\n"
        ));
        assert_eq!(
            e.key_path(),
            Some("npu_serving.kv_cache_memory_fraction"),
            "{bad}: {e}"
        );
    }
}

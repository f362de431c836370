//! Config of LoRA adapters: `npu_serving.lora_adapters` (a list of {name, path}),
//! `npu_serving.max_loras` and `npu_serving.max_lora_rank`; LoRA is off without all three, on
//! (with vLLM's defaults 1 and 16) with any; every bad value is refused naming its key, and what
//! LoRA does not run with yet (tensor parallelism, a prefill/decode split, long-context mode,
//! several models) is refused by name; every device serves it (Ascend since issue 53).

use npu_server::config::{LoraConfig, LoraEntry, ServerConfig};

fn load(yaml: &str) -> Result<ServerConfig, npu_server::config::ConfigError> {
    ServerConfig::from_yaml_str(yaml)
}

#[test]
fn lora_is_off_by_default_and_read_from_its_keys() {
    assert_eq!(load("{}").unwrap().npu_serving.lora, None);
    let c = load("npu_serving:\n  lora_adapters: []\n").unwrap();
    assert_eq!(c.npu_serving.lora, Some(LoraConfig::default()));
    assert_eq!(
        LoraConfig::default(),
        LoraConfig {
            adapters: vec![],
            max_loras: 1,
            max_lora_rank: 16
        }
    );
    let c = load(
        "npu_serving:\n  max_loras: 4\n  max_lora_rank: 64\n  lora_adapters:\n    \
         - {name: sql, path: /adapters/sql}\n    - name: chat\n      path: ad/chat.gguf\n",
    )
    .unwrap();
    assert_eq!(
        c.npu_serving.lora,
        Some(LoraConfig {
            adapters: vec![
                LoraEntry {
                    name: "sql".into(),
                    path: "/adapters/sql".into()
                },
                LoraEntry {
                    name: "chat".into(),
                    path: "ad/chat.gguf".into()
                },
            ],
            max_loras: 4,
            max_lora_rank: 64,
        })
    );
    assert_eq!(
        load("npu_serving:\n  max_loras: 2\n")
            .unwrap()
            .npu_serving
            .lora
            .map(|l| l.max_loras),
        Some(2)
    );
    // The CUDA backend has the segmented LoRA kernel (kernels/lora.cu): adapters load with it.
    let c = load("npu_serving:\n  max_loras: 2\n  device: cuda\n").unwrap();
    assert_eq!(c.npu_serving.lora.map(|l| l.max_loras), Some(2));
}

#[test]
fn bad_values_are_refused_naming_their_key() {
    let long = "a".repeat(1025);
    let cases: Vec<(String, &str)> = vec![
        ("  max_loras: 0\n".into(), "npu_serving.max_loras"),
        ("  max_loras: 65\n".into(), "npu_serving.max_loras"),
        ("  max_loras: -1\n".into(), "npu_serving.max_loras"),
        ("  max_lora_rank: 0\n".into(), "npu_serving.max_lora_rank"),
        ("  max_lora_rank: 257\n".into(), "npu_serving.max_lora_rank"),
        ("  lora_adapters: sql\n".into(), "npu_serving.lora_adapters"),
        (
            "  lora_adapters:\n    - {path: /a}\n".into(),
            "npu_serving.lora_adapters[0].name",
        ),
        (
            "  lora_adapters:\n    - {name: ' ', path: /a}\n".into(),
            "npu_serving.lora_adapters[0].name",
        ),
        (
            "  lora_adapters:\n    - {name: a}\n".into(),
            "npu_serving.lora_adapters[0].path",
        ),
        (
            "  lora_adapters:\n    - {name: a, path: /a}\n    - {name: a, path: /b}\n".into(),
            "npu_serving.lora_adapters[1].name",
        ),
        (
            "  lora_adapters:\n    - {name: a, path: /a, rank: 8}\n".into(),
            "rank",
        ),
        (
            format!("  lora_adapters:\n    - {{name: a, path: /{long}}}\n"),
            "npu_serving.lora_adapters[0].path",
        ),
        // What LoRA does not run with yet (on any device).
        (
            "  max_loras: 2\n  device: ascend\n  tensor_parallel_size: 2\n".into(),
            "npu_serving.tensor_parallel_size",
        ),
        (
            "  max_loras: 2\n  tensor_parallel_size: 2\n".into(),
            "npu_serving.tensor_parallel_size",
        ),
        (
            "  max_loras: 2\n  long_context: {}\n".into(),
            "npu_serving.long_context",
        ),
    ];
    for (npu, key) in cases {
        let yaml = format!("serving_config:\n  agent_ports: [0, 0]\nnpu_serving:\n{npu}");
        let e = load(&yaml).expect_err(&yaml).to_string();
        assert!(e.contains(key), "{yaml}: {e}");
    }
    // Every device serves adapters (Ascend's lora_add: backends/ascend/src/backend/lora_ops.rs).
    for device in ["cpu", "cuda", "ascend"] {
        let yaml = format!(
            "serving_config:\n  agent_ports: [0, 0]\nnpu_serving:\n  max_loras: 2\n  \
             device: {device}\n"
        );
        let c = load(&yaml).unwrap_or_else(|e| panic!("{device}: {e}"));
        assert_eq!(c.npu_serving.lora.map(|l| l.max_loras), Some(2), "{device}");
    }
    let split = "serving_config:\n  agent_ports: [0, 0]\nnpu_serving:\n  max_loras: 2\n  \
                 agent_roles: [prefill, decode]\n";
    let e = load(split).unwrap_err().to_string();
    assert!(e.contains("npu_serving.agent_roles"), "{e}");
}

//! Config of tensor parallelism: `npu_serving.tensor_parallel_size` (default 1), the groups the
//! agents form, and every refusal naming the key and what would work: a size that does not
//! divide the agents, and the features that do not run over a group yet (swap and the prefix
//! cache's host tier, a prefill/decode split, long-context mode). What the model cannot be
//! split over is refused once the model is read (`npu_server::serve::check_tensor_parallel`).

use npu_server::config::{ConfigError, ServerConfig};

fn load(yaml: &str) -> Result<ServerConfig, ConfigError> {
    ServerConfig::from_yaml_str(yaml)
}

fn agents(n: usize) -> String {
    let ports: Vec<&str> = (0..n).map(|_| "0").collect();
    format!("serving_config:\n  agent_ports: [{}]\n", ports.join(", "))
}

#[test]
fn one_rank_by_default_and_groups_of_the_size() {
    let cfg = load(&agents(2)).unwrap();
    assert_eq!(cfg.tensor_parallel_size(), 1);
    assert_eq!(cfg.num_groups(), 2);
    let cfg = load(&format!(
        "{}npu_serving:\n  tensor_parallel_size: 2\n",
        agents(4)
    ))
    .unwrap();
    assert_eq!((cfg.tensor_parallel_size(), cfg.num_groups()), (2, 2));
    let cfg = load(&format!(
        "{}npu_serving:\n  tensor_parallel_size: 4\n",
        agents(4)
    ))
    .unwrap();
    assert_eq!(cfg.num_groups(), 1);
}

#[test]
fn refusals_name_the_key_and_what_would_work() {
    let cases: &[(String, &str, &[&str])] = &[
        (
            format!("{}npu_serving:\n  tensor_parallel_size: 2\n", agents(3)),
            "npu_serving.tensor_parallel_size",
            &["2 is not allowed", "the 3 agents", "one of 1, 3"],
        ),
        (
            format!("{}npu_serving:\n  tensor_parallel_size: 0\n", agents(2)),
            "npu_serving.tensor_parallel_size",
            &["0 is not allowed", "1..=64"],
        ),
        (
            format!("{}npu_serving:\n  tensor_parallel_size: 65\n", agents(2)),
            "npu_serving.tensor_parallel_size",
            &["65 is not allowed"],
        ),
        (
            format!(
                "{}npu_serving:\n  tensor_parallel_size: 2\n  swap_space_mb: 64\n",
                agents(2)
            ),
            "npu_serving.swap_space_mb",
            &[
                "tensor_parallel_size: 2",
                "set npu_serving.tensor_parallel_size: 1",
            ],
        ),
        (
            format!(
                "{}npu_serving:\n  tensor_parallel_size: 2\n  agent_roles: [prefill, decode]\n",
                agents(2)
            ),
            "npu_serving.agent_roles",
            &["prefill/decode split", "tensor_parallel_size: 2"],
        ),
        (
            format!(
                "{}npu_serving:\n  tensor_parallel_size: 2\n  long_context: {{}}\n",
                agents(2)
            ),
            "npu_serving.long_context",
            &["long-context mode", "tensor_parallel_size: 2"],
        ),
    ];
    for (yaml, key, parts) in cases {
        let e = load(yaml).unwrap_err();
        assert_eq!(e.key_path(), Some(*key), "{yaml}: {e}");
        let text = e.to_string();
        for p in *parts {
            assert!(text.contains(p), "{yaml}: {text:?} lacks {p:?}");
        }
    }
}

#[test]
fn a_model_that_cannot_be_split_is_refused_naming_the_dimension() {
    let path = npu_gguf::store::resolve_model(None).expect("the default model");
    let gguf = npu_gguf::GgufFile::open(&path).unwrap();
    let mc = npu_model::ModelConfig::from_gguf(&gguf).unwrap();
    // SmolLM2-135M: 9 heads over 3 KV heads, FFN 1536 (Q4_1 blocks of 32).
    let cfg = load(&format!(
        "{}npu_serving:\n  tensor_parallel_size: 2\n",
        agents(2)
    ))
    .unwrap();
    npu_server::serve::check_tensor_parallel(&cfg, &mc, &npu_model::Checkpoint::from(&gguf))
        .unwrap();
    let cfg = load(&format!(
        "{}npu_serving:\n  tensor_parallel_size: 4\n",
        agents(4)
    ))
    .unwrap();
    let e =
        npu_server::serve::check_tensor_parallel(&cfg, &mc, &npu_model::Checkpoint::from(&gguf))
            .unwrap_err()
            .to_string();
    for p in [
        "npu_serving.tensor_parallel_size: 4",
        "KV heads",
        "9 attention heads, 3 KV heads",
        "sizes that would work with this model: 1, 2, 3",
    ] {
        assert!(e.contains(p), "{e:?} lacks {p:?}");
    }
}

/// `npu_serving.moe_tensor_parallel`: share_each_expert by default, whole_experts by name,
/// anything else refused naming the key and both names.
#[test]
fn moe_tensor_parallel_is_one_of_two_layouts_by_name() {
    use npu_model::shard::ExpertSplit;
    let tp2 = format!("{}npu_serving:\n  tensor_parallel_size: 2\n", agents(2));
    let cfg = load(&tp2).unwrap();
    assert_eq!(
        cfg.npu_serving.moe_tensor_parallel,
        ExpertSplit::ShareEachExpert
    );
    for (name, want) in [
        ("whole_experts", ExpertSplit::WholeExperts),
        ("share_each_expert", ExpertSplit::ShareEachExpert),
    ] {
        let cfg = load(&format!("{tp2}  moe_tensor_parallel: {name}\n")).unwrap();
        assert_eq!(cfg.npu_serving.moe_tensor_parallel, want);
    }
    let e = load(&format!("{tp2}  moe_tensor_parallel: experts\n")).unwrap_err();
    assert_eq!(e.key_path(), Some("npu_serving.moe_tensor_parallel"), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("share_each_expert or whole_experts"),
        "{text}"
    );
}

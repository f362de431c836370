//! Config of prefill/decode disaggregation: `npu_serving.agent_roles` (one role per agent,
//! default both) and `npu_serving.handoff_space_mb`; every bad value is refused naming its key.

use npu_server::config::{AgentRole, ServerConfig};

fn load(yaml: &str) -> Result<ServerConfig, npu_server::config::ConfigError> {
    ServerConfig::from_yaml_str(yaml)
}

const TWO_AGENTS: &str = "serving_config:\n  agent_ports: [0, 0]\n";

#[test]
fn roles_default_to_both_and_are_read_per_agent() {
    let cfg = load(TWO_AGENTS).unwrap();
    assert_eq!(cfg.agent_roles(), vec![AgentRole::Both, AgentRole::Both]);
    assert!(!cfg.disaggregated());
    let cfg = load(&format!(
        "{TWO_AGENTS}npu_serving:\n  agent_roles: [Prefill, decode]\n  handoff_space_mb: 32\n"
    ))
    .unwrap();
    assert_eq!(
        cfg.agent_roles(),
        vec![AgentRole::Prefill, AgentRole::Decode]
    );
    assert!(cfg.disaggregated());
    assert_eq!(cfg.npu_serving.handoff_space_mb, 32);
    let cfg = load(&format!(
        "{TWO_AGENTS}npu_serving:\n  agent_roles: [both, both]\n"
    ))
    .unwrap();
    assert!(!cfg.disaggregated());
    assert!(AgentRole::Both.prefills() && AgentRole::Both.decodes());
    assert!(!AgentRole::Prefill.decodes() && !AgentRole::Decode.prefills());
}

#[test]
fn bad_roles_and_handoff_space_are_refused_naming_their_key() {
    let cases: &[(&str, &str, &[&str])] = &[
        (
            "npu_serving:\n  agent_roles: [prefill, fast]\n",
            "npu_serving.agent_roles[1]",
            &["\"fast\"", "prefill, decode, both"],
        ),
        (
            "npu_serving:\n  agent_roles: prefill\n",
            "npu_serving.agent_roles",
            &["list of roles"],
        ),
        (
            "npu_serving:\n  agent_roles: [prefill, 3]\n",
            "npu_serving.agent_roles[1]",
            &["role"],
        ),
        (
            "npu_serving:\n  agent_roles: [prefill]\n",
            "npu_serving.agent_roles",
            &[
                "[prefill]",
                "one role per serving_config.agent_ports entry (2)",
            ],
        ),
        (
            "npu_serving:\n  agent_roles: [prefill, prefill]\n",
            "npu_serving.agent_roles",
            &["one that decodes"],
        ),
        (
            "npu_serving:\n  agent_roles: [decode, decode]\n",
            "npu_serving.agent_roles",
            &["one agent that prefills"],
        ),
        (
            "npu_serving:\n  handoff_space_mb: 0\n",
            "npu_serving.handoff_space_mb",
            &["0", "1..=1000"],
        ),
        (
            "npu_serving:\n  handoff_space_mb: 5000\n",
            "npu_serving.handoff_space_mb",
            &["5000"],
        ),
    ];
    for (yaml, key, words) in cases {
        let e = load(&format!("{TWO_AGENTS}{yaml}")).unwrap_err();
        assert_eq!(e.key_path(), Some(*key), "{yaml}: {e}");
        let msg = e.to_string();
        for w in *words {
            assert!(msg.contains(w), "{yaml}: {msg:?} lacks {w:?}");
        }
    }
}

#[test]
fn a_split_is_refused_with_long_context_mode() {
    let e = load(&format!(
        "{TWO_AGENTS}npu_serving:\n  agent_roles: [prefill, decode]\n  long_context: {{}}\n"
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("npu_serving.agent_roles"), "{e}");
    assert!(e.contains("long_context"), "{e}");
    load(&format!(
        "{TWO_AGENTS}npu_serving:\n  agent_roles: [both, both]\n  long_context: {{}}\n"
    ))
    .unwrap();
}

#[test]
fn long_context_mode_is_refused_on_devices_without_its_block_copies() {
    for device in ["cuda", "ascend"] {
        let e = load(&format!(
            "pa_config:\n  block_size: 16\nnpu_serving:\n  device: {device}\n  long_context: {{}}\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("npu_serving.long_context"), "{e}");
        assert!(e.contains(device), "{e}");
    }
}

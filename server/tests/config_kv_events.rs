//! Config of KV-cache events: `npu_serving.kv_events_endpoint` turns publishing on (bind on a
//! wildcard host, connect otherwise) and `kv_events_topic` names the topic (llm-d's
//! `kv@{replica}@{model}` by default); every bad value is refused naming its key.

use npu_server::config::ServerConfig;
use npu_server::kv_events::{KvEventsEndpoint, DEFAULT_TOPIC};

fn load(yaml: &str) -> Result<ServerConfig, npu_server::config::ConfigError> {
    ServerConfig::from_yaml_str(yaml)
}

#[test]
fn events_are_off_by_default_and_read_when_an_endpoint_is_given() {
    assert_eq!(load("{}").unwrap().npu_serving.kv_events, None);
    let cfg = load("npu_serving:\n  kv_events_endpoint: tcp://*:5557\n").unwrap();
    let ev = cfg.npu_serving.kv_events.unwrap();
    assert_eq!(ev.endpoint, KvEventsEndpoint::Bind("0.0.0.0:5557".into()));
    assert_eq!(ev.topic, DEFAULT_TOPIC);
    let cfg = load(
        "npu_serving:\n  kv_events_endpoint: tcp://epp.llm-d:5557\n  kv_events_topic: \
         kv@{replica}@smol\n",
    )
    .unwrap();
    let ev = cfg.npu_serving.kv_events.unwrap();
    assert_eq!(
        ev.endpoint,
        KvEventsEndpoint::Connect("epp.llm-d:5557".into())
    );
    assert_eq!(ev.topic, "kv@{replica}@smol");
}

#[test]
fn bad_endpoints_and_lone_topics_are_refused_naming_their_key() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "npu_serving:\n  kv_events_endpoint: ipc:///tmp/kv\n",
            "npu_serving.kv_events_endpoint",
            "only TCP",
        ),
        (
            "npu_serving:\n  kv_events_endpoint: tcp://*:port\n",
            "npu_serving.kv_events_endpoint",
            "not a port",
        ),
        (
            "npu_serving:\n  kv_events_endpoint: 5557\n",
            "npu_serving.kv_events_endpoint",
            "",
        ),
        (
            "npu_serving:\n  kv_events_topic: kv\n",
            "npu_serving.kv_events_topic",
            "kv_events_endpoint",
        ),
        (
            "npu_serving:\n  prefix_cache: false\n  kv_events_endpoint: tcp://*:5557\n",
            "npu_serving.kv_events_endpoint",
            "prefix cache",
        ),
    ];
    for (yaml, key, says) in cases {
        let e = load(yaml).expect_err(yaml);
        assert_eq!(e.key_path(), Some(*key), "{yaml}: {e}");
        let text = e.to_string();
        assert!(text.contains(says), "{yaml}: {text}");
    }
}

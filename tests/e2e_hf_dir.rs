//! End to end with a Hugging Face model directory: `npu-serving synth-model` writes a tiny f32
//! Qwen2 and its Hugging Face twin (config.json, safetensors, tokenizer files with SmolLM2's
//! ChatML template, generation_config.json); `serve --model DIR` answers with the same greedy
//! token ids as `serve --model TWIN.gguf`, renders chats through the directory's template, and
//! takes the sampling defaults of requests from its generation_config.json (vLLM's
//! `--generation-config auto`; `npu_serving.generation_config: ignore` turns that off);
//! `--model ORG/NAME` finds the directory in a hub cache under `$HF_HUB_CACHE`; a damaged
//! directory stops the server at start with an error naming what is wrong.

mod e2e_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use e2e_support::*;
use serde_json::{json, Value};

/// A sweep variant small enough to load in a blink, stored in f32 so that its twin holds
/// exactly the GGUF's values.
const VARIANT: &str = "qwen2_hd32_gqa4_bias0_base1e6_untied_f32";
/// The directory's generation_config.json sampling defaults: a temperature no request's own
/// default comes near (the synthetic model is so sure of its picks that temperature 1 mostly
/// gives the greedy tokens, temperature 50 almost never), and a max_new_tokens far below the
/// server's 256.
const GEN_TEMPERATURE: f64 = 50.0;
const GEN_MAX_NEW_TOKENS: u64 = 6;
/// The server's own max_new_tokens_default.
const SERVER_MAX_NEW_TOKENS: u64 = 256;
const PROMPTS: [&str; 2] = ["The capital of France is", "def fibonacci(n):"];
const REPO: &str = "tiny-org/tiny-qwen2";
const REVISION: &str = "0123456789abcdef0123456789abcdef01234567";

struct Models {
    root: PathBuf,
    gguf: PathBuf,
    dir: PathBuf,
}

/// Runs `npu-serving ARGS`, which must succeed.
fn npu_serving(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_npu-serving"))
        .args(args)
        .output()
        .expect("npu-serving runs");
    assert!(
        out.status.success(),
        "npu-serving {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The GGUF and its twin directory (with the sampling defaults written into its
/// generation_config.json), made once per test process; earlier runs' leftovers are removed.
fn models() -> &'static Models {
    static MODELS: OnceLock<Models> = OnceLock::new();
    MODELS.get_or_init(|| {
        let tmp = std::env::temp_dir();
        for e in std::fs::read_dir(&tmp).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("npu-e2e-hf-models-") {
                if !Path::new("/proc").join(pid).exists() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let root = tmp.join(format!("npu-e2e-hf-models-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let gguf = root.join("tiny.gguf");
        let dir = root.join("tiny");
        npu_serving(&[
            "synth-model",
            "--variant",
            VARIANT,
            "--hf-dir",
            s(&dir),
            s(&gguf),
        ]);
        let path = dir.join("generation_config.json");
        let mut g: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        g["temperature"] = json!(GEN_TEMPERATURE);
        g["max_new_tokens"] = json!(GEN_MAX_NEW_TOKENS);
        std::fs::write(&path, serde_json::to_string_pretty(&g).unwrap()).unwrap();
        Models { root, gguf, dir }
    })
}

/// What the GGUF twin answers (greedy), the reference the directory must match.
struct Reference {
    /// Each prompt's greedy token ids (llm-serving's route, details on).
    ids: Vec<Vec<u64>>,
    /// A greedy chat reply.
    chat: Value,
    /// The first prompt's 16 greedy tokens through /v1/completions.
    tokens: Vec<String>,
}

/// Serves the GGUF twin once (the caller holds `serial()`), checks that it keeps the server's
/// own defaults, and records its greedy answers.
fn reference() -> &'static Reference {
    static REF: OnceLock<Reference> = OnceLock::new();
    REF.get_or_init(|| {
        let m = models();
        let server = Server::start("hf-gguf", &opts(&["--model", s(&m.gguf)]));
        let r = Reference {
            ids: PROMPTS.iter().map(|p| tgi_ids(&server, p)).collect(),
            chat: chat(&server, json!({"temperature": 0, "max_tokens": 16})),
            tokens: completion(&server, json!({"temperature": 0, "max_tokens": 16})).0,
        };
        // A GGUF has no generation_config.json: the server's own defaults.
        let (_, body) = completion(&server, json!({"temperature": 0}));
        assert_eq!(body["usage"]["completion_tokens"], SERVER_MAX_NEW_TOKENS);
        assert!(!server.log_text().contains("generation config"));
        r
    })
}

fn opts(args: &[&str]) -> ServerOpts {
    ServerOpts {
        args: args.iter().map(|a| a.to_string()).collect(),
        ..ServerOpts::default()
    }
}

/// The greedy token ids of llm-serving's route (whose `do_sample` defaults to false).
fn tgi_ids(server: &Server, prompt: &str) -> Vec<u64> {
    let (status, body) = server.post_json(
        &format!("/models/{MODEL}/generate"),
        &json!({"inputs": prompt,
                "parameters": {"max_new_tokens": 12, "details": true, "ignore_eos": true}}),
    );
    assert_eq!(status, 200, "{body}");
    let ids: Vec<u64> = body["details"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no details.tokens: {body}"))
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 12, "{body}");
    ids
}

/// /v1/completions of the first prompt with `extra` fields (`ignore_eos` on, one log-prob per
/// token): the tokens' texts and the whole answer.
fn completion(server: &Server, extra: Value) -> (Vec<String>, Value) {
    let mut body = json!({"model": MODEL, "prompt": PROMPTS[0], "logprobs": 0, "ignore_eos": true});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let (status, answer) = server.post_json("/v1/completions", &body);
    assert_eq!(status, 200, "{body} -> {answer}");
    let tokens = answer["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs.tokens: {answer}"))
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    (tokens, answer)
}

fn messages() -> Value {
    json!([
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"}
    ])
}

fn chat(server: &Server, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": messages()});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let (status, answer) = server.post_json("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{body} -> {answer}");
    answer
}

/// How many of `got`'s tokens differ from the greedy ones at the same place.
fn differing(got: &[String], greedy: &[String]) -> usize {
    assert_eq!(got.len(), greedy.len());
    got.iter().zip(greedy).filter(|(a, b)| a != b).count()
}

fn check_models_route(server: &Server) {
    let (status, text) = server.get("/v1/models");
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["data"][0]["id"], MODEL, "{v}");
    assert_eq!(v["data"][0]["max_model_len"], 1024, "{v}");
}

#[test]
fn a_directory_answers_as_its_gguf_twin_and_its_generation_config_sets_the_defaults() {
    let _serial = serial();
    let m = models();
    let want = reference();
    let server = Server::start("hf-dir", &opts(&["--model", s(&m.dir)]));
    check_models_route(&server);

    // Greedy: the GGUF twin's token ids (llm-serving's route stays greedy by default, whatever
    // temperature the file sets).
    for (prompt, ids) in PROMPTS.iter().zip(&want.ids) {
        assert_eq!(&tgi_ids(&server, prompt), ids, "{prompt:?}");
    }
    let (tokens, _) = completion(&server, json!({"temperature": 0, "max_tokens": 16}));
    assert_eq!(tokens, want.tokens);

    // Chat through the directory's own template (ChatML): the same prompt tokens and reply.
    let got = chat(&server, json!({"temperature": 0, "max_tokens": 16}));
    assert_eq!(
        got["choices"][0]["message"]["content"], want.chat["choices"][0]["message"]["content"],
        "{got}"
    );
    assert_eq!(got["usage"], want.chat["usage"], "{got}");
    let tok = npu_tokenizer::Tokenizer::from_dir(&m.dir).unwrap();
    let rendered = tok
        .chat_template()
        .unwrap()
        .render(
            &[
                npu_tokenizer::ChatMessage::system("Answer in one short sentence."),
                npu_tokenizer::ChatMessage::user("What is the capital of France?"),
            ],
            true,
        )
        .unwrap();
    assert!(
        rendered.ends_with("<|im_start|>assistant\n"),
        "{rendered:?}"
    );
    let prompt_tokens = tok.encode_with(&rendered, false, true).unwrap().len();
    assert_eq!(got["usage"]["prompt_tokens"], prompt_tokens as u64, "{got}");

    // No temperature in the request: generation_config.json's 50, far from greedy (at the
    // server's own default of 1 this model gives the greedy tokens almost everywhere).
    for seed in 1..=3 {
        let (tokens, body) = completion(&server, json!({"max_tokens": 16, "seed": seed}));
        let d = differing(&tokens, &want.tokens);
        assert!(
            d >= 8,
            "seed {seed}: only {d} of 16 tokens off greedy: {body}"
        );
    }
    // No max_tokens: generation_config.json's max_new_tokens, on both OpenAI routes and
    // llm-serving's.
    let (_, body) = completion(&server, json!({"temperature": 0}));
    assert_eq!(
        body["usage"]["completion_tokens"], GEN_MAX_NEW_TOKENS,
        "{body}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    let body = chat(&server, json!({"ignore_eos": true}));
    assert_eq!(
        body["usage"]["completion_tokens"], GEN_MAX_NEW_TOKENS,
        "{body}"
    );
    let (status, body) = server.post_json(
        &format!("/models/{MODEL}/generate"),
        &json!({"inputs": PROMPTS[0], "parameters": {"details": true, "ignore_eos": true}}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["details"]["generated_tokens"], GEN_MAX_NEW_TOKENS,
        "{body}"
    );
    // Said at start.
    let log = server.log_text();
    assert!(
        log.contains("Default sampling parameters have been overridden by the model's Hugging Face generation config")
            && log.contains("temperature=50")
            && log.contains(&format!("max_new_tokens={GEN_MAX_NEW_TOKENS}")),
        "{log}"
    );
}

#[test]
fn org_name_is_found_in_the_hub_cache_and_generation_config_ignore_keeps_the_servers_defaults() {
    let _serial = serial();
    let m = models();
    let want = reference();
    // A hub cache as huggingface_hub lays it out: refs/main names the snapshot, whose files
    // link to the directory's.
    let hub = m.root.join("hub");
    let repo = hub.join(format!("models--{}", REPO.replace('/', "--")));
    let snapshot = repo.join("snapshots").join(REVISION);
    let _ = std::fs::remove_dir_all(&hub);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), REVISION).unwrap();
    for e in std::fs::read_dir(&m.dir).unwrap().flatten() {
        std::os::unix::fs::symlink(e.path(), snapshot.join(e.file_name())).unwrap();
    }
    let server = Server::start(
        "hf-hub",
        &ServerOpts {
            env: vec![("HF_HUB_CACHE".into(), hub.clone())],
            npu_serving_extra: "  generation_config: ignore\n".into(),
            ..opts(&["--model", REPO])
        },
    );
    check_models_route(&server);
    let log = server.log_text();
    assert!(log.contains(s(&snapshot)), "{log}");
    for (prompt, ids) in PROMPTS.iter().zip(&want.ids) {
        assert_eq!(&tgi_ids(&server, prompt), ids, "{prompt:?}");
    }
    // generation_config.json's temperature 50 and max_new_tokens are not applied: the
    // server's temperature 1 keeps this sure model near its greedy tokens, and its own
    // max_new_tokens_default holds.
    for seed in 1..=2 {
        let (tokens, body) = completion(&server, json!({"max_tokens": 16, "seed": seed}));
        let d = differing(&tokens, &want.tokens);
        assert!(d < 8, "seed {seed}: {d} of 16 tokens off greedy: {body}");
    }
    let (_, body) = completion(&server, json!({"temperature": 0}));
    assert_eq!(
        body["usage"]["completion_tokens"], SERVER_MAX_NEW_TOKENS,
        "{body}"
    );
    assert!(
        log.contains("npu_serving.generation_config: ignore")
            && !log.contains("Default sampling parameters have been overridden"),
        "{log}"
    );
}

/// A directory whose files link to the good one's, except `replace` (name, new text or None
/// to leave it out).
fn damaged(name: &str, replace: &[(&str, Option<String>)]) -> PathBuf {
    let m = models();
    let dir = m.root.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(&m.dir).unwrap().flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        match replace.iter().find(|(n, _)| *n == file) {
            Some((_, Some(text))) => std::fs::write(dir.join(&file), text).unwrap(),
            Some((_, None)) => {}
            None => std::os::unix::fs::symlink(e.path(), dir.join(&file)).unwrap(),
        }
    }
    dir
}

/// `serve --model MODEL` must exit at start (not hang, not panic) with an error saying each of
/// `expect`.
fn refused(name: &str, model: &str, env: &[(&str, Option<&str>)], expect: &[&str]) {
    let yaml = ServerOpts::default().yaml();
    let (status, stderr) = serve_refused_env(name, &yaml, &["--model", model], env);
    assert_eq!(status.code(), Some(1), "{name}: {status}: {stderr}");
    assert!(!stderr.contains("panicked"), "{name}: {stderr}");
    for e in expect {
        assert!(stderr.contains(e), "{name}: {e:?} not in: {stderr}");
    }
}

#[test]
fn a_damaged_directory_stops_the_server_at_start_naming_the_problem() {
    let _serial = serial();
    let m = models();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(m.dir.join("config.json")).unwrap()).unwrap();
    let mut no_hidden = config.clone();
    no_hidden.as_object_mut().unwrap().remove("hidden_size");
    let dir = damaged(
        "no-hidden-size",
        &[("config.json", Some(no_hidden.to_string()))],
    );
    refused("hf-no-key", s(&dir), &[], &["config.json", "hidden_size"]);

    let dir = damaged("no-weights", &[("model.safetensors", None)]);
    refused("hf-no-weights", s(&dir), &[], &["safetensors"]);

    // A sharded twin missing one of its shards.
    let sharded = m.root.join("sharded");
    let gguf = m.root.join("sharded.gguf");
    npu_serving(&[
        "synth-model",
        "--variant",
        VARIANT,
        "--hf-dir",
        s(&sharded),
        "--max-shard-bytes",
        "20000000",
        s(&gguf),
    ]);
    std::fs::remove_file(&gguf).unwrap();
    let shard = "model-00002-of-00003.safetensors";
    std::fs::remove_file(sharded.join(shard)).unwrap();
    refused("hf-no-shard", s(&sharded), &[], &[shard]);

    let dir = damaged(
        "bad-generation-config",
        &[(
            "generation_config.json",
            Some(r#"{"eos_token_id": 2, "top_p": 2}"#.into()),
        )],
    );
    refused(
        "hf-bad-gen",
        s(&dir),
        &[],
        &["generation_config.json", "top_p"],
    );

    // ORG/NAME that is not in the cache: where it looked.
    let hub = m.root.join("empty-hub");
    std::fs::create_dir_all(&hub).unwrap();
    refused(
        "hf-no-repo",
        "tiny-org/absent",
        &[("HF_HUB_CACHE", Some(s(&hub)))],
        &["tiny-org/absent", s(&hub.join("models--tiny-org--absent"))],
    );
}

//! Tokenizers of Hugging Face model directories (no GGUF), built in scratch directories from the
//! default model's real vocabulary (SmolLM2-135M-Instruct, written out with
//! `tokenizer_json_from_gguf`): the same ids as the GGUF tokenizer and llama.cpp, the chat
//! template from tokenizer_config.json or chat_template.jinja, end-of-generation ids from
//! tokenizer_config.json and generation_config.json, BOS handling, and errors naming file and key.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use npu_gguf::GgufFile;
use npu_tokenizer::{
    tokenizer_config_from_gguf, tokenizer_json_from_gguf, ChatMessage, Tokenizer, TokenizerError,
};
use serde_json::{json, Value};

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model file, or None (after a loud notice) when it is absent and that is allowed.
fn model_path() -> Option<PathBuf> {
    let path = match std::env::var_os("NPU_SERVING_MODEL") {
        Some(p) => PathBuf::from(p),
        None => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/npu-serving/models").join(MODEL_FILE)
        }
    };
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("NPU_SERVING_ALLOW_NO_MODEL").as_deref() == Ok("1") {
        eprintln!(
            "\n!!!!! SKIPPING model-directory tokenizer test: model not found at {} !!!!!\n",
            path.display()
        );
        return None;
    }
    panic!(
        "model not found at {}: set NPU_SERVING_MODEL, or NPU_SERVING_ALLOW_NO_MODEL=1 to skip",
        path.display()
    );
}

/// The GGUF tokenizer and the model's tokenizer.json / tokenizer_config.json written from it.
struct Model {
    gguf_tok: Tokenizer,
    tokenizer_json: String,
    config: Value,
}

fn model() -> Option<&'static Model> {
    static MODEL: OnceLock<Option<Model>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let gguf = GgufFile::open(model_path()?).expect("open model");
            Some(Model {
                gguf_tok: Tokenizer::from_gguf(&gguf).expect("tokenizer from GGUF"),
                tokenizer_json: tokenizer_json_from_gguf(&gguf)
                    .expect("tokenizer.json from GGUF")
                    .to_string(),
                config: tokenizer_config_from_gguf(&gguf).expect("tokenizer_config from GGUF"),
            })
        })
        .as_ref()
}

/// A scratch model directory, removed when dropped.
struct ModelDir(PathBuf);

impl ModelDir {
    /// An empty directory unique to one test.
    fn empty(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("npu-tokenizer-dir-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// A directory with the model's tokenizer.json and, when given, this tokenizer_config.json.
    fn new(name: &str, model: &Model, config: Option<&Value>) -> Self {
        let dir = Self::empty(name);
        dir.write("tokenizer.json", &model.tokenizer_json);
        if let Some(config) = config {
            dir.write_json("tokenizer_config.json", config);
        }
        dir
    }

    fn write(&self, file: &str, text: &str) {
        std::fs::write(self.0.join(file), text).unwrap();
    }

    fn write_json(&self, file: &str, value: &Value) {
        self.write(file, &serde_json::to_string_pretty(value).unwrap());
    }

    fn load(&self) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_dir(&self.0)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ModelDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The model's tokenizer_config.json without its chat template.
fn config_without_template(model: &Model) -> Value {
    let mut config = model.config.clone();
    config.as_object_mut().unwrap().remove("chat_template");
    config
}

/// An error's message, checked to be about `file` and to contain every one of `parts`.
fn expect_error(result: Result<Tokenizer, TokenizerError>, file: &str, parts: &[&str]) {
    let err = match result {
        Ok(t) => panic!("loaded {t:?}, expected an error about {file}"),
        Err(e) => e,
    };
    let TokenizerError::TokenizerFile { path, .. } = &err else {
        panic!("not a file error: {err}");
    };
    assert!(
        path.ends_with(file),
        "error names {}: {err}",
        path.display()
    );
    let message = err.to_string();
    for part in parts {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
}

fn mixed_texts() -> Vec<(String, Vec<u32>)> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/mixed_oracle.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).expect("oracle JSON");
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let ids = c["ids"].as_array().unwrap();
            (
                c["text"].as_str().unwrap().to_string(),
                ids.iter().map(|x| x.as_u64().unwrap() as u32).collect(),
            )
        })
        .collect()
}

#[test]
fn directory_ids_equal_the_gguf_tokenizer() {
    let Some(model) = model() else { return };
    let dir = ModelDir::new("ids", model, Some(&model.config));
    let tok = dir.load().unwrap();
    let gguf = &model.gguf_tok;
    assert_eq!(tok.vocab_size(), gguf.vocab_size());
    assert_eq!(tok.bos_id(), gguf.bos_id());
    assert_eq!(tok.eos_id(), gguf.eos_id());
    assert_eq!(tok.adds_bos(), gguf.adds_bos());
    assert_eq!(tok.eos_ids(), gguf.eos_ids());
    let texts = [
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>",
        "<|endoftext|>text<|im_end|><|im_start|>",
        "Unicode: naïve café, 日本語のテキスト, Ελληνικά, emoji 🦀🚀 and ZWJ 👩‍👩‍👧.",
        "digits 1234567890 3.14159 -42 1e10 0x1F 2024-11-29",
        "whitespace   runs\t\ttabs\n\n\nnewlines    \n  trailing   ",
        " leading space and double  spaces",
        "code: fn main() { println!(\"{}\", 1 + 2); }",
        "",
    ];
    for text in texts {
        for (add, parse) in [(true, true), (false, false), (false, true)] {
            let ids = tok.encode_with(text, add, parse).unwrap();
            assert_eq!(ids, gguf.encode_with(text, add, parse).unwrap(), "{text:?}");
            assert_eq!(tok.decode(&ids, false), gguf.decode(&ids, false));
            assert_eq!(tok.decode(&ids, true), gguf.decode(&ids, true));
        }
    }
    // llama.cpp's own ids for the mixed oracle texts.
    for (text, want) in mixed_texts() {
        assert_eq!(tok.encode(&text).unwrap(), want, "{text:?}");
        assert_eq!(tok.decode(&want, false), text);
    }
    for id in 0..tok.vocab_size() as u32 {
        assert_eq!(tok.token_bytes(id), gguf.token_bytes(id), "token {id}");
        assert_eq!(tok.is_special(id), gguf.is_special(id), "token {id}");
    }
    // The model's own chat template, from tokenizer_config.json, renders as the GGUF's.
    let messages = [ChatMessage::system("Be brief."), ChatMessage::user("Hi")];
    assert_eq!(
        tok.chat_template()
            .unwrap()
            .render(&messages, true)
            .unwrap(),
        gguf.chat_template()
            .unwrap()
            .render(&messages, true)
            .unwrap()
    );
    // Without tokenizer_config.json: tokenizer.json alone, and ids are the same.
    let bare = ModelDir::new("ids-bare", model, None).load().unwrap();
    assert_eq!(bare.bos_id(), None);
    assert!(!bare.adds_bos());
    assert_eq!(
        bare.encode(texts[0]).unwrap(),
        gguf.encode(texts[0]).unwrap()
    );
    assert!(bare.chat_template_source().is_none());
}

#[test]
fn chat_template_jinja_wins_over_tokenizer_config() {
    let Some(model) = model() else { return };
    let mut config = config_without_template(model);
    config["chat_template"] = json!("config:{{ messages[0].content }}");
    let dir = ModelDir::new("template", model, Some(&config));
    let messages = [ChatMessage::user("hi")];
    let render = |tok: &Tokenizer| {
        tok.chat_template()
            .unwrap()
            .render(&messages, true)
            .unwrap()
    };
    assert_eq!(render(&dir.load().unwrap()), "config:hi");

    // A list of named templates: "default" is used.
    config["chat_template"] = json!([
        {"name": "tool_use", "template": "tools:{{ messages[0].content }}"},
        {"name": "default", "template": "default:{{ messages[0].content }}"},
    ]);
    dir.write_json("tokenizer_config.json", &config);
    assert_eq!(render(&dir.load().unwrap()), "default:hi");

    // chat_template.jinja wins, and gets the directory's tokens and the usual variables.
    let jinja = "{{ bos_token }}|{{ eos_token }}|{% for m in messages %}{{ m.role }}={{ m.content }}\
                 {% endfor %}|{% if tools %}{{ tools | length }} tools{% endif %}|\
                 {% if add_generation_prompt %}GEN{% endif %}\
                 {% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}";
    dir.write("chat_template.jinja", jinja);
    let tok = dir.load().unwrap();
    assert_eq!(tok.chat_template_source(), Some(jinja));
    let template = tok.chat_template().unwrap();
    assert_eq!(
        template.render(&messages, true).unwrap(),
        "<|im_start|>|<|im_end|>|user=hi||GEN"
    );
    let extra = json!({"tools": [{"type": "function"}, {"type": "function"}]});
    assert_eq!(
        template
            .render_with(&messages, false, extra.as_object().unwrap())
            .unwrap(),
        "<|im_start|>|<|im_end|>|user=hi|2 tools|"
    );
    let two = [ChatMessage::user("a"), ChatMessage::user("b")];
    let err = template.render(&two, false).unwrap_err().to_string();
    assert!(err.contains("one message only"), "{err}");

    // A template that does not compile is reported with its file.
    dir.write("chat_template.jinja", "{% for m in messages %}");
    expect_error(dir.load(), "chat_template.jinja", &["chat template"]);
}

#[test]
fn end_of_generation_ids_join_both_files() {
    let Some(model) = model() else { return };
    let tok0 = &model.gguf_tok;
    let im_end = tok0.token_id("<|im_end|>").unwrap();
    let endoftext = tok0.token_id("<|endoftext|>").unwrap();
    let hello = tok0.token_id("Hello").unwrap();
    let mut config = config_without_template(model);
    // eos_token as an AddedToken object.
    config["eos_token"] = json!({"content": "<|im_end|>", "special": true, "lstrip": false});
    let dir = ModelDir::new("eos", model, Some(&config));
    dir.write_json(
        "generation_config.json",
        &json!({"bos_token_id": 1, "eos_token_id": [hello, im_end, 49151], "temperature": 0.2}),
    );
    let tok = dir.load().unwrap();
    assert_eq!(tok.eos_id(), Some(im_end));
    // EOS first, then generation_config's ids, then end-of-turn texts (<|endoftext|>).
    assert_eq!(tok.eos_ids(), &[im_end, hello, 49151, endoftext]);
    assert!(tok.is_eos(hello));

    // A single id.
    dir.write_json("generation_config.json", &json!({"eos_token_id": hello}));
    assert_eq!(dir.load().unwrap().eos_ids(), &[im_end, hello, endoftext]);
    // null: none.
    dir.write_json("generation_config.json", &json!({"eos_token_id": null}));
    assert_eq!(dir.load().unwrap().eos_ids(), &[im_end, endoftext]);
    // Another eos_token in the config: it leads; the end-of-turn texts still end generation.
    config["eos_token"] = json!("<|endoftext|>");
    dir.write_json("tokenizer_config.json", &config);
    assert_eq!(dir.load().unwrap().eos_ids(), &[endoftext, im_end]);
}

#[test]
fn bos_follows_add_bos_token_else_the_post_processor() {
    let Some(model) = model() else { return };
    let bos = model.gguf_tok.token_id("<|im_start|>").unwrap();
    let hi = model.gguf_tok.encode_with("Hi", false, false).unwrap();
    let with_bos: Vec<u32> = [bos].iter().chain(&hi).copied().collect();
    let mut config = config_without_template(model);
    config["add_bos_token"] = json!(true);
    let dir = ModelDir::new("bos", model, Some(&config));
    let tok = dir.load().unwrap();
    assert!(tok.adds_bos());
    assert_eq!(tok.encode("Hi").unwrap(), with_bos);
    assert_eq!(tok.encode_with("Hi", false, true).unwrap(), hi);

    // A tokenizer.json whose post-processor prepends BOS.
    let mut json: Value = serde_json::from_str(&model.tokenizer_json).unwrap();
    json["post_processor"] = json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [bos], "tokens": ["<|im_start|>"]}}
    });
    dir.write_json("tokenizer.json", &json);
    // No add_bos_token: the post-processor decides.
    config.as_object_mut().unwrap().remove("add_bos_token");
    dir.write_json("tokenizer_config.json", &config);
    assert_eq!(dir.load().unwrap().encode("Hi").unwrap(), with_bos);
    std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
    let tok = dir.load().unwrap();
    assert_eq!(
        (tok.bos_id(), tok.encode("Hi").unwrap()),
        (Some(bos), with_bos)
    );
    // add_bos_token false wins over the post-processor.
    config["add_bos_token"] = json!(false);
    dir.write_json("tokenizer_config.json", &config);
    assert_eq!(dir.load().unwrap().encode("Hi").unwrap(), hi);
    // A post-processor adding another token than bos_token, with nothing to settle it: refused.
    config.as_object_mut().unwrap().remove("add_bos_token");
    config["bos_token"] = json!("<|endoftext|>");
    dir.write_json("tokenizer_config.json", &config);
    expect_error(
        dir.load(),
        "tokenizer_config.json",
        &["\"bos_token\"", "post_processor"],
    );
}

#[test]
fn bad_directories_are_errors_naming_file_and_key() {
    let Some(model) = model() else { return };

    let empty = ModelDir::empty("bad-empty");
    let dir_name = empty.path().display().to_string();
    expect_error(empty.load(), "tokenizer.json", &["missing", &dir_name]);
    empty.write("tokenizer.model", "not really sentencepiece");
    expect_error(
        empty.load(),
        "tokenizer.json",
        &[
            "SentencePiece tokenizer.model",
            "not supported",
            "tokenizer.json is needed",
        ],
    );
    let err = Tokenizer::from_dir(&empty.path().join("absent")).unwrap_err();
    assert!(err.to_string().contains("not a directory"), "{err}");

    let base = config_without_template(model);
    let with = |key: &str, value: Value| {
        let mut c = base.clone();
        c[key] = value;
        c
    };
    let dir = ModelDir::new("bad", model, None);
    let config_cases = [
        (
            with("eos_token", json!("<|not_a_token|>")),
            vec!["\"eos_token\"", "<|not_a_token|>", "not in the vocabulary"],
        ),
        (
            with("pad_token", json!({"content": "<nope>"})),
            vec!["\"pad_token\"", "not in the vocabulary"],
        ),
        (
            with("bos_token", json!(7)),
            vec!["\"bos_token\"", "found a number"],
        ),
        (
            with("eos_token", json!({"special": true})),
            vec!["\"eos_token\"", "content"],
        ),
        (
            with("chat_template", json!(42)),
            vec!["\"chat_template\"", "found a number"],
        ),
        (
            with("chat_template", json!({"default": "x"})),
            vec!["\"chat_template\"", "found an object"],
        ),
        (
            with(
                "chat_template",
                json!([{"name": "tool_use", "template": "x"}]),
            ),
            vec!["\"chat_template\"", "tool_use", "\"default\""],
        ),
        (
            with("chat_template", json!([{"name": "default"}])),
            vec!["\"chat_template\"", "entry 0"],
        ),
        (
            with("add_bos_token", json!("yes")),
            vec!["\"add_bos_token\"", "true or false"],
        ),
        (
            with("clean_up_tokenization_spaces", json!(1)),
            vec!["\"clean_up_tokenization_spaces\""],
        ),
        (
            json!(["not", "an", "object"]),
            vec!["expected a JSON object"],
        ),
    ];
    for (config, parts) in &config_cases {
        dir.write_json("tokenizer_config.json", config);
        expect_error(dir.load(), "tokenizer_config.json", parts);
    }
    // add_bos_token without a bos_token adds nothing, as in transformers.
    let mut no_bos = with("add_bos_token", json!(true));
    no_bos.as_object_mut().unwrap().remove("bos_token");
    dir.write_json("tokenizer_config.json", &no_bos);
    let tok = dir.load().unwrap();
    assert!(!tok.adds_bos() && tok.bos_id().is_none());
    // clean_up_tokenization_spaces: transformers skips it for BPE models, as decoding here does;
    // for other models it is refused.
    let cleanup = with("clean_up_tokenization_spaces", json!(true));
    dir.write_json("tokenizer_config.json", &cleanup);
    assert!(dir.load().is_ok());
    let word_level = ModelDir::empty("bad-word-level");
    word_level.write_json(
        "tokenizer.json",
        &json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1}, "unk_token": "[UNK]"}
        }),
    );
    let plain = json!({"clean_up_tokenization_spaces": false});
    word_level.write_json("tokenizer_config.json", &plain);
    assert_eq!(word_level.load().unwrap().encode("a a").unwrap(), [1, 1]);
    word_level.write_json(
        "tokenizer_config.json",
        &json!({"clean_up_tokenization_spaces": true}),
    );
    expect_error(
        word_level.load(),
        "tokenizer_config.json",
        &["\"clean_up_tokenization_spaces\"", "not BPE"],
    );
    dir.write("tokenizer_config.json", "{ not json");
    expect_error(dir.load(), "tokenizer_config.json", &["not JSON"]);
    dir.write_json("tokenizer_config.json", &base);
    assert!(dir.load().is_ok());

    for (value, part) in [
        (json!("2"), "found a string"),
        (json!([2, "x"]), "found a string"),
        (json!(-1), "found a number (-1)"),
        (json!(1.5), "found a number"),
        (json!({"id": 2}), "found an object"),
    ] {
        dir.write_json("generation_config.json", &json!({ "eos_token_id": value }));
        expect_error(
            dir.load(),
            "generation_config.json",
            &["\"eos_token_id\"", part],
        );
    }
    dir.write("generation_config.json", "[]");
    expect_error(
        dir.load(),
        "generation_config.json",
        &["expected a JSON object"],
    );
    dir.write_json("generation_config.json", &json!({"eos_token_id": 2}));
    assert!(dir.load().is_ok());

    dir.write("tokenizer.json", "{ not json");
    expect_error(dir.load(), "tokenizer.json", &["not JSON"]);
}

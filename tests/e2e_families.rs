//! End to end with a second model family: Gemma 3 270M (Q4_K_M) served by `npu-serving serve`
//! on the shipped `configs/gemma3-cpu.yaml` (the model named there is fetched by name) with a
//! real agent process. llm-serving's stream gives llama.cpp's greedy text up to each
//! reference prompt's first near-tie; the OpenAI chat route renders Gemma's turn format (the
//! file carries no template) and answers; MindSpore performance_serving's way of reading the
//! stream (tests/http_load_tester_compat.py in the server crate) works unmodified.

mod e2e_support;

use e2e_support::*;
use serde_json::{json, Value};

fn gemma3() -> std::path::PathBuf {
    let cache = npu_gguf::store::StoreEnv::from_process()
        .cache_dir()
        .expect("a cache directory");
    npu_gguf::store::ensure_chunked_model(&cache, &npu_gguf::store::GEMMA3_270M_Q4_K_M)
        .expect("the Gemma 3 270M model is needed by this test")
}

/// llama.cpp's greedy references on Gemma 3: (prompt, its tokens up to the first near-tie).
fn references() -> Vec<(String, Vec<u32>)> {
    let text = include_str!("../agent/tests/data/greedy_gemma3_270m_q4_k_m.jsonl");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let ids: Vec<u32> = v["output_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let n = v["first_step_gap_below_0.15"]
                .as_u64()
                .map_or(ids.len(), |n| n as usize);
            (v["prompt"].as_str().unwrap().to_string(), ids[..n].to_vec())
        })
        .collect()
}

/// The shipped Gemma 3 config, whose `model_file: gemma3-270m` names the model to fetch.
fn server() -> Server {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/gemma3-cpu.yaml");
    Server::start_file("gemma3", std::path::Path::new(config))
}

#[test]
fn gemma3_is_served_on_both_apis() {
    let _serial = serial();
    let path = gemma3();
    let file = npu_gguf::GgufFile::open(&path).unwrap();
    let tok = npu_tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let server = server();
    // llm-serving's stream: llama.cpp's greedy text up to the first near-tie.
    for (prompt, ids) in references() {
        let r = server.stream(Api::LlmServing, &prompt, 32);
        assert!(r.success, "{prompt:?}: {:?}", r.error);
        let want = tok.decode(&ids, true);
        assert!(
            r.resp_text.starts_with(want.as_str())
                || format!("{prompt}{}", r.resp_text).contains(&want),
            "{prompt:?}: {:?} does not begin with llama.cpp's {want:?}",
            r.resp_text
        );
    }
    // OpenAI chat: Gemma's turn format, the turn's end token stops the answer.
    let (status, body) = server.post_json(
        "/v1/chat/completions",
        &json!({
            "model": "gemma-3-270m",
            "messages": [
                {"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}
            ],
            "max_tokens": 48,
            "temperature": 0
        }),
    );
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.trim().is_empty(), "{body}");
    assert!(!content.contains("<end_of_turn>"), "{content:?}");
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
    assert!(rendered.contains("<start_of_turn>model\n"), "{rendered:?}");
    let prompt_tokens = tok.encode_with(&rendered, false, true).unwrap().len();
    assert_eq!(
        body["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
        prompt_tokens,
        "{body}"
    );
    // OpenAI completions: llama.cpp's greedy text.
    let (status, body) = server.post_json(
        "/v1/completions",
        &json!({"model": "gemma-3-270m", "prompt": "The capital of France is",
                "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(status, 200, "{body}");
    let (_, first) = &references()[0];
    let want = tok.decode(&first[..first.len().min(12)], true);
    assert!(
        body["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(&want),
        "{body} does not begin with llama.cpp's {want:?}"
    );
    // performance_serving's client reads the stream unmodified.
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/server/tests/http_load_tester_compat.py"
    );
    let out = std::process::Command::new("python3")
        .args([
            script,
            &server.port.to_string(),
            "The capital of France is",
            "16",
        ])
        .output()
        .expect("python3 runs (scripts/test.sh installs requests)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], 200, "{v}");
    assert!(
        v["joined"]
            .as_str()
            .unwrap()
            .starts_with(&tok.decode(&first[..first.len().min(16)], true)),
        "{v}"
    );
}

//! The server through the official OpenAI Python client (openai-python, tests/openai_client.py),
//! as applications and agent frameworks call it: tool calls with a named function and with
//! `required` (streamed, put together from their deltas), a tool result in the history; and 100
//! `json_schema` chat completions at temperature 1, 16 at a time, every reply validated with
//! `jsonschema`; then long constrained replies on a KV pool so small that running sequences are
//! preempted (recomputed when sampled, swapped out to the host pool and back when greedy).
//! Needs python3 with openai and jsonschema (scripts/test.sh installs them).

mod e2e_support;

use std::process::Command;

use e2e_support::*;
use serde_json::Value;

fn client(server: &Server, args: &[&str]) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(format!("http://127.0.0.1:{}/v1", server.port))
        .args(args)
        .output()
        .expect("python3 runs (scripts/test.sh installs openai and jsonschema)");
    assert!(
        out.status.success(),
        "openai-python run {args:?} failed (pip install openai jsonschema if they are \
         missing):\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log_tail()
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn tool_calls_and_schema_replies_through_openai_python() {
    let _g = serial();
    let server = Server::start("openai-python", &ServerOpts::default());
    let tools = client(&server, &["tools"]);
    assert!(
        tools["tool_calls_checked"].as_u64().unwrap() >= 6,
        "{tools}"
    );
    let schema = client(&server, &["schema", "100", "16"]);
    assert_eq!(schema["validated"], 100, "{schema}");
    assert!(schema["distinct"].as_u64().unwrap() > 20, "{schema}");
}

#[test]
fn schema_replies_validate_while_sequences_are_preempted_and_swapped() {
    let _g = serial();
    // 36 blocks of 16 tokens: two prompts of about 260 tokens (17 blocks each) nearly fill the
    // pool, and replies with a story of 100 characters or more outgrow it, so running sequences are
    // preempted: sampled ones are recomputed (their sampler history is rebuilt from the tokens),
    // greedy ones are swapped out to the host pool and back.
    let opts = ServerOpts {
        num_blocks: 36,
        seq_length: 512,
        swap_space_mb: 64,
        prefix_cache: false,
        ..ServerOpts::default()
    };
    let server = Server::start("openai-python-swap", &opts);
    let sampled = client(&server, &["schema", "16", "16", "80", "1.0", "long"]);
    assert_eq!(sampled["validated"], 16, "{sampled}");
    let recomputed = server.metric("npu_serving_preemptions_by_kind_total{kind=\"recompute\"}");
    assert!(recomputed > 0.0, "no sampled sequence was preempted");

    let greedy = client(&server, &["schema", "16", "16", "80", "0", "long"]);
    assert_eq!(greedy["validated"], 16, "{greedy}");
    let swapped = server.metric("npu_serving_preemptions_by_kind_total{kind=\"swap\"}");
    let out = server.metric("npu_serving_kv_swap_out_blocks_total");
    let back = server.metric("npu_serving_kv_swap_in_blocks_total");
    assert!(
        swapped > 0.0 && out > 0.0 && back > 0.0,
        "nothing was swapped: {swapped} swap preemptions, {out} blocks out, {back} in"
    );
}

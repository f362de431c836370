//! End to end: the server with n-gram speculative decoding on. On one server, a request that
//! drafts and the same request with `speculative: false` give the same text — greedy and
//! sampled with a seed, on both APIs, alone and under concurrent streams (which also mix the
//! sequences that draft with those that do not) — while the agents keep drafted tokens
//! (`npu_serving_spec_decode_*` metrics); and `kill -9` of the agent while it verifies drafts
//! loses no request.

mod e2e_support;

use std::time::Duration;

use e2e_support::*;
use serde_json::{json, Value};

/// A prompt whose answer repeats its input.
const EDIT: &str = "Print this list again, one item per line:\n- apples\n- pears\n- plums\n\
- cherries\n- apples\n- pears\n- plums\n- cherries\n\nThe list again:\n- apples\n- pears\n";

fn options() -> ServerOpts {
    ServerOpts {
        decode_batch_size: 8,
        npu_serving_extra: "  speculative:\n    max_batch: 8\n    min_acceptance: 0\n".into(),
        ..ServerOpts::default()
    }
}

fn completion(server: &Server, prompt: &str, extra: &Value) -> String {
    let mut body = json!({"prompt": prompt, "max_tokens": 40, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (status, v) = server.post_json("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

fn generate(server: &Server, prompt: &str, speculative: bool) -> String {
    let (status, v) = server.post_json(
        &format!("/models/{MODEL}/generate"),
        &json!({"inputs": prompt, "parameters": {"max_new_tokens": 40, "speculative": speculative}}),
    );
    assert_eq!(status, 200, "{v}");
    v["generated_text"].as_str().unwrap().to_string()
}

#[test]
fn drafting_changes_no_text_and_drafts_are_kept() {
    let _serial = serial();
    let server = Server::start("speculative", &options());
    let mut prompts: Vec<String> = reference_prompts()
        .into_iter()
        .take(3)
        .map(|(p, _)| p)
        .collect();
    prompts.push(EDIT.to_string());
    let sampled = json!({"temperature": 0.8, "top_p": 0.9, "seed": 5});
    let mut plain_texts = Vec::new();
    for p in &prompts {
        let plain = completion(&server, p, &json!({"speculative": false}));
        let drafted = completion(&server, p, &json!({}));
        assert_eq!(drafted, plain, "greedy {p:?}");
        assert_eq!(generate(&server, p, true), generate(&server, p, false));
        let mut off = sampled.clone();
        off["speculative"] = json!(false);
        assert_eq!(
            completion(&server, p, &sampled),
            completion(&server, p, &off),
            "sampled {p:?}"
        );
        plain_texts.push(plain);
    }
    let kept = server.metric("npu_serving_spec_decode_num_accepted_tokens_total");
    let drafted = server.metric("npu_serving_spec_decode_num_draft_tokens_total");
    assert!(
        kept > 0.0 && drafted >= kept,
        "{kept} of {drafted} drafts kept"
    );

    // Eight concurrent streams of the same prompts: the same texts (whether the step cost
    // measured by then makes drafting worth it at this batch size or not).
    let load: Vec<(String, usize)> = prompts.iter().map(|p| (p.clone(), 40)).collect();
    for r in server.stream_concurrently(Api::Completions, &load, 8) {
        assert!(r.success, "{:?}", r.error);
        let i = prompts.iter().position(|p| *p == r.prompt).unwrap();
        assert_eq!(r.resp_text, plain_texts[i], "streamed {:?}", r.prompt);
    }
}

#[test]
fn a_killed_agent_that_was_verifying_drafts_loses_no_request() {
    let _serial = serial();
    let server = Server::start("speculative-kill", &options());
    let want = completion(
        &server,
        EDIT,
        &json!({"speculative": false, "max_tokens": 96}),
    );
    let agent = server.agent_pid(0).expect("the agent's pid");
    let texts = std::thread::scope(|s| {
        let clients: Vec<_> = (0..4)
            .map(|_| s.spawn(|| completion(&server, EDIT, &json!({"max_tokens": 96}))))
            .collect();
        let kept = server.wait_metric(
            "npu_serving_spec_decode_num_accepted_tokens_total",
            Duration::from_secs(120),
            |v| v > 8.0,
        );
        assert!(kept > 8.0, "no drafts kept before the kill");
        // SAFETY: kill(2) on the server's agent process.
        assert_eq!(unsafe { libc::kill(agent as i32, libc::SIGKILL) }, 0);
        clients
            .into_iter()
            .map(|c| c.join().unwrap())
            .collect::<Vec<_>>()
    });
    for t in texts {
        assert_eq!(t, want);
    }
    assert!(server.metric("npu_serving_agent_restarts_total") >= 1.0);
}

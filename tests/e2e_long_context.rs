//! End to end with `npu_serving.long_context` set: the server and its agent process serve short
//! prompts with the same greedy text as a server without the mode, and prompts far longer than
//! one sequence's device budget (on a pool of two budgets) complete, concurrently, on both APIs,
//! with every block free afterwards.

mod e2e_support;

use std::time::Duration;

use e2e_support::*;

/// The test config with long-context mode on: 8-block budgets (1 initial block, a ring of 5,
/// 2 device-cache entries) of 16 tokens, 96 tokens before memory starts.
fn long_yaml(opts: &ServerOpts) -> String {
    format!(
        "{}  long_context:\n    initial_blocks: 1\n    local_blocks: 2\n    topk_blocks: 2\n    \
         representative_keys: 4\n    device_blocks: 8\n",
        opts.yaml()
    )
}

fn start_long(name: &str, opts: &ServerOpts) -> Server {
    let dir = std::env::temp_dir().join(format!(
        "npu-serving-e2e-long-{}-{name}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.yaml");
    std::fs::write(&config, long_yaml(opts)).unwrap();
    Server::start_file(name, &config)
}

#[test]
fn the_served_path_runs_long_context_mode() {
    let _serial = serial();
    let opts = ServerOpts {
        num_blocks: 16,
        seq_length: 2048,
        ..ServerOpts::default()
    };
    let short: Vec<String> = prompts()[..4].to_vec();
    let want: Vec<String> = {
        let normal = Server::start("long-normal", &ServerOpts::default());
        short
            .iter()
            .map(|p| {
                let r = normal.stream(Api::LlmServing, p, 24);
                assert!(r.success, "{:?}", r.error);
                r.resp_text
            })
            .collect()
    };
    let server = start_long("long-on", &opts);
    for (p, w) in short.iter().zip(&want) {
        let r = server.stream(Api::LlmServing, p, 24);
        assert!(r.success, "{:?}", r.error);
        assert_eq!(
            &r.resp_text, w,
            "{p:?}: below the budget the mode changes nothing"
        );
    }
    // About 600 tokens each: far past an 8-block budget, two at once on a 16-block pool.
    let long: Vec<(String, usize)> = (0..2)
        .map(|i| {
            let mut p = String::new();
            while p.len() < 2400 {
                p.push_str(&prompts()[4 + i]);
                p.push(' ');
            }
            (p, 12)
        })
        .collect();
    for api in [Api::LlmServing, Api::Completions] {
        let records = server.stream_concurrently(api, &long, 2);
        for r in &records {
            assert!(r.success, "{api:?}: {:?}", r.error);
            assert!(!r.resp_text.is_empty(), "{api:?}: no text");
        }
    }
    let used = server.wait_metric("npu_serving_kv_blocks_used", Duration::from_secs(30), |v| {
        v == 0.0
    });
    assert_eq!(used, 0.0);
    assert_eq!(server.metric("npu_serving_http_responses_5xx_total"), 0.0);
    drop(server);
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!(
        "npu-serving-e2e-long-{}-long-on",
        std::process::id()
    )));
}

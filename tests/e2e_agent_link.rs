//! End to end, tried as an attacker and as a new user would: the agent link is private (no
//! port or socket anyone else can connect to; stray connections cost nothing), an agent killed
//! while idle is noticed within a second and back soon after, a killed agent is back within two
//! seconds, a KV pool too small for one sequence is refused at start, an unknown OpenAI model
//! gets 404, and two servers on the shipped default config run side by side.

mod e2e_support;

use std::net::{Shutdown, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use e2e_support::*;
use serde_json::json;

/// Socket inodes a process holds open.
fn socket_inodes(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|t| {
                    let t = t.to_string_lossy().into_owned();
                    Some(
                        t.strip_prefix("socket:[")?
                            .trim_end_matches(']')
                            .to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// TCP ports on which `pid` listens (IPv4 and IPv6).
fn listening_tcp_ports(pid: u32) -> Vec<u16> {
    let inodes = socket_inodes(pid);
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address is HEXIP:HEXPORT; state 0A is LISTEN; field 9 is the inode.
            if f.len() > 9 && f[3] == "0A" && inodes.iter().any(|i| i == f[9]) {
                let port = f[1].rsplit(':').next().unwrap();
                ports.push(u16::from_str_radix(port, 16).unwrap());
            }
        }
    }
    ports.sort();
    ports
}

/// Unix-domain sockets on which `pid` listens.
fn listening_unix_sockets(pid: u32) -> Vec<String> {
    let inodes = socket_inodes(pid);
    let text = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    text.lines()
        .skip(1)
        .filter(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let listening = u32::from_str_radix(f[3], 16).unwrap_or(0) & 0x10000 != 0;
            listening && inodes.iter().any(|i| i == f[6])
        })
        .map(str::to_string)
        .collect()
}

/// Whether `pid` is gone or a zombie nobody reaped.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim_start().chars().next()
}

fn sigkill(pid: u32) {
    // SAFETY: kill(2) on an agent process of the server under test.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
}

/// Waits until the server has one agent again, other than `old`, and /health is 200; returns
/// how long that took from `since`.
fn back_after(server: &Server, old: u32, since: Instant, timeout: Duration) -> Duration {
    loop {
        let agents = server.agent_pids();
        if agents.len() == 1 && agents[0] != old && server.get("/health").0 == 200 {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < timeout,
            "the agent was not back within {timeout:?}; log:\n{}",
            server.log_tail()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn greedy(server: &Server, prompt: &str) -> (u16, serde_json::Value) {
    let body = json!({"inputs": prompt, "parameters": {"max_new_tokens": 8, "do_sample": false}});
    server.post_json(&format!("/models/{MODEL}/generate"), &body)
}

#[test]
fn nothing_but_the_http_port_listens_stray_connections_cost_nothing_and_a_kill_is_back_within_2s() {
    let _serial = serial();
    let server = Server::start("link", &ServerOpts::default());
    let (status, want) = greedy(&server, "The capital of France is");
    assert_eq!(status, 200, "{want}");
    let agent = server.agent_pids()[0];

    // The server listens on its HTTP port alone; the agent listens on nothing; the agent's only
    // socket is its end of the pair.
    assert_eq!(listening_tcp_ports(server.pid()), vec![server.port]);
    assert!(listening_unix_sockets(server.pid()).is_empty());
    assert!(listening_tcp_ports(agent).is_empty());
    assert!(listening_unix_sockets(agent).is_empty());
    assert_eq!(socket_inodes(agent).len(), 1);
    // No secret or segment name on its command line or in its environment.
    let cmdline = std::fs::read(format!("/proc/{agent}/cmdline")).unwrap();
    let environ = std::fs::read(format!("/proc/{agent}/environ")).unwrap();
    let segments = server.segments();
    assert_eq!(segments.len(), 1);
    for text in [&cmdline, &environ] {
        let text = String::from_utf8_lossy(text);
        assert!(!text.contains(&segments[0]), "segment name visible: {text}");
        assert!(
            !text.contains("model_path"),
            "engine config visible: {text}"
        );
    }

    // Ten stray connections each to the ports llm-serving's agents use: none reaches the server
    // (nothing of it listens there; each is refused, or answered by some other program), and
    // none costs it anything.
    for port in [16002, 16003] {
        for _ in 0..10 {
            if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
    assert_eq!(server.agent_pids(), vec![agent]);
    assert_eq!(server.metric("npu_serving_agent_restarts_total"), 0.0);
    assert_eq!(server.get("/health").0, 200);

    // kill -9 of the agent: back within 2 s, serving the same greedy text.
    let killed = Instant::now();
    sigkill(agent);
    let took = back_after(&server, agent, killed, Duration::from_secs(60));
    eprintln!("agent back {took:?} after kill -9");
    assert!(
        took < Duration::from_secs(2),
        "the agent took {took:?} to come back"
    );
    assert_ne!(
        process_state(agent),
        Some('Z'),
        "the killed agent is a zombie"
    );
    assert_eq!(server.metric("npu_serving_agent_restarts_total"), 1.0);
    assert_eq!(greedy(&server, "The capital of France is"), (200, want));
}

#[test]
fn an_idle_agent_killed_shows_as_503_within_a_second_then_200_and_serves() {
    let _serial = serial();
    let server = Server::start("idle-kill", &ServerOpts::default());
    let (status, want) = greedy(&server, "Water boils at");
    assert_eq!(status, 200);
    assert_eq!(server.get("/ready").0, 200);
    let agent = server.agent_pids()[0];
    // Idle: no request runs. Nobody asks anything but /health.
    let killed = Instant::now();
    sigkill(agent);
    loop {
        if server.get("/health").0 == 503 {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(1),
            "/health still 200 a second after the idle agent was killed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let down_for = killed.elapsed();
    assert!(down_for < Duration::from_secs(1), "{down_for:?}");
    eprintln!("/health 503 {down_for:?} after kill -9 of an idle agent");
    assert_eq!(server.get("/ready").0, 503);
    // The restart starts at once: back without any request asking for it.
    back_after(&server, agent, killed, Duration::from_secs(60));
    assert_eq!(server.get("/ready").0, 200);
    assert_ne!(
        process_state(agent),
        Some('Z'),
        "the killed agent is a zombie"
    );
    assert_eq!(server.metric("npu_serving_agent_restarts_total"), 1.0);
    let log = server.log_text();
    assert!(log.contains("SIGKILL"), "the cause is not logged:\n{log}");
    // The next request finds the agent up and gets the same greedy text.
    assert_eq!(greedy(&server, "Water boils at"), (200, want));
}

#[test]
fn a_kv_pool_too_small_for_one_sequence_is_refused_at_start_naming_both_keys() {
    let _serial = serial();
    let yaml = format!(
        "model_config:\n  model_name: '{MODEL}'\n  seq_length: 2048\n\
         serving_config:\n  agent_ports: [0]\n\
         pa_config:\n  num_blocks: 64\n  block_size: 16\n\
         npu_serving:\n  device: cpu\n  threads_per_agent: 1\n"
    );
    let (status, stderr) = serve_refused("small-pool", &yaml, &[]);
    assert!(!status.success());
    for words in [
        "pa_config.num_blocks: 64 blocks",
        "1024 token slots",
        "model_config.seq_length = 2048",
        "at least 128",
    ] {
        assert!(stderr.contains(words), "{words:?} not in:\n{stderr}");
    }
    assert!(
        !stderr.contains("agent ready"),
        "agents were started:\n{stderr}"
    );
}

#[test]
fn config_typos_in_npu_serving_and_under_strict_config_are_refused_with_a_suggestion() {
    let _serial = serial();
    let yaml = "npu_serving:\n  device: cpu\n  prefix_cahce: false\n";
    let (status, stderr) = serve_refused("typo", yaml, &[]);
    assert!(!status.success());
    assert!(
        stderr.contains("npu_serving.prefix_cahce: unknown key (did you mean prefix_cache?)"),
        "{stderr}"
    );
    let yaml = "model_confg:\n  seq_length: 512\nnpu_serving:\n  device: cpu\n";
    let (status, stderr) = serve_refused("strict", yaml, &["--strict-config"]);
    assert!(!status.success());
    assert!(
        stderr.contains("model_confg: unknown key (did you mean model_config?)"),
        "{stderr}"
    );
}

#[test]
fn openai_routes_answer_404_for_a_model_the_server_does_not_serve() {
    let _serial = serial();
    let server = Server::start("model-404", &ServerOpts::default());
    let chat = |model: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": "What is 2+2?"}],
               "max_tokens": 4, "temperature": 0})
    };
    let (status, body) = server.post_json("/v1/chat/completions", &chat("gpt-4"));
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_eq!(body["error"]["param"], "model");
    let body = json!({"model": "gpt-4", "prompt": "hi", "max_tokens": 2, "stream": true});
    let (status, body) = server.post_json("/v1/completions", &body);
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");
    let (status, body) = server.post_json("/v1/chat/completions", &chat(MODEL));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], MODEL);
    // llm-serving's route takes any name, as llm-serving does.
    let body = json!({"inputs": "hi", "parameters": {"max_new_tokens": 2}});
    assert_eq!(server.post_json("/models/gpt-4/generate", &body).0, 200);
}

#[test]
fn a_prompt_that_can_never_fit_gets_400_naming_the_limit_not_an_empty_200() {
    let _serial = serial();
    let opts = ServerOpts {
        num_blocks: 64,
        seq_length: 1024,
        ..ServerOpts::default()
    };
    let server = Server::start("too-long", &opts);
    let prompt = "word ".repeat(1225);
    let body = json!({"inputs": prompt, "parameters": {"max_new_tokens": 4}});
    let (status, v) = server.post_json(&format!("/models/{MODEL}/generate"), &body);
    assert_eq!(status, 400, "{v}");
    let msg = v["error"].as_str().unwrap();
    assert!(msg.contains("1023") && msg.contains("tokens"), "{msg}");
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4});
    let (status, v) = server.post_json("/v1/completions", &body);
    assert_eq!(status, 400, "{v}");
    let body = json!({"inputs": prompt, "parameters": {"max_new_tokens": 4}, "stream": true});
    let (status, text) = server.request(
        "POST",
        &format!("/models/{MODEL}/generate_stream"),
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 400, "{text}");
}

#[test]
fn two_servers_on_the_shipped_default_config_run_side_by_side() {
    let _serial = serial();
    // Another program holds llm-serving's agent port (if nobody else does already): it does
    // not matter, no port is opened for agents.
    let _squatter = std::net::TcpListener::bind("127.0.0.1:16002");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/smollm2-cpu.yaml");
    let a = Server::start_file("default-a", &config);
    let b = Server::start_file("default-b", &config);
    assert_ne!(a.port, b.port);
    for server in [&a, &b] {
        assert_eq!(server.get("/ready").0, 200);
        let (status, v) = greedy(server, "The quick brown fox");
        assert_eq!(status, 200, "{v}");
        assert!(!v["generated_text"].as_str().unwrap().is_empty());
    }
    // Each one's agent belongs to it alone.
    let (aa, ba) = (a.agent_pids(), b.agent_pids());
    assert_eq!((aa.len(), ba.len()), (1, 1));
    assert_ne!(aa, ba);
}

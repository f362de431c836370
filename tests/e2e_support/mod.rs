//! Shared by the end-to-end tests: starts the real `npu-serving serve` (this package's binary)
//! on port 0 with real agent processes and the default model, from a small YAML config written
//! per test; talks to it with the load tester's own HTTP client and stream parser; reads
//! /metrics, the agents' pids and the server's shared-memory segments.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use client_bench::api::{ApiKind, ApiSettings};
use client_bench::dataset::Sample;
use client_bench::http_client::{fetch_text, HttpRequest, HttpTarget, Timeouts};
use client_bench::metrics::RequestRecord;
use client_bench::runner::execute_request;
use client_bench::tokens::TokenCounter;
use serde_json::Value;

/// The served model name the configs use (and the llm-serving route's `{name}`).
pub const MODEL: &str = "SmolLM2-135M-Instruct";

/// One server at a time: the machine's cores are few, and the tests compare outputs, not speed.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the test config sets.
#[derive(Debug, Clone)]
pub struct ServerOpts {
    pub agents: usize,
    pub threads_per_agent: u32,
    pub num_blocks: u32,
    pub block_size: u32,
    pub decode_batch_size: u32,
    pub prefill_batch_size: u32,
    pub max_tokens_per_step: u32,
    pub seq_length: u32,
    pub batching_strategy: &'static str,
    pub prefix_cache: bool,
    pub shutdown_grace_ms: u64,
    /// `npu_serving.device`.
    pub device: &'static str,
    /// `npu_serving.swap_space_mb`: the agents' host KV pool.
    pub swap_space_mb: u64,
    /// `npu_serving.agent_roles` as YAML (e.g. `[prefill, decode]`); None: left out.
    pub agent_roles: Option<&'static str>,
    /// Environment variables set for the server (and so for its agents).
    pub env: Vec<(String, PathBuf)>,
    /// `npu_serving.kv_cache_memory_fraction` (`num_blocks` is then the cap); None: left out.
    pub kv_cache_memory_fraction: Option<f64>,
    /// `npu_serving.tensor_parallel_size`: ranks per group of agents.
    pub tensor_parallel_size: u32,
    /// `npu_serving.step_deadline_ms`: a longer step counts as a hung agent.
    pub step_deadline_ms: u64,
    /// More `npu_serving` keys, as YAML lines indented by two spaces.
    pub npu_serving_extra: String,
    /// More arguments of `npu-serving serve` (e.g. `--model DIR`).
    pub args: Vec<String>,
    /// The server speaks TLS (`npu_serving.tls`): `start` waits for its `listening on` line
    /// only, not for /health over plain HTTP (the test checks it over HTTPS).
    pub https: bool,
}

impl Default for ServerOpts {
    fn default() -> Self {
        Self {
            agents: 1,
            threads_per_agent: 0,
            num_blocks: 1024,
            block_size: 16,
            decode_batch_size: 32,
            prefill_batch_size: 16,
            max_tokens_per_step: 256,
            seq_length: 1024,
            batching_strategy: "continuous",
            prefix_cache: true,
            shutdown_grace_ms: 10_000,
            device: "cpu",
            swap_space_mb: 0,
            agent_roles: None,
            env: Vec::new(),
            kv_cache_memory_fraction: None,
            tensor_parallel_size: 1,
            step_deadline_ms: 60_000,
            npu_serving_extra: String::new(),
            args: Vec::new(),
            https: false,
        }
    }
}

impl ServerOpts {
    /// The test config as YAML.
    pub fn yaml(&self) -> String {
        // One entry per agent; agents talk over private socket pairs, no port is opened.
        let ports: Vec<String> = (0..self.agents).map(|_| "0".to_string()).collect();
        let roles = self
            .agent_roles
            .map_or(String::new(), |r| format!("  agent_roles: {r}\n"));
        let yaml = format!(
            "model_config:\n  model_name: '{MODEL}'\n  seq_length: {}\n  decode_batch_size: {}\n  \
             prefill_batch_size: {}\n  batching_strategy: '{}'\n\
             serving_config:\n  agent_ports: [{}]\n  server_ip: '127.0.0.1'\n  server_port: 8835\n\
             pa_config:\n  num_blocks: {}\n  block_size: {}\n\
             npu_serving:\n  device: {}\n  threads_per_agent: {}\n  max_tokens_per_step: {}\n  \
             prefix_cache: {}\n  shutdown_grace_ms: {}\n  step_deadline_ms: {}\n  \
             swap_space_mb: {}\n",
            self.seq_length,
            self.decode_batch_size,
            self.prefill_batch_size,
            self.batching_strategy,
            ports.join(", "),
            self.num_blocks,
            self.block_size,
            self.device,
            self.threads_per_agent,
            self.max_tokens_per_step,
            self.prefix_cache,
            self.shutdown_grace_ms,
            self.step_deadline_ms,
            self.swap_space_mb,
        );
        let fraction = self.kv_cache_memory_fraction.map_or(String::new(), |f| {
            format!("  kv_cache_memory_fraction: {f}\n")
        });
        let tp = if self.tensor_parallel_size > 1 {
            format!("  tensor_parallel_size: {}\n", self.tensor_parallel_size)
        } else {
            String::new()
        };
        yaml + &roles + &fraction + &tp + &self.npu_serving_extra
    }
}

/// A running `npu-serving serve`; killed (with its agents) when dropped.
pub struct Server {
    child: Option<Child>,
    pub port: u16,
    pub dir: PathBuf,
    log: PathBuf,
}

/// A fresh scratch directory for one test server.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("npu-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `npu-serving serve` on a config that must be refused: its exit status and stderr.
pub fn serve_refused(name: &str, yaml: &str, extra_args: &[&str]) -> (ExitStatus, String) {
    serve_refused_env(name, yaml, extra_args, &[])
}

/// As `serve_refused`, with environment variables set (`Some`) or removed (`None`) for the server.
pub fn serve_refused_env(
    name: &str,
    yaml: &str,
    extra_args: &[&str],
    env: &[(&str, Option<&str>)],
) -> (ExitStatus, String) {
    let dir = scratch_dir(name);
    let config = dir.join("config.yaml");
    std::fs::write(&config, yaml).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_npu-serving"));
    for (k, v) in env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let mut child = cmd
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .args(["--port", "0"])
        .args(extra_args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("npu-serving starts");
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() >= until {
            let _ = child.kill();
            panic!("the server did not refuse its config: it is still running");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

impl Server {
    /// Writes the config, starts the server with `--port 0`, waits for its `listening on` line
    /// and for /health to be 200.
    pub fn start(name: &str, opts: &ServerOpts) -> Server {
        let dir = scratch_dir(name);
        let config = dir.join("config.yaml");
        std::fs::write(&config, opts.yaml()).unwrap();
        Self::start_config(dir, &config, &opts.env, &opts.args, !opts.https)
    }

    /// Starts the server on an existing config file (e.g. a shipped one) with `--port 0`.
    pub fn start_file(name: &str, config: &std::path::Path) -> Server {
        Self::start_config(scratch_dir(name), config, &[], &[], true)
    }

    fn start_config(
        dir: PathBuf,
        config: &std::path::Path,
        env: &[(String, PathBuf)],
        args: &[String],
        wait_health: bool,
    ) -> Server {
        let log = dir.join("server.log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_npu-serving"))
            .envs(env.iter().map(|(k, v)| (k, v)))
            .arg("serve")
            .arg("--config")
            .arg(config)
            .args(["--port", "0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .expect("npu-serving starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let mut server = Server {
            child: Some(child),
            port: 0,
            dir,
            log,
        };
        let line = rx
            .recv_timeout(Duration::from_secs(300))
            .unwrap_or_else(|_| panic!("no `listening on` line; log:\n{}", server.log_tail()));
        let addr = line
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("first stdout line is {line:?}"));
        server.port = addr.rsplit_once(':').unwrap().1.parse().unwrap();
        assert_eq!(addr, format!("127.0.0.1:{}", server.port));
        if wait_health {
            server.wait_health(200, Duration::from_secs(60));
        }
        server
    }

    pub fn target(&self) -> HttpTarget {
        HttpTarget::new("127.0.0.1", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server running").id()
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    pub fn request(&self, method: &str, path: &str, body: &[u8]) -> (u16, String) {
        let req = HttpRequest {
            method,
            path,
            headers: &[("Content-Type", "application/json")],
            body,
        };
        let t = Timeouts {
            connect: Duration::from_secs(10),
            total: Duration::from_secs(300),
        };
        fetch_text(&self.target(), &req, t)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}; log:\n{}", self.log_tail()))
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        self.request("GET", path, b"")
    }

    /// POST of a JSON body; the answer parsed as JSON (Null when it is not JSON).
    pub fn post_json(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.request("POST", path, body.to_string().as_bytes());
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// A gauge or counter from /metrics.
    pub fn metric(&self, name: &str) -> f64 {
        let (status, text) = self.get("/metrics");
        assert_eq!(status, 200);
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("{name} not in /metrics"))
            .trim()
            .parse()
            .unwrap()
    }

    /// Polls /metrics until `name` satisfies `ok`; returns the last value read.
    pub fn wait_metric(&self, name: &str, timeout: Duration, ok: impl Fn(f64) -> bool) -> f64 {
        let until = Instant::now() + timeout;
        loop {
            let v = self.metric(name);
            if ok(v) || Instant::now() >= until {
                return v;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn wait_health(&self, status: u16, timeout: Duration) {
        let until = Instant::now() + timeout;
        loop {
            if self.get("/health").0 == status {
                return;
            }
            assert!(
                Instant::now() < until,
                "/health not {status} within {timeout:?}; log:\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The agent processes (the server's children).
    pub fn agent_pids(&self) -> Vec<u32> {
        let pid = self.pid();
        let mut out = Vec::new();
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
        for t in tasks.flatten() {
            let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            out.extend(
                children
                    .split_whitespace()
                    .map(|c| c.parse::<u32>().unwrap()),
            );
        }
        out.sort();
        out
    }

    /// The pid of the agent started with `--agent-id id` (with tensor parallelism: rank
    /// `id % size` of group `id / size`).
    pub fn agent_pid(&self, id: u32) -> Option<u32> {
        self.agent_pids().into_iter().find(|&p| {
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
            args.windows(2)
                .any(|w| w[0] == b"--agent-id" && w[1] == id.to_string().as_bytes())
        })
    }

    /// The server's shared-memory segments in /dev/shm.
    pub fn segments(&self) -> Vec<String> {
        let prefix = format!("{}{}-", npu_protocol::shm::SEGMENT_PREFIX, self.pid());
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(&prefix))
            .collect()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        assert_eq!(unsafe { libc::kill(self.pid() as i32, sig) }, 0);
    }

    /// Waits for the server to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let until = Instant::now() + timeout;
        let child = self.child.as_mut().expect("server running");
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < until,
                "server did not exit within {timeout:?}; log:\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One streamed request, sent and read exactly as the load tester does.
    pub fn stream(&self, api: Api, prompt: &str, max_new_tokens: usize) -> RequestRecord {
        let settings = ApiSettings {
            kind: match api {
                Api::LlmServing => ApiKind::LlmServing,
                Api::Completions | Api::Chat => ApiKind::OpenAi,
            },
            path: match api {
                Api::LlmServing => format!("/models/{MODEL}/generate_stream"),
                Api::Completions => "/v1/completions".into(),
                Api::Chat => "/v1/chat/completions".into(),
            },
            model_name: MODEL.into(),
            chat: api == Api::Chat,
            ignore_eos: false,
            api_key: None,
            json_schema: None,
        };
        let sample = Sample {
            prompt: prompt.to_string(),
            prompt_tokens: 0,
            max_new_tokens,
        };
        let t = Timeouts {
            connect: Duration::from_secs(10),
            total: Duration::from_secs(600),
        };
        execute_request(
            &self.target(),
            &settings,
            t,
            &sample,
            0,
            Instant::now(),
            token_counter(),
        )
    }

    /// `prompts[i]` streamed by `n` clients at once (client `i` sends `prompts[i % len]`);
    /// the records in client order.
    pub fn stream_concurrently(
        &self,
        api: Api,
        prompts: &[(String, usize)],
        n: usize,
    ) -> Vec<RequestRecord> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|i| {
                    let (p, max_new) = &prompts[i % prompts.len()];
                    s.spawn(move || self.stream(api, p, *max_new))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }
}

impl Drop for Server {
    /// SIGTERM (the server drains and removes its segments), SIGKILL if it lingers.
    fn drop(&mut self) {
        let running = self
            .child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none());
        if !running {
            return;
        }
        let agents = self.agent_pids();
        self.signal(libc::SIGTERM);
        let until = Instant::now() + Duration::from_secs(15);
        let Some(mut child) = self.child.take() else {
            return;
        };
        while child.try_wait().ok().flatten().is_none() {
            if Instant::now() >= until {
                let _ = child.kill();
                let _ = child.wait();
                for a in agents {
                    // SAFETY: kill(2) on the server's former children; they may be gone already.
                    unsafe { libc::kill(a as i32, libc::SIGKILL) };
                }
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Resident memory of a process, in bytes (VmRSS).
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Which front end a request goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// llm-serving `POST /models/{name}/generate_stream` (greedy, return_full_text).
    LlmServing,
    /// OpenAI `POST /v1/completions` (stream, temperature 0).
    Completions,
    /// OpenAI `POST /v1/chat/completions` (stream, temperature 0).
    Chat,
}

/// The default model's tokenizer, as the load tester counts tokens.
pub fn token_counter() -> &'static TokenCounter {
    static COUNTER: OnceLock<TokenCounter> = OnceLock::new();
    COUNTER.get_or_init(|| TokenCounter::load(None).expect("the default model is available"))
}

/// The greedy reference (llama.cpp on the same model): each prompt and the text of its greedy
/// tokens up to the first step where the top two logits are close (where a different but
/// correct kernel may pick the other token).
pub fn reference_prompts() -> Vec<(String, String)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/agent/tests/data/greedy_smollm2_q4_1.jsonl"
    );
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading the greedy reference {path}: {e}"));
    let model = npu_gguf::store::resolve_model(None).unwrap();
    let gguf = npu_gguf::GgufFile::open(&model).unwrap();
    let tokenizer = npu_tokenizer::Tokenizer::for_model(&gguf, &model).unwrap();
    let refs: Vec<(String, String)> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let ids: Vec<u32> = v["output_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let sure = v["first_step_gap_below_0.15"]
                .as_u64()
                .map_or(ids.len(), |k| k as usize);
            (
                v["prompt"].as_str().unwrap().to_string(),
                tokenizer.decode_continuation(&ids[..sure], true),
            )
        })
        .collect();
    assert!(!refs.is_empty(), "{path} has no references");
    refs
}

/// The strict CANN emulation's install directory, for `ASCEND_HOME_PATH`: the variable's value
/// when set, else the directory `scripts/ascend-emulator.sh` builds and prints.
pub fn ascend_emulator() -> PathBuf {
    if let Some(p) = std::env::var_os("ASCEND_HOME_PATH") {
        return PathBuf::from(p);
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ascend-emulator.sh");
    let out = Command::new("bash")
        .arg(script)
        .output()
        .expect("bash runs scripts/ascend-emulator.sh");
    assert!(
        out.status.success(),
        "scripts/ascend-emulator.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Assorted prompts of different lengths and kinds.
pub fn prompts() -> Vec<String> {
    [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,",
        "Three tips for staying healthy are",
        "The quick brown fox",
        "List the planets of the solar system in order from the sun:",
        "Translate to French: I would like a cup of coffee, please.",
        "In 1969, the first humans",
        "Water boils at",
        "A haiku about autumn leaves:",
        "The sky is blue because",
        "import numpy as np\nx = np.arange(10)\n",
        "My favourite recipe for pancakes starts with",
        "The three primary colours are",
        "Q: What is 12 times 12?\nA:",
        "The history of the Roman Empire can be divided into",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

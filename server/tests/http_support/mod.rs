//! Shared by the HTTP tests: starts the real mio server with the real API layer and the real
//! tokenizer of the default model on 127.0.0.1:0, with a small echo engine thread on the other
//! end of the channels (the engine is not what these tests examine: it stands in until the real
//! engine loop exists and only answers Submit/Abort with events), and raw TcpStream clients.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::RecvTimeoutError;
use npu_gguf::GgufFile;
use npu_protocol::TokenLogprob;
use npu_server::api::{ApiContext, ApiSettings};
use npu_server::engine::{
    EngineCommand, EngineHandle, EngineStats, FinishReason, GenEvent, GenerateRequest, RequestId,
    Usage,
};
use npu_server::http::{EventSink, HttpError, HttpLimits, HttpServer, ShutdownSignal};
use npu_server::metrics::Metrics;
use npu_tokenizer::Tokenizer;

pub fn tokenizer() -> Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = npu_gguf::store::resolve_model(None).expect("the default model is available");
        let gguf = GgufFile::open(&path).expect("the default model opens");
        Tokenizer::from_gguf(&gguf).expect("the default model has a tokenizer")
    })
    .clone()
}

/// What the echo engine saw.
#[derive(Default)]
pub struct EngineLog {
    pub submitted: Vec<GenerateRequest>,
    pub aborted: Vec<RequestId>,
}

/// Answers each Submit by echoing the prompt's tokens back as "generated" tokens (cycling), one
/// per `token_delay`, up to max_new_tokens, then Finished{Length}. Abort ends a request with
/// Finished{Aborted}. Prompts containing "FAIL" end with Finished{Error}.
fn spawn_echo_engine(
    sink: EventSink,
    tokenizer: Tokenizer,
    token_delay: Duration,
    log: Arc<Mutex<EngineLog>>,
) -> (EngineHandle, JoinHandle<()>) {
    let (tx, rx) = crossbeam_channel::unbounded::<EngineCommand>();
    let stats = Arc::new(EngineStats::default());
    stats
        .ready
        .store(true, std::sync::atomic::Ordering::Relaxed);
    EngineStats::set(&stats.agents_total, 1);
    EngineStats::set(&stats.agents_up, 1);
    let handle = EngineHandle {
        commands: tx,
        stats: stats.clone(),
    };
    let join = std::thread::spawn(move || {
        struct Active {
            req: GenerateRequest,
            produced: u32,
            decoder: npu_tokenizer::DecodeStream,
        }
        let mut active: HashMap<RequestId, Active> = HashMap::new();
        loop {
            let cmd = if active.is_empty() {
                rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else {
                rx.recv_timeout(token_delay)
            };
            match cmd {
                Ok(EngineCommand::Submit(req))
                | Ok(EngineCommand::SubmitConstrained(req, _))
                | Ok(EngineCommand::SubmitLora(req, _, _)) => {
                    log.lock().unwrap().submitted.push(req.clone());
                    let fail = tokenizer.decode(&req.prompt_ids, false).contains("FAIL");
                    if fail {
                        sink.send(
                            req.id,
                            GenEvent::Finished {
                                reason: FinishReason::Error,
                                usage: Usage::default(),
                                message: Some("agent 0 crashed".into()),
                            },
                        );
                        continue;
                    }
                    let decoder = tokenizer.decode_stream_continuation(true);
                    active.insert(
                        req.id,
                        Active {
                            req,
                            produced: 0,
                            decoder,
                        },
                    );
                    if !token_delay.is_zero() {
                        continue;
                    }
                }
                Ok(EngineCommand::Abort(id)) => {
                    log.lock().unwrap().aborted.push(id);
                    if let Some(a) = active.remove(&id) {
                        sink.send(
                            id,
                            GenEvent::Finished {
                                reason: FinishReason::Aborted,
                                usage: Usage {
                                    prompt_tokens: a.req.prompt_ids.len() as u32,
                                    completion_tokens: a.produced,
                                },
                                message: None,
                            },
                        );
                    }
                    continue;
                }
                // Sleep and wake: answered at once (the fake engine has nothing to free).
                Ok(EngineCommand::Sleep { id, .. }) | Ok(EngineCommand::Wake { id }) => {
                    let reply = npu_server::engine::handle::ControlReply {
                        status: 200,
                        body: serde_json::json!({}),
                    };
                    sink.send(
                        id,
                        GenEvent::Finished {
                            reason: FinishReason::Stop,
                            usage: Usage::default(),
                            message: Some(serde_json::to_string(&reply).unwrap()),
                        },
                    );
                    continue;
                }
                // The fake engine serves no LoRA adapters.
                Ok(EngineCommand::LoadLora { id, .. }) => {
                    sink.send(
                        id,
                        GenEvent::Finished {
                            reason: FinishReason::Error,
                            usage: Usage::default(),
                            message: Some("LoRA adapters are not served here".into()),
                        },
                    );
                    continue;
                }
                Ok(EngineCommand::Shutdown) | Err(RecvTimeoutError::Disconnected) => return,
                Err(RecvTimeoutError::Timeout) => {}
            }
            // One step: every active request gets a token (all of them at once without delay).
            let ids: Vec<RequestId> = active.keys().copied().collect();
            for id in ids {
                let a = active.get_mut(&id).unwrap();
                loop {
                    let p = &a.req.prompt_ids;
                    let token = p[a.produced as usize % p.len()];
                    let text = a.decoder.push(token);
                    let top = (0..a.req.params.top_n)
                        .map(|i| TokenLogprob {
                            token: p[(a.produced as usize + i as usize) % p.len()],
                            logprob: -0.25 * (i + 1) as f32,
                        })
                        .collect();
                    a.produced += 1;
                    sink.send(
                        id,
                        GenEvent::Token {
                            token: TokenLogprob {
                                token,
                                logprob: -0.25,
                            },
                            top,
                            text,
                        },
                    );
                    if a.produced >= a.req.max_new_tokens {
                        let a = active.remove(&id).unwrap();
                        sink.send(
                            id,
                            GenEvent::Finished {
                                reason: FinishReason::Length,
                                usage: Usage {
                                    prompt_tokens: a.req.prompt_ids.len() as u32,
                                    completion_tokens: a.produced,
                                },
                                message: None,
                            },
                        );
                        break;
                    }
                    if !token_delay.is_zero() {
                        break;
                    }
                }
            }
        }
    });
    (handle, join)
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub shutdown: ShutdownSignal,
    pub stats: Arc<EngineStats>,
    pub metrics: Arc<Metrics>,
    pub log: Arc<Mutex<EngineLog>>,
    pub server: Option<JoinHandle<Result<(), HttpError>>>,
    engine: EngineHandle,
    engine_thread: Option<JoinHandle<()>>,
}

impl TestServer {
    pub fn start(limits: HttpLimits, settings: ApiSettings, token_delay: Duration) -> Self {
        Self::start_with_template(limits, settings, token_delay, None)
    }

    /// `start`, with `chat_template` (Jinja source) in place of the model's chat template.
    pub fn start_with_template(
        limits: HttpLimits,
        settings: ApiSettings,
        token_delay: Duration,
        chat_template: Option<&str>,
    ) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let metrics = Arc::new(Metrics::default());
        let server = HttpServer::new(listener, limits, metrics.clone()).unwrap();
        let addr = server.local_addr().unwrap();
        let log = Arc::new(Mutex::new(EngineLog::default()));
        let (engine, engine_thread) =
            spawn_echo_engine(server.event_sink(), tokenizer(), token_delay, log.clone());
        let mut api = ApiContext::new(settings, tokenizer(), engine.stats.clone(), metrics.clone());
        if let Some(source) = chat_template {
            api = api
                .with_chat_template(source)
                .expect("the test's chat template compiles");
        }
        let api = Arc::new(api);
        let shutdown = ShutdownSignal::new();
        let sd = shutdown.clone();
        let eng = engine.clone();
        let join = std::thread::spawn(move || server.run(sd, eng, api));
        Self {
            addr,
            shutdown,
            stats: engine.stats.clone(),
            metrics,
            log,
            server: Some(join),
            engine,
            engine_thread: Some(engine_thread),
        }
    }

    pub fn quick() -> Self {
        Self::start(
            HttpLimits::default(),
            ApiSettings::default(),
            Duration::ZERO,
        )
    }

    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    }

    /// Stops the server and waits for it to return.
    pub fn stop(&mut self) -> Result<(), HttpError> {
        self.shutdown.trigger();
        let r = self
            .server
            .take()
            .map(|j| j.join().expect("server thread"))
            .unwrap_or(Ok(()));
        let _ = self.engine.commands.send(EngineCommand::Shutdown);
        if let Some(j) = self.engine_thread.take() {
            let _ = j.join();
        }
        r
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if self.server.is_some() {
            let _ = self.stop();
        }
    }
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: Vec<u8>,
    pub chunked: bool,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8(self.body.clone()).expect("UTF-8 body")
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

/// Reads one byte; None at EOF.
fn read_byte(s: &mut TcpStream) -> Option<u8> {
    let mut b = [0u8; 1];
    match s.read(&mut b).expect("read response") {
        0 => None,
        _ => Some(b[0]),
    }
}

/// Reads up to and including CRLF (without it in the result).
fn read_line(s: &mut TcpStream, what: &str) -> Vec<u8> {
    let mut line = Vec::new();
    loop {
        let b = read_byte(s).unwrap_or_else(|| {
            panic!(
                "connection closed inside {what}; got {:?}",
                String::from_utf8_lossy(&line)
            )
        });
        line.push(b);
        if line.ends_with(b"\r\n") {
            line.truncate(line.len() - 2);
            return line;
        }
    }
}

/// Reads exactly one response (Content-Length, chunked, or to EOF), never past its end, so
/// pipelined responses can be read one after the other.
pub fn read_response(s: &mut TcpStream) -> HttpResponse {
    let status_line = String::from_utf8(read_line(s, "a response head")).unwrap();
    let status: u16 = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    let mut headers = Vec::new();
    loop {
        let line = String::from_utf8(read_line(s, "a response head")).unwrap();
        if line.is_empty() {
            break;
        }
        let (k, v) = line.split_once(':').unwrap();
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    if status == 100 {
        return HttpResponse {
            status,
            headers,
            body: Vec::new(),
            chunked: false,
        };
    }
    if let Some(len) = get("content-length") {
        let mut body = vec![0u8; len.parse().unwrap()];
        s.read_exact(&mut body).expect("read a body");
        return HttpResponse {
            status,
            headers,
            body,
            chunked: false,
        };
    }
    if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        let mut body = Vec::new();
        loop {
            let size_line = read_line(s, "a chunk size");
            let size = usize::from_str_radix(std::str::from_utf8(&size_line).unwrap(), 16).unwrap();
            let mut chunk = vec![0u8; size + 2];
            s.read_exact(&mut chunk).expect("read a chunk");
            assert_eq!(&chunk[size..], b"\r\n", "chunk not terminated by CRLF");
            body.extend_from_slice(&chunk[..size]);
            if size == 0 {
                return HttpResponse {
                    status,
                    headers,
                    body,
                    chunked: true,
                };
            }
        }
    }
    let mut body = Vec::new();
    s.read_to_end(&mut body).expect("read a body to EOF");
    HttpResponse {
        status,
        headers,
        body,
        chunked: false,
    }
}

pub fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Sends raw bytes on a new connection and reads one response.
pub fn raw_exchange(server: &TestServer, raw: &[u8]) -> (TcpStream, HttpResponse) {
    let mut s = server.connect();
    s.write_all(raw).unwrap();
    let r = read_response(&mut s);
    (s, r)
}

pub fn post_json(path: &str, body: &serde_json::Value, extra_headers: &str) -> Vec<u8> {
    let b = body.to_string();
    format!("POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{extra_headers}Content-Length: {}\r\n\r\n{b}", b.len())
        .into_bytes()
}

pub fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").into_bytes()
}

/// True when the peer has closed the connection (reads EOF or a reset).
pub fn is_closed(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

/// What the echo engine generates for `prompt_ids` and `n` tokens (bytes of a character not yet
/// complete at the end are held back, as a streaming detokenizer does).
pub fn echo_text(prompt_ids: &[u32], n: usize) -> String {
    let mut stream = tokenizer().decode_stream_continuation(true);
    (0..n)
        .map(|i| stream.push(prompt_ids[i % prompt_ids.len()]))
        .collect()
}

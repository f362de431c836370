//! HTTP/1.1 on mio: one event-loop thread accepts connections, parses request heads with
//! httparse, hands complete requests to a `Handler` (the API layer), submits generation
//! requests to the engine and streams the engine's events back, with per-connection buffers;
//! optionally over TLS (rustls).

mod conn;
mod request;
mod response;
mod server;
mod tls;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::engine::{GenEvent, GenerateRequest, RequestId, TaggedEvent};

pub use request::{frame_input, FramedInput, Request};
pub use response::{write_chunk, Response};
pub use server::HttpServer;
pub use tls::{TlsAcceptor, TlsError};

/// Limits the HTTP layer enforces (from `npu_serving:` in the config).
#[derive(Debug, Clone, PartialEq)]
pub struct HttpLimits {
    /// Larger bodies get 413 without being read.
    pub max_body_bytes: u64,
    /// A request head larger than this gets 431.
    pub max_header_bytes: usize,
    /// A request head (and then its body) must arrive within this time, else 408.
    pub header_timeout: Duration,
    /// How long a keep-alive connection may sit idle between requests.
    pub idle_timeout: Duration,
    /// On shutdown, running requests may take this long to finish; then they are aborted.
    pub shutdown_grace: Duration,
    /// Waiting requests at which new generation requests get 429.
    pub max_queue: u64,
    /// Unsent response bytes one connection may hold; a client reading slower than this is cut.
    pub max_output_bytes: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_body_bytes: 1 << 20,
            max_header_bytes: 16 * 1024,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(30),
            max_queue: 1024,
            max_output_bytes: 16 << 20,
        }
    }
}

/// Errors that stop the server loop (per-connection problems never do).
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("HTTP server I/O error while {doing}: {source}")]
    Io {
        doing: &'static str,
        source: std::io::Error,
    },
}

impl HttpError {
    pub(crate) fn io(doing: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| Self::Io { doing, source }
    }
}

/// What the API layer answers to one request.
pub enum Reply {
    /// A complete response, sent at once.
    Full(Response),
    /// A generation: the HTTP layer submits `request` to the engine (or answers 429 when the
    /// queue is full) and feeds the request's events to `writer`.
    Generate(Submission),
    /// A control command for the engine (sleep, wake): sent as is (never refused for a full
    /// queue); the engine's answer comes as the request's `Finished` event, which `writer`
    /// turns into the response.
    Control(ControlSubmission),
}

/// A control command and the writer of its answer.
pub struct ControlSubmission {
    pub command: ControlCommand,
    pub writer: Box<dyn EventWriter>,
}

/// What a control route asks the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlCommand {
    Sleep {
        level: u8,
    },
    Wake,
    /// `POST /v1/load_lora_adapter`: read the adapter at `path` and serve it as `name`.
    LoadLora {
        name: String,
        path: String,
    },
}

pub struct Submission {
    /// The engine request (of choice 0).
    pub request: GenerateRequest,
    /// Requests of choices 1.. when the client asked for several choices of one prompt (OpenAI's
    /// `n`); their events reach the writer through `on_choice_event`. The HTTP layer gives each
    /// its own id.
    pub more: Vec<GenerateRequest>,
    pub writer: Box<dyn EventWriter>,
    /// Structured output: one grammar constraint per request (`request`, then `more`), or
    /// none.
    pub constraints: Vec<npu_structured::Constraint>,
    /// The LoRA adapter every request of it runs under (None: the base model).
    pub lora: Option<npu_protocol::LoraRequest>,
}

/// Turns one request's generation events into its HTTP response.
pub trait EventWriter: Send {
    /// Called once when the request has been submitted. A streaming writer returns the
    /// status and headers to send now (the body follows in chunks); others return None.
    fn stream_start(&mut self) -> Option<Response>;
    /// Called for each event in order. A streaming writer appends body bytes to `body` (the
    /// HTTP layer frames them as one chunk). At the request's end it returns `StreamDone`, or for
    /// a non-streaming writer `Complete` with the whole response.
    fn on_event(&mut self, event: &GenEvent, body: &mut Vec<u8>) -> Progress;
    /// An event of choice `choice` (0 for the submission's `request`, i for `more[i - 1]`).
    /// Events of one choice come in order; choices interleave. The response is over when this
    /// returns `StreamDone` or `Complete` (the HTTP layer aborts choices still running then).
    /// A chat reply's tool calls are split out of its content (OpenAI's `tool_calls`); writers
    /// without tool calls ignore it. `tool_names` are the offered tools (a reply that is nothing
    /// but JSON calls of them, Llama 3's form, is read as calls).
    fn enable_tool_calls(&mut self, _tool_names: &[String]) {}
    fn on_choice_event(&mut self, choice: usize, event: &GenEvent, body: &mut Vec<u8>) -> Progress {
        debug_assert_eq!(
            choice, 0,
            "a writer of one choice got an event of choice {choice}"
        );
        self.on_event(event, body)
    }
}

pub enum Progress {
    More,
    StreamDone,
    Complete(Response),
}

/// The API layer, as the HTTP loop sees it. Called on the loop thread: it must not block.
pub trait Handler: Send + Sync {
    /// Answers a complete request; `id` is the server-wide id to use if it starts a generation.
    fn handle(&self, request: &Request, id: RequestId) -> Reply;
    /// The response for an error the HTTP layer finds itself (413, 408, 431, 429, 503, ...);
    /// `path` is the request's path when known, so the API can pick its error shape.
    fn error_response(
        &self,
        path: Option<&str>,
        status: u16,
        kind: &str,
        message: &str,
    ) -> Response {
        let _ = path;
        Response::error(status, kind, message)
    }
}

/// Asks the server loop to stop: stop accepting, let running requests finish (up to the grace
/// time), then return. Clone it freely; `trigger` may be called from any thread.
#[derive(Clone, Default)]
pub struct ShutdownSignal {
    inner: Arc<ShutdownInner>,
}

#[derive(Default)]
struct ShutdownInner {
    flag: AtomicBool,
    waker: OnceLock<Arc<mio::Waker>>,
}

impl ShutdownSignal {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn trigger(&self) {
        self.inner.flag.store(true, Ordering::SeqCst);
        if let Some(w) = self.inner.waker.get() {
            let _ = w.wake();
        }
    }

    pub fn is_triggered(&self) -> bool {
        self.inner.flag.load(Ordering::SeqCst)
    }

    /// Triggers this signal on SIGINT or SIGTERM (from a small watcher thread). A second
    /// signal after the first is left to the default action by the caller's choice: this only
    /// asks for the graceful drain.
    pub fn trigger_on_termination_signals(&self) -> std::io::Result<()> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
        let me = self.clone();
        std::thread::Builder::new()
            .name("shutdown-signals".into())
            .spawn(move || {
                if let Some(sig) = signals.forever().next() {
                    tracing::info!(signal = sig, "shutting down: draining running requests");
                    me.trigger();
                }
            })?;
        Ok(())
    }

    pub(crate) fn attach(&self, waker: Arc<mio::Waker>) {
        let _ = self.inner.waker.set(waker);
        // A trigger that came before the waker was attached is seen by the loop's first check.
    }
}

/// The engine's way back to the HTTP loop: sends a request's event and wakes the loop.
/// Cheap to clone. Wake-ups are coalesced: while the loop has not yet drained, senders do not
/// wake it again.
#[derive(Clone)]
pub struct EventSink {
    tx: Sender<TaggedEvent>,
    waker: Arc<mio::Waker>,
    wake_pending: Arc<AtomicBool>,
}

impl EventSink {
    /// Sends one event; false when the HTTP server is gone.
    pub fn send(&self, id: RequestId, event: GenEvent) -> bool {
        if self.tx.send((id, event)).is_err() {
            return false;
        }
        self.wake();
        true
    }

    /// Sends several events with one wake-up (e.g. all tokens of a step).
    pub fn send_all(&self, events: impl IntoIterator<Item = TaggedEvent>) -> bool {
        let mut any = false;
        for ev in events {
            if self.tx.send(ev).is_err() {
                return false;
            }
            any = true;
        }
        if any {
            self.wake();
        }
        true
    }

    fn wake(&self) {
        if !self.wake_pending.swap(true, Ordering::SeqCst) {
            let _ = self.waker.wake();
        }
    }
}

/// When a generation request arrived and produced tokens (for the latency histograms).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RequestTiming {
    pub arrived: Instant,
    pub last_token: Option<Instant>,
}

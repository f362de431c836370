//! The mio event loop: accepts connections, drives each connection's request/response cycle,
//! submits generations to the engine, routes the engine's events (woken by a `mio::Waker`) to
//! their connections, enforces the limits and timeouts, and drains gracefully on shutdown.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token, Waker};

use super::conn::{Conn, ConnState};
use super::request::{frame_head, HeadParse, Refusal, Request};
use super::response::{write_chunk, write_last_chunk};
use super::{
    EventSink, Handler, HttpError, HttpLimits, Progress, Reply, RequestTiming, Response,
    ShutdownSignal,
};
use crate::engine::{EngineCommand, EngineHandle, EngineStats, GenEvent, RequestId, TaggedEvent};
use crate::metrics::Metrics;

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const FIRST_CONN: usize = 2;
/// How often read deadlines are checked.
const TIMER_TICK: Duration = Duration::from_millis(50);
/// Most engine events handled between two polls of the sockets.
const EVENT_BATCH: usize = 1024;

/// A bound HTTP server, not yet running. Create it, hand `event_sink()` to the engine, then `run`.
pub struct HttpServer {
    poll: Poll,
    listener: TcpListener,
    waker: Arc<Waker>,
    wake_pending: Arc<AtomicBool>,
    events_tx: Sender<TaggedEvent>,
    events_rx: Receiver<TaggedEvent>,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    tls: Option<super::TlsAcceptor>,
}

impl HttpServer {
    /// Takes a bound listener (tests bind 127.0.0.1:0).
    pub fn new(
        listener: std::net::TcpListener,
        limits: HttpLimits,
        metrics: Arc<Metrics>,
    ) -> Result<Self, HttpError> {
        listener
            .set_nonblocking(true)
            .map_err(HttpError::io("making the listener non-blocking"))?;
        let mut listener = TcpListener::from_std(listener);
        let poll = Poll::new().map_err(HttpError::io("creating the poller"))?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(HttpError::io("registering the listener"))?;
        let waker = Arc::new(
            Waker::new(poll.registry(), WAKER).map_err(HttpError::io("creating the waker"))?,
        );
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        Ok(Self {
            poll,
            listener,
            waker,
            wake_pending: Arc::new(AtomicBool::new(false)),
            events_tx,
            events_rx,
            limits,
            metrics,
            tls: None,
        })
    }

    /// Serves HTTPS: every accepted connection does a TLS handshake with the acceptor's
    /// current certificate first.
    pub fn with_tls(mut self, tls: super::TlsAcceptor) -> Self {
        self.tls = Some(tls);
        self
    }

    pub fn local_addr(&self) -> Result<SocketAddr, HttpError> {
        self.listener
            .local_addr()
            .map_err(HttpError::io("reading the listener's address"))
    }

    /// The engine's end: it sends each request's events here, which wakes the loop.
    pub fn event_sink(&self) -> EventSink {
        EventSink {
            tx: self.events_tx.clone(),
            waker: self.waker.clone(),
            wake_pending: self.wake_pending.clone(),
        }
    }

    /// Serves until `shutdown` is triggered and the running requests have finished (or the
    /// grace time has passed, when the rest are aborted).
    pub fn run(
        self,
        shutdown: ShutdownSignal,
        engine: EngineHandle,
        handler: Arc<dyn Handler>,
    ) -> Result<(), HttpError> {
        shutdown.attach(self.waker.clone());
        let mut poll = self.poll;
        let mut lp = Loop {
            listener: Some(self.listener),
            conns: HashMap::new(),
            by_request: HashMap::new(),
            next_token: FIRST_CONN,
            limits: self.limits,
            metrics: self.metrics,
            engine,
            handler,
            draining_until: None,
            pending: Vec::new(),
            tls: self.tls,
        };
        let mut events = Events::with_capacity(1024);
        let mut next_tick = Instant::now() + TIMER_TICK;
        loop {
            if shutdown.is_triggered() && lp.draining_until.is_none() {
                lp.begin_drain(&poll);
            }
            if let Some(until) = lp.draining_until {
                if lp.conns.is_empty() {
                    return Ok(());
                }
                if Instant::now() >= until {
                    lp.abort_all();
                    return Ok(());
                }
            }
            let timeout = if !self.events_rx.is_empty() || !lp.pending.is_empty() {
                Some(Duration::ZERO)
            } else if lp.conns.is_empty() && lp.draining_until.is_none() {
                None
            } else {
                Some(next_tick.saturating_duration_since(Instant::now()))
            };
            if let Err(e) = poll.poll(&mut events, timeout) {
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(HttpError::Io {
                    doing: "waiting for events",
                    source: e,
                });
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => lp.accept(&poll)?,
                    WAKER => self.wake_pending.store(false, Ordering::SeqCst),
                    tok => {
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            lp.on_readable(tok);
                        }
                        if ev.is_writable() || ev.is_write_closed() {
                            lp.flush(tok);
                        }
                    }
                }
            }
            // A bounded batch, so a flood of events cannot starve the sockets.
            for _ in 0..EVENT_BATCH {
                let Ok((id, event)) = self.events_rx.try_recv() else {
                    break;
                };
                lp.on_engine_event(id, &event);
            }
            // Connections that finished a response and may hold the next request.
            for tok in std::mem::take(&mut lp.pending) {
                lp.on_readable(tok);
            }
            let now = Instant::now();
            if now >= next_tick {
                lp.check_deadlines(now);
                next_tick = now + TIMER_TICK;
            }
        }
    }
}

struct Loop {
    listener: Option<TcpListener>,
    conns: HashMap<Token, Conn>,
    /// Each running engine request: its connection and which choice of that response it is.
    by_request: HashMap<RequestId, (Token, usize)>,
    next_token: usize,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    engine: EngineHandle,
    handler: Arc<dyn Handler>,
    draining_until: Option<Instant>,
    /// Connections back in the Head state whose buffered or unread input must be looked at
    /// (a queue, not a recursive call, so pipelined floods cannot grow the stack).
    pending: Vec<Token>,
    tls: Option<super::TlsAcceptor>,
}

impl Loop {
    fn accept(&mut self, poll: &Poll) -> Result<(), HttpError> {
        loop {
            let Some(listener) = self.listener.as_ref() else {
                return Ok(());
            };
            match listener.accept() {
                Ok((mut stream, _peer)) => {
                    let tok = Token(self.next_token);
                    self.next_token += 1;
                    if poll
                        .registry()
                        .register(&mut stream, tok, Interest::READABLE | Interest::WRITABLE)
                        .is_err()
                    {
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let now = Instant::now();
                    let mut conn = Conn::new(stream, now, now + self.limits.header_timeout);
                    if let Some(tls) = &self.tls {
                        match rustls::ServerConnection::new(tls.current()) {
                            Ok(session) => conn.tls = Some(Box::new(session)),
                            Err(e) => {
                                tracing::warn!("TLS session not created: {e}");
                                continue;
                            }
                        }
                    }
                    self.conns.insert(tok, conn);
                    self.metrics
                        .connections_open
                        .fetch_add(1, Ordering::Relaxed);
                    // Edge-triggered: data that arrived with the connection is read on its event.
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // Out of file descriptors and the like: the loop goes on, clients retry.
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    return Ok(());
                }
            }
        }
    }

    fn input_cap(&self) -> usize {
        self.limits.max_header_bytes + self.limits.max_body_bytes as usize + 64 * 1024
    }

    fn on_readable(&mut self, tok: Token) {
        let cap = self.input_cap();
        loop {
            let Some(conn) = self.conns.get_mut(&tok) else {
                return;
            };
            let was_empty = conn.inbuf.is_empty();
            let r = conn.read_available(cap);
            if was_empty && !conn.inbuf.is_empty() && matches!(conn.state, ConnState::Head) {
                let now = Instant::now();
                conn.head_started = now;
                if conn.served > 0 {
                    // An idle keep-alive connection starts a new request: its head has the full time.
                    conn.deadline = Some(now + self.limits.header_timeout);
                }
            }
            if r.failed {
                // A reset (or another socket error) under a running generation is a client
                // going away just as a clean close is.
                if !conn.request_ids().is_empty() {
                    self.metrics
                        .client_aborts_total
                        .fetch_add(1, Ordering::Relaxed);
                }
                self.close(tok, "socket error");
                return;
            }
            self.advance(tok);
            let Some(conn) = self.conns.get_mut(&tok) else {
                return;
            };
            let reading = matches!(conn.state, ConnState::Head | ConnState::Body(_));
            if r.eof {
                match conn.state {
                    ConnState::Generating { .. } => {
                        self.metrics
                            .client_aborts_total
                            .fetch_add(1, Ordering::Relaxed);
                        self.close(tok, "client went away");
                    }
                    ConnState::Responding => conn.keep_alive = false,
                    _ => self.close(tok, "client closed"),
                }
                return;
            }
            if !r.capped {
                return;
            }
            if !reading {
                if let ConnState::Generating { .. } = conn.state {
                    // More input than any request may have while its response is under way.
                    self.close(tok, "too much pipelined input");
                }
                // Responding: the rest is read when the connection is back in the Head state.
                return;
            }
        }
    }

    /// Moves a connection's request cycle forward with the input it has.
    fn advance(&mut self, tok: Token) {
        loop {
            let Some(conn) = self.conns.get_mut(&tok) else {
                return;
            };
            match &conn.state {
                ConnState::Head => {
                    if conn.inbuf.is_empty() {
                        return;
                    }
                    match frame_head(&conn.inbuf, &self.limits) {
                        HeadParse::Partial => return,
                        HeadParse::Refused(r) => {
                            self.refuse(tok, r);
                            return;
                        }
                        HeadParse::Complete(head, n) => {
                            conn.inbuf.drain(..n);
                            if head.expect_continue
                                && (conn.inbuf.len() as u64) < head.content_length
                            {
                                conn.queue(b"HTTP/1.1 100 Continue\r\n\r\n");
                            }
                            conn.keep_alive = head.keep_alive;
                            // The body gets its own full timeout.
                            conn.deadline = Some(Instant::now() + self.limits.header_timeout);
                            conn.state = ConnState::Body(head);
                            self.flush(tok);
                        }
                    }
                }
                ConnState::Body(head) => {
                    let need = head.content_length as usize;
                    if conn.inbuf.len() < need {
                        return;
                    }
                    let ConnState::Body(head) =
                        std::mem::replace(&mut conn.state, ConnState::Responding)
                    else {
                        return;
                    };
                    let body: Vec<u8> = conn.inbuf.drain(..need).collect();
                    conn.deadline = None;
                    let req = Request {
                        method: head.method,
                        path: head.path,
                        query: head.query,
                        headers: head.headers,
                        body,
                        arrived: conn.head_started,
                    };
                    self.dispatch(tok, req);
                }
                ConnState::Generating { .. } | ConnState::Responding => return,
            }
        }
    }

    fn refuse(&mut self, tok: Token, r: Refusal) {
        let resp = self
            .handler
            .error_response(r.path.as_deref(), r.status, r.kind, &r.message);
        self.respond(tok, resp, false);
    }

    /// Queues a whole response and moves to Responding.
    fn respond(&mut self, tok: Token, resp: Response, keep_alive: bool) {
        let Some(conn) = self.conns.get_mut(&tok) else {
            return;
        };
        conn.keep_alive &= keep_alive && self.draining_until.is_none();
        self.metrics.count_response(resp.status);
        resp.write_full(&mut conn.out, conn.keep_alive);
        conn.state = ConnState::Responding;
        conn.deadline = None;
        self.flush(tok);
    }

    fn dispatch(&mut self, tok: Token, req: Request) {
        self.metrics
            .http_requests_total
            .fetch_add(1, Ordering::Relaxed);
        let id = next_request_id();
        let handler = self.handler.clone();
        let reply = std::panic::catch_unwind(AssertUnwindSafe(|| handler.handle(&req, id)))
            .unwrap_or_else(|_| {
                tracing::error!(path = %req.path, "request handler panicked");
                Reply::Full(handler.error_response(
                    Some(&req.path),
                    500,
                    "internal_error",
                    "internal error while handling the request",
                ))
            });
        let sub = match reply {
            Reply::Full(resp) => return self.respond(tok, resp, true),
            Reply::Generate(sub) => sub,
            Reply::Control(ctl) => return self.dispatch_control(tok, &req, id, ctl),
        };
        let stats = &self.engine.stats;
        let inflight = self.by_request.len() as u64;
        let waiting = EngineStats::get(&stats.waiting)
            .max(inflight.saturating_sub(EngineStats::get(&stats.running)));
        if waiting >= self.limits.max_queue {
            self.metrics
                .rejected_queue_full_total
                .fetch_add(1, Ordering::Relaxed);
            let msg = format!(
                "server is busy: {waiting} requests are waiting (limit {}); retry later",
                self.limits.max_queue
            );
            let resp = handler
                .error_response(Some(&req.path), 429, "queue_full", &msg)
                .with_header("Retry-After", "1");
            return self.respond(tok, resp, true);
        }
        let mut requests = Vec::with_capacity(1 + sub.more.len());
        requests.push(sub.request);
        requests.extend(sub.more);
        let mut constraints = sub.constraints.into_iter();
        let mut ids = Vec::with_capacity(requests.len());
        for (i, mut request) in requests.into_iter().enumerate() {
            request.id = if i == 0 { id } else { next_request_id() };
            let rid = request.id;
            let command = match (constraints.next(), sub.lora.clone()) {
                (c, Some(lora)) => EngineCommand::SubmitLora(request, c.map(Box::new), lora),
                (Some(c), None) => EngineCommand::SubmitConstrained(request, Box::new(c)),
                (None, None) => EngineCommand::Submit(request),
            };
            let refused = match self.engine.commands.try_send(command) {
                Ok(()) => None,
                Err(TrySendError::Full(_)) => Some(
                    handler
                        .error_response(
                            Some(&req.path),
                            429,
                            "queue_full",
                            "engine queue is full; retry later",
                        )
                        .with_header("Retry-After", "1"),
                ),
                Err(TrySendError::Disconnected(_)) => Some(handler.error_response(
                    Some(&req.path),
                    503,
                    "engine_unavailable",
                    "the engine is not running",
                )),
            };
            if let Some(resp) = refused {
                // Choices already submitted are withdrawn: the response is the refusal.
                for &done in &ids {
                    let _ = self.engine.commands.try_send(EngineCommand::Abort(done));
                }
                let keep_alive = resp.status == 429;
                return self.respond(tok, resp, keep_alive);
            }
            ids.push(rid);
        }
        for (choice, &rid) in ids.iter().enumerate() {
            self.by_request.insert(rid, (tok, choice));
        }
        self.metrics
            .inflight
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        let Some(conn) = self.conns.get_mut(&tok) else {
            return;
        };
        conn.keep_alive &= self.draining_until.is_none();
        let mut writer = sub.writer;
        let streaming = match writer.stream_start() {
            Some(head) => {
                self.metrics.count_response(head.status);
                head.write_stream_head(&mut conn.out, conn.keep_alive);
                true
            }
            None => false,
        };
        conn.state = ConnState::Generating {
            ids,
            writer,
            streaming,
            timing: RequestTiming {
                arrived: req.arrived,
                last_token: None,
            },
        };
        self.flush(tok);
    }

    /// Sends a control command to the engine; its answer arrives as request `id`'s events.
    fn dispatch_control(
        &mut self,
        tok: Token,
        req: &Request,
        id: RequestId,
        ctl: super::ControlSubmission,
    ) {
        let command = match ctl.command {
            super::ControlCommand::Sleep { level } => EngineCommand::Sleep { id, level },
            super::ControlCommand::Wake => EngineCommand::Wake { id },
            super::ControlCommand::LoadLora { name, path } => {
                EngineCommand::LoadLora { id, name, path }
            }
        };
        if self.engine.commands.try_send(command).is_err() {
            let resp = self.handler.error_response(
                Some(&req.path),
                503,
                "engine_unavailable",
                "the engine is not running",
            );
            return self.respond(tok, resp, false);
        }
        self.by_request.insert(id, (tok, 0));
        self.metrics.inflight.fetch_add(1, Ordering::Relaxed);
        let Some(conn) = self.conns.get_mut(&tok) else {
            return;
        };
        conn.keep_alive &= self.draining_until.is_none();
        conn.state = ConnState::Generating {
            ids: vec![id],
            writer: ctl.writer,
            streaming: false,
            timing: RequestTiming {
                arrived: req.arrived,
                last_token: None,
            },
        };
        self.flush(tok);
    }

    fn on_engine_event(&mut self, id: RequestId, event: &GenEvent) {
        let Some(&(tok, choice)) = self.by_request.get(&id) else {
            return; // its client went away
        };
        let Some(conn) = self.conns.get_mut(&tok) else {
            self.by_request.remove(&id);
            return;
        };
        let ConnState::Generating {
            ids,
            writer,
            streaming,
            timing,
        } = &mut conn.state
        else {
            self.by_request.remove(&id);
            return;
        };
        let now = Instant::now();
        if let GenEvent::Token { .. } = event {
            match timing.last_token {
                None => self
                    .metrics
                    .time_to_first_token
                    .observe(now - timing.arrived),
                Some(t) => self.metrics.inter_token_latency.observe(now - t),
            }
            timing.last_token = Some(now);
        }
        let finished = matches!(event, GenEvent::Finished { .. });
        if finished {
            // This choice's engine request is over.
            self.by_request.remove(&id);
            self.metrics.inflight.fetch_sub(1, Ordering::Relaxed);
        }
        let all_finished = !ids.iter().any(|r| self.by_request.contains_key(r));
        let mut body = Vec::new();
        let progress = writer.on_choice_event(choice, event, &mut body);
        let streaming = *streaming;
        let arrived = timing.arrived;
        let done = match progress {
            Progress::More if !all_finished => {
                if streaming {
                    write_chunk(&mut conn.out, &body);
                }
                false
            }
            Progress::More | Progress::StreamDone => {
                if streaming {
                    write_chunk(&mut conn.out, &body);
                    write_last_chunk(&mut conn.out);
                } else {
                    // A non-streaming writer must answer with a whole response at the end.
                    let resp = Response::error(
                        500,
                        "internal_error",
                        "the request ended without a response",
                    );
                    self.metrics.count_response(resp.status);
                    resp.write_full(&mut conn.out, false);
                    conn.keep_alive = false;
                }
                true
            }
            Progress::Complete(resp) => {
                if streaming {
                    write_chunk(&mut conn.out, &body);
                    write_last_chunk(&mut conn.out);
                } else {
                    self.metrics.count_response(resp.status);
                    resp.write_full(&mut conn.out, conn.keep_alive);
                }
                true
            }
        };
        if done {
            let ids = std::mem::take(ids);
            conn.state = ConnState::Responding;
            self.metrics.e2e_latency.observe(now - arrived);
            // Choices still running (the writer ended early, e.g. one choice failed): the
            // engine can stop them.
            for rid in ids {
                if self.by_request.remove(&rid).is_some() {
                    self.metrics.inflight.fetch_sub(1, Ordering::Relaxed);
                    let _ = self.engine.commands.try_send(EngineCommand::Abort(rid));
                }
            }
        }
        self.flush(tok);
    }

    fn flush(&mut self, tok: Token) {
        let Some(conn) = self.conns.get_mut(&tok) else {
            return;
        };
        if conn.flush().is_err() {
            if !conn.request_ids().is_empty() {
                self.metrics
                    .client_aborts_total
                    .fetch_add(1, Ordering::Relaxed);
            }
            self.close(tok, "write failed");
            return;
        }
        if conn.pending_output() > self.limits.max_output_bytes {
            self.close(tok, "client reads too slowly");
            return;
        }
        if conn.pending_output() == 0 && matches!(conn.state, ConnState::Responding) {
            if !conn.keep_alive || conn.peer_closed {
                self.close(tok, "response sent");
                return;
            }
            conn.served += 1;
            conn.state = ConnState::Head;
            let now = Instant::now();
            conn.head_started = now;
            conn.deadline = Some(if conn.inbuf.is_empty() {
                now + self.limits.idle_timeout
            } else {
                now + self.limits.header_timeout
            });
            self.pending.push(tok);
        }
    }

    /// Drops a connection; a generation still running for it is aborted.
    fn close(&mut self, tok: Token, why: &str) {
        let Some(conn) = self.conns.remove(&tok) else {
            return;
        };
        self.metrics
            .connections_open
            .fetch_sub(1, Ordering::Relaxed);
        for &id in conn.request_ids() {
            if self.by_request.remove(&id).is_none() {
                continue; // this choice had finished
            }
            tracing::debug!(request = id, "{why}: aborting the request");
            self.metrics.inflight.fetch_sub(1, Ordering::Relaxed);
            if self
                .engine
                .commands
                .try_send(EngineCommand::Abort(id))
                .is_err()
            {
                tracing::warn!(request = id, "could not send Abort to the engine");
            }
        }
    }

    fn check_deadlines(&mut self, now: Instant) {
        let expired: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| c.deadline.is_some_and(|d| now >= d))
            .map(|(t, _)| *t)
            .collect();
        for tok in expired {
            let Some(conn) = self.conns.get_mut(&tok) else {
                continue;
            };
            let idle =
                matches!(conn.state, ConnState::Head) && conn.inbuf.is_empty() && conn.served > 0;
            if idle {
                self.close(tok, "idle keep-alive connection");
                continue;
            }
            let what = match conn.state {
                ConnState::Body(_) => "request body",
                _ => "request head",
            };
            let ms = self.limits.header_timeout.as_millis();
            let r = Refusal {
                status: 408,
                kind: "request_timeout",
                message: format!("{what} not received within {ms} ms"),
                path: match &conn.state {
                    ConnState::Body(h) => Some(h.path.clone()),
                    _ => None,
                },
            };
            self.refuse(tok, r);
        }
    }

    fn begin_drain(&mut self, poll: &Poll) {
        if let Some(mut l) = self.listener.take() {
            let _ = poll.registry().deregister(&mut l);
        }
        self.draining_until = Some(Instant::now() + self.limits.shutdown_grace);
        let toks: Vec<Token> = self.conns.keys().copied().collect();
        for tok in toks {
            let Some(conn) = self.conns.get_mut(&tok) else {
                continue;
            };
            conn.keep_alive = false;
            match conn.state {
                ConnState::Head if conn.inbuf.is_empty() => self.close(tok, "shutting down"),
                ConnState::Head | ConnState::Body(_) => {
                    let r = Refusal {
                        status: 503,
                        kind: "shutting_down",
                        message: "the server is shutting down".into(),
                        path: None,
                    };
                    self.refuse(tok, r);
                }
                ConnState::Generating { .. } | ConnState::Responding => {}
            }
        }
    }

    fn abort_all(&mut self) {
        let toks: Vec<Token> = self.conns.keys().copied().collect();
        for tok in toks {
            self.close(tok, "shutdown grace time is over");
        }
    }
}

/// Server-wide request ids, unique for the life of the process.
fn next_request_id() -> RequestId {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

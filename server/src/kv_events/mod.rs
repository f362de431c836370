//! KV-cache events for prefix-aware routing: every block the prefix cache stores or drops, per
//! agent, published to ZeroMQ subscribers the way vLLM's `--kv-events-config` publisher does
//! (a PUB socket; each batch one message `[topic, sequence number (8 bytes, big-endian),
//! MessagePack batch]`), so that a gateway (llm-d's KV-cache indexer, or any SUB socket) learns
//! which replica holds which prefix. The endpoint either binds (`tcp://*:5557`: subscribers
//! connect to the replica) or connects (`tcp://indexer:5557`: the replica connects to a
//! subscriber that binds, as llm-d deploys it, reconnecting when the link drops).
//!
//! The engine never waits on a subscriber: batches go through a bounded queue and are dropped
//! (and counted) when it is full; a subscriber that cannot keep up is disconnected.

pub mod msgpack;
pub mod zmtp;

use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use npu_scheduler::KvEvent;

/// Batches waiting for the publisher thread before new ones are dropped.
const QUEUE: usize = 4096;
/// A subscriber that takes longer than this to accept one message is disconnected.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// A connecting peer has this long to finish the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between attempts to reach a subscriber that binds.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// Where the events go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventsEndpoint {
    /// Listen on this `host:port` (`tcp://*:PORT` binds every interface); subscribers connect.
    Bind(String),
    /// Connect to a subscriber listening at this `host:port`.
    Connect(String),
}

impl KvEventsEndpoint {
    /// `tcp://HOST:PORT`: HOST `*` (or `0.0.0.0`, `[::]`) binds, any other host is connected to.
    pub fn parse(s: &str) -> Result<Self, String> {
        let Some(rest) = s.strip_prefix("tcp://") else {
            return Err("a tcp://HOST:PORT endpoint (only TCP is served)".into());
        };
        let Some((host, port)) = rest.rsplit_once(':') else {
            return Err("a tcp://HOST:PORT endpoint (the port is missing)".into());
        };
        let port: u16 = port
            .parse()
            .map_err(|_| format!("a tcp://HOST:PORT endpoint ({port:?} is not a port)"))?;
        match host {
            "" => Err("a tcp://HOST:PORT endpoint (the host is missing; * binds)".into()),
            "*" | "0.0.0.0" => Ok(Self::Bind(format!("0.0.0.0:{port}"))),
            "[::]" => Ok(Self::Bind(format!("[::]:{port}"))),
            _ if port == 0 => Err("a port to connect to (0 only where the endpoint binds)".into()),
            _ if host.contains(['/', '?', '#', '@', ' ']) => Err(format!(
                "a tcp://HOST:PORT endpoint ({host:?} is not a host)"
            )),
            _ => Ok(Self::Connect(format!("{host}:{port}"))),
        }
    }
}

/// `npu_serving.kv_events_endpoint` and `kv_events_topic`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    pub endpoint: KvEventsEndpoint,
    /// The topic of every message; `{replica}` and `{model}` are filled in at start (see
    /// `expand_topic`).
    pub topic: String,
}

/// The topic when the config names none: llm-d's `kv@<replica>@<model>` convention.
pub const DEFAULT_TOPIC: &str = "kv@{replica}@{model}";

/// Fills in `{replica}` (the address this replica serves HTTP on, as a gateway reaches it) and
/// `{model}` (the served model name).
pub fn expand_topic(topic: &str, replica: &str, model: &str) -> String {
    topic
        .replace("{replica}", replica)
        .replace("{model}", model)
}

/// The changes of one agent's cached blocks taken at one engine turn.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Seconds since the Unix epoch.
    pub ts: f64,
    /// The agent (its index among the server's agents; the data-parallel rank).
    pub rank: u32,
    pub events: Vec<KvEvent>,
}

impl KvEventBatch {
    pub fn now(rank: u32, events: Vec<KvEvent>) -> Self {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        Self { ts, rank, events }
    }
}

/// The engine's end: hands batches to the publisher without ever waiting.
#[derive(Debug, Clone)]
pub struct KvEventSender {
    tx: Sender<KvEventBatch>,
    dropped: Arc<AtomicU64>,
}

impl KvEventSender {
    pub fn send(&self, batch: KvEventBatch) {
        match self.tx.try_send(batch) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                if self.dropped.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!(
                        "KV events are produced faster than they are published: batches are \
                         dropped (subscribers will see a gap in the sequence numbers)"
                    );
                }
            }
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    /// Batches dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// A connected subscriber.
struct Peer {
    writer: Mutex<TcpStream>,
    subscriptions: Mutex<Vec<Vec<u8>>>,
    dead: AtomicBool,
}

impl Peer {
    fn wants(&self, topic: &[u8]) -> bool {
        let subs = self.subscriptions.lock().unwrap_or_else(|e| e.into_inner());
        subs.iter().any(|s| topic.starts_with(s))
    }

    fn write(&self, bytes: &[u8]) {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = w.write_all(bytes) {
            tracing::warn!(error = %e, "a KV-event subscriber is disconnected");
            self.dead.store(true, Ordering::Relaxed);
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }
}

type Peers = Arc<Mutex<Vec<Arc<Peer>>>>;

/// The publishing threads: one for the messages, one listening or connecting, one per
/// subscriber reading its subscriptions. Stopped (connections closed) when dropped.
pub struct KvEventPublisher {
    sender: KvEventSender,
    local: Option<SocketAddr>,
    stop: Arc<AtomicBool>,
    peers: Peers,
    threads: Vec<JoinHandle<()>>,
}

impl KvEventPublisher {
    /// Binds (or starts connecting) and starts publishing batches on `topic` (already
    /// expanded); `block_size` is the tokens of one KV block.
    pub fn start(endpoint: &KvEventsEndpoint, topic: String, block_size: u32) -> io::Result<Self> {
        let (tx, rx) = crossbeam_channel::bounded(QUEUE);
        let stop = Arc::new(AtomicBool::new(false));
        let peers: Peers = Arc::default();
        let mut threads = Vec::new();
        let mut local = None;
        match endpoint {
            KvEventsEndpoint::Bind(addr) => {
                let listener = TcpListener::bind(addr)?;
                local = Some(listener.local_addr()?);
                listener.set_nonblocking(true)?;
                let (stop, peers) = (stop.clone(), peers.clone());
                threads.push(spawn("kv-events-listen", move || {
                    accept_loop(listener, stop, peers)
                })?);
            }
            KvEventsEndpoint::Connect(addr) => {
                let (addr, stop, peers) = (addr.clone(), stop.clone(), peers.clone());
                threads.push(spawn("kv-events-connect", move || {
                    connect_loop(addr, stop, peers)
                })?);
            }
        }
        {
            let (stop, peers) = (stop.clone(), peers.clone());
            threads.push(spawn("kv-events", move || {
                publish_loop(rx, topic.into_bytes(), block_size, stop, peers)
            })?);
        }
        Ok(Self {
            sender: KvEventSender {
                tx,
                dropped: Arc::default(),
            },
            local,
            stop,
            peers,
            threads,
        })
    }

    pub fn sender(&self) -> KvEventSender {
        self.sender.clone()
    }

    /// The address subscribers connect to, when the endpoint binds.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local
    }
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for p in self.peers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let w = p.writer.lock().unwrap_or_else(|e| e.into_inner());
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name.into()).spawn(f)
}

fn publish_loop(
    rx: Receiver<KvEventBatch>,
    topic: Vec<u8>,
    block_size: u32,
    stop: Arc<AtomicBool>,
    peers: Peers,
) {
    let mut seq: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        let batch = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(b) => b,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let payload = msgpack::encode_batch(batch.ts, &batch.events, batch.rank, block_size);
        let message = zmtp::message(&[&topic, &seq.to_be_bytes(), &payload]);
        seq += 1;
        let targets: Vec<Arc<Peer>> = {
            let mut all = peers.lock().unwrap_or_else(|e| e.into_inner());
            all.retain(|p| !p.dead.load(Ordering::Relaxed));
            all.clone()
        };
        for p in targets.iter().filter(|p| p.wants(&topic)) {
            p.write(&message);
        }
    }
}

fn accept_loop(listener: TcpListener, stop: Arc<AtomicBool>, peers: Peers) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, from)) => {
                let (stop, peers) = (stop.clone(), peers.clone());
                let started = spawn("kv-events-peer", move || {
                    if let Err(e) = serve_peer(stream, &stop, &peers) {
                        tracing::warn!(%from, error = %e, "a KV-event subscriber's connection ended");
                    }
                });
                if let Err(e) = started {
                    tracing::warn!(error = %e, "cannot serve a KV-event subscriber");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a KV-event subscriber failed");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

fn connect_loop(addr: String, stop: Arc<AtomicBool>, peers: Peers) {
    let mut reported = false;
    while !stop.load(Ordering::Relaxed) {
        let stream = addr.to_socket_addrs().and_then(|mut all| {
            let a = all.next().ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, "the host has no address")
            })?;
            TcpStream::connect_timeout(&a, HANDSHAKE_TIMEOUT)
        });
        match stream {
            Ok(s) => {
                reported = false;
                tracing::info!(%addr, "connected to the KV-event subscriber");
                if let Err(e) = serve_peer(s, &stop, &peers) {
                    tracing::warn!(%addr, error = %e, "the KV-event subscriber's connection ended");
                }
            }
            Err(e) if !reported => {
                reported = true;
                tracing::warn!(%addr, error = %e, "cannot reach the KV-event subscriber; retrying");
            }
            Err(_) => {}
        }
        let until = std::time::Instant::now() + RECONNECT_PAUSE;
        while std::time::Instant::now() < until && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Handshakes with one subscriber, then reads its subscriptions until the connection ends.
fn serve_peer(mut stream: TcpStream, stop: &AtomicBool, peers: &Peers) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    zmtp::handshake(&mut stream)?;
    // Reads block until the peer writes or the connection closes (the publisher's drop shuts
    // every connection down).
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let peer = Arc::new(Peer {
        writer: Mutex::new(stream.try_clone()?),
        subscriptions: Mutex::default(),
        dead: AtomicBool::new(false),
    });
    if stop.load(Ordering::Relaxed) {
        return Ok(());
    }
    peers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(peer.clone());
    let mut reader = io::BufReader::new(stream);
    let ended = loop {
        let frame = match zmtp::read_frame(&mut reader) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(e),
        };
        match zmtp::peer_request(&frame) {
            Ok(zmtp::PeerRequest::Subscribe(t)) => {
                peer.subscriptions
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(t);
            }
            Ok(zmtp::PeerRequest::Cancel(t)) => {
                let mut subs = peer.subscriptions.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(i) = subs.iter().position(|s| *s == t) {
                    subs.remove(i);
                }
            }
            Ok(zmtp::PeerRequest::Ping(pong)) => peer.write(&pong),
            Ok(zmtp::PeerRequest::Other) => {}
            Err(e) => break Err(e),
        }
        if peer.dead.load(Ordering::Relaxed) || stop.load(Ordering::Relaxed) {
            break Ok(());
        }
    };
    peer.dead.store(true, Ordering::Relaxed);
    ended
}

#[cfg(test)]
mod tests;

//! Control frames on the private socket between the server and an agent: `u32` little-endian
//! length, `u8` type, payload (little-endian integers, length-prefixed UTF-8 strings). The step
//! data itself lives in the shared-memory segment; frames only say what to do and how it went.
//!
//! The handshake: the server sends `Setup` (who the agent is, its segment, its engine config and
//! a per-launch secret), the agent answers `Hello` (echoing the secret) or `StartFailed`, the
//! server answers `Welcome` or `Refuse`. Nothing of this travels on a command line.

use std::io::{Read, Write};

use thiserror::Error;

use crate::step::{SeqFailure, StepTiming, MAX_SEQ_FAILURE};

/// Largest `type + payload` length accepted (the length prefix itself excluded).
pub const MAX_FRAME_LEN: usize = 1 << 20;
/// Bytes of the length prefix.
pub const LEN_PREFIX: usize = 4;

#[derive(Debug, Error)]
pub enum FrameError {
    #[error("frame length {0} outside 1..={MAX_FRAME_LEN}")]
    BadLength(usize),
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    #[error("{kind} frame payload ends early (needs more than {len} bytes)")]
    Truncated { kind: &'static str, len: usize },
    #[error("{kind} frame has {extra} bytes after its payload")]
    TrailingBytes { kind: &'static str, extra: usize },
    #[error("{kind} frame: {detail}")]
    BadField { kind: &'static str, detail: String },
    #[error("connection closed")]
    Closed,
    #[error("connection closed in the middle of a frame")]
    ClosedMidFrame,
    #[error("control socket: {0}")]
    Io(#[from] std::io::Error),
}

/// Server -> agent, the first frame on the agent's socket: what the agent is to be.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    pub agent_id: u32,
    /// Secret of this launch; the agent proves it in its Hello.
    pub launch_token: u128,
    /// The shared-memory segment the server created for this agent.
    pub segment_name: String,
    /// The agent's `AgentEngineConfig` as JSON.
    pub config_json: String,
}

/// Agent -> server, the answer to Setup once the engine is loaded.
#[derive(Debug, Clone, PartialEq)]
pub struct Hello {
    pub agent_id: u32,
    pub pid: u32,
    pub protocol_version: u32,
    /// `Setup::launch_token`, echoed.
    pub launch_token: u128,
    /// Layout hash the agent found in (and recomputed from) the segment header.
    pub layout_hash: u64,
    pub segment_name: String,
    /// The agent's `ModelFacts` as JSON.
    pub model_facts_json: String,
}

/// How a step went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepStatus {
    /// The result is in the segment.
    Ok,
    /// The step failed; `StepDone::error` says why; the segment holds no result for it.
    Failed,
}

/// Agent -> server: the step is finished.
#[derive(Debug, Clone, PartialEq)]
pub struct StepDone {
    pub step_id: u64,
    pub status: StepStatus,
    pub timing: StepTiming,
    /// Empty when `status` is Ok.
    pub error: String,
    /// With `Ok`: the plan's sequences the agent could not run (the rest of the step ran);
    /// each reason cut to `MAX_SEQ_FAILURE` bytes.
    pub failed: Vec<SeqFailure>,
}

/// Agent -> server: how a `Sleep` or `Wake` went.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SleepDone {
    /// The level the agent is asleep at now (0: awake).
    pub level: u8,
    /// Bytes of model and KV memory the agent let go of (Sleep) or took back (Wake).
    pub bytes: u64,
    /// How long the agent took, microseconds (for Wake: the reload or the KV pool's
    /// allocation, the whole of it).
    pub took_us: u64,
    /// Empty when it went well.
    pub error: String,
}

/// Every control message.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    /// Server -> agent: who you are, where your segment is, what to load.
    Setup(Setup),
    /// Agent -> server: who I am, what I loaded.
    Hello(Hello),
    /// Server -> agent: handshake accepted.
    Welcome,
    /// Server -> agent: handshake refused; the agent exits.
    Refuse {
        reason: String,
    },
    /// Agent -> server: start-up failed (engine load, segment); the agent exits after sending.
    StartFailed {
        reason: String,
    },
    /// Server -> agent: the plan for this step is in the segment.
    Step {
        step_id: u64,
    },
    /// Server -> agent: the token-mask words of this step's plan, which said they would follow,
    /// are now in the segment (written while the agent ran the step's forward pass).
    Masks {
        step_id: u64,
    },
    /// Agent -> server: the step is done (result in the segment when status is Ok).
    StepDone(StepDone),
    /// Server -> agent: forget every slot.
    Reset,
    /// Agent -> server: every slot is forgotten.
    ResetDone,
    /// Server -> agent: exit now.
    Shutdown,
    /// Server -> agent: go to sleep (forget every slot first). Level 1: free the KV pool, keep
    /// the weights (on the CPU backend they stay where they are); level 2: drop the model too.
    Sleep {
        level: u8,
    },
    /// Agent -> server: asleep (or why not).
    SleepDone(SleepDone),
    /// Server -> agent: wake up: reload what the last Sleep dropped (nothing when awake).
    Wake,
    /// Agent -> server: awake again (`level` 0), or why not.
    WakeDone(SleepDone),
    Ping {
        nonce: u64,
    },
    Pong {
        nonce: u64,
    },
}

mod tag {
    pub const SETUP: u8 = 5;
    pub const HELLO: u8 = 1;
    pub const WELCOME: u8 = 2;
    pub const REFUSE: u8 = 3;
    pub const START_FAILED: u8 = 4;
    pub const STEP: u8 = 10;
    pub const STEP_DONE: u8 = 11;
    pub const MASKS: u8 = 15;
    pub const RESET: u8 = 12;
    pub const RESET_DONE: u8 = 13;
    pub const SHUTDOWN: u8 = 14;
    pub const PING: u8 = 20;
    pub const PONG: u8 = 21;
    pub const SLEEP: u8 = 30;
    pub const SLEEP_DONE: u8 = 31;
    pub const WAKE: u8 = 32;
    pub const WAKE_DONE: u8 = 33;
}

impl Frame {
    /// Short name of the frame kind, for errors and logs.
    pub fn kind(&self) -> &'static str {
        kind_of(self.tag()).unwrap_or("unknown")
    }

    fn tag(&self) -> u8 {
        match self {
            Frame::Setup(_) => tag::SETUP,
            Frame::Hello(_) => tag::HELLO,
            Frame::Welcome => tag::WELCOME,
            Frame::Refuse { .. } => tag::REFUSE,
            Frame::StartFailed { .. } => tag::START_FAILED,
            Frame::Step { .. } => tag::STEP,
            Frame::StepDone(_) => tag::STEP_DONE,
            Frame::Masks { .. } => tag::MASKS,
            Frame::Reset => tag::RESET,
            Frame::ResetDone => tag::RESET_DONE,
            Frame::Shutdown => tag::SHUTDOWN,
            Frame::Ping { .. } => tag::PING,
            Frame::Pong { .. } => tag::PONG,
            Frame::Sleep { .. } => tag::SLEEP,
            Frame::SleepDone(_) => tag::SLEEP_DONE,
            Frame::Wake => tag::WAKE,
            Frame::WakeDone(_) => tag::WAKE_DONE,
        }
    }

    /// The whole frame, length prefix included. Texts too long for a frame are cut (at a char
    /// boundary) so that the frame always fits.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; LEN_PREFIX];
        out.push(self.tag());
        match self {
            Frame::Setup(s) => {
                out.extend_from_slice(&s.agent_id.to_le_bytes());
                out.extend_from_slice(&s.launch_token.to_le_bytes());
                put_str(&mut out, &s.segment_name, MAX_FRAME_LEN / 4);
                let room = MAX_FRAME_LEN - (out.len() - LEN_PREFIX) - 4;
                put_str(&mut out, &s.config_json, room);
            }
            Frame::Hello(h) => {
                out.extend_from_slice(&h.agent_id.to_le_bytes());
                out.extend_from_slice(&h.pid.to_le_bytes());
                out.extend_from_slice(&h.protocol_version.to_le_bytes());
                out.extend_from_slice(&h.launch_token.to_le_bytes());
                out.extend_from_slice(&h.layout_hash.to_le_bytes());
                put_str(&mut out, &h.segment_name, MAX_FRAME_LEN / 4);
                let room = MAX_FRAME_LEN - (out.len() - LEN_PREFIX) - 4;
                put_str(&mut out, &h.model_facts_json, room);
            }
            Frame::Welcome | Frame::Reset | Frame::ResetDone | Frame::Shutdown | Frame::Wake => {}
            Frame::Sleep { level } => out.push(*level),
            Frame::SleepDone(d) | Frame::WakeDone(d) => {
                out.push(d.level);
                out.extend_from_slice(&d.bytes.to_le_bytes());
                out.extend_from_slice(&d.took_us.to_le_bytes());
                put_str(&mut out, &d.error, MAX_FRAME_LEN - 64);
            }
            Frame::Refuse { reason } | Frame::StartFailed { reason } => {
                put_str(&mut out, reason, MAX_FRAME_LEN - 5);
            }
            Frame::Step { step_id } | Frame::Masks { step_id } => {
                out.extend_from_slice(&step_id.to_le_bytes())
            }
            Frame::StepDone(d) => {
                out.extend_from_slice(&d.step_id.to_le_bytes());
                out.push(match d.status {
                    StepStatus::Ok => 0,
                    StepStatus::Failed => 1,
                });
                out.extend_from_slice(&d.timing.forward_us.to_le_bytes());
                out.extend_from_slice(&d.timing.sample_us.to_le_bytes());
                out.extend_from_slice(&d.timing.total_us.to_le_bytes());
                out.extend_from_slice(&(d.failed.len() as u32).to_le_bytes());
                for f in &d.failed {
                    // Every failure keeps its slot; reasons are cut, then dropped past half
                    // the frame, so that the frame always fits.
                    let room = (MAX_FRAME_LEN / 2).saturating_sub(out.len());
                    out.extend_from_slice(&f.slot.to_le_bytes());
                    put_str(&mut out, &f.error, MAX_SEQ_FAILURE.min(room));
                }
                let room = MAX_FRAME_LEN - (out.len() - LEN_PREFIX) - 4;
                put_str(&mut out, &d.error, room);
            }
            Frame::Ping { nonce } | Frame::Pong { nonce } => {
                out.extend_from_slice(&nonce.to_le_bytes())
            }
        }
        let len = (out.len() - LEN_PREFIX) as u32;
        out[..LEN_PREFIX].copy_from_slice(&len.to_le_bytes());
        out
    }

    /// Decodes the first frame of `buf`. `Ok(None)`: not all of it has arrived yet;
    /// `Ok(Some((frame, used)))`: a frame and the bytes it took; errors for malformed frames.
    pub fn decode(buf: &[u8]) -> Result<Option<(Frame, usize)>, FrameError> {
        let Some(prefix) = buf.get(..LEN_PREFIX) else {
            return Ok(None);
        };
        let len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
        if len == 0 || len > MAX_FRAME_LEN {
            return Err(FrameError::BadLength(len));
        }
        let Some(body) = buf.get(LEN_PREFIX..LEN_PREFIX + len) else {
            return Ok(None);
        };
        let frame = decode_body(body[0], &body[1..])?;
        Ok(Some((frame, LEN_PREFIX + len)))
    }
}

fn kind_of(tag: u8) -> Option<&'static str> {
    Some(match tag {
        tag::SETUP => "Setup",
        tag::HELLO => "Hello",
        tag::WELCOME => "Welcome",
        tag::REFUSE => "Refuse",
        tag::START_FAILED => "StartFailed",
        tag::STEP => "Step",
        tag::STEP_DONE => "StepDone",
        tag::MASKS => "Masks",
        tag::RESET => "Reset",
        tag::RESET_DONE => "ResetDone",
        tag::SHUTDOWN => "Shutdown",
        tag::PING => "Ping",
        tag::PONG => "Pong",
        tag::SLEEP => "Sleep",
        tag::SLEEP_DONE => "SleepDone",
        tag::WAKE => "Wake",
        tag::WAKE_DONE => "WakeDone",
        _ => return None,
    })
}

fn put_str(out: &mut Vec<u8>, s: &str, max: usize) {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u32).to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

/// Reads a payload field by field.
struct Payload<'a> {
    kind: &'static str,
    rest: &'a [u8],
    len: usize,
}

impl<'a> Payload<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.rest.len() < n {
            return Err(FrameError::Truncated {
                kind: self.kind,
                len: self.len,
            });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    /// Payload bytes read so far.
    fn used(&self) -> usize {
        self.len - self.rest.len()
    }

    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, FrameError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, FrameError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn u128(&mut self) -> Result<u128, FrameError> {
        let b = self.take(16)?;
        let mut a = [0u8; 16];
        a.copy_from_slice(b);
        Ok(u128::from_le_bytes(a))
    }

    fn string(&mut self) -> Result<String, FrameError> {
        let n = self.u32()? as usize;
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| FrameError::BadField {
            kind: self.kind,
            detail: "text is not UTF-8".into(),
        })
    }

    fn finish(self, frame: Frame) -> Result<Frame, FrameError> {
        if !self.rest.is_empty() {
            return Err(FrameError::TrailingBytes {
                kind: self.kind,
                extra: self.rest.len(),
            });
        }
        Ok(frame)
    }
}

fn decode_body(tag: u8, payload: &[u8]) -> Result<Frame, FrameError> {
    let kind = kind_of(tag).ok_or(FrameError::UnknownType(tag))?;
    let mut p = Payload {
        kind,
        rest: payload,
        len: payload.len(),
    };
    let frame = match tag {
        tag::SETUP => Frame::Setup(Setup {
            agent_id: p.u32()?,
            launch_token: p.u128()?,
            segment_name: p.string()?,
            config_json: p.string()?,
        }),
        tag::HELLO => Frame::Hello(Hello {
            agent_id: p.u32()?,
            pid: p.u32()?,
            protocol_version: p.u32()?,
            launch_token: p.u128()?,
            layout_hash: p.u64()?,
            segment_name: p.string()?,
            model_facts_json: p.string()?,
        }),
        tag::WELCOME => Frame::Welcome,
        tag::REFUSE => Frame::Refuse {
            reason: p.string()?,
        },
        tag::START_FAILED => Frame::StartFailed {
            reason: p.string()?,
        },
        tag::STEP => Frame::Step { step_id: p.u64()? },
        tag::MASKS => Frame::Masks { step_id: p.u64()? },
        tag::STEP_DONE => {
            let step_id = p.u64()?;
            let status = match p.u8()? {
                0 => StepStatus::Ok,
                1 => StepStatus::Failed,
                other => {
                    return Err(FrameError::BadField {
                        kind,
                        detail: format!("status {other} (allowed 0 = ok, 1 = failed)"),
                    })
                }
            };
            let timing = StepTiming {
                forward_us: p.u64()?,
                sample_us: p.u64()?,
                total_us: p.u64()?,
            };
            let n_failed = p.u32()?;
            let mut failed = Vec::new();
            for _ in 0..n_failed {
                // The encoder's room for this reason (the frame's prefix and tag before the
                // payload): a longer one is not what an encoder writes.
                let room = (MAX_FRAME_LEN / 2).saturating_sub(LEN_PREFIX + 1 + p.used());
                let slot = p.u32()?;
                let error = p.string()?;
                if error.len() > MAX_SEQ_FAILURE.min(room) {
                    return Err(FrameError::BadField {
                        kind,
                        detail: format!(
                            "slot {slot}: a failure reason of {} bytes (at most {})",
                            error.len(),
                            MAX_SEQ_FAILURE.min(room)
                        ),
                    });
                }
                failed.push(SeqFailure { slot, error });
            }
            Frame::StepDone(StepDone {
                step_id,
                status,
                timing,
                error: p.string()?,
                failed,
            })
        }
        tag::RESET => Frame::Reset,
        tag::RESET_DONE => Frame::ResetDone,
        tag::SHUTDOWN => Frame::Shutdown,
        tag::PING => Frame::Ping { nonce: p.u64()? },
        tag::PONG => Frame::Pong { nonce: p.u64()? },
        tag::SLEEP => Frame::Sleep { level: p.u8()? },
        tag::WAKE => Frame::Wake,
        tag::SLEEP_DONE | tag::WAKE_DONE => {
            let done = SleepDone {
                level: p.u8()?,
                bytes: p.u64()?,
                took_us: p.u64()?,
                error: p.string()?,
            };
            match tag {
                tag::SLEEP_DONE => Frame::SleepDone(done),
                _ => Frame::WakeDone(done),
            }
        }
        _ => return Err(FrameError::UnknownType(tag)),
    };
    p.finish(frame)
}

/// Writes one frame and flushes.
pub fn write_frame(w: &mut impl Write, frame: &Frame) -> Result<(), FrameError> {
    w.write_all(&frame.encode())?;
    w.flush()?;
    Ok(())
}

/// Reads exactly one frame from a blocking reader. A clean end of stream before the frame
/// starts is `Closed`; one inside it is `ClosedMidFrame`.
pub fn read_frame(r: &mut impl Read) -> Result<Frame, FrameError> {
    let mut prefix = [0u8; LEN_PREFIX];
    let mut got = 0;
    while got < LEN_PREFIX {
        match r.read(&mut prefix[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => return Err(FrameError::ClosedMidFrame),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_le_bytes(prefix) as usize;
    if len == 0 || len > MAX_FRAME_LEN {
        return Err(FrameError::BadLength(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => FrameError::ClosedMidFrame,
        _ => FrameError::Io(e),
    })?;
    decode_body(body[0], &body[1..])
}

/// Accumulates bytes from a non-blocking socket and yields whole frames.
#[derive(Debug, Default)]
pub struct FrameReader {
    buf: Vec<u8>,
}

/// What one `FrameReader::fill` call saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// This many bytes were read (more may be waiting).
    Read(usize),
    /// Nothing is available right now.
    WouldBlock,
    /// The peer closed the connection.
    Closed,
}

impl FrameReader {
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads what is available (one read call) into the buffer.
    pub fn fill(&mut self, r: &mut impl Read) -> Result<Fill, FrameError> {
        let mut chunk = [0u8; 4096];
        loop {
            return match r.read(&mut chunk) {
                Ok(0) => Ok(Fill::Closed),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    Ok(Fill::Read(n))
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(Fill::WouldBlock),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e.into()),
            };
        }
    }

    /// Appends bytes received some other way.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame in the buffer, if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        match Frame::decode(&self.buf)? {
            Some((frame, used)) => {
                self.buf.drain(..used);
                Ok(Some(frame))
            }
            None => Ok(None),
        }
    }

    /// Bytes received but not yet part of a whole frame.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

//! The server's end of one agent's control socket (a Unix socket pair, private to the server and
//! that agent): non-blocking, frames in and out with deadlines, readiness waits through poll(2)
//! so the caller can also watch the child process.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use npu_protocol::frame::{Fill, Frame, FrameError, FrameReader};

/// How a control-socket operation failed.
#[derive(Debug)]
pub(crate) enum ChannelError {
    /// The agent closed the connection.
    Closed,
    /// The deadline passed first.
    Timeout,
    /// The agent sent bytes that are not a valid frame.
    Frame(FrameError),
    Io(std::io::Error),
}

impl From<FrameError> for ChannelError {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::Io(io) => ChannelError::Io(io),
            other => ChannelError::Frame(other),
        }
    }
}

pub(crate) struct ControlChannel {
    stream: UnixStream,
    reader: FrameReader,
    closed: bool,
}

impl ControlChannel {
    pub(crate) fn new(stream: UnixStream) -> std::io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(Self {
            stream,
            reader: FrameReader::new(),
            closed: false,
        })
    }

    pub(crate) fn raw_fd(&self) -> i32 {
        self.stream.as_raw_fd()
    }

    /// Sends one frame, waiting for room in the socket buffer until `deadline`.
    pub(crate) fn send(&mut self, frame: &Frame, deadline: Instant) -> Result<(), ChannelError> {
        let bytes = frame.encode();
        let mut sent = 0;
        while sent < bytes.len() {
            match self.stream.write(&bytes[sent..]) {
                Ok(0) => return Err(ChannelError::Closed),
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ChannelError::Timeout);
                    }
                    wait_fd(self.raw_fd(), libc::POLLOUT, left).map_err(ChannelError::Io)?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                    ) =>
                {
                    return Err(ChannelError::Closed)
                }
                Err(e) => return Err(ChannelError::Io(e)),
            }
        }
        Ok(())
    }

    /// The next frame if one has arrived (reads whatever is available, never blocks).
    pub(crate) fn try_recv(&mut self) -> Result<Option<Frame>, ChannelError> {
        if let Some(frame) = self.reader.next_frame()? {
            return Ok(Some(frame));
        }
        while !self.closed {
            match self.reader.fill(&mut self.stream) {
                Ok(Fill::Read(_)) => {
                    if let Some(frame) = self.reader.next_frame()? {
                        return Ok(Some(frame));
                    }
                }
                Ok(Fill::WouldBlock) => return Ok(None),
                Ok(Fill::Closed) => self.closed = true,
                Err(FrameError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                    self.closed = true
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ChannelError::Closed)
    }

    /// Waits for the next frame until `deadline`, waking at least every `slice` to call
    /// `check` (which may end the wait with an error, e.g. when the child process has exited).
    pub(crate) fn recv_until<E>(
        &mut self,
        deadline: Instant,
        slice: Duration,
        mut check: impl FnMut() -> Result<(), E>,
    ) -> Result<Result<Frame, ChannelError>, E> {
        loop {
            match self.try_recv() {
                Ok(Some(frame)) => return Ok(Ok(frame)),
                Ok(None) => {}
                Err(e) => return Ok(Err(e)),
            }
            check()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Err(ChannelError::Timeout));
            }
            if let Err(e) = wait_fd(self.raw_fd(), libc::POLLIN, left.min(slice)) {
                return Ok(Err(ChannelError::Io(e)));
            }
        }
    }
}

/// Waits until `fd` is ready for `events` (or has hung up / errored) or `timeout` passes.
pub(crate) fn wait_fd(fd: i32, events: libc::c_short, timeout: Duration) -> std::io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd, count 1.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(n > 0)
}

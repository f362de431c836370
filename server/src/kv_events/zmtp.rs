//! The publishing side of ZMTP 3 (ZeroMQ's wire protocol: greeting, the NULL security
//! handshake, frames), enough for a ZeroMQ SUB socket (pyzmq, libzmq, a Go or Rust zmq
//! library) to subscribe to the KV events: it reads the peer's subscriptions (ZMTP 3.1
//! `SUBSCRIBE`/`CANCEL` commands, or 3.0's subscription messages), answers heartbeats, and
//! writes multipart messages. A peer is untrusted: frames past a small size, a peer that is not
//! a subscriber, or a greeting that is not ZMTP 3 with NULL security end the connection.

use std::io::{self, Read, Write};

/// Bytes of a ZMTP 3 greeting.
pub const GREETING_LEN: usize = 64;
/// Largest frame a subscriber may send (a subscription is a topic prefix).
pub const MAX_PEER_FRAME: usize = 4096;

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// Our greeting: ZMTP 3.1, NULL mechanism, not the security server.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks a peer's greeting: ZMTP 3 or later with the NULL mechanism.
pub fn check_greeting(g: &[u8; GREETING_LEN]) -> io::Result<()> {
    if g[0] != 0xff || g[9] & 1 != 1 {
        return Err(invalid(
            "the peer does not speak ZMTP (no ZeroMQ signature)",
        ));
    }
    if g[10] < 3 {
        return Err(invalid(format!(
            "the peer speaks ZMTP {}.{}; 3.0 or later is needed",
            g[10], g[11]
        )));
    }
    let mech = &g[12..32];
    let end = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
    if &mech[..end] != b"NULL" {
        return Err(invalid(format!(
            "the peer asks for the {:?} security mechanism; only NULL is served",
            String::from_utf8_lossy(&mech[..end])
        )));
    }
    Ok(())
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Appends one frame.
pub fn put_frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if body.len() <= 255 {
        out.extend([flags, body.len() as u8]);
    } else {
        out.push(flags | LONG);
        out.extend((body.len() as u64).to_be_bytes());
    }
    out.extend_from_slice(body);
}

/// A command frame: its name, then its data.
pub fn put_command(out: &mut Vec<u8>, name: &str, data: &[u8]) {
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(name.len() as u8);
    body.extend(name.as_bytes());
    body.extend(data);
    put_frame(out, COMMAND, &body);
}

/// Our READY command: a PUB socket.
pub fn ready_pub() -> Vec<u8> {
    let mut props = Vec::new();
    props.push(b"Socket-Type".len() as u8);
    props.extend(b"Socket-Type");
    props.extend((b"PUB".len() as u32).to_be_bytes());
    props.extend(b"PUB");
    let mut out = Vec::new();
    put_command(&mut out, "READY", &props);
    out
}

/// One multipart message, each part a frame (MORE on all but the last).
pub fn message(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        let flags = if i + 1 < parts.len() { MORE } else { 0 };
        put_frame(&mut out, flags, p);
    }
    out
}

/// A frame read from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub command: bool,
    pub more: bool,
    pub body: Vec<u8>,
}

/// Reads one frame of at most [`MAX_PEER_FRAME`] bytes.
pub fn read_frame(r: &mut impl Read) -> io::Result<Frame> {
    let mut head = [0u8; 2];
    r.read_exact(&mut head)?;
    let flags = head[0];
    if flags & !(MORE | LONG | COMMAND) != 0 {
        return Err(invalid(format!("a frame with unknown flags {flags:#04x}")));
    }
    let len = if flags & LONG != 0 {
        let mut rest = [0u8; 7];
        r.read_exact(&mut rest)?;
        let mut size = [0u8; 8];
        size[0] = head[1];
        size[1..].copy_from_slice(&rest);
        u64::from_be_bytes(size)
    } else {
        u64::from(head[1])
    };
    if len > MAX_PEER_FRAME as u64 {
        return Err(invalid(format!(
            "a frame of {len} bytes from a subscriber (at most {MAX_PEER_FRAME})"
        )));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    Ok(Frame {
        command: flags & COMMAND != 0,
        more: flags & MORE != 0,
        body,
    })
}

/// A command's name and data.
pub fn split_command(body: &[u8]) -> io::Result<(&[u8], &[u8])> {
    let (&n, rest) = body
        .split_first()
        .ok_or_else(|| invalid("an empty command"))?;
    if rest.len() < n as usize {
        return Err(invalid("a command name longer than its frame"));
    }
    Ok(rest.split_at(n as usize))
}

/// The `Socket-Type` property of a READY command's data.
pub fn socket_type(mut props: &[u8]) -> io::Result<Option<Vec<u8>>> {
    while !props.is_empty() {
        let n = props[0] as usize;
        let name = props
            .get(1..1 + n)
            .ok_or_else(|| invalid("a READY property name past the frame"))?;
        let size = props
            .get(1 + n..5 + n)
            .ok_or_else(|| invalid("a READY property without its size"))?;
        let size = u32::from_be_bytes([size[0], size[1], size[2], size[3]]) as usize;
        let value = props
            .get(5 + n..5 + n + size)
            .ok_or_else(|| invalid("a READY property value past the frame"))?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return Ok(Some(value.to_vec()));
        }
        props = &props[5 + n + size..];
    }
    Ok(None)
}

/// What a subscriber asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerRequest {
    Subscribe(Vec<u8>),
    Cancel(Vec<u8>),
    /// A heartbeat: answer with this PONG frame.
    Ping(Vec<u8>),
    /// Anything else a subscriber may send (ignored).
    Other,
}

/// Interprets a frame from a subscriber after the handshake.
pub fn peer_request(frame: &Frame) -> io::Result<PeerRequest> {
    if frame.command {
        let (name, data) = split_command(&frame.body)?;
        return Ok(match name {
            b"SUBSCRIBE" => PeerRequest::Subscribe(data.to_vec()),
            b"CANCEL" => PeerRequest::Cancel(data.to_vec()),
            b"PING" => {
                // TTL (2 bytes), then a context of up to 16 bytes echoed in the PONG.
                let context = data.get(2..).unwrap_or(&[]);
                let context = &context[..context.len().min(16)];
                let mut pong = Vec::new();
                put_command(&mut pong, "PONG", context);
                PeerRequest::Ping(pong)
            }
            b"ERROR" => {
                return Err(invalid(format!(
                    "the subscriber reported an error: {}",
                    String::from_utf8_lossy(data.get(1..).unwrap_or(&[]))
                )))
            }
            _ => PeerRequest::Other,
        });
    }
    // ZMTP 3.0: a subscription is a message whose first byte is 1 (subscribe) or 0 (cancel).
    Ok(match frame.body.split_first() {
        Some((1, topic)) => PeerRequest::Subscribe(topic.to_vec()),
        Some((0, topic)) => PeerRequest::Cancel(topic.to_vec()),
        _ => PeerRequest::Other,
    })
}

/// Both greetings and READY commands over a fresh connection; Ok once the peer is a
/// subscriber.
pub fn handshake(stream: &mut (impl Read + Write)) -> io::Result<()> {
    let mut hello = greeting().to_vec();
    hello.extend(ready_pub());
    stream.write_all(&hello)?;
    let mut g = [0u8; GREETING_LEN];
    stream.read_exact(&mut g)?;
    check_greeting(&g)?;
    let frame = read_frame(stream)?;
    if !frame.command {
        return Err(invalid("the peer sent a message before its READY command"));
    }
    let (name, data) = split_command(&frame.body)?;
    if name == b"ERROR" {
        return Err(invalid(format!(
            "the peer refused the handshake: {}",
            String::from_utf8_lossy(data.get(1..).unwrap_or(&[]))
        )));
    }
    if name != b"READY" {
        return Err(invalid(format!(
            "the peer sent {:?} where READY belongs",
            String::from_utf8_lossy(name)
        )));
    }
    match socket_type(data)? {
        Some(t) if t == b"SUB" || t == b"XSUB" => Ok(()),
        Some(t) => Err(invalid(format!(
            "the peer is a {} socket; KV events go to SUB or XSUB sockets",
            String::from_utf8_lossy(&t)
        ))),
        None => Err(invalid("the peer's READY has no Socket-Type")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A subscriber's side of the handshake, as libzmq writes it.
    fn sub_hello(socket_type: &[u8]) -> Vec<u8> {
        let mut v = greeting().to_vec();
        let mut props = vec![11u8];
        props.extend(b"Socket-Type");
        props.extend((socket_type.len() as u32).to_be_bytes());
        props.extend(socket_type);
        put_command(&mut v, "READY", &props);
        v
    }

    struct Duplex {
        input: io::Cursor<Vec<u8>>,
        output: Vec<u8>,
    }
    impl Read for Duplex {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }
    impl Write for Duplex {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.output.write(buf)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn shake(input: Vec<u8>) -> (io::Result<()>, Vec<u8>) {
        let mut d = Duplex {
            input: io::Cursor::new(input),
            output: Vec::new(),
        };
        (handshake(&mut d), d.output)
    }

    #[test]
    fn a_subscriber_completes_the_handshake_and_others_are_refused() {
        let (r, out) = shake(sub_hello(b"SUB"));
        r.unwrap();
        assert_eq!(&out[..GREETING_LEN], &greeting());
        let mut rest = &out[GREETING_LEN..];
        let ready = read_frame(&mut rest).unwrap();
        assert!(ready.command);
        let (name, data) = split_command(&ready.body).unwrap();
        assert_eq!(name, b"READY");
        assert_eq!(socket_type(data).unwrap().unwrap(), b"PUB");
        shake(sub_hello(b"XSUB")).0.unwrap();

        let e = shake(sub_hello(b"REQ")).0.unwrap_err().to_string();
        assert!(e.contains("REQ socket"), "{e}");
        let mut curve = sub_hello(b"SUB");
        curve[12..17].copy_from_slice(b"CURVE");
        let e = shake(curve).0.unwrap_err().to_string();
        assert!(e.contains("CURVE"), "{e}");
        let e = shake(b"GET / HTTP/1.1\r\n".repeat(8)).0.unwrap_err();
        assert!(e.to_string().contains("ZMTP"), "{e}");
        let mut old = sub_hello(b"SUB");
        old[10] = 2;
        assert!(shake(old).0.is_err());
    }

    #[test]
    fn frames_past_the_limit_and_truncated_frames_are_errors() {
        let mut big = Vec::new();
        put_frame(&mut big, 0, &vec![1u8; MAX_PEER_FRAME + 1]);
        let e = read_frame(&mut &big[..]).unwrap_err().to_string();
        assert!(e.contains("at most"), "{e}");
        // A long size that would ask for exabytes.
        let huge = [LONG, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
        assert!(read_frame(&mut &huge[..]).is_err());
        assert!(read_frame(&mut &[0u8, 10, 1, 2][..]).is_err());
        assert!(read_frame(&mut &[0x80u8, 0][..]).is_err());
        // Property sizes past the frame.
        assert!(socket_type(&[11, b'S']).is_err());
        let mut p = vec![1u8, b'x'];
        p.extend(1000u32.to_be_bytes());
        assert!(socket_type(&p).is_err());
    }

    #[test]
    fn subscriptions_of_both_protocol_versions_and_heartbeats_are_understood() {
        let frame = |command: bool, body: Vec<u8>| Frame {
            command,
            more: false,
            body,
        };
        let mut cmd = Vec::new();
        put_command(&mut cmd, "SUBSCRIBE", b"kv@");
        let f = read_frame(&mut &cmd[..]).unwrap();
        assert_eq!(
            peer_request(&f).unwrap(),
            PeerRequest::Subscribe(b"kv@".to_vec())
        );
        assert_eq!(
            peer_request(&frame(false, b"\x01kv".to_vec())).unwrap(),
            PeerRequest::Subscribe(b"kv".to_vec())
        );
        assert_eq!(
            peer_request(&frame(false, b"\x00kv".to_vec())).unwrap(),
            PeerRequest::Cancel(b"kv".to_vec())
        );
        let mut ping = vec![4u8];
        ping.extend(b"PING");
        ping.extend([0, 10]);
        ping.extend(b"ctx");
        let PeerRequest::Ping(pong) = peer_request(&frame(true, ping)).unwrap() else {
            panic!("a PING is not answered");
        };
        let pong = read_frame(&mut &pong[..]).unwrap();
        assert_eq!(
            split_command(&pong.body).unwrap(),
            (&b"PONG"[..], &b"ctx"[..])
        );
        assert!(peer_request(&frame(true, vec![9, b'x'])).is_err());
    }

    #[test]
    fn a_message_is_one_frame_per_part_with_more_on_all_but_the_last() {
        let long = vec![7u8; 300];
        let m = message(&[b"topic", &1u64.to_be_bytes(), &long]);
        let mut r = &m[..];
        let a = read_frame(&mut r).unwrap();
        assert!(a.more && !a.command && a.body == b"topic");
        let b = read_frame(&mut r).unwrap();
        assert!(b.more && b.body == 1u64.to_be_bytes());
        // The third part is long (8-byte size): past a subscriber's frame limit only when
        // larger than MAX_PEER_FRAME, which 300 bytes is not.
        let c = read_frame(&mut r).unwrap();
        assert!(!c.more && c.body == long);
        assert!(r.is_empty());
    }
}

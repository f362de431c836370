//! A KV-event subscriber's bytes as the publisher reads them (`npu_server::kv_events::zmtp`):
//! the greeting and READY of the handshake, then frames (subscriptions in both protocol
//! versions, heartbeats, anything else), in pieces as TCP delivers them. Whatever the peer sends,
//! the handshake ends in Ok or an error, no frame is read past its size limit, and the PONG
//! answered to a heartbeat is a frame that reads back.

use std::io::{self, Read, Write};

use npu_server::kv_events::zmtp::{self, PeerRequest};

/// The peer's bytes, delivered in pieces of at most `piece` bytes; what the publisher writes
/// is kept.
struct Peer<'a> {
    input: &'a [u8],
    piece: usize,
    written: Vec<u8>,
}

impl Read for Peer<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.piece).min(self.input.len());
        buf[..n].copy_from_slice(&self.input[..n]);
        self.input = &self.input[n..];
        Ok(n)
    }
}

impl Write for Peer<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.written.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

pub fn run(data: &[u8]) {
    let Some((&piece, rest)) = data.split_first() else {
        return;
    };
    let mut peer = Peer {
        input: rest,
        piece: usize::from(piece % 64) + 1,
        written: Vec::new(),
    };
    if zmtp::handshake(&mut peer).is_err() {
        return;
    }
    // Our greeting and READY went out first, whatever came back.
    assert_eq!(&peer.written[..zmtp::GREETING_LEN], &zmtp::greeting());
    let mut frames = 0usize;
    while let Ok(frame) = zmtp::read_frame(&mut peer) {
        assert!(frame.body.len() <= zmtp::MAX_PEER_FRAME);
        frames += 1;
        assert!(frames <= rest.len(), "more frames than bytes");
        match zmtp::peer_request(&frame) {
            Ok(PeerRequest::Ping(pong)) => {
                let back = zmtp::read_frame(&mut &pong[..]).expect("a PONG reads back");
                assert!(back.command);
                let (name, context) = zmtp::split_command(&back.body).expect("a PONG command");
                assert_eq!(name, b"PONG");
                assert!(context.len() <= 16);
            }
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

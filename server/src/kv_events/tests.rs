//! The publisher over real TCP connections, with a subscriber written from the ZMTP
//! specification in the test (pyzmq, a real libzmq, is the subscriber of the two-replica
//! routing test in `tests/kv_routing.rs`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use npu_scheduler::{KvEvent, KvMedium};

use super::zmtp::{self, Frame};
use super::*;

/// A subscriber's end of a connection.
struct Sub {
    stream: TcpStream,
}

impl Sub {
    fn over(mut stream: TcpStream, socket_type: &[u8]) -> std::io::Result<Self> {
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut hello = zmtp::greeting().to_vec();
        let mut props = vec![11u8];
        props.extend(b"Socket-Type");
        props.extend((socket_type.len() as u32).to_be_bytes());
        props.extend(socket_type);
        zmtp::put_command(&mut hello, "READY", &props);
        stream.write_all(&hello)?;
        let mut g = [0u8; zmtp::GREETING_LEN];
        stream.read_exact(&mut g)?;
        zmtp::check_greeting(&g)?;
        let ready = zmtp::read_frame(&mut stream)?;
        assert!(ready.command);
        Ok(Self { stream })
    }

    fn subscribe(&mut self, topic: &[u8]) {
        let mut f = Vec::new();
        zmtp::put_command(&mut f, "SUBSCRIBE", topic);
        self.stream.write_all(&f).unwrap();
    }

    /// The next message's parts (each part under zmtp's frame limit is fine for these tests).
    fn message(&mut self) -> std::io::Result<Vec<Vec<u8>>> {
        let mut parts = Vec::new();
        loop {
            let Frame { more, body, .. } = read_any_frame(&mut self.stream)?;
            parts.push(body);
            if !more {
                return Ok(parts);
            }
        }
    }
}

/// A frame of any size (the publisher's batches can exceed what a subscriber may send).
fn read_any_frame(r: &mut impl Read) -> std::io::Result<Frame> {
    let mut head = [0u8; 2];
    r.read_exact(&mut head)?;
    let len = if head[0] & 0x02 != 0 {
        let mut size = [0u8; 8];
        size[0] = head[1];
        r.read_exact(&mut size[1..])?;
        u64::from_be_bytes(size) as usize
    } else {
        head[1] as usize
    };
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(Frame {
        command: head[0] & 0x04 != 0,
        more: head[0] & 0x01 != 0,
        body,
    })
}

fn stored(hash: u128) -> KvEvent {
    KvEvent::Stored {
        hash,
        parent: None,
        tokens: vec![1, 2, 3, 4].into(),
        lora: 0,
        medium: KvMedium::Device,
    }
}

/// Sends batches until `sub` gets one (its subscription is registered asynchronously); returns
/// that message.
fn first_message(publisher: &KvEventPublisher, sub: &mut Sub) -> Vec<Vec<u8>> {
    let tx = publisher.sender();
    sub.stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let started = Instant::now();
    loop {
        tx.send(KvEventBatch::now(0, vec![stored(1)]));
        match sub.message() {
            Ok(m) => {
                sub.stream
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .unwrap();
                return m;
            }
            Err(_) => assert!(
                started.elapsed() < Duration::from_secs(10),
                "no message reached the subscriber"
            ),
        }
    }
}

#[test]
fn endpoints_bind_on_a_wildcard_and_connect_otherwise() {
    use KvEventsEndpoint::*;
    let p = KvEventsEndpoint::parse;
    assert_eq!(p("tcp://*:5557"), Ok(Bind("0.0.0.0:5557".into())));
    assert_eq!(p("tcp://0.0.0.0:0"), Ok(Bind("0.0.0.0:0".into())));
    assert_eq!(p("tcp://[::]:5557"), Ok(Bind("[::]:5557".into())));
    assert_eq!(
        p("tcp://indexer.llm-d:5557"),
        Ok(Connect("indexer.llm-d:5557".into()))
    );
    assert_eq!(
        p("tcp://10.0.0.7:5557"),
        Ok(Connect("10.0.0.7:5557".into()))
    );
    for bad in [
        "ipc:///tmp/kv",
        "tcp://*",
        "tcp://:5557",
        "tcp://*:http",
        "tcp://*:70000",
        "tcp://host:0",
        "tcp://a/b:1",
    ] {
        assert!(p(bad).is_err(), "{bad} was accepted");
    }
    assert_eq!(
        expand_topic(DEFAULT_TOPIC, "10.0.0.7:8000", "smollm2"),
        "kv@10.0.0.7:8000@smollm2"
    );
}

#[test]
fn a_subscriber_gets_each_batch_with_its_topic_and_sequence_number() {
    let bind = KvEventsEndpoint::Bind("127.0.0.1:0".into());
    let publisher = KvEventPublisher::start(&bind, "kv@r1@m".into(), 4).unwrap();
    let addr = publisher.local_addr().unwrap();
    let mut sub = Sub::over(TcpStream::connect(addr).unwrap(), b"SUB").unwrap();
    sub.subscribe(b"kv@");
    // A subscriber to another topic gets nothing.
    let mut other = Sub::over(TcpStream::connect(addr).unwrap(), b"SUB").unwrap();
    other.subscribe(b"kv@r2");

    let first = first_message(&publisher, &mut sub);
    assert_eq!(first[0], b"kv@r1@m");
    let seq0 = u64::from_be_bytes(first[1].clone().try_into().unwrap());
    let events = vec![
        stored(5),
        KvEvent::Removed {
            hash: 5,
            medium: KvMedium::Device,
        },
    ];
    let batch = KvEventBatch::now(3, events.clone());
    publisher.sender().send(batch.clone());
    // Batches sent while the subscription was in flight may come first, in order.
    let want = msgpack::encode_batch(batch.ts, &events, 3, 4);
    let mut last = seq0;
    let m = loop {
        let m = sub.message().unwrap();
        assert_eq!(m.len(), 3);
        let seq = u64::from_be_bytes(m[1].clone().try_into().unwrap());
        assert_eq!(seq, last + 1, "sequence numbers rise one by one");
        last = seq;
        if m[2] == want {
            break m;
        }
    };
    assert_eq!(m[0], b"kv@r1@m");

    other
        .stream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    assert!(
        other.message().is_err(),
        "a message for another topic arrived"
    );
}

#[test]
fn the_publisher_connects_to_a_subscriber_that_binds_and_refuses_other_sockets() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = KvEventsEndpoint::Connect(listener.local_addr().unwrap().to_string());
    let publisher = KvEventPublisher::start(&endpoint, "kv@r@m".into(), 16).unwrap();
    assert_eq!(publisher.local_addr(), None);
    // A REQ socket is refused: the publisher drops it and connects again.
    let (s, _) = listener.accept().unwrap();
    let mut req = Sub::over(s, b"REQ").unwrap();
    let mut byte = [0u8; 1];
    assert!(
        matches!(req.stream.read(&mut byte), Ok(0) | Err(_)),
        "a REQ peer was kept"
    );
    let (s, _) = listener.accept().unwrap();
    let mut sub = Sub::over(s, b"SUB").unwrap();
    sub.subscribe(b"");
    let m = first_message(&publisher, &mut sub);
    assert_eq!(m[0], b"kv@r@m");
    drop(publisher);
    // Dropping the publisher closes the connection.
    sub.stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut rest = Vec::new();
    let _ = sub.stream.read_to_end(&mut rest);
}

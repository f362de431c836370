//! Prefix-aware routing over two replicas on this machine: both publish their KV-cache events
//! (`npu_serving.kv_events_endpoint`), and a small router (tests/kv_router.py: pyzmq SUB
//! sockets, msgspec structs declared as vLLM's example subscriber declares them) sends each
//! request to the replica holding the longest cached prefix of its prompt, else to the less
//! loaded one. With events, every request after the first of a long shared prefix lands on the
//! replica that holds it, and that replica's prefix-cache hit tokens rise by the shared blocks
//! each time; without events, routing falls back to load and the same requests spread.
//! Needs python3 with pyzmq and msgspec (scripts/test.sh installs them).

mod e2e_support;

use std::net::TcpListener;
use std::process::Command;

use e2e_support::*;
use serde_json::Value;

const BLOCK: usize = 16;
const SHARED_BLOCKS: usize = 10;

/// A free TCP port (bound, then released for the server to take).
fn free_port() -> u16 {
    TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `n` token ids from a simple generator seeded by `seed`, inside SmolLM2's vocabulary and
/// clear of its special tokens.
fn ids(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            100 + ((x >> 33) % 48_000) as u32
        })
        .collect()
}

/// `count` prompts sharing a prefix of `SHARED_BLOCKS` full blocks, each with its own tail.
fn family(seed: u64, count: usize) -> Vec<Vec<u32>> {
    let shared = ids(seed, SHARED_BLOCKS * BLOCK);
    (0..count)
        .map(|i| {
            let mut p = shared.clone();
            p.extend(ids(seed * 1000 + i as u64 + 1, 5));
            p
        })
        .collect()
}

/// Runs the router over `prompts`: (replica, leading blocks it was known to hold) per request.
fn route(
    servers: &[&Server],
    events: &[u16],
    prompts: &[Vec<u32>],
    use_events: bool,
) -> Vec<(usize, u64)> {
    let file = servers[0].dir.join("requests.json");
    std::fs::write(&file, serde_json::to_string(prompts).unwrap()).unwrap();
    let router = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/kv_router.py");
    let mut cmd = Command::new("python3");
    cmd.arg(router);
    if !use_events {
        cmd.arg("--no-events");
    }
    cmd.arg(&file);
    for (s, e) in servers.iter().zip(events) {
        cmd.arg(format!("127.0.0.1:{}=tcp://127.0.0.1:{e}", s.port));
    }
    let out = cmd
        .output()
        .expect("python3 runs (scripts/test.sh installs pyzmq and msgspec)");
    assert!(
        out.status.success(),
        "the router failed (pip install pyzmq msgspec if they are missing):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    report
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["replica"].as_u64().unwrap() as usize,
                r["matched_blocks"].as_u64().unwrap(),
            )
        })
        .collect()
}

const HITS: &str = "npu_serving_prefix_cache_hits_total";

#[test]
fn a_repeated_prefix_lands_on_the_replica_that_holds_it() {
    let _guard = serial();
    let events = [free_port(), free_port()];
    let start = |name: &str, port: u16| {
        Server::start(
            name,
            &ServerOpts {
                threads_per_agent: 1,
                npu_serving_extra: format!("  kv_events_endpoint: tcp://*:{port}\n"),
                ..ServerOpts::default()
            },
        )
    };
    let a = start("kv-routing-a", events[0]);
    let b = start("kv-routing-b", events[1]);
    let servers = [&a, &b];

    // Four prompts of one family, then two of another.
    let mut prompts = family(1, 4);
    prompts.extend(family(2, 2));
    let report = route(&servers, &events, &prompts, true);
    let p = report[0].0;
    assert_eq!(
        report[0].1, 0,
        "nothing was cached before the first request"
    );
    for (i, &(replica, matched)) in report[1..4].iter().enumerate() {
        assert_eq!(
            replica,
            p,
            "request {} of the family left its replica",
            i + 2
        );
        assert_eq!(matched, SHARED_BLOCKS as u64, "request {}", i + 2);
    }
    // The second family goes to the less loaded replica, and stays there.
    let q = report[4].0;
    assert_ne!(q, p, "a new prefix goes by load");
    assert_eq!(report[5], (q, SHARED_BLOCKS as u64));
    let shared_tokens = (SHARED_BLOCKS * BLOCK) as f64;
    assert!(
        servers[p].metric(HITS) >= 3.0 * shared_tokens,
        "replica {p}: {} prefix hit tokens for three repeats of {shared_tokens}",
        servers[p].metric(HITS)
    );
    assert!(servers[q].metric(HITS) >= shared_tokens);

    // Without events the router only knows load: a third family's requests spread.
    let before = [a.metric(HITS), b.metric(HITS)];
    let report = route(&servers, &events, &family(3, 4), false);
    let on: Vec<usize> = report.iter().map(|r| r.0).collect();
    assert_eq!(on, [0, 1, 0, 1], "routing by load alternates");
    // Each replica saw the family's prefix once before its second request: one hit each.
    for (i, s) in servers.iter().enumerate() {
        assert!(
            s.metric(HITS) - before[i] >= shared_tokens,
            "replica {i} hit nothing on its second request of the family"
        );
    }
}

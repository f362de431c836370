//! End to end: `kill -9` of an agent in the middle of a load loses no request. Its requests
//! complete on the restarted agent (or on the other agent) with the same greedy text as
//! without the crash, /health reports the outage while it lasts, and the restart is counted.

mod e2e_support;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use e2e_support::*;

/// Cumulative CPU time (user + system, in clock ticks) of a process.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    // After the command name: state is field 3, utime 14 and stime 15 (1-based, whole line).
    let n = |i: usize| {
        fields
            .get(i - 3)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    n(14) + n(15)
}

/// Runs `clients` concurrent greedy streams; once `kill_after` tokens' worth of time has
/// passed (the first requests have streamed text), kills one agent with SIGKILL while watching
/// /health. Returns the records and whether /health was seen not-ready after the kill.
fn load_with_a_kill(
    server: &Server,
    prompts: &[(String, usize)],
    clients: usize,
    victim: u32,
) -> (Vec<client_bench::metrics::RequestRecord>, bool) {
    let killed = AtomicBool::new(false);
    let saw_outage = AtomicBool::new(false);
    let done = AtomicU32::new(0);
    let records = std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            // Wait until the load has produced tokens, then kill the agent mid-load.
            let until = Instant::now() + Duration::from_secs(120);
            while server.metric("npu_serving_generation_tokens_total") < 3.0 * clients as f64 {
                assert!(Instant::now() < until, "the load produced no tokens");
                std::thread::sleep(Duration::from_millis(10));
            }
            // SAFETY: kill(2) on the server's agent process.
            assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
            killed.store(true, Ordering::SeqCst);
            let until = Instant::now() + Duration::from_secs(120);
            while done.load(Ordering::SeqCst) < clients as u32 && Instant::now() < until {
                if server.get("/health").0 == 503 {
                    saw_outage.store(true, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let handles: Vec<_> = (0..clients)
            .map(|i| {
                let (p, n) = &prompts[i % prompts.len()];
                let done = &done;
                s.spawn(move || {
                    let r = server.stream(Api::LlmServing, p, *n);
                    done.fetch_add(1, Ordering::SeqCst);
                    r
                })
            })
            .collect();
        let records: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        watcher.join().unwrap();
        records
    });
    assert!(killed.load(Ordering::SeqCst));
    (records, saw_outage.load(Ordering::SeqCst))
}

fn check_after_recovery(
    server: &Server,
    records: &[client_bench::metrics::RequestRecord],
    want: &[String],
    saw_outage: bool,
) {
    for (i, r) in records.iter().enumerate() {
        assert!(r.success, "client {i} lost its request: {:?}", r.error);
        assert_eq!(
            r.resp_text,
            want[i % want.len()],
            "client {i}: the recovered request's text differs from the uncrashed one"
        );
    }
    assert!(saw_outage, "/health never reported the outage");
    server.wait_health(200, Duration::from_secs(60));
    assert_eq!(server.metric("npu_serving_agent_restarts_total"), 1.0);
    assert_eq!(server.metric("npu_serving_kv_blocks_used"), 0.0);
    assert_eq!(server.metric("npu_serving_requests_running"), 0.0);
}

#[test]
fn killing_the_only_agent_mid_load_loses_no_request() {
    let _serial = serial();
    let server = Server::start("kill1", &ServerOpts::default());
    let prompts: Vec<(String, usize)> = prompts()[..8].iter().map(|p| (p.clone(), 48)).collect();
    let want: Vec<String> = prompts
        .iter()
        .map(|(p, n)| server.stream(Api::LlmServing, p, *n).resp_text)
        .collect();
    let agents = server.agent_pids();
    assert_eq!(agents.len(), 1, "one agent process");
    let (records, saw_outage) = load_with_a_kill(&server, &prompts, 16, agents[0]);
    check_after_recovery(&server, &records, &want, saw_outage);
    let now = server.agent_pids();
    assert_eq!(now.len(), 1);
    assert_ne!(now[0], agents[0], "a new agent process serves");
    assert_eq!(
        server.segments().len(),
        1,
        "the dead agent's segment is gone"
    );
}

#[test]
fn with_two_agents_work_is_spread_and_a_killed_agents_requests_complete() {
    let _serial = serial();
    let opts = ServerOpts {
        agents: 2,
        threads_per_agent: 1,
        num_blocks: 512,
        ..ServerOpts::default()
    };
    let server = Server::start("kill2", &opts);
    let agents = server.agent_pids();
    assert_eq!(agents.len(), 2, "two agent processes");
    assert_eq!(server.segments().len(), 2);
    let prompts: Vec<(String, usize)> = prompts()[..8].iter().map(|p| (p.clone(), 40)).collect();
    let want: Vec<String> = prompts
        .iter()
        .map(|(p, n)| server.stream(Api::LlmServing, p, *n).resp_text)
        .collect();
    // Least-loaded dispatch: a concurrent load keeps both agents computing.
    let cpu_before: Vec<u64> = agents.iter().map(|&p| cpu_ticks(p)).collect();
    let records = server.stream_concurrently(Api::LlmServing, &prompts, 16);
    for (i, r) in records.iter().enumerate() {
        assert!(r.success, "{:?}", r.error);
        assert_eq!(r.resp_text, want[i % want.len()]);
    }
    let used: Vec<u64> = agents
        .iter()
        .zip(&cpu_before)
        .map(|(&p, &b)| cpu_ticks(p) - b)
        .collect();
    assert!(
        used.iter().all(|&t| t > 10),
        "both agents should have computed: {used:?} ticks"
    );

    let (records, saw_outage) = load_with_a_kill(&server, &prompts, 16, agents[1]);
    check_after_recovery(&server, &records, &want, saw_outage);
    let now = server.agent_pids();
    assert_eq!(now.len(), 2);
    assert!(now.contains(&agents[0]), "the other agent was not touched");
    assert!(!now.contains(&agents[1]), "the killed agent was replaced");
    assert_eq!(server.segments().len(), 2);
}

//! Drives one load run: sends the planned requests at their arrival times (one thread per
//! in-flight request, optionally capped by --max-concurrency), times every streamed chunk, and
//! collects a `RequestRecord` per request, failures included, with live progress.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::api::{clip, ApiSettings, StreamItem, StreamParser};
use crate::arrival::{schedule, ArrivalSpec};
use crate::dataset::Sample;
use crate::http_client::{self, HttpRequest, HttpTarget, LineSplitter, Timeouts};
use crate::metrics::RequestRecord;
use crate::report::RunLog;
use crate::tokens::TokenCounter;

/// Stack size of a request thread (they only parse lines).
const REQUEST_THREAD_STACK: usize = 256 * 1024;

/// Everything one run at one rate needs.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub target: HttpTarget,
    pub api: ApiSettings,
    pub arrival: ArrivalSpec,
    /// Requests to send (X·T).
    pub num_requests: usize,
    /// At most this many requests in flight (None = unlimited).
    pub max_concurrency: Option<usize>,
    pub seed: u64,
    /// Requests sent one by one before the measured run, not recorded.
    pub warmup: usize,
    pub timeouts: Timeouts,
    pub show_progress: bool,
}

/// The records of a run, in completion order, and its duration.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub records: Vec<RequestRecord>,
    /// First send to last completion, seconds.
    pub duration_s: f64,
}

/// Sends one request and measures it. Never panics on bad responses: every problem becomes a
/// failed record with its reason.
pub fn execute_request(
    target: &HttpTarget,
    api: &ApiSettings,
    timeouts: Timeouts,
    sample: &Sample,
    index: usize,
    run_start: Instant,
    counter: &TokenCounter,
) -> RequestRecord {
    let body = api.request_body(&sample.prompt, sample.max_new_tokens);
    let headers_owned = api.headers();
    let headers: Vec<(&str, &str)> = headers_owned
        .iter()
        .map(|(n, v)| (*n, v.as_str()))
        .collect();
    let req = HttpRequest {
        method: "POST",
        path: &api.path,
        headers: &headers,
        body: &body,
    };
    let sent = Instant::now();
    let mut rec = RequestRecord {
        index,
        prompt: sample.prompt.clone(),
        prompt_tokens: sample.prompt_tokens,
        max_new_tokens: sample.max_new_tokens,
        send_offset_s: sent.duration_since(run_start).as_secs_f64(),
        success: false,
        error: None,
        resp_text: String::new(),
        output_tokens: 0,
        ttft_s: None,
        e2e_s: 0.0,
        chunk_times_s: Vec::new(),
        server_completion_tokens: None,
    };
    let outcome = read_stream(target, &req, api, timeouts, sent, &mut rec);
    if let Err(reason) = outcome {
        rec.error = Some(reason);
        return rec;
    }
    match counter.output_tokens(&rec.resp_text) {
        Ok(n) => rec.output_tokens = n,
        Err(reason) => {
            rec.error = Some(reason);
            return rec;
        }
    }
    if rec.resp_text.is_empty() {
        rec.error = Some("the response carried no generated text".to_string());
        return rec;
    }
    rec.success = true;
    rec
}

/// Sends the request and fills text, chunk times, TTFT and E2E into `rec`.
fn read_stream(
    target: &HttpTarget,
    req: &HttpRequest<'_>,
    api: &ApiSettings,
    timeouts: Timeouts,
    sent: Instant,
    rec: &mut RequestRecord,
) -> Result<(), String> {
    let since = |at: Instant| at.duration_since(sent).as_secs_f64();
    let result = http_client::send(target, req, timeouts);
    let (head, mut body) = match result {
        Ok(x) => x,
        Err(e) => {
            rec.e2e_s = since(Instant::now());
            return Err(e.to_string());
        }
    };
    rec.e2e_s = since(Instant::now());
    if head.status != 200 {
        let mut text = Vec::new();
        while text.len() < 4096 {
            match body.next_piece() {
                Ok(Some((piece, at))) => {
                    text.extend_from_slice(&piece);
                    rec.e2e_s = since(at);
                }
                _ => break,
            }
        }
        let text = String::from_utf8_lossy(&text);
        return Err(format!(
            "HTTP {} {}: {}",
            head.status,
            head.reason,
            clip(text.trim(), 200)
        ));
    }
    let mut splitter = LineSplitter::new();
    let mut parser = StreamParser::new(api.kind);
    let mut full_text: Option<String> = None;
    let mut last_at = None;
    loop {
        let piece = body.next_piece().map_err(|e| {
            if let Some(at) = last_at {
                rec.e2e_s = since(at);
            }
            format!("{e} (after {} chunks)", rec.chunk_times_s.len())
        })?;
        let (lines, at) = match piece {
            Some((bytes, at)) => {
                last_at = Some(at);
                (splitter.push(&bytes), at)
            }
            None => match splitter.finish() {
                Some(line) => (vec![line], last_at.unwrap_or_else(Instant::now)),
                None => break,
            },
        };
        for line in lines {
            match parser.parse_line(&line)? {
                StreamItem::Delta(text) => {
                    if !text.is_empty() {
                        let t = since(at);
                        rec.ttft_s.get_or_insert(t);
                        rec.chunk_times_s.push(t);
                        rec.resp_text.push_str(&text);
                    }
                }
                StreamItem::FullText(text) => full_text = Some(text),
                StreamItem::Usage {
                    completion_tokens, ..
                } => rec.server_completion_tokens = Some(completion_tokens),
                StreamItem::Done | StreamItem::Skip => {}
            }
        }
        if let Some(at) = last_at {
            rec.e2e_s = since(at);
        }
    }
    if let Some(full) = full_text {
        rec.resp_text = generated_part(full, &rec.prompt, &rec.resp_text);
    }
    Ok(())
}

/// The generated text of llm-serving's closing full-text line. With `return_full_text` a
/// TGI-style server puts the prompt first: then the line is the prompt followed by the streamed
/// deltas (and perhaps characters they held back), and the prompt is not output.
fn generated_part(full: String, prompt: &str, deltas: &str) -> String {
    match full.strip_prefix(prompt) {
        Some(rest) if !prompt.is_empty() && rest.starts_with(deltas) => rest.to_string(),
        _ => full,
    }
}

/// Counts in-flight requests against a cap.
struct Slots {
    cap: Option<usize>,
    used: Mutex<usize>,
    freed: Condvar,
}

impl Slots {
    fn acquire(&self) {
        let Some(cap) = self.cap else { return };
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        while *used >= cap {
            used = self.freed.wait(used).unwrap_or_else(|e| e.into_inner());
        }
        *used += 1;
    }

    fn release(&self) {
        if self.cap.is_none() {
            return;
        }
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        *used = used.saturating_sub(1);
        self.freed.notify_one();
    }
}

fn progress_bar(n: usize, show: bool) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(
        Some(n as u64),
        if show {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    let style =
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
    pb.set_style(style);
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

/// Runs warmup, then the measured load. `samples` are used in order and cycled.
pub fn run_load(
    cfg: &RunConfig,
    samples: &[Sample],
    counter: &TokenCounter,
    log: &mut RunLog,
) -> RunOutcome {
    assert!(!samples.is_empty(), "datasets are checked to be non-empty");
    for i in 0..cfg.warmup {
        let sample = &samples[i % samples.len()];
        let rec = execute_request(
            &cfg.target,
            &cfg.api,
            cfg.timeouts,
            sample,
            i,
            Instant::now(),
            counter,
        );
        if let Some(e) = rec.error {
            tracing::warn!("warmup request {i} failed: {e}");
            log.line(&format!("warmup request {i} failed: {e}"));
        }
    }
    let offsets = schedule(&cfg.arrival, cfg.num_requests, cfg.seed);
    let n = offsets.len();
    log.line(&format!(
        "Start send request, target rate {} req/s, {} requests",
        cfg.arrival.rate, n
    ));
    let (tx, rx) = mpsc::channel::<RequestRecord>();
    let slots = Arc::new(Slots {
        cap: cfg.max_concurrency,
        used: Mutex::new(0),
        freed: Condvar::new(),
    });
    let shared_samples: Arc<Vec<Sample>> = Arc::new(samples.to_vec());
    let start = Instant::now();
    let dispatcher = {
        let cfg = cfg.clone();
        let counter = counter.clone();
        let slots = Arc::clone(&slots);
        std::thread::spawn(move || {
            let counter = Arc::new(counter);
            let mut handles = Vec::with_capacity(n);
            for (i, offset) in offsets.into_iter().enumerate() {
                let due = start + Duration::from_secs_f64(offset);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                slots.acquire();
                let (cfg2, counter, slots2, samples, tx2) = (
                    cfg.clone(),
                    Arc::clone(&counter),
                    Arc::clone(&slots),
                    Arc::clone(&shared_samples),
                    tx.clone(),
                );
                let spawned = std::thread::Builder::new()
                    .name(format!("bench-req-{i}"))
                    .stack_size(REQUEST_THREAD_STACK)
                    .spawn(move || {
                        let sample = &samples[i % samples.len()];
                        let rec = execute_request(
                            &cfg2.target,
                            &cfg2.api,
                            cfg2.timeouts,
                            sample,
                            i,
                            start,
                            &counter,
                        );
                        slots2.release();
                        let _ = tx2.send(rec);
                    });
                match spawned {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        slots.release();
                        let sample = &shared_samples[i % shared_samples.len()];
                        let _ = tx.send(failed_to_start(i, sample, start, &e.to_string()));
                    }
                }
            }
            for h in handles {
                let _ = h.join();
            }
        })
    };

    let pb = progress_bar(n, cfg.show_progress);
    let mut records = Vec::with_capacity(n);
    let (mut failed, mut out_tokens) = (0usize, 0usize);
    let mut end = start;
    while records.len() < n {
        let Ok(rec) = rx.recv() else { break };
        end = Instant::now();
        if !rec.success {
            failed += 1;
        }
        out_tokens += rec.output_tokens;
        let secs = end.duration_since(start).as_secs_f64().max(1e-9);
        let done = records.len() + 1;
        pb.set_position(done as u64);
        pb.set_message(format!(
            "failed {failed} | {:.2} req/s | {:.1} tok/s",
            (done - failed) as f64 / secs,
            out_tokens as f64 / secs
        ));
        log.progress(done, n, &rec);
        records.push(rec);
    }
    pb.finish_and_clear();
    let _ = dispatcher.join();
    RunOutcome {
        records,
        duration_s: end.duration_since(start).as_secs_f64(),
    }
}

fn failed_to_start(i: usize, sample: &Sample, start: Instant, why: &str) -> RequestRecord {
    RequestRecord {
        index: i,
        prompt: sample.prompt.clone(),
        prompt_tokens: sample.prompt_tokens,
        max_new_tokens: sample.max_new_tokens,
        send_offset_s: start.elapsed().as_secs_f64(),
        success: false,
        error: Some(format!("could not start a request thread: {why}")),
        resp_text: String::new(),
        output_tokens: 0,
        ttft_s: None,
        e2e_s: 0.0,
        chunk_times_s: Vec::new(),
        server_completion_tokens: None,
    }
}

#[cfg(test)]
mod tests {
    use super::generated_part;

    #[test]
    fn the_prompt_before_the_full_text_is_not_output() {
        let g = |full: &str, prompt: &str, deltas: &str| {
            generated_part(full.to_string(), prompt, deltas)
        };
        // The prompt first (TGI's return_full_text): only what follows was generated.
        assert_eq!(g("Hi there! Hello", "Hi there!", " Hello"), " Hello");
        assert_eq!(g("Hi there! Hello", "Hi there!", " Hel"), " Hello");
        assert_eq!(g("Hi", "Hi", ""), "");
        // The generated text alone, even one that repeats the prompt.
        assert_eq!(g(" Hello", "Hi", " Hello"), " Hello");
        assert_eq!(g("Hi Hi", "Hi", "Hi Hi"), "Hi Hi");
        assert_eq!(g("Hi Hi", "", "Hi Hi"), "Hi Hi");
    }
}

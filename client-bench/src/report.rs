//! Output files and text of a run: performance_serving's `result_{X}_x.json` and log lines, the
//! summary as JSON and CSV, and the human-readable summary table.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::error::BenchError;
use crate::metrics::{RequestRecord, Stats, Summary};

/// X as performance_serving prints it in file names (Python's `str(float)`: `2.0`, `0.5`).
pub fn qps_label(x: f64) -> String {
    format!("{x:?}")
}

/// `result_{X}_x.json` in `out_dir`.
pub fn results_path(out_dir: &Path, qps: f64) -> PathBuf {
    out_dir.join(format!("result_{}_x.json", qps_label(qps)))
}

/// The object written for one request: performance_serving's keys (input, resp_text, res_time,
/// first_token_time; times in seconds) plus what makes failures and token counts visible.
pub fn result_object(r: &RequestRecord) -> Value {
    let mut v = json!({
        "input": r.prompt,
        "resp_text": r.resp_text,
        "res_time": r.e2e_s,
        "first_token_time": r.ttft_s,
        "success": r.success,
        "index": r.index,
        "send_time": r.send_offset_s,
        "prompt_tokens": r.prompt_tokens,
        "max_new_tokens": r.max_new_tokens,
        "output_tokens": r.output_tokens,
    });
    if let Some(e) = &r.error {
        v["error"] = json!(e);
    }
    v
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), BenchError> {
    std::fs::write(path, bytes).map_err(|e| BenchError::io("writing", path, e))
}

/// Writes `result_{X}_x.json`: a JSON array with one object per request, in completion order.
pub fn write_results(
    out_dir: &Path,
    qps: f64,
    records: &[RequestRecord],
) -> Result<PathBuf, BenchError> {
    let path = results_path(out_dir, qps);
    let arr: Vec<Value> = records.iter().map(result_object).collect();
    write_file(&path, &serde_json::to_vec(&arr)?)?;
    Ok(path)
}

const STAT_FIELDS: [&str; 5] = ["mean", "median", "std", "p90", "p99"];
const LATENCIES: [&str; 4] = ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"];

/// Column names of the summary CSV.
pub fn csv_header() -> Vec<String> {
    let mut h: Vec<String> = [
        "qps",
        "num_requests",
        "completed",
        "failed",
        "duration_s",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for lat in LATENCIES {
        for f in STAT_FIELDS {
            h.push(format!("{lat}_{f}"));
        }
    }
    h.extend(
        ["slo_ttft_ms", "slo_tpot_ms", "good_requests", "goodput"]
            .iter()
            .map(|s| s.to_string()),
    );
    h
}

fn num(x: f64) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        String::new()
    }
}

fn opt(x: Option<f64>) -> String {
    x.map(num).unwrap_or_default()
}

/// The CSV cells of a summary, matching `csv_header`.
pub fn csv_row(s: &Summary) -> Vec<String> {
    let mut row = vec![
        num(s.qps),
        s.num_requests.to_string(),
        s.completed.to_string(),
        s.failed.to_string(),
        num(s.duration_s),
        s.total_input_tokens.to_string(),
        s.total_output_tokens.to_string(),
        num(s.request_throughput),
        num(s.output_throughput),
        num(s.total_token_throughput),
    ];
    for st in [&s.ttft_ms, &s.tpot_ms, &s.itl_ms, &s.e2e_ms] {
        match st {
            Some(st) => row.extend([st.mean, st.median, st.std, st.p90, st.p99].map(num)),
            None => row.extend(std::iter::repeat_n(String::new(), STAT_FIELDS.len())),
        }
    }
    row.extend([
        opt(s.slo_ttft_ms),
        opt(s.slo_tpot_ms),
        s.good_requests.to_string(),
        num(s.goodput),
    ]);
    row
}

/// One CSV line; cells with commas, quotes or newlines are quoted.
pub fn csv_line(cells: &[String]) -> String {
    let quoted: Vec<String> = cells
        .iter()
        .map(|c| {
            if c.contains([',', '"', '\n', '\r']) {
                format!("\"{}\"", c.replace('"', "\"\""))
            } else {
                c.clone()
            }
        })
        .collect();
    quoted.join(",")
}

/// Writes `summary_{X}.json` and `summary_{X}.csv`; returns both paths.
pub fn write_summary(out_dir: &Path, s: &Summary) -> Result<(PathBuf, PathBuf), BenchError> {
    let label = qps_label(s.qps);
    let json_path = out_dir.join(format!("summary_{label}.json"));
    write_file(&json_path, &serde_json::to_vec_pretty(s)?)?;
    let csv_path = out_dir.join(format!("summary_{label}.csv"));
    let text = format!("{}\n{}\n", csv_line(&csv_header()), csv_line(&csv_row(s)));
    write_file(&csv_path, text.as_bytes())?;
    Ok((json_path, csv_path))
}

/// The summary as an aligned table for the terminal.
pub fn summary_table(s: &Summary) -> String {
    let mut out = String::new();
    let mut row = |k: &str, v: String| out.push_str(&format!("{k:<36}{v:>14}\n"));
    row("Target rate (req/s)", format!("{}", s.qps));
    row("Requests sent", s.num_requests.to_string());
    row("Completed", s.completed.to_string());
    row("Failed", s.failed.to_string());
    row("Duration (s)", format!("{:.2}", s.duration_s));
    row("Total input tokens", s.total_input_tokens.to_string());
    row("Total output tokens", s.total_output_tokens.to_string());
    row(
        "Request throughput (req/s)",
        format!("{:.3}", s.request_throughput),
    );
    row(
        "Output throughput (tok/s)",
        format!("{:.2}", s.output_throughput),
    );
    row(
        "Total token throughput (tok/s)",
        format!("{:.2}", s.total_token_throughput),
    );
    let slo = match (s.slo_ttft_ms, s.slo_tpot_ms) {
        (None, None) => "no SLO".to_string(),
        (a, b) => format!(
            "TTFT<={} TPOT<={}",
            a.map_or("-".into(), |x| format!("{x}ms")),
            b.map_or("-".into(), |x| format!("{x}ms"))
        ),
    };
    row(
        &format!("Goodput (req/s, {slo})"),
        format!("{:.3}", s.goodput),
    );
    let mut table = format!(
        "{:=^50}\n{out}{:<12}{:>9}{:>9}{:>9}{:>9}{:>9}\n",
        " Serving Benchmark Result ", "ms", "mean", "median", "std", "p90", "p99"
    );
    for (name, st) in [
        ("TTFT", &s.ttft_ms),
        ("TPOT", &s.tpot_ms),
        ("ITL", &s.itl_ms),
        ("E2E", &s.e2e_ms),
    ] {
        table.push_str(&stat_line(name, st.as_ref()));
    }
    if !s.failure_reasons.is_empty() {
        table.push_str("Failures:\n");
        for (reason, n) in &s.failure_reasons {
            table.push_str(&format!("  {n} x {reason}\n"));
        }
    }
    table.push_str(&"=".repeat(50));
    table.push('\n');
    table
}

fn stat_line(name: &str, st: Option<&Stats>) -> String {
    match st {
        Some(st) => format!(
            "{name:<12}{:>9.2}{:>9.2}{:>9.2}{:>9.2}{:>9.2}\n",
            st.mean, st.median, st.std, st.p90, st.p99
        ),
        None => format!("{name:<12}{:>9}\n", "n/a"),
    }
}

/// The run's log file (`test_performance_{X}.log`), with performance_serving's progress and
/// completion lines.
pub struct RunLog {
    file: Option<File>,
    path: PathBuf,
}

impl RunLog {
    /// Creates (truncates) the log file for rate `qps` in `out_dir`.
    pub fn create(out_dir: &Path, qps: f64) -> Result<Self, BenchError> {
        let path = out_dir.join(format!("test_performance_{}.log", qps_label(qps)));
        let file = File::create(&path).map_err(|e| BenchError::io("creating", &path, e))?;
        Ok(RunLog {
            file: Some(file),
            path,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one line (a write failure is reported once and then logging stops).
    pub fn line(&mut self, text: &str) {
        if let Some(f) = &mut self.file {
            if let Err(e) = writeln!(f, "{text}") {
                tracing::warn!("cannot write {}: {e}; logging stops", self.path.display());
                self.file = None;
            }
        }
    }

    /// `Test Progress --> k/N` after each finished request (with its failure reason, if any).
    pub fn progress(&mut self, done: usize, total: usize, r: &RequestRecord) {
        match &r.error {
            None => self.line(&format!(
                "request {} done: {} output tokens, first_token_time {:.4}s, res_time {:.4}s\n\
                 Test Progress --> {done}/{total}",
                r.index,
                r.output_tokens,
                r.ttft_s.unwrap_or(f64::NAN),
                r.e2e_s
            )),
            Some(e) => self.line(&format!(
                "request {} FAILED: {e}\nTest Progress --> {done}/{total}",
                r.index
            )),
        }
    }

    /// The closing line `All Tasks Done; Exec Time is <seconds>`, also printed to stdout.
    pub fn all_done(&mut self, exec_time_s: f64) {
        let line = format!("All Tasks Done; Exec Time is {exec_time_s}");
        println!("{line}");
        self.line(&line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{summarize, Slo};

    fn rec(i: usize, ok: bool) -> RequestRecord {
        RequestRecord {
            index: i,
            prompt: format!("p{i}"),
            prompt_tokens: 3,
            max_new_tokens: 4,
            send_offset_s: 0.5 * i as f64,
            success: ok,
            error: (!ok).then(|| "HTTP 500 Internal: boom, \"x\"".to_string()),
            resp_text: if ok { "a b".into() } else { String::new() },
            output_tokens: if ok { 2 } else { 0 },
            ttft_s: ok.then_some(0.1),
            e2e_s: 0.3,
            chunk_times_s: if ok { vec![0.1, 0.3] } else { vec![] },
            server_completion_tokens: None,
        }
    }

    #[test]
    fn labels_follow_python_float_str() {
        assert_eq!(qps_label(2.0), "2.0");
        assert_eq!(qps_label(0.5), "0.5");
        assert_eq!(qps_label(0.625), "0.625");
        assert_eq!(
            results_path(Path::new("/o"), 2.0),
            PathBuf::from("/o/result_2.0_x.json")
        );
    }

    #[test]
    fn results_file_has_performance_serving_keys() {
        let dir = std::env::temp_dir().join(format!("bench-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = write_results(&dir, 1.5, &[rec(0, true), rec(1, false)]).unwrap();
        assert!(path.ends_with("result_1.5_x.json"));
        let v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let arr = v.as_array().unwrap();
        assert_eq!(arr.len(), 2);
        assert_eq!(arr[0]["input"], "p0");
        assert_eq!(arr[0]["resp_text"], "a b");
        assert_eq!(arr[0]["res_time"], 0.3);
        assert_eq!(arr[0]["first_token_time"], 0.1);
        assert!(arr[0].get("error").is_none());
        assert_eq!(arr[1]["success"], false);
        assert!(arr[1]["first_token_time"].is_null());
        assert!(arr[1]["error"].as_str().unwrap().contains("boom"));

        let s = summarize(&[rec(0, true), rec(1, false)], 1.0, 1.5, Slo::default());
        let (j, c) = write_summary(&dir, &s).unwrap();
        let sj: Value = serde_json::from_slice(&std::fs::read(j).unwrap()).unwrap();
        assert_eq!(sj["completed"], 1);
        assert_eq!(sj["failed"], 1);
        assert_eq!(sj["ttft_ms"]["median"], 100.0);
        let csv = std::fs::read_to_string(c).unwrap();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 2);
        let header: Vec<&str> = lines[0].split(',').collect();
        let cells: Vec<&str> = lines[1].split(',').collect();
        assert_eq!(header.len(), cells.len());
        let col = |name: &str| cells[header.iter().position(|h| *h == name).unwrap()];
        assert_eq!(col("completed"), "1");
        assert_eq!(col("ttft_ms_mean"), "100");
        assert_eq!(col("slo_ttft_ms"), "");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn csv_quoting() {
        assert_eq!(
            csv_line(&["a".into(), "b,c".into(), "d\"e".into()]),
            "a,\"b,c\",\"d\"\"e\""
        );
    }

    #[test]
    fn table_mentions_every_latency_and_failures() {
        let s = summarize(&[rec(0, true), rec(1, false)], 1.0, 1.0, Slo::default());
        let t = summary_table(&s);
        for k in ["TTFT", "TPOT", "ITL", "E2E", "Goodput", "Failures", "boom"] {
            assert!(t.contains(k), "{k} missing in\n{t}");
        }
    }
}

//! Sweeps over server settings: parses the --sweep-config grid, writes one YAML per grid point
//! (overrides applied to the base config tree), and starts, health-checks and stops
//! `npu-serving serve` for each point.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_yaml::Value;

use crate::error::BenchError;
use crate::http_client::{fetch_text, HttpRequest, HttpTarget, Timeouts};

/// One axis of the grid: a dotted key path and the values it takes.
#[derive(Debug, Clone, PartialEq)]
pub struct GridAxis {
    pub key: String,
    pub values: Vec<Value>,
}

/// One grid point: the override of each axis.
pub type GridPoint = Vec<(String, Value)>;

/// Parses `"a.b=1,2;c.d=x,y"` into axes. Values are read as YAML scalars (numbers, booleans,
/// strings).
pub fn parse_grid(spec: &str) -> Result<Vec<GridAxis>, BenchError> {
    let err = |m: String| BenchError::arg("--sweep-config", m);
    let mut axes = Vec::new();
    for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, values) = part
            .split_once('=')
            .ok_or_else(|| err(format!("{part:?} is not KEY=V1,V2,...")))?;
        let key = key.trim();
        if key.is_empty() || key.split('.').any(|k| k.trim().is_empty()) {
            return Err(err(format!("{part:?}: bad key path {key:?}")));
        }
        let values: Vec<Value> = values
            .split(',')
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(|v| {
                serde_yaml::from_str::<Value>(v)
                    .map_err(|e| err(format!("{key}: value {v:?} is not a YAML scalar: {e}")))
            })
            .collect::<Result<_, _>>()?;
        if values.is_empty() {
            return Err(err(format!("{key}: no values")));
        }
        if axes.iter().any(|a: &GridAxis| a.key == key) {
            return Err(err(format!("{key} appears twice")));
        }
        axes.push(GridAxis {
            key: key.to_string(),
            values,
        });
    }
    if axes.is_empty() {
        return Err(err("empty grid".to_string()));
    }
    Ok(axes)
}

/// Every combination of the axes' values (the first axis varies slowest).
pub fn grid_points(axes: &[GridAxis]) -> Vec<GridPoint> {
    let mut points: Vec<GridPoint> = vec![Vec::new()];
    for axis in axes {
        points = points
            .into_iter()
            .flat_map(|p| {
                axis.values.iter().map(move |v| {
                    let mut q = p.clone();
                    q.push((axis.key.clone(), v.clone()));
                    q
                })
            })
            .collect();
    }
    points
}

/// `key=value;key=value` label of a point.
pub fn point_label(point: &GridPoint) -> String {
    point
        .iter()
        .map(|(k, v)| format!("{k}={}", scalar_text(v)))
        .collect::<Vec<_>>()
        .join(";")
}

fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => serde_yaml::to_string(other)
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
    }
}

/// Sets each dotted key of `point` in the YAML tree, creating mappings on the way.
pub fn apply_overrides(root: &mut Value, point: &GridPoint) -> Result<(), BenchError> {
    for (key, value) in point {
        let mut node = &mut *root;
        let parts: Vec<&str> = key.split('.').collect();
        for (i, part) in parts.iter().enumerate() {
            if node.is_null() {
                *node = Value::Mapping(Default::default());
            }
            let map = node.as_mapping_mut().ok_or_else(|| {
                BenchError::Sweep(format!(
                    "{key}: {} is not a mapping in the base config",
                    parts[..i].join(".")
                ))
            })?;
            let k = Value::String(part.to_string());
            if i + 1 == parts.len() {
                map.insert(k, value.clone());
                break;
            }
            node = map.entry(k).or_insert(Value::Null);
        }
    }
    Ok(())
}

/// Reads the base YAML, applies a point and writes the result to `dest`.
pub fn write_point_config(base: &Path, point: &GridPoint, dest: &Path) -> Result<(), BenchError> {
    let text = std::fs::read_to_string(base).map_err(|e| BenchError::io("reading", base, e))?;
    let mut tree: Value = serde_yaml::from_str(&text)
        .map_err(|e| BenchError::Sweep(format!("{}: not valid YAML: {e}", base.display())))?;
    apply_overrides(&mut tree, point)?;
    let out = serde_yaml::to_string(&tree)
        .map_err(|e| BenchError::Sweep(format!("encoding YAML: {e}")))?;
    std::fs::write(dest, out).map_err(|e| BenchError::io("writing", dest, e))
}

/// The address in a `listening on HOST:PORT` line (anywhere in the line, so log prefixes are
/// fine). IPv6 hosts may be bracketed.
pub fn parse_listening_line(line: &str) -> Option<(String, u16)> {
    let rest = &line[line.find("listening on ")? + "listening on ".len()..];
    let addr = rest.split_whitespace().next()?;
    let addr = addr.trim_start_matches("http://");
    let (host, port) = addr.rsplit_once(':')?;
    let port: u16 = port.trim_end_matches('/').parse().ok()?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let host = match host {
        "0.0.0.0" => "127.0.0.1",
        "::" => "::1",
        h => h,
    };
    Some((host.to_string(), port))
}

/// A server started for one grid point; stopped with SIGTERM by `stop` (or killed on drop).
pub struct ServerProcess {
    child: Option<Child>,
    pub target: HttpTarget,
    pub log_path: PathBuf,
}

impl ServerProcess {
    /// Runs `<bin> serve --config <config> --port 0`, with stdout and stderr copied to
    /// `log_path`, and waits for its `listening on HOST:PORT` line.
    pub fn start(
        bin: &Path,
        config: &Path,
        log_path: &Path,
        timeout: Duration,
    ) -> Result<Self, BenchError> {
        let log =
            std::fs::File::create(log_path).map_err(|e| BenchError::io("creating", log_path, e))?;
        let err_log = log
            .try_clone()
            .map_err(|e| BenchError::io("opening", log_path, e))?;
        let mut child = Command::new(bin)
            .arg("serve")
            .arg("--config")
            .arg(config)
            .arg("--port")
            .arg("0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(err_log))
            .spawn()
            .map_err(|e| BenchError::Sweep(format!("starting {}: {e}", bin.display())))?;
        let stdout = child.stdout.take().expect("stdout was piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut log = log;
            let mut sent = false;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = writeln!(log, "{line}");
                if !sent {
                    if let Some(addr) = parse_listening_line(&line) {
                        let _ = tx.send(addr);
                        sent = true;
                    }
                }
            }
        });
        let mut server = ServerProcess {
            child: Some(child),
            target: HttpTarget::new("127.0.0.1", 0),
            log_path: log_path.to_path_buf(),
        };
        let deadline = Instant::now() + timeout;
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok((host, port)) => {
                    server.target = HttpTarget::new(host, port);
                    return Ok(server);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // stdout closed without the line; fall through to the exit check.
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
            if let Some(status) = server.exited() {
                return Err(BenchError::Sweep(format!(
                    "server exited ({status}) before printing `listening on HOST:PORT`; \
                     log tail:\n{}",
                    log_tail(log_path)
                )));
            }
            if Instant::now() >= deadline {
                return Err(BenchError::Sweep(format!(
                    "server printed no `listening on HOST:PORT` line within {:?}; log tail:\n{}",
                    timeout,
                    log_tail(log_path)
                )));
            }
        }
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// Polls `GET /health` until it answers 200.
    pub fn wait_healthy(&mut self, timeout: Duration) -> Result<(), BenchError> {
        let target = self.target.clone();
        wait_healthy(&target, timeout, || self.exited().map(|s| s.to_string()))
            .map_err(|e| BenchError::Sweep(format!("{e}; log tail:\n{}", log_tail(&self.log_path))))
    }

    /// SIGTERM, then up to `grace` for the process to exit, then SIGKILL.
    pub fn stop(mut self, grace: Duration) -> Result<ExitStatus, BenchError> {
        let mut child = self.child.take().expect("stop is called once");
        let pid = child.id() as libc::pid_t;
        // SAFETY: kill(2) on the pid of a child we own and have not reaped yet.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        loop {
            if let Some(status) = child
                .try_wait()
                .map_err(|e| BenchError::Sweep(format!("waiting for the server: {e}")))?
            {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                tracing::warn!("server did not exit within {grace:?} of SIGTERM; killing it");
                let _ = child.kill();
                return child
                    .wait()
                    .map_err(|e| BenchError::Sweep(format!("waiting for the server: {e}")));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Polls `GET /health` on `target` until 200; `gone` reports a dead server early.
pub fn wait_healthy(
    target: &HttpTarget,
    timeout: Duration,
    mut gone: impl FnMut() -> Option<String>,
) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let probe = Timeouts {
        connect: Duration::from_secs(2),
        total: Duration::from_secs(5),
    };
    loop {
        let req = HttpRequest {
            method: "GET",
            path: "/health",
            headers: &[],
            body: &[],
        };
        let last = match fetch_text(target, &req, probe) {
            Ok((200, _)) => return Ok(()),
            Ok((status, body)) => {
                format!("HTTP {status}: {}", crate::api::clip(body.trim(), 200))
            }
            Err(e) => e.to_string(),
        };
        if let Some(status) = gone() {
            return Err(format!("server exited ({status}) before /health was 200"));
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "GET /health on {} not 200 within {timeout:?} (last: {last})",
                target.authority()
            ));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The last lines of a log file, for error messages.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_parsing_and_product() {
        let axes = parse_grid(
            "model_config.decode_batch_size=16,32; pa_config.block_size=16,32 ;x.name=a",
        )
        .unwrap();
        assert_eq!(axes.len(), 3);
        assert_eq!(axes[0].values, vec![Value::from(16), Value::from(32)]);
        assert_eq!(axes[2].values, vec![Value::String("a".into())]);
        let points = grid_points(&axes);
        assert_eq!(points.len(), 4);
        assert_eq!(
            point_label(&points[1]),
            "model_config.decode_batch_size=16;pa_config.block_size=32;x.name=a"
        );
        for bad in ["", "a", "a=", ".b=1", "a=1;a=2", "a.=1"] {
            assert!(parse_grid(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn overrides_edit_the_tree() {
        let mut tree: Value =
            serde_yaml::from_str("model_config:\n  decode_batch_size: [50]\n  x: 1\nlist: [1]\n")
                .unwrap();
        let point = vec![
            (
                "model_config.decode_batch_size".to_string(),
                Value::from(16),
            ),
            (
                "npu_serving.max_tokens_per_step".to_string(),
                Value::from(256),
            ),
        ];
        apply_overrides(&mut tree, &point).unwrap();
        assert_eq!(tree["model_config"]["decode_batch_size"], Value::from(16));
        assert_eq!(tree["model_config"]["x"], Value::from(1));
        assert_eq!(tree["npu_serving"]["max_tokens_per_step"], Value::from(256));
        let bad = vec![("list.a".to_string(), Value::from(1))];
        let e = apply_overrides(&mut tree, &bad).unwrap_err().to_string();
        assert!(e.contains("list is not a mapping"), "{e}");
    }

    #[test]
    fn listening_line_formats() {
        assert_eq!(
            parse_listening_line("listening on 127.0.0.1:40123"),
            Some(("127.0.0.1".into(), 40123))
        );
        assert_eq!(
            parse_listening_line("2026-11-22T00:00:00Z INFO npu_server: listening on 0.0.0.0:8835"),
            Some(("127.0.0.1".into(), 8835))
        );
        assert_eq!(
            parse_listening_line("listening on [::1]:9000"),
            Some(("::1".into(), 9000))
        );
        assert_eq!(parse_listening_line("listening on nowhere"), None);
        assert_eq!(parse_listening_line("starting agents"), None);
    }

    #[test]
    fn start_reports_a_server_that_exits_early() {
        let dir = std::env::temp_dir().join(format!("bench-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = ServerProcess::start(
            Path::new("/bin/false"),
            Path::new("x.yaml"),
            &dir.join("server.log"),
            Duration::from_secs(10),
        )
        .err()
        .expect("/bin/false never listens")
        .to_string();
        assert!(e.contains("exited"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

//! End to end: `npu-serving serve` with API keys and TLS. Keys from the config's key file,
//! `--api-key` and NPU_SERVING_API_KEY each open the OpenAI and llm-serving routes, as
//! `Authorization: Bearer` or `x-api-key`; a missing or wrong key is a 401 in the route's error
//! shape with `WWW-Authenticate: Bearer`; probes and /metrics stay open (or need the key with
//! `protect_health`). Over TLS (a self-signed certificate made here, read by a rustls client):
//! requests succeed, plain HTTP on the TLS port is cut without harm, SIGHUP with a new
//! certificate serves new connections with it while an open one keeps working, and a bad file
//! at reload keeps the old one; bad files at start are refused by key.

mod e2e_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e_support::*;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};

const FILE_KEY: &str = "sk-file-3f9a1c";
const CLI_KEY: &str = "sk-cli-77b2e0";
const ENV_KEY: &str = "sk-env-c41d9e";

/// A response: status, head lines, body.
struct Resp {
    status: u16,
    head: String,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }

    fn has_header(&self, name: &str, value: &str) -> bool {
        self.head.lines().any(|l| {
            l.split_once(':')
                .is_some_and(|(k, v)| k.trim().eq_ignore_ascii_case(name) && v.trim() == value)
        })
    }
}

/// One request on an open stream (keep-alive), the response read by its Content-Length.
fn exchange<S: Read + Write>(
    s: &mut S,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Resp> {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    s.write_all(body)?;
    s.flush()?;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok(Resp {
        status,
        head,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn plain(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s
}

fn call(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &Value) -> Resp {
    let body = if body.is_null() {
        Vec::new()
    } else {
        body.to_string().into_bytes()
    };
    exchange(&mut plain(port), method, path, headers, &body).unwrap()
}

type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// An HTTPS connection trusting only `ca` (the handshake is done on the first request).
fn https(port: u16, ca: &CertificateDer<'static>) -> Tls {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    rustls::StreamOwned::new(conn, plain(port))
}

/// A self-signed certificate for localhost, written as PEM to `cert` and `key`.
fn make_cert(cert: &Path, key: &Path) -> CertificateDer<'static> {
    let c = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    std::fs::write(cert, c.cert.pem()).unwrap();
    std::fs::write(key, c.key_pair.serialize_pem()).unwrap();
    c.cert.der().clone()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("npu-auth-files-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn chat() -> Value {
    json!({"model": MODEL, "max_tokens": 4,
           "messages": [{"role": "user", "content": "Say hi"}]})
}

#[test]
fn api_keys_guard_every_api_route_and_leave_probes_open() {
    let _serial = serial();
    let dir = scratch("keys");
    let keys = dir.join("keys.txt");
    std::fs::write(&keys, format!("# the team's keys\n\n{FILE_KEY}\n")).unwrap();
    let opts = ServerOpts {
        npu_serving_extra: format!("  api_keys: {{file: '{}'}}\n", keys.display()),
        args: vec!["--api-key".into(), CLI_KEY.into()],
        env: vec![("NPU_SERVING_API_KEY".into(), PathBuf::from(ENV_KEY))],
        ..Default::default()
    };
    let started = Instant::now();
    let server = Server::start("auth-keys", &opts);
    eprintln!("server up in {:?}", started.elapsed());
    let port = server.port;
    let generate = format!("/models/{MODEL}/generate");
    let tgi = json!({"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}});

    // Refused: no key, a wrong key, a key in the wrong scheme.
    for (path, body) in [
        ("/v1/chat/completions", chat()),
        (generate.as_str(), tgi.clone()),
    ] {
        for headers in [
            &[][..],
            &[("Authorization", "Bearer sk-wrong")][..],
            &[("x-api-key", "sk-file-3f9a1")][..],
            &[("Authorization", &format!("Basic {FILE_KEY}") as &str)][..],
        ] {
            let r = call(port, "POST", path, headers, &body);
            assert_eq!(r.status, 401, "{path} {headers:?}: {}", r.body);
            assert!(r.has_header("WWW-Authenticate", "Bearer"), "{}", r.head);
            let v = r.json();
            if path.starts_with("/v1/") {
                assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
                assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
            } else {
                assert_eq!(v["type"], "authentication_error", "{v}");
                assert!(v["error"].is_string(), "{v}");
            }
        }
    }
    assert_eq!(
        call(port, "GET", "/v1/models", &[], &Value::Null).status,
        401
    );
    assert_eq!(
        call(port, "GET", "/no/such/route", &[], &Value::Null).status,
        401
    );

    // Accepted: each key, as Bearer and as x-api-key.
    for key in [FILE_KEY, CLI_KEY, ENV_KEY] {
        let bearer = format!("Bearer {key}");
        for headers in [[("Authorization", bearer.as_str())], [("x-api-key", key)]] {
            let r = call(port, "POST", "/v1/chat/completions", &headers, &chat());
            assert_eq!(r.status, 200, "{headers:?}: {}", r.body);
            assert!(r.json()["choices"][0]["message"]["content"].is_string());
            let r = call(port, "POST", &generate, &headers, &tgi);
            assert_eq!(r.status, 200, "{headers:?}: {}", r.body);
        }
    }
    let r = call(
        port,
        "GET",
        "/v1/models",
        &[("x-api-key", CLI_KEY)],
        &Value::Null,
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Probes and the scraper need no key.
    for path in ["/health", "/live", "/ready", "/metrics"] {
        let r = call(port, "GET", path, &[], &Value::Null);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
    let log = server.log_text();
    for key in [FILE_KEY, CLI_KEY, ENV_KEY, "sk-wrong"] {
        assert!(!log.contains(key), "the log shows a key:\n{log}");
    }
    assert!(log.contains("api_keys=3"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn https_with_a_key_reloads_its_certificate_on_sighup() {
    let _serial = serial();
    let dir = scratch("tls");
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let first = make_cert(&cert, &key);
    let opts = ServerOpts {
        npu_serving_extra: format!(
            "  api_keys: ['{FILE_KEY}']\n  protect_health: true\n  tls: {{cert: '{}', key: '{}'}}\n",
            cert.display(),
            key.display()
        ),
        https: true,
        ..Default::default()
    };
    let server = Server::start("auth-tls", &opts);
    let port = server.port;
    let auth = [("Authorization", &format!("Bearer {FILE_KEY}") as &str)];

    // /health over HTTPS: the key is needed (protect_health), and the server becomes ready.
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let r = exchange(&mut https(port, &first), "GET", "/health", &auth, b"").unwrap();
        if r.status == 200 {
            break;
        }
        assert!(Instant::now() < until, "/health: {} {}", r.status, r.body);
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = exchange(&mut https(port, &first), "GET", "/health", &[], b"").unwrap();
    assert_eq!(r.status, 401, "{}", r.body);
    let r = exchange(&mut https(port, &first), "GET", "/metrics", &[], b"").unwrap();
    assert_eq!(r.status, 401, "{}", r.body);

    // A chat completion over HTTPS, on a connection kept open across the reload below.
    let mut kept = https(port, &first);
    let body = chat().to_string().into_bytes();
    let r = exchange(&mut kept, "POST", "/v1/chat/completions", &auth, &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["choices"][0]["message"]["content"].is_string());

    // Plain HTTP on the TLS port: no response, the connection is closed; the server lives on.
    let mut p = plain(port);
    p.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    let _ = p.read_to_end(&mut got);
    assert!(
        !got.starts_with(b"HTTP/"),
        "plain HTTP was answered: {:?}",
        String::from_utf8_lossy(&got)
    );

    // A new certificate, then SIGHUP: new connections get it.
    let second = make_cert(&cert, &key);
    server.signal(libc::SIGHUP);
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(r) = exchange(&mut https(port, &second), "GET", "/health", &auth, b"") {
            assert_eq!(r.status, 200, "{}", r.body);
            break;
        }
        assert!(
            Instant::now() < until,
            "the new certificate was not picked up; log:\n{}",
            server.log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        exchange(&mut https(port, &first), "GET", "/health", &auth, b"").is_err(),
        "a client trusting only the old certificate still connected"
    );
    // The connection opened before the reload keeps its session.
    let r = exchange(&mut kept, "POST", "/v1/chat/completions", &auth, &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);

    // A broken certificate at reload: logged, and the current one stays.
    std::fs::write(&cert, "not a certificate\n").unwrap();
    server.signal(libc::SIGHUP);
    let until = Instant::now() + Duration::from_secs(20);
    while !server.log_text().contains("not reloaded") {
        assert!(
            Instant::now() < until,
            "no reload warning; log:\n{}",
            server.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = exchange(&mut https(port, &second), "GET", "/health", &auth, b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(server.log_text().contains("npu_serving.tls.cert"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_key_and_certificate_files_are_refused_at_start_by_key() {
    let dir = scratch("refused");
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    make_cert(&cert, &key);
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "junk\n").unwrap();
    let empty_keys = dir.join("keys.txt");
    std::fs::write(&empty_keys, "# no key yet\n").unwrap();
    let base = ServerOpts::default().yaml();
    let cases = [
        (
            format!(
                "  tls: {{cert: '{}', key: '{}'}}\n",
                junk.display(),
                key.display()
            ),
            "npu_serving.tls.cert",
            junk.display().to_string(),
        ),
        (
            format!(
                "  tls: {{cert: '{}', key: '{}'}}\n",
                cert.display(),
                dir.join("absent.key").display()
            ),
            "npu_serving.tls.key",
            "absent.key".to_string(),
        ),
        (
            format!("  api_keys: {{file: '{}'}}\n", empty_keys.display()),
            "npu_serving.api_keys.file",
            empty_keys.display().to_string(),
        ),
        (
            "  api_keys: {env: NPU_E2E_UNSET_KEY_VAR}\n".to_string(),
            "npu_serving.api_keys.env",
            "NPU_E2E_UNSET_KEY_VAR".to_string(),
        ),
    ];
    for (extra, key_name, what) in cases {
        let (status, stderr) = serve_refused("auth-refused", &(base.clone() + &extra), &[]);
        assert!(!status.success(), "{extra}");
        assert!(
            stderr.contains(key_name) && stderr.contains(&what),
            "{extra}: stderr does not name {key_name} and {what}:\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

//! API-key authentication, applied to every route before the API layer dispatches it: the keys
//! (from `npu_serving.api_keys`, `serve --api-key` and `NPU_SERVING_API_KEY`) are kept only as
//! SHA-256 digests, a request's `Authorization: Bearer KEY` or `x-api-key: KEY` is hashed and
//! compared with every digest in constant time (so neither a key's bytes nor its length leak
//! through timing), and a missing or wrong key is a 401 in the shape of the API it was sent to,
//! with `WWW-Authenticate: Bearer`. /health, /live, /ready and /metrics stay open unless
//! `npu_serving.protect_health` is true. Keys are never logged.

use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{check_key, AccessConfig, ApiKeySource};
use crate::engine::RequestId;
use crate::http::{Handler, Reply, Request, Response};

/// The environment variable whose value is one more key (as vLLM's `VLLM_API_KEY`).
pub const API_KEY_ENV: &str = "NPU_SERVING_API_KEY";

/// The routes probes and scrapers call, open unless `protect_health`.
pub const HEALTH_ROUTES: [&str; 4] = ["/health", "/live", "/ready", "/metrics"];

/// The accepted keys, as SHA-256 digests. Empty: authentication is off.
#[derive(Clone, Default)]
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.digests.len())
    }
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

impl ApiKeys {
    pub fn new<S: AsRef<str>>(keys: impl IntoIterator<Item = S>) -> Self {
        let mut digests: Vec<[u8; 32]> = keys
            .into_iter()
            .map(|k| digest(k.as_ref().as_bytes()))
            .collect();
        digests.sort_unstable();
        digests.dedup();
        Self { digests }
    }

    /// The keys of the config (`api_keys`: a list, a file or a variable), of `--api-key` and of
    /// `NPU_SERVING_API_KEY` (`env_key`: its value; empty counts as unset), all accepted.
    /// `getenv` reads the variable `{env: VAR}` names. A file that cannot be read or holds no
    /// key, or a variable that is unset or empty, is refused naming the key.
    pub fn resolve(
        cfg: &AccessConfig,
        cli_keys: &[String],
        env_key: Option<String>,
        getenv: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, String> {
        let mut keys: Vec<String> = Vec::new();
        match &cfg.api_keys {
            ApiKeySource::None => {}
            ApiKeySource::Keys(k) => keys.extend(k.iter().cloned()),
            ApiKeySource::File(path) => keys.extend(read_key_file(path)?),
            ApiKeySource::Env(var) => match getenv(var) {
                Some(v) if !v.trim().is_empty() => keys.push(
                    check_key(&format!("npu_serving.api_keys.env ({var})"), &v)
                        .map_err(|e| e.to_string())?,
                ),
                _ => {
                    return Err(format!(
                        "npu_serving.api_keys.env: the environment variable {var} is unset or \
                         empty (it must hold the API key)"
                    ))
                }
            },
        }
        for (i, k) in cli_keys.iter().enumerate() {
            keys.push(
                check_key(&format!("--api-key (occurrence {})", i + 1), k)
                    .map_err(|e| e.to_string())?,
            );
        }
        if let Some(v) = env_key.filter(|v| !v.trim().is_empty()) {
            keys.push(check_key(API_KEY_ENV, &v).map_err(|e| e.to_string())?);
        }
        Ok(Self::new(keys))
    }

    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// Whether `presented` is one of the keys. Every digest is compared, each in constant
    /// time, and the results are combined without branching on them.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let d = digest(presented);
        let mut found = subtle::Choice::from(0u8);
        for k in &self.digests {
            found |= k.ct_eq(&d);
        }
        bool::from(found)
    }

    /// The key a request presents: `Authorization: Bearer KEY` (scheme in any case), else
    /// `x-api-key: KEY`.
    pub fn presented(req: &Request) -> Option<&str> {
        let bearer = req.header("authorization").and_then(|v| {
            let v = v.trim();
            let (scheme, rest) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(rest.trim())
        });
        bearer
            .or_else(|| req.header("x-api-key").map(str::trim))
            .filter(|k| !k.is_empty())
    }
}

/// Parses a key file: one key a line; blank lines and lines starting with `#` are skipped.
pub fn parse_key_file(text: &str, path: &Path) -> Result<Vec<String>, String> {
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = format!(
            "npu_serving.api_keys.file {} line {}",
            path.display(),
            i + 1
        );
        keys.push(check_key(&at, line).map_err(|e| e.to_string())?);
    }
    if keys.is_empty() {
        return Err(format!(
            "npu_serving.api_keys.file: {} holds no key (one key a line; # starts a comment)",
            path.display()
        ));
    }
    Ok(keys)
}

fn read_key_file(path: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "npu_serving.api_keys.file: cannot read {}: {e}",
            path.display()
        )
    })?;
    parse_key_file(&text, path)
}

/// The 401 for `path`, in the error shape of the API it belongs to.
fn unauthorized(path: &str, missing: bool) -> Response {
    let message = if missing {
        "missing API key: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`"
    } else {
        "invalid API key"
    };
    let resp = if path.starts_with("/v1/messages") {
        Response::json(
            401,
            &serde_json::json!({
                "type": "error",
                "error": { "type": "authentication_error", "message": message },
            }),
        )
    } else if path.starts_with("/v1/") || openai_without_prefix(path) {
        Response::json(
            401,
            &serde_json::json!({
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": null,
                    "code": "invalid_api_key",
                }
            }),
        )
    } else {
        Response::error(401, "authentication_error", message)
    };
    resp.with_header("WWW-Authenticate", "Bearer")
}

/// OpenAI routes llama-server also answers without `/v1` (`/models/{name}` is llm-serving's).
fn openai_without_prefix(path: &str) -> bool {
    ["/chat/completions", "/completions", "/models", "/responses"].contains(&path)
        || path.starts_with("/responses/")
}

/// The API layer behind a key check: requests without an accepted key never reach `inner`.
pub struct Authenticated {
    inner: Arc<dyn Handler>,
    keys: ApiKeys,
    protect_health: bool,
}

impl Authenticated {
    /// `inner` itself when there are no keys (nothing to check).
    pub fn wrap(inner: Arc<dyn Handler>, keys: ApiKeys, protect_health: bool) -> Arc<dyn Handler> {
        if keys.is_empty() {
            return inner;
        }
        Arc::new(Self {
            inner,
            keys,
            protect_health,
        })
    }

    fn open(&self, path: &str) -> bool {
        !self.protect_health && HEALTH_ROUTES.contains(&path)
    }
}

impl Handler for Authenticated {
    fn handle(&self, req: &Request, id: RequestId) -> Reply {
        if self.open(&req.path) {
            return self.inner.handle(req, id);
        }
        match ApiKeys::presented(req) {
            Some(k) if self.keys.accepts(k.as_bytes()) => self.inner.handle(req, id),
            k => {
                tracing::debug!(path = %req.path, presented = k.is_some(), "refused: API key");
                Reply::Full(unauthorized(&req.path, k.is_none()))
            }
        }
    }

    fn error_response(
        &self,
        path: Option<&str>,
        status: u16,
        kind: &str,
        message: &str,
    ) -> Response {
        self.inner.error_response(path, status, kind, message)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn req(path: &str, headers: &[(&str, &str)]) -> Request {
        Request {
            method: "GET".into(),
            path: path.into(),
            query: None,
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: Vec::new(),
            arrived: Instant::now(),
        }
    }

    #[test]
    fn accepts_exactly_the_keys() {
        let keys = ApiKeys::new(["sk-alpha", "sk-beta"]);
        assert_eq!(keys.len(), 2);
        assert!(keys.accepts(b"sk-alpha"));
        assert!(keys.accepts(b"sk-beta"));
        for wrong in [
            &b"sk-alph"[..],
            b"sk-alphaa",
            b"SK-ALPHA",
            b"",
            b"sk-gamma",
            b"sk-alpha\0",
        ] {
            assert!(!keys.accepts(wrong), "{wrong:?}");
        }
        assert!(ApiKeys::default().is_empty());
        assert!(!ApiKeys::default().accepts(b""));
        assert_eq!(format!("{keys:?}"), "ApiKeys(2 keys)");
    }

    #[test]
    fn presented_key_from_bearer_or_x_api_key() {
        let r = req("/v1/models", &[("Authorization", "Bearer  sk-1 ")]);
        assert_eq!(ApiKeys::presented(&r), Some("sk-1"));
        let r = req("/v1/models", &[("authorization", "bearer sk-1")]);
        assert_eq!(ApiKeys::presented(&r), Some("sk-1"));
        let r = req("/v1/models", &[("X-Api-Key", "sk-2")]);
        assert_eq!(ApiKeys::presented(&r), Some("sk-2"));
        let r = req("/v1/models", &[("Authorization", "Basic dXNlcg==")]);
        assert_eq!(ApiKeys::presented(&r), None);
        let r = req("/v1/models", &[("Authorization", "Bearer")]);
        assert_eq!(ApiKeys::presented(&r), None);
        assert_eq!(ApiKeys::presented(&req("/v1/models", &[])), None);
    }

    #[test]
    fn key_files_skip_comments_and_blank_lines() {
        let p = Path::new("/k");
        let text = "# team keys\n\nsk-one\n  sk-two  \n#sk-off\n";
        assert_eq!(parse_key_file(text, p).unwrap(), ["sk-one", "sk-two"]);
        let e = parse_key_file("# nothing\n\n", p).unwrap_err();
        assert!(
            e.contains("npu_serving.api_keys.file") && e.contains("no key"),
            "{e}"
        );
        let e = parse_key_file("sk-ok\nsk bad\n", p).unwrap_err();
        assert!(e.contains("line 2") && !e.contains("sk bad"), "{e}");
    }

    #[test]
    fn resolve_joins_config_cli_and_environment() {
        let none = |_: &str| None;
        let cfg = AccessConfig::default();
        assert!(ApiKeys::resolve(&cfg, &[], None, none).unwrap().is_empty());
        assert!(ApiKeys::resolve(&cfg, &[], Some(" ".into()), none)
            .unwrap()
            .is_empty());
        let cfg = AccessConfig {
            api_keys: ApiKeySource::Keys(vec!["a".into()]),
            ..AccessConfig::default()
        };
        let k = ApiKeys::resolve(&cfg, &["b".into()], Some("c".into()), none).unwrap();
        assert!(k.accepts(b"a") && k.accepts(b"b") && k.accepts(b"c"));
        let cfg = AccessConfig {
            api_keys: ApiKeySource::Env("TEAM_KEY".into()),
            ..AccessConfig::default()
        };
        let k = ApiKeys::resolve(&cfg, &[], None, |v| {
            (v == "TEAM_KEY").then(|| "sk-team".to_string())
        })
        .unwrap();
        assert!(k.accepts(b"sk-team"));
        let e = ApiKeys::resolve(&cfg, &[], None, none).unwrap_err();
        assert!(e.contains("npu_serving.api_keys.env") && e.contains("TEAM_KEY"));
        let cfg = AccessConfig {
            api_keys: ApiKeySource::File("/nonexistent/keys.txt".into()),
            ..AccessConfig::default()
        };
        let e = ApiKeys::resolve(&cfg, &[], None, none).unwrap_err();
        assert!(e.contains("npu_serving.api_keys.file") && e.contains("/nonexistent/keys.txt"));
        let e = ApiKeys::resolve(&AccessConfig::default(), &["two words".into()], None, none)
            .unwrap_err();
        assert!(e.contains("--api-key") && !e.contains("two words"), "{e}");
    }

    #[test]
    fn refusals_take_each_apis_shape() {
        let body = |r: &Response| -> serde_json::Value {
            assert_eq!(r.status, 401);
            assert!(r
                .headers
                .iter()
                .any(|(k, v)| k == "WWW-Authenticate" && v == "Bearer"));
            serde_json::from_slice(&r.body).unwrap()
        };
        let v = body(&unauthorized("/v1/chat/completions", false));
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert_eq!(v["error"]["message"], "invalid API key");
        let v = body(&unauthorized("/chat/completions", true));
        assert_eq!(v["error"]["code"], "invalid_api_key");
        let v = body(&unauthorized("/v1/messages/count_tokens", true));
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "authentication_error");
        let v = body(&unauthorized("/models/m/generate", true));
        assert_eq!(v["type"], "authentication_error");
        assert!(v["error"].as_str().unwrap().contains("missing API key"));
    }
}

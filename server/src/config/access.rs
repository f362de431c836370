//! Who may call the server and over what: `npu_serving.api_keys` (a list of keys, or
//! `{file: PATH}` / `{env: VAR}` naming where they are), `npu_serving.protect_health` (whether
//! /health, /live, /ready and /metrics need a key too) and `npu_serving.tls` (`{cert, key}`,
//! PEM files). Only the shape is checked here; files and variables are read at start
//! (`crate::auth::ApiKeys::resolve`, `crate::http::TlsAcceptor::load`), errors naming the key.

use std::path::PathBuf;

use serde_yaml::Value;

use super::error::ConfigError;
use super::reader::{describe, Section, Unknown};

/// Where the configured API keys come from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ApiKeySource {
    /// `api_keys` absent: keys only from `--api-key` or `NPU_SERVING_API_KEY`, if any.
    #[default]
    None,
    /// `api_keys: [KEY, ...]`.
    Keys(Vec<String>),
    /// `api_keys: {file: PATH}`: one key a line, `#` starts a comment line.
    File(PathBuf),
    /// `api_keys: {env: VAR}`: the variable's value is the key.
    Env(String),
}

/// `npu_serving.tls`: the server's certificate chain and private key, PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The access settings of `npu_serving`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessConfig {
    pub api_keys: ApiKeySource,
    /// When keys are set, /health, /live, /ready and /metrics need one too (default: open, so
    /// probes and scrapers work without the key).
    pub protect_health: bool,
    /// None: plain HTTP.
    pub tls: Option<TlsFiles>,
}

pub(super) fn access(s: &mut Section, unknown: Unknown) -> Result<AccessConfig, ConfigError> {
    let mut c = AccessConfig {
        protect_health: s.bool("protect_health")?.unwrap_or(false),
        ..AccessConfig::default()
    };
    let keys_path = s.key_path("api_keys");
    match s.raw("api_keys") {
        None => {}
        Some(Value::Sequence(items)) => {
            let mut keys = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let path = format!("{keys_path}[{i}]");
                match item {
                    Value::String(k) => keys.push(check_key(&path, k)?),
                    // Never echo what might be a key: only its type.
                    other => {
                        return Err(ConfigError::WrongType {
                            path,
                            expected: "a string (an API key)",
                            found: type_only(other),
                        })
                    }
                }
            }
            if keys.is_empty() {
                return Err(ConfigError::Empty {
                    path: keys_path,
                    need: "at least one key, or leave api_keys out for no authentication",
                });
            }
            c.api_keys = ApiKeySource::Keys(keys);
        }
        Some(Value::Mapping(_)) => {
            let mut sec = s.section("api_keys")?;
            let file = sec.string("file")?;
            let env = sec.string("env")?;
            sec.finish(&mut Vec::new(), unknown)?;
            c.api_keys = match (file, env) {
                (Some(f), None) if !f.trim().is_empty() => {
                    ApiKeySource::File(super::sections::expand_home(f.trim()))
                }
                (None, Some(v)) if valid_env_name(&v) => ApiKeySource::Env(v),
                (None, Some(v)) => {
                    return Err(ConfigError::not_allowed(
                        &format!("{keys_path}.env"),
                        format!("{v:?}"),
                        "an environment variable's name (letters, digits, _)",
                    ))
                }
                (Some(_), Some(_)) | (None, None) | (Some(_), None) => {
                    return Err(ConfigError::not_allowed(
                        &keys_path,
                        "this mapping",
                        "a list of keys, or exactly one of {file: PATH} and {env: VAR}",
                    ))
                }
            };
        }
        Some(other) => {
            return Err(ConfigError::WrongType {
                path: keys_path,
                expected: "a list of keys, {file: PATH} or {env: VAR}",
                found: type_only(other),
            })
        }
    }
    if s.raw("tls").is_some() {
        let mut sec = s.section("tls")?;
        let mut path_of = |key: &str| -> Result<PathBuf, ConfigError> {
            match sec.string(key)? {
                Some(p) if !p.trim().is_empty() => Ok(super::sections::expand_home(p.trim())),
                _ => Err(ConfigError::Empty {
                    path: sec.key_path(key),
                    need: "the path of a PEM file",
                }),
            }
        };
        let cert = path_of("cert")?;
        let key = path_of("key")?;
        sec.finish(&mut Vec::new(), unknown)?;
        c.tls = Some(TlsFiles { cert, key });
    }
    Ok(c)
}

/// A key as written: no surrounding whitespace, nothing a header cannot carry.
pub(crate) fn check_key(path: &str, key: &str) -> Result<String, ConfigError> {
    let k = key.trim();
    if k.is_empty() {
        return Err(ConfigError::Empty {
            path: path.to_string(),
            need: "an API key",
        });
    }
    if !k.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::not_allowed(
            path,
            "this key",
            "printable ASCII without spaces (what an HTTP header carries)",
        ));
    }
    Ok(k.to_string())
}

fn valid_env_name(v: &str) -> bool {
    !v.is_empty() && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// A value's type without the value (it may be a secret).
fn type_only(v: &Value) -> String {
    match v {
        Value::String(_) => "a string".into(),
        other => describe(other),
    }
}

#[cfg(test)]
mod tests {
    use crate::config::ServerConfig;

    use super::*;

    fn load(npu: &str) -> Result<AccessConfig, ConfigError> {
        let yaml = format!("npu_serving:\n{npu}");
        ServerConfig::from_yaml_str(&yaml).map(|c| c.npu_serving.access)
    }

    #[test]
    fn absent_means_open_plain_http() {
        assert_eq!(load("  device: cpu\n").unwrap(), AccessConfig::default());
    }

    #[test]
    fn keys_as_a_list_a_file_or_a_variable() {
        let c = load("  api_keys: [sk-one, ' sk-two ']\n  protect_health: true\n").unwrap();
        assert_eq!(
            c.api_keys,
            ApiKeySource::Keys(vec!["sk-one".into(), "sk-two".into()])
        );
        assert!(c.protect_health);
        let c = load("  api_keys: {file: /run/keys.txt}\n").unwrap();
        assert_eq!(c.api_keys, ApiKeySource::File("/run/keys.txt".into()));
        let c = load("  api_keys: {env: MY_KEY}\n").unwrap();
        assert_eq!(c.api_keys, ApiKeySource::Env("MY_KEY".into()));
    }

    #[test]
    fn bad_key_settings_are_refused_naming_the_key_without_echoing_it() {
        for (npu, key) in [
            ("  api_keys: []\n", "npu_serving.api_keys"),
            ("  api_keys: ['']\n", "npu_serving.api_keys[0]"),
            ("  api_keys: [ok, 'has space']\n", "npu_serving.api_keys[1]"),
            ("  api_keys: [12345]\n", "npu_serving.api_keys[0]"),
            ("  api_keys: secret-value\n", "npu_serving.api_keys"),
            ("  api_keys: {file: a, env: B}\n", "npu_serving.api_keys"),
            ("  api_keys: {}\n", "npu_serving.api_keys"),
            ("  api_keys: {env: 'A-B'}\n", "npu_serving.api_keys.env"),
            ("  api_keys: {fil: x}\n", "npu_serving.api_keys.fil"),
            ("  tls: {cert: a.pem}\n", "npu_serving.tls.key"),
            ("  tls: {key: a.pem, cert: ''}\n", "npu_serving.tls.cert"),
            ("  tls: {cert: a, key: b, ca: c}\n", "npu_serving.tls.ca"),
            ("  protect_health: maybe\n", "npu_serving.protect_health"),
        ] {
            let e = load(npu).unwrap_err();
            assert_eq!(e.key_path(), Some(key), "{npu}: {e}");
            let text = e.to_string();
            assert!(
                !text.contains("secret-value") && !text.contains("has space"),
                "{text}"
            );
        }
    }

    #[test]
    fn tls_takes_both_paths() {
        let c = load("  tls: {cert: /etc/tls/tls.crt, key: /etc/tls/tls.key}\n").unwrap();
        assert_eq!(
            c.tls,
            Some(TlsFiles {
                cert: "/etc/tls/tls.crt".into(),
                key: "/etc/tls/tls.key".into()
            })
        );
    }
}

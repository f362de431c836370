//! Errors and warnings of config loading: every refusal names the key's full path, the value
//! found and what is allowed; warnings name the key and say why it is ignored.

use std::path::PathBuf;

/// A config file that cannot be used as written.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config is not valid YAML: {0}")]
    Yaml(String),
    #[error("config must be a YAML mapping of sections at the top level, found {found}")]
    NotAMapping { found: String },
    #[error("{path}: expected {expected}, found {found}")]
    WrongType {
        path: String,
        expected: &'static str,
        found: String,
    },
    #[error("{path}: {value} is not allowed (must be {allowed})")]
    NotAllowed {
        path: String,
        value: String,
        allowed: String,
    },
    #[error("{path}: empty ({need})")]
    Empty { path: String, need: &'static str },
}

impl ConfigError {
    pub(crate) fn not_allowed(path: &str, value: impl ToString, allowed: impl ToString) -> Self {
        Self::NotAllowed {
            path: path.to_string(),
            value: value.to_string(),
            allowed: allowed.to_string(),
        }
    }

    /// The full key path the error is about, when it is about one key.
    pub fn key_path(&self) -> Option<&str> {
        match self {
            Self::WrongType { path, .. }
            | Self::NotAllowed { path, .. }
            | Self::Empty { path, .. } => Some(path),
            _ => None,
        }
    }
}

/// A key that was accepted but has no effect here (or is unknown), and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigWarning {
    /// Full key path, e.g. `model_config.zactivate_len`.
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

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
    #[error("{path}: unknown key{hint}")]
    UnknownKey { path: String, hint: String },
    /// The KV pool cannot hold one sequence as long as the context limit allows.
    #[error(
        "{pool_path}: {num_blocks} blocks x pa_config.block_size {block_size} = {slots} token \
         slots per agent cannot hold one sequence of {limit_path} = {limit} tokens; raise \
         {raise} at least {blocks_needed} or lower {lower} to at most {slots}"
    )]
    PoolTooSmall {
        pool_path: &'static str,
        /// What to raise, up to "at least N".
        raise: &'static str,
        num_blocks: u32,
        block_size: u32,
        slots: u64,
        limit_path: &'static str,
        limit: u32,
        blocks_needed: u64,
        /// The key to lower (for a limit that comes from the model: the one to set).
        lower: &'static str,
    },
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
            | Self::Empty { path, .. }
            | Self::UnknownKey { path, .. } => Some(path),
            Self::PoolTooSmall { pool_path, .. } => Some(pool_path),
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

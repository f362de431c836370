//! The load generator's one error type: everything that stops a bench run (bad arguments, an
//! unreadable dataset, a server that cannot be started, files that cannot be written). Failures of
//! single requests are not errors here: they are recorded in the request's result with a reason.

use std::path::PathBuf;

/// Why a bench run (or one of its preparation steps) could not go on.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A command-line value that is out of range or malformed.
    #[error("invalid argument {flag}: {message}")]
    InvalidArgument { flag: &'static str, message: String },

    /// The dataset file could not be read or does not have a supported shape.
    #[error("dataset {path}: {message}")]
    Dataset { path: PathBuf, message: String },

    /// The model (for its tokenizer) could not be found or loaded.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The server cannot be reached at all (checked once before a run starts).
    #[error(
        "cannot connect to the server at {addr}: {reason} (is it running there? --host and -P/--port say where)"
    )]
    Unreachable { addr: String, reason: String },

    /// An HTTP exchange failed outside of a measured request (health check, model list).
    #[error("http: {0}")]
    Http(#[from] crate::http_client::HttpError),

    /// Reading or writing a file in the output directory failed.
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// Encoding results as JSON failed.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),

    /// A sweep could not start, reach or stop its server, or its grid is malformed.
    #[error("sweep: {0}")]
    Sweep(String),

    /// Drawing a plot failed.
    #[error("plot {path}: {message}")]
    Plot { path: PathBuf, message: String },
}

impl BenchError {
    /// Shorthand for an I/O error tied to a path and what was being done to it.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        BenchError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// Shorthand for an invalid command-line value.
    pub fn arg(flag: &'static str, message: impl Into<String>) -> Self {
        BenchError::InvalidArgument {
            flag,
            message: message.into(),
        }
    }
}

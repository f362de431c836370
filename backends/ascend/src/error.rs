//! The Ascend layer's error type: every failing ACL/aclnn call names the function, its status
//! code (with the documented name) and CANN's own message (`aclGetRecentErrMsg`).

use thiserror::Error;

#[derive(Debug, Error)]
pub enum AscendError {
    #[error(transparent)]
    Load(#[from] npu_ffi::LoadError),
    #[error("{call} failed with {code} ({name}): {message}")]
    Call {
        call: &'static str,
        code: i32,
        name: &'static str,
        message: String,
    },
    #[error("CANN {found} is older than {minimum}, the oldest release this backend supports; install CANN {minimum} or newer and `source` its set_env.sh")]
    TooOld { found: String, minimum: String },
    #[error("could not determine the CANN version ({0}); set ASCEND_HOME_PATH to the install (it holds version.cfg)")]
    UnknownVersion(String),
    #[error("device {requested} (start_device_id {start} + agent {agent}) does not exist: {visible} device(s) visible{hint}")]
    NoSuchDevice {
        requested: u32,
        start: u32,
        agent: u32,
        visible: u32,
        hint: String,
    },
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("the Ascend runtime could not start: {message}")]
    Unavailable {
        missing_library: bool,
        message: String,
    },
}

pub type Result<T> = std::result::Result<T, AscendError>;

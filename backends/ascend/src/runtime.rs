//! The process-wide ACL runtime: CANN's libraries are loaded and `aclInit` is called once per
//! process (ACL allows one `aclInit`), the CANN version is read, logged and refused when older
//! than [`crate::version::MINIMUM`]. Every call's status goes through [`Acl::check`], which turns a
//! failure into an error naming the call, the documented status name and CANN's own message.
//! `NPU_SERVING_ACL_LOG=1` logs every ACL/aclnn call with its shapes and dtypes (target
//! `npu_serving::acl`), for whoever first runs the backend on hardware.

use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use npu_ffi::{AscendApi, SearchPaths};
use tracing::info;

use crate::error::{AscendError, Result};
use crate::version::{self, CannVersion};

pub struct Acl {
    pub api: AscendApi,
    pub version: CannVersion,
    pub log_calls: bool,
    /// The SoC's name (`aclrtGetSocName`, read once after `aclInit`); None when the release
    /// lacks the call or it answered null.
    pub soc_name: Option<String>,
}

/// Why the runtime could not start: (a library or symbol was missing, the message).
type StartFailure = (bool, String);

static ACL: OnceLock<std::result::Result<Acl, StartFailure>> = OnceLock::new();
static FINALIZED: AtomicBool = AtomicBool::new(false);

impl Acl {
    /// Loads CANN from `paths` and initialises ACL, once per process; later calls return the
    /// same runtime (or the same error).
    pub fn init(paths: &SearchPaths) -> Result<&'static Acl> {
        if FINALIZED.load(Ordering::SeqCst) {
            return Err(AscendError::Unavailable {
                missing_library: false,
                message: "the Ascend runtime was finalized (aclFinalize) in this process".into(),
            });
        }
        ACL.get_or_init(|| {
            Self::start(paths).map_err(|e| (matches!(e, AscendError::Load(_)), e.to_string()))
        })
        .as_ref()
        .map_err(|(missing_library, e)| AscendError::Unavailable {
            missing_library: *missing_library,
            message: e.clone(),
        })
    }

    /// Releases ACL (`aclFinalize`) once, at process exit, after every device of the process is
    /// closed; a no-op when ACL never started. The runtime cannot start again afterwards.
    pub fn finalize() -> Result<()> {
        if FINALIZED.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        match ACL.get() {
            Some(Ok(acl)) => {
                acl.log("aclFinalize", String::new);
                // SAFETY: called once; every context and stream of this process is closed.
                acl.check("aclFinalize", unsafe { (acl.api.rt.aclFinalize)() })
            }
            _ => Ok(()),
        }
    }

    /// [`Acl::init`] from the environment (`ASCEND_HOME_PATH`, `ASCEND_TOOLKIT_HOME`,
    /// `LD_LIBRARY_PATH`, default install paths).
    pub fn from_env() -> Result<&'static Acl> {
        Self::init(&SearchPaths::from_env())
    }

    fn start(paths: &SearchPaths) -> Result<Acl> {
        let api = AscendApi::load(paths)?;
        let log_calls =
            std::env::var("NPU_SERVING_ACL_LOG").is_ok_and(|v| v != "0" && !v.is_empty());
        let acl = Acl {
            api,
            version: MINIMUM_PLACEHOLDER,
            log_calls,
            soc_name: None,
        };
        // The operator package variables set_env.sh exports, where only the root was given.
        let env = npu_ffi::complete_environment(acl.api.root.as_deref())?;
        for (var, value) in &env.set {
            info!(target: "npu_serving::acl", "{var} was not set (CANN's set_env.sh not sourced): set to {}", value.display());
        }
        if let Some(dir) = &env.tiling_dir_missing_from_ld_path {
            tracing::warn!(
                target: "npu_serving::acl",
                "the op-tiling library directory {} is not on LD_LIBRARY_PATH, where CANN's set_env.sh puts it; if operators fail to find their tiling, source set_env.sh",
                dir.display()
            );
        }
        // SAFETY: aclInit with a null config path is the documented default initialisation.
        acl.check("aclInit", unsafe { (acl.api.rt.aclInit)(std::ptr::null()) })?;
        let version = acl.read_version()?;
        info!(target: "npu_serving::acl", "CANN {version} loaded from {:?}", acl.api.library_paths);
        version.check_supported()?;
        let soc_name = acl.read_soc_name();
        info!(target: "npu_serving::acl", "SoC: {}", soc_name.as_deref().unwrap_or("unknown (no aclrtGetSocName)"));
        Ok(Acl {
            version,
            soc_name,
            ..acl
        })
    }

    /// `aclrtGetSocName()`, copied out (the string belongs to ACL).
    fn read_soc_name(&self) -> Option<String> {
        let get = self.api.rt.aclrtGetSocName?;
        // SAFETY: no arguments; ACL is initialised.
        let p = unsafe { get() };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-null, and ACL documents a NUL-terminated string that lives as long as
        // the process; it is copied at once.
        let name = unsafe { std::ffi::CStr::from_ptr(p) };
        Some(name.to_string_lossy().into_owned())
    }

    /// Whether the SoC is an Atlas A3 (its names begin `Ascend910_93`), where the pages of
    /// aclnnMatmulAllReduce and aclnnWeightQuantMatmulAllReduce say they are not supported.
    pub fn is_atlas_a3(&self) -> bool {
        self.soc_name.as_deref().is_some_and(is_atlas_a3_soc)
    }

    /// The installed version: `aclsysGetVersionStr("runtime")` (CANN 8.5+), else the deprecated
    /// `aclsysGetCANNVersion`, else the install's version files.
    fn read_version(&self) -> Result<CannVersion> {
        if let Some(v) = self.version_by_package() {
            return Ok(v);
        }
        if let Some(get) = self.api.rt.aclsysGetCANNVersion {
            // SAFETY: all-zero bytes are a valid aclCANNPackageVersion (char arrays).
            let mut v: npu_ffi::types::aclCANNPackageVersion = unsafe { std::mem::zeroed() };
            // SAFETY: `v` is a valid out-pointer of the documented struct.
            let rc = unsafe { get(npu_ffi::types::ACL_PKG_NAME_CANN, &mut v) };
            if rc == 0 {
                // SAFETY: the runtime wrote a NUL-terminated string into the zeroed array.
                let s = unsafe { CStr::from_ptr(v.version.as_ptr()) }
                    .to_string_lossy()
                    .into_owned();
                if let Some(parsed) = CannVersion::parse(&s) {
                    return Ok(parsed);
                }
            }
        }
        let root = self.api.root.clone();
        root.as_deref()
            .and_then(version::from_install)
            .ok_or_else(|| {
                AscendError::UnknownVersion(format!(
                    "no aclsysGetVersionStr or aclsysGetCANNVersion and no version file under {root:?}"
                ))
            })
    }

    /// The runtime package's version through the entry points of CANN 8.5 and later (`None`
    /// without them, when they fail, or when the string is not a CANN release name of 8.x or
    /// later — older packages' `version.info` numbered themselves differently).
    fn version_by_package(&self) -> Option<CannVersion> {
        let get = self.api.rt.aclsysGetVersionStr?;
        let mut pkg = *b"runtime\0";
        let mut buf = [0 as std::ffi::c_char; npu_ffi::types::ACL_PKG_VERSION_MAX_SIZE];
        // SAFETY: a NUL-terminated package name and a buffer of ACL_PKG_VERSION_MAX_SIZE bytes,
        // the size the page asks for.
        let rc = unsafe { get(pkg.as_mut_ptr().cast(), buf.as_mut_ptr()) };
        if rc != 0 {
            return None;
        }
        buf[buf.len() - 1] = 0;
        // SAFETY: NUL-terminated within the buffer (the last byte forced to NUL).
        let s = unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let v = CannVersion::parse(&s).filter(|v| v.major >= 8)?;
        if let Some(num) = self.api.rt.aclsysGetVersionNum {
            let mut n = 0i32;
            // SAFETY: as above; `n` is a valid out-pointer.
            if unsafe { num(pkg.as_mut_ptr().cast(), &mut n) } == 0 {
                info!(target: "npu_serving::acl", "CANN runtime package {s} (version number {n})");
            }
        }
        Some(v)
    }

    /// CANN's most recent error message on this thread.
    pub fn last_message(&self) -> String {
        // SAFETY: aclGetRecentErrMsg takes no arguments and returns null or a NUL-terminated string.
        let p = unsafe { (self.api.rt.aclGetRecentErrMsg)() };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated, owned by the runtime until the next call on this thread.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Turns an ACL/aclnn status into a result.
    pub fn check(&self, call: &'static str, code: i32) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        Err(AscendError::Call {
            call,
            code,
            name: npu_ffi::types::status_name(code),
            message: self.last_message(),
        })
    }

    /// Logs one call when `NPU_SERVING_ACL_LOG` is set.
    pub fn log(&self, call: &str, detail: impl FnOnce() -> String) {
        if self.log_calls {
            info!(target: "npu_serving::acl", "{call} {}", detail());
        }
    }
}

/// Placeholder until the version is read (never escapes `start`).
const MINIMUM_PLACEHOLDER: CannVersion = version::MINIMUM;

/// Whether an `aclrtGetSocName` answer is an Atlas A3 chip ("Ascend910_93…"; the A2 series is
/// "Ascend910B…", the 310P "Ascend310P…").
pub fn is_atlas_a3_soc(name: &str) -> bool {
    name.starts_with("Ascend910_93")
}

#[cfg(test)]
mod soc_tests {
    use super::is_atlas_a3_soc;

    #[test]
    fn atlas_a3_names_are_told_from_a2_ones() {
        for a3 in [
            "Ascend910_9391",
            "Ascend910_9392",
            "Ascend910_9381",
            "Ascend910_9362",
        ] {
            assert!(is_atlas_a3_soc(a3), "{a3}");
        }
        for other in [
            "Ascend910B1",
            "Ascend910B3",
            "Ascend910B4-1",
            "Ascend310P3",
            "Ascend910A",
            "",
        ] {
            assert!(!is_atlas_a3_soc(other), "{other}");
        }
    }
}

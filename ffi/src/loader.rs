//! Finds and loads CANN's libraries at run time: `libascendcl.so`, `libnnopbase.so`,
//! `libopapi.so` (required) and, in the split packaging of newer releases,
//! `libopapi_transformer.so` / `libopapi_nn.so` / `libopapi_math.so` (optional), then resolves
//! the declared prototypes into function-pointer tables.
//!
//! Search order: `$ASCEND_HOME_PATH`, `$ASCEND_TOOLKIT_HOME` (each as the install root itself,
//! and as a parent holding `ascend-toolkit/latest` — CANN ≤ 8.3 — or `cann` — CANN 8.5+), then the
//! directories of `$LD_LIBRARY_PATH`, then the default roots `/usr/local/Ascend/ascend-toolkit/latest`
//! and `/usr/local/Ascend/cann`. Under a root the libraries live in `lib64/`,
//! `<arch>-linux/lib64/`, `runtime/lib64/` and (`libopapi*`) `opp/built-in/op_impl/ai_core/tbe/op_api/lib/linux/<arch>/`.
//!
//! Loading is not all of CANN's environment: [`complete_environment`] sets the operator-package
//! variables `set_env.sh` would have exported (or refuses) before `aclInit`.

use std::path::{Path, PathBuf};

use libloading::Library;
use thiserror::Error;

use crate::acl_rt::AclRuntimeApi;
use crate::aclnn::base::AclnnBaseApi;
use crate::aclnn::ops::AclnnOpsApi;

const SET_ENV_HINT: &str = "install CANN 8.x (toolkit and kernels) and run `source /usr/local/Ascend/ascend-toolkit/set_env.sh` (CANN 8.3 and older) or `source /usr/local/Ascend/cann/set_env.sh` (CANN 8.5 and newer) — or set ASCEND_HOME_PATH to the install";

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("CANN library {library} not found (searched: {searched}); {hint}", searched = .searched.join(", "), hint = SET_ENV_HINT)]
    MissingLibrary {
        library: &'static str,
        searched: Vec<String>,
    },
    #[error("CANN library {path} could not be loaded: {reason}; {hint}", hint = SET_ENV_HINT)]
    Unloadable { path: String, reason: String },
    #[error("symbol {symbol} not found in {libraries:?}: this CANN release lacks it (a newer CANN is needed) or the environment mixes releases; {hint}", hint = SET_ENV_HINT)]
    MissingSymbol {
        symbol: &'static str,
        libraries: Vec<String>,
    },
    #[error("ASCEND_OPP_PATH is not set and {reason}: CANN's operators find their kernels and tiling libraries through the variables set_env.sh exports; {hint}", hint = SET_ENV_HINT)]
    MissingEnvironment { reason: String },
}

/// The operator package directory under an install root (`set_env.sh`: `ASCEND_OPP_PATH`).
pub const OPP_DIR: &str = "opp";

/// The tiling libraries' directory under the operator package, which `set_env.sh` puts on
/// `LD_LIBRARY_PATH`.
pub fn op_tiling_dir(opp: &Path) -> PathBuf {
    opp.join(format!(
        "built-in/op_impl/ai_core/tbe/op_tiling/lib/linux/{}",
        std::env::consts::ARCH
    ))
}

/// What [`complete_environment`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvCompletion {
    /// Variables it set, with their values (empty when `set_env.sh` had been sourced).
    pub set: Vec<(&'static str, PathBuf)>,
    /// The tiling library directory, when it exists and is not on `LD_LIBRARY_PATH` (which
    /// cannot change for a running process: the dynamic loader read it at start).
    pub tiling_dir_missing_from_ld_path: Option<PathBuf>,
}

/// Before `aclInit`: CANN's `set_env.sh` exports `ASCEND_OPP_PATH` (`<root>/opp`, the operator
/// package with kernels and tiling libraries) and `ASCEND_AICPU_PATH` (`<root>`) besides the
/// library paths, and aclnn finds kernels through them. When `ASCEND_OPP_PATH` is unset (only
/// `ASCEND_HOME_PATH` given), both are set from `root`, the install the libraries were loaded
/// from, if it has an operator package; otherwise the start is refused naming `set_env.sh`. A
/// set `ASCEND_OPP_PATH` is left alone (and `ASCEND_AICPU_PATH` with it).
///
/// It changes the process environment: call it once, at start-up, before other threads read
/// the environment (the runtime calls it from `Acl::init`, before `aclInit`).
pub fn complete_environment(root: Option<&Path>) -> Result<EnvCompletion, LoadError> {
    let mut done = EnvCompletion::default();
    let opp = match std::env::var_os("ASCEND_OPP_PATH").filter(|v| !v.is_empty()) {
        Some(v) => PathBuf::from(v),
        None => {
            let Some(root) = root else {
                return Err(LoadError::MissingEnvironment {
                    reason: "the libraries were not found under an install root to derive it from"
                        .into(),
                });
            };
            let opp = root.join(OPP_DIR);
            if !opp.is_dir() {
                return Err(LoadError::MissingEnvironment {
                    reason: format!("{} is not a directory", opp.display()),
                });
            }
            std::env::set_var("ASCEND_OPP_PATH", &opp);
            done.set.push(("ASCEND_OPP_PATH", opp.clone()));
            if std::env::var_os("ASCEND_AICPU_PATH").is_none_or(|v| v.is_empty()) {
                std::env::set_var("ASCEND_AICPU_PATH", root);
                done.set.push(("ASCEND_AICPU_PATH", root.to_path_buf()));
            }
            opp
        }
    };
    let tiling = op_tiling_dir(&opp);
    let on_path = std::env::var_os("LD_LIBRARY_PATH")
        .is_some_and(|v| std::env::split_paths(&v).any(|d| d == tiling));
    if tiling.is_dir() && !on_path {
        done.tiling_dir_missing_from_ld_path = Some(tiling);
    }
    Ok(done)
}

/// The install roots to search, in order, and the directories of `LD_LIBRARY_PATH`.
#[derive(Debug, Clone, Default)]
pub struct SearchPaths {
    pub roots: Vec<PathBuf>,
    pub extra_dirs: Vec<PathBuf>,
}

impl SearchPaths {
    /// From the environment (`ASCEND_HOME_PATH`, `ASCEND_TOOLKIT_HOME`, `LD_LIBRARY_PATH`) and the
    /// default install locations.
    pub fn from_env() -> Self {
        let mut roots = Vec::new();
        for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
            if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
                roots.extend(expand_root(Path::new(&v)));
            }
        }
        let extra_dirs = std::env::var_os("LD_LIBRARY_PATH")
            .map(|v| {
                std::env::split_paths(&v)
                    .filter(|p| !p.as_os_str().is_empty())
                    .collect()
            })
            .unwrap_or_default();
        for default in [
            "/usr/local/Ascend/ascend-toolkit/latest",
            "/usr/local/Ascend/cann",
        ] {
            roots.push(PathBuf::from(default));
        }
        Self { roots, extra_dirs }
    }

    /// Only the given root (for tests and tools that point at one install).
    pub fn root(root: &Path) -> Self {
        Self {
            roots: expand_root(root),
            extra_dirs: Vec::new(),
        }
    }

    /// Every directory a library may be in, in search order.
    pub fn library_dirs(&self) -> Vec<PathBuf> {
        let arch = std::env::consts::ARCH;
        let mut dirs = Vec::new();
        for r in &self.roots {
            for sub in [
                "lib64".to_string(),
                format!("{arch}-linux/lib64"),
                "runtime/lib64".to_string(),
                format!("opp/built-in/op_impl/ai_core/tbe/op_api/lib/linux/{arch}"),
            ] {
                dirs.push(r.join(sub));
            }
        }
        dirs.extend(self.extra_dirs.iter().cloned());
        let mut seen = std::collections::HashSet::new();
        dirs.retain(|d| seen.insert(d.clone()));
        dirs
    }

    /// The first path of `file` among the library directories.
    pub fn find(&self, file: &str) -> Option<PathBuf> {
        self.library_dirs()
            .into_iter()
            .map(|d| d.join(file))
            .find(|p| p.is_file())
    }
}

/// A root given by the user may be the install itself or its parent
/// (`…/Ascend` holding `ascend-toolkit/latest` or `cann`).
fn expand_root(root: &Path) -> Vec<PathBuf> {
    vec![
        root.to_path_buf(),
        root.join("ascend-toolkit/latest"),
        root.join("latest"),
        root.join("cann"),
    ]
}

/// The loaded libraries and their resolved entry points. Libraries stay loaded for the life of
/// the process (CANN does not support being unloaded).
pub struct AscendApi {
    pub rt: AclRuntimeApi,
    pub base: AclnnBaseApi,
    pub ops: AclnnOpsApi,
    /// Path of each loaded library.
    pub library_paths: Vec<PathBuf>,
    /// The install root `libascendcl.so` was found under, if it was found under one.
    pub root: Option<PathBuf>,
    _libraries: Vec<Library>,
}

impl std::fmt::Debug for AscendApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AscendApi")
            .field("library_paths", &self.library_paths)
            .field("root", &self.root)
            .finish()
    }
}

fn open(path: &Path) -> Result<Library, LoadError> {
    // SAFETY: loading a CANN library runs its initialisers; these are the vendor's (or the
    // emulation's) libraries named by the user's environment, loaded once per process.
    unsafe { Library::new(path) }.map_err(|e| LoadError::Unloadable {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

impl AscendApi {
    /// Loads the libraries found through `paths` and resolves every declared symbol.
    pub fn load(paths: &SearchPaths) -> Result<Self, LoadError> {
        let searched: Vec<String> = paths
            .library_dirs()
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        let need = |file: &'static str| {
            paths.find(file).ok_or_else(|| LoadError::MissingLibrary {
                library: file,
                searched: searched.clone(),
            })
        };
        let acl_path = need("libascendcl.so")?;
        let nnop_path = need("libnnopbase.so")?;
        let opapi_path = need("libopapi.so")?;
        let split: Vec<PathBuf> = [
            "libopapi_transformer.so",
            "libopapi_nn.so",
            "libopapi_math.so",
        ]
        .iter()
        .filter_map(|f| paths.find(f))
        .collect();

        let acl = open(&acl_path)?;
        let nnop = open(&nnop_path)?;
        let opapi = open(&opapi_path)?;
        let split_libs: Vec<Library> = split.iter().map(|p| open(p)).collect::<Result<_, _>>()?;

        let name = |p: &Path| p.display().to_string();
        // SAFETY: each table's declarations are the documented prototypes of these libraries.
        let rt = unsafe { AclRuntimeApi::load(&[(name(&acl_path), &acl)])? };
        // SAFETY: as above.
        let base = unsafe { AclnnBaseApi::load(&[(name(&nnop_path), &nnop)])? };
        let mut op_libs = vec![(name(&opapi_path), &opapi)];
        op_libs.extend(
            split
                .iter()
                .zip(split_libs.iter())
                .map(|(p, l)| (name(p), l)),
        );
        // SAFETY: as above.
        let ops = unsafe { AclnnOpsApi::load(&op_libs)? };

        let root = paths
            .roots
            .iter()
            .find(|r| acl_path.starts_with(r) && r.is_dir())
            .cloned();
        let mut library_paths = vec![acl_path, nnop_path, opapi_path];
        library_paths.extend(split);
        let mut libraries = vec![acl, nnop, opapi];
        libraries.extend(split_libs);
        Ok(Self {
            rt,
            base,
            ops,
            library_paths,
            root,
            _libraries: libraries,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The variables are process-wide: one test changes them, start to end.
    #[test]
    fn the_operator_package_variables_come_from_the_root_or_the_start_is_refused() {
        let base = std::env::temp_dir().join(format!("npu-ffi-env-{}", std::process::id()));
        let root = base.join("cann");
        std::fs::create_dir_all(op_tiling_dir(&root.join(OPP_DIR))).unwrap();
        let bare = base.join("bare");
        std::fs::create_dir_all(&bare).unwrap();
        std::env::remove_var("ASCEND_OPP_PATH");
        std::env::remove_var("ASCEND_AICPU_PATH");

        // No operator package under the root, or no root: refused, naming set_env.sh.
        for r in [Some(bare.as_path()), None] {
            let e = complete_environment(r).unwrap_err().to_string();
            assert!(
                e.contains("ASCEND_OPP_PATH") && e.contains("set_env.sh"),
                "{e}"
            );
            assert!(std::env::var_os("ASCEND_OPP_PATH").is_none());
        }

        // Only the root known (ASCEND_HOME_PATH alone): both variables set from it.
        let done = complete_environment(Some(&root)).unwrap();
        assert_eq!(
            done.set,
            vec![
                ("ASCEND_OPP_PATH", root.join(OPP_DIR)),
                ("ASCEND_AICPU_PATH", root.clone())
            ]
        );
        assert_eq!(
            std::env::var_os("ASCEND_OPP_PATH").map(PathBuf::from),
            Some(root.join(OPP_DIR))
        );
        assert_eq!(
            std::env::var_os("ASCEND_AICPU_PATH").map(PathBuf::from),
            Some(root.clone())
        );
        assert_eq!(
            done.tiling_dir_missing_from_ld_path,
            Some(op_tiling_dir(&root.join(OPP_DIR)))
        );

        // As set_env.sh left them: nothing changes, whatever the root.
        let again = complete_environment(Some(&bare)).unwrap();
        assert!(again.set.is_empty());
        assert_eq!(
            std::env::var_os("ASCEND_OPP_PATH").map(PathBuf::from),
            Some(root.join(OPP_DIR))
        );
        std::env::remove_var("ASCEND_OPP_PATH");
        std::env::remove_var("ASCEND_AICPU_PATH");
        std::fs::remove_dir_all(&base).unwrap();
    }
}

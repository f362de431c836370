//! The GGUF reader and writer against the real default model: rewriting it with the writer
//! reproduces the file byte for byte, and copies truncated in every section fail with the right
//! error. The model comes from `model_store::resolve_model(None)` (fetched if absent).

use std::fs;
use std::path::{Path, PathBuf};

use npu_gguf::store::resolve_model;
use npu_gguf::writer::{GgufLayout, GgufWriter, TensorSpec};
use npu_gguf::{GgufError, GgufFile};

fn real_model() -> PathBuf {
    resolve_model(None).unwrap_or_else(|e| panic!("the real model is needed: {e}"))
}

struct TestDir(PathBuf);

impl TestDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("npu-gguf-{tag}-{}", std::process::id()));
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

/// A writer holding everything the reader found in `f`.
fn rewrite(f: &GgufFile) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.version = f.version;
    for key in f.keys() {
        w.add_meta(key.clone(), f.get(key).unwrap().clone());
    }
    if let Some(a) = f.get_u64("general.alignment") {
        w.alignment = a;
    }
    for t in f.tensors() {
        w.add_tensor_spec(TensorSpec {
            name: t.name.clone(),
            dims: t.dims.clone(),
            type_id: t.ty.id(),
            data: f.tensor_data(t).to_vec(),
            offset: None,
        });
    }
    w
}

fn layout_of_real_model() -> (PathBuf, Vec<u8>, GgufLayout) {
    let path = real_model();
    let f = GgufFile::open(&path).unwrap();
    let (bytes, layout) = rewrite(&f).to_bytes_with_layout().unwrap();
    (path, bytes, layout)
}

#[test]
fn rewriting_the_real_model_reproduces_it_exactly() {
    let (path, bytes, layout) = layout_of_real_model();
    let original = fs::read(&path).unwrap();
    assert_eq!(bytes.len(), original.len());
    if bytes != original {
        let i = bytes.iter().zip(&original).position(|(a, b)| a != b);
        panic!("rewritten file differs from the original first at byte {i:?} ({layout:?})");
    }
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.get_str("general.architecture"), Some("llama"));
    assert_eq!(
        f.tensors().iter().map(|t| t.offset).collect::<Vec<_>>(),
        layout.tensor_data
    );
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens")
            .unwrap()
            .unwrap()
            .len(),
        49_152
    );
}

#[test]
fn truncated_copies_of_the_real_model_fail_cleanly() {
    let (path, _, layout) = layout_of_real_model();
    let original = fs::read(&path).unwrap();
    let dir = TestDir::new("real-trunc");
    let copy = dir.path().join("cut.gguf");

    // The entry of the token list: cut inside it soon after its start and deep inside.
    let f = GgufFile::open(&path).unwrap();
    let tokens_entry = f
        .keys()
        .iter()
        .position(|k| k == "tokenizer.ggml.tokens")
        .map(|i| layout.metadata_entries[i])
        .unwrap();
    let mid_info = layout.tensor_infos[layout.tensor_infos.len() / 2];
    let last_data = *layout.tensor_data.last().unwrap();
    let cuts = [
        (0, "header"),
        (3, "header"),
        (6, "header"),
        (20, "header"),
        (layout.metadata_entries[1] + 3, "metadata"),
        (tokens_entry + 40, "metadata"),
        (tokens_entry + 300_000, "metadata"),
        (layout.tensor_infos_start - 1, "metadata"),
        (layout.tensor_infos_start + 5, "tensor infos"),
        (mid_info + 11, "tensor infos"),
        (layout.tensor_infos_end - 1, "tensor infos"),
        (layout.data_start, "data"),
        (layout.data_start + 1000, "data"),
        (layout.file_len / 2, "data"),
        (last_data + 1, "data"),
        (layout.file_len - 1, "data"),
    ];
    for (cut, section) in cuts {
        fs::write(&copy, &original[..cut as usize]).unwrap();
        match GgufFile::open(&copy) {
            Err(GgufError::Truncated { len, what, .. }) => {
                assert_eq!(len, cut);
                if section == "data" {
                    assert!(what.starts_with("data of tensor"), "cut {cut}: {what}");
                }
            }
            Err(GgufError::Corrupt { what, .. })
                if section == "metadata" && what.contains("cannot fit") => {}
            Err(e) => panic!("cut at {cut} ({section}): unexpected error {e}"),
            Ok(_) => panic!("cut at {cut} ({section}) opened"),
        }
    }
}

//! The crate's tests: safetensors images parsed in memory (`parse`), model directories written
//! to temporary directories and opened (`shards`), hub-cache resolution over fake cache layouts
//! (`hub`), generation configs (`generation`), and properties of the parser (`props`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::writer::WriteTensor;
use crate::Dtype;

mod generation;
mod hub;
mod parse;
mod props;
mod shards;

/// A directory under the system temp dir, unique to this process and call, removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("npu-hf-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A safetensors image from a header given as text and the data region.
pub(crate) fn image(header: &str, data: &[u8]) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(data);
    v
}

/// The error message of `r`, which must be an error.
pub(crate) fn err<T: std::fmt::Debug>(r: Result<T, crate::HfError>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

/// Owned tensors for tests: name, dtype, shape, data (a pattern that differs per tensor).
pub(crate) struct Owned(pub Vec<(String, Dtype, Vec<usize>, Vec<u8>)>);

impl Owned {
    pub(crate) fn sample() -> Self {
        let mut v = Vec::new();
        let specs: [(&str, Dtype, &[usize]); 5] = [
            ("model.embed_tokens.weight", Dtype::BF16, &[16, 8]),
            (
                "model.layers.0.self_attn.q_proj.weight",
                Dtype::F16,
                &[8, 8],
            ),
            ("model.layers.0.mlp.up_proj.weight", Dtype::F32, &[8, 4]),
            ("model.norm.weight", Dtype::F32, &[8]),
            ("lm_head.weight", Dtype::U8, &[3, 5]),
        ];
        for (i, (name, dtype, shape)) in specs.into_iter().enumerate() {
            let len = shape.iter().product::<usize>() * dtype.size();
            let data = (0..len).map(|j| (j * 7 + i * 31) as u8).collect();
            v.push((name.to_string(), dtype, shape.to_vec(), data));
        }
        Owned(v)
    }
    pub(crate) fn views(&self) -> Vec<WriteTensor<'_>> {
        self.0
            .iter()
            .map(|(n, d, s, data)| WriteTensor {
                name: n,
                dtype: *d,
                shape: s,
                data,
            })
            .collect()
    }
}

//! A safetensors writer for tools and tests: one file (`write_file`), or a model directory laid
//! out as Hugging Face's `save_pretrained` lays it out (`write_model`: `model.safetensors`, or
//! `model-0000K-of-0000N.safetensors` shards with `model.safetensors.index.json`).
//!
//! The header is written by hand (not through a JSON map) so that its keys keep the given order:
//! `__metadata__` first, then the tensors in the order given, their data in the same order.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::safetensors::Dtype;
use crate::HfError;

/// One tensor to write: `data` must be exactly `shape`'s element count times `dtype.size()`.
#[derive(Debug, Clone, Copy)]
pub struct WriteTensor<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// The file name of a model that fits one file.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded model.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The name `save_pretrained` gives shard `k` (1-based) of `n`.
pub fn shard_file_name(k: usize, n: usize) -> String {
    format!("model-{k:05}-of-{n:05}.safetensors")
}

/// Builds the header bytes (the JSON, padded with spaces to a multiple of 8 bytes as the
/// reference implementation pads it) for `tensors` laid out back to back in the given order.
pub fn header_bytes(
    path: &Path,
    tensors: &[WriteTensor],
    metadata: &[(&str, &str)],
) -> Result<Vec<u8>, HfError> {
    check(path, tensors, metadata)?;
    let mut h = String::from("{");
    let mut first = true;
    if !metadata.is_empty() {
        h.push_str("\"__metadata__\":{");
        for (i, (k, v)) in metadata.iter().enumerate() {
            if i > 0 {
                h.push(',');
            }
            h.push_str(&json_string(k));
            h.push(':');
            h.push_str(&json_string(v));
        }
        h.push('}');
        first = false;
    }
    let mut offset = 0usize;
    for t in tensors {
        if !first {
            h.push(',');
        }
        first = false;
        let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        let end = offset + t.data.len();
        h.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            json_string(t.name),
            t.dtype.name(),
            shape.join(",")
        ));
        offset = end;
    }
    h.push('}');
    let mut bytes = h.into_bytes();
    let pad = (8 - bytes.len() % 8) % 8;
    bytes.resize(bytes.len() + pad, b' ');
    Ok(bytes)
}

/// Writes one safetensors file: the 8-byte little-endian header length, the header (padded with
/// spaces to 8-byte alignment), then the tensors' data in the given order.
pub fn write_file(
    path: &Path,
    tensors: &[WriteTensor],
    metadata: &[(&str, &str)],
) -> Result<(), HfError> {
    let header = header_bytes(path, tensors, metadata)?;
    let file = File::create(path).map_err(|e| HfError::io("creating", path, e))?;
    let mut w = BufWriter::new(file);
    let write_all = |w: &mut BufWriter<File>| -> std::io::Result<()> {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for t in tensors {
            w.write_all(t.data)?;
        }
        w.flush()
    };
    write_all(&mut w).map_err(|e| HfError::io("writing", path, e))
}

/// Writes `tensors` into `dir` (created when missing) as `save_pretrained` would: one
/// `model.safetensors` when `max_shard_bytes` is `None` or the data fits in it; otherwise shards
/// `model-00001-of-0000N.safetensors` filled greedily in the given order (a shard is closed when
/// the next tensor would take it past the limit; a tensor larger than the limit gets a shard of
/// its own) plus `model.safetensors.index.json` with `metadata.total_size` (the sum of the
/// tensors' data bytes) and `weight_map`. Each file carries the metadata `{"format": "pt"}` as
/// the transformers library writes it. A `model.safetensors`, an index or `model-*-of-*` shards
/// left in `dir` by an earlier write are removed first, so the directory holds one model.
pub fn write_model(
    dir: &Path,
    tensors: &[WriteTensor],
    max_shard_bytes: Option<u64>,
) -> Result<(), HfError> {
    const META: &[(&str, &str)] = &[("format", "pt")];
    check(&dir.join(SINGLE_FILE), tensors, META)?;
    std::fs::create_dir_all(dir).map_err(|e| HfError::io("creating directory", dir, e))?;
    remove_earlier_model(dir)?;

    let groups = match max_shard_bytes {
        None => vec![tensors.to_vec()],
        Some(limit) => split(tensors, limit),
    };
    if groups.len() <= 1 {
        return write_file(&dir.join(SINGLE_FILE), tensors, META);
    }
    let n = groups.len();
    let mut weight_map = serde_json::Map::new();
    let mut total: u64 = 0;
    for (i, group) in groups.iter().enumerate() {
        let name = shard_file_name(i + 1, n);
        write_file(&dir.join(&name), group, META)?;
        for t in group {
            weight_map.insert(t.name.to_string(), serde_json::Value::String(name.clone()));
            total += t.data.len() as u64;
        }
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    let index_path = dir.join(INDEX_FILE);
    let mut text = serde_json::to_string_pretty(&index).map_err(|e| HfError::Write {
        path: index_path.clone(),
        what: e.to_string(),
    })?;
    text.push('\n');
    std::fs::write(&index_path, text).map_err(|e| HfError::io("writing", &index_path, e))
}

/// Greedy split in order: a new shard starts when the next tensor would take the current one
/// past `limit`; a tensor larger than `limit` sits alone.
fn split<'a>(tensors: &[WriteTensor<'a>], limit: u64) -> Vec<Vec<WriteTensor<'a>>> {
    let mut groups: Vec<Vec<WriteTensor<'a>>> = Vec::new();
    let mut current: Vec<WriteTensor<'a>> = Vec::new();
    let mut size: u64 = 0;
    for t in tensors {
        let len = t.data.len() as u64;
        if !current.is_empty() && size.saturating_add(len) > limit {
            groups.push(std::mem::take(&mut current));
            size = 0;
        }
        current.push(*t);
        size = size.saturating_add(len);
    }
    if !current.is_empty() {
        groups.push(current);
    }
    groups
}

/// Removes what an earlier `write_model` (or `save_pretrained`) left: `model.safetensors`, the
/// index, and files named `model-NNNNN-of-NNNNN.safetensors`.
fn remove_earlier_model(dir: &Path) -> Result<(), HfError> {
    let entries = std::fs::read_dir(dir).map_err(|e| HfError::io("listing", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| HfError::io("listing", dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name == SINGLE_FILE || name == INDEX_FILE || is_shard_name(name) {
            let p = entry.path();
            std::fs::remove_file(&p).map_err(|e| HfError::io("removing", &p, e))?;
        }
    }
    Ok(())
}

/// `model-NNNNN-of-NNNNN.safetensors` (five digits each).
pub fn is_shard_name(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let b = rest.as_bytes();
    b.len() == 14
        && b[..5].iter().all(u8::is_ascii_digit)
        && &b[5..9] == b"-of-"
        && b[9..].iter().all(u8::is_ascii_digit)
}

/// The checks a reader would make: known sizes, unique non-reserved names, data lengths that
/// match the shapes.
fn check(path: &Path, tensors: &[WriteTensor], metadata: &[(&str, &str)]) -> Result<(), HfError> {
    let fail = |what: String| HfError::Write {
        path: path.to_path_buf(),
        what,
    };
    let mut names = std::collections::HashSet::new();
    let mut total: usize = 0;
    for t in tensors {
        total = total
            .checked_add(t.data.len())
            .ok_or_else(|| fail("the tensors' data lengths overflow a byte offset".into()))?;
        if t.name == "__metadata__" {
            return Err(fail(
                "a tensor cannot be named \"__metadata__\" (the header's metadata key)".into(),
            ));
        }
        if !names.insert(t.name) {
            return Err(fail(format!("tensor {:?} is given twice", t.name)));
        }
        let need = t
            .shape
            .iter()
            .try_fold(t.dtype.size(), |acc, &d| acc.checked_mul(d));
        match need {
            Some(n) if n == t.data.len() => {}
            Some(n) => {
                return Err(fail(format!(
                    "tensor {:?}: shape {:?} of {} takes {n} bytes, but {} are given",
                    t.name,
                    t.shape,
                    t.dtype,
                    t.data.len()
                )))
            }
            None => {
                return Err(fail(format!(
                    "tensor {:?}: shape {:?} of {} overflows the byte count",
                    t.name, t.shape, t.dtype
                )))
            }
        }
    }
    let mut keys = std::collections::HashSet::new();
    for (k, _) in metadata {
        if !keys.insert(*k) {
            return Err(fail(format!("metadata key {k:?} is given twice")));
        }
    }
    Ok(())
}

fn json_string(s: &str) -> String {
    // Serialising a &str cannot fail; the fallback is unreachable but keeps this panic-free.
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_padded_and_ordered() {
        let a = [1u8, 2, 3, 4];
        let b = [5u8, 6];
        let ts = [
            WriteTensor {
                name: "z",
                dtype: Dtype::F32,
                shape: &[1],
                data: &a,
            },
            WriteTensor {
                name: "a",
                dtype: Dtype::BF16,
                shape: &[1, 1],
                data: &b,
            },
        ];
        let h = header_bytes(Path::new("x"), &ts, &[("format", "pt")]).unwrap();
        assert_eq!(h.len() % 8, 0);
        let text = std::str::from_utf8(&h).unwrap();
        assert!(text.starts_with(
            r#"{"__metadata__":{"format":"pt"},"z":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"BF16","shape":[1,1],"data_offsets":[4,6]}}"#
        ));
        assert!(text.trim_end_matches(' ').ends_with('}'));
    }

    #[test]
    fn refuses_mismatched_data() {
        let a = [1u8, 2, 3];
        let ts = [WriteTensor {
            name: "t",
            dtype: Dtype::F32,
            shape: &[1],
            data: &a,
        }];
        let e = header_bytes(Path::new("x"), &ts, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("takes 4 bytes, but 3 are given"), "{e}");
    }

    #[test]
    fn shard_names() {
        assert_eq!(shard_file_name(1, 3), "model-00001-of-00003.safetensors");
        assert!(is_shard_name("model-00001-of-00003.safetensors"));
        assert!(!is_shard_name("model-1-of-3.safetensors"));
    }
}

//! The safetensors files of one model directory, memory-mapped and checked together: a single
//! `model.safetensors`, or the shards `model.safetensors.index.json` names, with the index and
//! the shards' headers required to agree tensor for tensor.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapOptions};
use serde::Deserialize;
use serde_json::Value;

use super::{kind, parse, Entries, TensorMeta};
use crate::writer::{INDEX_FILE, SINGLE_FILE};
use crate::HfError;

/// The safetensors shards of a model, memory-mapped; see [`Shards::open`].
pub struct Shards {
    dir: PathBuf,
    files: Vec<ShardFile>,
    /// Sorted by name.
    tensors: Vec<TensorMeta>,
    total: u64,
}

struct ShardFile {
    path: PathBuf,
    map: Mmap,
}

impl std::fmt::Debug for Shards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shards")
            .field("dir", &self.dir)
            .field(
                "files",
                &self.files.iter().map(|s| &s.path).collect::<Vec<_>>(),
            )
            .field("tensors", &self.tensors.len())
            .field("total_bytes", &self.total)
            .finish()
    }
}

/// What `model.safetensors.index.json` holds that is read here (other keys are ignored).
#[derive(Deserialize)]
struct IndexFile {
    weight_map: Option<Entries>,
    #[serde(default)]
    metadata: Option<Value>,
}

impl Shards {
    /// Opens the weights of the model directory `dir`: `model.safetensors` when it exists (as
    /// transformers prefers it), else the shards named by `model.safetensors.index.json`'s
    /// `weight_map`. Every shard the index names must exist (a plain file name inside `dir`),
    /// every tensor it maps must be in the shard it names, and every shard's tensor must be in
    /// the map; a tensor in two shards is an error. `dir` may also be one `.safetensors` file.
    /// With neither file, the error says which files were looked for and lists the
    /// `*.safetensors` (and `*.bin`) files present.
    pub fn open(dir: &Path) -> Result<Self, HfError> {
        if dir.is_file() {
            let parent = dir.parent().unwrap_or(Path::new(".")).to_path_buf();
            return Self::single(parent, dir);
        }
        let single = dir.join(SINGLE_FILE);
        if single.is_file() {
            return Self::single(dir.to_path_buf(), &single);
        }
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Self::sharded(dir, &index);
        }
        if !dir.is_dir() {
            return Err(HfError::io(
                "opening model directory",
                dir,
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ));
        }
        Err(HfError::NoWeights {
            dir: dir.to_path_buf(),
            looked_for: format!("{SINGLE_FILE} and {INDEX_FILE}"),
            present: weight_files(dir),
        })
    }

    fn single(dir: PathBuf, path: &Path) -> Result<Self, HfError> {
        let file = map_and_parse(path, 0)?;
        let (map, mut tensors) = file;
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let total = tensors.iter().map(|t| (t.end - t.start) as u64).sum();
        Ok(Shards {
            dir,
            files: vec![ShardFile {
                path: path.to_path_buf(),
                map,
            }],
            tensors,
            total,
        })
    }

    fn sharded(dir: &Path, index_path: &Path) -> Result<Self, HfError> {
        let bad = |what: String| HfError::Index {
            path: index_path.to_path_buf(),
            what,
        };
        let text = std::fs::read(index_path).map_err(|e| HfError::io("reading", index_path, e))?;
        // Syntax errors first, with their line and column; then the shape of the object.
        crate::parse_json(index_path, &text)?;
        let index: IndexFile = serde_json::from_slice(&text).map_err(|e| HfError::Json {
            path: index_path.to_path_buf(),
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        })?;
        let Some(weight_map) = index.weight_map else {
            return Err(bad("no \"weight_map\" object".into()));
        };
        if let Some(dup) = weight_map.duplicate() {
            return Err(bad(format!(
                "tensor {dup:?} appears twice in \"weight_map\""
            )));
        }
        let mut map: HashMap<&str, &str> = HashMap::with_capacity(weight_map.0.len());
        for (name, v) in &weight_map.0 {
            let Some(file) = v.as_str() else {
                return Err(bad(format!(
                    "\"weight_map\" maps tensor {name:?} to {}, not a file name",
                    kind(v)
                )));
            };
            if !is_plain_file_name(file) {
                return Err(bad(format!(
                    "\"weight_map\" maps tensor {name:?} to {file:?}, which is not a file name in the model directory"
                )));
            }
            map.insert(name, file);
        }
        if map.is_empty() {
            return Err(bad("\"weight_map\" is empty".into()));
        }
        let names: Vec<&str> = map
            .values()
            .copied()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let missing: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| !dir.join(n).is_file())
            .collect();
        if !missing.is_empty() {
            return Err(bad(format!(
                "shards named in \"weight_map\" are missing from {}: {}",
                dir.display(),
                missing.join(", ")
            )));
        }

        let mut files = Vec::with_capacity(names.len());
        let mut tensors: Vec<TensorMeta> = Vec::new();
        for (i, shard_name) in names.iter().enumerate() {
            let path = dir.join(shard_name);
            let (mmap, ts) = map_and_parse(&path, i)?;
            files.push(ShardFile { path, map: mmap });
            tensors.extend(ts);
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        for pair in tensors.windows(2) {
            if pair[0].name == pair[1].name {
                return Err(bad(format!(
                    "tensor {:?} is in two shards: {} and {}",
                    pair[0].name, names[pair[0].shard], names[pair[1].shard]
                )));
            }
        }
        for t in &tensors {
            let here = names[t.shard];
            match map.get(t.name.as_str()) {
                None => {
                    return Err(bad(format!(
                        "tensor {:?} of shard {here} is missing from \"weight_map\"",
                        t.name
                    )))
                }
                Some(&there) if there != here => {
                    return Err(bad(format!(
                        "tensor {:?} is in shard {here}, but \"weight_map\" maps it to {there}",
                        t.name
                    )))
                }
                Some(_) => {}
            }
        }
        // Every shard's tensor is mapped to that shard; a mapped tensor found in none is the
        // remaining disagreement.
        if tensors.len() != map.len() {
            let mut absent: Vec<(&str, &str)> = map
                .iter()
                .filter(|(n, _)| {
                    tensors
                        .binary_search_by(|t| t.name.as_str().cmp(n))
                        .is_err()
                })
                .map(|(n, f)| (*n, *f))
                .collect();
            absent.sort();
            if let Some((n, f)) = absent.first() {
                return Err(bad(format!(
                    "\"weight_map\" maps tensor {n:?} to {f}, which does not hold it{}",
                    if absent.len() > 1 {
                        format!(" ({} such tensors)", absent.len())
                    } else {
                        String::new()
                    }
                )));
            }
        }
        let total: u64 = tensors.iter().map(|t| (t.end - t.start) as u64).sum();
        if let Some(stated) = index
            .metadata
            .as_ref()
            .and_then(|m| m.get("total_size"))
            .and_then(Value::as_u64)
        {
            if stated != total {
                tracing::warn!(
                    index = %index_path.display(),
                    stated,
                    actual = total,
                    "metadata.total_size differs from the shards' tensor bytes"
                );
            }
        }
        Ok(Shards {
            dir: dir.to_path_buf(),
            files,
            tensors,
            total,
        })
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The shard files, by shard number ([`TensorMeta::shard`]).
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|f| f.path.as_path())
    }

    /// Every tensor, sorted by name.
    pub fn tensors(&self) -> &[TensorMeta] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&TensorMeta> {
        self.tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }

    /// The tensor's bytes in its shard's mapping (empty for a `TensorMeta` that is not one of
    /// these shards').
    pub fn data(&self, t: &TensorMeta) -> &[u8] {
        self.files
            .get(t.shard)
            .and_then(|f| f.map.get(t.start..t.end))
            .unwrap_or(&[])
    }

    /// Drops the resident pages of the tensor's bytes (`madvise(MADV_DONTNEED)` on the whole
    /// pages inside its range, never a neighbour's partial page), so that a loader streaming the
    /// weights into device memory does not keep the whole file resident. Later reads of the bytes
    /// fault them back in from the file. A no-op off Unix, for a range smaller than a page, or
    /// where the call fails.
    pub fn release(&self, t: &TensorMeta) {
        #[cfg(unix)]
        {
            let Some(f) = self.files.get(t.shard) else {
                return;
            };
            if t.start >= t.end || t.end > f.map.len() {
                return;
            }
            let page = page_size();
            let Some(first) = t.start.checked_next_multiple_of(page) else {
                return;
            };
            let last = t.end - t.end % page;
            if first >= last {
                return;
            }
            // SAFETY: the mapping is private (MAP_PRIVATE) and read-only (PROT_READ,
            // `map_copy_read_only`), and nothing ever writes to it, so it holds no
            // copy-on-write pages of its own: every page is the file's page-cache page. Dropping
            // them with MADV_DONTNEED changes no byte any `&[u8]` from `data` can observe; the
            // next access faults the same file contents back in. The range lies inside the
            // mapping (checked above) and starts on a page boundary (the mapping starts at file
            // offset 0, page-aligned).
            let _ = unsafe {
                f.map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    first,
                    last - first,
                )
            };
        }
        #[cfg(not(unix))]
        let _ = t;
    }

    /// The tensors' data bytes, all shards together (what an index's `metadata.total_size`
    /// states).
    pub fn total_bytes(&self) -> u64 {
        self.total
    }
}

#[cfg(unix)]
fn page_size() -> usize {
    // SAFETY: sysconf reads a configuration value; it has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// Maps `path` read-only and parses it as shard `shard`.
fn map_and_parse(path: &Path, shard: usize) -> Result<(Mmap, Vec<TensorMeta>), HfError> {
    let file = File::open(path).map_err(|e| HfError::io("opening", path, e))?;
    let len = file
        .metadata()
        .map_err(|e| HfError::io("reading the size of", path, e))?
        .len();
    let name = path.display().to_string();
    if len < 8 {
        // Too short to be mapped usefully (and an empty file cannot be mapped at all): parse the
        // few bytes from memory, which reports the truncation.
        let bytes = std::fs::read(path).map_err(|e| HfError::io("reading", path, e))?;
        parse(&name, &bytes, shard)?;
    }
    // SAFETY: a private read-only mapping; references into it never outlive the `Shards` that
    // owns it. Model files are not expected to change while they are served: a concurrent
    // truncation is the one hazard of any mmap reader (it would fault, not corrupt memory).
    let map = unsafe { MmapOptions::new().map_copy_read_only(&file) }
        .map_err(|e| HfError::io("mapping", path, e))?;
    let tensors = parse(&name, &map, shard)?;
    Ok((map, tensors))
}

/// A name that stays in the directory: one path component, not `.` or `..`.
fn is_plain_file_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains('/') && !s.contains('\\')
}

/// The `*.safetensors` and `*.bin` files in `dir`, sorted, for the "no weights" message.
fn weight_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.ends_with(".safetensors") || n.ends_with(".bin"))
        .collect();
    v.sort();
    v
}

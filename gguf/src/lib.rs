//! GGUF container reader: maps the file, validates the header, metadata and tensor directory
//! against the file length, and hands out typed metadata values and tensor byte slices.
//! Every read is bounds-checked, so a truncated or corrupted file is an error, never a panic.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use thiserror::Error;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Sanity limits: a real model has at most a few thousand tensors and keys.
const MAX_TENSORS: u64 = 1 << 20;
const MAX_KV: u64 = 1 << 20;
const MAX_DIMS: u32 = 4;
const MAX_STRING: u64 = 1 << 30;

#[derive(Debug, Error)]
pub enum GgufError {
    #[error("cannot open model file {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (magic bytes {found:?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: unsupported GGUF version {version} (supported: 2 and 3)")]
    BadVersion { path: PathBuf, version: u32 },
    #[error("{path}: file is truncated or corrupt: {what} needs bytes {start}..{end} but the file has {len}")]
    Truncated {
        path: PathBuf,
        what: String,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("{path}: corrupt GGUF: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error(
        "{path}: tensor {name:?} is stored as {}, which is not supported (supported: {})",
        ggml_type_name(*type_id),
        SUPPORTED_TYPES
    )]
    UnsupportedType {
        path: PathBuf,
        name: String,
        type_id: u32,
    },
    #[error("model is missing tensor {0:?}")]
    MissingTensor(String),
    #[error("model is missing metadata key {0:?}")]
    MissingKey(String),
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        key: String,
        found: &'static str,
        expected: &'static str,
    },
    /// Bytes that are not a row of the given length of a type (`quants::dequantize_row`).
    #[error("{}", row_length_message(*ty, *values, *bytes))]
    RowLength {
        ty: GgmlType,
        values: usize,
        bytes: usize,
    },
}

fn row_length_message(ty: GgmlType, values: usize, bytes: usize) -> String {
    match ty.row_bytes(values) {
        Some(need) => format!(
            "a row of {values} {} values takes {need} bytes, not {bytes}",
            ty.name()
        ),
        None => format!(
            "{values} {} values are not a whole number of its {}-value blocks ({bytes} bytes given)",
            ty.name(),
            ty.block_len()
        ),
    }
}

/// Tensor element types we understand (ggml type ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    /// 32 values per block: an f16 scale and 4-bit indices into a fixed non-linear table.
    IQ4NL,
    /// 256 values per super-block: IQ4_NL's table with one f16 scale and a 6-bit scale per 32.
    IQ4XS,
}

/// The tensor types this crate reads, as the error for any other names them.
pub const SUPPORTED_TYPES: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_NL, IQ4_XS";

/// ggml's name for a tensor type id (the ones not supported included), for messages.
pub fn ggml_type_name(id: u32) -> String {
    if let Some(t) = GgmlType::from_id(id) {
        return t.name().to_string();
    }
    let name = match id {
        9 => "Q8_1",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        21 => "IQ3_S",
        22 => "IQ2_S",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("type id {id} (unknown to ggml as of this build)"),
    };
    format!("{name} (type id {id})")
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            20 => Self::IQ4NL,
            23 => Self::IQ4XS,
            30 => Self::BF16,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q2K => 10,
            Self::Q3K => 11,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Q8K => 15,
            Self::IQ4NL => 20,
            Self::IQ4XS => 23,
            Self::BF16 => 30,
        }
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::IQ4NL => 32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K | Self::Q8K | Self::IQ4XS => {
                256
            }
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::Q8K => 292,
            Self::IQ4NL => 18,
            Self::IQ4XS => 136,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Q8K => "Q8_K",
            Self::IQ4NL => "IQ4_NL",
            Self::IQ4XS => "IQ4_XS",
        }
    }

    /// Bytes taken by a row of `n` elements, or None when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "u8",
            Self::I8(_) => "i8",
            Self::U16(_) => "u16",
            Self::I16(_) => "i16",
            Self::U32(_) => "u32",
            Self::I32(_) => "i32",
            Self::U64(_) => "u64",
            Self::I64(_) => "i64",
            Self::F32(_) => "f32",
            Self::F64(_) => "f64",
            Self::Bool(_) => "bool",
            Self::String(_) => "string",
            Self::Array(_) => "array",
        }
    }

    /// Any non-negative integer as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v as u64),
            Self::U16(v) => Some(v as u64),
            Self::U32(v) => Some(v as u64),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            Self::Bool(v) => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v as i64),
            Self::I16(v) => Some(v as i64),
            Self::I32(v) => Some(v as i64),
            Self::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v as f64),
            Self::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => self.as_u64().map(|v| v != 0),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: dims[0] is the contiguous (row) length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Length of one row (the contiguous dimension).
    pub fn row_len(&self) -> usize {
        self.dims.first().copied().unwrap_or(1) as usize
    }
    /// Number of rows (product of the other dimensions).
    pub fn n_rows(&self) -> usize {
        self.dims.iter().skip(1).product::<u64>() as usize
    }
}

/// An opened, validated GGUF file. Tensor data stays in the memory map (shared by clones).
#[derive(Clone)]
pub struct GgufFile {
    path: PathBuf,
    map: std::sync::Arc<Mmap>,
    pub version: u32,
    metadata: HashMap<String, MetaValue>,
    /// Keys in file order (for listing).
    keys: Vec<String>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

struct Cursor<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

/// The fewest bytes a metadata value of type `type_id` takes (unknown types: 1, refused later).
fn min_value_bytes(type_id: u32) -> u64 {
    match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        // An array: element type and count.
        9 => 12,
        _ => 1,
    }
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let start = self.pos as u64;
        let end = start.saturating_add(n);
        if end > self.buf.len() as u64 {
            return Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                start,
                end,
                len: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..end as usize];
        self.pos = end as usize;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8, GgufError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > MAX_STRING {
            return Err(self.corrupt(format!("{what}: string length {len} is implausible")));
        }
        let bytes = self.take(len, what)?;
        // Token texts may hold invalid UTF-8 in some conversions; keep them lossy rather than fail.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }
    fn corrupt(&self, what: String) -> GgufError {
        GgufError::Corrupt {
            path: self.path.to_path_buf(),
            what,
        }
    }

    fn value(&mut self, type_id: u32, key: &str, depth: u32) -> Result<MetaValue, GgufError> {
        let what = format!("metadata value of {key:?}");
        Ok(match type_id {
            0 => MetaValue::U8(self.u8(&what)?),
            1 => MetaValue::I8(self.u8(&what)? as i8),
            2 => MetaValue::U16(self.u16(&what)?),
            3 => MetaValue::I16(self.u16(&what)? as i16),
            4 => MetaValue::U32(self.u32(&what)?),
            5 => MetaValue::I32(self.u32(&what)? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32(&what)?)),
            7 => MetaValue::Bool(self.u8(&what)? != 0),
            8 => MetaValue::String(self.string(&what)?),
            9 => {
                if depth > 2 {
                    return Err(self.corrupt(format!("{what}: arrays nested too deeply")));
                }
                let elem_type = self.u32(&what)?;
                let n = self.u64(&what)?;
                // Every element takes at least its type's smallest encoding: a count beyond what
                // the remaining bytes can hold is corrupt (and nothing is sized by it before).
                let remaining = (self.buf.len() - self.pos) as u64;
                let min_bytes = min_value_bytes(elem_type);
                if n > remaining / min_bytes {
                    return Err(self.corrupt(format!(
                        "{what}: array of {n} elements cannot fit in the {remaining} bytes left"
                    )));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem_type, key, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64(&what)?),
            11 => MetaValue::I64(self.u64(&what)? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64(&what)?)),
            t => return Err(self.corrupt(format!("{what}: unknown value type {t}"))),
        })
    }
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| GgufError::Open {
            path: path.clone(),
            source,
        })?;
        // SAFETY: the map is read-only; we never hand out references that outlive it, and model
        // files are not expected to change while served (a concurrent truncation is the one hazard
        // of any mmap reader).
        let map = unsafe { Mmap::map(&file) }.map_err(|source| GgufError::Open {
            path: path.clone(),
            source,
        })?;
        Self::parse(path, map)
    }

    /// Reads a GGUF image held in memory (copied into an anonymous read-only mapping), named
    /// `name` in errors: what a fuzzer or a test hands the reader.
    pub fn from_bytes(name: &str, bytes: &[u8]) -> Result<Self, GgufError> {
        let path = PathBuf::from(name);
        let open_err = |source| GgufError::Open {
            path: path.clone(),
            source,
        };
        let mut anon = memmap2::MmapMut::map_anon(bytes.len()).map_err(open_err)?;
        anon.copy_from_slice(bytes);
        let map = anon.make_read_only().map_err(open_err)?;
        Self::parse(path, map)
    }

    fn parse(path: PathBuf, map: Mmap) -> Result<Self, GgufError> {
        let file_len = map.len() as u64;
        let mut c = Cursor {
            path: &path,
            buf: &map,
            pos: 0,
        };
        let magic: [u8; 4] = c.take(4, "magic")?.try_into().unwrap();
        if &magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic {
                path: path.clone(),
                found: magic,
            });
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::BadVersion {
                path: path.clone(),
                version,
            });
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        if n_tensors > MAX_TENSORS || n_kv > MAX_KV {
            return Err(c.corrupt(format!(
                "implausible counts: {n_tensors} tensors, {n_kv} metadata keys"
            )));
        }
        // A metadata entry takes at least 13 bytes (key length, type, a one-byte value) and a
        // tensor entry 32 (name length, one dimension, type, offset): counts the file cannot
        // hold are refused before anything is sized by them.
        let least = n_kv * 13 + n_tensors * 32;
        if least > file_len - c.pos as u64 {
            return Err(GgufError::Truncated {
                path: path.clone(),
                what: format!(
                    "metadata and tensor table ({n_kv} keys and {n_tensors} tensors need at least \
                     {least} bytes)"
                ),
                start: c.pos as u64,
                end: c.pos as u64 + least,
                len: file_len,
            });
        }
        let mut metadata = HashMap::new();
        let mut keys = Vec::new();
        for i in 0..n_kv {
            // A damaged value usually shows as an unreadable next key: name the key before it.
            let what = match keys.last() {
                Some(prev) => format!("metadata key #{i} (the one after {prev:?})"),
                None => format!("metadata key #{i}"),
            };
            let key = c.string(&what)?;
            let ty = c.u32(&format!("type of metadata key {key:?}"))?;
            let v = c.value(ty, &key, 0)?;
            keys.push(key.clone());
            metadata.insert(key, v);
        }
        let alignment = match metadata.get("general.alignment") {
            Some(v) => {
                let a = v.as_u64().unwrap_or(0);
                if a == 0 || !a.is_power_of_two() {
                    return Err(c.corrupt(format!("general.alignment {a} is not a power of two")));
                }
                a
            }
            None => DEFAULT_ALIGNMENT,
        };
        struct Raw {
            name: String,
            dims: Vec<u64>,
            type_id: u32,
            rel: u64,
        }
        let mut raw: Vec<Raw> = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let what = match (raw.last(), keys.last()) {
                (Some(prev), _) => format!("name of tensor #{i} (the one after {:?})", prev.name),
                (None, Some(key)) => format!("name of tensor #{i} (after metadata key {key:?})"),
                (None, None) => format!("name of tensor #{i}"),
            };
            let name = c.string(&what)?;
            let nd = c.u32(&format!("dimension count of {name:?}"))?;
            if nd == 0 || nd > MAX_DIMS {
                return Err(c.corrupt(format!("tensor {name:?} has {nd} dimensions")));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(c.u64(&format!("dimensions of {name:?}"))?);
            }
            let type_id = c.u32(&format!("type of {name:?}"))?;
            let rel = c.u64(&format!("offset of {name:?}"))?;
            raw.push(Raw {
                name,
                dims,
                type_id,
                rel,
            });
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(raw.len());
        let mut by_name = HashMap::new();
        for r in raw {
            let ty = GgmlType::from_id(r.type_id).ok_or_else(|| GgufError::UnsupportedType {
                path: path.clone(),
                name: r.name.clone(),
                type_id: r.type_id,
            })?;
            let mut n_el: u64 = 1;
            for &d in &r.dims {
                n_el = n_el
                    .checked_mul(d)
                    .filter(|&n| d > 0 && n < (1 << 40))
                    .ok_or_else(|| {
                        c.corrupt(format!(
                            "tensor {:?} has bad dimensions {:?}",
                            r.name, r.dims
                        ))
                    })?;
            }
            let row = r.dims[0] as usize;
            let row_bytes = ty.row_bytes(row).ok_or_else(|| {
                c.corrupt(format!(
                    "tensor {:?}: row length {row} is not a multiple of the {} block size {}",
                    r.name,
                    ty.name(),
                    ty.block_len()
                ))
            })? as u64;
            let n_bytes = row_bytes * (n_el / r.dims[0]);
            if r.rel % alignment != 0 {
                return Err(c.corrupt(format!(
                    "tensor {:?} offset {} is not aligned to {alignment}",
                    r.name, r.rel
                )));
            }
            let offset = data_start.saturating_add(r.rel);
            let end = offset.saturating_add(n_bytes);
            if end > file_len {
                return Err(GgufError::Truncated {
                    path: path.clone(),
                    what: format!("data of tensor {:?}", r.name),
                    start: offset,
                    end,
                    len: file_len,
                });
            }
            if by_name.insert(r.name.clone(), tensors.len()).is_some() {
                return Err(c.corrupt(format!("tensor {:?} appears twice", r.name)));
            }
            tensors.push(TensorInfo {
                name: r.name,
                dims: r.dims,
                ty,
                offset,
                n_bytes,
            });
        }
        Ok(Self {
            path,
            map: std::sync::Arc::new(map),
            version,
            metadata,
            keys,
            tensors,
            by_name,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file_len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(MetaValue::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(MetaValue::as_u64)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(MetaValue::as_f64)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(MetaValue::as_bool)
    }

    /// A required integer key.
    pub fn require_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        v.as_u64().ok_or_else(|| GgufError::WrongType {
            key: key.to_string(),
            found: v.type_name(),
            expected: "unsigned integer",
        })
    }

    /// An array of strings (token texts, merges).
    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let wrong = || GgufError::WrongType {
            key: key.to_string(),
            found: v.type_name(),
            expected: "array of strings",
        };
        let arr = v.as_array().ok_or_else(wrong)?;
        arr.iter()
            .map(|e| e.as_str().ok_or_else(wrong))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (bounds were checked when the file was opened).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.offset as usize..(info.offset + info.n_bytes) as usize]
    }

    pub fn tensor(&self, name: &str) -> Result<(&TensorInfo, &[u8]), GgufError> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))?;
        Ok((info, self.tensor_data(info)))
    }
}

pub mod quantize;
pub mod quants;
pub mod store;
pub mod synth;
#[cfg(test)]
mod tests;
pub mod writer;

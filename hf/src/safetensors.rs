//! The safetensors format: its element types (`Dtype`), a strict parser of one file image
//! (`parse`) and the memory-mapped shards of a model directory (`Shards`), one file or several
//! named by `model.safetensors.index.json`.

use std::collections::HashSet;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;

use crate::HfError;

mod shards;
pub use shards::Shards;

/// A tensor element type, as a safetensors header spells it (`"BF16"`, `"F8_E4M3"`, ...).
///
/// The sub-byte types the format also defines (`F4`, `F6_E2M3`, `F6_E3M2`) are not represented:
/// a file holding one is refused with an error naming the type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F64,
    F32,
    F16,
    BF16,
    F8E4M3,
    F8E5M2,
    /// The OCP MX scale type (8 exponent bits, no mantissa).
    F8E8M0,
    I64,
    I32,
    I16,
    I8,
    U64,
    U32,
    U16,
    U8,
    Bool,
    /// Complex of two `F32`.
    C64,
}

impl Dtype {
    /// Every type, for tests and tools.
    pub const ALL: [Dtype; 17] = [
        Dtype::F64,
        Dtype::F32,
        Dtype::F16,
        Dtype::BF16,
        Dtype::F8E4M3,
        Dtype::F8E5M2,
        Dtype::F8E8M0,
        Dtype::I64,
        Dtype::I32,
        Dtype::I16,
        Dtype::I8,
        Dtype::U64,
        Dtype::U32,
        Dtype::U16,
        Dtype::U8,
        Dtype::Bool,
        Dtype::C64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F64 | Dtype::I64 | Dtype::U64 | Dtype::C64 => 8,
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::F16 | Dtype::BF16 | Dtype::I16 | Dtype::U16 => 2,
            Dtype::F8E4M3 | Dtype::F8E5M2 | Dtype::F8E8M0 | Dtype::I8 | Dtype::U8 | Dtype::Bool => {
                1
            }
        }
    }

    /// The header's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F64 => "F64",
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::I64 => "I64",
            Dtype::I32 => "I32",
            Dtype::I16 => "I16",
            Dtype::I8 => "I8",
            Dtype::U64 => "U64",
            Dtype::U32 => "U32",
            Dtype::U16 => "U16",
            Dtype::U8 => "U8",
            Dtype::Bool => "BOOL",
            Dtype::C64 => "C64",
        }
    }

    /// The type a header's `"dtype"` names (exact spelling, as the format requires).
    pub fn from_name(s: &str) -> Option<Self> {
        Dtype::ALL.into_iter().find(|d| d.name() == s)
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where one tensor lies: its shard (index into the model's shard files) and its bytes there.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: Dtype,
    /// Row-major, as stored.
    pub shape: Vec<usize>,
    pub shard: usize,
    /// Absolute byte offsets in the shard file.
    pub start: usize,
    pub end: usize,
}

/// The largest header accepted (the reference implementation's limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

fn fault(file: &str, tensor: Option<&str>, what: impl Into<String>) -> HfError {
    HfError::Safetensors {
        file: file.to_string(),
        tensor: tensor.map(str::to_string),
        what: what.into(),
    }
}

/// A JSON object's entries in file order, duplicates kept (a `serde_json::Map` would silently
/// keep the last of two equal keys, which the format forbids).
pub(crate) struct Entries(pub(crate) Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some(entry) = m.next_entry::<String, Value>()? {
                    v.push(entry);
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

impl Entries {
    /// The first key that appears twice.
    pub(crate) fn duplicate(&self) -> Option<&str> {
        let mut seen = HashSet::new();
        self.0
            .iter()
            .map(|(k, _)| k.as_str())
            .find(|k| !seen.insert(*k))
    }
}

/// A JSON number that is a non-negative integer fitting `usize`.
fn as_usize(v: &Value) -> Option<usize> {
    v.as_u64().and_then(|n| usize::try_from(n).ok())
}

/// Parses and checks a whole safetensors file image (header and data), named `file_name` in
/// errors, as shard number `shard` of its model.
///
/// Checked: the 8-byte little-endian header length (below [`MAX_HEADER_BYTES`] and within the
/// file), the header is one JSON object (starting with `{`, no key twice), `__metadata__` (when
/// present) maps strings to strings, every tensor entry has a known `dtype`, a `shape` of
/// non-negative integers and two `data_offsets` inside the data region, its shape's element
/// count times the type's size (overflow checked) is its byte length, and the tensors sorted by
/// offset tile the data region exactly (no overlap, no hole, nothing after the last). Keys of a
/// tensor entry other than these three are ignored, as the reference implementation ignores
/// them.
///
/// The tensors come back in file order (by start offset, then name), with absolute offsets.
/// Nothing is allocated beyond the header's size, and no input makes this panic.
pub fn parse(file_name: &str, bytes: &[u8], shard: usize) -> Result<Vec<TensorMeta>, HfError> {
    let file = file_name;
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(fault(
            file,
            None,
            format!(
                "the file is {} bytes long, shorter than the 8-byte header length that starts a safetensors file (truncated?)",
                bytes.len()
            ),
        ));
    };
    let mut le = [0u8; 8];
    le.copy_from_slice(len_bytes);
    let header_len = u64::from_le_bytes(le);
    if header_len >= MAX_HEADER_BYTES {
        return Err(fault(
            file,
            None,
            format!(
                "header length {header_len} is not below the {MAX_HEADER_BYTES}-byte limit (not a safetensors file?)"
            ),
        ));
    }
    let rest = (bytes.len() - 8) as u64;
    if header_len > rest {
        return Err(fault(
            file,
            None,
            format!(
                "header length {header_len} runs past the end of the file ({} bytes, {rest} after the length; truncated?)",
                bytes.len()
            ),
        ));
    }
    // Below MAX_HEADER_BYTES and within the slice, so it fits usize.
    let header_end = 8 + header_len as usize;
    let header = &bytes[8..header_end];
    let data_len = bytes.len() - header_end;
    if header.first() != Some(&b'{') {
        return Err(fault(
            file,
            None,
            "the header does not start with '{' (not a safetensors file?)",
        ));
    }
    let entries: Entries = serde_json::from_slice(header).map_err(|e| {
        fault(
            file,
            None,
            format!(
                "the header is not valid JSON (line {}, column {}): {e}",
                e.line(),
                e.column()
            ),
        )
    })?;
    if let Some(dup) = entries.duplicate() {
        return Err(fault(file, Some(dup), "the header names this key twice"));
    }

    let mut tensors = Vec::new();
    for (name, v) in &entries.0 {
        if name == "__metadata__" {
            check_metadata(file, v)?;
            continue;
        }
        let t = Some(name.as_str());
        let Some(obj) = v.as_object() else {
            return Err(fault(
                file,
                t,
                format!("entry is {}, not an object", kind(v)),
            ));
        };
        let dtype = match obj.get("dtype") {
            None => return Err(fault(file, t, "no \"dtype\"")),
            Some(Value::String(s)) => match Dtype::from_name(s) {
                Some(d) => d,
                None if matches!(s.as_str(), "F4" | "F6_E2M3" | "F6_E3M2") => {
                    return Err(fault(
                        file,
                        t,
                        format!("dtype {s} (a sub-byte type) is not supported"),
                    ))
                }
                None => {
                    let known: Vec<&str> = Dtype::ALL.iter().map(|d| d.name()).collect();
                    return Err(fault(
                        file,
                        t,
                        format!("unknown dtype {s:?} (known: {})", known.join(", ")),
                    ));
                }
            },
            Some(other) => {
                return Err(fault(
                    file,
                    t,
                    format!("\"dtype\" is {}, not a string", kind(other)),
                ))
            }
        };
        let shape: Vec<usize> = match obj.get("shape") {
            None => return Err(fault(file, t, "no \"shape\"")),
            Some(Value::Array(dims)) => {
                let mut shape = Vec::with_capacity(dims.len());
                for d in dims {
                    match as_usize(d) {
                        Some(n) => shape.push(n),
                        None => {
                            return Err(fault(
                                file,
                                t,
                                format!("\"shape\" holds {d}, not a non-negative integer"),
                            ))
                        }
                    }
                }
                shape
            }
            Some(other) => {
                return Err(fault(
                    file,
                    t,
                    format!("\"shape\" is {}, not an array", kind(other)),
                ))
            }
        };
        let (begin, end) = match obj.get("data_offsets") {
            None => return Err(fault(file, t, "no \"data_offsets\"")),
            Some(Value::Array(o)) if o.len() == 2 => match (as_usize(&o[0]), as_usize(&o[1])) {
                (Some(b), Some(e)) => (b, e),
                _ => {
                    return Err(fault(
                        file,
                        t,
                        format!(
                            "\"data_offsets\" [{}, {}] are not two non-negative integers",
                            o[0], o[1]
                        ),
                    ))
                }
            },
            Some(other) => {
                return Err(fault(
                    file,
                    t,
                    format!(
                        "\"data_offsets\" is {other}, not an array of two integers [begin, end]"
                    ),
                ))
            }
        };
        if begin > end {
            return Err(fault(
                file,
                t,
                format!("data_offsets [{begin}, {end}]: the begin is past the end"),
            ));
        }
        if end > data_len {
            return Err(fault(
                file,
                t,
                format!(
                    "data_offsets [{begin}, {end}] run past the data region ({data_len} bytes after the header; truncated?)"
                ),
            ));
        }
        let need = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d));
        match need {
            Some(n) if n == end - begin => {}
            Some(n) => {
                return Err(fault(
                    file,
                    t,
                    format!(
                        "shape {shape:?} of {dtype} takes {n} bytes, but data_offsets [{begin}, {end}] hold {}",
                        end - begin
                    ),
                ))
            }
            None => {
                return Err(fault(
                    file,
                    t,
                    format!("shape {shape:?} of {dtype}: the byte count overflows"),
                ))
            }
        }
        tensors.push(TensorMeta {
            name: name.clone(),
            dtype,
            shape,
            shard,
            start: header_end + begin,
            end: header_end + end,
        });
    }

    tensors.sort_by(|a, b| (a.start, a.end, &a.name).cmp(&(b.start, b.end, &b.name)));
    let mut pos = header_end;
    let mut prev: Option<&TensorMeta> = None;
    for t in &tensors {
        if t.start < pos {
            let p = prev.map(|p| p.name.as_str()).unwrap_or("");
            return Err(fault(
                file,
                Some(&t.name),
                format!(
                    "its data_offsets [{}, {}] overlap tensor {p:?}'s, which end at {}",
                    t.start - header_end,
                    t.end - header_end,
                    pos - header_end
                ),
            ));
        }
        if t.start > pos {
            let after = match prev {
                Some(p) => format!("after tensor {:?}", p.name),
                None => "at the start of the data region".to_string(),
            };
            return Err(fault(
                file,
                Some(&t.name),
                format!(
                    "its data begin at {}, leaving a hole of {} bytes {after}",
                    t.start - header_end,
                    t.start - pos
                ),
            ));
        }
        pos = t.end;
        prev = Some(t);
    }
    if pos != bytes.len() {
        let after = match prev {
            Some(p) => format!("after the last tensor, {:?}", p.name),
            None => "and no tensor is in the header".to_string(),
        };
        return Err(fault(
            file,
            None,
            format!(
                "{} bytes of the data region belong to no tensor ({after})",
                bytes.len() - pos
            ),
        ));
    }
    Ok(tensors)
}

fn check_metadata(file: &str, v: &Value) -> Result<(), HfError> {
    let Some(map) = v.as_object() else {
        return Err(fault(
            file,
            None,
            format!("\"__metadata__\" is {}, not an object of strings", kind(v)),
        ));
    };
    for (k, val) in map {
        if !val.is_string() {
            return Err(fault(
                file,
                None,
                format!("\"__metadata__\" key {k:?} is {}, not a string", kind(val)),
            ));
        }
    }
    Ok(())
}

/// What a JSON value is, for messages.
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

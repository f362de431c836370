//! A small GGUF (v2/v3) writer: metadata of every value type including nested arrays, tensors with
//! a given type, dims and bytes, and data alignment. Used by tests here and in other crates to build
//! valid and deliberately damaged model files; `layout()` tells where each section landed.

use std::io;
use std::path::Path;

use super::{GgmlType, MetaValue};

/// The alignment a reader assumes when the file has no `general.alignment` key.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Tensor data is only written below this offset (a test file, not a real model).
const MAX_WRITTEN_OFFSET: u64 = 1 << 34;

/// One tensor to write. `type_id` and `offset` are raw so tests can write invalid ones.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    /// ggml order: dims[0] is the contiguous (row) length.
    pub dims: Vec<u64>,
    /// ggml type id (see [`GgmlType::id`]).
    pub type_id: u32,
    pub data: Vec<u8>,
    /// Offset relative to the data section; `None` places it after the previous tensor, aligned.
    pub offset: Option<u64>,
}

/// Where the parts of a written file start (absolute byte offsets).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GgufLayout {
    /// Start of each metadata entry (its key's length field), in order.
    pub metadata_entries: Vec<u64>,
    /// End of the metadata = start of the tensor directory.
    pub tensor_infos_start: u64,
    /// Start of each tensor directory entry, in order.
    pub tensor_infos: Vec<u64>,
    /// End of the tensor directory.
    pub tensor_infos_end: u64,
    /// Start of the (aligned) data section.
    pub data_start: u64,
    /// Absolute offset of each tensor's data.
    pub tensor_data: Vec<u64>,
    /// Total file length.
    pub file_len: u64,
}

/// Builds a GGUF file in memory.
#[derive(Debug, Clone)]
pub struct GgufWriter {
    pub magic: [u8; 4],
    pub version: u32,
    /// Data alignment used for the layout (write `general.alignment` yourself, or use
    /// [`GgufWriter::set_alignment`], when it is not the default).
    pub alignment: u64,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<TensorSpec>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self {
            magic: *b"GGUF",
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// The GGUF value type id of a metadata value.
pub fn meta_type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Append the encoding of `v` (without its type id).
fn put_value(out: &mut Vec<u8>, v: &MetaValue) -> io::Result<()> {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => put_string(out, s),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Array(items) => {
            // An empty array is written with element type u8; readers do not look at it.
            let elem = items.first().map_or(0, meta_type_id);
            if let Some(bad) = items.iter().find(|i| meta_type_id(i) != elem) {
                return Err(invalid(format!(
                    "GGUF arrays hold one element type: found {} among {}",
                    bad.type_name(),
                    items[0].type_name()
                )));
            }
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item)?;
            }
        }
    }
    Ok(())
}

fn pad_to(out: &mut Vec<u8>, alignment: u64) {
    let len = out.len() as u64;
    let padded = len.div_ceil(alignment) * alignment;
    out.resize(padded as usize, 0);
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Use `alignment` for the data section and record it as `general.alignment` (u32).
    pub fn set_alignment(&mut self, alignment: u32) -> &mut Self {
        self.alignment = alignment as u64;
        self.metadata.retain(|(k, _)| k != "general.alignment");
        self.metadata
            .push(("general.alignment".to_string(), MetaValue::U32(alignment)));
        self
    }

    /// Add a metadata entry (kept in insertion order; duplicates are written as given).
    pub fn add_meta(&mut self, key: impl Into<String>, value: MetaValue) -> &mut Self {
        self.metadata.push((key.into(), value));
        self
    }

    /// Add a tensor of a known type, placed after the previous one. The byte count is the
    /// caller's business (tests write wrong ones on purpose).
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
        data: Vec<u8>,
    ) -> &mut Self {
        self.add_tensor_spec(TensorSpec {
            name: name.into(),
            dims: dims.to_vec(),
            type_id: ty.id(),
            data,
            offset: None,
        })
    }

    /// Add an F32 tensor from values.
    pub fn add_f32_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        values: &[f32],
    ) -> &mut Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add_tensor(name, GgmlType::F32, dims, data)
    }

    pub fn add_tensor_spec(&mut self, spec: TensorSpec) -> &mut Self {
        self.tensors.push(spec);
        self
    }

    /// The file bytes and where each part landed.
    pub fn to_bytes_with_layout(&self) -> io::Result<(Vec<u8>, GgufLayout)> {
        if self.alignment == 0 || !self.alignment.is_power_of_two() {
            return Err(invalid(format!(
                "alignment {} is not a power of two",
                self.alignment
            )));
        }
        let mut layout = GgufLayout::default();
        let mut out = Vec::new();
        out.extend_from_slice(&self.magic);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            layout.metadata_entries.push(out.len() as u64);
            put_string(&mut out, key);
            out.extend_from_slice(&meta_type_id(value).to_le_bytes());
            put_value(&mut out, value)?;
        }
        layout.tensor_infos_start = out.len() as u64;

        // Relative data offsets: explicit ones as given, others after the previous tensor.
        let mut next = 0u64;
        let mut rel_offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let rel = t
                .offset
                .unwrap_or(next.div_ceil(self.alignment) * self.alignment);
            rel_offsets.push(rel);
            next = rel.saturating_add(t.data.len() as u64);
        }
        for (t, &rel) in self.tensors.iter().zip(&rel_offsets) {
            layout.tensor_infos.push(out.len() as u64);
            put_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&rel.to_le_bytes());
        }
        layout.tensor_infos_end = out.len() as u64;
        if !self.tensors.is_empty() {
            pad_to(&mut out, self.alignment);
        }
        let data_start = out.len() as u64;
        layout.data_start = data_start;

        for (t, &rel) in self.tensors.iter().zip(&rel_offsets) {
            let start = data_start.saturating_add(rel);
            layout.tensor_data.push(start);
            // Empty data writes nothing: a directory entry may point anywhere (damaged files).
            if t.data.is_empty() {
                continue;
            }
            if start > MAX_WRITTEN_OFFSET {
                return Err(invalid(format!(
                    "tensor {:?}: offset {rel} is too large to write its data",
                    t.name
                )));
            }
            let end = start as usize + t.data.len();
            if out.len() < end {
                out.resize(end, 0);
            }
            out[start as usize..end].copy_from_slice(&t.data);
        }
        layout.file_len = out.len() as u64;
        Ok((out, layout))
    }

    pub fn to_bytes(&self) -> io::Result<Vec<u8>> {
        Ok(self.to_bytes_with_layout()?.0)
    }

    /// Write the file to `path`; returns the layout.
    pub fn write_to(&self, path: impl AsRef<Path>) -> io::Result<GgufLayout> {
        let (bytes, layout) = self.to_bytes_with_layout()?;
        std::fs::write(path, bytes)?;
        Ok(layout)
    }
}

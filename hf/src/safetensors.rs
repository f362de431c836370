//! The safetensors format: its element types (`Dtype`), a strict parser of one file image
//! (`parse`) and the memory-mapped shards of a model directory (`Shards`), one file or several
//! named by `model.safetensors.index.json`.

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

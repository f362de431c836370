//! Tensor descriptions as aclCreateTensor receives them (view shape, strides, offset, dtype,
//! format, storage shape, device address), and element access through them: every element is
//! read or written as f64 at the storage position `offset + Σ index·stride`, in the tensor's
//! dtype (f16/bf16 via `half`, int4 as nibbles, low nibble first).

use std::sync::LazyLock;

use npu_ffi::types::*;

/// Every f16 bit pattern as f32 (the emulation reads f16 data through it).
static F16_TO_F32: LazyLock<Vec<f32>> = LazyLock::new(|| {
    (0..=u16::MAX)
        .map(|b| half::f16::from_bits(b).to_f32())
        .collect()
});

/// The f32 value of the f16 at element `pos` of `bytes`.
#[inline(always)]
pub fn f16_at(bytes: &[u8], pos: usize) -> f32 {
    F16_TO_F32[u16::from_le_bytes([bytes[pos * 2], bytes[pos * 2 + 1]]) as usize]
}

/// Element types the emulation reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    Bf16,
    I8,
    U8,
    I32,
    I64,
    Bool,
    I4,
}

impl DType {
    pub fn from_acl(t: aclDataType) -> Option<Self> {
        Some(match t {
            ACL_FLOAT => Self::F32,
            ACL_FLOAT16 => Self::F16,
            ACL_BF16 => Self::Bf16,
            ACL_INT8 => Self::I8,
            ACL_UINT8 => Self::U8,
            ACL_INT32 => Self::I32,
            ACL_INT64 => Self::I64,
            ACL_BOOL => Self::Bool,
            ACL_INT4 => Self::I4,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "FLOAT",
            Self::F16 => "FLOAT16",
            Self::Bf16 => "BFLOAT16",
            Self::I8 => "INT8",
            Self::U8 => "UINT8",
            Self::I32 => "INT32",
            Self::I64 => "INT64",
            Self::Bool => "BOOL",
            Self::I4 => "INT4",
        }
    }

    /// Storage bits per element.
    pub fn bits(self) -> u64 {
        match self {
            Self::I4 => 4,
            Self::I8 | Self::U8 | Self::Bool => 8,
            Self::F16 | Self::Bf16 => 16,
            Self::F32 | Self::I32 => 32,
            Self::I64 => 64,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, Self::F32 | Self::F16 | Self::Bf16)
    }
}

/// A tensor as described to aclCreateTensor.
#[derive(Debug, Clone)]
pub struct View {
    pub dims: Vec<i64>,
    pub strides: Vec<i64>,
    pub offset: i64,
    pub dtype: DType,
    pub format: aclFormat,
    pub storage_dims: Vec<i64>,
    pub addr: u64,
}

impl View {
    pub fn numel(&self) -> usize {
        self.dims.iter().map(|&d| d.max(0) as usize).product()
    }

    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// Elements of storage the descriptor claims.
    pub fn storage_elems(&self) -> u64 {
        self.storage_dims.iter().map(|&d| d.max(0) as u64).product()
    }

    /// Storage bytes the descriptor claims.
    pub fn storage_bytes(&self) -> u64 {
        (self.storage_elems() * self.dtype.bits()).div_ceil(8)
    }

    /// Largest storage element index the view touches (None for an empty view).
    pub fn max_elem(&self) -> Option<i64> {
        if self.numel() == 0 {
            return None;
        }
        Some(
            self.offset
                + self
                    .dims
                    .iter()
                    .zip(&self.strides)
                    .map(|(d, s)| (d - 1) * s)
                    .sum::<i64>(),
        )
    }

    /// Whether the view is dense row-major.
    pub fn is_contiguous(&self) -> bool {
        let mut expect = 1;
        for (d, s) in self.dims.iter().zip(&self.strides).rev() {
            if *d != 1 && *s != expect {
                return false;
            }
            expect *= d;
        }
        true
    }

    /// Calls `f` with the storage element index of each element of the view, in row-major
    /// order of the view.
    pub fn for_each_position(&self, mut f: impl FnMut(usize)) {
        let n = self.numel();
        if n == 0 {
            return;
        }
        let rank = self.rank();
        if rank == 0 || self.is_contiguous() {
            let o = self.offset as usize;
            (o..o + n).for_each(f);
            return;
        }
        let (last_d, last_s) = (self.dims[rank - 1], self.strides[rank - 1]);
        let mut idx = vec![0i64; rank - 1];
        let mut base = self.offset;
        for _ in 0..n / last_d as usize {
            let mut p = base;
            for _ in 0..last_d {
                f(p as usize);
                p += last_s;
            }
            for ax in (0..rank - 1).rev() {
                idx[ax] += 1;
                base += self.strides[ax];
                if idx[ax] < self.dims[ax] {
                    break;
                }
                base -= self.strides[ax] * self.dims[ax];
                idx[ax] = 0;
            }
        }
    }

    /// A short text naming the view (for cache keys).
    pub fn key(&self) -> String {
        format!(
            "{}{:?}{:?}+{}",
            self.dtype.name(),
            self.dims,
            self.strides,
            self.offset
        )
    }

    /// Storage element index of each element of the view, in row-major order of the view.
    pub fn positions(&self) -> Vec<i64> {
        let n = self.numel();
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return out;
        }
        let rank = self.rank();
        let mut idx = vec![0i64; rank];
        for _ in 0..n {
            out.push(
                self.offset
                    + idx
                        .iter()
                        .zip(&self.strides)
                        .map(|(i, s)| i * s)
                        .sum::<i64>(),
            );
            for ax in (0..rank).rev() {
                idx[ax] += 1;
                if idx[ax] < self.dims[ax] {
                    break;
                }
                idx[ax] = 0;
            }
        }
        out
    }

    pub fn shape_string(&self) -> String {
        format!("{}{:?}", self.dtype.name(), self.dims)
    }
}

/// Reads element `pos` of `bytes` (the tensor's whole allocation, starting at the tensor's
/// address) as f64.
pub fn read_elem(bytes: &[u8], dtype: DType, pos: usize) -> f64 {
    match dtype {
        DType::F32 => f32::from_le_bytes(bytes[pos * 4..pos * 4 + 4].try_into().unwrap()) as f64,
        DType::F16 => f16_at(bytes, pos) as f64,
        DType::Bf16 => half::bf16::from_le_bytes([bytes[pos * 2], bytes[pos * 2 + 1]]).to_f64(),
        DType::I8 => bytes[pos] as i8 as f64,
        DType::U8 | DType::Bool => bytes[pos] as f64,
        DType::I32 => i32::from_le_bytes(bytes[pos * 4..pos * 4 + 4].try_into().unwrap()) as f64,
        DType::I64 => i64::from_le_bytes(bytes[pos * 8..pos * 8 + 8].try_into().unwrap()) as f64,
        DType::I4 => {
            let b = bytes[pos / 2];
            let nib = if pos.is_multiple_of(2) {
                b & 0x0f
            } else {
                b >> 4
            };
            ((nib as i8) << 4 >> 4) as f64
        }
    }
}

/// Writes `v` at element `pos` (rounded to nearest for floats, truncated toward zero for ints).
pub fn write_elem(bytes: &mut [u8], dtype: DType, pos: usize, v: f64) {
    match dtype {
        DType::F32 => bytes[pos * 4..pos * 4 + 4].copy_from_slice(&(v as f32).to_le_bytes()),
        DType::F16 => {
            bytes[pos * 2..pos * 2 + 2].copy_from_slice(&half::f16::from_f64(v).to_le_bytes())
        }
        DType::Bf16 => {
            bytes[pos * 2..pos * 2 + 2].copy_from_slice(&half::bf16::from_f64(v).to_le_bytes())
        }
        DType::I8 => bytes[pos] = v as i8 as u8,
        DType::U8 => bytes[pos] = v as u8,
        DType::Bool => bytes[pos] = (v != 0.0) as u8,
        DType::I32 => bytes[pos * 4..pos * 4 + 4].copy_from_slice(&(v as i32).to_le_bytes()),
        DType::I64 => bytes[pos * 8..pos * 8 + 8].copy_from_slice(&(v as i64).to_le_bytes()),
        DType::I4 => {
            let nib = (v as i8 as u8) & 0x0f;
            let b = &mut bytes[pos / 2];
            *b = if pos.is_multiple_of(2) {
                (*b & 0xf0) | nib
            } else {
                (*b & 0x0f) | (nib << 4)
            };
        }
    }
}

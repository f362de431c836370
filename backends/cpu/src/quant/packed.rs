//! The packed weight layout our matmul kernels read. Rows are taken 16 at a time (a "group") and
//! each 32-value block of a group is one unit: the 16 rows' quantized values interleaved four at a
//! time (so one 512-bit register holds 4 consecutive values of each of the 16 rows), then the 16
//! scales and, for affine formats, the 16 minimums. A weight is `d * (q - offset) + m`.
//!
//! Every ggml format maps onto it: Q4_0/Q4_1/Q4_K as 4-bit values (two per byte), Q5_*/Q8_0/Q8_K as
//! bytes, all exactly; Q2_K/Q3_K/Q6_K (16-value sub-blocks) are re-quantized to 8-bit affine
//! blocks of 32, a small loss that the loader reports.

use std::alloc::{alloc_zeroed, dealloc, Layout};

use half::f16;

use super::acts::QBLOCK;
use npu_gguf::quants::{self as ggml, f16_at};
use npu_gguf::GgmlType;

/// Rows per group.
pub const GROUP: usize = 16;

/// How the quantized values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackKind {
    /// 4-bit values 0..=15, two per byte: low nibbles hold values 0..16 of the block, high
    /// nibbles values 16..32.
    Nibble,
    /// 8-bit values 0..=255.
    Byte,
}

/// How a packed matrix stores its per-block numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackFormat {
    pub kind: PackKind,
    /// Scales and minimums stored as f16 (exact for formats whose scales are f16) or f32.
    pub f16_scales: bool,
    /// Affine blocks carry a minimum `m`.
    pub has_min: bool,
    /// Subtracted from every value before scaling (8 for Q4_0, 16 for Q5_0, 128 for Q8_0).
    pub offset: i32,
}

impl PackFormat {
    pub fn values_bytes(&self) -> usize {
        match self.kind {
            PackKind::Nibble => GROUP * QBLOCK / 2,
            PackKind::Byte => GROUP * QBLOCK,
        }
    }
    pub fn scale_bytes(&self) -> usize {
        GROUP * if self.f16_scales { 2 } else { 4 }
    }
    /// Bytes of one unit (one 32-value block of one group of 16 rows).
    pub fn unit_bytes(&self) -> usize {
        self.values_bytes() + self.scale_bytes() * if self.has_min { 2 } else { 1 }
    }

    /// The packed form of a ggml type, and whether converting to it loses precision.
    pub fn for_type(ty: GgmlType) -> Option<(PackFormat, bool)> {
        let f = |kind, f16_scales, has_min, offset| PackFormat {
            kind,
            f16_scales,
            has_min,
            offset,
        };
        use PackKind::*;
        Some(match ty {
            GgmlType::Q4_0 => (f(Nibble, true, false, 8), false),
            GgmlType::Q4_1 => (f(Nibble, true, true, 0), false),
            GgmlType::Q4K => (f(Nibble, false, true, 0), false),
            GgmlType::Q5_0 => (f(Byte, true, false, 16), false),
            GgmlType::Q5_1 => (f(Byte, true, true, 0), false),
            GgmlType::Q5K => (f(Byte, false, true, 0), false),
            GgmlType::Q8_0 => (f(Byte, true, false, 128), false),
            GgmlType::Q8K => (f(Byte, false, false, 128), false),
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q6K => (f(Byte, false, true, 0), true),
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => return None,
        })
    }
}

/// 64-byte aligned, zero-initialised bytes.
pub struct AlignedBytes {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain owned memory with no tie to a thread: moving the owner moves the allocation.
unsafe impl Send for AlignedBytes {}
// SAFETY: `&AlignedBytes` only reads (`as_slice`); writing needs `&mut`.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return Self {
                ptr: std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8,
                len,
            };
        }
        let layout = Layout::from_size_align(len, 64).expect("allocation size");
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Self { ptr, len }
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes and uniquely owned.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: allocated with this layout in `zeroed`.
            unsafe { dealloc(self.ptr, Layout::from_size_align(self.len, 64).unwrap()) }
        }
    }
}

/// A weight matrix of `n` output rows by `k` inputs in the packed layout.
pub struct PackedMatrix {
    pub n: usize,
    pub k: usize,
    pub format: PackFormat,
    /// Converting from the file's format lost precision (re-quantized).
    pub lossy: bool,
    data: AlignedBytes,
}

/// A weight matrix as the kernels take it.
pub enum WeightMatrix {
    Packed(PackedMatrix),
    /// Row-major f32 (from F32/F16/BF16 tensors).
    F32 {
        n: usize,
        k: usize,
        data: Vec<f32>,
    },
}

impl WeightMatrix {
    pub fn n(&self) -> usize {
        match self {
            Self::Packed(p) => p.n,
            Self::F32 { n, .. } => *n,
        }
    }
    pub fn k(&self) -> usize {
        match self {
            Self::Packed(p) => p.k,
            Self::F32 { k, .. } => *k,
        }
    }
    pub fn bytes(&self) -> usize {
        match self {
            Self::Packed(p) => p.data.len,
            Self::F32 { data, .. } => data.len() * 4,
        }
    }

    /// Builds a matrix from row-major ggml tensor parts stacked on top of each other (used to fuse
    /// Q/K/V or gate/up projections into one matmul). Returns None when the parts cannot share one
    /// layout (different packed formats, or a part whose row count is not a multiple of 16).
    pub fn from_ggml_parts(parts: &[(GgmlType, &[u8], usize)], k: usize) -> Option<Self> {
        let first = parts.first()?.0;
        let packed = PackFormat::for_type(first);
        match packed {
            None => {
                // Plain floats: dequantize everything to f32.
                let n: usize = parts.iter().map(|p| p.2).sum();
                let mut data = vec![0f32; n * k];
                let mut row0 = 0;
                for &(ty, bytes, rows) in parts {
                    PackFormat::for_type(ty).is_none().then_some(())?;
                    let rb = ty.row_bytes(k)?;
                    for r in 0..rows {
                        ggml::dequantize_row(
                            ty,
                            &bytes[r * rb..(r + 1) * rb],
                            &mut data[(row0 + r) * k..(row0 + r + 1) * k],
                        );
                    }
                    row0 += rows;
                }
                Some(Self::F32 { n, k, data })
            }
            Some((format, _)) => {
                if !k.is_multiple_of(QBLOCK) {
                    return None;
                }
                let mut lossy = false;
                for (i, &(ty, _, rows)) in parts.iter().enumerate() {
                    let (f, l) = PackFormat::for_type(ty)?;
                    if f != format || (i + 1 < parts.len() && rows % GROUP != 0) {
                        return None;
                    }
                    lossy |= l;
                }
                let n: usize = parts.iter().map(|p| p.2).sum();
                let mut m = PackedMatrix::zeroed(n, k, format, lossy);
                let mut row0 = 0;
                for &(ty, bytes, rows) in parts {
                    let rb = ty.row_bytes(k)?;
                    for r in 0..rows {
                        m.set_row_from_ggml(row0 + r, ty, &bytes[r * rb..(r + 1) * rb]);
                    }
                    row0 += rows;
                }
                Some(Self::Packed(m))
            }
        }
    }
}

/// One 32-value block of one row, decoded: `w = d * (q - offset) + m`.
struct RowBlock {
    d: f32,
    m: f32,
    q: [u8; 32],
}

impl PackedMatrix {
    pub fn zeroed(n: usize, k: usize, format: PackFormat, lossy: bool) -> Self {
        assert!(k.is_multiple_of(QBLOCK));
        let groups = n.div_ceil(GROUP);
        let bytes = groups * (k / QBLOCK) * format.unit_bytes();
        Self {
            n,
            k,
            format,
            lossy,
            data: AlignedBytes::zeroed(bytes),
        }
    }

    pub fn groups(&self) -> usize {
        self.n.div_ceil(GROUP)
    }

    pub fn blocks(&self) -> usize {
        self.k / QBLOCK
    }

    /// The packed bytes of group `g` (all its blocks, in order).
    #[inline]
    pub fn group_data(&self, g: usize) -> &[u8] {
        let per = self.blocks() * self.format.unit_bytes();
        &self.data.as_slice()[g * per..(g + 1) * per]
    }

    pub fn data(&self) -> &[u8] {
        self.data.as_slice()
    }

    fn set_block(&mut self, row: usize, b: usize, blk: &RowBlock) {
        let f = self.format;
        let unit = f.unit_bytes();
        let (g, i) = (row / GROUP, row % GROUP);
        let at = (g * self.blocks() + b) * unit;
        let u = &mut self.data.as_mut_slice()[at..at + unit];
        match f.kind {
            PackKind::Nibble => {
                for j in 0..4 {
                    for t in 0..4 {
                        let lo = blk.q[4 * j + t] & 0x0F;
                        let hi = blk.q[16 + 4 * j + t] & 0x0F;
                        u[j * 64 + i * 4 + t] = lo | (hi << 4);
                    }
                }
            }
            PackKind::Byte => {
                for c in 0..8 {
                    for t in 0..4 {
                        u[c * 64 + i * 4 + t] = blk.q[4 * c + t];
                    }
                }
            }
        }
        let vb = f.values_bytes();
        let sb = f.scale_bytes();
        if f.f16_scales {
            u[vb + 2 * i..vb + 2 * i + 2].copy_from_slice(&f16::from_f32(blk.d).to_le_bytes());
            if f.has_min {
                let o = vb + sb + 2 * i;
                u[o..o + 2].copy_from_slice(&f16::from_f32(blk.m).to_le_bytes());
            }
        } else {
            u[vb + 4 * i..vb + 4 * i + 4].copy_from_slice(&blk.d.to_le_bytes());
            if f.has_min {
                let o = vb + sb + 4 * i;
                u[o..o + 4].copy_from_slice(&blk.m.to_le_bytes());
            }
        }
    }

    /// Packs one row of a ggml tensor of type `ty` (whose format must be this matrix's).
    pub fn set_row_from_ggml(&mut self, row: usize, ty: GgmlType, src: &[u8]) {
        let blocks = row_blocks(ty, src, self.k);
        for (b, blk) in blocks.iter().enumerate() {
            self.set_block(row, b, blk);
        }
    }

    /// The values of row `row` as f32 (for tests and debugging), from the packed form.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let f = self.format;
        let unit = f.unit_bytes();
        let (g, i) = (row / GROUP, row % GROUP);
        for b in 0..self.blocks() {
            let at = (g * self.blocks() + b) * unit;
            let u = &self.data.as_slice()[at..at + unit];
            let (d, m) = unit_scale_min(f, u, i);
            for kk in 0..QBLOCK {
                let q = unit_value(f, u, i, kk) as i32 - f.offset;
                out[b * QBLOCK + kk] = d * q as f32 + m;
            }
        }
    }
}

/// Scale and minimum of lane `i` of a unit.
#[inline]
pub fn unit_scale_min(f: PackFormat, u: &[u8], i: usize) -> (f32, f32) {
    let vb = f.values_bytes();
    let sb = f.scale_bytes();
    if f.f16_scales {
        let d = f16_at(u, vb + 2 * i);
        let m = if f.has_min {
            f16_at(u, vb + sb + 2 * i)
        } else {
            0.0
        };
        (d, m)
    } else {
        let rd = |o: usize| f32::from_le_bytes(u[o..o + 4].try_into().unwrap());
        let d = rd(vb + 4 * i);
        let m = if f.has_min { rd(vb + sb + 4 * i) } else { 0.0 };
        (d, m)
    }
}

/// The stored value (before offset) of lane `i`, position `kk` (0..32) of a unit.
#[inline]
pub fn unit_value(f: PackFormat, u: &[u8], i: usize, kk: usize) -> u8 {
    match f.kind {
        PackKind::Nibble => {
            let (j, hi) = if kk < 16 {
                (kk / 4, false)
            } else {
                ((kk - 16) / 4, true)
            };
            let byte = u[j * 64 + i * 4 + kk % 4];
            if hi {
                byte >> 4
            } else {
                byte & 0x0F
            }
        }
        PackKind::Byte => u[(kk / 4) * 64 + i * 4 + kk % 4],
    }
}

/// Decodes a ggml row into 32-value blocks of the packed form.
fn row_blocks(ty: GgmlType, src: &[u8], k: usize) -> Vec<RowBlock> {
    let nb = k / QBLOCK;
    let mut out = Vec::with_capacity(nb);
    let bb = ty.block_bytes();
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            for blk in src.chunks_exact(bb) {
                let (d, m, qs) = if ty == GgmlType::Q4_0 {
                    (f16_at(blk, 0), 0.0, &blk[2..18])
                } else {
                    (f16_at(blk, 0), f16_at(blk, 2), &blk[4..20])
                };
                let mut q = [0u8; 32];
                for j in 0..16 {
                    q[j] = qs[j] & 0x0F;
                    q[j + 16] = qs[j] >> 4;
                }
                out.push(RowBlock { d, m, q });
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            for blk in src.chunks_exact(bb) {
                let (d, m, qh_at) = if ty == GgmlType::Q5_0 {
                    (f16_at(blk, 0), 0.0, 2)
                } else {
                    (f16_at(blk, 0), f16_at(blk, 2), 4)
                };
                let qh = u32::from_le_bytes(blk[qh_at..qh_at + 4].try_into().unwrap());
                let qs = &blk[qh_at + 4..qh_at + 20];
                let mut q = [0u8; 32];
                for j in 0..16 {
                    q[j] = (qs[j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
                    q[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                }
                out.push(RowBlock { d, m, q });
            }
        }
        GgmlType::Q8_0 => {
            for blk in src.chunks_exact(bb) {
                let mut q = [0u8; 32];
                for j in 0..32 {
                    q[j] = (blk[2 + j] as i8 as i32 + 128) as u8;
                }
                out.push(RowBlock {
                    d: f16_at(blk, 0),
                    m: 0.0,
                    q,
                });
            }
        }
        GgmlType::Q8K => {
            for blk in src.chunks_exact(bb) {
                let d = f32::from_le_bytes(blk[0..4].try_into().unwrap());
                for s in 0..8 {
                    let mut q = [0u8; 32];
                    for j in 0..32 {
                        q[j] = (blk[4 + s * 32 + j] as i8 as i32 + 128) as u8;
                    }
                    out.push(RowBlock { d, m: 0.0, q });
                }
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            for blk in src.chunks_exact(bb) {
                let subs = if ty == GgmlType::Q4K {
                    ggml::q4_k_subblocks(blk)
                } else {
                    ggml::q5_k_subblocks(blk)
                };
                for (d, m, q) in subs {
                    out.push(RowBlock { d, m, q });
                }
            }
        }
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q6K => {
            let mut vals = vec![0f32; k];
            ggml::dequantize_row(ty, src, &mut vals);
            for xb in vals.chunks_exact(QBLOCK) {
                out.push(requantize_affine(xb));
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            unreachable!("float tensors are not packed")
        }
    }
    debug_assert_eq!(out.len(), nb);
    out
}

/// 8-bit affine quantization of 32 values: q = round((x - lo) / d), d = (hi - lo) / 255.
fn requantize_affine(x: &[f32]) -> RowBlock {
    let lo = x.iter().fold(f32::INFINITY, |a, &v| a.min(v));
    let hi = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let d = (hi - lo) / 255.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0u8; 32];
    for (qi, &v) in q.iter_mut().zip(x) {
        *qi = ((v - lo) * id).round().clamp(0.0, 255.0) as u8;
    }
    RowBlock { d, m: lo, q }
}

#[cfg(test)]
mod tests;

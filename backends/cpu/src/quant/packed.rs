//! The packed weight layout our matmul kernels read, computed from each ggml format's own bits: a
//! repack reorders a file's bytes (rows interleaved for SIMD) but never widens them, so a matrix
//! takes exactly the bytes of its tensor in the file (rows padded to a whole group of 16).
//!
//! Rows are taken 16 at a time (a "group"). The group's values come in 32-value blocks; in a
//! block, "register" `c` (0..8) is values `4c..4c+4` of each of the 16 rows, byte `p = 4 * row +
//! t` of a 64-byte vector holding value `4c + t` of that row: one 512-bit register of such bytes
//! against a broadcast 4-byte slice of one activation row is one `vpdpbusd`. The values are
//! unsigned; a format's offset is subtracted from the integer dot products. How a block's values
//! are stored (`Values`):
//!
//! - `Q4`: 4 planes of 64 bytes; plane `j` holds register `j` in its low nibbles and register
//!   `j + 4` in its high nibbles (Q4_0, Q4_1, Q4_K).
//! - `Q5`: `Q4`, then one 64-byte bit plane: bit `c` of byte `p` is bit 4 of register `c`'s value
//!   (Q5_0, Q5_1, Q5_K).
//! - `Q6`: `Q4`, then two 64-byte planes of 2-bit fields: bits `2(c % 4)..` of byte `p` of plane
//!   `c / 4` are bits 4-5 of register `c`'s value (Q6_K).
//! - `Q8`: 8 planes of 64 bytes, one per register (Q8_0, Q8_K; the signed values plus 128).
//! - `Q2`: two 64-byte planes of 2-bit fields, as `Q6`'s high bits but holding bits 0-1 (Q2_K).
//! - `Q3`: `Q2`, then one bit plane as `Q5`'s holding bit 2 (Q3_K; its value plus 4).
//! - `IQ4`: stored as `Q4`, the nibbles being indices into IQ4_NL's fixed table of 16 signed
//!   values; the kernels look each up (its value plus 128) as they unpack (IQ4_NL, IQ4_XS).
//!
//! Scales (`Scales`) come per block, or per super-block of 8 blocks (the K-quants' 256 values):
//! a super-block starts with a header (per row: the f16 `d`, and `dmin` where the format has
//! minimums), then the 8 blocks' scale fields, then the 8 blocks' values; formats without
//! super-blocks store each block as its scale fields then its values. Sub-block scales stay the
//! integers the file holds (6-bit for Q4_K/Q5_K/Q3_K/IQ4_XS, 8-bit for Q6_K, 4-bit for Q2_K), so
//! the kernels compute with exactly the file's numbers.

use std::alloc::{alloc, alloc_zeroed, dealloc, Layout};

use super::acts::{ActBlocks, QBLOCK};
use npu_gguf::quants::{self as ggml, f16_at, iq4_xs_scale, k4_scale_min, IQ4_VALUES};
use npu_gguf::GgmlType;

/// Rows per group.
pub const GROUP: usize = 16;

/// How a block's 32 values of each of a group's 16 rows are stored (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    Q4,
    Q5,
    Q6,
    Q8,
    Q2,
    Q3,
    IQ4,
}

/// How scales (and minimums) are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scales {
    /// Per block, 16 f16 scales: `w = d (q - offset)` (Q4_0, Q5_0, Q8_0).
    F16,
    /// Per block, 16 f16 scales then 16 f16 minimums: `w = d q + m` (Q4_1, Q5_1).
    F16Min,
    /// Per super-block, 16 f32 scales (Q8_K).
    F32Super,
    /// Q4_K/Q5_K: header `d` and `dmin` (f16, 16 each); per block 24 bytes of the rows' 6-bit
    /// scale `s` and minimum `m`: byte `i` is `s | (m >> 4) << 6`, the low nibbles of bytes
    /// 16..24 are rows 0..8's `m & 15`, the high nibbles rows 8..16's. `w = d s q - dmin m`.
    K4,
    /// Q6_K: header `d` (f16); per block the 16 rows' signed 8-bit scales of its first 16 values,
    /// then of its last 16. `w = d s (q - 32)`.
    K6,
    /// Q3_K: header `d`; per block the 6-bit scales of its two 16-value halves, stored as `K4`'s
    /// `s` and `m`. `w = d (s - 32) (q - 4)`.
    K3,
    /// Q2_K: header `d` and `dmin`; per block the file's scale bytes (4-bit scale, 4-bit minimum)
    /// of its first 16 values for the 16 rows, then of its last 16. `w = d s q - dmin m`.
    K2,
    /// IQ4_XS: header `d`; per block 12 bytes of the rows' 6-bit scales `s` (stored plus 32):
    /// the low nibbles of bytes 0..8 are rows 0..8's low 4 bits, the high nibbles rows 8..16's,
    /// and bits `2(i % 4)..` of byte `8 + i / 4` row `i`'s high 2 bits. `w = (d (s - 32)) q`, the
    /// block's scale `d (s - 32)` exact in f32 (an f16 times a 6-bit integer).
    Xs,
}

/// Numbers for the kernels' const generic parameters.
pub mod code {
    use super::{Scales, Values};

    pub const Q4: u8 = 0;
    pub const Q5: u8 = 1;
    pub const Q6: u8 = 2;
    pub const Q8: u8 = 3;
    pub const Q2: u8 = 4;
    pub const Q3: u8 = 5;
    pub const IQ4: u8 = 6;

    pub const F16: u8 = 0;
    pub const F16MIN: u8 = 1;
    pub const F32SUPER: u8 = 2;
    pub const K4: u8 = 3;
    pub const K6: u8 = 4;
    pub const K3: u8 = 5;
    pub const K2: u8 = 6;
    pub const XS: u8 = 7;

    pub const fn values(v: Values) -> u8 {
        match v {
            Values::Q4 => Q4,
            Values::Q5 => Q5,
            Values::Q6 => Q6,
            Values::Q8 => Q8,
            Values::Q2 => Q2,
            Values::Q3 => Q3,
            Values::IQ4 => IQ4,
        }
    }

    pub const fn scales(s: Scales) -> u8 {
        match s {
            Scales::F16 => F16,
            Scales::F16Min => F16MIN,
            Scales::F32Super => F32SUPER,
            Scales::K4 => K4,
            Scales::K6 => K6,
            Scales::K3 => K3,
            Scales::K2 => K2,
            Scales::Xs => XS,
        }
    }

    /// Bytes of one block's values.
    pub const fn values_bytes(v: u8) -> usize {
        match v {
            Q4 | IQ4 => 256,
            Q5 => 320,
            Q6 => 384,
            Q8 => 512,
            Q2 => 128,
            _ => 192,
        }
    }

    /// Blocks per super-block.
    pub const fn blocks_per_super(s: u8) -> usize {
        match s {
            F16 | F16MIN => 1,
            _ => 8,
        }
    }

    /// Bytes of a super-block's header.
    pub const fn header_bytes(s: u8) -> usize {
        match s {
            F16 | F16MIN => 0,
            F32SUPER | K4 | K2 => 64,
            _ => 32,
        }
    }

    /// Bytes of one block's scale fields.
    pub const fn scale_bytes(s: u8) -> usize {
        match s {
            F16 => 32,
            F16MIN => 64,
            F32SUPER => 0,
            K4 | K3 => 24,
            XS => 12,
            _ => 32,
        }
    }

    /// Bytes of one super-block of a group.
    pub const fn super_bytes(v: u8, s: u8) -> usize {
        header_bytes(s) + blocks_per_super(s) * (scale_bytes(s) + values_bytes(v))
    }

    /// Where a format's fields lie in a super-block of a group, for the SIMD kernels (constant
    /// for each pair of const parameters).
    #[derive(Clone, Copy)]
    pub struct Layout {
        /// Blocks per super-block.
        pub bps: usize,
        /// Bytes of one super-block.
        pub super_bytes: usize,
        header: usize,
        scales: usize,
        values: usize,
    }

    impl Layout {
        pub const fn of(v: u8, s: u8) -> Self {
            Self {
                bps: blocks_per_super(s),
                super_bytes: super_bytes(v, s),
                header: header_bytes(s),
                scales: scale_bytes(s),
                values: values_bytes(v),
            }
        }

        /// Offset of block `j`'s scale fields from its super-block's start.
        pub const fn scales_at(&self, j: usize) -> usize {
            self.header + j * self.scales
        }

        /// Offset of block `j`'s values from its super-block's start.
        pub const fn values_at(&self, j: usize) -> usize {
            self.header + self.bps * self.scales + j * self.values
        }
    }
}

/// How a packed matrix stores its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackFormat {
    pub values: Values,
    pub scales: Scales,
    /// Subtracted from every value (8 for Q4_0, 16 for Q5_0, 128 for Q8_0/Q8_K and the IQ4
    /// formats, 32 for Q6_K, 4 for Q3_K).
    pub offset: i32,
}

/// Where a block lies inside its group's bytes.
#[derive(Debug, Clone, Copy)]
pub struct BlockAt {
    /// The start of its super-block (the header).
    pub super_at: usize,
    /// Its scale fields.
    pub scales_at: usize,
    /// Its values.
    pub values_at: usize,
    /// Its index inside the super-block.
    pub j: usize,
}

impl PackFormat {
    fn codes(&self) -> (u8, u8) {
        (code::values(self.values), code::scales(self.scales))
    }
    pub fn values_bytes(&self) -> usize {
        code::values_bytes(self.codes().0)
    }
    pub fn blocks_per_super(&self) -> usize {
        code::blocks_per_super(self.codes().1)
    }
    pub fn header_bytes(&self) -> usize {
        code::header_bytes(self.codes().1)
    }
    pub fn scale_bytes(&self) -> usize {
        code::scale_bytes(self.codes().1)
    }
    /// Bytes of one super-block (one block for formats without super-blocks) of a group.
    pub fn super_bytes(&self) -> usize {
        let (v, s) = self.codes();
        code::super_bytes(v, s)
    }
    /// Values per row of one super-block: rows must hold a whole number of them.
    pub fn super_len(&self) -> usize {
        QBLOCK * self.blocks_per_super()
    }
    /// How the activations this format meets are quantized: as llama.cpp's `vec_dot_type` of
    /// the file's type (Q8_K for the K-quants and IQ4_XS, Q8_0 blocks for the others).
    pub fn act_blocks(&self) -> ActBlocks {
        match self.scales {
            Scales::K4 | Scales::K6 | Scales::K3 | Scales::K2 | Scales::Xs | Scales::F32Super => {
                ActBlocks::Q8K
            }
            Scales::F16 | Scales::F16Min => ActBlocks::Q8_0,
        }
    }

    /// Whether the kernels need the activations' per-16 sums or exact block sums (`ActSums`).
    pub fn needs_act_sums(&self) -> bool {
        matches!(
            self.scales,
            Scales::K4 | Scales::K6 | Scales::K3 | Scales::K2
        )
    }

    /// Where block `b` of a group lies in the group's bytes.
    #[inline]
    pub fn block_at(&self, b: usize) -> BlockAt {
        let bps = self.blocks_per_super();
        let (s, j) = (b / bps, b % bps);
        let super_at = s * self.super_bytes();
        let scales_at = super_at + self.header_bytes() + j * self.scale_bytes();
        let values_at =
            super_at + self.header_bytes() + bps * self.scale_bytes() + j * self.values_bytes();
        BlockAt {
            super_at,
            scales_at,
            values_at,
            j,
        }
    }

    /// The packed form of a ggml type, and whether converting to it loses precision (never: every
    /// packed format is computed from the file's own numbers).
    pub fn for_type(ty: GgmlType) -> Option<(PackFormat, bool)> {
        let f = |values, scales, offset| PackFormat {
            values,
            scales,
            offset,
        };
        use Scales::*;
        use Values::*;
        Some((
            match ty {
                GgmlType::Q4_0 => f(Q4, F16, 8),
                GgmlType::Q4_1 => f(Q4, F16Min, 0),
                GgmlType::Q5_0 => f(Q5, F16, 16),
                GgmlType::Q5_1 => f(Q5, F16Min, 0),
                GgmlType::Q8_0 => f(Q8, F16, 128),
                GgmlType::Q8K => f(Q8, F32Super, 128),
                GgmlType::Q4K => f(Q4, K4, 0),
                GgmlType::Q5K => f(Q5, K4, 0),
                GgmlType::Q6K => f(Q6, K6, 32),
                GgmlType::Q3K => f(Q3, K3, 4),
                GgmlType::Q2K => f(Q2, K2, 0),
                GgmlType::IQ4NL => f(IQ4, F16, 128),
                GgmlType::IQ4XS => f(IQ4, Xs, 128),
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => return None,
            },
            false,
        ))
    }
}

/// 64-byte aligned, zero-initialised bytes. An allocation of 2 MiB or more is aligned to 2 MiB
/// and the kernel is asked, before any page is touched, to back it with transparent huge pages:
/// weights are streamed whole every decode step, and with 4 KiB pages each page costs a TLB walk
/// and stops the hardware prefetchers at its edge.
pub struct AlignedBytes {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain owned memory with no tie to a thread: moving the owner moves the allocation.
unsafe impl Send for AlignedBytes {}
// SAFETY: `&AlignedBytes` only reads (`as_slice`); writing needs `&mut`.
unsafe impl Sync for AlignedBytes {}

/// The size from which `AlignedBytes` asks for huge pages (one x86-64 huge page).
const HUGE_PAGE: usize = 2 << 20;

impl AlignedBytes {
    fn layout(len: usize) -> Layout {
        let align = if len >= HUGE_PAGE { HUGE_PAGE } else { 64 };
        Layout::from_size_align(len, align).expect("allocation size")
    }

    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return Self {
                ptr: std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8,
                len,
            };
        }
        let layout = Self::layout(len);
        let ptr = if layout.align() == HUGE_PAGE {
            // SAFETY: non-zero size; the bytes are zeroed below before anything reads them.
            let ptr = unsafe { alloc(layout) };
            if !ptr.is_null() {
                crate::backend::advise_huge_pages(ptr as usize, len);
                // SAFETY: `ptr` is valid for `len` bytes (just allocated with that size).
                unsafe { std::ptr::write_bytes(ptr, 0, len) };
            }
            ptr
        } else {
            // SAFETY: non-zero size.
            unsafe { alloc_zeroed(layout) }
        };
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
            unsafe { dealloc(self.ptr, Self::layout(self.len)) }
        }
    }
}

/// A weight matrix of `n` output rows by `k` inputs in the packed layout.
pub struct PackedMatrix {
    pub n: usize,
    pub k: usize,
    pub format: PackFormat,
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
        /// How the activations are rounded before they meet these weights.
        acts: FloatActs,
    },
}

/// How activations are rounded before a matmul with float weights, as llama.cpp's CPU backend
/// feeds them: its F16 and BF16 matmuls take their inputs converted to the weights' type (the
/// type's `vec_dot_type`, and tinyBLAS on x86 takes F16 x F16 only), so an f16 file's every
/// projection sees f16-rounded activations. F32 weights take f32 activations as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatActs {
    /// Exact f32 (F32 weights, or the f32 reference mode).
    F32,
    /// Rounded to the nearest f16 (F16 weights).
    F16,
    /// Rounded to the nearest bf16 (BF16 weights).
    Bf16,
}

impl FloatActs {
    /// The rounding llama.cpp applies for weights stored as `ty` (None: not a float type).
    pub fn for_type(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::F32 => Some(Self::F32),
            GgmlType::F16 => Some(Self::F16),
            GgmlType::BF16 => Some(Self::Bf16),
            _ => None,
        }
    }
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
                // Plain floats: dequantize everything to f32. The parts must share one type, as
                // the activations are rounded once for the whole matrix.
                let acts = FloatActs::for_type(first)?;
                if parts.iter().any(|p| p.0 != first) {
                    return None;
                }
                let n: usize = parts.iter().map(|p| p.2).sum();
                let mut data = vec![0f32; n * k];
                let mut row0 = 0;
                for &(ty, bytes, rows) in parts {
                    PackFormat::for_type(ty).is_none().then_some(())?;
                    let rb = ty.row_bytes(k)?;
                    for r in 0..rows {
                        ggml::dequantize_row(
                            ty,
                            bytes.get(r * rb..(r + 1) * rb)?,
                            &mut data[(row0 + r) * k..(row0 + r + 1) * k],
                        )
                        .ok()?;
                    }
                    row0 += rows;
                }
                Some(Self::F32 { n, k, data, acts })
            }
            Some((format, _)) => {
                if !k.is_multiple_of(format.super_len()) {
                    return None;
                }
                for (i, &(ty, _, rows)) in parts.iter().enumerate() {
                    let (f, _) = PackFormat::for_type(ty)?;
                    if f != format || (i + 1 < parts.len() && rows % GROUP != 0) {
                        return None;
                    }
                }
                let n: usize = parts.iter().map(|p| p.2).sum();
                let mut m = PackedMatrix::zeroed(n, k, format);
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

/// One row's scales for one block, decoded (what the scalar kernel and the tests use).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LaneScales {
    /// The float scale: `d` (F16/F16Min/F32Super and the header `d` of K6/K3/K2), or `d s` (K4,
    /// and `d (s - 32)` for Xs: exact in f32, an f16 times a 6-bit integer).
    pub d: f32,
    /// The float minimum term: `m` (F16Min), `-dmin m` (K4, exact), or `-dmin` (K2).
    pub m: f32,
    /// Integer scales of the block's two 16-value halves (K6, K3 already less 32, K2).
    pub sc: [i32; 2],
    /// Integer minimums of the two halves (K2).
    pub mn: [i32; 2],
}

/// The two 6-bit numbers of row `i` in a `K4`/`K3` scale field.
#[inline]
pub fn six_bit_pair(s: &[u8], i: usize) -> (i32, i32) {
    let b = s[i];
    let lo = (s[16 + i % 8] >> (4 * (i / 8))) & 15;
    ((b & 63) as i32, (lo | ((b >> 6) << 4)) as i32)
}

/// Row `i`'s scales for the block at `at` of a group's bytes `gd`.
#[inline]
pub fn lane_scales(f: PackFormat, gd: &[u8], at: BlockAt, i: usize) -> LaneScales {
    let h = &gd[at.super_at..];
    let s = &gd[at.scales_at..];
    let mut l = LaneScales::default();
    match f.scales {
        Scales::F16 => l.d = f16_at(s, 2 * i),
        Scales::F16Min => {
            l.d = f16_at(s, 2 * i);
            l.m = f16_at(s, 32 + 2 * i);
        }
        Scales::F32Super => l.d = f32::from_le_bytes(h[4 * i..4 * i + 4].try_into().unwrap()),
        Scales::K4 => {
            let (sc, m) = six_bit_pair(s, i);
            l.d = f16_at(h, 2 * i) * sc as f32;
            l.m = m as f32 * -f16_at(h, 32 + 2 * i);
        }
        Scales::K3 => {
            let (s0, s1) = six_bit_pair(s, i);
            l.d = f16_at(h, 2 * i);
            l.sc = [s0 - 32, s1 - 32];
        }
        Scales::K6 => {
            l.d = f16_at(h, 2 * i);
            l.sc = [s[i] as i8 as i32, s[16 + i] as i8 as i32];
        }
        Scales::K2 => {
            l.d = f16_at(h, 2 * i);
            l.m = -f16_at(h, 32 + 2 * i);
            let (b0, b1) = (s[i] as i32, s[16 + i] as i32);
            l.sc = [b0 & 15, b1 & 15];
            l.mn = [b0 >> 4, b1 >> 4];
        }
        Scales::Xs => l.d = f16_at(h, 2 * i) * (xs_scale(s, i) - 32) as f32,
    }
    l
}

/// Row `i`'s 6-bit number (as stored, plus 32) in an `Xs` scale field.
#[inline]
pub fn xs_scale(s: &[u8], i: usize) -> i32 {
    let low = (s[i % 8] >> (4 * (i / 8))) & 15;
    let high = (s[8 + i / 4] >> (2 * (i % 4))) & 3;
    (low | (high << 4)) as i32
}

/// Writes row `i`'s 6-bit number into an `Xs` scale field.
fn put_xs_scale(s: &mut [u8], i: usize, v: u8) {
    debug_assert!(v < 64);
    let (at, shift) = (i % 8, 4 * (i / 8));
    s[at] = (s[at] & !(15 << shift)) | ((v & 15) << shift);
    let (at, shift) = (8 + i / 4, 2 * (i % 4));
    s[at] = (s[at] & !(3 << shift)) | ((v >> 4) << shift);
}

/// The stored (unsigned) value of row `i`, position `kk` (0..32), of a block's values `v`.
#[inline]
pub fn lane_value(kind: Values, v: &[u8], i: usize, kk: usize) -> u8 {
    let (c, p) = (kk / 4, i * 4 + kk % 4);
    match kind {
        Values::Q8 => v[c * 64 + p],
        Values::Q4 | Values::Q5 | Values::Q6 | Values::IQ4 => {
            let byte = v[(c % 4) * 64 + p];
            let nib = if c < 4 { byte & 15 } else { byte >> 4 };
            match kind {
                Values::Q5 => nib | (((v[256 + p] >> c) & 1) << 4),
                Values::Q6 => nib | (((v[256 + (c / 4) * 64 + p] >> (2 * (c % 4))) & 3) << 4),
                Values::IQ4 => (IQ4_VALUES[nib as usize] as i32 + 128) as u8,
                _ => nib,
            }
        }
        Values::Q2 | Values::Q3 => {
            let lo = (v[(c / 4) * 64 + p] >> (2 * (c % 4))) & 3;
            if kind == Values::Q3 {
                lo | (((v[128 + p] >> c) & 1) << 2)
            } else {
                lo
            }
        }
    }
}

/// Writes row `i`'s 32 values `u` into a block's values `v` (every byte of the row, so a row
/// packed again replaces what it held).
fn put_values(kind: Values, v: &mut [u8], i: usize, u: &[u8; 32]) {
    // The bits of register c's value at byte position t, `bits` wide from bit `from`, packed
    // `bits` apart for registers `cs`.
    let field = |t: usize, cs: std::ops::Range<usize>, from: u32, bits: u32| -> u8 {
        let mask = (1u8 << bits) - 1;
        cs.clone().fold(0u8, |acc, c| {
            acc | (((u[4 * c + t] >> from) & mask) << (bits as usize * (c - cs.start)))
        })
    };
    for t in 0..4 {
        let p = i * 4 + t;
        match kind {
            Values::Q8 => {
                for c in 0..8 {
                    v[c * 64 + p] = u[4 * c + t];
                }
            }
            Values::Q4 | Values::Q5 | Values::Q6 | Values::IQ4 => {
                for j in 0..4 {
                    v[j * 64 + p] = (u[4 * j + t] & 15) | ((u[16 + 4 * j + t] & 15) << 4);
                }
                if kind == Values::Q5 {
                    v[256 + p] = field(t, 0..8, 4, 1);
                } else if kind == Values::Q6 {
                    v[256 + p] = field(t, 0..4, 4, 2);
                    v[320 + p] = field(t, 4..8, 4, 2);
                }
            }
            Values::Q2 | Values::Q3 => {
                v[p] = field(t, 0..4, 0, 2);
                v[64 + p] = field(t, 4..8, 0, 2);
                if kind == Values::Q3 {
                    v[128 + p] = field(t, 0..8, 2, 1);
                }
            }
        }
    }
}

/// A 32-value block's 4-bit numbers from 16 bytes: values 0..16 in the low nibbles, 16..32 in
/// the high ones (IQ4_NL's layout, and each IQ4_XS sub-block's).
fn nibbles(q: &[u8]) -> [u8; 32] {
    std::array::from_fn(|j| if j < 16 { q[j] & 15 } else { q[j - 16] >> 4 })
}

/// Writes row `i`'s two 6-bit numbers into a `K4`/`K3` scale field.
fn put_six_bit_pair(s: &mut [u8], i: usize, a: u8, b: u8) {
    debug_assert!(a < 64 && b < 64);
    s[i] = a | ((b >> 4) << 6);
    let (at, shift) = (16 + i % 8, 4 * (i / 8));
    s[at] = (s[at] & !(15 << shift)) | ((b & 15) << shift);
}

impl PackedMatrix {
    pub fn zeroed(n: usize, k: usize, format: PackFormat) -> Self {
        assert!(
            k.is_multiple_of(format.super_len()),
            "rows of {k} are not whole blocks of {}",
            format.super_len()
        );
        let groups = n.div_ceil(GROUP);
        let bytes = groups * (k / format.super_len()) * format.super_bytes();
        Self {
            n,
            k,
            format,
            data: AlignedBytes::zeroed(bytes),
        }
    }

    pub fn groups(&self) -> usize {
        self.n.div_ceil(GROUP)
    }

    /// 32-value blocks per row.
    pub fn blocks(&self) -> usize {
        self.k / QBLOCK
    }

    /// Bytes of one group (all its blocks).
    pub fn group_bytes(&self) -> usize {
        self.k / self.format.super_len() * self.format.super_bytes()
    }

    /// The packed bytes of group `g` (all its blocks, in order).
    #[inline]
    pub fn group_data(&self, g: usize) -> &[u8] {
        let per = self.group_bytes();
        &self.data.as_slice()[g * per..(g + 1) * per]
    }

    pub fn data(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// Packs one row of a ggml tensor of type `ty` (whose format must be this matrix's).
    pub fn set_row_from_ggml(&mut self, row: usize, ty: GgmlType, src: &[u8]) {
        let f = self.format;
        assert_eq!(
            PackFormat::for_type(ty).map(|p| p.0),
            Some(f),
            "a {} row for a matrix of another format",
            ty.name()
        );
        assert_eq!(Some(src.len()), ty.row_bytes(self.k), "row length");
        let per = self.group_bytes();
        let (g, i) = (row / GROUP, row % GROUP);
        let gd = &mut self.data.as_mut_slice()[g * per..(g + 1) * per];
        let bb = ty.block_bytes();
        let h16 = |gd: &mut [u8], at: usize, v: &[u8]| gd[at..at + 2].copy_from_slice(&v[..2]);
        for (sb, blk) in src.chunks_exact(bb).enumerate() {
            let first = sb * ty.block_len() / QBLOCK;
            let at0 = f.block_at(first);
            let (hd, sc0, vals) = (at0.super_at, at0.scales_at, at0.values_at);
            let (sbytes, vbytes) = (f.scale_bytes(), f.values_bytes());
            let block = |j: usize| (sc0 + j * sbytes, vals + j * vbytes);
            match ty {
                GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
                    let has_min = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
                    let five = matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1);
                    let mut at = if has_min { 4 } else { 2 };
                    h16(gd, sc0 + 2 * i, &blk[0..]);
                    if has_min {
                        h16(gd, sc0 + 32 + 2 * i, &blk[2..]);
                    }
                    let qh = if five {
                        at += 4;
                        u32::from_le_bytes(blk[at - 4..at].try_into().unwrap())
                    } else {
                        0
                    };
                    let qs = &blk[at..at + 16];
                    let mut u = [0u8; 32];
                    for j in 0..16 {
                        u[j] = (qs[j] & 15) | ((((qh >> j) & 1) as u8) << 4);
                        u[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                    }
                    put_values(f.values, &mut gd[vals..vals + vbytes], i, &u);
                }
                GgmlType::Q8_0 => {
                    h16(gd, sc0 + 2 * i, blk);
                    let u: [u8; 32] =
                        std::array::from_fn(|j| (blk[2 + j] as i8 as i32 + 128) as u8);
                    put_values(f.values, &mut gd[vals..vals + vbytes], i, &u);
                }
                GgmlType::Q8K => {
                    gd[hd + 4 * i..hd + 4 * i + 4].copy_from_slice(&blk[0..4]);
                    for j in 0..8 {
                        let u: [u8; 32] =
                            std::array::from_fn(|t| (blk[4 + j * 32 + t] as i8 as i32 + 128) as u8);
                        let (_, v) = block(j);
                        put_values(f.values, &mut gd[v..v + vbytes], i, &u);
                    }
                }
                GgmlType::Q4K | GgmlType::Q5K => {
                    h16(gd, hd + 2 * i, &blk[0..]);
                    h16(gd, hd + 32 + 2 * i, &blk[2..]);
                    let scales = &blk[4..16];
                    let (qh, qs) = if ty == GgmlType::Q5K {
                        (Some(&blk[16..48]), &blk[48..176])
                    } else {
                        (None, &blk[16..144])
                    };
                    for j in 0..8 {
                        let (sc, m) = k4_scale_min(j, scales);
                        let q = &qs[(j / 2) * 32..(j / 2) * 32 + 32];
                        let u: [u8; 32] = std::array::from_fn(|l| {
                            let lo = if j % 2 == 0 { q[l] & 15 } else { q[l] >> 4 };
                            lo | qh.map_or(0, |h| ((h[l] >> j) & 1) << 4)
                        });
                        let (s, v) = block(j);
                        put_six_bit_pair(&mut gd[s..s + sbytes], i, sc, m);
                        put_values(f.values, &mut gd[v..v + vbytes], i, &u);
                    }
                }
                GgmlType::Q6K => {
                    h16(gd, hd + 2 * i, &blk[208..]);
                    let sc = &blk[192..208];
                    for j in 0..8 {
                        // Values 32j..32j+32 of the super-block: half h = j / 4 of the file's
                        // layout, quarter j % 4 of its 128 values.
                        let (half, qtr) = (j / 4, j % 4);
                        let ql = &blk[half * 64..half * 64 + 64];
                        let qh = &blk[128 + half * 32..128 + half * 32 + 32];
                        let u: [u8; 32] = std::array::from_fn(|l| {
                            let lo = match qtr {
                                0 => ql[l] & 15,
                                1 => ql[l + 32] & 15,
                                2 => ql[l] >> 4,
                                _ => ql[l + 32] >> 4,
                            };
                            lo | (((qh[l] >> (2 * qtr)) & 3) << 4)
                        });
                        let (s, v) = block(j);
                        gd[s + i] = sc[2 * j];
                        gd[s + 16 + i] = sc[2 * j + 1];
                        put_values(f.values, &mut gd[v..v + vbytes], i, &u);
                    }
                }
                GgmlType::Q3K | GgmlType::Q2K => {
                    let three = ty == GgmlType::Q3K;
                    let qs = if three { &blk[32..96] } else { &blk[16..80] };
                    let scale = |is: usize| -> u8 {
                        if three {
                            let sb = &blk[96..108];
                            let low = if is < 8 { sb[is] & 15 } else { sb[is - 8] >> 4 };
                            low | (((sb[8 + is % 4] >> (2 * (is / 4))) & 3) << 4)
                        } else {
                            blk[is]
                        }
                    };
                    if three {
                        h16(gd, hd + 2 * i, &blk[108..]);
                    } else {
                        h16(gd, hd + 2 * i, &blk[80..]);
                        h16(gd, hd + 32 + 2 * i, &blk[82..]);
                    }
                    for j in 0..8 {
                        // Values 32j..32j+32: half j / 4 of the file's layout, shift 2 (j % 4).
                        let (half, shift) = (j / 4, 2 * (j % 4));
                        let q = &qs[half * 32..half * 32 + 32];
                        let u: [u8; 32] = std::array::from_fn(|l| {
                            let lo = (q[l] >> shift) & 3;
                            if three {
                                lo | (((blk[l] >> (4 * half + j % 4)) & 1) << 2)
                            } else {
                                lo
                            }
                        });
                        let (s, v) = block(j);
                        if three {
                            put_six_bit_pair(
                                &mut gd[s..s + sbytes],
                                i,
                                scale(2 * j),
                                scale(2 * j + 1),
                            );
                        } else {
                            gd[s + i] = scale(2 * j);
                            gd[s + 16 + i] = scale(2 * j + 1);
                        }
                        put_values(f.values, &mut gd[v..v + vbytes], i, &u);
                    }
                }
                GgmlType::IQ4NL => {
                    h16(gd, sc0 + 2 * i, blk);
                    put_values(
                        f.values,
                        &mut gd[vals..vals + vbytes],
                        i,
                        &nibbles(&blk[2..18]),
                    );
                }
                GgmlType::IQ4XS => {
                    h16(gd, hd + 2 * i, blk);
                    for j in 0..8 {
                        let (s, v) = block(j);
                        put_xs_scale(&mut gd[s..s + sbytes], i, (iq4_xs_scale(blk, j) + 32) as u8);
                        let q = &blk[8 + 16 * j..8 + 16 * j + 16];
                        put_values(f.values, &mut gd[v..v + vbytes], i, &nibbles(q));
                    }
                }
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                    unreachable!("float tensors are not packed")
                }
            }
        }
    }

    /// The values of row `row` as f32 (for tests and debugging), from the packed form, computed
    /// as the reference dequantizer computes them.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let f = self.format;
        let (g, i) = (row / GROUP, row % GROUP);
        let gd = self.group_data(g);
        for b in 0..self.blocks() {
            let at = f.block_at(b);
            let l = lane_scales(f, gd, at, i);
            let v = &gd[at.values_at..at.values_at + f.values_bytes()];
            for kk in 0..QBLOCK {
                let q = lane_value(f.values, v, i, kk) as i32 - f.offset;
                let h = kk / 16;
                out[b * QBLOCK + kk] = match f.scales {
                    Scales::F16 | Scales::F32Super | Scales::Xs => q as f32 * l.d,
                    Scales::F16Min => q as f32 * l.d + l.m,
                    Scales::K4 => l.d * q as f32 + l.m,
                    Scales::K6 | Scales::K3 => l.d * l.sc[h] as f32 * q as f32,
                    // d s q - dmin m, as the reference computes it (`l.m` is -dmin).
                    Scales::K2 => l.d * l.sc[h] as f32 * q as f32 - -l.m * l.mn[h] as f32,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests;

//! Weights in the device's formats, prepared on the host from the tensors as the file stores them.
//!
//! Matrices: Q4_0, Q4_1 and Q8_0 keep their quantized values, repacked so quants and scales lie
//! in separate aligned arrays (see kernels/matmul.cu); F16 stays as is; every other type (F32,
//! BF16, Q5_x, K-quants by default) is dequantized with the reference dequantization and stored as F16. In
//! `MatmulMode::Dequantized` every matrix is dequantized once, here, to the activation dtype.
//!
//! With `NPU_SERVING_CUDA_KQUANTS=packed`, Q4_K matrices keep the file's bytes unchanged
//! and Q6_K's are split into quants, scales and d (`pack_kquant`): the device holds exactly the
//! file's bytes of them.
//!
//! Embedding tables keep the file's bytes for F32, F16, BF16, Q4_0, Q4_1 and Q8_0 (rows are
//! dequantized on lookup); other types are dequantized to F16 here.

use half::{bf16, f16};
use npu_backend::{BackendError, DType, HostTensor};
use npu_gguf::quants::dequantize_row;
use npu_gguf::GgmlType;

use crate::buffer::DeviceMem;
use crate::kernels::WeightFormat;

const NAME: &str = "cuda";

/// How a matrix's bytes are laid out on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatrixKind {
    /// Read by the GEMV kernels (and dequantized for cuBLAS).
    Packed(WeightFormat),
    /// Row-major `n x k` in this dtype, for cuBLAS only.
    Dense(DType),
    /// Q4_K blocks as the file stores them (144 bytes per 256 values), read by the packed Q4_K
    /// GEMV only (`NPU_SERVING_CUDA_KQUANTS=packed`; kernels/matmul_k.cu).
    Q4K,
    /// Q6_K blocks split into quants, scales and d (`pack_kquant`), read by the packed Q6_K
    /// GEMV only.
    Q6K,
}

/// A weight matrix on the device: `n` outputs of `k` inputs.
#[derive(Debug)]
pub struct CudaMatrix {
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) kind: MatrixKind,
    pub(crate) mem: DeviceMem,
    /// Byte offsets of the scales and minimums (packed quantized formats).
    pub(crate) scales_at: usize,
    pub(crate) mins_at: usize,
}

impl CudaMatrix {
    pub fn rows(&self) -> usize {
        self.n
    }
    pub fn cols(&self) -> usize {
        self.k
    }
    pub fn kind(&self) -> MatrixKind {
        self.kind
    }
}

/// An embedding table on the device: `rows` rows of `dim` values of ggml type `ty`.
#[derive(Debug)]
pub struct CudaEmbedding {
    pub(crate) ty: GgmlType,
    pub(crate) rows: usize,
    pub(crate) dim: usize,
    pub(crate) row_bytes: usize,
    pub(crate) mem: DeviceMem,
}

impl CudaEmbedding {
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn dim(&self) -> usize {
        self.dim
    }
}

/// Host bytes of a matrix in its device layout, before upload.
pub struct PackedHost {
    pub kind: MatrixKind,
    pub n: usize,
    pub k: usize,
    pub bytes: Vec<u8>,
    pub scales_at: usize,
    pub mins_at: usize,
}

fn bad(op: &'static str, message: String) -> BackendError {
    BackendError::BadArgument { op, message }
}

/// Checks a tensor's byte length against its shape; returns the row length in bytes.
pub fn check_tensor(op: &'static str, t: &HostTensor<'_>) -> Result<usize, BackendError> {
    let rb =
        t.ty.row_bytes(t.cols)
            .ok_or_else(|| BackendError::Unsupported {
                backend: NAME,
                what: format!("rows of {} {} values", t.cols, t.ty.name()),
            })?;
    if t.data.len() != rb * t.rows {
        return Err(bad(
            op,
            format!(
                "a {}x{} {} tensor needs {} bytes, got {}",
                t.rows,
                t.cols,
                t.ty.name(),
                rb * t.rows,
                t.data.len()
            ),
        ));
    }
    Ok(rb)
}

/// The packed format a GGUF type keeps on the device, if any.
fn packed_format(ty: GgmlType) -> Option<WeightFormat> {
    match ty {
        GgmlType::F16 => Some(WeightFormat::F16),
        GgmlType::Q4_0 => Some(WeightFormat::Q4_0),
        GgmlType::Q4_1 => Some(WeightFormat::Q4_1),
        GgmlType::Q8_0 => Some(WeightFormat::Q8_0),
        _ => None,
    }
}

fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// Dequantizes every row of `parts` (stacked) to f32 and hands each to `emit`.
fn for_each_row_f32(
    parts: &[HostTensor<'_>],
    k: usize,
    mut emit: impl FnMut(&[f32]),
) -> Result<(), BackendError> {
    let mut row = vec![0f32; k];
    for p in parts {
        let rb = check_tensor("load_matrix", p)?;
        for r in 0..p.rows {
            dequantize_row(p.ty, &p.data[r * rb..(r + 1) * rb], &mut row)
                .map_err(|e| bad("load_matrix", e.to_string()))?;
            emit(&row);
        }
    }
    Ok(())
}

/// `values` converted to `dt`'s bytes.
pub fn f32_to_bytes(values: &[f32], dt: DType, out: &mut Vec<u8>) {
    match dt {
        DType::F32 => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        DType::F16 => out.extend(values.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes())),
        DType::BF16 => out.extend(values.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes())),
        DType::I32 => unreachable!("f32 values are not converted to i32"),
    }
}

/// The device layout of `parts` stacked row-wise. `dense` asks for a dense matrix in that dtype
/// (dequantized once); otherwise quantized types keep their values. `Ok(None)`: the parts have
/// different types, so they are loaded apart.
pub fn pack_matrix(
    parts: &[HostTensor<'_>],
    dense: Option<DType>,
) -> Result<Option<PackedHost>, BackendError> {
    let Some(first) = parts.first() else {
        return Err(bad("load_matrix", "no tensors given".into()));
    };
    let k = first.cols;
    if k == 0 {
        return Err(bad("load_matrix", "a matrix with 0 inputs".into()));
    }
    for p in parts {
        if p.cols != k {
            return Err(bad(
                "load_matrix",
                format!("stacked parts have {} and {k} inputs", p.cols),
            ));
        }
        check_tensor("load_matrix", p)?;
    }
    if parts.iter().any(|p| p.ty != first.ty) {
        return Ok(None);
    }
    let n: usize = parts.iter().map(|p| p.rows).sum();
    if i32::try_from(n).is_err() || i32::try_from(k).is_err() {
        return Err(BackendError::Unsupported {
            backend: NAME,
            what: format!("a {n}x{k} matrix (dimensions over i32)"),
        });
    }
    let format = packed_format(first.ty);
    if let Some(dt) = dense {
        let mut bytes = Vec::with_capacity(n * k * dt.size());
        for_each_row_f32(parts, k, |row| f32_to_bytes(row, dt, &mut bytes))?;
        return Ok(Some(PackedHost {
            kind: MatrixKind::Dense(dt),
            n,
            k,
            bytes,
            scales_at: 0,
            mins_at: 0,
        }));
    }
    let Some(format) = format else {
        let mut bytes = Vec::with_capacity(n * k * 2);
        for_each_row_f32(parts, k, |row| f32_to_bytes(row, DType::F16, &mut bytes))?;
        return Ok(Some(PackedHost {
            kind: MatrixKind::Packed(WeightFormat::F16),
            n,
            k,
            bytes,
            scales_at: 0,
            mins_at: 0,
        }));
    };
    if format == WeightFormat::F16 {
        let mut bytes = Vec::with_capacity(n * k * 2);
        for p in parts {
            bytes.extend_from_slice(p.data);
        }
        return Ok(Some(PackedHost {
            kind: MatrixKind::Packed(format),
            n,
            k,
            bytes,
            scales_at: 0,
            mins_at: 0,
        }));
    }
    // Quantized: [quants][scales][mins], each 16-byte aligned.
    let blocks = n * (k / 32);
    let (qb, head) = match format {
        WeightFormat::Q4_0 => (16, 2),
        WeightFormat::Q4_1 => (16, 4),
        WeightFormat::Q8_0 => (32, 2),
        WeightFormat::F16 => unreachable!(),
    };
    let scales_at = align16(blocks * qb);
    let mins_at = align16(scales_at + blocks * 2);
    let total = if format == WeightFormat::Q4_1 {
        mins_at + blocks * 2
    } else {
        mins_at
    };
    let mut bytes = vec![0u8; total];
    let mut b = 0;
    for p in parts {
        for blk in p.data.chunks_exact(first.ty.block_bytes()) {
            bytes[b * qb..(b + 1) * qb].copy_from_slice(&blk[head..head + qb]);
            bytes[scales_at + 2 * b..scales_at + 2 * b + 2].copy_from_slice(&blk[0..2]);
            if format == WeightFormat::Q4_1 {
                bytes[mins_at + 2 * b..mins_at + 2 * b + 2].copy_from_slice(&blk[2..4]);
            }
            b += 1;
        }
    }
    debug_assert_eq!(b, blocks);
    Ok(Some(PackedHost {
        kind: MatrixKind::Packed(format),
        n,
        k,
        bytes,
        scales_at,
        mins_at,
    }))
}

/// `parts` stacked in a packed K-quant form, where every part is Q4_K or every part is Q6_K;
/// `Ok(None)` otherwise (they load as F16). Q4_K keeps the file's bytes unchanged
/// (`MatrixKind::Q4K`); Q6_K's 210-byte blocks are split into the quants (ql and qh, 192 bytes
/// a block), then the 16 scales of every block, then every block's d (`MatrixKind::Q6K`): the
/// same bytes, each part 16-byte aligned without padding.
pub fn pack_kquant(parts: &[HostTensor<'_>]) -> Result<Option<PackedHost>, BackendError> {
    let Some(first) = parts.first() else {
        return Err(bad("load_matrix", "no tensors given".into()));
    };
    let kind = match first.ty {
        GgmlType::Q4K => MatrixKind::Q4K,
        GgmlType::Q6K => MatrixKind::Q6K,
        _ => return Ok(None),
    };
    if parts
        .iter()
        .any(|p| p.ty != first.ty || p.cols != first.cols)
    {
        return Ok(None);
    }
    let k = first.cols;
    if k == 0 || k % 256 != 0 {
        return Err(bad(
            "load_matrix",
            format!(
                "a {} matrix of {k} inputs (a multiple of 256 needed)",
                first.ty.name()
            ),
        ));
    }
    for p in parts {
        check_tensor("load_matrix", p)?;
    }
    let n: usize = parts.iter().map(|p| p.rows).sum();
    if i32::try_from(n).is_err() || i32::try_from(k).is_err() {
        return Err(BackendError::Unsupported {
            backend: NAME,
            what: format!("a {n}x{k} matrix (dimensions over i32)"),
        });
    }
    let blocks = n * (k / 256);
    let bytes = if kind == MatrixKind::Q4K {
        let mut bytes = Vec::with_capacity(blocks * 144);
        for p in parts {
            bytes.extend_from_slice(p.data);
        }
        bytes
    } else {
        let mut bytes = vec![0u8; blocks * 210];
        let (sc_at, d_at) = (blocks * 192, blocks * 208);
        let all = parts.iter().flat_map(|p| p.data.chunks_exact(210));
        for (b, blk) in all.enumerate() {
            bytes[b * 192..(b + 1) * 192].copy_from_slice(&blk[..192]);
            bytes[sc_at + b * 16..sc_at + (b + 1) * 16].copy_from_slice(&blk[192..208]);
            bytes[d_at + b * 2..d_at + (b + 1) * 2].copy_from_slice(&blk[208..210]);
        }
        bytes
    };
    Ok(Some(PackedHost {
        kind,
        n,
        k,
        bytes,
        scales_at: 0,
        mins_at: 0,
    }))
}

/// An embedding table's device bytes and type: the file's bytes where `embed` reads the type,
/// else F16 values.
pub fn pack_embedding(t: &HostTensor<'_>) -> Result<(GgmlType, usize, Vec<u8>), BackendError> {
    let rb = check_tensor("load_embedding", t)?;
    if i32::try_from(t.rows).is_err() || i32::try_from(t.cols).is_err() {
        return Err(BackendError::Unsupported {
            backend: NAME,
            what: format!("a {}x{} embedding table", t.rows, t.cols),
        });
    }
    match t.ty {
        GgmlType::F32
        | GgmlType::F16
        | GgmlType::BF16
        | GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q8_0 => Ok((t.ty, rb, t.data.to_vec())),
        _ => {
            let mut bytes = Vec::with_capacity(t.rows * t.cols * 2);
            let mut row = vec![0f32; t.cols];
            for r in 0..t.rows {
                dequantize_row(t.ty, &t.data[r * rb..(r + 1) * rb], &mut row)
                    .map_err(|e| bad("load_embedding", e.to_string()))?;
                f32_to_bytes(&row, DType::F16, &mut bytes);
            }
            Ok((GgmlType::F16, t.cols * 2, bytes))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q8_block(d: f32, q: impl Fn(usize) -> i8) -> Vec<u8> {
        let mut b = f16::from_f32(d).to_le_bytes().to_vec();
        b.extend((0..32).map(|j| q(j) as u8));
        b
    }

    #[test]
    fn q8_0_repack_splits_quants_and_scales() {
        let mut data = q8_block(0.5, |j| j as i8 - 16);
        data.extend(q8_block(2.0, |j| 15 - j as i8));
        let t = HostTensor {
            ty: GgmlType::Q8_0,
            data: &data,
            rows: 2,
            cols: 32,
        };
        let p = pack_matrix(&[t], None).unwrap().unwrap();
        assert_eq!(p.kind, MatrixKind::Packed(WeightFormat::Q8_0));
        assert_eq!(p.scales_at, 64);
        assert_eq!(&p.bytes[0..32], &data[2..34]);
        assert_eq!(&p.bytes[32..64], &data[36..68]);
        assert_eq!(&p.bytes[64..66], &data[0..2]);
        assert_eq!(&p.bytes[66..68], &data[34..36]);
    }

    #[test]
    fn mixed_types_load_apart_and_bad_lengths_are_refused() {
        let q = q8_block(1.0, |_| 1);
        let f = vec![0u8; 64];
        let a = HostTensor {
            ty: GgmlType::Q8_0,
            data: &q,
            rows: 1,
            cols: 32,
        };
        let b = HostTensor {
            ty: GgmlType::F16,
            data: &f,
            rows: 1,
            cols: 32,
        };
        assert!(pack_matrix(&[a, b], None).unwrap().is_none());
        let short = HostTensor {
            ty: GgmlType::Q8_0,
            data: &q[..30],
            rows: 1,
            cols: 32,
        };
        assert!(matches!(
            pack_matrix(&[short], None),
            Err(BackendError::BadArgument { .. })
        ));
    }

    #[test]
    fn k_quants_pack_as_the_files_bytes_or_not_at_all() {
        let data: Vec<u8> = (0..2 * 144).map(|i| (i * 7) as u8).collect();
        let t = HostTensor {
            ty: GgmlType::Q4K,
            data: &data,
            rows: 1,
            cols: 512,
        };
        let p = pack_kquant(&[t, t]).unwrap().unwrap();
        assert_eq!((p.kind, p.n, p.k), (MatrixKind::Q4K, 2, 512));
        assert_eq!(p.bytes, [data.clone(), data.clone()].concat());
        let q = q8_block(1.0, |_| 1);
        let other = HostTensor {
            ty: GgmlType::Q8_0,
            data: &q,
            rows: 1,
            cols: 32,
        };
        assert!(pack_kquant(&[other]).unwrap().is_none());
        let short = HostTensor {
            ty: GgmlType::Q4K,
            data: &data[..100],
            rows: 1,
            cols: 512,
        };
        assert!(pack_kquant(&[short]).is_err());
        // Q6_K: quants, then scales, then d; the same bytes.
        let q6: Vec<u8> = (0..2 * 210).map(|i| (i * 5 + 1) as u8).collect();
        let t6 = HostTensor {
            ty: GgmlType::Q6K,
            data: &q6,
            rows: 1,
            cols: 512,
        };
        let p = pack_kquant(&[t6]).unwrap().unwrap();
        assert_eq!(p.kind, MatrixKind::Q6K);
        assert_eq!(p.bytes.len(), q6.len());
        assert_eq!(&p.bytes[192..384], &q6[210..402]);
        assert_eq!(&p.bytes[400..416], &q6[402..418]);
        assert_eq!(&p.bytes[418..420], &q6[418..420]);
    }

    #[test]
    fn other_types_become_f16_or_dense() {
        let vals: Vec<f32> = (0..64).map(|i| i as f32 * 0.25).collect();
        let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = HostTensor {
            ty: GgmlType::F32,
            data: &data,
            rows: 2,
            cols: 32,
        };
        let p = pack_matrix(&[t], None).unwrap().unwrap();
        assert_eq!(p.kind, MatrixKind::Packed(WeightFormat::F16));
        assert_eq!(p.bytes.len(), 128);
        assert_eq!(
            f16::from_le_bytes([p.bytes[10], p.bytes[11]]).to_f32(),
            vals[5]
        );
        let d = pack_matrix(&[t], Some(DType::BF16)).unwrap().unwrap();
        assert_eq!(d.kind, MatrixKind::Dense(DType::BF16));
        assert_eq!(d.bytes.len(), 128);
    }
}

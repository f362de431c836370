//! Host-side conversions of the backend's uploads and read-backs: host data to a buffer's element
//! type as bytes, and a view's bytes back into host rows.

use npu_backend::{BackendError, DType, HostSlice, HostSliceMut};

use crate::weights;

/// Converts `src` to `dst`'s element type, as bytes.
pub(crate) fn host_bytes(
    src: HostSlice<'_>,
    dt: DType,
    out: &mut Vec<u8>,
) -> Result<(), BackendError> {
    out.clear();
    match (src, dt) {
        (HostSlice::I32(s), DType::I32) => out.extend(s.iter().flat_map(|v| v.to_le_bytes())),
        (HostSlice::F32(s), DType::F32 | DType::F16 | DType::BF16) => {
            weights::f32_to_bytes(s, dt, out)
        }
        (HostSlice::I32(_), _) | (HostSlice::F32(_), DType::I32) => {
            return Err(BackendError::BadArgument {
                op: "upload",
                message: format!("host data of the wrong kind for a {} buffer", dt.name()),
            })
        }
    }
    Ok(())
}

/// Decodes `bytes` (one view's window, from its first element) into `dst`, row by row.
pub(crate) fn decode_rows(
    bytes: &[u8],
    dt: DType,
    rows: usize,
    cols: usize,
    stride: usize,
    dst: &mut HostSliceMut<'_>,
) {
    let es = dt.size();
    for r in 0..rows {
        let row = &bytes[r * stride * es..(r * stride + cols) * es];
        match dst {
            HostSliceMut::I32(d) => {
                for (o, b) in d[r * cols..(r + 1) * cols]
                    .iter_mut()
                    .zip(row.chunks_exact(4))
                {
                    *o = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            HostSliceMut::F32(d) => {
                let out = &mut d[r * cols..(r + 1) * cols];
                match dt {
                    DType::F32 => {
                        for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        }
                    }
                    DType::F16 => {
                        for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                            *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                        }
                    }
                    DType::BF16 => {
                        for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                            *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                        }
                    }
                    DType::I32 => unreachable!("checked by read_back"),
                }
            }
        }
    }
}

//! The backend's device objects: typed activation buffers ([`AscendBuffer`]), weight matrices in
//! the form their aclnn operator takes ([`AscendMatrix`]: INT4/INT8 with per-group antiquant
//! scale/offset for WeightQuantBatchMatmulV2, or 16-bit for Matmul) and embedding tables
//! ([`AscendEmbedding`]), their 16-bit parts in the activations' type (f16 or bf16). Each holds the device it lives on, so the context outlives every
//! allocation made in it whatever order the owners drop in.

use std::sync::Arc;

use half::f16;
use npu_backend::{BackendError, DType, HostTensor};
use npu_gguf::quants::dequantize_row;
use npu_gguf::GgmlType;

use crate::device::Device;
use crate::memory::DeviceBuffer as Mem;
use crate::tensor::{self, View};
use crate::weights::{self, QuantWeight};

use super::{err, NAME};

/// Bytes of `n` elements of `dtype`.
pub fn dtype_bytes(dtype: DType, n: usize) -> usize {
    n * dtype.size()
}

/// The aclnn element type of a buffer dtype.
pub fn acl_dtype(dtype: DType) -> tensor::DType {
    match dtype {
        DType::F32 => tensor::DType::F32,
        DType::F16 => tensor::DType::F16,
        DType::BF16 => tensor::DType::Bf16,
        DType::I32 => tensor::DType::I32,
    }
}

/// A zeroed device allocation of `bytes` (at least 64, so that an empty buffer still has an
/// address).
pub fn zeroed(dev: &Device, bytes: usize, what: &str) -> Result<Mem, BackendError> {
    let bytes = bytes.max(64);
    let mut m = Mem::alloc(dev.acl, bytes).map_err(|e| match e {
        crate::AscendError::Call { code, .. }
            if code == npu_ffi::types::ACL_ERROR_RT_MEMORY_ALLOCATION =>
        {
            BackendError::OutOfMemory {
                backend: NAME,
                what: what.to_string(),
                bytes,
            }
        }
        e => err(e),
    })?;
    m.fill(0, 0, bytes).map_err(err)?;
    Ok(m)
}

/// A device allocation holding `data` (synchronous copy into fresh memory, which no queued work
/// can touch).
pub fn upload_new(dev: &Device, data: &[u8], what: &str) -> Result<Mem, BackendError> {
    let bytes = data.len().max(64);
    let mut m = Mem::alloc(dev.acl, bytes).map_err(|e| match e {
        crate::AscendError::Call { code, .. }
            if code == npu_ffi::types::ACL_ERROR_RT_MEMORY_ALLOCATION =>
        {
            BackendError::OutOfMemory {
                backend: NAME,
                what: what.to_string(),
                bytes,
            }
        }
        e => err(e),
    })?;
    if !data.is_empty() {
        m.upload(0, data).map_err(err)?;
    }
    Ok(m)
}

pub fn f16_bytes(v: impl IntoIterator<Item = f16>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `vals` rounded to the 16-bit activation type `act` (f16 or bf16), as bytes.
pub fn half_bytes(act: DType, vals: &[f32]) -> Vec<u8> {
    match act {
        DType::BF16 => vals
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
        _ => f16_bytes(vals.iter().map(|&x| f16::from_f32(x))),
    }
}

/// A typed device buffer of `len` elements.
pub struct AscendBuffer {
    pub(crate) mem: Mem,
    dtype: DType,
    len: usize,
    /// For a loaded f32 vector: the same values in the activations' type (f16 or bf16), for ops
    /// whose other operands are activations (a bias added in place). Dropped when the buffer is written.
    pub(crate) half: Option<Mem>,
    _dev: Arc<Device>,
}

impl AscendBuffer {
    pub(crate) fn new(dev: &Arc<Device>, dtype: DType, len: usize) -> Result<Self, BackendError> {
        let bytes = dtype_bytes(dtype, len);
        Ok(Self {
            mem: zeroed(
                dev,
                bytes,
                &format!("a {len}-element {} buffer", dtype.name()),
            )?,
            dtype,
            len,
            half: None,
            _dev: dev.clone(),
        })
    }

    pub(crate) fn from_mem(
        dev: &Arc<Device>,
        mem: Mem,
        dtype: DType,
        len: usize,
        half: Option<Mem>,
    ) -> Self {
        Self {
            mem,
            dtype,
            len,
            half,
            _dev: dev.clone(),
        }
    }

    /// The device allocation (for code that builds its own aclnn calls over it).
    pub fn device_memory(&self) -> &Mem {
        &self.mem
    }
}

/// Waits for the stream's queued work before an allocation is freed, as a kernel may still use
/// it — only when work was queued since the last synchronization, so dropping a model's weights
/// after a step's sync waits once, not once per weight.
fn quiesce(dev: &Device) {
    dev.quiesce();
}

impl Drop for AscendBuffer {
    fn drop(&mut self) {
        quiesce(&self._dev);
    }
}

impl npu_backend::DeviceBuffer for AscendBuffer {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// How a matrix is stored on the device.
pub enum MatrixForm {
    /// WeightQuantBatchMatmulV2: `weight` (n, k) INT4 or INT8, `scale` and `offset` (n, k/32)
    /// in the activations' type (the operator takes them in x's); the operator sees them transposed. k is at most [`WQBMM_MAX_DIM`]; n may exceed it
    /// (a large vocabulary's output matrix), and is then multiplied in [`column_blocks`].
    Quant {
        /// The matrix's own allocation, or an expert stack's (at [`AscendMatrix::base`]).
        weight: Arc<Mem>,
        scale: Mem,
        offset: Option<Mem>,
        int4: bool,
    },
    /// Matmul: (n, k) in the activations' type (Matmul takes self and mat2 of one type), seen
    /// transposed. Its own allocation, or an expert stack's (at [`AscendMatrix::base`]).
    Half { data: Arc<Mem> },
}

/// A weight matrix of `n` outputs of `k` inputs.
pub struct AscendMatrix {
    pub n: usize,
    pub k: usize,
    pub form: MatrixForm,
    /// The file's type(s), for descriptions.
    pub source: GgmlType,
    /// The 16-bit type of `Half` data and of `Quant` scales and offsets (the activations').
    pub half: tensor::DType,
    /// For a symmetric INT4 expert in a grouped call (GroupedMatmulV4's per-group antiquant
    /// parameters, `[k/32, n]` contiguous): the scales copied once from their (n, k/32) storage
    /// on first use (`moe_ops::ffn`).
    pub(crate) grouped_scale: std::sync::OnceLock<Mem>,
    /// Where the weight starts in its allocation, in elements (0 unless it is one expert of a
    /// stack).
    pub base: usize,
    /// The expert stack this matrix is expert `.1` of (`moe_ops::stack`).
    pub(crate) stack: Option<(Arc<super::moe_ops::ExpertStack>, usize)>,
    pub(crate) _dev: Arc<Device>,
}

/// Which form a GGUF type takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    Quant(GgmlType),
    Half,
}

/// The largest k and n WeightQuantBatchMatmulV2 takes: its page refuses (ACLNN_ERR_PARAM_INVALID)
/// k or n outside [1, 65535].
pub const WQBMM_MAX_DIM: usize = 65535;

/// Widths of the column blocks a matrix of more outputs than [`WQBMM_MAX_DIM`] is multiplied in
/// are multiples of this (so each block's weight, scale and output start 32-byte aligned).
const BLOCK_COLS: usize = 64;

/// The column ranges (outputs) of one WeightQuantBatchMatmulV2 call each for `n` outputs: one
/// range when `n` is within [`WQBMM_MAX_DIM`], else the fewest near-equal blocks of at most that
/// many, each but the last a multiple of 64 wide.
pub fn column_blocks(n: usize) -> Vec<std::ops::Range<usize>> {
    if n <= WQBMM_MAX_DIM {
        return std::iter::once(0..n).collect();
    }
    let max = WQBMM_MAX_DIM / BLOCK_COLS * BLOCK_COLS;
    let count = n.div_ceil(max);
    let width = n.div_ceil(count).next_multiple_of(BLOCK_COLS);
    (0..n)
        .step_by(width)
        .map(|j| j..(j + width).min(n))
        .collect()
}

pub(crate) fn route(ty: GgmlType, k: usize, act: DType) -> Route {
    // Per-group antiquant needs the group (32) below k; k above the operator's range takes the
    // 16-bit Matmul form (outputs above it are split into column blocks instead).
    let grouped = k > weights::GROUP && k.is_multiple_of(weights::GROUP) && k <= WQBMM_MAX_DIM;
    match ty {
        GgmlType::Q4_0 | GgmlType::Q8_0 if grouped => Route::Quant(ty),
        // Q4_1's offset (8 + m/d, 8 to 24) would keep 1/16 of a step in bf16, per group: the
        // values are rounded one by one in the 16-bit form instead.
        GgmlType::Q4_1 if grouped && act != DType::BF16 => Route::Quant(ty),
        _ => Route::Half,
    }
}

fn bad(op: &'static str, message: String) -> BackendError {
    BackendError::BadArgument { op, message }
}

pub(crate) fn check_part(p: &HostTensor<'_>, k: usize) -> Result<(), BackendError> {
    if p.cols != k {
        return Err(bad(
            "load_matrix",
            format!("parts have {} and {k} inputs", p.cols),
        ));
    }
    match p.ty.row_bytes(p.cols) {
        Some(rb) if rb * p.rows == p.data.len() => Ok(()),
        _ => Err(bad(
            "load_matrix",
            format!(
                "{} bytes are not {} rows of {} {} values",
                p.data.len(),
                p.rows,
                p.cols,
                p.ty.name()
            ),
        )),
    }
}

/// Every value of `t` as f32, row by row.
pub fn dequantize(t: &HostTensor<'_>) -> Result<Vec<f32>, BackendError> {
    let rb = t.ty.row_bytes(t.cols).ok_or_else(|| {
        bad(
            "dequantize",
            format!("rows of {} {} values", t.cols, t.ty.name()),
        )
    })?;
    if rb * t.rows != t.data.len() {
        return Err(bad(
            "dequantize",
            format!(
                "{} bytes are not {} rows of {} {} values",
                t.data.len(),
                t.rows,
                t.cols,
                t.ty.name()
            ),
        ));
    }
    let mut out = vec![0f32; t.rows * t.cols];
    for (src, dst) in t.data.chunks_exact(rb).zip(out.chunks_exact_mut(t.cols)) {
        dequantize_row(t.ty, src, dst).map_err(|e| bad("dequantize", e.to_string()))?;
    }
    Ok(out)
}

impl Drop for AscendMatrix {
    fn drop(&mut self) {
        quiesce(&self._dev);
    }
}

/// f16 antiquant parameters in the activations' type (bf16: rounded once more).
pub(crate) fn narrow(act: DType, v: Vec<f16>) -> Vec<u8> {
    match act {
        DType::BF16 => v
            .into_iter()
            .flat_map(|x| half::bf16::from_f32(x.to_f32()).to_le_bytes())
            .collect(),
        _ => f16_bytes(v),
    }
}

impl AscendMatrix {
    /// The parts stacked in one matrix, or `None` when they take different forms.
    pub(crate) fn load(
        dev: &Arc<Device>,
        parts: &[HostTensor<'_>],
        act: DType,
    ) -> Result<Option<Self>, BackendError> {
        let Some(first) = parts.first() else {
            return Err(bad("load_matrix", "no parts".into()));
        };
        let k = first.cols;
        for p in parts {
            check_part(p, k)?;
        }
        let r = route(first.ty, k, act);
        if parts.iter().any(|p| route(p.ty, k, act) != r) {
            return Ok(None);
        }
        let n: usize = parts.iter().map(|p| p.rows).sum();
        let what = format!("a {n}x{k} {} matrix", first.ty.name());
        let form = match r {
            Route::Quant(ty) => {
                let mut qs = Vec::with_capacity(parts.len());
                for p in parts {
                    let q = match ty {
                        GgmlType::Q4_1 => weights::from_q4_1(p.data, p.rows, k),
                        GgmlType::Q4_0 => weights::from_q4_0(p.data, p.rows, k),
                        _ => weights::from_q8_0(p.data, p.rows, k),
                    }
                    .map_err(err)?;
                    qs.push(q);
                }
                let QuantWeight {
                    weight,
                    int4,
                    scale,
                    offset,
                    ..
                } = weights::stack(qs).map_err(err)?;
                MatrixForm::Quant {
                    weight: Arc::new(upload_new(dev, &weight, &what)?),
                    scale: upload_new(dev, &narrow(act, scale), &what)?,
                    offset: match offset {
                        Some(o) => Some(upload_new(dev, &narrow(act, o), &what)?),
                        None => None,
                    },
                    int4,
                }
            }
            Route::Half => {
                let mut bytes = Vec::with_capacity(n * k * 2);
                for p in parts {
                    bytes.extend(half_bytes(act, &dequantize(p)?));
                }
                MatrixForm::Half {
                    data: Arc::new(upload_new(dev, &bytes, &what)?),
                }
            }
        };
        Ok(Some(Self {
            n,
            k,
            form,
            source: first.ty,
            half: acl_dtype(act),
            grouped_scale: std::sync::OnceLock::new(),
            base: 0,
            stack: None,
            _dev: dev.clone(),
        }))
    }

    /// The weight as the operator sees it: (k, n), transposed over the (n, k) storage.
    pub fn weight_view(&self) -> View {
        self.weight_cols(0..self.n)
    }

    /// Outputs `cols` of the weight as the operator sees them: (k, cols), transposed over rows
    /// `cols` of the (n, k) storage.
    pub fn weight_cols(&self, cols: std::ops::Range<usize>) -> View {
        let k = self.k as i64;
        let dt = match &self.form {
            MatrixForm::Quant { int4: true, .. } => tensor::DType::I4,
            MatrixForm::Quant { int4: false, .. } => tensor::DType::I8,
            MatrixForm::Half { .. } => self.half,
        };
        View::strided(
            dt,
            &[k, cols.len() as i64],
            &[1, k],
            (self.base + cols.start * self.k) as i64,
        )
    }

    /// Antiquant scale/offset as the operator sees them: (k/32, n) over (n, k/32) storage.
    pub fn group_view(&self) -> View {
        self.group_cols(0..self.n)
    }

    /// Antiquant scale/offset of outputs `cols`: (k/32, cols) over rows `cols` of the storage.
    pub fn group_cols(&self, cols: std::ops::Range<usize>) -> View {
        let g = (self.k / weights::GROUP) as i64;
        View::strided(
            self.half,
            &[g, cols.len() as i64],
            &[1, g],
            cols.start as i64 * g,
        )
    }
}

/// An embedding table: `rows` rows of `cols` values in the activations' type (Embedding writes
/// the table's type).
pub struct AscendEmbedding {
    pub table: Mem,
    pub rows: usize,
    pub cols: usize,
    pub dtype: tensor::DType,
    _dev: Arc<Device>,
}

impl Drop for AscendEmbedding {
    fn drop(&mut self) {
        quiesce(&self._dev);
    }
}

impl AscendEmbedding {
    pub(crate) fn load(
        dev: &Arc<Device>,
        t: &HostTensor<'_>,
        act: DType,
    ) -> Result<Self, BackendError> {
        let vals = dequantize(t)?;
        let bytes = half_bytes(act, &vals);
        Ok(Self {
            table: upload_new(dev, &bytes, "the embedding table")?,
            rows: t.rows,
            cols: t.cols,
            dtype: acl_dtype(act),
            _dev: dev.clone(),
        })
    }

    pub fn view(&self) -> View {
        View::contiguous(self.dtype, &[self.rows as i64, self.cols as i64])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_blocks_cover_every_output_within_the_operators_range() {
        assert_eq!(column_blocks(49_152), vec![0..49_152]);
        assert_eq!(column_blocks(65_535), vec![0..65_535]);
        for n in [65_536, 70_000, 151_936, 262_144] {
            let b = column_blocks(n);
            assert_eq!(b.first().unwrap().start, 0);
            assert_eq!(b.last().unwrap().end, n);
            for w in b.windows(2) {
                assert_eq!(w[0].end, w[1].start, "n {n}: blocks follow each other");
            }
            for (i, r) in b.iter().enumerate() {
                assert!(r.len() <= WQBMM_MAX_DIM, "n {n}: block {r:?}");
                assert!(
                    i + 1 == b.len() || r.len().is_multiple_of(64),
                    "n {n}: block {r:?}"
                );
            }
            assert_eq!(b.len(), n.div_ceil(65_472), "n {n}: the fewest blocks");
        }
        // Q8_0/Q4_0 with k above the operator's range take the f16 form.
        assert_eq!(
            route(GgmlType::Q8_0, 4096, DType::F16),
            Route::Quant(GgmlType::Q8_0)
        );
        assert_eq!(route(GgmlType::Q8_0, 65_536, DType::F16), Route::Half);
        // bf16: Q8_0 keeps its INT8 form (scales in bf16); Q4_1 takes the 16-bit one.
        assert_eq!(
            route(GgmlType::Q8_0, 4096, DType::BF16),
            Route::Quant(GgmlType::Q8_0)
        );
        assert_eq!(
            route(GgmlType::Q4_1, 4096, DType::F16),
            Route::Quant(GgmlType::Q4_1)
        );
        assert_eq!(route(GgmlType::Q4_1, 4096, DType::BF16), Route::Half);
    }
}

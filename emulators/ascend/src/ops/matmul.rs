//! Matrix products: Matmul (f16/bf16/f32, `mat2` contiguous or a transposed view) and
//! WeightQuantBatchMatmulV2 (`y = x @ ((weight + antiquantOffset) * antiquantScale) + bias` with
//! INT8 or INT4 weights of shape (k, n), contiguous or transposed; per-tensor, per-channel or
//! per-group antiquant parameters with `antiquantGroupSize` a multiple of 32 in [32, k-1]; k and n
//! each in [1, 65535]).
//! Products accumulate in f32 and round to the output type, as the cube unit does.

use npu_ffi::types::*;

use super::{
    derived, derived_key, dot, dtype_in, invalid, kernel_common, nd, par_chunks, prepare, read,
    read_f32, write, Io, Kernel,
};
use crate::state::*;
use crate::view::{f16_at, read_elem, DType, View};

/// Element (i, j) of a 2-D view, read straight from its storage bytes.
struct Mat2<'a> {
    bytes: &'a [u8],
    dtype: DType,
    offset: i64,
    strides: [i64; 2],
}

impl<'a> Mat2<'a> {
    fn new(st: &'a State, v: &'a View) -> Result<Self, Fail> {
        Ok(Self {
            bytes: st.bytes(v.addr, v.storage_bytes())?,
            dtype: v.dtype,
            offset: v.offset,
            strides: [v.strides[0], v.strides[1]],
        })
    }
    #[inline]
    fn get(&self, i: i64, j: i64) -> f32 {
        let p = (self.offset + i * self.strides[0] + j * self.strides[1]) as usize;
        match self.dtype {
            DType::I4 => {
                let b = self.bytes[p / 2];
                let nib = if p.is_multiple_of(2) {
                    b & 0x0f
                } else {
                    b >> 4
                };
                ((nib as i8) << 4 >> 4) as f32
            }
            DType::I8 => self.bytes[p] as i8 as f32,
            DType::F16 => f16_at(self.bytes, p),
            dt => read_elem(self.bytes, dt, p) as f32,
        }
    }
}

/// A 1-D (n) or 2-D (rows, n) parameter seen as 2-D.
fn as_2d(v: &View) -> View {
    if v.rank() == 1 {
        View {
            dims: vec![1, v.dims[0]],
            strides: vec![0, v.strides[0]],
            ..v.clone()
        }
    } else {
        v.clone()
    }
}

pub(super) fn is_transposed_2d(v: &View) -> bool {
    v.rank() == 2 && v.strides[0] == 1 && (v.strides[1] == v.dims[0] || v.dims[1] == 1)
}

// ---- Matmul ---------------------------------------------------------------------------------

#[derive(Clone)]
struct Matmul {
    io: Io,
}

impl Kernel for Matmul {
    kernel_common!("aclnnMatmul");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let (a, b) = (&self.io.ins[0], &self.io.ins[1]);
        let (m, k) = (a.dims[0] as usize, a.dims[1] as usize);
        let x = read_f32(st, a)?;
        let out = product_by(st, &x, b, m, k)?;
        write(st, &self.io.outs[0], &out)
    }
}

/// `x (m, k, row-major) @ b` for a 2-D view `b` (k, n) of any strides, as (m, n) row-major with
/// f32 sums (Matmul's arithmetic; MatmulAllReduce's product); `b`'s columns are cached.
pub(super) fn product_by(
    st: &mut State,
    x: &[f32],
    b: &View,
    m: usize,
    k: usize,
) -> Result<Vec<f64>, Fail> {
    let n = b.dims[1] as usize;
    let key = derived_key(st, &[b], &[]);
    let w = derived(st, key, |st| {
        let w = Mat2::new(st, b)?;
        let mut cols = vec![0f32; n * k];
        par_chunks(&mut cols, k, n * k, |j0, part| {
            for (dj, col) in part.chunks_mut(k).enumerate() {
                for (kk, c) in col.iter_mut().enumerate() {
                    *c = w.get(kk as i64, (j0 + dj) as i64);
                }
            }
        });
        Ok(cols)
    })?;
    Ok(products(x, &w, m, k, n, None))
}

/// `x (m, k) @ cols (n rows of k)ᵀ (+ bias)` as (m, n) row-major, f32 sums.
fn products(
    x: &[f32],
    cols: &[f32],
    m: usize,
    k: usize,
    n: usize,
    bias: Option<&[f64]>,
) -> Vec<f64> {
    let mut by_col = vec![0.0f64; n * m];
    par_chunks(&mut by_col, m, m * n * k, |j0, part| {
        for (dj, outs) in part.chunks_mut(m).enumerate() {
            let j = j0 + dj;
            let col = &cols[j * k..(j + 1) * k];
            let b = bias.map_or(0.0, |b| b[j] as f32);
            for (i, o) in outs.iter_mut().enumerate() {
                *o = (dot(&x[i * k..(i + 1) * k], col) + b) as f64;
            }
        }
    });
    let mut out = vec![0.0f64; m * n];
    for j in 0..n {
        for i in 0..m {
            out[i * n + j] = by_col[j * m + i];
        }
    }
    out
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnMatmulGetWorkspaceSize(
    self_: *const aclTensor,
    mat2: *const aclTensor,
    out: *mut aclTensor,
    cubeMathType: i8,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnMatmul", workspaceSize, executor, |st| {
        let op = "aclnnMatmul";
        let a = st.tensor(self_, "self")?;
        let b = st.tensor(mat2, "mat2")?;
        let o = st.tensor(out, "out")?;
        for (w, v) in [("self", &a), ("mat2", &b), ("out", &o)] {
            dtype_in(op, w, v, &[DType::F16, DType::Bf16, DType::F32])?;
            nd(op, w, v)?;
            if v.rank() != 2 {
                return invalid(
                    op,
                    format!(
                        "{w} is {:?}: this emulation implements 2-D matmul only",
                        v.dims
                    ),
                );
            }
        }
        if a.dtype != b.dtype || o.dtype != a.dtype {
            return invalid(op, "self, mat2 and out must share one data type");
        }
        if !(0..=3).contains(&cubeMathType) {
            return invalid(
                op,
                format!("cubeMathType {cubeMathType} is not one of 0 (KEEP_DTYPE), 1, 2, 3"),
            );
        }
        if a.dims[1] != b.dims[0] || o.dims != [a.dims[0], b.dims[1]] {
            return invalid(
                op,
                format!(
                    "shapes self {:?} @ mat2 {:?} -> out {:?} do not agree",
                    a.dims, b.dims, o.dims
                ),
            );
        }
        Ok(Box::new(Matmul {
            io: Io {
                ins: vec![a, b],
                outs: vec![o],
            },
        }))
    })
}

// ---- WeightQuantBatchMatmulV2 -----------------------------------------------------------------

/// The page's range of k and n (ACLNN_ERR_PARAM_INVALID outside [1, 65535]).
const WQBMM_MAX_DIM: i64 = 65535;

#[derive(Clone)]
pub(super) struct Wqbmm {
    pub(super) io: Io,
    group: i64,
    has_offset: bool,
    has_bias: bool,
}

impl Kernel for Wqbmm {
    kernel_common!("aclnnWeightQuantBatchMatmulV2");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let out = self.product(st)?;
        write(st, &self.io.outs[0], &out)
    }
}

impl Wqbmm {
    /// `x @ ((weight + offset) * scale) (+ bias)` as (m, n) row-major, f32 sums (the
    /// dequantized weight in x's 16-bit type); WeightQuantMatmulAllReduce's product too.
    pub(super) fn product(&self, st: &mut State) -> Result<Vec<f64>, Fail> {
        let (xv, wv) = (&self.io.ins[0], &self.io.ins[1]);
        let (m, k, n) = (xv.dims[0], xv.dims[1], wv.dims[1]);
        let x = read_f32(st, xv)?;
        let sv = as_2d(&self.io.ins[2]);
        let ov = self.has_offset.then(|| as_2d(&self.io.ins[3]));
        let bias = if self.has_bias {
            Some(read(st, &self.io.ins[if self.has_offset { 4 } else { 3 }])?)
        } else {
            None
        };
        let mut sources = vec![wv, &sv];
        sources.extend(ov.as_ref());
        let key = derived_key(st, &sources, &[self.group]);
        let group = self.group;
        let bf16 = xv.dtype == DType::Bf16;
        let cols = derived(st, key, |st| {
            let w = Mat2::new(st, wv)?;
            let scale = Mat2::new(st, &sv)?;
            let offset = match &ov {
                Some(o) => Some(Mat2::new(st, o)?),
                None => None,
            };
            let per_tensor = sv.dims[0] == 1;
            let mut cols = vec![0f32; (n * k) as usize];
            par_chunks(&mut cols, k as usize, (n * k) as usize, |j0, part| {
                for (dj, col) in part.chunks_mut(k as usize).enumerate() {
                    let j = (j0 + dj) as i64;
                    let sj = if sv.dims[1] == 1 { 0 } else { j };
                    for (kk, c) in col.iter_mut().enumerate() {
                        let g = if per_tensor { 0 } else { kk as i64 / group };
                        let off = offset.as_ref().map_or(0.0, |o| o.get(g, sj));
                        // The antiquant parameters are in x's (16-bit) type: so is the
                        // dequantized weight.
                        let deq = (w.get(kk as i64, j) + off) * scale.get(g, sj);
                        *c = if bf16 {
                            half::bf16::from_f32(deq).to_f32()
                        } else {
                            half::f16::from_f32(deq).to_f32()
                        };
                    }
                }
            });
            Ok(cols)
        })?;
        Ok(products(
            &x,
            &cols,
            m as usize,
            k as usize,
            n as usize,
            bias.as_deref(),
        ))
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnWeightQuantBatchMatmulV2GetWorkspaceSize(
    x: *const aclTensor,
    weight: *const aclTensor,
    antiquantScale: *const aclTensor,
    antiquantOffsetOptional: *const aclTensor,
    quantScaleOptional: *const aclTensor,
    quantOffsetOptional: *const aclTensor,
    biasOptional: *const aclTensor,
    antiquantGroupSize: core::ffi::c_int,
    y: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare(
        "aclnnWeightQuantBatchMatmulV2",
        workspaceSize,
        executor,
        |st| {
            let op = "aclnnWeightQuantBatchMatmulV2";
            let xv = st.tensor(x, "x")?;
            let wv = st.tensor(weight, "weight")?;
            let sv = st.tensor(antiquantScale, "antiquantScale")?;
            let ov = st.opt_tensor(antiquantOffsetOptional, "antiquantOffsetOptional")?;
            let bv = st.opt_tensor(biasOptional, "biasOptional")?;
            let yv = st.tensor(y, "y")?;
            if !quantScaleOptional.is_null() || !quantOffsetOptional.is_null() {
                return invalid(op, "output quantization (quantScaleOptional/quantOffsetOptional) is not implemented by this emulation");
            }
            let group = antiquantGroupSize as i64;
            Ok(Box::new(checked_wqbmm(op, xv, wv, sv, ov, bv, yv, group)?))
        },
    )
}

/// WeightQuantBatchMatmulV2's checks of its tensors (as its page states them) and its kernel;
/// WeightQuantMatmulAllReduce's product takes the same (its x1 and output seen as 2-D).
#[allow(clippy::too_many_arguments)]
pub(super) fn checked_wqbmm(
    op: &str,
    xv: View,
    wv: View,
    sv: View,
    ov: Option<View>,
    bv: Option<View>,
    yv: View,
    group: i64,
) -> Result<Wqbmm, Fail> {
    dtype_in(op, "x", &xv, &[DType::F16, DType::Bf16])?;
    dtype_in(op, "weight", &wv, &[DType::I8, DType::I4])?;
    for (w, v) in [
        ("x", &xv),
        ("weight", &wv),
        ("antiquantScale", &sv),
        ("y", &yv),
    ] {
        nd(op, w, v)?;
    }
    if xv.rank() != 2 || wv.rank() != 2 || yv.rank() != 2 {
        return invalid(
            op,
            format!(
                "x {:?}, weight {:?} and y {:?} must be 2-D",
                xv.dims, wv.dims, yv.dims
            ),
        );
    }
    let (m, k, n) = (xv.dims[0], xv.dims[1], wv.dims[1]);
    if wv.dims[0] != k || yv.dims != [m, n] {
        return invalid(
            op,
            format!(
                "shapes x {:?}, weight {:?} (k, n), y {:?} do not agree",
                xv.dims, wv.dims, yv.dims
            ),
        );
    }
    if !(1..=WQBMM_MAX_DIM).contains(&k) || !(1..=WQBMM_MAX_DIM).contains(&n) {
        return invalid(
            op,
            format!("k {k} and n {n} must each be in [1, {WQBMM_MAX_DIM}]"),
        );
    }
    if !xv.is_contiguous() && !is_transposed_2d(&xv) {
        return invalid(op, "x must be contiguous or a transposed view");
    }
    if !wv.is_contiguous() && !is_transposed_2d(&wv) {
        return invalid(op, format!("weight strides {:?} are neither contiguous nor transposed (the only non-contiguous case supported)", wv.strides));
    }
    let mut layouts = vec![("antiquantScale", &sv), ("y", &yv)];
    layouts.extend(ov.as_ref().map(|o| ("antiquantOffsetOptional", o)));
    super::contiguity::check(op, &layouts)?;
    if wv.dtype == DType::I4 {
        let inner = if wv.is_contiguous() { n } else { k };
        if inner % 2 != 0 {
            return invalid(
                op,
                format!("INT4 weight needs an even inner axis, got {inner}"),
            );
        }
    }
    if sv.dtype != xv.dtype || yv.dtype != xv.dtype {
        return invalid(
            op,
            format!(
                "antiquantScale ({}) and y ({}) must have x's data type ({})",
                sv.dtype.name(),
                yv.dtype.name(),
                xv.dtype.name()
            ),
        );
    }
    let s2 = as_2d(&sv);
    let per_tensor = sv.numel() == 1 && sv.rank() <= 2;
    let per_channel = s2.dims == [1, n];
    if group == 0 {
        if !per_tensor && !per_channel {
            return invalid(
                op,
                format!(
                    "antiquantScale shape {:?} must be (1,), (1, 1), (n,) or (1, n) without groups",
                    sv.dims
                ),
            );
        }
    } else {
        if group < 32 || group >= k || group % 32 != 0 {
            return invalid(
                op,
                format!(
                    "antiquantGroupSize {group} must be a multiple of 32 in [32, k-1] (k = {k})"
                ),
            );
        }
        let want = [(k + group - 1) / group, n];
        if sv.dims != want {
            return invalid(
                op,
                format!(
                    "per-group antiquantScale shape {:?} must be (ceil(k/group), n) = {want:?}",
                    sv.dims
                ),
            );
        }
    }
    if let Some(o) = &ov {
        if o.dims != sv.dims || o.dtype != sv.dtype {
            return invalid(
                op,
                "antiquantOffsetOptional must have antiquantScale's shape and data type",
            );
        }
    }
    if let Some(b) = &bv {
        let want = if xv.dtype == DType::F16 {
            DType::F16
        } else {
            DType::F32
        };
        if b.dtype != want || !(b.dims == [n] || b.dims == [1, n]) {
            return invalid(
                op,
                format!(
                    "biasOptional must be {} of shape (n,) or (1, n)",
                    want.name()
                ),
            );
        }
    }
    let mut ins = vec![xv, wv, sv];
    let has_offset = ov.is_some();
    ins.extend(ov);
    let has_bias = bv.is_some();
    ins.extend(bv);
    Ok(Wqbmm {
        io: Io {
            ins,
            outs: vec![yv],
        },
        group: group.max(1),
        has_offset,
        has_bias,
    })
}

const _: () = {
    use npu_ffi::aclnn::ops::sig;
    let _: sig::aclnnMatmulGetWorkspaceSize = aclnnMatmulGetWorkspaceSize;
    let _: sig::aclnnWeightQuantBatchMatmulV2GetWorkspaceSize =
        aclnnWeightQuantBatchMatmulV2GetWorkspaceSize;
};

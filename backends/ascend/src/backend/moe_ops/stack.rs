//! Expert stacks: one projection of every expert of a mixture-of-experts layer in one device
//! allocation, expert `e`'s (n, k) rows at `e·n·k`, so that GroupedMatmulV4 takes them as its
//! single 3-D weight — the page's "单单单" scenario (x, weight and out one tensor each,
//! groupType 0), weight (E, K, N) seen transposed over the (E, n, k) storage, at most 1024
//! groups and no 128-tensor list.
//!
//! Each expert is still an [`AscendMatrix`] (its weight a view into the stack at
//! [`AscendMatrix::base`]), so one matmul per expert keeps working where the grouped call does
//! not apply. Two forms, chosen per projection at load ([`AscendMatrix::load_stack`]):
//! - INT4 with a symmetric f16 scale per 32 inputs, when every part is Q4_0: the page's A16W4
//!   per-group antiquant, its weight-single scale `[g, G, n]` — an (E, k/32, n) allocation
//!   written at load beside each expert's (n, k/32) scales (WeightQuantBatchMatmulV2's, for a
//!   matmul per expert): the scales are held twice (2 bytes per 32 weights each).
//! - f16 otherwise: every value dequantized at load, as the backend already stores K-quants.
//!   Q8_0 and Q4_1 experts are among them, as the page has no grouped form for their scales
//!   (INT8 takes a scale per output channel only, per-group INT4 is symmetric only): they take
//!   16 bits a weight instead of the file's 8.5 (Q8_0, 1.88×) or 5 (Q4_1, 3.2×).
//!
//! Each expert's bytes are uploaded into the stack as they are made: the host holds one expert
//! at a time and the device the stack alone (no second copy).

use std::sync::Arc;

use npu_backend::{BackendError, DType, HostTensor};
use npu_gguf::GgmlType;

use super::super::err;
use super::super::objects::{
    check_part, dequantize, half_bytes, narrow, route, upload_new, zeroed, AscendMatrix,
    MatrixForm, Route,
};
use crate::device::Device;
use crate::memory::DeviceBuffer as Mem;
use crate::weights::{self, QuantWeight, GROUP};

/// The most groups GroupedMatmulV4 takes with one 3-D weight ("groupListOptional第1维最大支持
/// 1024，即最多支持1024个group").
pub(crate) const GMM_MAX_GROUPS: usize = 1024;

/// One projection of `count` experts, (count, n, k), in one allocation.
pub(crate) struct ExpertStack {
    /// (count, n, k): f16, or INT4 (two values a byte).
    pub(crate) weight: Arc<Mem>,
    /// INT4: the (count, k/32, n) f16 scales, contiguous.
    pub(crate) scale: Option<Mem>,
    pub(crate) count: usize,
}

fn bad(message: String) -> BackendError {
    BackendError::BadArgument {
        op: "load_experts",
        message,
    }
}

/// `v` (n, g) row-major, transposed to (g, n).
fn transpose<T: Copy>(v: &[T], n: usize, g: usize) -> Vec<T> {
    (0..g)
        .flat_map(|j| (0..n).map(move |i| (i, j)))
        .map(|(i, j)| v[i * g + j])
        .collect()
}

impl AscendMatrix {
    /// Every expert's matrix of one projection in one [`ExpertStack`] (`experts[e]` the parts
    /// of expert `e`, stacked by rows as `load_matrix` stacks them; every expert the same
    /// shape), f16 activations.
    pub(crate) fn load_stack(
        dev: &Arc<Device>,
        experts: &[Vec<HostTensor<'_>>],
    ) -> Result<Vec<Self>, BackendError> {
        let act = DType::F16;
        let Some(first) = experts.first().and_then(|p| p.first()) else {
            return Err(bad("no experts, or an expert of no parts".into()));
        };
        let (k, count) = (first.cols, experts.len());
        let mut n = None;
        for (e, parts) in experts.iter().enumerate() {
            for p in parts {
                check_part(p, k)?;
            }
            let rows: usize = parts.iter().map(|p| p.rows).sum();
            if *n.get_or_insert(rows) != rows || parts.is_empty() {
                return Err(bad(format!(
                    "expert {e} has {rows} outputs, expert 0 {}",
                    n.unwrap_or(0)
                )));
            }
        }
        let n = n.unwrap_or(0);
        let int4 = experts
            .iter()
            .flatten()
            .all(|p| route(p.ty, k, act) == Route::Quant(GgmlType::Q4_0));
        let what = format!("{count} experts' {n}x{k} {} matrices", first.ty.name());
        let per = if int4 { n * k / 2 } else { n * k * 2 };
        let mut weight = zeroed(dev, count * per, &what)?;
        let g = k / GROUP;
        let mut scale = match int4 {
            true => Some(zeroed(dev, count * g * n * 2, &what)?),
            false => None,
        };
        // Per expert: its (n, k/32) scales (INT4), else nothing.
        let mut own_scales = Vec::with_capacity(count);
        for (e, parts) in experts.iter().enumerate() {
            if int4 {
                let mut qs = Vec::with_capacity(parts.len());
                for p in parts {
                    qs.push(weights::from_q4_0(p.data, p.rows, k).map_err(err)?);
                }
                let QuantWeight {
                    weight: w,
                    scale: s,
                    ..
                } = weights::stack(qs).map_err(err)?;
                weight.upload(e * per, &w).map_err(err)?;
                if let Some(sm) = scale.as_mut() {
                    sm.upload(e * g * n * 2, &narrow(act, transpose(&s, n, g)))
                        .map_err(err)?;
                }
                own_scales.push(Some(upload_new(dev, &narrow(act, s), &what)?));
            } else {
                let mut bytes = Vec::with_capacity(per);
                for p in parts {
                    bytes.extend(half_bytes(act, &dequantize(p)?));
                }
                weight.upload(e * per, &bytes).map_err(err)?;
                own_scales.push(None);
            }
        }
        let weight = Arc::new(weight);
        let stack = Arc::new(ExpertStack {
            weight: weight.clone(),
            scale,
            count,
        });
        let elems = n * k;
        Ok(own_scales
            .into_iter()
            .enumerate()
            .map(|(e, s)| Self {
                n,
                k,
                form: match s {
                    Some(scale) => MatrixForm::Quant {
                        weight: weight.clone(),
                        scale,
                        offset: None,
                        int4: true,
                    },
                    None => MatrixForm::Half {
                        data: weight.clone(),
                    },
                },
                source: first.ty,
                half: crate::tensor::DType::F16,
                grouped_scale: std::sync::OnceLock::new(),
                base: e * elems,
                stack: Some((stack.clone(), e)),
                _dev: dev.clone(),
            })
            .collect())
    }
}

/// The stack `mats` are, in order, every expert of (none when they are not).
pub(crate) fn stack_of(mats: &[AscendMatrix]) -> Option<&ExpertStack> {
    let (s0, _) = mats.first()?.stack.as_ref()?;
    let whole = s0.count == mats.len()
        && mats.iter().enumerate().all(|(e, m)| {
            m.stack
                .as_ref()
                .is_some_and(|(s, i)| Arc::ptr_eq(s, s0) && *i == e)
        });
    whole.then_some(&**s0)
}

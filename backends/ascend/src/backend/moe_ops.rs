//! Mixture-of-experts routing and the routed experts' SwiGLU FFN ([`Capability::Moe`],
//! Qwen3-MoE, DeepSeek-2), as documented aclnn calls on the agent's stream.
//!
//! `moe_route(logits, k, normalize, ids, weights)`:
//! 1. Cast: the f16 router logits to an f32 scratch (MoeGatingTopKSoftmaxV2's yOut has x's type,
//!    and the weights are f32).
//! 2. MoeGatingTopKSoftmaxV2(x, null, k, renorm, false, yOut = weights, expertIdxOut = ids,
//!    null). Without normalisation, renorm 0: softmax over the experts, then the k most probable.
//!    With it, renorm 1: the k largest logits, then softmax over those k — which is
//!    `p_j / Σ_chosen p` exactly (the other experts' exponentials cancel). ggml clamps that sum
//!    at 6.103515625e-5 before dividing; the sum of the k largest of E probabilities is at least
//!    k/E, so the clamp cannot bind while E ≤ 8192·k, which is checked (more experts are
//!    refused rather than computed without the clamp).
//!
//! `moe_ffn`: the experts' FFN, the tokens grouped by expert on the device (MoeInitRoutingV2,
//! GroupedMatmulV4, MoeFinalizeRoutingV2), is [`ffn`]; the experts' weights side by side for it,
//! one allocation per projection, [`stack`].

mod ffn;
mod stack;

pub(super) use ffn::MoeBufs;
pub(crate) use stack::{ExpertStack, GMM_MAX_GROUPS};

use npu_backend::{BackendError, DType, View, ViewMut};

use super::layer_ops::{bad, dense, tview, want_f16};
use super::objects::AscendBuffer;
use super::{err, AscendBackend};
use crate::memory::DeviceBuffer as Mem;
use crate::reuse::{Arg, Launcher};
use crate::tensor::{self, View as TView};

/// ggml's floor of the chosen weights' sum (see the module note on why it cannot bind).
const MIN_SUM: f64 = 6.103_515_625e-5;

/// `dst = cast(src)` (aclnnCast: between float types, or INT32 to INT64).
fn cast(
    ops: &mut Launcher,
    src: (&Mem, TView),
    dst: (&Mem, TView),
    to: npu_ffi::types::aclDataType,
) -> Result<(), BackendError> {
    let api = ops.runner.acl().api.ops;
    let pc = api.aclnnCastGetWorkspaceSize;
    ops.call(
        "aclnnCast",
        api.aclnnCast,
        &[
            Arg::input("self", 0, src.0, src.1),
            Arg::output("out", 0, dst.0, dst.1),
        ],
        &[to as i64],
        &[],
        // SAFETY (closure): live tensors and out-pointers from the launcher.
        Box::new(move |ts, _, w, e| unsafe { pc(ts[0].raw(), to, ts[1].raw(), w, e) }),
    )
    .map_err(err)
}

impl AscendBackend {
    pub(super) fn op_moe_route(
        &mut self,
        logits: View<'_, AscendBuffer>,
        k: usize,
        normalize: bool,
        ids: ViewMut<'_, AscendBuffer>,
        weights: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "moe_route";
        let (ll, il, wl) = (logits.layout(), ids.layout(), weights.layout());
        want_f16(op, "logits", logits.dtype())?;
        if ids.dtype() != DType::I32 || weights.dtype() != DType::F32 {
            return Err(bad(
                op,
                format!(
                    "ids {} and weights {}: INT32 and f32 expected",
                    ids.dtype().name(),
                    weights.dtype().name()
                ),
            ));
        }
        let (t, ne) = (ll.rows(), ll.cols());
        if il.rows() != t || il.cols() != k || wl.rows() != t || wl.cols() != k {
            return Err(bad(
                op,
                format!(
                    "{t}x{ne} logits with ids {}x{} and weights {}x{} for k = {k}",
                    il.rows(),
                    il.cols(),
                    wl.rows(),
                    wl.cols()
                ),
            ));
        }
        if k == 0 || k > ne || k > 1024 {
            return Err(bad(
                op,
                format!("k = {k} of {ne} experts (MoeGatingTopKSoftmaxV2: 0 < k <= E, k <= 1024)"),
            ));
        }
        if normalize && (k as f64) / (ne as f64) < 2.0 * MIN_SUM {
            return Err(bad(
                op,
                format!(
                    "{ne} experts for k = {k}: the normalised weights' floor of {MIN_SUM} could \
                     bind, which renorm 1 does not apply"
                ),
            ));
        }
        if !dense(il) || !dense(wl) {
            return Err(bad(
                op,
                "ids and weights must be dense rows (the operator's outputs do not support \
                 non-contiguous tensors)",
            ));
        }
        if t == 0 {
            return Ok(());
        }
        let api = self.dev.acl.api.ops;
        let (Some(pg), Some(lg)) = (
            api.aclnnMoeGatingTopKSoftmaxV2GetWorkspaceSize,
            api.aclnnMoeGatingTopKSoftmaxV2,
        ) else {
            return Err(self.missing("expert routing (aclnnMoeGatingTopKSoftmaxV2)"));
        };
        self.pending = true;
        self.scratch.ensure(&self.dev, "moe_logits", t * ne * 4)?;
        let f32v = TView::contiguous(tensor::DType::F32, &[t as i64, ne as i64]);
        let s = self.scratch.get("moe_logits");
        cast(
            &mut self.ops,
            (&logits.buf().mem, tview(DType::F16, ll)),
            (s, f32v.clone()),
            npu_ffi::types::ACL_FLOAT,
        )?;
        let (kk, renorm) = (k as i64, i64::from(normalize));
        self.ops
            .call(
                "aclnnMoeGatingTopKSoftmaxV2",
                lg,
                &[
                    Arg::input("x", 0, s, f32v),
                    Arg::output("yOut", 0, &weights.buf().mem, tview(DType::F32, wl)),
                    Arg::output("expertIdxOut", 1, &ids.buf().mem, tview(DType::I32, il)),
                ],
                &[kk, renorm],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher; the
                // optional finished mask and softmax output are absent (null).
                Box::new(move |ts, _, w, e| unsafe {
                    pg(
                        ts[0].raw(),
                        std::ptr::null(),
                        kk,
                        renorm,
                        false,
                        ts[1].raw(),
                        ts[2].raw(),
                        std::ptr::null(),
                        w,
                        e,
                    )
                }),
            )
            .map_err(err)
    }
}

//! A layer's feed-forward part and the residual adds around it (split out of the runner): the
//! dense gated FFN or the routed experts, the (possibly split) projections, and `x += tmp` with
//! the norms that follow, each handed to the backend with the products beside them where it
//! folds them (`Backend::folds_norms_into_matmuls`), or the whole dense SwiGLU block with its
//! residual add in one op where it folds that (`Backend::folds_ffn`).

use npu_backend::{Backend, RouteSpec, View, ViewMut};
use npu_model::FfnAct;

use super::super::lora::{LoraSlots, Target};
use super::super::weights::{Ffn, Proj};
use super::super::{ModelConfig, ModelError};
use super::tp::Tp;
use super::Buffers;

/// A layer's FFN of `xn` into `tmp`: dense, or the routed experts (their routing as the
/// model's spec says) with the shared experts added. `fold`: the FFN norm (of `x` into `xn`)
/// not made yet, and whether the down product may add itself into `x` (a dense FFN: then
/// `Ok(true)`, and `tmp` is added already). `tp`: this rank's group (then `fold` is off): `tmp`
/// is all-reduced over it on return, the dense down product fused with the all-reduce where the
/// group's collective does that (`Tp::matmul_all_reduce`).
#[allow(clippy::too_many_arguments)]
pub(super) fn ffn<B: Backend>(
    b: &mut B,
    bufs: &mut Buffers<B>,
    ffn: &Ffn<B>,
    cfg: &ModelConfig,
    t: usize,
    h: usize,
    lora: (&LoraSlots<B>, usize),
    fold: (Option<&B::Buffer>, bool),
    tp: Option<&mut Tp<B>>,
) -> Result<bool, ModelError> {
    let norm = fold.0.map(|w| (w, cfg.rms_eps));
    let (gate_up, down, router, selection_bias, shared, held) = match ffn {
        Ffn::Dense { gate_up, down } => {
            let acts = (cfg.ffn_act, cfg.ff);
            let fold = (norm, fold.1 && tp.is_none());
            return dense_ffn(b, bufs, gate_up, down, acts, t, h, lora, fold, tp);
        }
        Ffn::Moe {
            router,
            gate_up,
            down,
            selection_bias,
            shared,
            held,
        } => (gate_up, down, router, selection_bias, shared, held),
    };
    let moe = cfg
        .moe
        .ok_or_else(|| ModelError::Inconsistent("expert weights without MoE settings".into()))?;
    if let Some((w, eps)) = norm {
        let (x, xn) = (
            View::rows(&bufs.x, t, h)?,
            ViewMut::rows(&mut bufs.xn, t, h)?,
        );
        b.rms_norm(x, w, eps, xn)?;
    }
    let (ne, k) = (moe.n_experts, moe.n_used);
    b.matmul(
        View::rows(&bufs.xn, t, h)?,
        router,
        ViewMut::rows(&mut bufs.router, t, ne)?,
    )?;
    let (logits, ids, weights) = (
        View::rows(&bufs.router, t, ne)?,
        ViewMut::rows(&mut bufs.route_ids, t, k)?,
        ViewMut::rows(&mut bufs.route_w, t, k)?,
    );
    if moe.plain_softmax() && selection_bias.is_none() {
        b.moe_route(logits, k, moe.norm_top_k, ids, weights)?;
    } else {
        let spec = RouteSpec {
            k,
            gating: moe.gating,
            normalize: moe.norm_top_k,
            scale: moe.weights_scale,
            groups: moe.groups,
        };
        b.moe_route_scored(logits, selection_bias.as_ref(), &spec, ids, weights)?;
    }
    if let Some((gate_up, down)) = shared {
        // The shared experts first, into their own rows; the routed ones' sum then lands in
        // `tmp` and the shared output is added to it.
        let sff = moe.shared_ff;
        let mut gu = ViewMut::rows(&mut bufs.gate_up, t, 2 * sff)?;
        project(b, View::rows(&bufs.xn, t, h)?, gate_up, &mut gu)?;
        let gu = gu.as_view();
        b.swiglu(
            gu.col_range(0, sff)?,
            gu.col_range(sff, sff)?,
            ViewMut::rows(&mut bufs.h, t, sff)?,
        )?;
        b.matmul(
            View::rows(&bufs.h, t, sff)?,
            down,
            ViewMut::rows(&mut bufs.shared, t, h)?,
        )?;
    }
    let (x, ids, w) = (
        View::rows(&bufs.xn, t, h)?,
        View::rows(&bufs.route_ids, t, k)?,
        View::rows(&bufs.route_w, t, k)?,
    );
    let out = ViewMut::rows(&mut bufs.tmp, t, h)?;
    if held.len() == ne {
        b.moe_ffn(x, ids, w, gate_up, down, moe.expert_ff, out)?;
    } else {
        // A rank of whole experts: the slots routed to the others' experts add nothing here.
        let held = held.clone();
        b.moe_ffn_held(x, ids, w, gate_up, down, held, ne, moe.expert_ff, out)?;
    }
    if shared.is_some() {
        b.add(
            ViewMut::rows(&mut bufs.tmp, t, h)?,
            View::rows(&bufs.shared, t, h)?,
        )?;
    }
    if let Some(tp) = tp {
        tp.all_reduce(b, ViewMut::rows(&mut bufs.tmp, t, h)?)?;
    }
    Ok(false)
}

/// Runs a (possibly split) projection of `x` into the columns of `out`.
pub(in crate::model) fn project<B: Backend>(
    b: &mut B,
    x: View<'_, B::Buffer>,
    p: &Proj<B::Matrix>,
    out: &mut ViewMut<'_, B::Buffer>,
) -> Result<(), ModelError> {
    match p {
        Proj::Fused(m) => {
            let cols = out.layout().cols();
            b.matmul(x, m, out.col_range(0, cols)?)?
        }
        Proj::Split(parts) => {
            for (m, col, n) in parts {
                b.matmul(x, m, out.col_range(*col, *n)?)?;
            }
        }
    }
    Ok(())
}

/// The dense gated FFN of `xn` into `tmp`, with the step's LoRA adapters of layer `lora.1`;
/// `norm`: `xn` is `x` normalised by these weights, not made yet (made here, with the gate/up
/// product where the backend folds it); `residual`: the down product may add itself into `x`
/// (`Ok(true)` where it did); `tp`: `tmp` all-reduced over the group on return (see `ffn`).
#[allow(clippy::too_many_arguments)]
fn dense_ffn<B: Backend>(
    b: &mut B,
    bufs: &mut Buffers<B>,
    gate_up: &Proj<B::Matrix>,
    down: &B::Matrix,
    (act, ff): (FfnAct, usize),
    t: usize,
    h: usize,
    (lora, li): (&LoraSlots<B>, usize),
    (norm, residual): (Option<(&B::Buffer, f32)>, bool),
    tp: Option<&mut Tp<B>>,
) -> Result<bool, ModelError> {
    let mut gu = ViewMut::rows(&mut bufs.gate_up, t, 2 * ff)?;
    let gu_lora = lora.targets(li, Target::Gate) || lora.targets(li, Target::Up);
    // The whole block in one go where the backend folds it (`Backend::folds_ffn`): the norm,
    // gate/up, SwiGLU, down and the residual add.
    let whole = residual
        && act == FfnAct::Silu
        && !gu_lora
        && !lora.targets(li, Target::Down)
        && b.folds_ffn(t);
    if let (true, Some((w, eps)), Proj::Fused(m)) = (whole, norm, gate_up) {
        b.rms_norm_ffn(
            ViewMut::rows(&mut bufs.x, t, h)?,
            w,
            eps,
            ViewMut::rows(&mut bufs.xn, t, h)?,
            m,
            gu.col_range(0, 2 * ff)?,
            ViewMut::rows(&mut bufs.h, t, ff)?,
            down,
            ViewMut::rows(&mut bufs.tmp, t, h)?,
        )?;
        return Ok(true);
    }
    let (x, xn) = (
        View::rows(&bufs.x, t, h)?,
        ViewMut::rows(&mut bufs.xn, t, h)?,
    );
    let mut activated = false;
    match (norm, gate_up) {
        (Some((w, eps)), Proj::Fused(m)) if act == FfnAct::Silu && !gu_lora => {
            let out = ViewMut::rows(&mut bufs.h, t, ff)?;
            b.rms_norm_matmul_swiglu(x, w, eps, xn, m, gu.col_range(0, 2 * ff)?, out)?;
            activated = true;
        }
        (Some((w, eps)), Proj::Fused(m)) => {
            b.rms_norm_matmul(x, w, eps, xn, m, gu.col_range(0, 2 * ff)?)?
        }
        (Some((w, eps)), Proj::Split(_)) => {
            b.rms_norm(x, w, eps, xn)?;
            project(b, View::rows(&bufs.xn, t, h)?, gate_up, &mut gu)?;
        }
        (None, _) => project(b, View::rows(&bufs.xn, t, h)?, gate_up, &mut gu)?,
    }
    if !activated {
        for (target, col) in [(Target::Gate, 0), (Target::Up, ff)] {
            lora.apply(
                b,
                li,
                target,
                View::rows(&bufs.xn, t, h)?,
                gu.col_range(col, ff)?,
            )?;
        }
        let gu = gu.as_view();
        let (gate, up, out) = (
            gu.col_range(0, ff)?,
            gu.col_range(ff, ff)?,
            ViewMut::rows(&mut bufs.h, t, ff)?,
        );
        match act {
            FfnAct::Silu => b.swiglu(gate, up, out)?,
            FfnAct::GeluTanh => b.geglu(gate, up, out)?,
        }
    }
    if residual && !lora.targets(li, Target::Down) {
        b.matmul_add(
            View::rows(&bufs.h, t, ff)?,
            down,
            ViewMut::rows(&mut bufs.tmp, t, h)?,
            ViewMut::rows(&mut bufs.x, t, h)?,
        )?;
        return Ok(true);
    }
    let (hv, tmp) = (
        View::rows(&bufs.h, t, ff)?,
        ViewMut::rows(&mut bufs.tmp, t, h)?,
    );
    match tp {
        // The down product and the group's all-reduce in one operator where it has one.
        Some(tp) if !lora.targets(li, Target::Down) => tp.matmul_all_reduce(b, hv, down, tmp)?,
        tp => {
            b.matmul(hv, down, tmp)?;
            lora.apply(
                b,
                li,
                Target::Down,
                View::rows(&bufs.h, t, ff)?,
                ViewMut::rows(&mut bufs.tmp, t, h)?,
            )?;
            if let Some(tp) = tp {
                tp.all_reduce(b, ViewMut::rows(&mut bufs.tmp, t, h)?)?;
            }
        }
    }
    Ok(false)
}

/// `x += tmp`, with `tmp` first RMS-normalised by `post` into `xn` where the family has a
/// post-norm (Gemma 3's post-attention and post-FFN norms); then, with `next`, `xn` = `x`
/// RMS-normalised by `next` (the norm that follows: `add_rms_norm`, one op where the backend
/// folds the add into the norm).
pub(super) fn residual_add<B: Backend>(
    b: &mut B,
    bufs: &mut Buffers<B>,
    post: Option<&B::Buffer>,
    next: Option<&B::Buffer>,
    eps: f32,
    t: usize,
    h: usize,
) -> Result<(), ModelError> {
    let y = match (post, next) {
        (None, Some(next)) => {
            b.add_rms_norm(
                ViewMut::rows(&mut bufs.x, t, h)?,
                View::rows(&bufs.tmp, t, h)?,
                next,
                eps,
                ViewMut::rows(&mut bufs.xn, t, h)?,
            )?;
            return Ok(());
        }
        (Some(norm), _) => {
            b.rms_norm(
                View::rows(&bufs.tmp, t, h)?,
                norm,
                eps,
                ViewMut::rows(&mut bufs.xn, t, h)?,
            )?;
            &bufs.xn
        }
        (None, None) => &bufs.tmp,
    };
    b.add(ViewMut::rows(&mut bufs.x, t, h)?, View::rows(y, t, h)?)?;
    if let Some(next) = next {
        b.rms_norm(
            View::rows(&bufs.x, t, h)?,
            next,
            eps,
            ViewMut::rows(&mut bufs.xn, t, h)?,
        )?;
    }
    Ok(())
}

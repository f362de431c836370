//! DeepSeek's ops on CANN ([`Capability::ScoredRouting`], [`Capability::LatentAttention`]), each
//! a documented aclnn call or a short composition of them on the agent's stream.
//!
//! `moe_route_scored(logits, bias, spec, ids, weights)`:
//! 1. Cast: the router logits (f16/bf16) to an f32 scratch: MoeGatingTopK's bias must have x's
//!    type, and the selection bias is kept in f32 (`load_vector`), as are the weights.
//! 2. MoeGatingTopK(x, bias, k, kGroup, groupCount, groupSelectMode 1, renorm, normType, false,
//!    routedScalingFactor = scale, eps = 1e-20, yOut = weights, expertIdxOut = ids, null):
//!    sigmoid (normType 1) or softmax (normType 0, documented from CANN 8.5) scores, the bias
//!    added for the choice, groups scored by the sum of their two best (groupSelectMode 1) with
//!    the best `groups.1` kept, the top k, the chosen unbiased scores over their sum (+ 1e-20,
//!    DeepSeek's own; ggml instead floors the sum at 2^-14, which differs only where k chosen
//!    scores sum below 6.1e-5), times the scale. No groups: groupCount 1, kGroup 1.
//!    Its limits are checked before the call: at most 2048 experts, groups dividing them with at
//!    least 2 experts a group, ⌈E/groups/32⌉·32·groups ≤ 2048, k ≤ E/groups·kGroup.
//! 3. Where the page's sigmoid always renormalises, sigmoid without normalisation is refused by
//!    name; softmax without a bias or groups goes through MoeGatingTopKSoftmaxV2 (`moe_route`)
//!    and, for a scale, InplaceMuls on the weights; softmax with a bias or groups needs normType
//!    0, so releases before 8.5 refuse it by name.
//!
//! The latent pool ([`super::KvPool::new_latent`]): per layer one (blocks, block_size, row) cache
//! of the activations' type, a row being a token's latent then its rotated key; for rows of
//! 512 + 64 (DeepSeek-V2/V3/R1, Kimi-K2) split into a latent and a rotated-key cache, which
//! `kv_write_latent` and `attention_latent` hand to `mla_ops` (FusedInferAttentionScoreV3's MLA
//! form). What follows is the path of the other rows.
//!
//! `kv_write_latent(latent, rope, layer)`: two InplaceCopy calls lay each new token's row out in
//! a dense (T, row) scratch, then one ScatterNdUpdate writes the rows at the step's slots.
//!
//! `attention_latent(q_latent, q_rope, g, latent_dim, layer, out)`: with the up-projections
//! absorbed every head attends over the same rows with score `q_latent·latent + q_rope·rope =
//! [q_latent | q_rope]·row`, and its output is the weighted sum of the latents, the first
//! `latent_dim` columns of the weighted sum of the rows. So:
//! 1. two InplaceCopy calls lay out the query as (T, heads, row): each head's latent part then
//!    its rotated part;
//! 2. FusedInferAttentionScoreV2, the same paged call as `attention` (BSH, INT32 block table,
//!    actual lengths, the causal prompt branch or the incremental one) with `numKeyValueHeads`
//!    1, `D` = row and the latent cache as both key and value (the ordinary form takes key and
//!    value of one head dim, so the value is the whole row, not a strided view of its latent
//!    columns, which the page's × for non-contiguous key/value forbids); its limits apply: row a
//!    multiple of 16 up to 512, at most 64 query heads over the one KV head. Rows above 512 other
//!    than 512 + 64, and more than 64 heads over rows up to 512, are refused by name (the MLA
//!    form takes only 512 + 64, with up to 128 heads: `mla_ops` pads fewer than 32, 64 or 128);
//! 3. one InplaceCopy takes each head's first `latent_dim` output columns into `out`.

use npu_backend::{
    AttnGeometry, BackendError, Capability, DType, DeviceBuffer as _, RouteSpec, View, ViewMut,
};
use npu_model::Gating;

use super::layer_ops::{bad, copy, dense, step_slice, tview, want_act};
use super::objects::AscendBuffer;
use super::{err, AscendBackend};
use crate::ops::RowScatter;
use crate::reuse::Arg;
use crate::tensor::{self, View as TView};
use crate::version::{CannVersion, Stage};

/// MoeGatingTopK's most experts ("不大于2048").
const MAX_EXPERTS: usize = 2048;
/// The sum's eps passed to MoeGatingTopK (DeepSeek's reference code adds 1e-20).
const EPS: f64 = 1e-20;
/// The first release whose MoeGatingTopK page documents softmax scores (normType 0).
const SOFTMAX_GATING: CannVersion = CannVersion {
    major: 8,
    minor: 5,
    stage: Stage::Rc(0),
};
/// FusedInferAttentionScoreV2's largest head dim, and its most query heads per KV head.
const FIA_MAX_D: usize = 512;
const FIA_MAX_GROUP: usize = 64;

impl AscendBackend {
    fn unsupported_here(&self, c: Capability, what: String) -> BackendError {
        BackendError::Unsupported {
            backend: super::NAME,
            what: format!("{}: {what}", c.name()),
        }
    }

    pub(super) fn op_moe_route_scored(
        &mut self,
        logits: View<'_, AscendBuffer>,
        bias: Option<&AscendBuffer>,
        spec: &RouteSpec,
        mut ids: ViewMut<'_, AscendBuffer>,
        mut weights: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "moe_route_scored";
        let c = Capability::ScoredRouting;
        let (ll, il, wl) = (logits.layout(), ids.layout(), weights.layout());
        want_act(op, "logits", logits.dtype(), self.act)?;
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
        let (t, ne, k) = (ll.rows(), ll.cols(), spec.k);
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
        if k == 0 || k > ne {
            return Err(bad(op, format!("{k} experts of {ne}")));
        }
        if let Some(b) = bias {
            if b.len() != ne || b.dtype() != DType::F32 {
                return Err(bad(
                    op,
                    format!(
                        "a bias of {} {} values for {ne} experts",
                        b.len(),
                        b.dtype().name()
                    ),
                ));
            }
        }
        let (groups, used) = spec.groups.unwrap_or((1, 1));
        if spec.groups.is_some()
            && (groups < 2 || !ne.is_multiple_of(groups) || used == 0 || used >= groups)
        {
            return Err(bad(
                op,
                format!("{used} of {groups} groups over {ne} experts"),
            ));
        }
        if !dense(il) || !dense(wl) {
            return Err(bad(
                op,
                "ids and weights must be dense rows (the operator's outputs do not support \
                 non-contiguous tensors)",
            ));
        }
        let softmax = spec.gating == Gating::Softmax;
        if !softmax && !spec.normalize {
            return Err(self.unsupported_here(
                c,
                "sigmoid scores without normalisation (aclnnMoeGatingTopK always divides \
                 sigmoid scores by their sum)"
                    .into(),
            ));
        }
        let api = self.dev.acl.api.ops;
        let scale = if spec.scale == 0.0 { 1.0 } else { spec.scale };
        if softmax && bias.is_none() && spec.groups.is_none() {
            // Plain softmax top-k (renorm 1 for normalised weights), then the scale.
            self.op_moe_route(
                logits,
                k,
                spec.normalize,
                ViewMut::new(ids.buf_mut(), il)?,
                ViewMut::new(weights.buf_mut(), wl)?,
            )?;
            if scale != 1.0 && t > 0 {
                let (Some(prep), Some(launch)) =
                    (api.aclnnInplaceMulsGetWorkspaceSize, api.aclnnInplaceMuls)
                else {
                    return Err(self.missing("the routed scale (aclnnInplaceMuls)"));
                };
                self.ops
                    .call(
                        "aclnnInplaceMuls",
                        launch,
                        &[Arg::fixed(
                            "selfRef",
                            &weights.buf().mem,
                            tview(DType::F32, wl),
                        )],
                        &[],
                        &[scale],
                        // SAFETY (closure): a live tensor, scalar and out-pointers.
                        Box::new(move |ts, sc, w, e| unsafe {
                            prep(ts[0].raw(), sc[0].raw(), w, e)
                        }),
                    )
                    .map_err(err)?;
            }
            return Ok(());
        }
        if softmax && self.dev.acl.version < SOFTMAX_GATING {
            return Err(self.unsupported_here(
                c,
                format!(
                    "softmax scores with a selection bias or groups (aclnnMoeGatingTopK documents \
                     softmax, normType 0, from CANN 8.5; this is {})",
                    self.dev.acl.version
                ),
            ));
        }
        let per = ne / groups;
        if ne > MAX_EXPERTS
            || per < 2
            || per.div_ceil(32) * 32 * groups > MAX_EXPERTS
            || k > per * used
        {
            return Err(self.unsupported_here(
                c,
                format!(
                    "{ne} experts in {groups} groups choosing {k} from {used}: outside \
                     aclnnMoeGatingTopK's limits (at most 2048 experts, at least 2 a group, groups \
                     aligned to 32 within 2048, k within the kept groups)"
                ),
            ));
        }
        let (Some(prep), Some(launch)) = (
            api.aclnnMoeGatingTopKGetWorkspaceSize,
            api.aclnnMoeGatingTopK,
        ) else {
            return Err(self.missing("scored expert routing (aclnnMoeGatingTopK)"));
        };
        if t == 0 {
            return Ok(());
        }
        self.pending = true;
        self.scratch.ensure(&self.dev, "moe_logits", t * ne * 4)?;
        let f32v = TView::contiguous(tensor::DType::F32, &[t as i64, ne as i64]);
        let s = self.scratch.get("moe_logits");
        copy_cast(
            &mut self.ops,
            (&logits.buf().mem, tview(logits.dtype(), ll)),
            (s, f32v.clone()),
        )?;
        let kk = k as i64;
        let (kg, gc) = (used as i64, groups as i64);
        let renorm = i64::from(spec.normalize);
        let norm_type = if softmax { 0 } else { 1 };
        let scale = f64::from(scale);
        let mut args = vec![
            Arg::input("x", 0, s, f32v),
            Arg::output("yOut", 0, &weights.buf().mem, tview(DType::F32, wl)),
            Arg::output("expertIdxOut", 1, &ids.buf().mem, tview(DType::I32, il)),
        ];
        if let Some(b) = bias {
            args.push(Arg::input(
                "biasOptional",
                1,
                &b.mem,
                TView::contiguous(tensor::DType::F32, &[ne as i64]),
            ));
        }
        let with_bias = bias.is_some();
        self.ops
            .call(
                "aclnnMoeGatingTopK",
                launch,
                &args,
                &[kk, kg, gc, renorm, norm_type],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher; the
                // optional norm output is absent (null, outFlag false).
                Box::new(move |ts, _, w, e| unsafe {
                    prep(
                        ts[0].raw(),
                        if with_bias {
                            ts[3].raw()
                        } else {
                            std::ptr::null()
                        },
                        kk,
                        kg,
                        gc,
                        1,
                        renorm,
                        norm_type,
                        false,
                        scale,
                        EPS,
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

    /// The latent pool, refused when the pool is a K/V one (or none).
    fn latent_spec(&self, op: &'static str) -> Result<npu_backend::KvSpec, BackendError> {
        let kv = self.kv()?;
        if !kv.latent {
            return Err(bad(
                op,
                "the KV pool holds keys and values (init_kv), not latents (init_latent_kv)",
            ));
        }
        Ok(kv.spec)
    }

    pub(super) fn op_kv_write_latent(
        &mut self,
        latent: View<'_, AscendBuffer>,
        rope: View<'_, AscendBuffer>,
        layer: usize,
    ) -> Result<(), BackendError> {
        let op = "kv_write_latent";
        let spec = self.latent_spec(op)?;
        let act = self.act_t();
        want_act(op, "latent", latent.dtype(), self.act)?;
        want_act(op, "rope", rope.dtype(), self.act)?;
        let (ll, rl) = (latent.layout(), rope.layout());
        let (t, row) = (self.plan.n_tokens, spec.head_dim);
        if ll.rows() != t || rl.rows() != t || ll.cols() + rl.cols() != row || ll.cols() == 0 {
            return Err(bad(
                op,
                format!(
                    "latent {}x{} and rope {}x{}: the step needs {t} rows of {row} in all",
                    ll.rows(),
                    ll.cols(),
                    rl.rows(),
                    rl.cols()
                ),
            ));
        }
        if layer >= spec.n_layers {
            return Err(bad(
                op,
                format!("layer {layer} of a {}-layer pool", spec.n_layers),
            ));
        }
        if self.kv()?.mla.is_some() {
            return self.mla_write(latent, rope, layer);
        }
        if t == 0 {
            return Ok(());
        }
        self.pending = true;
        self.scratch.ensure(&self.dev, "latent_rows", t * row * 2)?;
        let (lat, rp) = (ll.cols() as i64, rl.cols() as i64);
        let (ti, rowi) = (t as i64, row as i64);
        let rows = self.scratch.get("latent_rows");
        copy(
            &mut self.ops,
            rows,
            TView::strided(act, &[ti, lat], &[rowi, 1], 0),
            &latent.buf().mem,
            tview(latent.dtype(), ll),
        )?;
        copy(
            &mut self.ops,
            rows,
            TView::strided(act, &[ti, rp], &[rowi, 1], lat),
            &rope.buf().mem,
            tview(rope.dtype(), rl),
        )?;
        let kv = self.kv.as_ref().expect("checked");
        let (cache, _) = kv.layer(layer)?;
        let (slots, _) = step_slice(&self.step_mem, self.plan.slots, t)?;
        self.ops
            .runner
            .scatter_rows(&RowScatter {
                dtype: act,
                tokens: t,
                width: row,
                row_stride: row,
                src: self.scratch.get("latent_rows"),
                src_offset: 0,
                cache,
                slots,
                slots_offset: self.plan.slots,
                cache_rows: spec.num_blocks * spec.block_size,
            })
            .map_err(err)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_attention_latent(
        &mut self,
        q_latent: View<'_, AscendBuffer>,
        q_rope: View<'_, AscendBuffer>,
        g: &AttnGeometry,
        latent_dim: usize,
        layer: usize,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "attention_latent";
        let spec = self.latent_spec(op)?;
        let act = self.act_t();
        let row = spec.head_dim;
        let h = g.n_heads;
        if g.head_dim != row || g.n_kv_heads != 1 || latent_dim == 0 || latent_dim >= row {
            return Err(bad(
                op,
                format!(
                    "a geometry of {} KV heads of {} with a latent of {latent_dim} over a pool \
                     of rows of {row}",
                    g.n_kv_heads, g.head_dim
                ),
            ));
        }
        if g.window.is_some() {
            return Err(bad(op, "latent attention through a window"));
        }
        let rope = row - latent_dim;
        for (w, dt) in [
            ("q_latent", q_latent.dtype()),
            ("q_rope", q_rope.dtype()),
            ("out", out.dtype()),
        ] {
            want_act(op, w, dt, self.act)?;
        }
        let (ql, qr, ol) = (q_latent.layout(), q_rope.layout(), out.layout());
        let t = self.plan.n_tokens;
        for (w, l, cols) in [
            ("q_latent", ql, h * latent_dim),
            ("q_rope", qr, h * rope),
            ("out", ol, h * latent_dim),
        ] {
            if l.rows() != t || l.cols() != cols {
                return Err(bad(
                    op,
                    format!(
                        "{w} is {}x{}, the step needs {t}x{cols}",
                        l.rows(),
                        l.cols()
                    ),
                ));
            }
        }
        if let Some((lat, rp)) = self.kv()?.mla {
            if latent_dim != lat {
                return Err(bad(
                    op,
                    format!("a latent of {latent_dim} over rows of {lat} + {rp}"),
                ));
            }
            return self.mla_attend(q_latent, q_rope, g, layer, out);
        }
        if row > FIA_MAX_D || h > FIA_MAX_GROUP || h == 0 {
            return Err(self.unsupported_here(
                Capability::LatentAttention,
                format!(
                    "{h} heads over rows of {row}: FusedInferAttentionScoreV2's ordinary form \
                     takes a head dim up to {FIA_MAX_D} and up to {FIA_MAX_GROUP} query heads a \
                     KV head, FusedInferAttentionScoreV3's MLA form only rows of 512 + 64 with \
                     up to 128 heads"
                ),
            ));
        }
        if t == 0 {
            return Ok(());
        }
        let want = t * h * row;
        let (mut qb, mut ob) = match self.latent_bufs.take() {
            Some((q, o)) if q.len() >= want && q.dtype() == self.act => (q, o),
            old => {
                if let Some((q, o)) = old {
                    // Queued work may still read them: freed at the next synchronization.
                    self.retired_bufs.push(q);
                    self.retired_bufs.push(o);
                }
                let n = want.next_power_of_two();
                (
                    AscendBuffer::new(&self.dev, self.act, n)?,
                    AscendBuffer::new(&self.dev, self.act, n)?,
                )
            }
        };
        let r = self.latent_attend(
            (&q_latent, ql),
            (&q_rope, qr),
            g,
            latent_dim,
            layer,
            (&mut qb, &mut ob),
            out,
            act,
        );
        self.latent_bufs = Some((qb, ob));
        r
    }

    /// `attention_latent`'s three steps with its query and output rows in `bufs`.
    #[allow(clippy::too_many_arguments)]
    fn latent_attend(
        &mut self,
        q_latent: (&View<'_, AscendBuffer>, npu_backend::Layout),
        q_rope: (&View<'_, AscendBuffer>, npu_backend::Layout),
        g: &AttnGeometry,
        latent_dim: usize,
        layer: usize,
        bufs: (&mut AscendBuffer, &mut AscendBuffer),
        out: ViewMut<'_, AscendBuffer>,
        act: tensor::DType,
    ) -> Result<(), BackendError> {
        let (h, row) = (g.n_heads, g.head_dim);
        let rope = row - latent_dim;
        let t = self.plan.n_tokens;
        let (ti, hi, rowi) = (t as i64, h as i64, row as i64);
        let (lat, rp) = (latent_dim as i64, rope as i64);
        let (qb, ob) = bufs;
        self.pending = true;
        // 1. The query as (T, heads, row): each head's latent part, then its rotated part.
        let (ql, qr) = (q_latent.1, q_rope.1);
        copy(
            &mut self.ops,
            &qb.mem,
            TView::strided(act, &[ti, hi, lat], &[hi * rowi, rowi, 1], 0),
            &q_latent.0.buf().mem,
            TView::strided(
                act,
                &[ti, hi, lat],
                &[ql.stride() as i64, lat, 1],
                ql.offset() as i64,
            ),
        )?;
        copy(
            &mut self.ops,
            &qb.mem,
            TView::strided(act, &[ti, hi, rp], &[hi * rowi, rowi, 1], lat),
            &q_rope.0.buf().mem,
            TView::strided(
                act,
                &[ti, hi, rp],
                &[qr.stride() as i64, rp, 1],
                qr.offset() as i64,
            ),
        )?;
        // 2. Paged attention over the rows as keys and values, one KV head of `row`.
        let g_rows = AttnGeometry {
            n_heads: h,
            n_kv_heads: 1,
            head_dim: row,
            rope: g.rope,
            scale: g.scale,
            window: None,
        };
        self.attend(
            View::rows(qb, t, h * row)?,
            &g_rows,
            layer,
            ViewMut::rows(ob, t, h * row)?,
        )?;
        // 3. Each head's latent columns of the output.
        let ol = out.layout();
        copy(
            &mut self.ops,
            &out.buf().mem,
            TView::strided(
                act,
                &[ti, hi, lat],
                &[ol.stride() as i64, lat, 1],
                ol.offset() as i64,
            ),
            &ob.mem,
            TView::strided(act, &[ti, hi, lat], &[hi * rowi, rowi, 1], 0),
        )
    }
}

/// `dst = cast(src)` to f32 (aclnnCast).
fn copy_cast(
    ops: &mut crate::reuse::Launcher,
    src: (&crate::memory::DeviceBuffer, TView),
    dst: (&crate::memory::DeviceBuffer, TView),
) -> Result<(), BackendError> {
    let api = ops.runner.acl().api.ops;
    let pc = api.aclnnCastGetWorkspaceSize;
    let to = npu_ffi::types::ACL_FLOAT;
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

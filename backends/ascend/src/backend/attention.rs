//! Writing the step's K/V into the paged cache by slot mapping (ScatterPaKvCache, or
//! ScatterNdUpdate on releases without it) and paged attention through
//! FusedInferAttentionScoreV2 with an INT32 block table and actual sequence lengths, on the path
//! the step's plan chose ([`super::step::AttnPath`]).
//!
//! Sliding windows (`AttnGeometry::window`, a query at p sees p + 1 − window ..= p): the prompt
//! branch takes band mode (sparseMode 4, preTokens = window − 1, nextTokens = 0, counted from
//! the bottom-right corner of each entry's actual lengths) over the causal mask; the incremental
//! branch ignores sparseMode and the token counts, so each entry gets a (1, 1, KV_S) key mask
//! hiding the keys before `kv_len − window`, packed into the step's upload
//! ([`super::step::StepPlan::window_mask`]).

use npu_backend::{AttnGeometry, BackendError, View, ViewMut};

use super::layer_ops::{bad, copy, dense, gather, step_slice, tview, want_act};
use super::objects::AscendBuffer;
use super::step::AttnPath;
use super::{err, AscendBackend};
use crate::ops::{Attention, KvWrite};
use crate::reuse::Arg;
use crate::tensor::{self, IntArray, Tensor, View as TView};

impl AscendBackend {
    fn check_geometry(&self, op: &'static str, g: &AttnGeometry) -> Result<(), BackendError> {
        let spec = self.kv()?.spec;
        if g.n_kv_heads != spec.n_kv_heads || g.head_dim != spec.head_dim {
            return Err(bad(
                op,
                format!(
                    "{} KV heads of {} for a pool of {} of {}",
                    g.n_kv_heads, g.head_dim, spec.n_kv_heads, spec.head_dim
                ),
            ));
        }
        if g.n_heads == 0 || !g.n_heads.is_multiple_of(g.n_kv_heads) {
            return Err(bad(
                op,
                format!("{} heads over {} KV heads", g.n_heads, g.n_kv_heads),
            ));
        }
        Ok(())
    }

    pub(super) fn op_kv_write(
        &mut self,
        k: View<'_, AscendBuffer>,
        v: View<'_, AscendBuffer>,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        let op = "kv_write";
        let act = self.act_t();
        self.want_kv_pool(op)?;
        self.check_geometry(op, g)?;
        let (kl, vl) = (k.layout(), v.layout());
        want_act(op, "k", k.dtype(), self.act)?;
        want_act(op, "v", v.dtype(), self.act)?;
        let t = self.plan.n_tokens;
        let kvd = g.kv_width();
        for (w, l) in [("k", kl), ("v", vl)] {
            if l.rows() != t || l.cols() != kvd {
                return Err(bad(
                    op,
                    format!("{w} is {}x{}, the step needs {t}x{kvd}", l.rows(), l.cols()),
                ));
            }
        }
        let api = self.dev.acl.api.ops;
        let (n, d) = (g.n_kv_heads as i64, g.head_dim as i64);
        self.pending = true;
        if let (Some(prep), Some(launch)) = (
            api.aclnnScatterPaKvCacheGetWorkspaceSize,
            api.aclnnScatterPaKvCache,
        ) {
            // Scatter mode "None" takes the new key and value contiguous (the page: "None" means
            // uncompressed and contiguous; strided rows are the "Nct" mode, which not every
            // release has). Column ranges of the fused QKV rows are copied into dense (T, N, D)
            // scratch first.
            let packed = TView::contiguous(act, &[t as i64, n, d]);
            for (name, x, l) in [("kv_k", &k, kl), ("kv_v", &v, vl)] {
                if !dense(l) {
                    self.scratch.ensure(&self.dev, name, t * kvd * 2)?;
                    copy(
                        &mut self.ops,
                        self.scratch.get(name),
                        TView::contiguous(act, &[t as i64, kvd as i64]),
                        &x.buf().mem,
                        tview(x.dtype(), l),
                    )?;
                }
            }
            let (km, kview) = if dense(kl) {
                let at = kl.offset() as i64;
                (
                    &k.buf().mem,
                    TView {
                        offset: at,
                        ..packed.clone()
                    },
                )
            } else {
                (self.scratch.get("kv_k"), packed.clone())
            };
            let (vm, vview) = if dense(vl) {
                let at = vl.offset() as i64;
                (
                    &v.buf().mem,
                    TView {
                        offset: at,
                        ..packed.clone()
                    },
                )
            } else {
                (self.scratch.get("kv_v"), packed.clone())
            };
            let kv = self
                .kv
                .as_ref()
                .ok_or_else(|| BackendError::BadStep("the KV pool is not initialised".into()))?;
            let spec = kv.spec;
            let (kc, vc) = kv.layer(layer)?;
            let (slots, sv) = step_slice(&self.step_mem, self.plan.slots, t)?;
            let cache =
                TView::contiguous(act, &[spec.num_blocks as i64, spec.block_size as i64, n, d]);
            // torch_npu's defaults for the arrays read only in "Nct" mode: strides {1, 1},
            // offsets {0, 0} (explicit, not null).
            let acl = self.dev.acl;
            let strides = IntArray::new(acl, &[1, 1]).map_err(err)?;
            let offsets = IntArray::new(acl, &[0, 0]).map_err(err)?;
            let (sp, op_) = (strides.raw(), offsets.raw());
            return self
                .ops
                .call(
                    "aclnnScatterPaKvCache",
                    launch,
                    &[
                        Arg::fixed("key", km, kview),
                        Arg::fixed("keyCacheRef", kc, cache.clone()),
                        Arg::fixed("slotMapping", slots, sv),
                        Arg::fixed("value", vm, vview),
                        Arg::fixed("valueCacheRef", vc, cache),
                    ],
                    &[],
                    &[],
                    // SAFETY (closure): live tensors, NUL-terminated modes, int arrays that
                    // outlive the call (dropped after it returns) and out-pointers.
                    Box::new(move |ts, _, w, e| unsafe {
                        let mut norm = *b"Norm\0";
                        let mut none = *b"None\0";
                        prep(
                            ts[0].raw(),
                            ts[1].raw(),
                            ts[2].raw(),
                            ts[3].raw(),
                            ts[4].raw(),
                            std::ptr::null(),
                            std::ptr::null(),
                            std::ptr::null(),
                            norm.as_mut_ptr().cast(),
                            none.as_mut_ptr().cast(),
                            sp,
                            op_,
                            w,
                            e,
                        )
                    }),
                )
                .map_err(err);
        }
        let kv = self
            .kv
            .as_ref()
            .ok_or_else(|| BackendError::BadStep("the KV pool is not initialised".into()))?;
        let spec = kv.spec;
        let (kc, vc) = kv.layer(layer)?;
        let (slots, _) = step_slice(&self.step_mem, self.plan.slots, t)?;
        // Releases without ScatterPaKvCache: its documented equivalent, per cache.
        if kl.stride() != vl.stride() || !std::ptr::eq(k.buf(), v.buf()) {
            return Err(bad(
                op,
                "without ScatterPaKvCache, K and V must be column ranges of one buffer",
            ));
        }
        let w = KvWrite {
            dtype: act,
            tokens: t,
            kv_heads: g.n_kv_heads,
            head_dim: g.head_dim,
            row_stride: kl.stride(),
            key: &k.buf().mem,
            key_offset: kl.offset(),
            value: &v.buf().mem,
            value_offset: vl.offset(),
            key_cache: kc,
            value_cache: vc,
            slots,
            slots_offset: self.plan.slots,
            num_blocks: spec.num_blocks,
            block_size: spec.block_size,
        };
        self.ops.runner.write_kv_rows(&w).map_err(err)
    }

    /// Refuses a latent pool (its rows are read by `attention_latent`).
    fn want_kv_pool(&self, op: &'static str) -> Result<(), BackendError> {
        if self.kv()?.latent {
            return Err(bad(
                op,
                "the KV pool holds latents (init_latent_kv): attention_latent reads it",
            ));
        }
        Ok(())
    }

    pub(super) fn op_attention(
        &mut self,
        q: View<'_, AscendBuffer>,
        g: &AttnGeometry,
        layer: usize,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.want_kv_pool("attention")?;
        self.attend(q, g, layer, out)
    }

    /// Paged attention over `layer`'s caches (a K/V pool's, or a latent pool's rows as both).
    pub(super) fn attend(
        &mut self,
        q: View<'_, AscendBuffer>,
        g: &AttnGeometry,
        layer: usize,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "attention";
        let act = self.act_t();
        self.check_geometry(op, g)?;
        let (ql, ol) = (q.layout(), out.layout());
        want_act(op, "q", q.dtype(), self.act)?;
        want_act(op, "out", out.dtype(), self.act)?;
        let t = self.plan.n_tokens;
        let h = g.q_width();
        for (w, l) in [("q", ql), ("out", ol)] {
            if l.rows() != t || l.cols() != h {
                return Err(bad(
                    op,
                    format!("{w} is {}x{}, the step needs {t}x{h}", l.rows(), l.cols()),
                ));
            }
        }
        let path = self
            .plan
            .path
            .ok_or_else(|| BackendError::BadStep("the step has no sequences to attend".into()))?;
        if g.window == Some(0) {
            return Err(bad(op, "a sliding window of 0 positions"));
        }
        let acl = self.dev.acl;
        self.pending = true;
        let groups = self.plan.groups.clone();
        match path {
            AttnPath::TokenWise => {
                // FusedInferAttentionScoreV2 takes query (and attentionOut) contiguous: its page
                // marks query/key/value as not supporting non-contiguous tensors, and its entry
                // point makes no contiguous copy. Rows of a wider buffer (the query columns of
                // the fused QKV rows) are copied into a dense (T, H) scratch first; an output
                // with such rows is written to scratch and copied out after.
                let dense_q = dense(ql);
                let dense_o = dense(ol);
                let packed = TView::contiguous(act, &[t as i64, h as i64]);
                if !dense_q {
                    self.scratch.ensure(&self.dev, "attn_q", t * h * 2)?;
                    copy(
                        &mut self.ops,
                        self.scratch.get("attn_q"),
                        packed.clone(),
                        &q.buf().mem,
                        tview(q.dtype(), ql),
                    )?;
                }
                if !dense_o {
                    self.scratch.ensure(&self.dev, "attn_o", t * h * 2)?;
                }
                // (B, 1, H) of entries `r`: dense rows of H from element `base` on.
                let rows = |base: usize, r: &std::ops::Range<usize>| {
                    TView::strided(
                        act,
                        &[r.len() as i64, 1, h as i64],
                        &[h as i64, h as i64, 1],
                        (base + r.start * h) as i64,
                    )
                };
                let (q_mem, q_base) = if dense_q {
                    (&q.buf().mem, ql.offset())
                } else {
                    (self.scratch.get("attn_q"), 0)
                };
                let (o_mem, o_base) = if dense_o {
                    (&out.buf().mem, ol.offset())
                } else {
                    (self.scratch.get("attn_o"), 0)
                };
                // Handles (not borrows) of the buffers, so `self.fia` may take `self` below.
                let mut calls = Vec::with_capacity(groups.len());
                for r in &groups {
                    calls.push((
                        Tensor::new(acl, q_mem, rows(q_base, r)).map_err(err)?,
                        Tensor::new(acl, o_mem, rows(o_base, r)).map_err(err)?,
                    ));
                }
                let masked = match (g.window, self.plan.length_mask) {
                    (Some(_), Some(_)) => {
                        return Err(bad(
                            op,
                            "a sliding window in a step of the graph form (not built)",
                        ))
                    }
                    (Some(w), None) => self.window_mask(w)?,
                    // The graph form: the keys past each entry's length hidden by its mask.
                    (None, Some(at)) => Some((None, at * 4)),
                    (None, None) => None,
                };
                let width = self.plan.mask_width() as i64;
                for (r, (query, outt)) in groups.iter().zip(&calls) {
                    // The entries' key-mask rows, (B, 1, 1, KV_S) bytes.
                    let mask = match masked {
                        Some((own, at)) => Some(
                            Tensor::new(
                                acl,
                                match own {
                                    Some(i) => &self.step_masks[i].1,
                                    None => self.step_mem.as_ref().expect("a step has begun"),
                                },
                                TView::strided(
                                    tensor::DType::I8,
                                    &[r.len() as i64, 1, 1, width],
                                    &[width, width, width, 1],
                                    at as i64 + r.start as i64 * width,
                                ),
                            )
                            .map_err(err)?,
                        ),
                        None => None,
                    };
                    self.fia(query, outt, layer, g, mask.as_ref(), None, r.clone())?;
                }
                if !dense_o {
                    copy(
                        &mut self.ops,
                        &out.buf().mem,
                        tview(out.dtype(), ol),
                        self.scratch.get("attn_o"),
                        packed,
                    )?;
                }
                Ok(())
            }
            AttnPath::Prompt { s_max } => {
                let rows = self.plan.batch * s_max;
                for name in ["attn_q", "attn_o"] {
                    self.scratch.ensure(&self.dev, name, rows * h * 2)?;
                }
                if self.mask.is_none() {
                    // sparseMode 3 takes the 2048×2048 mask with 1 above the diagonal.
                    let m: Vec<u8> = (0..2048 * 2048)
                        .map(|i| ((i % 2048) > (i / 2048)) as u8)
                        .collect();
                    self.mask = Some(super::objects::upload_new(
                        &self.dev,
                        &m,
                        "the causal mask",
                    )?);
                }
                let padded = TView::contiguous(act, &[rows as i64, h as i64]);
                gather(
                    &mut self.ops,
                    (&q.buf().mem, tview(q.dtype(), ql)),
                    step_slice(&self.step_mem, self.plan.pad_rows, rows)?,
                    (self.scratch.get("attn_q"), padded.clone()),
                )?;
                let mask = Tensor::new(
                    acl,
                    self.mask.as_ref().expect("just made"),
                    TView::contiguous(tensor::DType::I8, &[2048, 2048]),
                )
                .map_err(err)?;
                for r in &groups {
                    // (sequences, s_max, H) of the padded batch.
                    let bsh = TView::strided(
                        act,
                        &[r.len() as i64, s_max as i64, h as i64],
                        &[(s_max * h) as i64, h as i64, 1],
                        (r.start * s_max * h) as i64,
                    );
                    let query =
                        Tensor::new(acl, self.scratch.get("attn_q"), bsh.clone()).map_err(err)?;
                    let outt = Tensor::new(acl, self.scratch.get("attn_o"), bsh).map_err(err)?;
                    let band = g.window.map(|w| w as i64 - 1);
                    self.fia(&query, &outt, layer, g, Some(&mask), band, r.clone())?;
                }
                gather(
                    &mut self.ops,
                    (self.scratch.get("attn_o"), padded),
                    step_slice(&self.step_mem, self.plan.unpad_rows, t)?,
                    (&out.buf().mem, tview(out.dtype(), ol)),
                )
            }
        }
    }

    /// The token-wise path's key mask for `window`: where it is (`None`: the step's inputs,
    /// `Some(i)`: `step_masks[i]`) and the byte offset of its first row there, or `None` when no
    /// entry of the step reaches past the window. Packed into the step's upload for windows met
    /// before; a window met for the first time is uploaded on its own now (and packed from the
    /// next step on).
    fn window_mask(&mut self, window: u32) -> Result<Option<(Option<usize>, usize)>, BackendError> {
        if let Some(&(_, at)) = self.plan.window_masks.iter().find(|m| m.0 == window) {
            if self.step_mem.is_none() {
                return Err(BackendError::BadStep("no step has begun".into()));
            }
            return Ok(Some((None, at * 4)));
        }
        if !self.windows.contains(&window) {
            self.windows.push(window);
        }
        let Some(bytes) = self.plan.window_mask(window) else {
            return Ok(None);
        };
        let i = match self.step_masks.iter().position(|m| m.0 == window) {
            Some(i) => i,
            None => {
                // A fresh allocation: no queued work can touch it, so the copy needs no
                // synchronization.
                let mem = super::objects::upload_new(&self.dev, &bytes, "a sliding-window mask")?;
                self.step_masks.push((window, mem));
                self.step_masks.len() - 1
            }
        };
        Ok(Some((Some(i), 0)))
    }

    /// One FusedInferAttentionScoreV2 call over `layer`'s caches with the step's block tables and
    /// lengths (its first phase reads the lengths on the host, so it is never reused); `mask` and
    /// `band` as [`crate::ops::Attention`] takes them.
    #[allow(clippy::too_many_arguments)]
    fn fia(
        &mut self,
        query: &Tensor,
        out: &Tensor,
        layer: usize,
        g: &AttnGeometry,
        mask: Option<&Tensor>,
        band: Option<i64>,
        entries: std::ops::Range<usize>,
    ) -> Result<(), BackendError> {
        let acl = self.dev.acl;
        let act = self.act_t();
        let kv = self
            .kv
            .as_ref()
            .ok_or_else(|| BackendError::BadStep("the KV pool is not initialised".into()))?;
        let spec = kv.spec;
        let (kc, vc) = kv.layer(layer)?;
        let (b, mb) = (entries.len(), self.plan.max_blocks);
        let (tables, _) = step_slice(&self.step_mem, self.plan.tables, self.plan.batch * mb)?;
        let table = Tensor::new(
            acl,
            tables,
            TView::strided(
                tensor::DType::I32,
                &[b as i64, mb as i64],
                &[mb as i64, 1],
                (self.plan.tables + entries.start * mb) as i64,
            ),
        )
        .map_err(err)?;
        let a = Attention {
            query,
            out,
            key_cache: kc,
            value_cache: vc,
            cache_view: TView::contiguous(
                act,
                &[
                    spec.num_blocks as i64,
                    spec.block_size as i64,
                    (spec.n_kv_heads * spec.head_dim) as i64,
                ],
            ),
            block_table: &table,
            mask,
            band,
            q_lens: &self.plan.q_lens[entries.clone()],
            kv_lens: &self.plan.kv_lens[entries],
            heads: g.n_heads as i64,
            kv_heads: g.n_kv_heads as i64,
            block_size: spec.block_size as i64,
            scale: g.scale as f64,
        };
        self.ops.runner.attention(&a).map_err(err)
    }
}

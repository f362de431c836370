//! DeepSeek's latent attention at its own widths ([`Capability::LatentAttention`] over a pool of
//! [`MLA_ROW`]s: a 512-wide latent and a 64-wide rotated key, as DeepSeek-V2/V3/R1 and Kimi-K2
//! have) through FusedInferAttentionScoreV3's MLA form, the rope inputs set. The latent pool is
//! split for it ([`super::kv_pool`]): per layer a latent cache (blocks, block_size, 512) and a
//! rotated-key cache (blocks, block_size, 64), both contiguous as the form takes them.
//!
//! Followed: ops-transformer `attention/fused_infer_attention_score/docs/
//! aclnnFusedInferAttentionScoreV3.md` ("queryRope和keyRope输入时即为MLA场景": query d 512 and
//! queryRope d 64 with its other dims, key n 1 and d 512, keyRope d 64, page attention required
//! with blockSize 16 or 128, Q_S 1 to 16, at Q_S = 1 sparseMode 0 without a mask), torch_npu's
//! `npu_fused_infer_attention_score` page (the same limits, and the query heads: 32, 64 or 128),
//! and vllm-ascend's MLA decode (`mla_v1.py`: the latent cache as both key and value, the rope
//! cache as keyRope, numKeyValueHeads 1, the block table and the KV lengths).
//!
//! `kv_write_latent(latent, rope, layer)`: each part (dense rows, or copied into a dense scratch
//! first) scattered by slot into its cache with ScatterNdUpdate.
//!
//! `attention_latent(q_latent, q_rope, g, 512, layer, out)`: the step is planned token-wise
//! ([`super::step::StepPlan::token_wise`]): every new token its own batch entry, S = 1, its KV
//! length its position + 1 and its sequence's block-table row, so causality is the length and a
//! prefill chunk needs no mask (the form takes none at S = 1). One call per run of entries
//! ([`super::step::StepPlan::groups`]): query (B, 1, N, 512) and queryRope (B, 1, N, 64) in BSND,
//! key and value the latent cache, keyRope the rotated-key cache, numKeyValueHeads 1, sparseMode
//! 0, the output (B, 1, N, 512) — each head's weighted latents, what `out` holds. Rows that are
//! not dense are copied into scratch (the form takes contiguous query, queryRope and output).
//!
//! Fewer heads than the form takes (DeepSeek-V2-Lite's 16; any count below 128 not 32 or 64)
//! are padded to the next of 32, 64 and 128 on the device, with no host synchronisation: the
//! query and queryRope are copied (one InplaceCopy each, strided) into the real heads of zeroed
//! (T, N', 512) and (T, N', 64) scratch reused across steps and layers, the call takes N' heads,
//! and one InplaceCopy takes the real heads' rows of its (T, N', 512) output into `out`. Each
//! head's scores and softmax are its own over the one KV head, so the real heads' outputs are
//! exactly the unpadded ones (the extra heads' values never reach them; zero keeps them finite).
//! Cost per layer: at most 3 InplaceCopy calls (query, queryRope, output) besides the
//! operator's, 2 more than unpadded heads of dense query and output with a strided queryRope (the
//! agent's case). Releases whose page lists 32, 64 and 128 only (through 8.5) are what this
//! follows; ops-transformer's current page also lists 1, 2, 4, 8 and 16 (padding satisfies both).
//! Refused by name before any call: more than 128 heads, a sliding window, a step of the graph
//! form (its key mask), a release without the operator.

use npu_backend::{AttnGeometry, BackendError, Capability, View, ViewMut};

use super::kv_pool::MLA_ROW;
use super::layer_ops::{bad, copy, dense, step_slice, tview};
use super::objects::AscendBuffer;
use super::step::AttnPath;
use super::{err, AscendBackend};
use crate::ops::RowScatter;
use crate::tensor::{self, IntArray, Tensor, TensorList, View as TView};

/// The query head counts the MLA form takes with a 512-wide latent ("n为32、64、128").
pub(super) const MLA_HEADS: [usize; 3] = [32, 64, 128];
/// The most batch entries of one call (the page's B ≤ 65536).
const MAX_BATCH: usize = 65536;

impl AscendBackend {
    fn mla_unsupported(&self, what: String) -> BackendError {
        BackendError::Unsupported {
            backend: super::NAME,
            what: format!("{}: {what}", Capability::LatentAttention.name()),
        }
    }

    /// `kv_write_latent` into a split pool: latents and rotated keys into their own caches.
    pub(super) fn mla_write(
        &mut self,
        latent: View<'_, AscendBuffer>,
        rope: View<'_, AscendBuffer>,
        layer: usize,
    ) -> Result<(), BackendError> {
        let op = "kv_write_latent";
        let (ll, rl) = (latent.layout(), rope.layout());
        if ll.cols() != MLA_ROW.0 || rl.cols() != MLA_ROW.1 {
            return Err(bad(
                op,
                format!(
                    "a latent of {} and a rope part of {} for a pool of rows of 512 + 64",
                    ll.cols(),
                    rl.cols()
                ),
            ));
        }
        let t = self.plan.n_tokens;
        if t == 0 {
            return Ok(());
        }
        let act = self.act_t();
        self.pending = true;
        for (name, l) in [("mla_latent", ll), ("mla_rope", rl)] {
            if !dense(l) {
                self.scratch.ensure(&self.dev, name, t * l.cols() * 2)?;
            }
        }
        let kv = self
            .kv
            .as_ref()
            .ok_or_else(|| BackendError::BadStep("the KV pool is not initialised".into()))?;
        let spec = kv.spec;
        let caches = kv.layer(layer)?;
        let (slots, _) = step_slice(&self.step_mem, self.plan.slots, t)?;
        for (name, x, cache) in [
            ("mla_latent", &latent, caches.0),
            ("mla_rope", &rope, caches.1),
        ] {
            let l = x.layout();
            let width = l.cols();
            let (src, src_offset) = if dense(l) {
                (&x.buf().mem, l.offset())
            } else {
                let s = self.scratch.get(name);
                copy(
                    &mut self.ops,
                    s,
                    TView::contiguous(act, &[t as i64, width as i64]),
                    &x.buf().mem,
                    tview(x.dtype(), l),
                )?;
                (s, 0)
            };
            self.ops
                .runner
                .scatter_rows(&RowScatter {
                    dtype: act,
                    tokens: t,
                    width,
                    row_stride: width,
                    src,
                    src_offset,
                    cache,
                    slots,
                    slots_offset: self.plan.slots,
                    cache_rows: spec.num_blocks * spec.block_size,
                })
                .map_err(err)?;
        }
        Ok(())
    }

    /// `attention_latent` over a split pool (its checks of the geometry and the step's shapes
    /// done by the caller), through FusedInferAttentionScoreV3's MLA form.
    pub(super) fn mla_attend(
        &mut self,
        q_latent: View<'_, AscendBuffer>,
        q_rope: View<'_, AscendBuffer>,
        g: &AttnGeometry,
        layer: usize,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let h = g.n_heads;
        let (lat, rp) = MLA_ROW;
        // The operator's head count: `h` itself, or the next the form takes (zero query heads
        // appended, their outputs dropped; each head's softmax is its own, so this is exact).
        let Some(hp) = MLA_HEADS.into_iter().find(|&n| n >= h && h > 0) else {
            return Err(self.mla_unsupported(format!(
                "{h} query heads over rows of 512 + 64: FusedInferAttentionScoreV3's MLA form \
                 takes 32, 64 or 128 (fewer are padded to the next of them; the ordinary form \
                 takes no head dim above 512)"
            )));
        };
        let padded = hp != h;
        if self.plan.length_mask.is_some() {
            return Err(self.mla_unsupported(
                "a captured step of the graph form: its key mask is refused by \
                 FusedInferAttentionScoreV3's MLA form at S = 1 (sparseMode 0 without a mask only)"
                    .into(),
            ));
        }
        match self.plan.path {
            Some(AttnPath::TokenWise) => {}
            _ => {
                return Err(BackendError::BadStep(
                    "latent attention of rows 512 + 64 needs a token-wise step (begin_step plans \
                     one for this pool)"
                        .into(),
                ))
            }
        }
        let api = self.dev.acl.api.ops;
        let (Some(prep), Some(launch)) = (
            api.aclnnFusedInferAttentionScoreV3GetWorkspaceSize,
            api.aclnnFusedInferAttentionScoreV3,
        ) else {
            return Err(
                self.missing("latent attention of rows 512 + 64 (aclnnFusedInferAttentionScoreV3)")
            );
        };
        let t = self.plan.n_tokens;
        if t == 0 {
            return Ok(());
        }
        let act = self.act_t();
        let acl = self.dev.acl;
        let (ql, qr, ol) = (q_latent.layout(), q_rope.layout(), out.layout());
        self.pending = true;
        // Contiguous (T, 1, N, D) forms of N = hp heads: the rows themselves where dense and
        // not padded, else scratch. The padded query scratch is zeroed when allocated and only
        // its real heads are ever written, so its extra heads stay zero while `h` stays.
        let names = if padded {
            [
                ("mla_q_pad", ql, lat),
                ("mla_qr_pad", qr, rp),
                ("mla_o", ol, lat),
            ]
        } else {
            [("mla_q", ql, lat), ("mla_qr", qr, rp), ("mla_o", ol, lat)]
        };
        for (name, l, w) in names {
            if padded || !dense(l) {
                self.scratch.ensure(&self.dev, name, t * hp * w * 2)?;
            }
        }
        // (T, h, w): `h` heads of `w` from element `at`, rows `row` apart.
        let heads3 = |w: usize, row: usize, at: usize| {
            let (hi, w) = (h as i64, w as i64);
            TView::strided(act, &[t as i64, hi, w], &[row as i64, w, 1], at as i64)
        };
        for ((name, l, w), x) in names.into_iter().zip([&q_latent, &q_rope]) {
            if padded || !dense(l) {
                copy(
                    &mut self.ops,
                    self.scratch.get(name),
                    heads3(w, hp * w, 0),
                    &x.buf().mem,
                    heads3(w, l.stride(), l.offset()),
                )?;
            }
        }
        let [(q_name, ..), (r_name, ..), _] = names;
        let (q_mem, q_at) = if padded || !dense(ql) {
            (self.scratch.get(q_name), 0)
        } else {
            (&q_latent.buf().mem, ql.offset())
        };
        let (r_mem, r_at) = if padded || !dense(qr) {
            (self.scratch.get(r_name), 0)
        } else {
            (&q_rope.buf().mem, qr.offset())
        };
        let (o_mem, o_at) = if padded || !dense(ol) {
            (self.scratch.get("mla_o"), 0)
        } else {
            (&out.buf().mem, ol.offset())
        };
        // (entries, 1, N, w) of a run of entries, from element `at` of its rows.
        let bsnd = |w: usize, at: usize, r: &std::ops::Range<usize>| {
            let (hw, w) = ((hp * w) as i64, w as i64);
            TView::strided(
                act,
                &[r.len() as i64, 1, hp as i64, w],
                &[hw, hw, w, 1],
                (at + r.start * hp * w as usize) as i64,
            )
        };
        let kv = self
            .kv
            .as_ref()
            .ok_or_else(|| BackendError::BadStep("the KV pool is not initialised".into()))?;
        let spec = kv.spec;
        let (latents, ropes) = kv.layer(layer)?;
        let (nb, bs) = (spec.num_blocks as i64, spec.block_size as i64);
        let mb = self.plan.max_blocks;
        let (tables, _) = step_slice(&self.step_mem, self.plan.tables, self.plan.batch * mb)?;
        let mut calls = Vec::with_capacity(self.plan.groups.len());
        for r in &self.plan.groups {
            if r.len() > MAX_BATCH {
                return Err(self.mla_unsupported(format!(
                    "{} entries in one call: FusedInferAttentionScoreV3 takes B up to {MAX_BATCH}",
                    r.len()
                )));
            }
            let cache = |w: i64| TView::contiguous(act, &[nb, bs, w]);
            let list = |w: i64| -> Result<TensorList, BackendError> {
                TensorList::new(acl, vec![Tensor::new(acl, latents, cache(w)).map_err(err)?])
                    .map_err(err)
            };
            calls.push((
                Tensor::new(acl, q_mem, bsnd(lat, q_at, r)).map_err(err)?,
                list(lat as i64)?,
                list(lat as i64)?,
                Tensor::new(acl, r_mem, bsnd(rp, r_at, r)).map_err(err)?,
                Tensor::new(acl, ropes, cache(rp as i64)).map_err(err)?,
                Tensor::new(
                    acl,
                    tables,
                    TView::strided(
                        tensor::DType::I32,
                        &[r.len() as i64, mb as i64],
                        &[mb as i64, 1],
                        (self.plan.tables + r.start * mb) as i64,
                    ),
                )
                .map_err(err)?,
                IntArray::new(acl, &self.plan.kv_lens[r.clone()]).map_err(err)?,
                Tensor::new(acl, o_mem, bsnd(lat, o_at, r)).map_err(err)?,
            ));
        }
        let scale = f64::from(g.scale);
        let (heads, block_size) = (hp as i64, bs);
        for (query, key, value, query_rope, key_rope, table, kv_lens, attn_out) in &calls {
            let detail = format!(
                "query {:?} keyRope {:?} blockTable {:?} kv={:?} blockSize={bs} heads={hp}/1 ({h} real) BSND",
                query.view().dims,
                key_rope.view().dims,
                table.view().dims,
                &self.plan.kv_lens,
            );
            let null = std::ptr::null::<npu_ffi::types::aclTensor>();
            let mut layout = *b"BSND\0";
            self.ops
                .runner
                .call(
                    "aclnnFusedInferAttentionScoreV3",
                    detail,
                    // SAFETY: live tensors, lists and arrays (held by `calls` past the call),
                    // nulls for the absent optionals, a NUL-terminated layout, out-pointers.
                    |w, e| unsafe {
                        prep(
                            query.raw(),
                            key.raw(),
                            value.raw(),
                            null,
                            null,
                            std::ptr::null(),
                            kv_lens.raw(),
                            null,
                            null,
                            null,
                            null,
                            null,
                            null,
                            null,
                            table.raw(),
                            null,
                            null,
                            null,
                            null,
                            null,
                            null,
                            null,
                            null,
                            std::ptr::null(),
                            query_rope.raw(),
                            key_rope.raw(),
                            null,
                            heads,
                            scale,
                            i32::MAX as i64,
                            i32::MAX as i64,
                            layout.as_mut_ptr().cast(),
                            1,
                            0,
                            0,
                            block_size,
                            0,
                            false,
                            0,
                            0,
                            attn_out.raw(),
                            null,
                            w,
                            e,
                        )
                    },
                    launch,
                )
                .map_err(err)?;
        }
        drop(calls);
        // The real heads' rows of the output (a padded output's extra heads are dropped).
        if padded || !dense(ol) {
            copy(
                &mut self.ops,
                &out.buf().mem,
                heads3(lat, ol.stride(), ol.offset()),
                self.scratch.get("mla_o"),
                heads3(lat, hp * lat, 0),
            )?;
        }
        Ok(())
    }
}

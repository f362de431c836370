//! RoPE on the device: the cos/sin table for the step's positions and the rotation of the
//! query and key heads (RotaryPositionEmbedding or ApplyRotaryPosEmb, by the model's style).

use npu_backend::{AttnGeometry, BackendError, Layout, ViewMut};
use npu_gguf::hparams::RopeStyle;

use super::layer_ops::{bad, copy, gather, step_slice, want_f16};
use super::objects::AscendBuffer;
use super::{err, AscendBackend, RopeKernel, RopeTable};
use crate::reuse::Arg;
use crate::tensor::{self, View as TView};

impl AscendBackend {
    /// Makes the cos/sin table cover the step's positions for `rope`, laid out for the kernel.
    fn ensure_rope_table(
        &mut self,
        rope: &npu_gguf::hparams::Rope,
        interleaved: bool,
    ) -> Result<(), BackendError> {
        let need = self.plan.max_position as usize + 1;
        if self
            .rope_table
            .as_ref()
            .is_some_and(|t| t.rope == *rope && t.interleaved == interleaved && t.rows >= need)
        {
            return Ok(());
        }
        let rows = need.max(4096).next_power_of_two();
        let d = rope.dims;
        let mut host = Vec::with_capacity(rows * 2 * d);
        let mut cs = vec![0f32; d];
        let mut row = vec![half::f16::ZERO; 2 * d];
        for pos in 0..rows {
            rope.angles(pos as u32, &mut cs);
            for i in 0..d / 2 {
                let (c, s) = (
                    half::f16::from_f32(cs[2 * i]),
                    half::f16::from_f32(cs[2 * i + 1]),
                );
                let (a, b) = if interleaved {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + d / 2)
                };
                row[a] = c;
                row[b] = c;
                row[d + a] = s;
                row[d + b] = s;
            }
            host.extend_from_slice(&row);
        }
        // A fresh allocation: no queued work can touch it, so the copy needs no synchronization.
        let mem = super::objects::upload_new(
            &self.dev,
            &super::objects::f16_bytes(host),
            "the rotary table",
        )?;
        let generation = self.rope_table.as_ref().map_or(1, |t| t.generation + 1);
        if let Some(old) = self.rope_table.take() {
            self.retired_mem.push(old.mem);
        }
        self.rope_table = Some(RopeTable {
            rope: *rope,
            interleaved,
            rows,
            mem,
            generation,
        });
        Ok(())
    }

    /// The step's cos/sin rows (T rows of [cos | sin]), gathered once per step by position.
    fn rope_rows(&mut self, width: usize) -> Result<(), BackendError> {
        let table = self.rope_table.as_ref().expect("ensured by the caller");
        let want = (self.serial, table.generation);
        if self.rope_rows_for == Some(want) {
            return Ok(());
        }
        let t = self.plan.n_tokens;
        self.scratch.ensure(&self.dev, "rope_cs", t * width * 2)?;
        let table = self.rope_table.as_ref().expect("ensured by the caller");
        let idx = step_slice(&self.step_mem, self.plan.positions, t)?;
        gather(
            &mut self.ops,
            (
                &table.mem,
                TView::contiguous(tensor::DType::F16, &[table.rows as i64, width as i64]),
            ),
            idx,
            (
                self.scratch.get("rope_cs"),
                TView::contiguous(tensor::DType::F16, &[t as i64, width as i64]),
            ),
        )?;
        self.rope_rows_for = Some(want);
        Ok(())
    }

    pub(super) fn op_rope(
        &mut self,
        qk: ViewMut<'_, AscendBuffer>,
        g: &AttnGeometry,
    ) -> Result<(), BackendError> {
        let op = "rope";
        let l = qk.layout();
        want_f16(op, "qk", qk.dtype())?;
        self.check_rows(op, l.rows())?;
        let heads = g.n_heads + g.n_kv_heads;
        let (hd, d) = (g.head_dim, g.rope.dims);
        if l.cols() != heads * hd {
            return Err(bad(
                op,
                format!("{} columns for {heads} heads of {hd}", l.cols()),
            ));
        }
        if d == 0 || d > hd || !d.is_multiple_of(2) {
            return Err(bad(
                op,
                format!("{d} rotated dimensions of a {hd}-wide head"),
            ));
        }
        let api = self.dev.acl.api.ops;
        let native = match self.cfg.rope {
            RopeKernel::Auto => api
                .aclnnRotaryPositionEmbeddingGetWorkspaceSize
                .zip(api.aclnnRotaryPositionEmbedding),
            RopeKernel::ApplyRotaryPosEmb => None,
        };
        let interleaved = g.rope.style == RopeStyle::Interleaved;
        // The table's pairing follows the kernel: the native one rotates interleaved pairs itself;
        // ApplyRotaryPosEmb rotates halves (interleaved heads are regrouped into halves first).
        self.ensure_rope_table(&g.rope, interleaved && native.is_some())?;
        self.rope_rows(2 * d)?;
        if native.is_none() && interleaved {
            self.scratch
                .ensure(&self.dev, "rope_x", l.rows() * heads * d * 2)?;
        }
        self.pending = true;
        let t = l.rows() as i64;
        let cs = self.scratch.get("rope_cs");
        let cos = TView::strided(
            tensor::DType::F16,
            &[1, t, 1, d as i64],
            &[t * 2 * d as i64, 2 * d as i64, d as i64, 1],
            0,
        );
        let sin = TView {
            offset: d as i64,
            ..cos.clone()
        };
        let qkm = &qk.buf().mem;
        // (1, T, heads, d): the rotated part of every head, rows `stride` apart.
        let x = TView::strided(
            tensor::DType::F16,
            &[1, t, heads as i64, d as i64],
            &[t * l.stride() as i64, l.stride() as i64, hd as i64, 1],
            l.offset() as i64,
        );
        if let Some((prep, launch)) = native {
            let mode = if interleaved { 1 } else { 0 };
            return self
                .ops
                .call(
                    "aclnnRotaryPositionEmbedding",
                    launch,
                    &[
                        Arg::input("x", 0, qkm, x.clone()),
                        Arg::input("cos", 1, cs, cos),
                        Arg::input("sin", 2, cs, sin),
                        Arg::output("out", 0, qkm, x),
                    ],
                    &[mode],
                    &[],
                    // SAFETY (closure): live tensors and out-pointers from the launcher.
                    Box::new(move |ts, _, w, e| unsafe {
                        prep(
                            ts[0].raw(),
                            ts[1].raw(),
                            ts[2].raw(),
                            mode,
                            ts[3].raw(),
                            w,
                            e,
                        )
                    }),
                )
                .map_err(err);
        }
        // ApplyRotaryPosEmb: q and k in place, rotating halves.
        let (work, wv) = if interleaved {
            // Pairs (2i, 2i+1) regrouped as (i, i + d/2) in a scratch copy, rotated, put back.
            let s = self.scratch.get("rope_x");
            let (src, dst) = regroup_views(t, heads, hd, d, l);
            copy(&mut self.ops, s, dst, qkm, src)?;
            (
                s,
                TView::strided(
                    tensor::DType::F16,
                    &[1, t, heads as i64, d as i64],
                    &[t * (heads * d) as i64, (heads * d) as i64, d as i64, 1],
                    0,
                ),
            )
        } else {
            (qkm, x)
        };
        let q = TView {
            dims: vec![1, t, g.n_heads as i64, d as i64],
            ..wv.clone()
        };
        let k = TView {
            dims: vec![1, t, g.n_kv_heads as i64, d as i64],
            offset: wv.offset + g.n_heads as i64 * wv.strides[2],
            ..wv.clone()
        };
        let prep = api.aclnnApplyRotaryPosEmbGetWorkspaceSize;
        self.ops
            .call(
                "aclnnApplyRotaryPosEmb",
                api.aclnnApplyRotaryPosEmb,
                &[
                    Arg::fixed("queryRef", work, q),
                    Arg::fixed("keyRef", work, k),
                    Arg::fixed("cos", cs, cos),
                    Arg::fixed("sin", cs, sin),
                ],
                &[1],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    prep(ts[0].raw(), ts[1].raw(), ts[2].raw(), ts[3].raw(), 1, w, e)
                }),
            )
            .map_err(err)?;
        if interleaved {
            let (orig, grouped) = regroup_views(t, heads, hd, d, l);
            let s = self.scratch.get("rope_x");
            copy(&mut self.ops, qkm, orig, s, grouped)?;
        }
        Ok(())
    }
}

/// The rotated part of each head seen as (T, heads, 2, d/2): over the step's rows with pairs
/// interleaved (element 2i + j at [.., j, i]), and over a dense scratch with the halves apart.
fn regroup_views(t: i64, heads: usize, hd: usize, d: usize, l: Layout) -> (TView, TView) {
    let dims = [t, heads as i64, 2, d as i64 / 2];
    let interleaved = TView::strided(
        tensor::DType::F16,
        &dims,
        &[l.stride() as i64, hd as i64, 1, 2],
        l.offset() as i64,
    );
    let halves = TView::contiguous(tensor::DType::F16, &dims);
    (interleaved, halves)
}

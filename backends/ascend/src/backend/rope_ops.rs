//! RoPE on the device: host-built cos/sin tables, one per rope (base, scaling, frequency
//! factors), the step's rows of each gathered by position, and the rotation of the query and
//! key heads (RotaryPositionEmbedding or ApplyRotaryPosEmb, by the model's style).

use npu_backend::{AttnGeometry, BackendError, Layout, ViewMut};
use npu_gguf::hparams::RopeStyle;

use super::layer_ops::{bad, copy, gather, step_slice, want_f16};
use super::objects::AscendBuffer;
use super::{err, AscendBackend, RopeKernel, RopeTable, ROPE_TABLES};
use crate::reuse::Arg;
use crate::tensor::{self, View as TView};

impl AscendBackend {
    /// The index of `rope`'s cos/sin table, laid out for the kernel, made (or grown) to cover the
    /// step's positions. Each rope keeps its own table, so ropes alternating from layer to layer
    /// (Gemma 3's local and global bases) never rebuild one another's.
    fn ensure_rope_table(
        &mut self,
        rope: &npu_gguf::hparams::Rope,
        interleaved: bool,
    ) -> Result<usize, BackendError> {
        let need = self.plan.max_position as usize + 1;
        let serial = self.serial;
        let found = self
            .rope_tables
            .iter()
            .position(|t| t.rope == *rope && t.interleaved == interleaved);
        if let Some(i) = found.filter(|&i| self.rope_tables[i].rows >= need) {
            self.rope_tables[i].used = serial;
            return Ok(i);
        }
        let rows = need.max(4096).next_power_of_two();
        let d = rope.dims;
        let mut host = Vec::with_capacity(rows * 2 * d);
        let mut cs = vec![0f32; d];
        let mut row = vec![half::f16::ZERO; 2 * d];
        for pos in 0..rows {
            // Base, position scale and frequency factors, as the CPU backend turns them.
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
        let table = RopeTable {
            rope: *rope,
            interleaved,
            rows,
            mem,
            step_rows: None,
            rows_for: None,
            used: serial,
        };
        // Replaced: the same rope's smaller table, else the least recently used one when full.
        let slot = found.or_else(|| {
            (self.rope_tables.len() >= ROPE_TABLES).then(|| {
                (0..self.rope_tables.len())
                    .min_by_key(|&i| self.rope_tables[i].used)
                    .expect("full")
            })
        });
        Ok(match slot {
            Some(i) => {
                let old = std::mem::replace(&mut self.rope_tables[i], table);
                // Queued kernels may still read the old table and rows.
                self.retired_mem.push(old.mem);
                self.retired_mem.extend(old.step_rows);
                i
            }
            None => {
                self.rope_tables.push(table);
                self.rope_tables.len() - 1
            }
        })
    }

    /// The step's cos/sin rows of table `i` (T rows of [cos | sin]), gathered once per step by
    /// position.
    fn rope_rows(&mut self, i: usize, width: usize) -> Result<(), BackendError> {
        let t = self.plan.n_tokens;
        let table = &mut self.rope_tables[i];
        if table.rows_for == Some(self.serial) {
            return Ok(());
        }
        let bytes = t * width * 2;
        if table.step_rows.as_ref().is_none_or(|m| m.bytes() < bytes) {
            let fresh =
                super::objects::zeroed(&self.dev, bytes.next_power_of_two(), "rotary rows")?;
            if let Some(old) = table.step_rows.replace(fresh) {
                self.retired_mem.push(old);
            }
        }
        let table = &self.rope_tables[i];
        let idx = step_slice(&self.step_mem, self.plan.positions, t)?;
        gather(
            &mut self.ops,
            (
                &table.mem,
                TView::contiguous(tensor::DType::F16, &[table.rows as i64, width as i64]),
            ),
            idx,
            (
                table.step_rows.as_ref().expect("just ensured"),
                TView::contiguous(tensor::DType::F16, &[t as i64, width as i64]),
            ),
        )?;
        self.rope_tables[i].rows_for = Some(self.serial);
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
        let ti = self.ensure_rope_table(&g.rope, interleaved && native.is_some())?;
        self.rope_rows(ti, 2 * d)?;
        if native.is_none() && interleaved {
            self.scratch
                .ensure(&self.dev, "rope_x", l.rows() * heads * d * 2)?;
        }
        self.pending = true;
        let t = l.rows() as i64;
        let cs = self.rope_tables[ti]
            .step_rows
            .as_ref()
            .expect("gathered above");
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

//! RoPE on the device: host-built cos/sin tables, one per rope (base, scaling, frequency
//! factors), the step's rows of each gathered by position, and the rotation of the query and
//! key heads: ApplyRotaryPosEmb (q and k in place in one call; rotary width 128 only, as its page
//! requires; the automatic choice for half-rotation ropes), RotaryPositionEmbedding (into a dense
//! scratch, copied back: its out must be contiguous), or an element-wise Mul/Add rotation where
//! neither applies.

use npu_backend::{AttnGeometry, BackendError, Layout, ViewMut};
use npu_model::RopeStyle;

use super::layer_ops::{bad, copy, gather, step_slice, want_act};
use super::objects::AscendBuffer;
use super::{err, AscendBackend, RopeKernel, RopeTable, ROPE_TABLES};
use crate::memory::DeviceBuffer as Mem;
use crate::reuse::{Arg, Launcher};
use crate::tensor::{self, View as TView};

impl AscendBackend {
    /// The index of `rope`'s cos/sin table, laid out for the kernel, made (or grown) to cover the
    /// step's positions. Each rope keeps its own table, so ropes alternating from layer to layer
    /// (Gemma 3's local and global bases) never rebuild one another's.
    fn ensure_rope_table(
        &mut self,
        rope: &npu_model::Rope,
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
        let mut row = vec![0f32; 2 * d];
        for pos in 0..rows {
            // Base, position scale and frequency factors, as the CPU backend turns them.
            rope.angles(pos as u32, &mut cs);
            for i in 0..d / 2 {
                let (c, s) = (cs[2 * i], cs[2 * i + 1]);
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
            &super::objects::half_bytes(self.act, &host),
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
        let act = self.act_t();
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
                TView::contiguous(act, &[table.rows as i64, width as i64]),
            ),
            idx,
            (
                table.step_rows.as_ref().expect("just ensured"),
                TView::contiguous(act, &[t as i64, width as i64]),
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
        let act = self.act_t();
        let l = qk.layout();
        want_act(op, "qk", qk.dtype(), self.act)?;
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
        let native = api
            .aclnnRotaryPositionEmbeddingGetWorkspaceSize
            .zip(api.aclnnRotaryPositionEmbedding);
        let interleaved = g.rope.style == RopeStyle::Interleaved;
        let bf16 = self.act == npu_backend::DType::BF16;
        let kernel = pick_kernel(self.cfg.rope, native.is_some(), interleaved, bf16, d, g);
        // The table's pairing follows the kernel: RotaryPositionEmbedding and the element-wise
        // rotation pair interleaved elements themselves; ApplyRotaryPosEmb rotates halves
        // (interleaved heads are regrouped into halves first).
        let ti = self.ensure_rope_table(&g.rope, interleaved && kernel != Kernel::Apply)?;
        self.rope_rows(ti, 2 * d)?;
        let dense_bytes = l.rows() * heads * d * 2;
        match kernel {
            Kernel::Native => self.scratch.ensure(&self.dev, "rope_o", dense_bytes)?,
            Kernel::Apply if interleaved => {
                self.scratch.ensure(&self.dev, "rope_x", dense_bytes)?
            }
            Kernel::Apply => {}
            Kernel::Elementwise => {
                self.scratch.ensure(&self.dev, "rope_c", dense_bytes)?;
                self.scratch.ensure(&self.dev, "rope_s", dense_bytes)?;
            }
        }
        self.pending = true;
        let t = l.rows() as i64;
        let cs = self.rope_tables[ti]
            .step_rows
            .as_ref()
            .expect("gathered above");
        let cos = TView::strided(
            act,
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
            act,
            &[1, t, heads as i64, d as i64],
            &[t * l.stride() as i64, l.stride() as i64, hd as i64, 1],
            l.offset() as i64,
        );
        let packed = TView::contiguous(act, &[1, t, heads as i64, d as i64]);
        match kernel {
            Kernel::Native => {
                let (prep, launch) = native.expect("picked only where the release has it");
                let mode = if interleaved { 1 } else { 0 };
                // x may be strided (the page allows it); out may not, and the page documents no
                // in-place use: the rotation goes to a dense scratch, copied back into the rows.
                let o = self.scratch.get("rope_o");
                self.ops
                    .call(
                        "aclnnRotaryPositionEmbedding",
                        launch,
                        &[
                            Arg::input("x", 0, qkm, x.clone()),
                            Arg::input("cos", 1, cs, cos),
                            Arg::input("sin", 2, cs, sin),
                            Arg::output("out", 0, o, packed.clone()),
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
                    .map_err(err)?;
                copy(&mut self.ops, qkm, x, o, packed)
            }
            Kernel::Elementwise => {
                let scratch = (self.scratch.get("rope_c"), self.scratch.get("rope_s"));
                rotate_elementwise(&mut self.ops, qkm, &x, cs, &cos, scratch, interleaved)
            }
            Kernel::Apply => {
                // ApplyRotaryPosEmb: q and k in place, rotating halves.
                let (work, wv) = if interleaved {
                    // Pairs (2i, 2i+1) regrouped as (i, i + d/2) in a scratch copy, rotated,
                    // put back.
                    let s = self.scratch.get("rope_x");
                    let (src, dst) = regroup_views(act, t, heads, hd, d, l);
                    copy(&mut self.ops, s, dst, qkm, src)?;
                    (s, packed)
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
                    let (orig, grouped) = regroup_views(act, t, heads, hd, d, l);
                    let s = self.scratch.get("rope_x");
                    copy(&mut self.ops, qkm, orig, s, grouped)?;
                }
                Ok(())
            }
        }
    }
}

/// The rotated part of each head seen as (T, heads, 2, d/2): over the step's rows with pairs
/// interleaved (element 2i + j at [.., j, i]), and over a dense scratch with the halves apart.
fn regroup_views(
    act: tensor::DType,
    t: i64,
    heads: usize,
    hd: usize,
    d: usize,
    l: Layout,
) -> (TView, TView) {
    let dims = [t, heads as i64, 2, d as i64 / 2];
    let interleaved = TView::strided(
        act,
        &dims,
        &[l.stride() as i64, hd as i64, 1, 2],
        l.offset() as i64,
    );
    let halves = TView::contiguous(act, &dims);
    (interleaved, halves)
}

/// Which operator rotates a step's heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// RotaryPositionEmbedding (half or interleave mode), into a dense scratch.
    Native,
    /// ApplyRotaryPosEmb, q and k in place (rotary width 128 only).
    Apply,
    /// Mul and Add over the pairs ([`rotate_elementwise`]).
    Elementwise,
}

/// aclnnApplyRotaryPosEmb's page: the last dimension D of queryRef, keyRef, cos and sin must
/// equal 128.
const APPLY_ROPE_D: usize = 128;

/// Whether ApplyRotaryPosEmb takes `heads` (q + k) heads rotated over `d` dimensions in 16-bit
/// activations (`bf16` or FLOAT16): D = 128, and the page's unified-buffer bound,
/// (q_n + k_n)·128·castSize·5 + 128·DtypeSize·4 + cast·128·4·2 bytes (FLOAT16: cast 0, castSize
/// 2; BFLOAT16: cast 1, castSize 4; DtypeSize 2), within the 192 KiB of an Atlas A2/A3 AI core.
fn apply_fits(d: usize, heads: usize, bf16: bool) -> bool {
    let (cast, cast_size) = if bf16 { (1, 4) } else { (0, 2) };
    let d128 = APPLY_ROPE_D;
    d == d128 && heads * d128 * cast_size * 5 + d128 * 2 * 4 + cast * d128 * 4 * 2 <= 192 * 1024
}

/// The kernel for `cfg`. Auto: ApplyRotaryPosEmb for half-rotation ropes its page takes (one
/// call rotating q and k in place, as vllm-ascend's `npu_apply_rotary_pos_emb`; an interleaved
/// rope would need its pairs regrouped around it), else RotaryPositionEmbedding where the release
/// has it (two calls: the rotation into a dense scratch and the copy back), else
/// ApplyRotaryPosEmb where its documented shape holds; otherwise — ApplyRotaryPosEmb configured
/// or left as the automatic fallback for a width it does not take — RotaryPositionEmbedding if
/// present, else the element-wise rotation, with a warning naming the constraint.
fn pick_kernel(
    cfg: RopeKernel,
    has_native: bool,
    interleaved: bool,
    bf16: bool,
    d: usize,
    g: &AttnGeometry,
) -> Kernel {
    let heads = g.n_heads + g.n_kv_heads;
    match cfg {
        RopeKernel::MulAdd => return Kernel::Elementwise,
        RopeKernel::Auto if !interleaved && apply_fits(d, heads, bf16) => return Kernel::Apply,
        RopeKernel::Auto if has_native => return Kernel::Native,
        _ => {}
    }
    if apply_fits(d, heads, bf16) {
        return Kernel::Apply;
    }
    let instead = if has_native {
        Kernel::Native
    } else {
        Kernel::Elementwise
    };
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            "aclnnApplyRotaryPosEmb takes only a rotary width D of {APPLY_ROPE_D} (and a bounded \
             q + k head count); this model rotates {d} dimensions of {heads} heads, so {} is used \
             instead",
            match instead {
                Kernel::Native => "aclnnRotaryPositionEmbedding",
                _ => "an element-wise rotation (aclnnMul, aclnnAdd)",
            }
        )
    });
    instead
}

/// Rotates `x` (1, T, heads, d) in place with Mul and Add, which take strided views and
/// broadcast: each pair (a, b) — halves (i, i + d/2), or interleaved (2i, 2i + 1) — becomes
/// (a·cos − b·sin, b·cos + a·sin). `cos` is the step's table rows (1, T, 1, d) in `cs`, whose
/// sin row starts d after it; `c` and `s` are dense scratch of x's size.
fn rotate_elementwise(
    ops: &mut Launcher,
    xm: &Mem,
    x: &TView,
    cs: &Mem,
    cos: &TView,
    (cm, sm): (&Mem, &Mem),
    interleaved: bool,
) -> Result<(), BackendError> {
    let d = x.dims[3];
    let half = d / 2;
    // The a (`second` false) or b elements of every pair of `v`, as (.., d/2).
    let part = |v: &TView, second: bool| {
        let mut p = v.clone();
        p.dims[3] = half;
        if interleaved {
            p.offset += second as i64 * v.strides[3];
            p.strides[3] *= 2;
        } else {
            p.offset += second as i64 * half * v.strides[3];
        }
        p
    };
    let sin = TView {
        offset: cos.offset + d,
        ..cos.clone()
    };
    let dense = TView::contiguous(x.dtype, &x.dims);
    // c = x·cos; s_a = b·sin_a, s_b = a·sin_b.
    mul(ops, (xm, x.clone()), (cs, cos.clone()), (cm, dense.clone()))?;
    mul(
        ops,
        (xm, part(x, true)),
        (cs, part(&sin, false)),
        (sm, part(&dense, false)),
    )?;
    mul(
        ops,
        (xm, part(x, false)),
        (cs, part(&sin, true)),
        (sm, part(&dense, true)),
    )?;
    // a = c_a − s_a, b = c_b + s_b, written into the rows.
    for (second, alpha) in [(false, -1.0), (true, 1.0)] {
        add(
            ops,
            (cm, part(&dense, second)),
            (sm, part(&dense, second)),
            alpha,
            (xm, part(x, second)),
        )?;
    }
    Ok(())
}

/// `out = a · b` (b broadcast), aclnnMul.
fn mul(
    ops: &mut Launcher,
    a: (&Mem, TView),
    b: (&Mem, TView),
    out: (&Mem, TView),
) -> Result<(), BackendError> {
    let api = ops.runner.acl().api.ops;
    let prep = api.aclnnMulGetWorkspaceSize;
    ops.call(
        "aclnnMul",
        api.aclnnMul,
        &[
            Arg::input("self", 0, a.0, a.1),
            Arg::input("other", 1, b.0, b.1),
            Arg::output("out", 0, out.0, out.1),
        ],
        &[],
        &[],
        // SAFETY (closure): live tensors and out-pointers from the launcher.
        Box::new(move |ts, _, w, e| unsafe { prep(ts[0].raw(), ts[1].raw(), ts[2].raw(), w, e) }),
    )
    .map_err(err)
}

/// `out = a + alpha · b`, aclnnAdd.
fn add(
    ops: &mut Launcher,
    a: (&Mem, TView),
    b: (&Mem, TView),
    alpha: f32,
    out: (&Mem, TView),
) -> Result<(), BackendError> {
    let api = ops.runner.acl().api.ops;
    let prep = api.aclnnAddGetWorkspaceSize;
    ops.call(
        "aclnnAdd",
        api.aclnnAdd,
        &[
            Arg::input("self", 0, a.0, a.1),
            Arg::input("other", 1, b.0, b.1),
            Arg::output("out", 0, out.0, out.1),
        ],
        &[],
        &[alpha],
        // SAFETY (closure): live tensors, scalar and out-pointers from the launcher.
        Box::new(move |ts, sc, w, e| unsafe {
            prep(ts[0].raw(), ts[1].raw(), sc[0].raw(), ts[2].raw(), w, e)
        }),
    )
    .map_err(err)
}

#[cfg(test)]
mod tests {
    use super::apply_fits;

    /// The page's unified-buffer bound: 152 FLOAT16 heads of 128 fit 192 KiB, 153 do not; in
    /// BFLOAT16 (staged in 32 bits) 76 and 77.
    #[test]
    fn apply_rotary_pos_emb_takes_the_heads_its_page_bound_allows() {
        assert!(apply_fits(128, 152, false) && !apply_fits(128, 153, false));
        assert!(apply_fits(128, 76, true) && !apply_fits(128, 77, true));
        assert!(!apply_fits(64, 8, false));
    }
}

//! The per-token operators of a step, each one aclnn call (or a documented pair) on the agent's
//! stream: Embedding (token rows, logit rows), RmsNorm, WeightQuantBatchMatmulV2 / Matmul,
//! InplaceAdd (bias, residual), RotaryPositionEmbedding or ApplyRotaryPosEmb, SwiGlu, and ArgMax
//! with a Cast to INT32. Views of the seam become strided aclTensors over the same memory; where an
//! operator needs contiguous rows a copy (InplaceCopy) goes through a scratch buffer.

use npu_backend::{BackendError, DType, Layout, View, ViewMut};

use super::objects::{
    acl_dtype, column_blocks, AscendBuffer, AscendEmbedding, AscendMatrix, MatrixForm,
    WQBMM_MAX_DIM,
};
use super::{err, AscendBackend, Scratch};
use crate::memory::DeviceBuffer as Mem;
use crate::reuse::{Arg, Launcher};
use crate::tensor::{self, View as TView};
use crate::weights::GROUP;

pub(super) fn bad(op: &'static str, message: impl Into<String>) -> BackendError {
    BackendError::BadArgument {
        op,
        message: message.into(),
    }
}

/// A 2-D seam layout as an aclTensor view.
pub(super) fn tview(dtype: DType, l: Layout) -> TView {
    TView::strided(
        acl_dtype(dtype),
        &[l.rows() as i64, l.cols() as i64],
        &[l.stride() as i64, 1],
        l.offset() as i64,
    )
}

/// Whether a seam layout is dense row-major (rows exactly `cols` apart, or a single row): the
/// form operators whose documentation refuses non-contiguous tensors take.
pub(super) fn dense(l: Layout) -> bool {
    l.rows() <= 1 || l.stride() == l.cols()
}

/// Refuses activations that are not of the backend's activation type `act` (f16 or bf16).
pub(super) fn want_act(
    op: &'static str,
    what: &str,
    dt: DType,
    act: DType,
) -> Result<(), BackendError> {
    if dt != act {
        return Err(bad(
            op,
            format!(
                "{what} is {}; the Ascend backend computes this model in {}",
                dt.name(),
                act.name()
            ),
        ));
    }
    Ok(())
}

/// Refuses activations that are not f16 (for the operators that take f16 activations only).
pub(super) fn want_f16(op: &'static str, what: &str, dt: DType) -> Result<(), BackendError> {
    if dt != DType::F16 {
        return Err(bad(
            op,
            format!(
                "{what} is {}; the Ascend backend computes in f16",
                dt.name()
            ),
        ));
    }
    Ok(())
}

/// `dst = src` (same shapes) through aclnnInplaceCopy.
pub(super) fn copy(
    ops: &mut Launcher,
    dst: &Mem,
    dst_view: TView,
    src: &Mem,
    src_view: TView,
) -> Result<(), BackendError> {
    let api = ops.runner.acl().api.ops;
    let prep = api.aclnnInplaceCopyGetWorkspaceSize;
    ops.call(
        "aclnnInplaceCopy",
        api.aclnnInplaceCopy,
        &[
            Arg::fixed("selfRef", dst, dst_view),
            Arg::fixed("src", src, src_view),
        ],
        &[],
        &[],
        // SAFETY (closure): live tensors and out-pointers from the launcher.
        Box::new(move |ts, _, w, e| unsafe { prep(ts[0].raw(), ts[1].raw(), w, e) }),
    )
    .map_err(err)
}

/// The step's INT32 inputs from element `at`, `n` values (as a 1-D view).
pub(super) fn step_slice(
    step_mem: &Option<Mem>,
    at: usize,
    n: usize,
) -> Result<(&Mem, TView), BackendError> {
    let mem = step_mem
        .as_ref()
        .ok_or_else(|| BackendError::BadStep("no step has begun".into()))?;
    Ok((
        mem,
        TView::strided(tensor::DType::I32, &[n as i64], &[1], at as i64),
    ))
}

/// `dst` row i = `src` row `idx[i]` (aclnnEmbedding over any rows).
pub(super) fn gather(
    ops: &mut Launcher,
    src: (&Mem, TView),
    idx: (&Mem, TView),
    dst: (&Mem, TView),
) -> Result<(), BackendError> {
    let api = ops.runner.acl().api.ops;
    let prep = api.aclnnEmbeddingGetWorkspaceSize;
    ops.call(
        "aclnnEmbedding",
        api.aclnnEmbedding,
        &[
            Arg::input("weight", 0, src.0, src.1),
            Arg::input("indices", 1, idx.0, idx.1),
            Arg::output("out", 0, dst.0, dst.1),
        ],
        &[],
        &[],
        // SAFETY (closure): live tensors and out-pointers from the launcher.
        Box::new(move |ts, _, w, e| unsafe { prep(ts[0].raw(), ts[1].raw(), ts[2].raw(), w, e) }),
    )
    .map_err(err)
}

/// `x += y` (y broadcast over x's rows when it is one row), in place (aclnnInplaceAdd).
fn inplace_add(
    ops: &mut Launcher,
    op: &'static str,
    x: &Mem,
    xv: TView,
    y: &Mem,
    yv: TView,
) -> Result<(), BackendError> {
    let api = ops.runner.acl().api.ops;
    let prep = api.aclnnInplaceAddGetWorkspaceSize;
    ops.call(
        "aclnnInplaceAdd",
        api.aclnnInplaceAdd,
        &[Arg::fixed("selfRef", x, xv), Arg::fixed("other", y, yv)],
        &[],
        &[1.0],
        // SAFETY (closure): live tensors, scalar and out-pointers from the launcher.
        Box::new(move |ts, sc, w, e| unsafe { prep(ts[0].raw(), ts[1].raw(), sc[0].raw(), w, e) }),
    )
    .map_err(err)
    .map_err(|e| match e {
        BackendError::Device { backend, message } => BackendError::Device {
            backend,
            message: format!("{op}: {message}"),
        },
        e => e,
    })
}

/// `y = x · w[:, cols]` through WeightQuantBatchMatmulV2 (outputs `cols` of a quantized matrix;
/// at most [`WQBMM_MAX_DIM`] of them), `y` contiguous (m, cols).
fn wqbmm(
    ops: &mut Launcher,
    w: &AscendMatrix,
    cols: std::ops::Range<usize>,
    x: (&Mem, TView),
    y: (&Mem, TView),
) -> Result<(), BackendError> {
    let MatrixForm::Quant {
        weight,
        scale,
        offset,
        ..
    } = &w.form
    else {
        return Err(bad("matmul", "not a quantized matrix"));
    };
    let api = ops.runner.acl().api.ops;
    let prep = api.aclnnWeightQuantBatchMatmulV2GetWorkspaceSize;
    let mut args = vec![
        Arg::input("x", 0, x.0, x.1),
        Arg::input("weight", 1, weight, w.weight_cols(cols.clone())),
        Arg::input("antiquantScale", 2, scale, w.group_cols(cols.clone())),
    ];
    if let Some(o) = offset {
        args.push(Arg::input("antiquantOffset", 3, o, w.group_cols(cols)));
    }
    args.push(Arg::output("y", 0, y.0, y.1));
    let has_offset = offset.is_some();
    ops.call(
        "aclnnWeightQuantBatchMatmulV2",
        api.aclnnWeightQuantBatchMatmulV2,
        &args,
        &[GROUP as i64],
        &[],
        // SAFETY (closure): live tensors (or null optionals) and out-pointers.
        Box::new(move |ts, _, w, e| unsafe {
            let (off, y) = if has_offset {
                (ts[3].raw() as *const _, ts[4].raw())
            } else {
                (std::ptr::null(), ts[3].raw())
            };
            prep(
                ts[0].raw(),
                ts[1].raw(),
                ts[2].raw(),
                off,
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null(),
                GROUP as i32,
                y,
                w,
                e,
            )
        }),
    )
    .map_err(err)
}

/// The 16-bit values of a vector that [`AscendBackend::half_vector`] prepared: the buffer
/// itself, its loaded 16-bit copy, or (`cast`) scratch `name`.
pub(super) fn half_of<'a>(
    scratch: &'a Scratch,
    v: &'a AscendBuffer,
    name: &'static str,
    cast: bool,
) -> &'a Mem {
    use npu_backend::DeviceBuffer as _;
    match &v.half {
        _ if cast => scratch.get(name),
        Some(h) if v.dtype() == DType::F32 => h,
        _ => &v.mem,
    }
}

impl AscendBackend {
    /// Makes `v` (f32, or of the activations' type) available in the activations' type for an
    /// op over activations: an f32 vector written since it was loaded (no 16-bit copy) is cast
    /// into scratch `name` first, and the result is `true`; [`half_of`] then names the memory.
    pub(super) fn half_vector(
        &mut self,
        op: &'static str,
        v: &AscendBuffer,
        name: &'static str,
    ) -> Result<bool, BackendError> {
        use npu_backend::DeviceBuffer as _;
        let n = v.len();
        let act = self.act_t();
        match (v.dtype(), &v.half) {
            (dt, _) if dt == self.act => Ok(false),
            (DType::F32, Some(_)) => Ok(false),
            (DType::F32, None) => {
                self.scratch.ensure(&self.dev, name, n * 2)?;
                let s = self.scratch.get(name);
                let api = self.dev.acl.api.ops;
                let pc = api.aclnnCastGetWorkspaceSize;
                self.pending = true;
                self.ops
                    .call(
                        "aclnnCast",
                        api.aclnnCast,
                        &[
                            Arg::input(
                                "self",
                                0,
                                &v.mem,
                                TView::contiguous(tensor::DType::F32, &[n as i64]),
                            ),
                            Arg::output("out", 0, s, TView::contiguous(act, &[n as i64])),
                        ],
                        &[act.acl() as i64],
                        &[],
                        // SAFETY (closure): live tensors and out-pointers from the launcher.
                        Box::new(move |ts, _, w, e| unsafe {
                            pc(ts[0].raw(), act.acl(), ts[1].raw(), w, e)
                        }),
                    )
                    .map_err(err)?;
                Ok(true)
            }
            (dt, _) => Err(bad(
                op,
                format!("a {} vector for {} activations", dt.name(), self.act.name()),
            )),
        }
    }

    pub(super) fn check_rows(&self, op: &'static str, rows: usize) -> Result<(), BackendError> {
        if rows != self.plan.n_tokens {
            return Err(bad(
                op,
                format!("{rows} rows for a step of {} tokens", self.plan.n_tokens),
            ));
        }
        Ok(())
    }

    pub(super) fn op_embed(
        &mut self,
        table: &AscendEmbedding,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "embed";
        let l = out.layout();
        want_act(op, "out", out.dtype(), self.act)?;
        self.check_rows(op, l.rows())?;
        if l.cols() != table.cols {
            return Err(bad(
                op,
                format!("{} columns for {}-wide embeddings", l.cols(), table.cols),
            ));
        }
        let idx = step_slice(&self.step_mem, self.plan.tokens, self.plan.n_tokens)?;
        self.pending = true;
        gather(
            &mut self.ops,
            (&table.table, table.view()),
            idx,
            (&out.buf().mem, tview(out.dtype(), l)),
        )
    }

    pub(super) fn op_rms_norm(
        &mut self,
        x: View<'_, AscendBuffer>,
        w: &AscendBuffer,
        eps: f32,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        use npu_backend::DeviceBuffer as _;
        let op = "rms_norm";
        let act = self.act_t();
        let (xl, ol) = (x.layout(), out.layout());
        want_act(op, "x", x.dtype(), self.act)?;
        want_act(op, "out", out.dtype(), self.act)?;
        if xl.rows() != ol.rows() || xl.cols() != ol.cols() || w.len() != xl.cols() {
            return Err(bad(
                op,
                format!(
                    "x {}x{}, weight {}, out {}x{}",
                    xl.rows(),
                    xl.cols(),
                    w.len(),
                    ol.rows(),
                    ol.cols()
                ),
            ));
        }
        if eps.is_nan() || eps <= 0.0 {
            return Err(bad(op, format!("epsilon {eps} must be positive")));
        }
        let rows = xl.rows();
        // Gamma in x's type: f32 gamma with f16 x is a documented combination only from CANN 8.5
        // (and a reported refusal before), f16 with f16 on every release.
        let cast = self.half_vector(op, w, "gamma16")?;
        self.scratch.ensure(&self.dev, "rstd", rows * 4)?;
        let rstd = self.scratch.get("rstd");
        let gamma = half_of(&self.scratch, w, "gamma16", cast);
        let api = self.dev.acl.api.ops;
        let prep = api.aclnnRmsNormGetWorkspaceSize;
        let eps = eps as f64;
        self.pending = true;
        self.ops
            .call(
                "aclnnRmsNorm",
                api.aclnnRmsNorm,
                &[
                    Arg::input("x", 0, &x.buf().mem, tview(x.dtype(), xl)),
                    Arg::input("gamma", 1, gamma, TView::contiguous(act, &[w.len() as i64])),
                    Arg::output("yOut", 0, &out.buf().mem, tview(out.dtype(), ol)),
                    Arg::output(
                        "rstdOut",
                        1,
                        rstd,
                        TView::contiguous(tensor::DType::F32, &[rows as i64, 1]),
                    ),
                ],
                &[eps.to_bits() as i64],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    prep(
                        ts[0].raw(),
                        ts[1].raw(),
                        eps,
                        ts[2].raw(),
                        ts[3].raw(),
                        w,
                        e,
                    )
                }),
            )
            .map_err(err)
    }

    pub(super) fn op_matmul(
        &mut self,
        x: View<'_, AscendBuffer>,
        w: &AscendMatrix,
        mut out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "matmul";
        let act = self.act_t();
        let (xl, ol) = (x.layout(), out.layout());
        want_act(op, "x", x.dtype(), self.act)?;
        want_act(op, "out", out.dtype(), self.act)?;
        if xl.cols() != w.k || ol.cols() != w.n || xl.rows() != ol.rows() {
            return Err(bad(
                op,
                format!(
                    "x {}x{} times a {}x{} matrix into {}x{}",
                    xl.rows(),
                    xl.cols(),
                    w.k,
                    w.n,
                    ol.rows(),
                    ol.cols()
                ),
            ));
        }
        let m = xl.rows();
        if m == 0 {
            return Ok(());
        }
        self.pending = true;
        let quant = matches!(w.form, MatrixForm::Quant { .. });
        let q8 = quant && self.cfg.q8_activations;
        // The matmul operators take contiguous rows: strided ones go through scratch copies
        // (DynamicQuant reads strided rows itself).
        let x_contig = xl.is_contiguous() || q8;
        let y_contig = ol.is_contiguous();
        if !x_contig {
            self.scratch.ensure(&self.dev, "mm_x", m * w.k * 2)?;
        }
        if !y_contig {
            self.scratch.ensure(&self.dev, "mm_y", m * w.n * 2)?;
        }
        if quant && m > 1 && w.n > WQBMM_MAX_DIM {
            self.scratch
                .ensure(&self.dev, "mm_yb", m * WQBMM_MAX_DIM * 2)?;
        }
        if q8 {
            self.quantize_acts(&x, w.k)?;
        }
        let xin = TView::contiguous(act, &[m as i64, w.k as i64]);
        let yout = TView::contiguous(act, &[m as i64, w.n as i64]);
        let (xm, xv) = if q8 {
            (self.scratch.get("q8_x"), xin)
        } else if x_contig {
            (&x.buf().mem, tview(x.dtype(), xl))
        } else {
            let s = self.scratch.get("mm_x");
            copy(
                &mut self.ops,
                s,
                xin.clone(),
                &x.buf().mem,
                tview(x.dtype(), xl),
            )?;
            (s, xin)
        };
        let (ym, yv) = if y_contig {
            (&out.buf().mem, tview(out.dtype(), ol))
        } else {
            (self.scratch.get("mm_y"), yout.clone())
        };
        let api = self.dev.acl.api.ops;
        match &w.form {
            MatrixForm::Quant { .. } => {
                let blocks = column_blocks(w.n);
                if blocks.len() == 1 {
                    wqbmm(&mut self.ops, w, 0..w.n, (xm, xv), (ym, yv))?;
                } else {
                    // More outputs than the operator takes: one call per column block. A single
                    // row's column range is contiguous and written in place; several rows'
                    // go through a contiguous scratch block and a copy into their columns.
                    let base = if y_contig { ol.offset() } else { 0 };
                    let block = |c: usize| TView::contiguous(act, &[m as i64, c as i64]);
                    for cols in blocks {
                        let nb = cols.len() as i64;
                        let region = TView::strided(
                            act,
                            &[m as i64, nb],
                            &[if m == 1 { nb } else { w.n as i64 }, 1],
                            (base + cols.start) as i64,
                        );
                        if m == 1 {
                            wqbmm(&mut self.ops, w, cols, (xm, xv.clone()), (ym, region))?;
                        } else {
                            let s = self.scratch.get("mm_yb");
                            let bv = block(cols.len());
                            wqbmm(&mut self.ops, w, cols, (xm, xv.clone()), (s, bv.clone()))?;
                            copy(&mut self.ops, ym, region, s, bv)?;
                        }
                    }
                }
            }
            MatrixForm::Half { data } => {
                let prep = api.aclnnMatmulGetWorkspaceSize;
                self.ops
                    .call(
                        "aclnnMatmul",
                        api.aclnnMatmul,
                        &[
                            Arg::input("self", 0, xm, xv),
                            Arg::input("mat2", 1, data, w.weight_view()),
                            Arg::output("out", 0, ym, yv),
                        ],
                        &[],
                        &[],
                        // SAFETY (closure): live tensors and out-pointers from the launcher.
                        Box::new(move |ts, _, w, e| unsafe {
                            prep(
                                ts[0].raw(),
                                ts[1].raw(),
                                ts[2].raw(),
                                npu_ffi::types::KEEP_DTYPE,
                                w,
                                e,
                            )
                        }),
                    )
                    .map_err(err)?;
            }
        }
        if !y_contig {
            let dt = out.dtype();
            copy(
                &mut self.ops,
                &out.buf_mut().mem,
                tview(dt, ol),
                self.scratch.get("mm_y"),
                yout,
            )?;
        }
        Ok(())
    }

    /// `x`'s rows quantized to 8 bits per 32 values and back, into scratch "q8_x" (f16): per
    /// block, `q = round(x / s)` with `s = max|x| / 127` (DynamicQuant over 32-value rows), then
    /// `q · f16(s)` — the values llama.cpp's 8-bit activations stand for.
    fn quantize_acts(&mut self, x: &View<'_, AscendBuffer>, k: usize) -> Result<(), BackendError> {
        let l = x.layout();
        let act = self.act_t();
        let (m, g) = (l.rows(), k / GROUP);
        for (name, bytes) in [
            ("q8_y", m * k),
            ("q8_s", m * g * 4),
            ("q8_s16", m * g * 2),
            ("q8_x", m * k * 2),
        ] {
            self.scratch.ensure(&self.dev, name, bytes)?;
        }
        let blocks = |dt| TView::contiguous(dt, &[m as i64, g as i64, GROUP as i64]);
        let scales = |dt| TView::contiguous(dt, &[m as i64, g as i64]);
        let api = self.dev.acl.api.ops;
        let (pq, pc, pm) = (
            api.aclnnDynamicQuantGetWorkspaceSize,
            api.aclnnCastGetWorkspaceSize,
            api.aclnnMulGetWorkspaceSize,
        );
        let (y, s, s16, xq) = (
            self.scratch.get("q8_y"),
            self.scratch.get("q8_s"),
            self.scratch.get("q8_s16"),
            self.scratch.get("q8_x"),
        );
        self.ops
            .call(
                "aclnnDynamicQuant",
                api.aclnnDynamicQuant,
                &[
                    Arg::input(
                        "x",
                        0,
                        &x.buf().mem,
                        TView::strided(
                            act,
                            &[m as i64, g as i64, GROUP as i64],
                            &[l.stride() as i64, GROUP as i64, 1],
                            l.offset() as i64,
                        ),
                    ),
                    Arg::output("yOut", 0, y, blocks(tensor::DType::I8)),
                    Arg::output("scaleOut", 1, s, scales(tensor::DType::F32)),
                ],
                &[],
                &[],
                // SAFETY (closure): live tensors, a null optional and out-pointers.
                Box::new(move |ts, _, w, e| unsafe {
                    pq(
                        ts[0].raw(),
                        std::ptr::null(),
                        ts[1].raw(),
                        ts[2].raw(),
                        w,
                        e,
                    )
                }),
            )
            .map_err(err)?;
        self.ops
            .call(
                "aclnnCast",
                api.aclnnCast,
                &[
                    Arg::input("self", 0, s, scales(tensor::DType::F32)),
                    Arg::output("out", 0, s16, scales(act)),
                ],
                &[act.acl() as i64],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    pc(ts[0].raw(), act.acl(), ts[1].raw(), w, e)
                }),
            )
            .map_err(err)?;
        self.ops
            .call(
                "aclnnMul",
                api.aclnnMul,
                &[
                    Arg::input("self", 0, y, blocks(tensor::DType::I8)),
                    Arg::input(
                        "other",
                        1,
                        s16,
                        TView::contiguous(act, &[m as i64, g as i64, 1]),
                    ),
                    Arg::output("out", 0, xq, blocks(act)),
                ],
                &[],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe {
                    pm(ts[0].raw(), ts[1].raw(), ts[2].raw(), w, e)
                }),
            )
            .map_err(err)
    }

    pub(super) fn op_add_bias(
        &mut self,
        x: ViewMut<'_, AscendBuffer>,
        bias: &AscendBuffer,
    ) -> Result<(), BackendError> {
        use npu_backend::DeviceBuffer as _;
        let l = x.layout();
        let act = self.act_t();
        want_act("add_bias", "x", x.dtype(), self.act)?;
        if bias.len() != l.cols() {
            return Err(bad(
                "add_bias",
                format!("a {}-value bias for {} columns", bias.len(), l.cols()),
            ));
        }
        let bv = TView::contiguous(act, &[l.cols() as i64]);
        let cast = self.half_vector("add_bias", bias, "bias16")?;
        let b16 = half_of(&self.scratch, bias, "bias16", cast);
        self.pending = true;
        inplace_add(
            &mut self.ops,
            "add_bias",
            &x.buf().mem,
            tview(x.dtype(), l),
            b16,
            bv,
        )
    }

    pub(super) fn op_add(
        &mut self,
        x: ViewMut<'_, AscendBuffer>,
        y: View<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let (xl, yl) = (x.layout(), y.layout());
        want_act("add", "x", x.dtype(), self.act)?;
        want_act("add", "y", y.dtype(), self.act)?;
        if xl.rows() != yl.rows() || xl.cols() != yl.cols() {
            return Err(bad(
                "add",
                format!("{}x{} += {}x{}", xl.rows(), xl.cols(), yl.rows(), yl.cols()),
            ));
        }
        self.pending = true;
        inplace_add(
            &mut self.ops,
            "add",
            &x.buf().mem,
            tview(x.dtype(), xl),
            &y.buf().mem,
            tview(y.dtype(), yl),
        )
    }

    pub(super) fn op_swiglu(
        &mut self,
        gate: View<'_, AscendBuffer>,
        up: View<'_, AscendBuffer>,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "swiglu";
        let act = self.act_t();
        let (gl, ul, ol) = (gate.layout(), up.layout(), out.layout());
        for (w, dt) in [
            ("gate", gate.dtype()),
            ("up", up.dtype()),
            ("out", out.dtype()),
        ] {
            want_act(op, w, dt, self.act)?;
        }
        if gl.rows() != ul.rows()
            || gl.cols() != ul.cols()
            || ol.rows() != gl.rows()
            || ol.cols() != gl.cols()
        {
            return Err(bad(op, "gate, up and out must have one shape"));
        }
        let (rows, ff) = (gl.rows(), gl.cols());
        self.pending = true;
        // SwiGlu takes x = [gate | up] rows and out contiguous (its page marks both as not
        // supporting non-contiguous tensors). Adjacent column ranges of one buffer are x already
        // when they are the whole row; otherwise both halves are copied into a dense scratch.
        let adjacent = std::ptr::eq(gate.buf(), up.buf())
            && gl.stride() == ul.stride()
            && ul.offset() == gl.offset() + ff
            && (rows <= 1 || gl.stride() == 2 * ff);
        // A strided out is written through a dense scratch and copied out after.
        let dense_out = dense(ol);
        let packed = TView::contiguous(act, &[rows as i64, ff as i64]);
        if !dense_out {
            self.scratch.ensure(&self.dev, "swiglu_o", rows * ff * 2)?;
        }
        let (xm, xv) = if adjacent {
            (
                &gate.buf().mem,
                TView::strided(
                    act,
                    &[rows as i64, 2 * ff as i64],
                    &[gl.stride() as i64, 1],
                    gl.offset() as i64,
                ),
            )
        } else {
            self.scratch
                .ensure(&self.dev, "swiglu_x", rows * 2 * ff * 2)?;
            let s = self.scratch.get("swiglu_x");
            for (i, v) in [gate, up].into_iter().enumerate() {
                let dst = TView::strided(
                    act,
                    &[rows as i64, ff as i64],
                    &[2 * ff as i64, 1],
                    (i * ff) as i64,
                );
                copy(
                    &mut self.ops,
                    s,
                    dst,
                    &v.buf().mem,
                    tview(v.dtype(), v.layout()),
                )?;
            }
            (s, TView::contiguous(act, &[rows as i64, 2 * ff as i64]))
        };
        let (om, ov) = if dense_out {
            (&out.buf().mem, tview(out.dtype(), ol))
        } else {
            (self.scratch.get("swiglu_o"), packed.clone())
        };
        let api = self.dev.acl.api.ops;
        let prep = api.aclnnSwiGluGetWorkspaceSize;
        self.ops
            .call(
                "aclnnSwiGlu",
                api.aclnnSwiGlu,
                &[Arg::input("x", 0, xm, xv), Arg::output("out", 0, om, ov)],
                &[-1],
                &[],
                // SAFETY (closure): live tensors and out-pointers from the launcher.
                Box::new(move |ts, _, w, e| unsafe { prep(ts[0].raw(), -1, ts[1].raw(), w, e) }),
            )
            .map_err(err)?;
        if !dense_out {
            copy(
                &mut self.ops,
                &out.buf().mem,
                tview(out.dtype(), ol),
                self.scratch.get("swiglu_o"),
                packed,
            )?;
        }
        Ok(())
    }

    pub(super) fn op_gather_rows(
        &mut self,
        x: View<'_, AscendBuffer>,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        let op = "gather_logit_rows";
        let (xl, ol) = (x.layout(), out.layout());
        want_act(op, "x", x.dtype(), self.act)?;
        want_act(op, "out", out.dtype(), self.act)?;
        self.check_rows(op, xl.rows())?;
        let n = self.plan.n_logit_rows;
        if ol.rows() != n || ol.cols() != xl.cols() {
            return Err(bad(
                op,
                format!(
                    "{}x{} out for {n} logit rows of {} columns",
                    ol.rows(),
                    ol.cols(),
                    xl.cols()
                ),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let idx = step_slice(&self.step_mem, self.plan.logit_rows, n)?;
        self.pending = true;
        gather(
            &mut self.ops,
            (&x.buf().mem, tview(x.dtype(), xl)),
            idx,
            (&out.buf().mem, tview(out.dtype(), ol)),
        )
    }
}

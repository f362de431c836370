//! The kernels of one step, launched on the backend's stream: each op checks its views (shapes,
//! dtypes, owner) against the step and the KV pool, so that no kernel reads or writes outside
//! the memory it is given, then packs the kernel's parameters and launches it. Matrix products
//! are in `matmul.rs`; RMS norms, SwiGLU and the add folded into a norm in `fused.rs`; the KV
//! writes and paged attention in `attention.rs`.

use npu_backend::{AttnGeometry, BackendError, DType, DeviceBuffer, Layout, View, ViewMut};
use npu_model::RopeStyle;

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;
use crate::gpu::{blocks, Args, DevPtr, LaunchDims};
use crate::kernels::{op_kernel, Op};
use crate::weights::CudaEmbedding;

/// Threads of the element-wise kernels' blocks.
pub(crate) const EW_THREADS: usize = 256;
/// Threads of a rope block: one per (head, rotary pair) of a row, over as many blocks as needed.
const ROPE_THREADS: usize = 256;
/// Threads of the greedy pick's blocks (one block reads a whole row of logits).
const PICK_THREADS: u32 = 1024;

/// GELU with the tanh approximation in f32, as the CPU reference writes it (ggml's
/// `ggml_gelu_f32`: the constants as it spells them, products unfused and in its order, the
/// host's `tanh`).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044_715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh())
}

/// `gelu_tanh` of every f16 value, rounded to f16, by bit pattern: ggml's CPU table, which the
/// GELU-gate kernel reads (built here so that the device's values are the host's).
pub fn gelu_f16_table() -> Vec<u16> {
    (0..=u16::MAX)
        .map(|bits| half::f16::from_f32(gelu_tanh(half::f16::from_bits(bits).to_f32())).to_bits())
        .collect()
}

pub(crate) fn bad(op: &'static str, message: String) -> BackendError {
    BackendError::BadArgument { op, message }
}

pub(crate) fn need(
    ok: bool,
    op: &'static str,
    message: impl FnOnce() -> String,
) -> Result<(), BackendError> {
    if ok {
        Ok(())
    } else {
        Err(bad(op, message()))
    }
}

/// `dt` if it is a float dtype.
pub(crate) fn float(op: &'static str, dt: DType) -> Result<DType, BackendError> {
    match dt {
        DType::I32 => Err(bad(op, "an i32 view where floats are expected".into())),
        d => Ok(d),
    }
}

pub(crate) fn same(op: &'static str, a: DType, b: DType) -> Result<(), BackendError> {
    need(a == b, op, || {
        format!("views of {} and {} (one dtype per op)", a.name(), b.name())
    })
}

/// The runtime dtype code kernels use for weight vectors (DT_* in common.cuh).
pub(crate) fn dt_code(dt: DType) -> i32 {
    match dt {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::I32 => -1,
    }
}

pub(crate) fn int(op: &'static str, v: usize) -> Result<i32, BackendError> {
    i32::try_from(v).map_err(|_| BackendError::Unsupported {
        backend: "cuda",
        what: format!("{op} with a size or stride of {v} (over i32)"),
    })
}

/// Rows as a grid dimension (y and z are limited to 65535).
pub(crate) fn grid_rows(op: &'static str, rows: usize) -> Result<u32, BackendError> {
    if rows > 65535 {
        return Err(BackendError::Unsupported {
            backend: "cuda",
            what: format!("{op} over {rows} rows (at most 65535)"),
        });
    }
    Ok(rows as u32)
}

/// Threads for a row kernel over `n` columns: a multiple of 32, at most `max`.
pub(crate) fn row_threads(n: usize, max: usize) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, max) as u32
}

pub(crate) fn addr(v: &View<'_, CudaBuffer>) -> DevPtr {
    v.buf().addr(v.layout().offset())
}

pub(crate) fn addr_mut(v: &ViewMut<'_, CudaBuffer>) -> DevPtr {
    v.buf().addr(v.layout().offset())
}

impl CudaBackend {
    pub(crate) fn launch(
        &self,
        kernel: usize,
        dims: LaunchDims,
        mut args: Args,
    ) -> Result<(), BackendError> {
        self.launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.gpu.launch(kernel, dims, &mut args)
    }

    pub(crate) fn op_embed(
        &mut self,
        table: &CudaEmbedding,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "embed";
        self.own(out.buf(), OP)?;
        need(table.mem.device() == self.device, OP, || {
            "a table of another backend instance".into()
        })?;
        let (lay, meta) = self.step_meta()?;
        let dt = float(OP, out.dtype())?;
        let l = out.layout();
        need(
            l.rows() == lay.n_tokens && l.cols() == table.dim,
            OP,
            || {
                format!(
                    "output window {}x{} for {} tokens of {} values",
                    l.rows(),
                    l.cols(),
                    lay.n_tokens,
                    table.dim
                )
            },
        )?;
        if let Some(t) = self.step.tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(BackendError::BadStep(format!(
                "token id {t} is beyond the vocabulary ({})",
                table.rows
            )));
        }
        if l.rows() == 0 {
            return Ok(());
        }
        self.launch(
            op_kernel(Op::Embed, dt),
            LaunchDims::linear(
                [blocks(table.dim, EW_THREADS), grid_rows(OP, l.rows())?, 1],
                EW_THREADS as u32,
            ),
            Args::new()
                .ptr(table.mem.ptr())
                .i32(table.ty.id() as i32)
                .i64(table.row_bytes as i64)
                .i32(int(OP, table.dim)?)
                .ptr(meta + 4 * lay.tokens as u64)
                .ptr(addr_mut(&out))
                .i32(int(OP, l.stride())?),
        )
    }

    pub(crate) fn op_rms_norm_heads(
        &mut self,
        x: ViewMut<'_, CudaBuffer>,
        w: &CudaBuffer,
        eps: f32,
        head_dim: usize,
    ) -> Result<(), BackendError> {
        const OP: &str = "rms_norm_heads";
        self.own(x.buf(), OP)?;
        self.own(w, OP)?;
        let dt = float(OP, x.dtype())?;
        let wdt = float(OP, w.dtype())?;
        let l = x.layout();
        need(
            head_dim > 0 && w.len() == head_dim && l.cols().is_multiple_of(head_dim),
            OP,
            || {
                format!(
                    "{} weights for heads of {head_dim} in rows of {}",
                    w.len(),
                    l.cols()
                )
            },
        )?;
        if l.elements() == 0 {
            return Ok(());
        }
        self.launch(
            op_kernel(Op::RmsNormHeads, dt),
            LaunchDims::linear(
                [
                    int(OP, l.cols() / head_dim)? as u32,
                    grid_rows(OP, l.rows())?,
                    1,
                ],
                row_threads(head_dim, 256),
            ),
            Args::new()
                .ptr(addr_mut(&x))
                .i32(int(OP, l.stride())?)
                .i32(int(OP, head_dim)?)
                .ptr(w.addr(0))
                .i32(dt_code(wdt))
                .f32(eps),
        )
    }

    pub(crate) fn op_add_bias(
        &mut self,
        x: ViewMut<'_, CudaBuffer>,
        bias: &CudaBuffer,
    ) -> Result<(), BackendError> {
        const OP: &str = "add_bias";
        self.own(x.buf(), OP)?;
        self.own(bias, OP)?;
        let dt = float(OP, x.dtype())?;
        let bdt = float(OP, bias.dtype())?;
        let l = x.layout();
        need(bias.len() == l.cols(), OP, || {
            format!("a bias of {} for rows of {}", bias.len(), l.cols())
        })?;
        if l.elements() == 0 {
            return Ok(());
        }
        self.launch(
            op_kernel(Op::AddBias, dt),
            LaunchDims::linear(
                [blocks(l.cols(), EW_THREADS), grid_rows(OP, l.rows())?, 1],
                EW_THREADS as u32,
            ),
            Args::new()
                .ptr(addr_mut(&x))
                .i32(int(OP, l.stride())?)
                .ptr(bias.addr(0))
                .i32(dt_code(bdt))
                .i32(int(OP, l.cols())?),
        )
    }

    pub(crate) fn op_rope(
        &mut self,
        qk: ViewMut<'_, CudaBuffer>,
        g: &AttnGeometry,
    ) -> Result<(), BackendError> {
        const OP: &str = "rope";
        self.own(qk.buf(), OP)?;
        let (lay, meta) = self.step_meta()?;
        let dt = float(OP, qk.dtype())?;
        let l = qk.layout();
        let heads = g.n_heads + g.n_kv_heads;
        let dims = g.rope.dims;
        need(
            l.rows() == lay.n_tokens && l.cols() >= heads * g.head_dim,
            OP,
            || {
                format!(
                    "a {}x{} window for {} tokens of {heads} heads of {}",
                    l.rows(),
                    l.cols(),
                    lay.n_tokens,
                    g.head_dim
                )
            },
        )?;
        need(dims <= g.head_dim && dims.is_multiple_of(2), OP, || {
            format!("{dims} rotary dimensions of a {}-value head", g.head_dim)
        })?;
        if let Some(f) = g.rope.factors {
            need(f.len() == dims / 2, OP, || {
                format!(
                    "{} frequency factors for {} rotary pairs",
                    f.len(),
                    dims / 2
                )
            })?;
        }
        if l.rows() == 0 || dims == 0 {
            return Ok(());
        }
        let factors = match g.rope.factors {
            Some(f) => self.rope_factor_table(f)?,
            None => 0,
        };
        let theta_scale = g.rope.base.powf(-2.0 / dims as f32);
        self.launch(
            op_kernel(Op::Rope, dt),
            LaunchDims::linear(
                [
                    int(OP, l.rows())? as u32,
                    blocks(heads * (dims / 2), ROPE_THREADS),
                    1,
                ],
                row_threads(heads * (dims / 2), ROPE_THREADS),
            ),
            Args::new()
                .ptr(addr_mut(&qk))
                .i32(int(OP, l.stride())?)
                .i32(int(OP, heads)?)
                .i32(int(OP, g.head_dim)?)
                .i32(int(OP, dims)?)
                .i32(i32::from(g.rope.style == RopeStyle::Halves))
                .f32(theta_scale)
                .f32(g.rope.freq_scale)
                .ptr(meta + 4 * lay.positions as u64)
                .ptr(factors),
        )
    }

    /// The device copy of a rope's frequency factors, uploaded the first time a table is seen
    /// (by address, then by contents: the tables are interned, so a model uploads one) and kept
    /// for the backend's life.
    pub(crate) fn rope_factor_table(&mut self, f: &'static [f32]) -> Result<DevPtr, BackendError> {
        let t = &mut self.rope_factors;
        if let Some(&(_, i)) = t.keys.iter().find(|(k, _)| std::ptr::eq(*k, f)) {
            return Ok(t.tables[i].ptr());
        }
        let same = |k: &[f32]| {
            k.len() == f.len() && k.iter().zip(f).all(|(a, b)| a.to_bits() == b.to_bits())
        };
        let i = match t.keys.iter().find(|(k, _)| same(k)) {
            Some(&(_, i)) => i,
            None => {
                let mem = self.alloc_mem(std::mem::size_of_val(f))?;
                self.gpu.htod(mem.ptr(), bytemuck::cast_slice(f))?;
                self.rope_factors.tables.push(mem);
                self.rope_factors.tables.len() - 1
            }
        };
        self.rope_factors.keys.push((f, i));
        Ok(self.rope_factors.tables[i].ptr())
    }

    /// The checks a gated activation (`swiglu`, `geglu`) makes of its operands: this backend's
    /// buffers, one float type, equal (rows, cols). Their type and layouts (gate, up, out), or
    /// None when there is nothing to compute.
    pub(crate) fn check_gated(
        &self,
        op: &'static str,
        gate: &View<'_, CudaBuffer>,
        up: &View<'_, CudaBuffer>,
        out: &ViewMut<'_, CudaBuffer>,
    ) -> Result<Option<(DType, Layout, Layout, Layout)>, BackendError> {
        self.own(gate.buf(), op)?;
        self.own(up.buf(), op)?;
        self.own(out.buf(), op)?;
        let dt = float(op, gate.dtype())?;
        same(op, dt, up.dtype())?;
        same(op, dt, out.dtype())?;
        let (gl, ul, ol) = (gate.layout(), up.layout(), out.layout());
        let shape = |l: Layout| (l.rows(), l.cols());
        need(shape(gl) == shape(ul) && shape(gl) == shape(ol), op, || {
            format!(
                "gate {:?}, up {:?}, out {:?} (rows, cols)",
                shape(gl),
                shape(ul),
                shape(ol)
            )
        })?;
        Ok((gl.elements() > 0).then_some((dt, gl, ul, ol)))
    }

    pub(crate) fn op_geglu(
        &mut self,
        gate: View<'_, CudaBuffer>,
        up: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "geglu";
        let Some((dt, gl, ul, ol)) = self.check_gated(OP, &gate, &up, &out)? else {
            return Ok(());
        };
        let table = self.gelu_table()?;
        self.launch(
            op_kernel(Op::Geglu, dt),
            LaunchDims::linear(
                [blocks(gl.cols(), EW_THREADS), grid_rows(OP, gl.rows())?, 1],
                EW_THREADS as u32,
            ),
            Args::new()
                .ptr(addr(&gate))
                .i32(int(OP, gl.stride())?)
                .ptr(addr(&up))
                .i32(int(OP, ul.stride())?)
                .ptr(addr_mut(&out))
                .i32(int(OP, ol.stride())?)
                .i32(int(OP, gl.cols())?)
                .ptr(table),
        )
    }

    /// The device copy of the f16 GELU table (`gelu_f16_table`), uploaded at the first GELU
    /// gate and kept for the backend's life.
    fn gelu_table(&mut self) -> Result<DevPtr, BackendError> {
        if let Some(t) = &self.gelu_table {
            return Ok(t.ptr());
        }
        let table = gelu_f16_table();
        let mem = self.alloc_mem(table.len() * 2)?;
        self.gpu.htod(mem.ptr(), bytemuck::cast_slice(&table))?;
        let p = mem.ptr();
        self.gelu_table = Some(mem);
        Ok(p)
    }

    pub(crate) fn op_scale_rows(
        &mut self,
        x: ViewMut<'_, CudaBuffer>,
        s: f32,
    ) -> Result<(), BackendError> {
        const OP: &str = "scale_rows";
        self.own(x.buf(), OP)?;
        let dt = float(OP, x.dtype())?;
        let l = x.layout();
        if l.elements() == 0 {
            return Ok(());
        }
        self.launch(
            op_kernel(Op::Scale, dt),
            LaunchDims::linear(
                [blocks(l.cols(), EW_THREADS), grid_rows(OP, l.rows())?, 1],
                EW_THREADS as u32,
            ),
            Args::new()
                .ptr(addr_mut(&x))
                .i32(int(OP, l.stride())?)
                .i32(int(OP, l.cols())?)
                .f32(s),
        )
    }

    pub(crate) fn op_add(
        &mut self,
        x: ViewMut<'_, CudaBuffer>,
        y: View<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "add";
        self.own(x.buf(), OP)?;
        self.own(y.buf(), OP)?;
        let dt = float(OP, x.dtype())?;
        same(OP, dt, y.dtype())?;
        let (xl, yl) = (x.layout(), y.layout());
        need(xl.rows() == yl.rows() && xl.cols() == yl.cols(), OP, || {
            format!(
                "x {}x{} and y {}x{}",
                xl.rows(),
                xl.cols(),
                yl.rows(),
                yl.cols()
            )
        })?;
        if xl.elements() == 0 {
            return Ok(());
        }
        self.launch(
            op_kernel(Op::Add, dt),
            LaunchDims::linear(
                [blocks(xl.cols(), EW_THREADS), grid_rows(OP, xl.rows())?, 1],
                EW_THREADS as u32,
            ),
            Args::new()
                .ptr(addr_mut(&x))
                .i32(int(OP, xl.stride())?)
                .ptr(addr(&y))
                .i32(int(OP, yl.stride())?)
                .i32(int(OP, xl.cols())?),
        )
    }

    pub(crate) fn op_gather_logit_rows(
        &mut self,
        x: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "gather_logit_rows";
        self.own(x.buf(), OP)?;
        self.own(out.buf(), OP)?;
        let (lay, meta) = self.step_meta()?;
        let dt = float(OP, x.dtype())?;
        same(OP, dt, out.dtype())?;
        let (xl, ol) = (x.layout(), out.layout());
        let max_row = self.step.logit_rows.iter().max().map(|&r| r as usize);
        let rows_inside = match max_row {
            Some(r) => r < xl.rows(),
            None => true,
        };
        need(
            ol.rows() == lay.n_logit_rows && ol.cols() == xl.cols() && rows_inside,
            OP,
            || {
                format!(
                    "{} logit rows (largest {max_row:?}) of a {}x{} window into {}x{}",
                    lay.n_logit_rows,
                    xl.rows(),
                    xl.cols(),
                    ol.rows(),
                    ol.cols()
                )
            },
        )?;
        if ol.elements() == 0 {
            return Ok(());
        }
        self.launch(
            op_kernel(Op::GatherRows, dt),
            LaunchDims::linear(
                [blocks(xl.cols(), EW_THREADS), grid_rows(OP, ol.rows())?, 1],
                EW_THREADS as u32,
            ),
            Args::new()
                .ptr(addr(&x))
                .i32(int(OP, xl.stride())?)
                .ptr(meta + 4 * lay.logit_rows as u64)
                .i32(int(OP, xl.cols())?)
                .ptr(addr_mut(&out))
                .i32(int(OP, ol.stride())?),
        )
    }

    pub(crate) fn op_argmax_rows(
        &mut self,
        logits: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "argmax_rows";
        self.own(logits.buf(), OP)?;
        self.own(out.buf(), OP)?;
        let dt = float(OP, logits.dtype())?;
        need(out.dtype() == DType::I32, OP, || {
            format!("a {} output (i32 expected)", out.dtype().name())
        })?;
        let (ll, ol) = (logits.layout(), out.layout());
        need(ol.elements() == ll.rows(), OP, || {
            format!(
                "{} rows into a window of {} elements",
                ll.rows(),
                ol.elements()
            )
        })?;
        if ll.rows() == 0 {
            return Ok(());
        }
        need(ll.cols() > 0, OP, || "rows of no values".into())?;
        self.launch(
            op_kernel(Op::Argmax, dt),
            LaunchDims::linear([int(OP, ll.rows())? as u32, 1, 1], PICK_THREADS),
            Args::new()
                .ptr(addr(&logits))
                .i32(int(OP, ll.stride())?)
                .i32(int(OP, ll.cols())?)
                .ptr(addr_mut(&out))
                .i32(int(OP, ol.stride())?)
                .i32(int(OP, ol.cols())?),
        )
    }

    pub(crate) fn op_argmax_logprob_rows(
        &mut self,
        logits: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "argmax_logprob_rows";
        self.own(logits.buf(), OP)?;
        self.own(out.buf(), OP)?;
        let dt = float(OP, logits.dtype())?;
        need(out.dtype() == DType::F32, OP, || {
            format!("a {} output (f32 expected)", out.dtype().name())
        })?;
        let (ll, ol) = (logits.layout(), out.layout());
        need(ol.elements() == ll.rows(), OP, || {
            format!(
                "{} rows into a window of {} elements",
                ll.rows(),
                ol.elements()
            )
        })?;
        if ll.rows() == 0 {
            return Ok(());
        }
        need(ll.cols() > 0, OP, || "rows of no values".into())?;
        self.launch(
            op_kernel(Op::ArgmaxLogprob, dt),
            LaunchDims::linear([int(OP, ll.rows())? as u32, 1, 1], PICK_THREADS),
            Args::new()
                .ptr(addr(&logits))
                .i32(int(OP, ll.stride())?)
                .i32(int(OP, ll.cols())?)
                .ptr(addr_mut(&out))
                .i32(int(OP, ol.stride())?)
                .i32(int(OP, ol.cols())?),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gelu_table_is_the_cpu_reference_s() {
        let table = gelu_f16_table();
        let mut out = [0f32];
        for bits in 0..=u16::MAX {
            let g = half::f16::from_bits(bits).to_f32();
            if !g.is_finite() || g.abs() >= 10.0 {
                continue;
            }
            npu_backend_cpu::kernels::elementwise::geglu(&[g], &[1.0], &mut out);
            let t = half::f16::from_bits(table[bits as usize]).to_f32();
            assert_eq!(t.to_bits(), out[0].to_bits(), "gate {g} ({bits:#06x})");
        }
    }
}

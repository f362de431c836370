//! The CPU backend: host-memory buffers (`buffer`), packed quantized weights, an f16 paged KV
//! pool with each block contiguous across layers (`kv`), and the kernels of `crate::kernels` run
//! on a fork-join thread pool with the best instruction set the machine offers. Activations are
//! f32. Every op reaches its data through checked views and slices; the only raw writes are
//! inside the kernels, and each op checks the shapes those rely on before calling them.

mod buffer;
pub(crate) use buffer::advise_huge_pages;
mod checks;
mod family_ops;
mod kv;
#[cfg(test)]
mod kv_int8_tests;
mod kv_rounding;
mod latent_ops;
mod lora;
mod moe_grouped;
#[cfg(test)]
mod moe_tests;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::kernels::attention::{self, AttnParams, AttnSeq};
use crate::kernels::elementwise::{self, Rope};
use crate::kernels::quantize::{self, quantize_acts};
use crate::kernels::{matmul, scan, Isa, KernelError};
use crate::quant::acts::{ActBlocks, QBLOCK, QK_K};
use crate::quant::packed::PackFormat;
use crate::quant::{FloatActs, QuantizedActs, WeightMatrix};
use crate::threadpool::{split_range, ThreadPool};
use npu_backend::{
    AttnGeometry, Backend, BackendError, Capability, DType, DeviceKind, HostSlice, HostTensor,
    KvDtype, KvSpec, MemInfo, Readback, RouteSpec, StepInputs, View, ViewMut,
};
use npu_gguf::quants::dequantize_row;
use npu_gguf::GgmlType;

pub use buffer::CpuBuffer;
use buffer::{bad, rows, rows_mut, shape, RowsKey, RowsMut};
use checks::{check_geometry, host_mem_info, tensor_row_bytes};
use kv::KvPool;
pub use kv_rounding::KvRounding;

pub(crate) const NAME: &str = "cpu";

/// Settings of the CPU backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuConfig {
    /// Compute threads; 0 = all cores.
    pub threads: usize,
    /// Dequantize every weight to f32 and skip activation quantization: a slow, plain-arithmetic
    /// reference for tests.
    pub f32_reference: bool,
}

/// An embedding table kept in the file's format; rows are dequantized on lookup.
pub struct CpuEmbedding {
    ty: GgmlType,
    data: Vec<u8>,
    dim: usize,
    rows: usize,
    row_bytes: usize,
}

pub struct CpuBackend {
    f32_reference: bool,
    pool: Arc<ThreadPool>,
    isa: Isa,
    acts: QuantizedActs,
    /// A contiguous copy of a strided matmul input.
    staging: Vec<f32>,
    kv: Option<KvPool>,
    /// What `init_kv` stores (`set_kv_dtype`).
    kv_dtype: KvDtype,
    step: StepInputs,
    /// Which rows `acts` holds quantized, as they were when quantized, and how (`None`:
    /// nothing usable).
    acts_key: Option<(RowsKey, ActBlocks)>,
    /// Weight elements loaded per activation blocking their matrices take ([Q8_0, Q8_K]): ops
    /// that quantize their output as they write it use the blocking most weights take.
    act_blocks_weight: [u64; 2],
    /// Counts steps, so per-step caches know when they are stale.
    step_serial: u64,
    /// Rope angles of the step's positions, per rope (a model may turn at several bases) and
    /// the step they were made for.
    rope_tables: Vec<(Rope, u64, Vec<f32>)>,
    /// Some weights were re-quantized on load (formats without an exact packed form).
    lossy_weights: bool,
    /// How an f16 cache rounds its rows (`set_kv_rounding`, a measuring instrument).
    kv_rounding: Option<kv_rounding::RoundingState>,
}

impl CpuBackend {
    /// A backend with its own pool of `cfg.threads` threads and the best instruction set here
    /// (or `NPU_SERVING_ISA`).
    pub fn new(cfg: CpuConfig) -> Self {
        let threads = if cfg.threads == 0 {
            ThreadPool::available_threads()
        } else {
            cfg.threads
        };
        Self::on_pool(Arc::new(ThreadPool::new(threads)), cfg)
    }

    /// Same, with an explicit instruction set (tests compare them).
    pub fn with_isa(cfg: CpuConfig, isa: Isa) -> Self {
        let mut b = Self::new(cfg);
        b.isa = isa;
        b
    }

    /// A backend computing on `pool`, shared with its caller (the engine samples on it too, so
    /// two pools never compete for the same cores); `cfg.threads` is ignored.
    pub fn on_pool(pool: Arc<ThreadPool>, cfg: CpuConfig) -> Self {
        Self {
            f32_reference: cfg.f32_reference,
            pool,
            isa: Isa::active(),
            acts: QuantizedActs::new(),
            acts_key: None,
            act_blocks_weight: [0; 2],
            staging: Vec::new(),
            kv: None,
            kv_dtype: KvDtype::F16,
            step: StepInputs::default(),
            step_serial: 0,
            rope_tables: Vec::new(),
            lossy_weights: false,
            kv_rounding: None,
        }
    }

    /// The compute pool.
    pub fn pool(&self) -> Arc<ThreadPool> {
        self.pool.clone()
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// True when some weights were re-quantized on load (Q2_K/Q3_K/Q6_K to 8-bit blocks).
    pub fn lossy_weights(&self) -> bool {
        self.lossy_weights
    }

    fn kv(&self, op: &'static str) -> Result<&KvPool, BackendError> {
        self.kv
            .as_ref()
            .ok_or_else(|| bad(op, "the KV pool is not initialised (init_kv)".into()))
    }

    /// Calls `f(r, row)` for every row of `out`, in parallel when there are enough rows. Each
    /// task gets its own part of the slice (split with `split_at_mut`), so no two tasks can
    /// touch the same element.
    fn par_rows_mut<F>(&self, out: RowsMut<'_>, f: F) -> Result<(), BackendError>
    where
        F: Fn(usize, &mut [f32]) + Sync,
    {
        let RowsMut {
            data,
            rows,
            cols,
            stride,
            ..
        } = out;
        let threads = self.pool.threads();
        if rows < 8 || threads == 1 {
            for r in 0..rows {
                f(r, &mut data[r * stride..r * stride + cols]);
            }
            return Ok(());
        }
        let tasks = threads.min(rows);
        let mut parts = Vec::with_capacity(tasks);
        let mut rest = data;
        for t in 0..tasks {
            let range = split_range(rows, tasks, t);
            let take = if t + 1 == tasks {
                rest.len()
            } else {
                range.len() * stride
            };
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(take);
            rest = tail;
            parts.push(Mutex::new(Some((range, part))));
        }
        self.pool
            .run(tasks, |t| {
                let Some((range, part)) = parts[t].lock().unwrap_or_else(|e| e.into_inner()).take()
                else {
                    return;
                };
                for (i, r) in range.enumerate() {
                    f(r, &mut part[i * stride..i * stride + cols]);
                }
            })
            .map_err(KernelError::from)?;
        Ok(())
    }

    /// `par_rows_mut`, each row then quantized for the matmul that reads these rows next (the
    /// matmul finds them under the rows' key and skips its own quantization pass). Where the
    /// rows cannot feed a packed matmul (f32 reference mode, a width not in whole 32-value
    /// blocks) this is `par_rows_mut`.
    fn par_rows_mut_quantized<F>(&mut self, out: RowsMut<'_>, f: F) -> Result<(), BackendError>
    where
        F: Fn(usize, &mut [f32]) + Sync,
    {
        let blocks = if self.act_blocks_weight[1] > self.act_blocks_weight[0] {
            ActBlocks::Q8K
        } else {
            ActBlocks::Q8_0
        };
        let per = if blocks == ActBlocks::Q8K {
            QK_K
        } else {
            QBLOCK
        };
        if self.f32_reference || !out.cols.is_multiple_of(per) {
            return self.par_rows_mut(out, f);
        }
        let key = out.key();
        self.acts_key = None;
        quantize::map_rows_quantized(
            &self.pool,
            self.isa,
            out.data,
            out.rows,
            out.cols,
            out.stride,
            blocks,
            &mut self.acts,
            f,
        )?;
        self.acts_key = Some((key, blocks));
        Ok(())
    }

    /// `f(r)` for every row in `0..rows` on the pool, collected in order.
    fn par_map_rows<F>(&self, rows: usize, f: F) -> Result<Vec<u64>, BackendError>
    where
        F: Fn(usize) -> u64 + Sync,
    {
        let out: Vec<AtomicU64> = (0..rows).map(|_| AtomicU64::new(0)).collect();
        let tasks = self.pool.threads().min(rows);
        self.pool
            .run(tasks, |t| {
                for r in split_range(rows, tasks, t) {
                    out[r].store(f(r), Ordering::Relaxed);
                }
            })
            .map_err(KernelError::from)?;
        Ok(out.into_iter().map(AtomicU64::into_inner).collect())
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;
    type Matrix = WeightMatrix;
    type Embedding = CpuEmbedding;

    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn describe(&self) -> String {
        format!(
            "cpu ({}, {} threads)",
            crate::kernels::engine_name(self.isa),
            self.pool.threads()
        )
    }

    fn act_dtype(&self) -> DType {
        DType::F32
    }

    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        host_mem_info()
    }

    fn supports(&self, c: Capability) -> bool {
        family_ops::supports(c)
    }

    fn rms_norm_heads(
        &mut self,
        x: ViewMut<'_, CpuBuffer>,
        w: &CpuBuffer,
        eps: f32,
        head_dim: usize,
    ) -> Result<(), BackendError> {
        self.rms_norm_heads_op(x, w, eps, head_dim)
    }

    fn scale_rows(&mut self, x: ViewMut<'_, CpuBuffer>, s: f32) -> Result<(), BackendError> {
        self.scale_rows_op(x, s)
    }

    fn lora_add(
        &mut self,
        x: View<'_, CpuBuffer>,
        groups: &[npu_backend::LoraGroup<'_, CpuBuffer>],
        out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        self.lora_add_op(x, groups, out)
    }

    fn moe_route(
        &mut self,
        logits: View<'_, CpuBuffer>,
        k: usize,
        normalize: bool,
        ids: ViewMut<'_, CpuBuffer>,
        weights: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        self.moe_route_op(logits, k, normalize, ids, weights)
    }

    fn moe_ffn(
        &mut self,
        x: View<'_, CpuBuffer>,
        ids: View<'_, CpuBuffer>,
        weights: View<'_, CpuBuffer>,
        gate_up: &[WeightMatrix],
        down: &[WeightMatrix],
        ff: usize,
        out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        let n = gate_up.len();
        self.moe_ffn_op(x, ids, weights, gate_up, down, 0..n, n, ff, out)
    }

    fn moe_ffn_held(
        &mut self,
        x: View<'_, CpuBuffer>,
        ids: View<'_, CpuBuffer>,
        weights: View<'_, CpuBuffer>,
        gate_up: &[WeightMatrix],
        down: &[WeightMatrix],
        held: std::ops::Range<usize>,
        n_experts: usize,
        ff: usize,
        out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        self.moe_ffn_op(x, ids, weights, gate_up, down, held, n_experts, ff, out)
    }

    fn moe_route_scored(
        &mut self,
        logits: View<'_, CpuBuffer>,
        bias: Option<&CpuBuffer>,
        spec: &RouteSpec,
        ids: ViewMut<'_, CpuBuffer>,
        weights: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        self.moe_route_scored_op(logits, bias, spec, ids, weights)
    }

    fn init_latent_kv(&mut self, spec: KvSpec) -> Result<(), BackendError> {
        self.init_latent_kv_op(spec)
    }

    fn kv_write_latent(
        &mut self,
        latent: View<'_, CpuBuffer>,
        rope: View<'_, CpuBuffer>,
        layer: usize,
    ) -> Result<(), BackendError> {
        self.kv_write_latent_op(latent, rope, layer)
    }

    fn attention_latent(
        &mut self,
        q_latent: View<'_, CpuBuffer>,
        q_rope: View<'_, CpuBuffer>,
        g: &AttnGeometry,
        latent_dim: usize,
        layer: usize,
        out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        self.attention_latent_op(q_latent, q_rope, g, latent_dim, layer, out)
    }

    fn geglu(
        &mut self,
        gate: View<'_, CpuBuffer>,
        up: View<'_, CpuBuffer>,
        out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        self.geglu_op(gate, up, out)
    }

    fn alloc(&mut self, dtype: DType, len: usize) -> Result<CpuBuffer, BackendError> {
        CpuBuffer::zeroed(dtype, len)
    }

    fn upload(
        &mut self,
        src: HostSlice<'_>,
        dst: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        buffer::upload(src, dst)
    }

    fn read_back(&mut self, reads: &mut [Readback<'_, CpuBuffer>]) -> Result<(), BackendError> {
        for r in reads {
            buffer::read(&r.src, &mut r.dst)?;
        }
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    fn load_matrix(
        &mut self,
        parts: &[HostTensor<'_>],
    ) -> Result<Option<WeightMatrix>, BackendError> {
        const OP: &str = "load_matrix";
        let Some(first) = parts.first() else {
            return Err(bad(OP, "no tensors given".into()));
        };
        let k = first.cols;
        for p in parts {
            if p.cols != k {
                return Err(bad(
                    OP,
                    format!("parts with {} and {k} inputs cannot share a matrix", p.cols),
                ));
            }
            tensor_row_bytes(OP, p)?;
        }
        if self.f32_reference {
            let n: usize = parts.iter().map(|p| p.rows).sum();
            let mut data = buffer::alloc_vec(n * k, 0f32, "f32 reference weights")?;
            let mut row0 = 0;
            for p in parts {
                let rb = tensor_row_bytes(OP, p)?;
                for (r, src) in p.data.chunks_exact(rb).enumerate() {
                    dequantize_row(p.ty, src, &mut data[(row0 + r) * k..(row0 + r + 1) * k])
                        .map_err(|e| bad(OP, e.to_string()))?;
                }
                row0 += p.rows;
            }
            // The reference computes in exact f32 throughout, activations included.
            return Ok(Some(WeightMatrix::F32 {
                n,
                k,
                data,
                acts: FloatActs::F32,
            }));
        }
        let raw: Vec<(GgmlType, &[u8], usize)> =
            parts.iter().map(|p| (p.ty, p.data, p.rows)).collect();
        let m = WeightMatrix::from_ggml_parts(&raw, k);
        if m.is_some()
            && parts
                .iter()
                .any(|p| PackFormat::for_type(p.ty).is_some_and(|f| f.1))
            && !std::mem::replace(&mut self.lossy_weights, true)
        {
            tracing::warn!(
                "some weights (Q2_K/Q3_K/Q6_K) were re-quantized to 8-bit blocks for the CPU kernels"
            );
        }
        if let Some(WeightMatrix::Packed(p)) = &m {
            let i = usize::from(p.format.act_blocks() == ActBlocks::Q8K);
            self.act_blocks_weight[i] += (p.n * p.k) as u64;
        }
        Ok(m)
    }

    fn load_embedding(&mut self, table: HostTensor<'_>) -> Result<CpuEmbedding, BackendError> {
        let row_bytes = tensor_row_bytes("load_embedding", &table)?;
        Ok(CpuEmbedding {
            ty: table.ty,
            data: table.data.to_vec(),
            dim: table.cols,
            rows: table.rows,
            row_bytes,
        })
    }

    fn load_vector(&mut self, v: HostTensor<'_>) -> Result<CpuBuffer, BackendError> {
        let rb = tensor_row_bytes("load_vector", &v)?;
        let mut values = buffer::alloc_vec(v.rows * v.cols, 0f32, "a weight vector")?;
        for (src, dst) in v.data.chunks_exact(rb).zip(values.chunks_exact_mut(v.cols)) {
            dequantize_row(v.ty, src, dst).map_err(|e| bad("load_vector", e.to_string()))?;
        }
        Ok(CpuBuffer::from_f32(values))
    }

    fn init_kv(&mut self, spec: KvSpec) -> Result<(), BackendError> {
        self.kv = None;
        self.kv = Some(KvPool::new(spec, self.kv_dtype)?);
        Ok(())
    }

    fn set_kv_dtype(&mut self, dtype: KvDtype) -> Result<(), BackendError> {
        self.kv_dtype = dtype;
        Ok(())
    }

    fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    fn kv_block_bytes_for(&self, spec: &KvSpec) -> usize {
        kv::block_bytes_for(spec, self.kv_dtype)
    }

    fn kv_block_bytes(&self) -> usize {
        self.kv.as_ref().map_or(0, KvPool::block_bytes)
    }

    fn kv_copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), BackendError> {
        self.kv("kv_copy_blocks")?;
        self.kv.as_mut().map_or(Ok(()), |kv| kv.copy_blocks(pairs))
    }

    fn kv_blocks_to_host(&mut self, blocks: &[u32], dst: &mut [u8]) -> Result<(), BackendError> {
        self.kv("kv_blocks_to_host")?.save_blocks(blocks, dst)
    }

    fn kv_blocks_from_host(&mut self, src: &[u8], blocks: &[u32]) -> Result<(), BackendError> {
        self.kv("kv_blocks_from_host")?;
        self.kv
            .as_mut()
            .map_or(Ok(()), |kv| kv.load_blocks(src, blocks))
    }

    fn kv_layer_block_to_host(
        &mut self,
        layer: usize,
        block: u32,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), BackendError> {
        self.kv("kv_layer_block_to_host")?
            .save_layer_block(layer, block, k, v)
    }

    fn kv_layer_block_from_host(
        &mut self,
        layer: usize,
        block: u32,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), BackendError> {
        self.kv("kv_layer_block_from_host")?;
        self.kv
            .as_mut()
            .map_or(Ok(()), |kv| kv.load_layer_block(layer, block, k, v))
    }

    fn begin_step(&mut self, step: &StepInputs) -> Result<(), BackendError> {
        // The agent checked the step once, where it read it; here it is only taken over.
        self.step.clone_from(step);
        self.step_serial += 1;
        Ok(())
    }

    fn embed(
        &mut self,
        table: &CpuEmbedding,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "embed";
        let mut o = rows_mut(&mut out, OP)?;
        shape(OP, "out", o.rows, o.cols, self.step.tokens.len(), table.dim)?;
        for (i, &tok) in self.step.tokens.iter().enumerate() {
            let t = tok as usize;
            let src = table
                .data
                .get(t * table.row_bytes..(t + 1) * table.row_bytes)
                .filter(|_| t < table.rows)
                .ok_or_else(|| {
                    bad(
                        OP,
                        format!("token id {t} is beyond the vocabulary ({})", table.rows),
                    )
                })?;
            dequantize_row(table.ty, src, o.row_mut(i)).map_err(|e| bad(OP, e.to_string()))?;
        }
        Ok(())
    }

    fn rms_norm(
        &mut self,
        x: View<'_, CpuBuffer>,
        w: &CpuBuffer,
        eps: f32,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "rms_norm";
        let x = rows(&x, OP)?;
        let o = rows_mut(&mut out, OP)?;
        shape(OP, "out", o.rows, o.cols, x.rows, x.cols)?;
        let w = w.f32s(OP)?;
        if w.len() != x.cols {
            return Err(bad(
                OP,
                format!("{} weights for rows of {}", w.len(), x.cols),
            ));
        }
        self.par_rows_mut_quantized(o, |r, dst| elementwise::rms_norm(x.row(r), w, eps, dst))
    }

    fn matmul(
        &mut self,
        x: View<'_, CpuBuffer>,
        w: &WeightMatrix,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "matmul";
        let x = rows(&x, OP)?;
        let o = rows_mut(&mut out, OP)?;
        shape(OP, "x", x.rows, x.cols, o.rows, w.k())?;
        shape(OP, "out", o.rows, o.cols, x.rows, w.n())?;
        if x.rows == 0 {
            return Ok(());
        }
        let input = match x.contiguous() {
            Some(all) => all,
            None => {
                self.staging.clear();
                for r in 0..x.rows {
                    self.staging.extend_from_slice(x.row(r));
                }
                &self.staging
            }
        };
        // Rows an op has just written may have been quantized as it wrote them (the key
        // names the same contents only while nothing wrote the buffer since).
        let key = x.key();
        if let WeightMatrix::Packed(p) = w {
            let blocks = p.format.act_blocks();
            if self.acts_key != Some((key, blocks)) {
                self.acts_key = None;
                quantize_acts(
                    &self.pool,
                    self.isa,
                    input,
                    x.rows,
                    x.cols,
                    blocks,
                    &mut self.acts,
                )?;
                self.acts_key = Some((key, blocks));
            }
        }
        matmul::matmul(
            &self.pool,
            self.isa,
            w,
            matmul::MatmulInput {
                f32: input,
                quantized: &self.acts,
                rows: x.rows,
            },
            o.data,
            o.stride,
        )?;
        Ok(())
    }

    fn add_bias(
        &mut self,
        mut x: ViewMut<'_, CpuBuffer>,
        bias: &CpuBuffer,
    ) -> Result<(), BackendError> {
        const OP: &str = "add_bias";
        let mut x = rows_mut(&mut x, OP)?;
        let bias = bias.f32s(OP)?;
        if bias.len() != x.cols {
            return Err(bad(
                OP,
                format!("a bias of {} for rows of {}", bias.len(), x.cols),
            ));
        }
        for r in 0..x.rows {
            elementwise::add_assign(x.row_mut(r), bias);
        }
        Ok(())
    }

    fn rope(
        &mut self,
        mut qk: ViewMut<'_, CpuBuffer>,
        g: &AttnGeometry,
    ) -> Result<(), BackendError> {
        const OP: &str = "rope";
        let (hd, dims) = (g.head_dim, g.rope.dims);
        if dims > hd || !dims.is_multiple_of(2) {
            return Err(bad(
                OP,
                format!("{dims} rotary dimensions in heads of {hd}"),
            ));
        }
        let heads = g.n_heads + g.n_kv_heads;
        let qk = rows_mut(&mut qk, OP)?;
        shape(
            OP,
            "qk",
            qk.rows,
            qk.cols,
            self.step.positions.len(),
            heads * hd,
        )?;
        // The angles depend on the position only: computed once per step and rope, used by
        // every layer that turns with that rope.
        let serial = self.step_serial;
        self.rope_tables.retain(|(_, s, _)| *s == serial);
        let at = match self.rope_tables.iter().position(|(r, _, _)| *r == g.rope) {
            Some(at) => at,
            None => {
                let mut cs = vec![0.0; self.step.positions.len() * dims];
                for (cs, &pos) in cs.chunks_exact_mut(dims.max(1)).zip(&self.step.positions) {
                    g.rope.angles(pos, cs);
                }
                self.rope_tables.push((g.rope, serial, cs));
                self.rope_tables.len() - 1
            }
        };
        let cs = &self.rope_tables[at].2;
        let rope = g.rope;
        self.par_rows_mut(qk, |r, row| {
            elementwise::rope_apply(&rope, row, heads, hd, &cs[r * dims..(r + 1) * dims]);
        })
    }

    fn kv_write(
        &mut self,
        k: View<'_, CpuBuffer>,
        v: View<'_, CpuBuffer>,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        const OP: &str = "kv_write";
        let (k, v) = (rows(&k, OP)?, rows(&v, OP)?);
        let n = self.step.slot_mapping.len();
        shape(OP, "k", k.rows, k.cols, n, g.kv_width())?;
        shape(OP, "v", v.rows, v.cols, n, g.kv_width())?;
        let kv = self
            .kv
            .as_mut()
            .ok_or_else(|| bad(OP, "the KV pool is not initialised (init_kv)".into()))?;
        check_geometry(OP, &kv.spec, g)?;
        if kv.dtype == KvDtype::Int8 {
            if self.kv_rounding.is_some() {
                return Err(bad(
                    OP,
                    "set_kv_rounding is for an f16 cache, not int8".into(),
                ));
            }
            return kv.write_i8(
                OP,
                layer,
                k.data,
                k.stride,
                v.data,
                v.stride,
                &self.step.slot_mapping,
            );
        }
        let (k_base, v_base) = kv.bases(OP, layer)?;
        let lay = kv.layout();
        // A measuring instrument only (kv_rounding.rs): the rows rounded as it says.
        let rounded = match self.kv_rounding.as_mut() {
            Some(r) => Some(r.round(
                OP,
                layer,
                k.data,
                k.stride,
                v.data,
                v.stride,
                n,
                lay.n_kv_heads,
                lay.head_dim,
            )?),
            None => None,
        };
        let (kd, vd) = rounded
            .as_ref()
            .map_or((k.data, v.data), |(k, v)| (&k[..], &v[..]));
        attention::kv_write_parallel(
            &self.pool,
            &lay,
            kd,
            k.stride,
            vd,
            v.stride,
            &self.step.slot_mapping,
            kv.data_mut(),
            k_base,
            v_base,
        )?;
        Ok(())
    }

    fn attention(
        &mut self,
        q: View<'_, CpuBuffer>,
        g: &AttnGeometry,
        layer: usize,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "attention";
        let q = rows(&q, OP)?;
        let o = rows_mut(&mut out, OP)?;
        let n = self.step.tokens.len();
        shape(OP, "q", q.rows, q.cols, n, g.q_width())?;
        shape(OP, "out", o.rows, o.cols, n, g.q_width())?;
        let kv = self.kv(OP)?;
        check_geometry(OP, &kv.spec, g)?;
        if g.n_kv_heads == 0 || !g.n_heads.is_multiple_of(g.n_kv_heads) {
            return Err(bad(
                OP,
                format!("{} query heads over {} KV heads", g.n_heads, g.n_kv_heads),
            ));
        }
        let (k_base, v_base) = kv.bases(OP, layer)?;
        let mb = self.step.max_blocks;
        let mut seqs = Vec::with_capacity(self.step.seqs.len());
        for (i, s) in self.step.seqs.iter().enumerate() {
            // The kernel writes each sequence's output rows directly: they must lie in `out`.
            let (q_row, n_q) = (s.q_row as usize, s.n_q as usize);
            let table = self.step.block_tables.get(i * mb..(i + 1) * mb);
            let (Some(table), true) = (table, q_row + n_q <= n) else {
                return Err(BackendError::BadStep(format!(
                    "sequence {i} lies outside the step's {n} tokens or block tables"
                )));
            };
            seqs.push(AttnSeq {
                q_row,
                n_q,
                start_pos: s.start_pos as usize,
                block_table: table,
            });
        }
        let p = AttnParams {
            lay: kv.layout(),
            n_heads: g.n_heads,
            scale: g.scale,
            window: g.window.map(|w| w as usize),
        };
        let cache = match kv.i8_cache(OP, layer)? {
            Some(c) => attention::KvCache::I8(c),
            None => attention::KvCache::F16 {
                k: &kv.data()[k_base..],
                v: &kv.data()[v_base..],
            },
        };
        attention::paged_attention_kv(
            &self.pool, self.isa, &p, q.data, q.stride, &seqs, cache, o.data, o.stride,
        )?;
        Ok(())
    }

    fn swiglu(
        &mut self,
        gate: View<'_, CpuBuffer>,
        up: View<'_, CpuBuffer>,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "swiglu";
        let (gate, up) = (rows(&gate, OP)?, rows(&up, OP)?);
        let o = rows_mut(&mut out, OP)?;
        shape(OP, "up", up.rows, up.cols, gate.rows, gate.cols)?;
        shape(OP, "out", o.rows, o.cols, gate.rows, gate.cols)?;
        let isa = self.isa;
        self.par_rows_mut_quantized(o, |r, dst| {
            elementwise::swiglu(isa, gate.row(r), up.row(r), dst)
        })
    }

    fn add(
        &mut self,
        mut x: ViewMut<'_, CpuBuffer>,
        y: View<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "add";
        let y = rows(&y, OP)?;
        let x = rows_mut(&mut x, OP)?;
        shape(OP, "y", y.rows, y.cols, x.rows, x.cols)?;
        self.par_rows_mut(x, |r, dst| elementwise::add_assign(dst, y.row(r)))
    }

    fn gather_logit_rows(
        &mut self,
        x: View<'_, CpuBuffer>,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        const OP: &str = "gather_logit_rows";
        let x = rows(&x, OP)?;
        let mut o = rows_mut(&mut out, OP)?;
        shape(
            OP,
            "out",
            o.rows,
            o.cols,
            self.step.logit_rows.len(),
            x.cols,
        )?;
        for (i, &r) in self.step.logit_rows.iter().enumerate() {
            if r as usize >= x.rows {
                return Err(BackendError::BadStep(format!(
                    "logit row {r} of a {}-row step",
                    x.rows
                )));
            }
            o.row_mut(i).copy_from_slice(x.row(r as usize));
        }
        Ok(())
    }

    fn argmax_rows(
        &mut self,
        logits: View<'_, CpuBuffer>,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<bool, BackendError> {
        const OP: &str = "argmax_rows";
        let x = rows(&logits, OP)?;
        let l = out.layout();
        shape(OP, "out", l.rows(), l.cols(), x.rows, 1)?;
        let ids = self.par_map_rows(x.rows, |r| u64::from(scan::argmax_sanitized(x.row(r))))?;
        let (o, stride) = buffer::i32_rows_mut(&mut out, OP)?;
        for (r, id) in ids.into_iter().enumerate() {
            o[r * stride] = id as i32;
        }
        Ok(true)
    }

    fn argmax_logprob_rows(
        &mut self,
        logits: View<'_, CpuBuffer>,
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<bool, BackendError> {
        const OP: &str = "argmax_logprob_rows";
        let x = rows(&logits, OP)?;
        let mut o = rows_mut(&mut out, OP)?;
        shape(OP, "out", o.rows, o.cols, x.rows, 1)?;
        let bits = self.par_map_rows(x.rows, |r| {
            u64::from(scan::max_logprob_sanitized(x.row(r)).to_bits())
        })?;
        for (r, b) in bits.into_iter().enumerate() {
            o.row_mut(r)[0] = f32::from_bits(b as u32);
        }
        Ok(true)
    }

    fn argmax_and_logprob_rows(
        &mut self,
        logits: View<'_, CpuBuffer>,
        mut ids: ViewMut<'_, CpuBuffer>,
        mut logprobs: ViewMut<'_, CpuBuffer>,
    ) -> Result<bool, BackendError> {
        const OP: &str = "argmax_and_logprob_rows";
        let x = rows(&logits, OP)?;
        let l = ids.layout();
        shape(OP, "ids", l.rows(), l.cols(), x.rows, 1)?;
        let mut lp = rows_mut(&mut logprobs, OP)?;
        shape(OP, "logprobs", lp.rows, lp.cols, x.rows, 1)?;
        // One pass finds the pick and the maximum, a second sums the exponentials.
        let picks = self.par_map_rows(x.rows, |r| {
            let (id, logprob) = scan::pick_sanitized(x.row(r));
            u64::from(id) << 32 | u64::from(logprob.to_bits())
        })?;
        for (r, &p) in picks.iter().enumerate() {
            lp.row_mut(r)[0] = f32::from_bits(p as u32);
        }
        let (o, stride) = buffer::i32_rows_mut(&mut ids, OP)?;
        for (r, p) in picks.into_iter().enumerate() {
            o[r * stride] = (p >> 32) as i32;
        }
        Ok(true)
    }
}

//! The CPU backend: host memory buffers, packed quantized weights, an f16 paged KV pool, and the
//! kernels of `crate::kernels` run on a fork-join thread pool with the best instruction set the
//! machine offers.

use std::sync::Arc;

use half::f16;

use crate::disjoint::{Tile, TileGrid};
use crate::kernels::attention::{self, AttnParams, AttnSeq, KvLayout};
use crate::kernels::elementwise;
use crate::kernels::elementwise::Rope;
use crate::kernels::matmul;
use crate::kernels::quantize::quantize_acts;
use crate::kernels::{Isa, KernelError};
use crate::quant::{QuantizedActs, WeightMatrix};
use crate::threadpool::ThreadPool;
use npu_backend::legacy::{AttnGeometry, Backend, BackendError, KvSpec, StepMeta, TensorPart};
use npu_gguf::quants::dequantize_row;
use npu_gguf::GgmlType;

const NAME: &str = "cpu";

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
}

struct KvPool {
    spec: KvSpec,
    /// Per layer: K and V caches.
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
}

pub struct CpuBackend {
    f32_reference: bool,
    pool: Arc<ThreadPool>,
    isa: Isa,
    acts: QuantizedActs,
    kv: Option<KvPool>,
    step: StepMeta,
    /// Counts steps, so per-step caches know when they are stale.
    step_serial: u64,
    /// Rotary cos/sin of every token of the step, and what they were computed for.
    rope_cs: Vec<f32>,
    rope_for: Option<(Rope, u64)>,
}

impl CpuBackend {
    pub fn new(cfg: CpuConfig) -> Self {
        let threads = if cfg.threads == 0 {
            ThreadPool::available_threads()
        } else {
            cfg.threads
        };
        Self {
            f32_reference: cfg.f32_reference,
            pool: Arc::new(ThreadPool::new(threads)),
            isa: Isa::active(),
            acts: QuantizedActs::new(),
            kv: None,
            step: StepMeta::default(),
            step_serial: 0,
            rope_cs: Vec::new(),
            rope_for: None,
        }
    }

    /// Same, with an explicit instruction set (tests compare them).
    pub fn with_isa(cfg: CpuConfig, isa: Isa) -> Self {
        let mut b = Self::new(cfg);
        b.isa = isa;
        b
    }

    /// The compute pool (the engine samples on it too).
    pub fn pool(&self) -> Arc<ThreadPool> {
        self.pool.clone()
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Row ranges covering `0..rows`: one per thread when there are enough rows, else one.
    fn row_parts(&self, rows: usize) -> Vec<std::ops::Range<usize>> {
        let threads = self.pool.threads();
        let tasks = if rows < 8 || threads == 1 {
            1
        } else {
            threads.min(rows)
        };
        (0..tasks)
            .map(|t| crate::threadpool::split_range(rows, tasks, t))
            .collect()
    }

    /// Runs `f` on every tile of `grid`, in parallel.
    fn par_tiles<T: Send, F: Fn(&mut Tile<T>) + Sync>(
        &self,
        grid: Result<TileGrid<T>, crate::disjoint::GridError>,
        f: F,
    ) -> Result<(), BackendError> {
        let grid = grid.map_err(|e| BackendError::BadStep(e.to_string()))?;
        let cols = grid.n_col_parts();
        self.pool
            .run(grid.n_row_parts() * cols, |t| {
                f(&mut grid.take(t / cols, t % cols))
            })
            .map_err(|e| KernelError::from(e).into())
    }

    fn kv(&self) -> Result<&KvPool, BackendError> {
        self.kv
            .as_ref()
            .ok_or_else(|| BackendError::BadStep("KV pool not initialised".into()))
    }
}

/// A zero-filled vector from `calloc`: for a large buffer the kernel hands out zero pages on
/// first touch, so a large KV pool costs no start-up time (an agent restart is not slowed by
/// writing zeros to every block).
fn alloc_zeroed_vec<T: bytemuck::Zeroable>(len: usize, what: &str) -> Result<Vec<T>, BackendError> {
    let oom = || BackendError::OutOfMemory {
        backend: NAME,
        what: what.to_string(),
        bytes: len.saturating_mul(std::mem::size_of::<T>()),
    };
    let layout = std::alloc::Layout::array::<T>(len).map_err(|_| oom())?;
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the layout has a non-zero size (checked above).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `[T; len]` (so capacity
    // `len` and T's alignment), and its `len` elements are zero bytes, a valid `T` (Zeroable).
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

fn alloc_vec<T: Clone>(len: usize, v: T, what: &str) -> Result<Vec<T>, BackendError> {
    let mut out = Vec::new();
    out.try_reserve_exact(len)
        .map_err(|_| BackendError::OutOfMemory {
            backend: NAME,
            what: what.to_string(),
            bytes: len * std::mem::size_of::<T>(),
        })?;
    out.resize(len, v);
    Ok(out)
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Matrix = WeightMatrix;
    type Embedding = CpuEmbedding;

    fn name(&self) -> &'static str {
        NAME
    }

    fn describe(&self) -> String {
        format!("cpu ({}, {} threads)", self.isa.name(), self.pool.threads())
    }

    fn alloc(&mut self, len: usize) -> Result<Vec<f32>, BackendError> {
        alloc_vec(len, 0f32, "activation buffer")
    }

    fn upload(&mut self, dst: &mut Vec<f32>, src: &[f32]) -> Result<(), BackendError> {
        dst.clear();
        dst.extend_from_slice(src);
        Ok(())
    }

    fn download(&mut self, src: &Vec<f32>, dst: &mut [f32]) -> Result<(), BackendError> {
        dst.copy_from_slice(&src[..dst.len()]);
        Ok(())
    }

    fn load_matrix(
        &mut self,
        parts: &[TensorPart],
        k: usize,
    ) -> Result<Option<WeightMatrix>, BackendError> {
        let raw: Vec<(GgmlType, &[u8], usize)> =
            parts.iter().map(|p| (p.ty, p.data, p.rows)).collect();
        if self.f32_reference {
            let n: usize = parts.iter().map(|p| p.rows).sum();
            let mut data = alloc_vec(n * k, 0f32, "f32 reference weights")?;
            let mut row0 = 0;
            for p in parts {
                let rb = p.ty.row_bytes(k).ok_or_else(|| BackendError::Unsupported {
                    backend: NAME,
                    what: format!("rows of {k} {} values", p.ty.name()),
                })?;
                for r in 0..p.rows {
                    dequantize_row(
                        p.ty,
                        &p.data[r * rb..(r + 1) * rb],
                        &mut data[(row0 + r) * k..(row0 + r + 1) * k],
                    );
                }
                row0 += p.rows;
            }
            return Ok(Some(WeightMatrix::F32 { n, k, data }));
        }
        Ok(WeightMatrix::from_ggml_parts(&raw, k))
    }

    fn load_embedding(
        &mut self,
        table: TensorPart,
        dim: usize,
    ) -> Result<CpuEmbedding, BackendError> {
        Ok(CpuEmbedding {
            ty: table.ty,
            data: table.data.to_vec(),
            dim,
            rows: table.rows,
        })
    }

    fn init_kv(&mut self, spec: KvSpec) -> Result<(), BackendError> {
        let per_layer = spec.num_blocks * spec.block_size * spec.n_kv_heads * spec.head_dim;
        let mut k = Vec::with_capacity(spec.n_layers);
        let mut v = Vec::with_capacity(spec.n_layers);
        for _ in 0..spec.n_layers {
            k.push(alloc_zeroed_vec::<f16>(per_layer, "KV cache")?);
            v.push(alloc_zeroed_vec::<f16>(per_layer, "KV cache")?);
        }
        self.kv = Some(KvPool { spec, k, v });
        Ok(())
    }

    fn begin_step(&mut self, meta: &StepMeta) -> Result<(), BackendError> {
        let kv = self.kv()?;
        let cap = (kv.spec.num_blocks * kv.spec.block_size) as u32;
        if let Some(bad) = meta.slot_mapping.iter().find(|&&s| s >= cap) {
            return Err(BackendError::BadStep(format!(
                "slot {bad} is beyond the KV pool ({cap} slots)"
            )));
        }
        if let Some(bad) = meta
            .block_tables
            .iter()
            .find(|&&b| b as usize >= kv.spec.num_blocks)
        {
            return Err(BackendError::BadStep(format!(
                "block {bad} is beyond the KV pool ({} blocks)",
                kv.spec.num_blocks
            )));
        }
        self.step.clone_from(meta);
        self.step_serial += 1;
        Ok(())
    }

    fn embed(&mut self, table: &CpuEmbedding, out: &mut Vec<f32>) -> Result<(), BackendError> {
        let d = table.dim;
        let rb = table
            .ty
            .row_bytes(d)
            .ok_or_else(|| BackendError::Unsupported {
                backend: NAME,
                what: format!("embedding rows of {d} {} values", table.ty.name()),
            })?;
        for (i, &tok) in self.step.tokens.iter().enumerate() {
            let t = tok as usize;
            if t >= table.rows {
                return Err(BackendError::BadStep(format!(
                    "token id {t} is beyond the vocabulary ({})",
                    table.rows
                )));
            }
            dequantize_row(
                table.ty,
                &table.data[t * rb..(t + 1) * rb],
                &mut out[i * d..(i + 1) * d],
            );
        }
        Ok(())
    }

    fn rms_norm(
        &mut self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        dim: usize,
        eps: f32,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let grid = TileGrid::rows(&mut out[..rows * dim], dim, self.row_parts(rows));
        self.par_tiles(grid, |t| {
            let r = t.rows();
            elementwise::rms_norm(
                &x[r.start * dim..r.end * dim],
                &w[..dim],
                eps,
                t.contiguous_mut(),
            );
        })
    }

    fn matmul(
        &mut self,
        x: &Vec<f32>,
        rows: usize,
        w: &WeightMatrix,
        out: &mut Vec<f32>,
        col0: usize,
        ldo: usize,
    ) -> Result<(), BackendError> {
        let k = w.k();
        if let WeightMatrix::Packed(_) = w {
            quantize_acts(
                &self.pool,
                self.isa,
                &x[..rows * k],
                rows,
                k,
                &mut self.acts,
            )?;
        }
        matmul::matmul(
            &self.pool,
            self.isa,
            w,
            matmul::MatmulInput {
                f32: &x[..rows * k],
                quantized: &self.acts,
                rows,
            },
            &mut out[col0..],
            ldo,
        )?;
        Ok(())
    }

    fn add_bias(
        &mut self,
        x: &mut Vec<f32>,
        bias: &Vec<f32>,
        rows: usize,
        col0: usize,
        ld: usize,
    ) -> Result<(), BackendError> {
        for r in 0..rows {
            let row = &mut x[r * ld + col0..r * ld + col0 + bias.len()];
            elementwise::add_assign(row, bias);
        }
        Ok(())
    }

    fn rope(
        &mut self,
        qkv: &mut Vec<f32>,
        ld: usize,
        g: &AttnGeometry,
    ) -> Result<(), BackendError> {
        let hd = g.head_dim;
        let dims = g.rope.dims;
        // The angles depend on the position only: computed once per step, used by every layer.
        if self.rope_for != Some((g.rope, self.step_serial)) {
            self.rope_cs.resize(self.step.positions.len() * dims, 0.0);
            for (r, &pos) in self.step.positions.iter().enumerate() {
                g.rope
                    .angles(pos, &mut self.rope_cs[r * dims..(r + 1) * dims]);
            }
            self.rope_for = Some((g.rope, self.step_serial));
        }
        let rows = self.step.positions.len();
        let cs = &self.rope_cs;
        let heads = g.n_heads + g.n_kv_heads;
        let grid = TileGrid::row_parts(qkv, ld, self.row_parts(rows), 0..heads * hd);
        self.par_tiles(grid, |t| {
            for r in t.rows() {
                let row = t.row_mut(r);
                elementwise::rope_apply(&g.rope, row, heads, hd, &cs[r * dims..(r + 1) * dims]);
            }
        })
    }

    fn kv_write(
        &mut self,
        qkv: &Vec<f32>,
        ld: usize,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        let kv = self
            .kv
            .as_mut()
            .ok_or_else(|| BackendError::BadStep("KV pool not initialised".into()))?;
        let lay = KvLayout {
            n_kv_heads: g.n_kv_heads,
            head_dim: g.head_dim,
            block_size: kv.spec.block_size,
        };
        let k_col = g.n_heads * g.head_dim;
        let v_col = k_col + g.n_kv_heads * g.head_dim;
        attention::kv_write(
            &lay,
            qkv,
            ld,
            k_col,
            v_col,
            &self.step.slot_mapping,
            &mut kv.k[layer],
            &mut kv.v[layer],
        );
        Ok(())
    }

    fn attention(
        &mut self,
        qkv: &Vec<f32>,
        ld: usize,
        g: &AttnGeometry,
        layer: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let kv = self.kv()?;
        let lay = KvLayout {
            n_kv_heads: g.n_kv_heads,
            head_dim: g.head_dim,
            block_size: kv.spec.block_size,
        };
        let mb = self.step.max_blocks;
        let seqs: Vec<AttnSeq> = self
            .step
            .seqs
            .iter()
            .enumerate()
            .map(|(i, s)| AttnSeq {
                q_row: s.q_row as usize,
                n_q: s.n_q as usize,
                start_pos: s.start_pos as usize,
                block_table: &self.step.block_tables[i * mb..(i + 1) * mb],
            })
            .collect();
        let p = AttnParams {
            lay,
            n_heads: g.n_heads,
            scale: g.scale,
        };
        attention::paged_attention(
            &self.pool,
            self.isa,
            &p,
            qkv,
            ld,
            &seqs,
            &kv.k[layer],
            &kv.v[layer],
            out,
            g.n_heads * g.head_dim,
        )?;
        Ok(())
    }

    fn swiglu(
        &mut self,
        gate_up: &Vec<f32>,
        ff: usize,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let isa = self.isa;
        let grid = TileGrid::rows(&mut out[..rows * ff], ff, self.row_parts(rows));
        self.par_tiles(grid, |t| {
            let r = t.rows();
            let src = &gate_up[r.start * 2 * ff..r.end * 2 * ff];
            elementwise::swiglu(isa, src, ff, t.contiguous_mut());
        })
    }

    fn add_assign(
        &mut self,
        x: &mut Vec<f32>,
        y: &Vec<f32>,
        len: usize,
    ) -> Result<(), BackendError> {
        // One row of `len` values, cut into runs of whole 4096-value chunks.
        let chunk = 4096;
        let parts = self
            .row_parts(len.div_ceil(chunk))
            .into_iter()
            .map(|r| r.start * chunk..(r.end * chunk).min(len))
            .collect();
        let grid = TileGrid::column_parts(&mut x[..len], len, 0..1, parts);
        self.par_tiles(grid, |t| {
            let c = t.cols();
            elementwise::add_assign(t.contiguous_mut(), &y[c]);
        })
    }

    fn gather_logit_rows(
        &mut self,
        x: &Vec<f32>,
        dim: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        for (i, &r) in self.step.logit_rows.iter().enumerate() {
            let r = r as usize;
            out[i * dim..(i + 1) * dim].copy_from_slice(&x[r * dim..(r + 1) * dim]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_vectors_are_zero_of_the_asked_length() {
        let v = alloc_zeroed_vec::<f16>(3 << 20, "test").unwrap();
        assert_eq!(v.len(), 3 << 20);
        assert!(v.iter().all(|x| x.to_bits() == 0));
        let mut v = v;
        v[12345] = f16::ONE;
        assert_eq!(v[12345], f16::ONE);
        assert!(alloc_zeroed_vec::<f16>(0, "test").unwrap().is_empty());
        assert!(matches!(
            alloc_zeroed_vec::<f16>(usize::MAX / 2, "test"),
            Err(BackendError::OutOfMemory { .. })
        ));
    }
}

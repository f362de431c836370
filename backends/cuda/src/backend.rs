//! `CudaBackend`: the `npu_backend::Backend` implementation over a `Gpu` (the real device, or the
//! emulation). This file holds construction, memory, weights, the KV pool and step inputs; the
//! kernels of a step are launched from `ops.rs`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use npu_backend::{
    AttnGeometry, Backend, BackendError, Capability, DType, DeviceKind, HostSlice, HostSliceMut,
    HostTensor, KvDtype, KvSpec, MemInfo, OpCounts, Readback, RouteSpec, StepInputs, View, ViewMut,
};
use npu_gguf::quants::dequantize_row;

use crate::buffer::{CudaBuffer, DeviceId, DeviceMem, Scratch};
use crate::config::{CudaConfig, MatmulMode};
use crate::gpu::{DevPtr, Gpu};
use crate::host_rows::{decode_rows, host_bytes};
use crate::open::panic_message;
pub use crate::open::{open_libraries, Libraries};
use crate::step::{self, StepLayout};
use crate::weights::{self, CudaEmbedding, CudaMatrix};

pub(crate) const NAME: &str = "cuda";

pub(crate) use crate::kv::KvPool;

/// Rope frequency-factor tables on the device: each distinct table uploaded once, found by the
/// address of the (interned, `'static`) host table that asked for it.
#[derive(Default)]
pub(crate) struct RopeFactorTables {
    /// (host table, index into `tables`); equal tables at different addresses share an entry.
    pub keys: Vec<(&'static [f32], usize)>,
    pub tables: Vec<DeviceMem>,
}

/// What the CUDA backend has of [`Capability`]: every op of the newer families, the
/// mixture-of-experts ones included (`moe`), DeepSeek's scored routing and latent attention
/// (`mla`), and LoRA adapters (`lora`).
pub(crate) fn supports(c: Capability) -> bool {
    match c {
        Capability::HeadNorm
        | Capability::GeluGate
        | Capability::ScaleRows
        | Capability::SlidingWindow
        | Capability::RopeFactors
        | Capability::PerLayerRope
        | Capability::Moe
        | Capability::ScoredRouting
        | Capability::LatentAttention
        | Capability::Lora => true,
        // Not built on CUDA yet: `moe_tensor_parallel: whole_experts` is refused by name at
        // load (share_each_expert serves MoE groups).
        Capability::HeldExperts => false,
    }
}

/// A CUDA device running the kernels of a step.
pub struct CudaBackend {
    pub(crate) gpu: Arc<dyn Gpu>,
    pub(crate) device: DeviceId,
    pub(crate) cfg: CudaConfig,
    pub(crate) kv: Option<KvPool>,
    /// What `init_kv` stores (`set_kv_dtype`; `kv.rs`).
    pub(crate) kv_dtype: KvDtype,
    /// The step inputs on the device (one packed i32 array) and where each part lies.
    pub(crate) meta: Option<DeviceMem>,
    pub(crate) meta_host: Vec<i32>,
    pub(crate) step: StepInputs,
    pub(crate) layout: Option<StepLayout>,
    /// Dequantized weights for cuBLAS, aligned activation rows for the GEMV kernels, and the
    /// partial results of split attention.
    pub(crate) scratch_w: Scratch,
    pub(crate) scratch_x: Scratch,
    pub(crate) scratch_attn: Scratch,
    /// The fused attention + output projection's work area and counters (`fold_attn`).
    pub(crate) attn_out: crate::fold_attn::AttnOutScratch,
    /// The one-launch feed-forward block's partial sums and counter (`fold_ffn`).
    pub(crate) ffn: crate::fold_ffn::FfnScratch,
    pub(crate) rope_factors: RopeFactorTables,
    /// The f16 GELU table on the device (uploaded at the first GELU gate).
    pub(crate) gelu_table: Option<DeviceMem>,
    pub(crate) read_buf: Vec<u8>,
    /// Kernels launched (and cuBLAS GEMMs called) since the backend was made.
    pub(crate) launches: AtomicU64,
    /// Device writes that are not kernel launches (uploads, device copies, collectives), for
    /// `fused::Q8Ready`'s check that nothing ran between a producer and its product.
    pub(crate) device_writes: AtomicU64,
    /// 8-bit activations the last launch wrote for the next quantized product (`fused`).
    pub(crate) q8_ready: Option<crate::fused::Q8Ready>,
    /// Whether a quantized (not f16) packed matrix is loaded: only then do producers write
    /// 8-bit activations.
    pub(crate) quantized_matrices: bool,
    /// Decode steps as CUDA graphs (`graphs`).
    pub(crate) graphs: crate::graphs::Graphs,
    /// The quantized GEMV kernels (`NPU_SERVING_CUDA_GEMV`; `set_gemv_variant`).
    pub(crate) gemv: crate::matmul::GemvVariant,
    /// Every weight loaded, for sleep level 1 (`offload`).
    pub(crate) weights: crate::offload::WeightList,
    #[cfg(feature = "emulation")]
    emu: Option<Arc<crate::emu::EmuGpu>>,
}

impl CudaBackend {
    /// Opens CUDA device `device` (0-based). Loads the driver library, NVRTC and cuBLAS first
    /// (CUDA 13's or 12's, as the driver allows: `open_libraries`) and fails with
    /// `BackendError::MissingLibrary` naming what is missing and how to get it; a machine
    /// without CUDA never reaches cudarc's device calls.
    ///
    /// With the `emulation` feature and `NPU_SERVING_CUDA_EMULATION=1` it opens the CPU
    /// emulation of the kernels instead (see [`crate::config::ENV_EMULATION`]).
    pub fn new(device: usize, cfg: CudaConfig) -> Result<Self, BackendError> {
        #[cfg(feature = "emulation")]
        if std::env::var(crate::config::ENV_EMULATION).is_ok_and(|v| v == "1") {
            tracing::warn!(
                "{}=1: CUDA device {device} is the CPU emulation of the kernels, not a GPU",
                crate::config::ENV_EMULATION
            );
            return Self::emulated(cfg);
        }
        let (nvrtc, blas, driver) = open_libraries(&cfg.lib_dirs)?;
        let cache = cfg.kernel_cache.clone();
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            crate::driver::CudaGpu::open(device, cache, &nvrtc, blas, driver)
        }))
        .map_err(|p| BackendError::Device {
            backend: NAME,
            message: format!(
                "opening CUDA device {device} failed inside the CUDA bindings: {}",
                panic_message(p)
            ),
        })??;
        let b = Self::with_gpu(Arc::new(opened), cfg);
        tracing::info!("cuda: opened {}", b.describe());
        Ok(b)
    }

    /// The backend on a CPU emulation of the kernels (same sources, compiled as C++): for tests
    /// on machines without a GPU. It is an emulation, not a GPU.
    #[cfg(feature = "emulation")]
    pub fn emulated(cfg: CudaConfig) -> Result<Self, BackendError> {
        let gpu = Arc::new(crate::emu::EmuGpu::new()?);
        let mut b = Self::with_gpu(gpu.clone(), cfg);
        b.emu = Some(gpu);
        Ok(b)
    }

    /// The emulated device, when this backend runs on the emulation.
    #[cfg(feature = "emulation")]
    pub fn emulation(&self) -> Option<&crate::emu::EmuGpu> {
        self.emu.as_deref()
    }

    /// Whether the device has a CUDA stream (a GPU; not the emulation), which NCCL needs.
    pub fn has_cuda_stream(&self) -> bool {
        self.gpu.raw_stream().is_ok_and(|s| s.is_some())
    }

    pub(crate) fn with_gpu(gpu: Arc<dyn Gpu>, cfg: CudaConfig) -> Self {
        Self {
            gpu,
            device: DeviceId::fresh(),
            cfg,
            kv: None,
            kv_dtype: KvDtype::F16,
            meta: None,
            meta_host: Vec::new(),
            step: StepInputs::default(),
            layout: None,
            scratch_w: Scratch::default(),
            scratch_x: Scratch::default(),
            scratch_attn: Scratch::default(),
            attn_out: Default::default(),
            ffn: Default::default(),
            rope_factors: RopeFactorTables::default(),
            gelu_table: None,
            read_buf: Vec::new(),
            launches: AtomicU64::new(0),
            device_writes: AtomicU64::new(0),
            q8_ready: None,
            quantized_matrices: false,
            graphs: Default::default(),
            gemv: crate::matmul::GemvVariant::from_env(),
            weights: Default::default(),
            #[cfg(feature = "emulation")]
            emu: None,
        }
    }

    pub fn config(&self) -> &CudaConfig {
        &self.cfg
    }

    pub(crate) fn own(&self, b: &CudaBuffer, op: &'static str) -> Result<(), BackendError> {
        if b.device() != self.device {
            return Err(BackendError::BadArgument {
                op,
                message: "a buffer of another backend instance".into(),
            });
        }
        Ok(())
    }

    pub(crate) fn alloc_mem(&self, bytes: usize) -> Result<DeviceMem, BackendError> {
        DeviceMem::alloc(&self.gpu, self.device, bytes)
    }

    pub(crate) fn kv_pool(&self) -> Result<&KvPool, BackendError> {
        self.kv
            .as_ref()
            .ok_or_else(|| BackendError::BadStep("the KV pool is not initialised".into()))
    }

    /// The current step's layout and the device address of its packed inputs.
    pub(crate) fn step_meta(&self) -> Result<(StepLayout, DevPtr), BackendError> {
        let meta = match self.graphs.active {
            Some(_) => self.graphs.active_inputs(),
            None => self.meta.as_ref().map(|m| m.ptr()),
        };
        match (&self.layout, meta) {
            (Some(l), Some(m)) => Ok((*l, m)),
            _ => Err(BackendError::BadStep("no step has begun".into())),
        }
    }

    fn upload_matrix(&mut self, p: weights::PackedHost) -> Result<CudaMatrix, BackendError> {
        let mem = self.alloc_mem(p.bytes.len())?;
        self.gpu.htod(mem.ptr(), &p.bytes)?;
        self.weights.add(&mem);
        Ok(CudaMatrix {
            n: p.n,
            k: p.k,
            kind: p.kind,
            mem,
            scales_at: p.scales_at,
            mins_at: p.mins_at,
        })
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Matrix = CudaMatrix;
    type Embedding = CudaEmbedding;

    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn describe(&self) -> String {
        format!(
            "cuda: {}, {} activations, matmul {}",
            self.gpu.describe(),
            self.cfg.act_dtype.name(),
            self.cfg.matmul.name()
        )
    }

    fn act_dtype(&self) -> DType {
        self.cfg.act_dtype
    }

    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        self.gpu.mem_info()
    }

    fn supports(&self, c: Capability) -> bool {
        supports(c)
    }

    fn op_counts(&self) -> Option<OpCounts> {
        Some(OpCounts {
            launches: self.launches.load(Ordering::Relaxed),
            first_phases: 0,
            graph_replays: self.graphs.replays,
        })
    }

    fn matrix_bytes(&self, m: &CudaMatrix) -> Option<u64> {
        Some(m.mem.bytes() as u64)
    }

    fn alloc(&mut self, dtype: DType, len: usize) -> Result<CudaBuffer, BackendError> {
        let bytes = len
            .checked_mul(dtype.size())
            .ok_or_else(|| BackendError::OutOfMemory {
                backend: NAME,
                what: format!("{len} {} elements", dtype.name()),
                bytes: usize::MAX,
            })?;
        Ok(CudaBuffer::new(self.alloc_mem(bytes)?, dtype, len))
    }

    fn upload(
        &mut self,
        src: HostSlice<'_>,
        dst: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.own(dst.buf(), "upload")?;
        let l = dst.layout();
        if src.len() != l.elements() {
            return Err(BackendError::BadArgument {
                op: "upload",
                message: format!("{} values for a window of {}", src.len(), l.elements()),
            });
        }
        let dt = dst.dtype();
        let mut bytes = Vec::new();
        host_bytes(src, dt, &mut bytes)?;
        self.device_wrote();
        let es = dt.size();
        if l.is_contiguous() {
            return self.gpu.htod(dst.buf().addr(l.offset()), &bytes);
        }
        for r in 0..l.rows() {
            let row = &bytes[r * l.cols() * es..(r + 1) * l.cols() * es];
            self.gpu
                .htod(dst.buf().addr(l.offset() + r * l.stride()), row)?;
        }
        Ok(())
    }

    fn read_back(&mut self, reads: &mut [Readback<'_, CudaBuffer>]) -> Result<(), BackendError> {
        let mut regions = Vec::with_capacity(reads.len());
        for rd in reads.iter() {
            self.own(rd.src.buf(), "read_back")?;
            let l = rd.src.layout();
            let dt = rd.src.dtype();
            let kinds_match = matches!(
                (&rd.dst, dt),
                (HostSliceMut::I32(_), DType::I32)
                    | (HostSliceMut::F32(_), DType::F32 | DType::F16 | DType::BF16)
            );
            if !kinds_match || rd.dst.len() != l.elements() {
                return Err(BackendError::BadArgument {
                    op: "read_back",
                    message: format!(
                        "a {} window of {} elements into host memory of {} {}",
                        dt.name(),
                        l.elements(),
                        rd.dst.len(),
                        match rd.dst {
                            HostSliceMut::F32(_) => "f32",
                            HostSliceMut::I32(_) => "i32",
                        }
                    ),
                });
            }
            regions.push((
                rd.src.buf().addr(l.offset()),
                (l.end() - l.offset()) * dt.size(),
            ));
        }
        let mut bytes = std::mem::take(&mut self.read_buf);
        let res = self.gpu.read(&regions, &mut bytes);
        if res.is_ok() {
            let mut at = 0;
            for (rd, &(_, n)) in reads.iter_mut().zip(&regions) {
                let l = rd.src.layout();
                decode_rows(
                    &bytes[at..at + n],
                    rd.src.dtype(),
                    l.rows(),
                    l.cols(),
                    l.stride(),
                    &mut rd.dst,
                );
                at += n;
            }
        }
        self.read_buf = bytes;
        res
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.gpu.synchronize()
    }

    fn load_matrix(
        &mut self,
        parts: &[HostTensor<'_>],
    ) -> Result<Option<CudaMatrix>, BackendError> {
        self.load_matrix_as(parts, self.cfg.kquants)
    }

    /// Experts load as `load_matrix` does, except that K-quant experts are widened to F16
    /// whatever `kquants` says: the grouped MoE matmul reads Q4_0, Q4_1, Q8_0, F16 or dense
    /// weights, not the packed K-quant blocks.
    fn load_experts(
        &mut self,
        experts: &[Vec<HostTensor<'_>>],
    ) -> Result<Option<Vec<CudaMatrix>>, BackendError> {
        let mut out = Vec::with_capacity(experts.len());
        for parts in experts {
            match self.load_matrix_as(parts, crate::config::KQuants::F16)? {
                Some(m) => out.push(m),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    }

    fn load_embedding(&mut self, table: HostTensor<'_>) -> Result<CudaEmbedding, BackendError> {
        let (ty, row_bytes, bytes) = weights::pack_embedding(&table)?;
        let mem = self.alloc_mem(bytes.len())?;
        self.gpu.htod(mem.ptr(), &bytes)?;
        self.weights.add(&mem);
        Ok(CudaEmbedding {
            ty,
            rows: table.rows,
            dim: table.cols,
            row_bytes,
            mem,
        })
    }

    fn load_vector(&mut self, v: HostTensor<'_>) -> Result<CudaBuffer, BackendError> {
        let rb = weights::check_tensor("load_vector", &v)?;
        let n = v.rows * v.cols;
        let mut vals = vec![0f32; n];
        for r in 0..v.rows {
            dequantize_row(
                v.ty,
                &v.data[r * rb..(r + 1) * rb],
                &mut vals[r * v.cols..(r + 1) * v.cols],
            )
            .map_err(|e| BackendError::BadArgument {
                op: "load_vector",
                message: e.to_string(),
            })?;
        }
        let mut buf = self.alloc(DType::F32, n)?;
        self.upload(HostSlice::F32(&vals), ViewMut::rows(&mut buf, 1, n)?)?;
        self.weights.add(buf.mem());
        Ok(buf)
    }

    fn init_kv(&mut self, spec: KvSpec) -> Result<(), BackendError> {
        self.op_init_kv(spec)
    }

    fn set_kv_dtype(&mut self, dtype: KvDtype) -> Result<(), BackendError> {
        self.op_set_kv_dtype(dtype)
    }

    fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    fn kv_block_bytes_for(&self, spec: &KvSpec) -> usize {
        spec.block_bytes(self.kv_dtype)
    }

    fn kv_block_bytes(&self) -> usize {
        self.kv.as_ref().map_or(0, KvPool::block_bytes)
    }

    fn kv_copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), BackendError> {
        self.op_kv_copy_blocks(pairs)
    }

    fn kv_blocks_to_host(&mut self, blocks: &[u32], dst: &mut [u8]) -> Result<(), BackendError> {
        self.op_kv_blocks_to_host(blocks, dst)
    }

    fn kv_blocks_from_host(&mut self, src: &[u8], blocks: &[u32]) -> Result<(), BackendError> {
        self.op_kv_blocks_from_host(src, blocks)
    }

    fn init_latent_kv(&mut self, spec: KvSpec) -> Result<(), BackendError> {
        self.op_init_latent_kv(spec)
    }

    fn latent_kv_block_bytes_for(&self, spec: &KvSpec) -> usize {
        crate::mla::latent_block_elems(spec).saturating_mul(2)
    }

    fn kv_write_latent(
        &mut self,
        latent: View<'_, CudaBuffer>,
        rope: View<'_, CudaBuffer>,
        layer: usize,
    ) -> Result<(), BackendError> {
        self.op_kv_write_latent(latent, rope, layer)
    }

    fn attention_latent(
        &mut self,
        q_latent: View<'_, CudaBuffer>,
        q_rope: View<'_, CudaBuffer>,
        g: &AttnGeometry,
        latent_dim: usize,
        layer: usize,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_attention_latent(q_latent, q_rope, g, latent_dim, layer, out)
    }

    fn begin_step(&mut self, s: &StepInputs) -> Result<(), BackendError> {
        self.check_awake()?;
        // Token ops may run before the pool exists; KV ops then refuse (no pool), and making
        // the pool forgets the step, so every step a KV op reads was checked against the pool.
        let spec = self.kv.as_ref().map(|k| k.spec);
        self.layout = None;
        self.graphs.active = None;
        let lay = step::pack(s, spec.as_ref(), &mut self.meta_host)?;
        let bytes = lay.total * 4;
        let big_enough = matches!(&self.meta, Some(m) if m.bytes() >= bytes);
        if !big_enough {
            self.meta = None;
            self.meta = Some(self.alloc_mem(bytes.next_power_of_two().max(4096))?);
        }
        let ptr = self.meta.as_ref().map(|m| m.ptr()).unwrap_or(0);
        self.device_wrote();
        self.gpu.htod(ptr, bytemuck::cast_slice(&self.meta_host))?;
        self.step.clone_from(s);
        self.layout = Some(lay);
        Ok(())
    }

    // Decode steps as CUDA graphs: `graphs.rs`.
    fn step_graphs(&self) -> bool {
        self.graphs_on()
    }
    fn begin_graph_step(
        &mut self,
        s: &StepInputs,
        key: npu_backend::GraphKey,
    ) -> Result<(), BackendError> {
        self.check_awake()?;
        self.graph_begin_step(s, key)
    }
    fn has_graph(&self, key: npu_backend::GraphKey) -> bool {
        self.graph_has(key)
    }
    fn capture_begin(&mut self, key: npu_backend::GraphKey) -> Result<(), BackendError> {
        self.graph_capture_begin(key)
    }
    fn capture_end(&mut self, key: npu_backend::GraphKey) -> Result<(), BackendError> {
        self.graph_capture_end(key)
    }
    fn capture_abort(&mut self) {
        self.graph_capture_abort()
    }
    fn replay_graph(&mut self, key: npu_backend::GraphKey) -> Result<(), BackendError> {
        self.graph_replay(key)
    }
    fn drop_graphs(&mut self) -> Result<(), BackendError> {
        self.graph_drop_all()
    }

    // Sleep level 1: `offload.rs`.
    fn offloads_weights(&self) -> bool {
        true
    }
    fn offload_weights(&mut self) -> Result<u64, BackendError> {
        self.op_offload_weights()
    }
    fn restore_weights(&mut self) -> Result<u64, BackendError> {
        self.op_restore_weights()
    }

    fn embed(
        &mut self,
        table: &CudaEmbedding,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_embed(table, out)
    }

    fn rms_norm(
        &mut self,
        x: View<'_, CudaBuffer>,
        w: &CudaBuffer,
        eps: f32,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_rms_norm(x, w, eps, out)
    }

    fn rms_norm_heads(
        &mut self,
        x: ViewMut<'_, CudaBuffer>,
        w: &CudaBuffer,
        eps: f32,
        head_dim: usize,
    ) -> Result<(), BackendError> {
        self.op_rms_norm_heads(x, w, eps, head_dim)
    }

    fn lora_add(
        &mut self,
        x: View<'_, CudaBuffer>,
        groups: &[npu_backend::LoraGroup<'_, CudaBuffer>],
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_lora_add(x, groups, out)
    }

    fn scale_rows(&mut self, x: ViewMut<'_, CudaBuffer>, s: f32) -> Result<(), BackendError> {
        self.op_scale_rows(x, s)
    }

    fn geglu(
        &mut self,
        gate: View<'_, CudaBuffer>,
        up: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_geglu(gate, up, out)
    }

    fn matmul(
        &mut self,
        x: View<'_, CudaBuffer>,
        w: &CudaMatrix,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_matmul(x, w, out)
    }

    fn add_bias(
        &mut self,
        x: ViewMut<'_, CudaBuffer>,
        bias: &CudaBuffer,
    ) -> Result<(), BackendError> {
        self.op_add_bias(x, bias)
    }

    fn rope(&mut self, qk: ViewMut<'_, CudaBuffer>, g: &AttnGeometry) -> Result<(), BackendError> {
        self.op_rope(qk, g)
    }

    fn kv_write(
        &mut self,
        k: View<'_, CudaBuffer>,
        v: View<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        self.op_kv_write(k, v, g, layer)
    }

    fn attention(
        &mut self,
        q: View<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_attention(q, g, layer, out)
    }

    fn attention_matmul_add(
        &mut self,
        q: View<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
        attn: ViewMut<'_, CudaBuffer>,
        m: &CudaMatrix,
        out: ViewMut<'_, CudaBuffer>,
        residual: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_attention_matmul_add(q, g, layer, attn, m, out, residual)
    }

    fn swiglu(
        &mut self,
        gate: View<'_, CudaBuffer>,
        up: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_swiglu(gate, up, out)
    }

    fn moe_route(
        &mut self,
        logits: View<'_, CudaBuffer>,
        k: usize,
        normalize: bool,
        ids: ViewMut<'_, CudaBuffer>,
        weights: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_moe_route(logits, k, normalize, ids, weights)
    }

    fn moe_route_scored(
        &mut self,
        logits: View<'_, CudaBuffer>,
        bias: Option<&CudaBuffer>,
        spec: &RouteSpec,
        ids: ViewMut<'_, CudaBuffer>,
        weights: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_moe_route_scored(logits, bias, spec, ids, weights)
    }

    fn moe_ffn(
        &mut self,
        x: View<'_, CudaBuffer>,
        ids: View<'_, CudaBuffer>,
        weights: View<'_, CudaBuffer>,
        gate_up: &[CudaMatrix],
        down: &[CudaMatrix],
        ff: usize,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_moe_ffn(x, ids, weights, gate_up, down, ff, out)
    }

    fn add(
        &mut self,
        x: ViewMut<'_, CudaBuffer>,
        y: View<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_add(x, y)
    }

    fn rope_kv_write(
        &mut self,
        qkv: ViewMut<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        self.op_rope_kv_write(qkv, g, layer)
    }

    fn norm_rope_kv_write(
        &mut self,
        qkv: ViewMut<'_, CudaBuffer>,
        q_norm: &CudaBuffer,
        k_norm: &CudaBuffer,
        eps: f32,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        self.op_norm_rope_kv_write(qkv, q_norm, k_norm, eps, g, layer)
    }

    fn add_rms_norm(
        &mut self,
        x: ViewMut<'_, CudaBuffer>,
        y: View<'_, CudaBuffer>,
        w: &CudaBuffer,
        eps: f32,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_add_rms_norm(x, y, w, eps, out)
    }

    fn folds_norms_into_matmuls(&self, rows: usize) -> bool {
        self.folds_norms(rows)
    }
    fn rms_norm_matmul(
        &mut self,
        x: View<'_, CudaBuffer>,
        w: &CudaBuffer,
        eps: f32,
        xn: ViewMut<'_, CudaBuffer>,
        m: &CudaMatrix,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_rms_norm_matmul(x, w, eps, xn, m, out)
    }
    fn rms_norm_matmul_rope_kv_write(
        &mut self,
        x: View<'_, CudaBuffer>,
        w: &CudaBuffer,
        eps: f32,
        xn: ViewMut<'_, CudaBuffer>,
        m: &CudaMatrix,
        qkv: ViewMut<'_, CudaBuffer>,
        g: &AttnGeometry,
        layer: usize,
        head_norms: Option<(&CudaBuffer, &CudaBuffer)>,
    ) -> Result<(), BackendError> {
        self.op_rms_norm_matmul_rope_kv_write(x, w, eps, xn, m, qkv, g, layer, head_norms)
    }
    fn rms_norm_matmul_swiglu(
        &mut self,
        x: View<'_, CudaBuffer>,
        w: &CudaBuffer,
        eps: f32,
        xn: ViewMut<'_, CudaBuffer>,
        m: &CudaMatrix,
        gate_up: ViewMut<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_rms_norm_matmul_swiglu(x, w, eps, xn, m, gate_up, out)
    }
    fn matmul_add(
        &mut self,
        x: View<'_, CudaBuffer>,
        m: &CudaMatrix,
        out: ViewMut<'_, CudaBuffer>,
        residual: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_matmul_add(x, m, out, residual)
    }
    fn folds_ffn(&self, rows: usize) -> bool {
        self.folds_ffn_rows(rows)
    }
    fn rms_norm_ffn(
        &mut self,
        residual: ViewMut<'_, CudaBuffer>,
        w: &CudaBuffer,
        eps: f32,
        xn: ViewMut<'_, CudaBuffer>,
        gate_up_m: &CudaMatrix,
        gate_up: ViewMut<'_, CudaBuffer>,
        h: ViewMut<'_, CudaBuffer>,
        down: &CudaMatrix,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_rms_norm_ffn(residual, w, eps, xn, gate_up_m, gate_up, h, down, out)
    }
    fn gather_logit_rows(
        &mut self,
        x: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<(), BackendError> {
        self.op_gather_logit_rows(x, out)
    }

    fn argmax_rows(
        &mut self,
        logits: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<bool, BackendError> {
        self.op_argmax_rows(logits, out)?;
        Ok(true)
    }

    fn argmax_logprob_rows(
        &mut self,
        logits: View<'_, CudaBuffer>,
        out: ViewMut<'_, CudaBuffer>,
    ) -> Result<bool, BackendError> {
        self.op_argmax_logprob_rows(logits, out)?;
        Ok(true)
    }
}

impl CudaBackend {
    /// `load_matrix` with K-quant matrices kept as `kquants` says.
    fn load_matrix_as(
        &mut self,
        parts: &[HostTensor<'_>],
        kquants: crate::config::KQuants,
    ) -> Result<Option<CudaMatrix>, BackendError> {
        // F32 matrices (a MoE router, f32 files) stay f32 under f32 activations, products in f32
        // as the CPU backend and llama.cpp compute them: a router's logits rounded through f16
        // weights can choose another expert where two are close.
        let all_f32 = parts.iter().all(|p| p.ty == npu_gguf::GgmlType::F32);
        let dense = if self.cfg.matmul == MatmulMode::Dequantized {
            Some(self.cfg.act_dtype)
        } else if all_f32 && self.cfg.act_dtype == DType::F32 {
            Some(DType::F32)
        } else {
            None
        };
        let q4k = if dense.is_none() && kquants == crate::config::KQuants::Packed {
            weights::pack_kquant(parts)?
        } else {
            None
        };
        if q4k.is_none()
            && kquants == crate::config::KQuants::Packed
            && parts.iter().any(|p| p.ty.name().ends_with("_K"))
        {
            tracing::debug!(
                "cuda: packed K-quants (NPU_SERVING_CUDA_KQUANTS=packed, the default) are Q4_K and \
                 Q6_K only, outside the dequantized matmul mode; these {} parts load as F16 or \
                 dense",
                parts[0].ty.name()
            );
        }
        let p = match q4k {
            Some(p) => p,
            None => match weights::pack_matrix(parts, dense)? {
                Some(p) => p,
                None => return Ok(None),
            },
        };
        let m = self.upload_matrix(p)?;
        if matches!(m.kind, weights::MatrixKind::Packed(f) if f != crate::kernels::WeightFormat::F16)
            || matches!(m.kind, weights::MatrixKind::Q4K | weights::MatrixKind::Q6K)
        {
            self.quantized_matrices = true;
        }
        // `Auto` dequantizes a matrix into the weight scratch for long steps: that area is
        // made here, at its largest, while the weights load, so that it is taken before the KV
        // pool is sized from the free memory and the first long prompt allocates nothing (review
        // finding 6).
        let dt = self.cfg.act_dtype;
        if let Some(bytes) = crate::matmul::dequant_scratch_bytes(self.cfg.matmul, &m, dt) {
            self.scratch_w.ensure(&self.gpu, self.device, bytes)?;
        }
        Ok(Some(m))
    }
}

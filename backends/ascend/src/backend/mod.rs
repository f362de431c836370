//! `AscendBackend`: the agent's device seam (`npu_backend::Backend`) on CANN. One context and one
//! stream per agent; every op is an aclnn two-phase call on that stream ([`crate::reuse`] reuses
//! executors of repeated shapes); activations are f16, or bf16 for a model whose hidden states
//! outgrow f16's range (chosen when the model loads: [`AscendConfig::activations`]), and the
//! weights' 16-bit forms, rotary tables and the paged KV cache take the same type; the paged KV
//! cache is per layer one key and one value tensor in the layout FusedInferAttentionScore takes; step inputs go up in one
//! host→device copy (`begin_step`) and the host waits once per step (`read_back`).
//!
//! Where each op lives: buffers, weights and embeddings in [`objects`], step inputs and the
//! attention path of a step in [`step`], the per-token ops in `layer_ops`, KV write and paged
//! attention in `attention`, the pool and its block copies in `kv_pool`, the ops of the newer
//! families (per-head norm, GELU gate, row scaling; [`Capability`]) in `family_ops`, expert
//! routing and the experts' FFN in `moe_ops`, DeepSeek's scored routing and latent attention
//! (its latent pool's writes and the attention over it) in `latent_ops`, and at DeepSeek's own
//! widths (rows of 512 + 64, FusedInferAttentionScoreV3's MLA form) in `mla_ops`; LoRA
//! adapters' products (`lora_add`) in `lora_ops`; sleep level 1 (the weights to host memory and
//! back) in `offload`.

mod attention;
mod config;
mod family_ops;
mod fused_ops;
mod graphs;
pub mod hccl;
mod kv_pool;
mod latent_ops;
mod layer_ops;
mod lora_ops;
mod mc2_ops;
mod mla_ops;
mod moe_ops;
pub mod objects;
mod offload;
mod pick_ops;
mod rope_ops;
mod staging;
pub mod step;

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::ThreadId;

use npu_backend::{
    AttnGeometry, Backend, BackendError, Capability, DType, DeviceKind, GraphKey, HostSlice,
    HostSliceMut, HostTensor, KvSpec, MemInfo, Readback, StepInputs, View, ViewMut,
};
use tracing::info;

use crate::device::{self, Device};
use crate::error::AscendError;
use crate::memory::DeviceBuffer as Mem;
use crate::ops::StepStats;
use crate::reuse::Launcher;
use crate::runtime::Acl;

pub use config::{AscendConfig, RopeKernel};
pub use kv_pool::{KvPool, INT8_KV_REFUSAL};
pub use objects::{AscendBuffer, AscendEmbedding, AscendMatrix};
use staging::Staging;
use step::StepPlan;

pub const NAME: &str = "ascend";

/// An Ascend-layer error as the seam's error.
pub fn err(e: AscendError) -> BackendError {
    match e {
        AscendError::Load(l) => BackendError::MissingLibrary {
            backend: NAME,
            message: l.to_string(),
        },
        AscendError::Unavailable {
            missing_library: true,
            message,
        } => BackendError::MissingLibrary {
            backend: NAME,
            message,
        },
        e => BackendError::Device {
            backend: NAME,
            message: e.to_string(),
        },
    }
}

/// Device scratch buffers by purpose, grown on demand (a replaced one is kept until the stream
/// is next synchronized, as queued kernels may still use it).
#[derive(Default)]
struct Scratch {
    bufs: HashMap<&'static str, Mem>,
    retired: Vec<Mem>,
}

impl Scratch {
    /// Makes `name` at least `bytes` long.
    fn ensure(
        &mut self,
        dev: &Device,
        name: &'static str,
        bytes: usize,
    ) -> Result<(), BackendError> {
        if self.bufs.get(name).is_some_and(|m| m.bytes() >= bytes) {
            return Ok(());
        }
        let grown = objects::zeroed(dev, bytes.next_power_of_two(), name)?;
        if let Some(old) = self.bufs.insert(name, grown) {
            self.retired.push(old);
        }
        Ok(())
    }

    fn get(&self, name: &'static str) -> &Mem {
        &self.bufs[name]
    }
}

/// Rotary cos/sin for positions `0..rows` of one rope (base, scaling and frequency factors, as
/// `Rope::angles` gives them): per row `dims` cosines then `dims` sines, laid out for the
/// kernel's pairing (`interleaved`: each pair's value twice in a row; else the halves repeated).
/// One table per rope the model uses, so layers with different bases (Gemma 3's local and
/// global layers) each keep theirs; `step_rows` holds the step's rows of it, gathered by
/// position once per step (`rows_for`: the step serial they were gathered for).
struct RopeTable {
    rope: npu_model::Rope,
    interleaved: bool,
    rows: usize,
    mem: Mem,
    step_rows: Option<Mem>,
    rows_for: Option<u64>,
    /// The step serial that last used this table (the least recent is replaced when full).
    used: u64,
}

/// Rope tables kept at once (a model has one or two ropes; a few more tolerate tests that mix).
const ROPE_TABLES: usize = 4;

pub struct AscendBackend {
    /// Captured decode steps (first: destroyed before anything they recorded is freed).
    graphs: graphs::Graphs,
    ops: Launcher,
    kv: Option<KvPool>,
    plan: StepPlan,
    step_mem: Option<Mem>,
    staging: Staging,
    retired_mem: Vec<Mem>,
    scratch: Scratch,
    /// `moe_ffn`'s grouped rows and index arrays.
    moe: moe_ops::MoeBufs,
    /// `attention_latent`'s query and output rows (one KV head of a whole cache row).
    latent_bufs: Option<(AscendBuffer, AscendBuffer)>,
    /// Buffers replaced while queued work may still use them (freed at synchronization).
    retired_bufs: Vec<AscendBuffer>,
    rope_tables: Vec<RopeTable>,
    /// The prompt branch's 2048×2048 causal mask (made on first use).
    mask: Option<Mem>,
    /// Sliding windows met so far: `begin_step` packs their key masks into the step's upload.
    windows: Vec<u32>,
    /// Key masks of windows first met during this step, uploaded on their own.
    step_masks: Vec<(u32, Mem)>,
    /// The step serial, logits buffer and view whose greedy picks are in scratch "argmax".
    picked: Option<(u64, usize, npu_backend::Layout)>,
    serial: u64,
    last_stats: StepStats,
    /// Work queued since the last synchronization.
    pending: bool,
    bound: Option<ThreadId>,
    cfg: AscendConfig,
    /// The activations' type (f16 or bf16), fixed before a model's weights load.
    act: DType,
    emulated: bool,
    /// Every weight allocation loaded, for sleep level 1 (`offload`).
    weights: offload::WeightList,
    /// Last: every allocation above is freed before the context goes.
    dev: Arc<Device>,
}

impl AscendBackend {
    /// Loads CANN from the environment (`ASCEND_HOME_PATH`, `set_env.sh`'s variables, default
    /// install paths), checks its version and opens the agent's device.
    pub fn new(cfg: AscendConfig) -> Result<Self, BackendError> {
        let acl = Acl::from_env().map_err(err)?;
        Self::with_runtime(acl, cfg)
    }

    pub fn with_runtime(acl: &'static Acl, cfg: AscendConfig) -> Result<Self, BackendError> {
        let act = match cfg.activations {
            None | Some(DType::F16) => DType::F16,
            Some(DType::BF16) => DType::BF16,
            Some(other) => {
                return Err(BackendError::BadArgument {
                    op: "ascend settings",
                    message: format!("activations in {}: expected f16 or bf16", other.name()),
                })
            }
        };
        let id = device::select_device(acl, cfg.start_device_id, cfg.agent_index).map_err(err)?;
        let dev = Arc::new(Device::open(acl, id).map_err(err)?);
        let ops = Launcher::new(&dev, cfg.reuse_executors);
        let emulated = acl
            .api
            .root
            .as_ref()
            .is_some_and(|r| r.join("EMULATION.txt").is_file());
        info!(
            target: "npu_serving::acl",
            "ascend: device {id} (physical {}), CANN {}{}, executor reuse {}",
            device::physical_device(id),
            acl.version,
            if emulated { " (emulation)" } else { "" },
            if ops.reusing() { "on" } else { "off" }
        );
        Ok(Self {
            graphs: Default::default(),
            ops,
            kv: None,
            plan: StepPlan::default(),
            step_mem: None,
            staging: Staging::default(),
            retired_mem: Vec::new(),
            scratch: Scratch::default(),
            moe: Default::default(),
            latent_bufs: None,
            retired_bufs: Vec::new(),
            rope_tables: Vec::new(),
            mask: None,
            windows: Vec::new(),
            step_masks: Vec::new(),
            picked: None,
            serial: 0,
            last_stats: StepStats::default(),
            pending: false,
            bound: Some(std::thread::current().id()),
            cfg,
            act,
            emulated,
            weights: Default::default(),
            dev,
        })
    }

    /// The aclnn element type of the activations (and of the weights' 16-bit forms, the rotary
    /// tables and the KV cache).
    pub(crate) fn act_t(&self) -> crate::tensor::DType {
        objects::acl_dtype(self.act)
    }

    /// aclnn calls of the last finished step (counted from one `begin_step` to the next).
    pub fn last_step_stats(&self) -> StepStats {
        self.last_stats
    }

    /// aclnn calls since the current step began.
    pub fn step_stats(&self) -> StepStats {
        self.ops.stats()
    }

    /// Rotary cos/sin tables held: one per rope met (base, scaling, factors), at most 4.
    pub fn rope_tables(&self) -> usize {
        self.rope_tables.len()
    }

    /// Executors kept for reuse.
    pub fn cached_executors(&self) -> usize {
        self.ops.cached()
    }

    /// Pinned staging buffers allocated so far (`aclrtMallocHost`; a small pool is reused).
    pub fn pinned_allocations(&self) -> u64 {
        self.staging.allocations()
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Makes this agent's context current on the calling thread (once per thread).
    fn bind(&mut self) -> Result<(), BackendError> {
        let me = std::thread::current().id();
        if self.bound != Some(me) {
            self.dev.bind().map_err(err)?;
            self.bound = Some(me);
        }
        Ok(())
    }

    fn sync(&mut self) -> Result<(), BackendError> {
        self.bind()?;
        // Graphs that may read what this synchronization frees go after it.
        let stale = self.graphs_before_free();
        self.dev.synchronize().map_err(err)?;
        drop(stale);
        self.ops.synchronized();
        self.scratch.retired.clear();
        self.retired_mem.clear();
        self.retired_bufs.clear();
        self.staging.synchronized();
        self.pending = false;
        Ok(())
    }

    fn kv(&self) -> Result<&KvPool, BackendError> {
        self.kv
            .as_ref()
            .ok_or_else(|| BackendError::BadStep("the KV pool is not initialised".into()))
    }
}

fn check_len(op: &'static str, want: usize, got: usize) -> Result<(), BackendError> {
    if want != got {
        return Err(BackendError::BadArgument {
            op,
            message: format!("{got} host values for a {want}-element view"),
        });
    }
    Ok(())
}

/// Host values as bytes of `dtype`.
fn to_device_bytes(src: HostSlice<'_>, dtype: DType) -> Result<Vec<u8>, BackendError> {
    Ok(match (src, dtype) {
        (HostSlice::F32(v), DType::F32) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (HostSlice::F32(v), DType::F16) => {
            objects::f16_bytes(v.iter().map(|&x| half::f16::from_f32(x)))
        }
        (HostSlice::F32(v), DType::BF16) => v
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
        (HostSlice::I32(v), DType::I32) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (s, d) => {
            return Err(BackendError::BadArgument {
                op: "upload",
                message: format!(
                    "{} host values into a {} buffer",
                    match s {
                        HostSlice::F32(_) => "f32",
                        HostSlice::I32(_) => "i32",
                    },
                    d.name()
                ),
            })
        }
    })
}

impl Backend for AscendBackend {
    type Buffer = AscendBuffer;
    type Matrix = AscendMatrix;
    type Embedding = AscendEmbedding;

    fn kind(&self) -> DeviceKind {
        DeviceKind::Ascend
    }

    fn describe(&self) -> String {
        format!(
            "ascend (device {} = physical {}, CANN {}{})",
            self.dev.id,
            device::physical_device(self.dev.id),
            self.dev.acl.version,
            if self.emulated {
                ", an emulation of the documented API, not an NPU"
            } else {
                ""
            }
        )
    }

    fn act_dtype(&self) -> DType {
        self.act
    }

    /// With [`AscendConfig::activations`] unset: bf16 for a model whose hidden states outgrow
    /// f16's range (the 910B computes bf16 natively; every operator the backend calls lists
    /// BFLOAT16 beside FLOAT16 for the A2 series), else f16. Called before the model's weights
    /// load, as they are stored in this type.
    fn choose_activations(&mut self, wide: bool) {
        if self.cfg.activations.is_none() {
            let act = if wide { DType::BF16 } else { DType::F16 };
            if act != self.act {
                self.act = act;
                // Rotary tables are kept in the activations' type.
                self.rope_tables.clear();
            }
        }
    }

    /// Every capability, where the release has the operators: per-head norm (RmsNorm over a
    /// heads view), row scaling (InplaceMuls), the GELU gate (GeluV2 with the tanh
    /// approximation, then InplaceMul), sliding windows (FusedInferAttentionScoreV2's band mode,
    /// or key masks in its incremental branch), rope frequency factors and per-layer rope bases
    /// (host cos/sin tables per rope), mixture-of-experts layers (MoeGatingTopKSoftmaxV2, then
    /// MoeInitRoutingV2 and MoeFinalizeRoutingV2 around grouped expert matmuls; `moe_ops`),
    /// DeepSeek's scored routing (MoeGatingTopK) and latent attention (ScatterNdUpdate and
    /// FusedInferAttentionScoreV2 over a latent pool; `latent_ops`).
    fn supports(&self, c: Capability) -> bool {
        let api = &self.dev.acl.api.ops;
        match c {
            Capability::HeadNorm
            | Capability::SlidingWindow
            | Capability::RopeFactors
            | Capability::PerLayerRope => true,
            Capability::ScaleRows => api.aclnnInplaceMulsGetWorkspaceSize.is_some(),
            Capability::GeluGate => {
                api.aclnnGeluV2GetWorkspaceSize.is_some()
                    && api.aclnnInplaceMulGetWorkspaceSize.is_some()
            }
            Capability::Moe => {
                api.aclnnMoeGatingTopKSoftmaxV2GetWorkspaceSize.is_some()
                    && api.aclnnMoeInitRoutingV2GetWorkspaceSize.is_some()
                    && api.aclnnMoeFinalizeRoutingV2GetWorkspaceSize.is_some()
            }
            // MoeGatingTopK (softmax with groups or a bias only from CANN 8.5; `latent_ops`).
            Capability::ScoredRouting => api.aclnnMoeGatingTopKGetWorkspaceSize.is_some(),
            // The latent pool's rows through ScatterNdUpdate and FusedInferAttentionScoreV2 (rows
            // of 512 + 64 through V3's MLA form where the release has it; `mla_ops`).
            Capability::LatentAttention => true,
            // lora_ops: Matmul, Matmul and InplaceAdd per adapter group.
            Capability::Lora => true,
            // Not built on CANN yet: `moe_tensor_parallel: whole_experts` is refused by name at
            // load (share_each_expert serves MoE groups).
            Capability::HeldExperts => false,
        }
    }

    /// aclnn launches and first phases since the backend was made (no graph is captured yet).
    fn op_counts(&self) -> Option<npu_backend::OpCounts> {
        let (first_phases, launches) = self.ops.runner.totals();
        Some(npu_backend::OpCounts {
            launches,
            first_phases,
            graph_replays: self.graphs.replays(),
        })
    }

    fn matrix_bytes(&self, m: &AscendMatrix) -> Option<u64> {
        Some(match &m.form {
            objects::MatrixForm::Quant {
                scale,
                offset,
                int4,
                ..
            } => {
                // The weight's own bytes (an expert of a stack shares the allocation).
                let w = if *int4 { m.n * m.k / 2 } else { m.n * m.k };
                (w + scale.bytes() + offset.as_ref().map_or(0, |o| o.bytes())) as u64
            }
            objects::MatrixForm::Half { .. } => (m.n * m.k * 2) as u64,
        })
    }

    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        let (free, total) = self.dev.mem_info().map_err(err)?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn alloc(&mut self, dtype: DType, len: usize) -> Result<AscendBuffer, BackendError> {
        self.bind()?;
        AscendBuffer::new(&self.dev, dtype, len)
    }

    fn upload(
        &mut self,
        src: HostSlice<'_>,
        mut dst: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        let l = dst.layout();
        check_len("upload", l.elements(), src.len())?;
        let bytes = to_device_bytes(src, dst.dtype())?;
        if bytes.is_empty() {
            return Ok(());
        }
        // A synchronous copy is not ordered with the stream: let queued work finish first.
        if self.pending {
            self.sync()?;
        }
        self.bind()?;
        let es = dst.dtype().size();
        dst.buf_mut().half = None;
        let whole = l.is_contiguous()
            && l.offset() == 0
            && l.elements() == npu_backend::DeviceBuffer::len(dst.buf());
        self.upload_half_copy(dst.buf_mut(), src, whole)?;
        let mem = &mut dst.buf_mut().mem;
        if l.is_contiguous() {
            mem.upload(l.offset() * es, &bytes).map_err(err)?;
        } else {
            let row = l.cols() * es;
            for (r, chunk) in bytes.chunks_exact(row).enumerate() {
                mem.upload((l.offset() + r * l.stride()) * es, chunk)
                    .map_err(err)?;
            }
        }
        Ok(())
    }

    fn read_back(&mut self, reads: &mut [Readback<'_, AscendBuffer>]) -> Result<(), BackendError> {
        self.sync()?;
        for rd in reads.iter_mut() {
            let l = rd.src.layout();
            check_len("read_back", l.elements(), rd.dst.len())?;
            if l.elements() == 0 {
                continue;
            }
            let dt = rd.src.dtype();
            let es = dt.size();
            let mut raw = vec![0u8; (l.end() - l.offset()) * es];
            rd.src
                .buf()
                .mem
                .download(l.offset() * es, &mut raw)
                .map_err(err)?;
            let rows = (0..l.rows()).map(|r| &raw[r * l.stride() * es..][..l.cols() * es]);
            match (&mut rd.dst, dt) {
                (HostSliceMut::F32(out), DType::F32) => {
                    for (o, c) in out.iter_mut().zip(rows.flat_map(|r| r.chunks_exact(4))) {
                        *o = f32::from_le_bytes(c.try_into().expect("4 bytes"));
                    }
                }
                (HostSliceMut::F32(out), DType::F16) => {
                    for (o, c) in out.iter_mut().zip(rows.flat_map(|r| r.chunks_exact(2))) {
                        *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
                (HostSliceMut::F32(out), DType::BF16) => {
                    for (o, c) in out.iter_mut().zip(rows.flat_map(|r| r.chunks_exact(2))) {
                        *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
                (HostSliceMut::I32(out), DType::I32) => {
                    for (o, c) in out.iter_mut().zip(rows.flat_map(|r| r.chunks_exact(4))) {
                        *o = i32::from_le_bytes(c.try_into().expect("4 bytes"));
                    }
                }
                (_, dt) => {
                    return Err(BackendError::BadArgument {
                        op: "read_back",
                        message: format!("a {} buffer into host memory of another type", dt.name()),
                    })
                }
            }
        }
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.sync()
    }

    fn load_matrix(
        &mut self,
        parts: &[HostTensor<'_>],
    ) -> Result<Option<AscendMatrix>, BackendError> {
        self.bind()?;
        let m = AscendMatrix::load(&self.dev, parts, self.act)?;
        if let Some(m) = &m {
            self.weights.matrix(m);
        }
        Ok(m)
    }

    /// One allocation per projection (`moe_ops::stack`) where GroupedMatmulV4 can take the
    /// experts as its single 3-D weight: f16 activations, the operator present, 1 to 1024
    /// experts. Otherwise each expert apart.
    fn load_experts(
        &mut self,
        experts: &[Vec<HostTensor<'_>>],
    ) -> Result<Option<Vec<AscendMatrix>>, BackendError> {
        self.bind()?;
        let api = self.dev.acl.api.ops;
        let grouped = api.aclnnGroupedMatmulV4GetWorkspaceSize.is_some()
            && api.aclnnGroupedMatmulV4.is_some();
        if self.act == DType::F16
            && grouped
            && (1..=moe_ops::GMM_MAX_GROUPS).contains(&experts.len())
        {
            let stack = AscendMatrix::load_stack(&self.dev, experts)?;
            stack.iter().for_each(|m| self.weights.matrix(m));
            return Ok(Some(stack));
        }
        let mut out = Vec::with_capacity(experts.len());
        for parts in experts {
            match AscendMatrix::load(&self.dev, parts, self.act)? {
                Some(m) => out.push(m),
                None => return Ok(None),
            }
        }
        out.iter().for_each(|m| self.weights.matrix(m));
        Ok(Some(out))
    }

    fn load_embedding(&mut self, table: HostTensor<'_>) -> Result<AscendEmbedding, BackendError> {
        self.bind()?;
        let e = AscendEmbedding::load(&self.dev, &table, self.act)?;
        self.weights.embedding(&e);
        Ok(e)
    }

    fn load_vector(&mut self, v: HostTensor<'_>) -> Result<AscendBuffer, BackendError> {
        self.bind()?;
        // f32 values, with a copy in the activations' type that the ops over activations take:
        // RmsNorm's gamma (f32 gamma with 16-bit x is documented only from CANN 8.5) and biases
        // added in place.
        let vals = objects::dequantize(&v)?;
        let f32s: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
        let halfs = objects::half_bytes(self.act, &vals);
        let mem = objects::upload_new(&self.dev, &f32s, "a vector")?;
        let half = objects::upload_new(&self.dev, &halfs, "a vector")?;
        let b = AscendBuffer::from_mem(&self.dev, mem, DType::F32, vals.len(), Some(half));
        self.weights.vector(&b);
        Ok(b)
    }

    fn set_kv_dtype(&mut self, dtype: npu_backend::KvDtype) -> Result<(), BackendError> {
        kv_pool::check_kv_dtype(dtype)
    }

    fn init_kv(&mut self, spec: KvSpec) -> Result<(), BackendError> {
        self.bind()?;
        self.drop_all_graphs()?;
        self.kv = Some(KvPool::new(&self.dev, spec)?);
        Ok(())
    }

    fn init_latent_kv(&mut self, spec: KvSpec) -> Result<(), BackendError> {
        self.bind()?;
        self.drop_all_graphs()?;
        // The old pool goes first, so that its memory counts as free for the new one.
        self.kv = None;
        self.kv = Some(KvPool::new_latent(&self.dev, spec)?);
        Ok(())
    }

    fn kv_write_latent(
        &mut self,
        latent: View<'_, AscendBuffer>,
        rope: View<'_, AscendBuffer>,
        layer: usize,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_kv_write_latent(latent, rope, layer)
    }

    fn attention_latent(
        &mut self,
        q_latent: View<'_, AscendBuffer>,
        q_rope: View<'_, AscendBuffer>,
        g: &AttnGeometry,
        latent_dim: usize,
        layer: usize,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_attention_latent(q_latent, q_rope, g, latent_dim, layer, out)
    }

    fn moe_route_scored(
        &mut self,
        logits: View<'_, AscendBuffer>,
        bias: Option<&AscendBuffer>,
        spec: &npu_backend::RouteSpec,
        ids: ViewMut<'_, AscendBuffer>,
        weights: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_moe_route_scored(logits, bias, spec, ids, weights)
    }

    fn kv_block_bytes(&self) -> usize {
        self.kv.as_ref().map_or(0, |k| k.block_bytes())
    }

    fn kv_copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), BackendError> {
        self.bind()?;
        self.picked = None;
        let dev = self.dev.clone();
        let kv = self
            .kv
            .as_mut()
            .ok_or_else(|| BackendError::BadStep("the KV pool is not initialised".into()))?;
        kv.copy_blocks(&dev, pairs)?;
        self.pending |= !pairs.is_empty();
        Ok(())
    }

    fn kv_blocks_to_host(&mut self, blocks: &[u32], dst: &mut [u8]) -> Result<(), BackendError> {
        self.kv_to_host(blocks, dst)
    }

    fn kv_blocks_from_host(&mut self, src: &[u8], blocks: &[u32]) -> Result<(), BackendError> {
        self.picked = None;
        self.kv_from_host(src, blocks)
    }

    fn begin_step(&mut self, step: &StepInputs) -> Result<(), BackendError> {
        self.check_awake()?;
        self.bind()?;
        let mut plan = match &self.kv {
            // The MLA form takes S = 1 entries only (`mla_ops`).
            Some(kv) if kv.mla.is_some() => {
                StepPlan::token_wise(step, kv.spec.num_blocks, kv.spec.block_size)?
            }
            Some(kv) => StepPlan::new(step, kv.spec.num_blocks, kv.spec.block_size)?,
            None => StepPlan::without_kv(step)?,
        };
        plan.pack_window_masks(&self.windows);
        let old_masks = std::mem::take(&mut self.step_masks);
        self.retired_mem
            .extend(old_masks.into_iter().map(|(_, m)| m));
        let bytes = plan.bytes();
        self.eager_step_mem();
        if self
            .step_mem
            .as_ref()
            .is_none_or(|m| m.bytes() < bytes.len())
        {
            let fresh = objects::zeroed(&self.dev, bytes.len().next_power_of_two(), "step inputs")?;
            if let Some(old) = self.step_mem.replace(fresh) {
                self.retired_mem.push(old);
            }
        }
        self.upload_step(plan, &bytes)
    }

    fn step_graphs(&self) -> bool {
        self.graphs_available()
    }

    fn begin_graph_step(&mut self, step: &StepInputs, key: GraphKey) -> Result<(), BackendError> {
        self.check_awake()?;
        self.begin_graph_step_inner(step, key)
    }

    fn has_graph(&self, key: GraphKey) -> bool {
        self.has_graph_inner(key)
    }

    fn capture_begin(&mut self, key: GraphKey) -> Result<(), BackendError> {
        self.capture_begin_inner(key)
    }

    fn capture_end(&mut self, key: GraphKey) -> Result<(), BackendError> {
        self.capture_end_inner(key)
    }

    fn capture_abort(&mut self) {
        self.capture_abort_inner()
    }

    fn replay_graph(&mut self, key: GraphKey) -> Result<(), BackendError> {
        self.replay_graph_inner(key)
    }

    fn drop_graphs(&mut self) -> Result<(), BackendError> {
        self.drop_all_graphs()
    }

    // Sleep level 1: `offload`.
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
        table: &AscendEmbedding,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_embed(table, out)
    }

    fn rms_norm(
        &mut self,
        x: View<'_, AscendBuffer>,
        w: &AscendBuffer,
        eps: f32,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_rms_norm(x, w, eps, out)
    }

    fn rms_norm_heads(
        &mut self,
        x: ViewMut<'_, AscendBuffer>,
        w: &AscendBuffer,
        eps: f32,
        head_dim: usize,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_rms_norm_heads(x, w, eps, head_dim)
    }

    fn scale_rows(&mut self, x: ViewMut<'_, AscendBuffer>, s: f32) -> Result<(), BackendError> {
        self.picked = None;
        self.op_scale_rows(x, s)
    }

    fn geglu(
        &mut self,
        gate: View<'_, AscendBuffer>,
        up: View<'_, AscendBuffer>,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_geglu(gate, up, out)
    }

    fn matmul(
        &mut self,
        x: View<'_, AscendBuffer>,
        w: &AscendMatrix,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_matmul(x, w, out)
    }

    fn add_bias(
        &mut self,
        x: ViewMut<'_, AscendBuffer>,
        bias: &AscendBuffer,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_add_bias(x, bias)
    }

    fn rope(
        &mut self,
        qk: ViewMut<'_, AscendBuffer>,
        g: &AttnGeometry,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_rope(qk, g)
    }

    fn kv_write(
        &mut self,
        k: View<'_, AscendBuffer>,
        v: View<'_, AscendBuffer>,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_kv_write(k, v, g, layer)
    }

    fn attention(
        &mut self,
        q: View<'_, AscendBuffer>,
        g: &AttnGeometry,
        layer: usize,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_attention(q, g, layer, out)
    }

    fn swiglu(
        &mut self,
        gate: View<'_, AscendBuffer>,
        up: View<'_, AscendBuffer>,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_swiglu(gate, up, out)
    }

    fn moe_route(
        &mut self,
        logits: View<'_, AscendBuffer>,
        k: usize,
        normalize: bool,
        ids: ViewMut<'_, AscendBuffer>,
        weights: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_moe_route(logits, k, normalize, ids, weights)
    }

    fn moe_ffn(
        &mut self,
        x: View<'_, AscendBuffer>,
        ids: View<'_, AscendBuffer>,
        weights: View<'_, AscendBuffer>,
        gate_up: &[AscendMatrix],
        down: &[AscendMatrix],
        ff: usize,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_moe_ffn(x, ids, weights, gate_up, down, ff, out)
    }

    fn add(
        &mut self,
        x: ViewMut<'_, AscendBuffer>,
        y: View<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_add(x, y)
    }

    fn lora_add(
        &mut self,
        x: View<'_, AscendBuffer>,
        groups: &[npu_backend::LoraGroup<'_, AscendBuffer>],
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_lora_add(x, groups, out)
    }

    fn add_rms_norm(
        &mut self,
        x: ViewMut<'_, AscendBuffer>,
        y: View<'_, AscendBuffer>,
        w: &AscendBuffer,
        eps: f32,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_add_rms_norm(x, y, w, eps, out)
    }

    fn gather_logit_rows(
        &mut self,
        x: View<'_, AscendBuffer>,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<(), BackendError> {
        self.picked = None;
        self.op_gather_rows(x, out)
    }

    fn argmax_rows(
        &mut self,
        logits: View<'_, AscendBuffer>,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<bool, BackendError> {
        self.op_argmax(logits, out)?;
        Ok(true)
    }

    /// The log-probability of `argmax_rows`' pick in each row, into an f32 buffer (the device
    /// half of a greedy step: only ids and log-probabilities are read back).
    fn argmax_logprob_rows(
        &mut self,
        logits: View<'_, AscendBuffer>,
        out: ViewMut<'_, AscendBuffer>,
    ) -> Result<bool, BackendError> {
        self.op_argmax_logprob(logits, out)?;
        Ok(true)
    }
}

impl Drop for AscendBackend {
    fn drop(&mut self) {
        // Queued work may still use buffers about to be freed.
        if self.pending {
            let _ = self.sync();
        }
    }
}

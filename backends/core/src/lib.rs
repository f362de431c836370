//! npu-backend: the device seam. One narrow, device-shaped `Backend` trait that every device
//! (`cpu`, `cuda`, `ascend`) implements, and the plain data that crosses it: element types,
//! typed buffers and checked strided views (`view`), weights as the model file stores them, the
//! paged KV pool's shape, one step's inputs, and the errors.
//!
//! The contract, for whoever writes a backend:
//! - Ops are stream-ordered: they may run asynchronously, in call order. The host waits only in
//!   `read_back` (once per step: the sampled ids or the logit rows), `kv_blocks_to_host` and
//!   `synchronize`.
//! - Step inputs (tokens, positions, slot mapping, block tables, logit rows) reach the device in
//!   `begin_step`, in one host→device copy where the device has separate memory; the ops read
//!   them from there.
//! - Weights arrive as the file stores them (`HostTensor`: GGUF type, bytes, shape); each
//!   backend picks its own format (repack, dequantize, upload).
//! - Views are checked against their buffers when made (`View::new`), so an op may trust them;
//!   an op still refuses a view of the wrong shape or dtype with `BackendError`.
//! - The KV pool holds `num_blocks` blocks; block ids index it for every layer. Blocks move by id
//!   between device blocks, and between device blocks and host memory the caller owns.

pub mod collective;
pub mod host;
pub mod moe;
pub mod step;
pub mod view;

use thiserror::Error;

pub use collective::{Collective, HostCollective, HostStaged};
pub use host::{HostSlice, HostSliceMut, HostTensor, MemInfo, Readback};
pub use step::{
    AttnGeometry, GraphKey, KvDtype, KvSpec, LoraGroup, OpCounts, RouteSpec, SeqSpan, StepInputs,
};
pub use view::{DeviceBuffer, Layout, View, ViewMut};

/// Element types of device buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// Indices (token ids, positions, slots, block ids).
    I32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            Self::F32 | Self::I32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::I32 => "i32",
        }
    }
}

/// The kinds of device an agent can run on, and the cargo feature that builds each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Cpu,
    Cuda,
    Ascend,
}

impl DeviceKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Ascend => "ascend",
        }
    }
    /// The cargo feature of the `npu-serving` package that compiles this backend in (`None`:
    /// always built).
    pub fn cargo_feature(self) -> Option<&'static str> {
        match self {
            Self::Cpu => None,
            Self::Cuda => Some("cuda"),
            Self::Ascend => Some("ascend"),
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "cpu" => Self::Cpu,
            "cuda" | "gpu" => Self::Cuda,
            "ascend" | "npu" => Self::Ascend,
            _ => return None,
        })
    }
}

#[derive(Debug, Error)]
pub enum BackendError {
    #[error(
        "this build has no {device} backend: rebuild with `cargo build --release --features {feature}`"
    )]
    NotBuilt {
        device: &'static str,
        feature: &'static str,
    },
    #[error("{backend}: a library it needs is missing: {message}")]
    MissingLibrary {
        backend: &'static str,
        message: String,
    },
    #[error("{backend}: out of memory allocating {what} ({bytes} bytes)")]
    OutOfMemory {
        backend: &'static str,
        what: String,
        bytes: usize,
    },
    #[error("{backend} does not support {what}")]
    Unsupported { backend: &'static str, what: String },
    #[error("bad view: {0}")]
    BadView(String),
    #[error("{op}: {message}")]
    BadArgument { op: &'static str, message: String },
    #[error("invalid step metadata: {0}")]
    BadStep(String),
    #[error("{backend} device error: {message}")]
    Device {
        backend: &'static str,
        message: String,
    },
}

/// What a backend may have beyond the Llama step. A new op joins the trait with a default that
/// refuses it, and a backend reports here what it has built; a model that needs a capability its
/// backend lacks is refused at load, naming the family, the capability and the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Capability {
    /// `rms_norm_heads`: each head of Q and K RMS-normalised with its own weights (Qwen3,
    /// Gemma 3).
    HeadNorm,
    /// `geglu`: the GELU(tanh)-gated feed-forward activation (Gemma).
    GeluGate,
    /// `scale_rows`: rows multiplied by a constant (Gemma's embedding scale).
    ScaleRows,
    /// `attention` with `AttnGeometry::window` set (Gemma 3's local layers).
    SlidingWindow,
    /// `rope` with per-pair frequency factors (`Rope::factors`, Llama 3).
    RopeFactors,
    /// `rope` whose base differs from layer to layer in one step (Gemma 3).
    PerLayerRope,
    /// `moe_route`, `gather_rows` and `scatter_add_rows`: a mixture-of-experts FFN (Qwen3-MoE).
    Moe,
    /// `moe_route_scored`: sigmoid gating, a selection bias, group-limited choice and a routed
    /// scaling factor (DeepSeek-V3).
    ScoredRouting,
    /// `init_latent_kv`, `kv_write_latent` and `attention_latent`: multi-head latent attention
    /// over a cache of latents (DeepSeek).
    LatentAttention,
    /// `moe_ffn_held`: the routed experts' FFN over a range of whole experts, the slots routed
    /// to other experts skipped (a tensor-parallel group that splits whole experts).
    HeldExperts,
    /// `lora_add`: low-rank adapters (LoRA) added to a projection's output, a different adapter
    /// per group of rows in one step.
    Lora,
}

impl Capability {
    pub fn name(self) -> &'static str {
        match self {
            Self::HeadNorm => "per-head Q/K RMS norm",
            Self::GeluGate => "GELU-gated FFN",
            Self::ScaleRows => "row scaling",
            Self::SlidingWindow => "sliding-window attention",
            Self::RopeFactors => "rope frequency factors",
            Self::PerLayerRope => "per-layer rope bases",
            Self::Moe => "mixture-of-experts routing",
            Self::ScoredRouting => "scored expert routing (sigmoid, bias, groups)",
            Self::LatentAttention => "latent attention (a KV cache of latents)",
            Self::HeldExperts => "a range of whole experts (moe_ffn_held)",
            Self::Lora => "LoRA adapters",
        }
    }
}

/// A compute device: buffers, weights, the paged KV pool and the kernels of a Llama step.
pub trait Backend: Send {
    /// A typed device allocation.
    type Buffer: DeviceBuffer;
    /// A weight matrix in the device's chosen format.
    type Matrix: Send + Sync;
    /// An embedding table (rows looked up by token id).
    type Embedding: Send + Sync;

    /// `cpu`, `cuda` or `ascend`.
    fn kind(&self) -> DeviceKind;
    /// A short description for logs (device, instruction set or architecture, threads).
    fn describe(&self) -> String;
    /// The dtype this backend computes activations in (the model allocates its buffers so).
    fn act_dtype(&self) -> DType;
    /// Called once when a model loads, before its weights: `wide` when its hidden states outgrow
    /// f16's range (Gemma 3). A backend that chooses its activation type per model (Ascend: bf16
    /// then, else f16) does so here; by default the type stays as configured.
    fn choose_activations(&mut self, wide: bool) {
        let _ = wide;
    }
    fn mem_info(&self) -> Result<MemInfo, BackendError>;
    /// Whether this backend has `c` (see [`Capability`]); none by default.
    fn supports(&self, c: Capability) -> bool {
        let _ = c;
        false
    }
    /// What this backend has queued since it was made (`None`: it does not count).
    fn op_counts(&self) -> Option<OpCounts> {
        None
    }
    /// Bytes of `m` as stored on the device (what one pass over it reads), where the backend
    /// says.
    fn matrix_bytes(&self, m: &Self::Matrix) -> Option<u64> {
        let _ = m;
        None
    }

    // --- memory ---------------------------------------------------------------------------
    /// A zeroed buffer of `len` elements.
    fn alloc(&mut self, dtype: DType, len: usize) -> Result<Self::Buffer, BackendError>;
    /// Writes `src` into `dst`'s window, row by row (`src.len() == dst.layout().elements()`),
    /// converting f32 to the buffer's float dtype. `src` may be reused when this returns.
    fn upload(
        &mut self,
        src: HostSlice<'_>,
        dst: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError>;
    /// Waits for every queued op, then fills each read's host memory. The one host sync of a step.
    fn read_back(&mut self, reads: &mut [Readback<'_, Self::Buffer>]) -> Result<(), BackendError>;
    /// Waits for every queued op.
    fn synchronize(&mut self) -> Result<(), BackendError>;

    // --- weights --------------------------------------------------------------------------
    /// A weight matrix whose output rows are `parts` stacked in order (all with the same
    /// `cols`). `Ok(None)` when the parts cannot share one matrix (the caller loads them apart).
    fn load_matrix(
        &mut self,
        parts: &[HostTensor<'_>],
    ) -> Result<Option<Self::Matrix>, BackendError>;
    /// One projection of a mixture-of-experts layer: `experts[e]` the parts of expert `e`, as
    /// `load_matrix` takes them (every expert the same shape). A backend that multiplies every
    /// expert in one grouped call stores them side by side (Ascend); by default each is loaded
    /// apart. `Ok(None)` when an expert's parts cannot share one matrix.
    fn load_experts(
        &mut self,
        experts: &[Vec<HostTensor<'_>>],
    ) -> Result<Option<Vec<Self::Matrix>>, BackendError> {
        let mut out = Vec::with_capacity(experts.len());
        for parts in experts {
            match self.load_matrix(parts)? {
                Some(m) => out.push(m),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    }
    fn load_embedding(&mut self, table: HostTensor<'_>) -> Result<Self::Embedding, BackendError>;
    /// A vector (norm weight, bias) as a buffer of the backend's choosing.
    fn load_vector(&mut self, v: HostTensor<'_>) -> Result<Self::Buffer, BackendError>;

    // --- the paged KV pool ----------------------------------------------------------------
    /// Allocates the pool (zeroed). Called once, before any step.
    fn init_kv(&mut self, spec: KvSpec) -> Result<(), BackendError>;
    /// Bytes one block occupies (K and V of every layer): the unit of the host copies below.
    fn kv_block_bytes(&self) -> usize;
    /// Bytes one block of a pool of `spec` would take, before `init_kv` (to size a pool from
    /// free memory). f16 by default; a backend storing another dtype (`set_kv_dtype`) overrides
    /// this, scales included.
    fn kv_block_bytes_for(&self, spec: &KvSpec) -> usize {
        spec.f16_block_bytes()
    }
    /// Chooses what the pool stores, before `init_kv` (or `kv_block_bytes_for`). Every backend
    /// stores f16; one that stores another dtype overrides this (and `kv_block_bytes_for`).
    fn set_kv_dtype(&mut self, dtype: KvDtype) -> Result<(), BackendError> {
        match dtype {
            KvDtype::F16 => Ok(()),
            other => Err(BackendError::Unsupported {
                backend: self.kind().name(),
                what: format!(
                    "kv_cache_dtype {} (the int8 KV cache is built on the CPU and CUDA backends \
                     only)",
                    other.name()
                ),
            }),
        }
    }
    /// What the pool stores (`set_kv_dtype`).
    fn kv_dtype(&self) -> KvDtype {
        KvDtype::F16
    }
    /// Copies whole blocks device→device, `(src, dst)` pairs, stream-ordered.
    fn kv_copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), BackendError>;
    /// Copies `blocks` to host memory, `kv_block_bytes()` each, in order (waits for queued ops).
    fn kv_blocks_to_host(&mut self, blocks: &[u32], dst: &mut [u8]) -> Result<(), BackendError>;
    /// Copies host memory (as written by `kv_blocks_to_host`) into `blocks`; `src` may be reused
    /// when this returns.
    fn kv_blocks_from_host(&mut self, src: &[u8], blocks: &[u32]) -> Result<(), BackendError>;

    /// Copies one layer of one block to host rows: `k` and `v` get `block_size` rows of
    /// `n_kv_heads * head_dim` values (token by token, heads in order) as f32. Waits for queued
    /// ops. Long-context mode reads the blocks leaving its local window so. Only the CPU
    /// backend has it today: the others answer `Unsupported` (and long-context mode is refused
    /// on their devices at start).
    fn kv_layer_block_to_host(
        &mut self,
        layer: usize,
        block: u32,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), BackendError> {
        let _ = (layer, block, k, v);
        Err(BackendError::Unsupported {
            backend: self.kind().name(),
            what: "per-layer KV block copies (long-context mode)".into(),
        })
    }
    /// Writes host rows (shaped as `kv_layer_block_to_host` gives them) into one layer of one
    /// block, converting to the cache's dtype; the slices may be reused when this returns.
    fn kv_layer_block_from_host(
        &mut self,
        layer: usize,
        block: u32,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), BackendError> {
        let _ = (layer, block, k, v);
        Err(BackendError::Unsupported {
            backend: self.kind().name(),
            what: "per-layer KV block copies (long-context mode)".into(),
        })
    }

    // --- one step -------------------------------------------------------------------------
    /// Takes the step's inputs to the device; the ops below read them.
    fn begin_step(&mut self, step: &StepInputs) -> Result<(), BackendError>;

    // --- decode steps as graphs (`step_graphs`) ---------------------------------------------
    // The caller's sequence for a decode-only step shaped as `key` (`key.rows` sequences of one
    // token each, every token's logits wanted, block tables `key.max_blocks` wide):
    // `begin_graph_step`, then `replay_graph` when `has_graph(key)`; else the step's ops run
    // eagerly once (warming workspaces and executors, the step's answer), then `capture_begin`,
    // the same ops again (recorded, not run), `capture_end`. The read back stays outside.
    // Ops between `capture_begin` and `capture_end` must not synchronize, allocate or read back;
    // one that would fails, and the caller calls `capture_abort` and runs the step eagerly
    // (`begin_step`). A backend keeps everything a graph reads at fixed addresses while it
    // lives, and drops its graphs itself when one of those moves (the KV pool reallocated).

    /// Whether this backend captures decode steps as graphs (the methods below; none by
    /// default, and they refuse).
    fn step_graphs(&self) -> bool {
        false
    }
    /// `begin_step` for a step run, captured or replayed as `key`: the inputs go to the fixed
    /// addresses `key`'s graph reads, in a form that bakes no per-step host value into the
    /// recorded ops (sequence lengths as device data, not first-phase arguments). The ops
    /// after it run eagerly until `capture_begin`.
    fn begin_graph_step(&mut self, step: &StepInputs, key: GraphKey) -> Result<(), BackendError> {
        let _ = (step, key);
        Err(self.graphs_unsupported())
    }
    /// Whether a graph of `key` was captured (and not dropped since).
    fn has_graph(&self, key: GraphKey) -> bool {
        let _ = key;
        false
    }
    /// Starts recording the ops queued from here for `key` (after `begin_graph_step(_, key)`).
    fn capture_begin(&mut self, key: GraphKey) -> Result<(), BackendError> {
        let _ = key;
        Err(self.graphs_unsupported())
    }
    /// Ends the recording: `key`'s graph (none of the recorded work has run).
    fn capture_end(&mut self, key: GraphKey) -> Result<(), BackendError> {
        let _ = key;
        Err(self.graphs_unsupported())
    }
    /// Ends an open recording, if any, and discards it (after an op failed inside it).
    fn capture_abort(&mut self) {}
    /// Queues one run of `key`'s graph (after `begin_graph_step(_, key)`).
    fn replay_graph(&mut self, key: GraphKey) -> Result<(), BackendError> {
        let _ = key;
        Err(self.graphs_unsupported())
    }
    /// Drops every captured graph (waits for queued replays first).
    fn drop_graphs(&mut self) -> Result<(), BackendError> {
        Ok(())
    }
    /// The refusal of the graph methods by a backend without them.
    fn graphs_unsupported(&self) -> BackendError {
        BackendError::Unsupported {
            backend: self.kind().name(),
            what: "decode steps captured as graphs".into(),
        }
    }
    // --- sleep level 1: weights to host memory -------------------------------------------
    // `offload_weights` then `restore_weights`, with no step between (a step while the weights
    // are in host memory is refused by `begin_step`, naming the sleep). The KV pool is the
    // model's to release (`init_kv` with fewer blocks); these move the weights only.

    /// Whether this backend moves its weights to host memory and back (the two methods below;
    /// none by default, and they refuse).
    fn offloads_weights(&self) -> bool {
        false
    }
    /// Copies every weight this backend loaded (`load_matrix`, `load_experts`,
    /// `load_embedding`, `load_vector`, and what it derived from them) to host memory and frees
    /// its device memory; captured graphs and anything else naming their addresses are dropped.
    /// Returns the device bytes released (the host memory now holding them). Nothing is freed
    /// when it fails.
    fn offload_weights(&mut self) -> Result<u64, BackendError> {
        Err(self.offload_unsupported())
    }
    /// Allocates the offloaded weights' device memory again and copies them back; the handles
    /// the model holds stay valid. Returns the device bytes allocated. On failure the weights
    /// stay in host memory (what was allocated is freed again).
    fn restore_weights(&mut self) -> Result<u64, BackendError> {
        Err(self.offload_unsupported())
    }
    /// The refusal of the offload methods by a backend without them.
    fn offload_unsupported(&self) -> BackendError {
        BackendError::Unsupported {
            backend: self.kind().name(),
            what: "moving weights to host memory (sleep level 1)".into(),
        }
    }

    /// `out` row i = embedding row of the step's token i.
    fn embed(
        &mut self,
        table: &Self::Embedding,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError>;
    /// Each row of `x` RMS-normalised, times `w`, into the same row of `out`.
    fn rms_norm(
        &mut self,
        x: View<'_, Self::Buffer>,
        w: &Self::Buffer,
        eps: f32,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError>;
    /// Each `head_dim` slice of each row of `x` RMS-normalised and times `w` (`head_dim`
    /// weights), in place ([`Capability::HeadNorm`]).
    fn rms_norm_heads(
        &mut self,
        x: ViewMut<'_, Self::Buffer>,
        w: &Self::Buffer,
        eps: f32,
        head_dim: usize,
    ) -> Result<(), BackendError> {
        let _ = (x, w, eps, head_dim);
        Err(self.unsupported(Capability::HeadNorm))
    }
    /// `x *= s`, element-wise ([`Capability::ScaleRows`]).
    fn scale_rows(&mut self, x: ViewMut<'_, Self::Buffer>, s: f32) -> Result<(), BackendError> {
        let _ = (x, s);
        Err(self.unsupported(Capability::ScaleRows))
    }
    /// `out = gelu_tanh(gate) * up`, element-wise ([`Capability::GeluGate`]).
    fn geglu(
        &mut self,
        gate: View<'_, Self::Buffer>,
        up: View<'_, Self::Buffer>,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let _ = (gate, up, out);
        Err(self.unsupported(Capability::GeluGate))
    }
    /// Mixture-of-experts routing ([`Capability::Moe`]): for each row of `logits` (a token's
    /// router logits, one column per expert), the softmax over the experts, then the `k` most
    /// probable experts in descending order (ties: the lower index first) into `ids` (i32, rows
    /// of `k`) and their probabilities into `weights` (f32, rows of `k`), divided by their sum
    /// when `normalize`.
    fn moe_route(
        &mut self,
        logits: View<'_, Self::Buffer>,
        k: usize,
        normalize: bool,
        ids: ViewMut<'_, Self::Buffer>,
        weights: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let _ = (logits, k, normalize, ids, weights);
        Err(self.unsupported(Capability::Moe))
    }
    /// The routed experts' SwiGLU FFN ([`Capability::Moe`]): `out[r] = sum_j weights[r][j] *
    /// down[e](silu(gate_e(x[r])) * up_e(x[r]))` with `e = ids[r][j]`, the terms added in `j`
    /// order; `gate_up[e]` holds expert e's gate rows then its up rows (`2 * ff` outputs).
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn(
        &mut self,
        x: View<'_, Self::Buffer>,
        ids: View<'_, Self::Buffer>,
        weights: View<'_, Self::Buffer>,
        gate_up: &[Self::Matrix],
        down: &[Self::Matrix],
        ff: usize,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let _ = (x, ids, weights, gate_up, down, ff, out);
        Err(self.unsupported(Capability::Moe))
    }
    /// `moe_ffn` over the routed experts `held` of the router's `n_experts`
    /// ([`Capability::HeldExperts`]): `gate_up[i]` and `down[i]` are expert `held.start + i`; a
    /// slot routed to an expert outside `held` adds nothing (another rank of a tensor-parallel
    /// group holds it). The held slots' terms are added in `j` order; a row with none is zero.
    /// An id outside `0..n_experts` is refused.
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn_held(
        &mut self,
        x: View<'_, Self::Buffer>,
        ids: View<'_, Self::Buffer>,
        weights: View<'_, Self::Buffer>,
        gate_up: &[Self::Matrix],
        down: &[Self::Matrix],
        held: std::ops::Range<usize>,
        n_experts: usize,
        ff: usize,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let _ = (x, ids, weights, gate_up, down, held, n_experts, ff, out);
        Err(self.unsupported(Capability::HeldExperts))
    }
    /// Expert routing with DeepSeek's choices ([`Capability::ScoredRouting`]): for each row of
    /// `logits`, the scores (`spec.gating`), the scores plus `bias` (one value per expert, f32)
    /// to choose by, limited to the best groups when `spec.groups` is set; the `k` best experts
    /// by biased score in descending order (ties: the lower index) into `ids`, and their
    /// unbiased scores, normalised and scaled as `spec` says, into `weights` (f32).
    fn moe_route_scored(
        &mut self,
        logits: View<'_, Self::Buffer>,
        bias: Option<&Self::Buffer>,
        spec: &RouteSpec,
        ids: ViewMut<'_, Self::Buffer>,
        weights: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let _ = (logits, bias, spec, ids, weights);
        Err(self.unsupported(Capability::ScoredRouting))
    }
    /// Allocates a latent KV pool ([`Capability::LatentAttention`]): each block holds, for every
    /// layer, `block_size` rows of `head_dim` values (`n_kv_heads` must be 1): a token's latent
    /// then its rotated key. Instead of `init_kv`.
    fn init_latent_kv(&mut self, spec: KvSpec) -> Result<(), BackendError> {
        let _ = spec;
        Err(self.unsupported(Capability::LatentAttention))
    }
    /// Bytes one block of a latent pool of `spec` would take (f16 rows, no separate values).
    fn latent_kv_block_bytes_for(&self, spec: &KvSpec) -> usize {
        spec.f16_block_bytes() / 2
    }
    /// Writes each new token's cache row, `latent` then `rope` (its rotated key), into
    /// `layer`'s latent cache at the step's slot mapping ([`Capability::LatentAttention`]).
    fn kv_write_latent(
        &mut self,
        latent: View<'_, Self::Buffer>,
        rope: View<'_, Self::Buffer>,
        layer: usize,
    ) -> Result<(), BackendError> {
        let _ = (latent, rope, layer);
        Err(self.unsupported(Capability::LatentAttention))
    }
    /// Causal paged attention over `layer`'s latent cache ([`Capability::LatentAttention`]):
    /// head h's score against a cached row is `(q_latent[h] . latent + q_rope[h] . rope) *
    /// g.scale`, and its output the softmax-weighted sum of the latents. `q_latent` and `out`
    /// rows hold `g.n_heads` heads of `latent_dim` values, `q_rope` rows `g.n_heads` heads of
    /// `g.head_dim - latent_dim` (the rotated part).
    fn attention_latent(
        &mut self,
        q_latent: View<'_, Self::Buffer>,
        q_rope: View<'_, Self::Buffer>,
        g: &AttnGeometry,
        latent_dim: usize,
        layer: usize,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let _ = (q_latent, q_rope, g, latent_dim, layer, out);
        Err(self.unsupported(Capability::LatentAttention))
    }
    /// `out[r] += g.scale * B_g (A_g x[r])` for the rows `r` of each group `g` (row ranges that
    /// do not overlap; rows in no group are left as they are) ([`Capability::Lora`]). `x` has
    /// the projection's input count of columns, `out` its output count.
    fn lora_add(
        &mut self,
        x: View<'_, Self::Buffer>,
        groups: &[LoraGroup<'_, Self::Buffer>],
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let _ = (x, groups, out);
        Err(self.unsupported(Capability::Lora))
    }
    /// The refusal of an op this backend has not built.
    fn unsupported(&self, c: Capability) -> BackendError {
        BackendError::Unsupported {
            backend: self.kind().name(),
            what: c.name().into(),
        }
    }
    /// `out[r][n] = x[r] . w[n]`: `x` has the matrix's input count of columns, `out` its output
    /// count.
    fn matmul(
        &mut self,
        x: View<'_, Self::Buffer>,
        w: &Self::Matrix,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError>;
    /// `x[r] += bias` for every row.
    fn add_bias(
        &mut self,
        x: ViewMut<'_, Self::Buffer>,
        bias: &Self::Buffer,
    ) -> Result<(), BackendError>;
    /// Rotary embedding at the step's positions, in place: `qk` rows hold `n_heads` query heads
    /// then `n_kv_heads` key heads.
    fn rope(&mut self, qk: ViewMut<'_, Self::Buffer>, g: &AttnGeometry)
        -> Result<(), BackendError>;
    /// `rope` on the query and key heads of `qkv` (rows of `n_heads` query heads, `n_kv_heads`
    /// key heads, then `n_kv_heads` value heads), then `kv_write` of its keys and values into
    /// `layer`'s cache: the two ops (which this does by default), which a backend may do in one
    /// pass with the same results.
    fn rope_kv_write(
        &mut self,
        mut qkv: ViewMut<'_, Self::Buffer>,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        let (qw, kvw) = (g.q_width(), g.kv_width());
        self.rope(qkv.col_range(0, qw + kvw)?, g)?;
        let v = qkv.as_view();
        self.kv_write(v.col_range(qw, kvw)?, v.col_range(qw + kvw, kvw)?, g, layer)
    }
    /// Each query head of `qkv` RMS-normalised by `q_norm` and each key head by `k_norm`
    /// (`rms_norm_heads`, Qwen3's and Gemma 3's per-head norms), then `rope_kv_write`: the three
    /// ops (which this does by default), which a backend may do in one pass with the same
    /// results.
    fn norm_rope_kv_write(
        &mut self,
        mut qkv: ViewMut<'_, Self::Buffer>,
        q_norm: &Self::Buffer,
        k_norm: &Self::Buffer,
        eps: f32,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError> {
        let (qw, kvw) = (g.q_width(), g.kv_width());
        self.rms_norm_heads(qkv.col_range(0, qw)?, q_norm, eps, g.head_dim)?;
        self.rms_norm_heads(qkv.col_range(qw, kvw)?, k_norm, eps, g.head_dim)?;
        self.rope_kv_write(qkv, g, layer)
    }
    /// Writes each new token's K and V rows into `layer`'s cache at the step's slot mapping.
    fn kv_write(
        &mut self,
        k: View<'_, Self::Buffer>,
        v: View<'_, Self::Buffer>,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError>;
    /// Causal paged attention of the step's queries over `layer`'s cache through the block
    /// tables (history and this step's tokens, grouped-query heads); `out` rows get
    /// `n_heads * head_dim` values.
    fn attention(
        &mut self,
        q: View<'_, Self::Buffer>,
        g: &AttnGeometry,
        layer: usize,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError>;
    /// `attention` of `q` into `attn`, then `matmul_add` of `attn` by `m` into `out` and
    /// `residual` (which this does by default). A backend may run the three in one pass; its
    /// product may then add its terms in another fixed order (the same bits every run, not bit
    /// for bit the parts').
    #[allow(clippy::too_many_arguments)]
    fn attention_matmul_add(
        &mut self,
        q: View<'_, Self::Buffer>,
        g: &AttnGeometry,
        layer: usize,
        mut attn: ViewMut<'_, Self::Buffer>,
        m: &Self::Matrix,
        out: ViewMut<'_, Self::Buffer>,
        residual: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let cols = attn.layout().cols();
        self.attention(q, g, layer, attn.col_range(0, cols)?)?;
        self.matmul_add(attn.as_view(), m, out, residual)
    }
    /// `out = silu(gate) * up`, element-wise.
    fn swiglu(
        &mut self,
        gate: View<'_, Self::Buffer>,
        up: View<'_, Self::Buffer>,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError>;
    /// `x += y`, element-wise (the residual adds).
    fn add(
        &mut self,
        x: ViewMut<'_, Self::Buffer>,
        y: View<'_, Self::Buffer>,
    ) -> Result<(), BackendError>;
    /// `x += y`, then each row of `x` RMS-normalised, times `w`, into the same row of `out`: a
    /// residual add and the next norm (`add` then `rms_norm`, which this does by default; a
    /// backend may do both in one pass, with the same results).
    fn add_rms_norm(
        &mut self,
        mut x: ViewMut<'_, Self::Buffer>,
        y: View<'_, Self::Buffer>,
        w: &Self::Buffer,
        eps: f32,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let cols = x.layout().cols();
        self.add(x.col_range(0, cols)?, y)?;
        self.rms_norm(x.as_view(), w, eps, out)
    }
    /// Whether a step of `rows` token rows should hand this backend its RMS norms, residual adds
    /// and SwiGLU together with the matrix products beside them (`rms_norm_matmul`,
    /// `rms_norm_matmul_swiglu`, `matmul_add`) instead of `add_rms_norm` after each residual
    /// add: `true` where the backend folds them into fewer launches with the same results. The
    /// default, `false`, keeps the model's plain sequence of ops.
    fn folds_norms_into_matmuls(&self, rows: usize) -> bool {
        let _ = rows;
        false
    }
    /// `x` RMS-normalised by `w` into `xn`, then `out = xn . m`: `rms_norm` then `matmul` (which
    /// this does by default); a backend may do both in one pass with the same results. `xn`
    /// holds the normalised rows afterwards either way.
    fn rms_norm_matmul(
        &mut self,
        x: View<'_, Self::Buffer>,
        w: &Self::Buffer,
        eps: f32,
        mut xn: ViewMut<'_, Self::Buffer>,
        m: &Self::Matrix,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let cols = xn.layout().cols();
        self.rms_norm(x, w, eps, xn.col_range(0, cols)?)?;
        self.matmul(xn.as_view(), m, out)
    }
    /// `rms_norm_matmul` into `qkv` (rows of the query, key and value heads), then
    /// `rope_kv_write` of it into `layer`'s cache, or with `head_norms` (query, key)
    /// `norm_rope_kv_write` by the same `eps` (which this does by default; a backend may do it
    /// in one pass with the same results).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul_rope_kv_write(
        &mut self,
        x: View<'_, Self::Buffer>,
        w: &Self::Buffer,
        eps: f32,
        xn: ViewMut<'_, Self::Buffer>,
        m: &Self::Matrix,
        mut qkv: ViewMut<'_, Self::Buffer>,
        g: &AttnGeometry,
        layer: usize,
        head_norms: Option<(&Self::Buffer, &Self::Buffer)>,
    ) -> Result<(), BackendError> {
        let cols = qkv.layout().cols();
        self.rms_norm_matmul(x, w, eps, xn, m, qkv.col_range(0, cols)?)?;
        match head_norms {
            Some((qn, kn)) => self.norm_rope_kv_write(qkv, qn, kn, eps, g, layer),
            None => self.rope_kv_write(qkv, g, layer),
        }
    }
    /// `rms_norm_matmul` into `gate_up` (the gate's columns, then as many of the up's), then
    /// `swiglu` of its two halves into `out` (which this does by default; a backend may do it
    /// in one pass with the same results, `gate_up` and `xn` written either way).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul_swiglu(
        &mut self,
        x: View<'_, Self::Buffer>,
        w: &Self::Buffer,
        eps: f32,
        xn: ViewMut<'_, Self::Buffer>,
        m: &Self::Matrix,
        mut gate_up: ViewMut<'_, Self::Buffer>,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let cols = gate_up.layout().cols();
        if cols % 2 != 0 {
            return Err(BackendError::BadArgument {
                op: "rms_norm_matmul_swiglu",
                message: format!("gate/up rows of {cols} values (not two halves)"),
            });
        }
        self.rms_norm_matmul(x, w, eps, xn, m, gate_up.col_range(0, cols)?)?;
        let gu = gate_up.as_view();
        self.swiglu(
            gu.col_range(0, cols / 2)?,
            gu.col_range(cols / 2, cols / 2)?,
            out,
        )
    }
    /// `out = x . m`, then `residual += out` (`matmul` then `add`, which this does by default; a
    /// backend may add in the product's pass, with the same results).
    fn matmul_add(
        &mut self,
        x: View<'_, Self::Buffer>,
        m: &Self::Matrix,
        mut out: ViewMut<'_, Self::Buffer>,
        residual: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let cols = out.layout().cols();
        self.matmul(x, m, out.col_range(0, cols)?)?;
        self.add(residual, out.as_view())
    }
    /// Whether `rms_norm_ffn` takes fewer launches than its parts for a step of `rows` token rows
    /// (the default: no; the model then hands the parts over one by one).
    fn folds_ffn(&self, rows: usize) -> bool {
        let _ = rows;
        false
    }
    /// A dense SwiGLU feed-forward block and its residual add: `rms_norm_matmul_swiglu` of
    /// `residual` by `w` (into `xn`, `gate_up` and `h`), then `matmul_add` of `h` by `down` into
    /// `out` and `residual` (which this does by default). A backend may run it in one pass; its
    /// down product may then add its terms in another fixed order (the same bits every run, not
    /// bit for bit the parts').
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_ffn(
        &mut self,
        residual: ViewMut<'_, Self::Buffer>,
        w: &Self::Buffer,
        eps: f32,
        xn: ViewMut<'_, Self::Buffer>,
        gate_up_m: &Self::Matrix,
        gate_up: ViewMut<'_, Self::Buffer>,
        mut h: ViewMut<'_, Self::Buffer>,
        down: &Self::Matrix,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError> {
        let cols = h.layout().cols();
        let x = residual.as_view();
        self.rms_norm_matmul_swiglu(x, w, eps, xn, gate_up_m, gate_up, h.col_range(0, cols)?)?;
        self.matmul_add(h.as_view(), down, out, residual)
    }
    /// `out` row i = `x` row `logit_rows[i]` of the step.
    fn gather_logit_rows(
        &mut self,
        x: View<'_, Self::Buffer>,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<(), BackendError>;
    /// `out[r]` = index of the largest value of `logits` row r (the first on ties), into an i32
    /// buffer. NaN counts as -inf and +inf as `f32::MAX` (as the sampler sees them); a row with
    /// nothing finite gives 0. `Ok(false)` when the backend has no device argmax (the caller
    /// reads logits back).
    fn argmax_rows(
        &mut self,
        logits: View<'_, Self::Buffer>,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<bool, BackendError>;
    /// `out[r]` = the log-probability of `argmax_rows`' pick in row r, into an f32 buffer:
    /// `-ln(sum_i exp(x_i - max))` over the row's values read as `argmax_rows` reads them (a row
    /// with nothing finite is uniform: `-ln(cols)`). With `argmax_rows` it makes a greedy step's
    /// answer on the device, so only ids and log-probabilities are read back. `Ok(false)` when
    /// the backend has no such op (the default; the caller then reads logits back).
    fn argmax_logprob_rows(
        &mut self,
        logits: View<'_, Self::Buffer>,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<bool, BackendError> {
        let _ = (logits, out);
        Ok(false)
    }
    /// `argmax_logprob_rows` into `logprobs`, then `argmax_rows` into `ids`, of the same logits
    /// (a backend may share the scans: the maximum is the pick's logit). `Ok(false)` when either
    /// is not available (the caller then reads logits back).
    fn argmax_and_logprob_rows(
        &mut self,
        logits: View<'_, Self::Buffer>,
        ids: ViewMut<'_, Self::Buffer>,
        logprobs: ViewMut<'_, Self::Buffer>,
    ) -> Result<bool, BackendError> {
        Ok(self.argmax_logprob_rows(logits, logprobs)? && self.argmax_rows(logits, ids)?)
    }
}

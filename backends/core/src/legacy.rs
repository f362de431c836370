//! The first, CPU-shaped Backend trait (kept while the model moves to `crate::Backend`): the narrow set of device operations one batched Llama step needs — buffers
//! and copies, weight upload, and the kernels (embedding lookup, RMS norm, matmul, RoPE, paged KV
//! write, paged attention, SwiGLU, residual add). Step metadata (tokens, positions, slot mapping,
//! block tables) is uploaded once per step by `begin_step` and the kernels read it from there.
//! Shaped for aclnn (PagedAttention with an int32 block table and per-sequence KV lengths,
//! ReshapeAndCache with a slot mapping) and for NVRTC-compiled CUDA kernels alike.

use thiserror::Error;

use npu_gguf::hparams::Rope;
use npu_gguf::GgmlType;

#[derive(Debug, Error)]
pub enum BackendError {
    #[error("{backend}: out of memory allocating {what} ({bytes} bytes)")]
    OutOfMemory {
        backend: &'static str,
        what: String,
        bytes: usize,
    },
    #[error("{backend} does not support {what}")]
    Unsupported { backend: &'static str, what: String },
    #[error("invalid step metadata: {0}")]
    BadStep(String),
    #[error("{backend} device error: {message}")]
    Device {
        backend: &'static str,
        message: String,
    },
}

/// One weight tensor (or several stacked row-wise) as the file stores it.
#[derive(Debug, Clone, Copy)]
pub struct TensorPart<'a> {
    pub ty: GgmlType,
    pub data: &'a [u8],
    pub rows: usize,
}

/// The shape of the paged KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSpec {
    pub n_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// One sequence's part of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqMeta {
    /// First row of this sequence's new tokens in the step's token rows.
    pub q_row: u32,
    /// Number of new tokens.
    pub n_q: u32,
    /// Tokens already in the KV cache (position of the first new token).
    pub start_pos: u32,
}

/// Host-side description of one step; `begin_step` uploads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepMeta {
    /// New tokens of all sequences, concatenated.
    pub tokens: Vec<u32>,
    /// Position of each new token.
    pub positions: Vec<u32>,
    /// KV cache slot of each new token.
    pub slot_mapping: Vec<u32>,
    pub seqs: Vec<SeqMeta>,
    /// `seqs.len()` rows of `max_blocks` block ids (padded with 0).
    pub block_tables: Vec<u32>,
    pub max_blocks: usize,
    /// Token rows whose logits are wanted (the last new token of each sampling sequence).
    pub logit_rows: Vec<u32>,
}

/// Model-wide attention geometry the kernels need.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnGeometry {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope: Rope,
    pub scale: f32,
}

/// A compute device. Buffers are row-major f32 matrices of a given number of columns.
pub trait Backend: Send {
    /// A device buffer of f32 activations.
    type Buf: Send;
    /// A weight matrix in the device's preferred layout.
    type Matrix: Send + Sync;
    /// An embedding table (row lookup by token id).
    type Embedding: Send + Sync;

    fn name(&self) -> &'static str;
    /// A short description for logs (device, instruction set, threads).
    fn describe(&self) -> String;

    fn alloc(&mut self, len: usize) -> Result<Self::Buf, BackendError>;
    fn upload(&mut self, dst: &mut Self::Buf, src: &[f32]) -> Result<(), BackendError>;
    fn download(&mut self, src: &Self::Buf, dst: &mut [f32]) -> Result<(), BackendError>;

    /// Uploads a weight matrix with `k` inputs whose rows are the parts stacked in order.
    /// Returns `Ok(None)` when the parts cannot share one layout (the caller keeps them apart).
    fn load_matrix(
        &mut self,
        parts: &[TensorPart],
        k: usize,
    ) -> Result<Option<Self::Matrix>, BackendError>;
    fn load_embedding(
        &mut self,
        table: TensorPart,
        dim: usize,
    ) -> Result<Self::Embedding, BackendError>;
    /// Allocates the paged KV pool (zeroed).
    fn init_kv(&mut self, spec: KvSpec) -> Result<(), BackendError>;

    /// Uploads the step's metadata; the kernels below refer to it.
    fn begin_step(&mut self, meta: &StepMeta) -> Result<(), BackendError>;

    /// `out` rows = embedding rows of the step's tokens.
    fn embed(&mut self, table: &Self::Embedding, out: &mut Self::Buf) -> Result<(), BackendError>;
    /// RMS-normalises `rows` rows of `x` (row length `w.len()`), times `w`.
    fn rms_norm(
        &mut self,
        x: &Self::Buf,
        w: &Self::Buf,
        dim: usize,
        eps: f32,
        rows: usize,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;
    /// `out[r][col0 + n] = x[r] . w[n]` for `rows` rows (`x` rows have the matrix's `k` values,
    /// `out` rows are `ldo` apart).
    fn matmul(
        &mut self,
        x: &Self::Buf,
        rows: usize,
        w: &Self::Matrix,
        out: &mut Self::Buf,
        col0: usize,
        ldo: usize,
    ) -> Result<(), BackendError>;
    /// `x[r][col0 + i] += bias[i]` for `rows` rows `ld` apart.
    fn add_bias(
        &mut self,
        x: &mut Self::Buf,
        bias: &Self::Buf,
        rows: usize,
        col0: usize,
        ld: usize,
    ) -> Result<(), BackendError>;
    /// Applies RoPE at the step's positions to the query and key heads at the start of each
    /// `qkv` row (`n_heads` query heads then `n_kv_heads` key heads).
    fn rope(
        &mut self,
        qkv: &mut Self::Buf,
        ld: usize,
        g: &AttnGeometry,
    ) -> Result<(), BackendError>;
    /// Writes each new token's K and V (from `qkv` rows, after the query heads) into the cache
    /// of `layer` at the step's slot mapping.
    fn kv_write(
        &mut self,
        qkv: &Self::Buf,
        ld: usize,
        g: &AttnGeometry,
        layer: usize,
    ) -> Result<(), BackendError>;
    /// Paged attention of the step's queries (first `n_heads * head_dim` columns of `qkv` rows)
    /// over the cache of `layer` through the block tables; `out` rows get `n_heads * head_dim`.
    fn attention(
        &mut self,
        qkv: &Self::Buf,
        ld: usize,
        g: &AttnGeometry,
        layer: usize,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;
    /// `out[r] = silu(gate_up[r][..ff]) * gate_up[r][ff..]` for `rows` rows.
    fn swiglu(
        &mut self,
        gate_up: &Self::Buf,
        ff: usize,
        rows: usize,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;
    /// `x[..len] += y[..len]`.
    fn add_assign(
        &mut self,
        x: &mut Self::Buf,
        y: &Self::Buf,
        len: usize,
    ) -> Result<(), BackendError>;
    /// `out[i] = x[step.logit_rows[i]]` (rows of `dim` values).
    fn gather_logit_rows(
        &mut self,
        x: &Self::Buf,
        dim: usize,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;
}

//! The plain data of a step that crosses the device seam: the paged KV pool's shape and
//! element type ([`KvSpec`], [`KvDtype`]), routing and attention geometry ([`RouteSpec`],
//! [`AttnGeometry`]), one step's inputs ([`StepInputs`], [`SeqSpan`]), LoRA groups
//! ([`LoraGroup`]), the work a backend counts ([`OpCounts`]) and a captured step's shape
//! ([`GraphKey`]).

use npu_model::{Gating, Rope};

/// The shape of the paged KV pool: `num_blocks` blocks of `block_size` token slots, each slot
/// holding K and V (`n_kv_heads * head_dim` values each) for every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSpec {
    pub n_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvSpec {
    /// Bytes of one block stored as f16 (K and V of every layer), saturating on overflow.
    pub fn f16_block_bytes(&self) -> usize {
        [
            self.n_layers,
            2,
            self.block_size,
            self.n_kv_heads,
            self.head_dim,
            2,
        ]
        .into_iter()
        .fold(1usize, usize::saturating_mul)
    }

    /// Bytes of one block stored as int8 (`KvDtype::Int8`), saturating: one byte a value, and
    /// one f16 scale per token, KV head, K or V, and layer. Every backend with an int8 pool
    /// sizes its blocks so (the CPU's and CUDA's block bytes are the same layout).
    pub fn int8_block_bytes(&self) -> usize {
        let scales = [self.n_layers, 2, self.block_size, self.n_kv_heads, 2]
            .into_iter()
            .fold(1usize, usize::saturating_mul);
        (self.f16_block_bytes() / 2).saturating_add(scales)
    }

    /// Bytes of one block of a pool storing `dtype` (scales included), saturating.
    pub fn block_bytes(&self, dtype: KvDtype) -> usize {
        match dtype {
            KvDtype::F16 => self.f16_block_bytes(),
            KvDtype::Int8 => self.int8_block_bytes(),
        }
    }
}

/// What the paged KV pool stores: f16 values (every backend), or int8 values with one f16 scale
/// per token, KV head and K or V row (`npu_serving.kv_cache_dtype: int8`; the CPU and CUDA
/// backends).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvDtype {
    #[default]
    F16,
    Int8,
}

impl KvDtype {
    pub fn name(self) -> &'static str {
        match self {
            Self::F16 => "f16",
            Self::Int8 => "int8",
        }
    }
}

/// How `moe_route_scored` chooses experts and weighs them (llama.cpp's `build_moe_ffn`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteSpec {
    /// Experts chosen per token.
    pub k: usize,
    /// Scores: the softmax over the experts, or each expert's sigmoid.
    pub gating: Gating,
    /// The chosen scores are divided by their sum (at least 2^-14, f16's smallest normal).
    pub normalize: bool,
    /// The weights are then multiplied by this (1: not).
    pub scale: f32,
    /// Group-limited choice: (groups, groups used); each group scored by the sum of its two
    /// best biased scores, experts chosen from the best groups only.
    pub groups: Option<(usize, usize)>,
}

/// Model-wide attention geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnGeometry {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope: Rope,
    /// Softmax scale (1 / sqrt(head_dim) for Llama).
    pub scale: f32,
    /// Sliding-window attention: a query at position p sees positions `p - window + 1 ..= p`
    /// (Gemma 3's local layers; `None`: every earlier position). Only backends that report
    /// [`Capability::SlidingWindow`](crate::Capability::SlidingWindow) take a window; the others refuse it.
    pub window: Option<u32>,
}

impl AttnGeometry {
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// One sequence's part of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan {
    /// First row of this sequence's new tokens in the step's token rows.
    pub q_row: u32,
    /// Number of new tokens.
    pub n_q: u32,
    /// Tokens already in the KV cache (position of the first new token).
    pub start_pos: u32,
}

/// The inputs of one step, host side; `begin_step` takes them to the device. The agent checks a
/// step once, at the shared-memory boundary, before it becomes a `StepInputs`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepInputs {
    /// New tokens of all sequences, concatenated.
    pub tokens: Vec<u32>,
    /// Position of each new token.
    pub positions: Vec<u32>,
    /// KV slot of each new token (block id * block_size + offset in the block).
    pub slot_mapping: Vec<u32>,
    pub seqs: Vec<SeqSpan>,
    /// `seqs.len()` rows of `max_blocks` block ids (unused entries 0).
    pub block_tables: Vec<u32>,
    pub max_blocks: usize,
    /// Token rows whose logits are wanted (the last new token of each sampling sequence).
    pub logit_rows: Vec<u32>,
}

/// One adapter's rows of a step for [`Backend::lora_add`](crate::Backend::lora_add): rows `row..row + n` of the input
/// and output views get `out += scale * B (A x)`.
#[derive(Debug)]
pub struct LoraGroup<'a, Buf> {
    pub row: usize,
    pub n: usize,
    /// `rank` rows of the projection's input count (f32): the adapter's A.
    pub a: &'a Buf,
    /// `rank` rows of the projection's output count (f32): the adapter's B transposed (row k is
    /// column k of B).
    pub b_t: &'a Buf,
    pub rank: usize,
    pub scale: f32,
}

impl<Buf> Clone for LoraGroup<'_, Buf> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<Buf> Copy for LoraGroup<'_, Buf> {}

/// Work a backend has queued on its device since it was made, counted by the backend where it
/// queues it (so the same on a device as on an emulation of it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounts {
    /// Kernel launches: CUDA kernels (a cuBLAS GEMM call counted as one), Ascend aclnn
    /// operators' second phases (reused executors included).
    pub launches: u64,
    /// Ascend: aclnn first phases (`…GetWorkspaceSize`); 0 where there is no such phase.
    pub first_phases: u64,
    /// Replays of captured graphs (`replay_graph`).
    pub graph_replays: u64,
}

/// The shape a captured decode step is recorded for ([`Backend::step_graphs`](crate::Backend::step_graphs)): `rows`
/// sequences of one new token each (the batch padded up to its bucket by the caller), block
/// tables `max_blocks` wide, and whether the graph ends in the greedy pick on the device
/// (`argmax_and_logprob_rows`) or in the logit rows. One graph per key; a replay reads the
/// step inputs `begin_graph_step` placed for the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphKey {
    pub rows: usize,
    pub max_blocks: usize,
    pub picks: bool,
}

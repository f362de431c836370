//! The batched forward step: the new tokens of many sequences (prefill chunks and decode tokens
//! alike) go through every layer together; each layer writes its new K/V by slot mapping and reads
//! history through the block tables; only the rows that need logits reach the output head. Every
//! op is handed checked views of the model's buffers; the step ends with one read back: the
//! logits, or, for an all-greedy step on a backend that picks on the device, the token ids and
//! their log-probabilities.
//!
//! On a rank of a tensor-parallel group (`Model::load_shard`) the same step runs on the rank's
//! shard: the embedding rows are read on the host, the attention output and FFN down
//! projections are followed by an all-reduce of their partial sums, and each rank's logits (its
//! vocabulary rows) are gathered into rank 0's host memory, where they are sampled.

use npu_backend::{
    AttnGeometry, Backend, Collective, DType, HostSlice, HostSliceMut, KvDtype, KvSpec, Readback,
    StepInputs, View, ViewMut,
};
use npu_gguf::GgufFile;
use npu_model::shard::RankShard;
use npu_model::Checkpoint;

mod ffn;
mod graph;
pub use graph::default_buckets as default_step_buckets;
mod tp;

use super::lora::{LoraSlots, Target};
use super::mla::{self, MlaBuffers, MlaStep};
use super::weights::{Attn, Embedding, Proj, Weights};
use super::{ModelConfig, ModelError};
use crate::long_context::LongContext;
pub(super) use ffn::project;
use ffn::{ffn, residual_add};
use tp::{local_triples, Tp};

/// Capacities fixed when the model is loaded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelOptions {
    /// Most new tokens in one step.
    pub max_tokens: usize,
    /// Most sequences that want logits in one step.
    pub max_logit_rows: usize,
    /// KV pool blocks; with `kv_memory_fraction`, the most it may have (once loaded: the blocks
    /// it has).
    pub num_blocks: usize,
    pub block_size: usize,
    /// When set, the KV pool takes this fraction of the device memory free after the weights
    /// and step buffers are placed (whole blocks, at most `num_blocks`); `Model::load` writes
    /// the resulting count into `num_blocks`.
    pub kv_memory_fraction: Option<f64>,
}

/// What a step hands back to the host.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct StepOutput {
    /// True when the device picked the greedy tokens (`ids`, `logprobs`); false when `logits`
    /// holds the logit rows.
    pub picked_on_device: bool,
    /// `logit_rows.len()` rows of `vocab` logits.
    pub logits: Vec<f32>,
    /// Per logit row: the greedy token and its log-probability.
    pub ids: Vec<i32>,
    pub logprobs: Vec<f32>,
}

struct Buffers<B: Backend> {
    x: B::Buffer,
    xn: B::Buffer,
    qkv: B::Buffer,
    attn: B::Buffer,
    tmp: B::Buffer,
    gate_up: B::Buffer,
    h: B::Buffer,
    lx: B::Buffer,
    lxn: B::Buffer,
    logits: B::Buffer,
    ids: B::Buffer,
    logprobs: B::Buffer,
    /// Router logits, chosen experts and their weights (MoE models; empty otherwise).
    router: B::Buffer,
    route_ids: B::Buffer,
    route_w: B::Buffer,
    /// The shared experts' output (DeepSeek; empty otherwise).
    shared: B::Buffer,
    /// Latent attention's own buffers (DeepSeek).
    mla: Option<MlaBuffers<B>>,
}

pub struct Model<B: Backend> {
    /// The whole model's hyper-parameters.
    pub cfg: ModelConfig,
    /// What this rank computes: `cfg` with its heads and FFN widths (`cfg` itself without
    /// tensor parallelism).
    local: ModelConfig,
    pub opts: ModelOptions,
    weights: Weights<B>,
    tp: Option<Tp<B>>,
    backend: B,
    bufs: Buffers<B>,
    /// Each layer's attention geometry (its rope and window).
    geometry: Vec<AttnGeometry>,
    /// Host copy of a layer's queries, read back only for long-context memory selection.
    q_host: Vec<f32>,
    /// Decode steps as device graphs (`enable_step_graphs`; none: off).
    graphs: Option<graph::StepGraphs>,
    /// LoRA adapter slots (none unless enabled; see `model::lora`).
    lora: LoraSlots<B>,
}

impl<B: Backend> Model<B> {
    /// The model of a GGUF file, read as stored.
    pub fn load(f: &GgufFile, backend: B, opts: ModelOptions) -> Result<Self, ModelError> {
        Self::load_checkpoint(&Checkpoint::from(f), backend, opts, None)
    }

    /// `load` of one rank's shard of a tensor-parallel group (`tp`: the shard and the group's
    /// collectives; None: the whole model).
    pub fn load_shard(
        f: &GgufFile,
        backend: B,
        opts: ModelOptions,
        tp: Option<(RankShard, Box<dyn Collective<B>>)>,
    ) -> Result<Self, ModelError> {
        Self::load_checkpoint(&Checkpoint::from(f), backend, opts, tp)
    }

    /// The model of a checkpoint (a GGUF file or a Hugging Face directory), whole or one rank's
    /// shard.
    pub fn load_checkpoint(
        f: &Checkpoint,
        mut backend: B,
        opts: ModelOptions,
        tp: Option<(RankShard, Box<dyn Collective<B>>)>,
    ) -> Result<Self, ModelError> {
        let cfg = f.config()?;
        backend.choose_activations(cfg.wide_activations);
        super::capabilities::check_capabilities(&cfg, &backend)?;
        if opts.max_tokens == 0
            || opts.max_logit_rows == 0
            || opts.num_blocks == 0
            || opts.block_size == 0
        {
            return Err(ModelError::BadOptions(format!(
                "model options must be non-zero: {opts:?}"
            )));
        }
        let shard = match &tp {
            Some((shard, comm)) => {
                if comm.rank() != shard.rank || comm.size() != shard.size {
                    return Err(ModelError::BadOptions(format!(
                        "shard of rank {} of {} on the collectives of rank {} of {}",
                        shard.rank,
                        shard.size,
                        comm.rank(),
                        comm.size()
                    )));
                }
                let want = npu_model::shard::shard_split(
                    &cfg,
                    Some(f),
                    shard.size,
                    shard.rank,
                    shard.expert_split,
                )
                .map_err(|e| ModelError::Unsupported(e.to_string()))?;
                if &want != shard {
                    return Err(ModelError::BadOptions(format!(
                        "shard {shard:?} is not the model's {want:?}"
                    )));
                }
                shard.clone()
            }
            None => RankShard::whole(&cfg),
        };
        super::capabilities::check_expert_split(&cfg, &shard, &backend)?;
        let local = shard.local_config(&cfg);
        let weights = Weights::load_shard(f, &cfg, &shard, &mut backend)?;
        let t = opts.max_tokens;
        let l = opts.max_logit_rows;
        let h = cfg.hidden;
        let act = backend.act_dtype();
        let mut alloc = |dtype: DType, len: usize| backend.alloc(dtype, len);
        let bufs = Buffers {
            x: alloc(act, t * h)?,
            xn: alloc(act, t * h)?,
            qkv: alloc(act, t * local.qkv_width())?,
            attn: alloc(act, t * local.attn_width())?,
            tmp: alloc(act, t * h)?,
            gate_up: alloc(act, t * 2 * local.ffn_width())?,
            h: alloc(act, t * local.ffn_width())?,
            lx: alloc(act, l * h)?,
            lxn: alloc(act, l * h)?,
            logits: alloc(act, l * shard.vocab_chunk)?,
            ids: alloc(DType::I32, l)?,
            logprobs: alloc(DType::F32, l)?,
            router: alloc(act, cfg.moe.map_or(1, |m| t * m.n_experts))?,
            route_ids: alloc(DType::I32, cfg.moe.map_or(1, |m| t * m.n_used))?,
            route_w: alloc(DType::F32, cfg.moe.map_or(1, |m| t * m.n_used))?,
            shared: alloc(
                act,
                match cfg.moe {
                    Some(m) if m.shared_ff > 0 => t * h,
                    _ => 1,
                },
            )?,
            mla: None,
        };
        let mut bufs = bufs;
        bufs.mla = MlaBuffers::alloc(&mut backend, act, t, &local)?;
        // The pool last: sized from free memory, it sees what the weights and buffers left.
        let mut opts = opts;
        opts.num_blocks = init_kv_pool(&mut backend, &local, &opts)?;
        let geometry = local
            .layers
            .iter()
            .map(|l| AttnGeometry {
                n_heads: local.n_heads,
                n_kv_heads: local.n_kv_heads,
                head_dim: local.head_dim,
                rope: l.rope,
                scale: local.attn_scale,
                window: l.window,
            })
            .collect();
        let tp = tp.map(|(shard, comm)| Tp {
            shard,
            comm,
            embed: Vec::new(),
            gathered: Vec::new(),
            vocab_size: cfg.vocab,
            calls: 0,
            spent: std::time::Duration::ZERO,
        });
        Ok(Self {
            cfg,
            local,
            opts,
            weights,
            tp,
            backend,
            bufs,
            geometry,
            q_host: Vec::new(),
            graphs: None,
            lora: LoraSlots::default(),
        })
    }

    /// This rank's shard (the whole model without tensor parallelism).
    pub fn shard(&self) -> RankShard {
        match &self.tp {
            Some(tp) => tp.shard.clone(),
            None => RankShard::whole(&self.cfg),
        }
    }

    /// Collectives this rank has run and the time they took, waiting for the other ranks
    /// included (None without tensor parallelism).
    pub fn collective_time(&self) -> Option<(u64, std::time::Duration)> {
        self.tp.as_ref().map(|tp| (tp.calls, tp.spent))
    }

    /// What carries this rank's collectives (None without tensor parallelism).
    pub fn describe_collectives(&self) -> Option<String> {
        self.tp.as_ref().map(|tp| tp.comm.describe())
    }

    /// The LoRA slots, the backend, this rank's config and whether the model is split over
    /// tensor-parallel ranks (for `model::lora`'s methods).
    pub(super) fn lora_parts(&mut self) -> (&mut LoraSlots<B>, &mut B, &ModelConfig, bool) {
        (
            &mut self.lora,
            &mut self.backend,
            &self.local,
            self.tp.is_some(),
        )
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The weights as loaded on the backend.
    pub fn weights(&self) -> &Weights<B> {
        &self.weights
    }

    /// Multiply-adds of the weight matrices per token on this rank: (every layer's projections,
    /// the output head). Attention over the context is not counted.
    pub fn matmul_macs_per_token(&self) -> (u64, u64) {
        let c = &self.local;
        let vocab = self.shard().vocab.len();
        // An MoE token runs the router and its routed experts.
        let dense = 3 * c.hidden * c.ff;
        let attn = match c.mla {
            None => c.hidden * c.qkv_width() + c.attn_width() * c.hidden,
            Some(m) => {
                let q = match m.q_lora_rank {
                    0 => c.hidden * c.n_heads * (m.qk_nope + m.qk_rope),
                    r => c.hidden * r + r * c.n_heads * (m.qk_nope + m.qk_rope),
                };
                let heads =
                    c.n_heads * (m.qk_nope * m.kv_lora_rank + m.kv_lora_rank * m.v_head_dim);
                q + c.hidden * m.cache_row() + heads + c.attn_width() * c.hidden
            }
        };
        let total: usize = (0..c.n_layers)
            .map(|il| {
                attn + match c.moe {
                    Some(m) if m.is_moe_layer(il) => {
                        // An MoE token runs the router, its routed experts and the shared ones.
                        c.hidden * m.n_experts
                            + m.n_used * 3 * c.hidden * m.expert_ff
                            + 3 * c.hidden * m.shared_ff
                    }
                    _ => dense,
                }
            })
            .sum();
        (total as u64, (vocab * c.hidden) as u64)
    }

    /// Lets go of the KV pool's memory (a sleeping agent): the pool shrinks to one block, its
    /// contents gone. Returns the bytes released. `restore_kv` brings the whole pool back.
    pub fn release_kv(&mut self) -> Result<u64, ModelError> {
        let before = self.backend.kv_block_bytes() as u64 * self.opts.num_blocks as u64;
        let one = ModelOptions {
            num_blocks: 1,
            kv_memory_fraction: None,
            ..self.opts
        };
        init_kv_pool(&mut self.backend, &self.local, &one)?;
        Ok(before.saturating_sub(self.backend.kv_block_bytes() as u64))
    }

    /// Allocates the KV pool again, zeroed, with the blocks it had at load (after
    /// `release_kv`). Returns its bytes.
    pub fn restore_kv(&mut self) -> Result<u64, ModelError> {
        let whole = ModelOptions {
            kv_memory_fraction: None,
            num_blocks: self.opts.num_blocks + self.reserved_blocks(),
            ..self.opts
        };
        let blocks = init_kv_pool(&mut self.backend, &self.local, &whole)?;
        Ok(self.backend.kv_block_bytes() as u64 * blocks as u64)
    }

    /// Why this model cannot move its weights to host memory (sleep level 1), if it cannot: a
    /// backend without it, or a rank of a tensor-parallel group (its peers sleep apart, and
    /// their collectives are not kept across a move; not built).
    pub fn weights_offload_refusal(&self) -> Option<String> {
        if !self.backend.offloads_weights() {
            return Some(self.backend.offload_unsupported().to_string());
        }
        self.tp.as_ref().map(|_| {
            format!(
                "{}: moving a tensor-parallel rank's weights to host memory is not built",
                self.backend.kind().name()
            )
        })
    }

    /// Sleep level 1 on a device: every weight copied to host memory and its device memory
    /// freed (`Backend::offload_weights`); steps fail until `restore_weights`. Returns the
    /// device bytes released. Refused as `weights_offload_refusal` says.
    pub fn offload_weights(&mut self) -> Result<u64, ModelError> {
        if let Some(why) = self.weights_offload_refusal() {
            return Err(ModelError::Unsupported(why));
        }
        Ok(self.backend.offload_weights()?)
    }

    /// Wakes from `offload_weights`: the weights on the device again, at new addresses the
    /// model's handles follow. Returns the device bytes allocated.
    pub fn restore_weights(&mut self) -> Result<u64, ModelError> {
        Ok(self.backend.restore_weights()?)
    }

    /// The backend, for KV block moves between steps.
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Runs one step, checked by the caller (see `crate::step_input`): every layer, then the
    /// output head on the step's logit rows, then one read back into `out`. With `greedy` (every
    /// logit row is a plain greedy pick) the backend may pick on the device; `out` says which
    /// happened.
    pub fn forward(
        &mut self,
        step: &StepInputs,
        greedy: bool,
        out: &mut StepOutput,
    ) -> Result<(), ModelError> {
        self.forward_with(step, greedy, out, None)
    }

    /// Long-context mode's work before a step (see `LongContext::prepare`): offloads, and
    /// rewrites `step`'s tables for sequences with memory.
    pub fn prepare_long_context(
        &mut self,
        lc: &mut LongContext,
        step: &mut StepInputs,
        slots: &[u32],
    ) -> Result<(), ModelError> {
        lc.prepare(&mut self.backend, step, slots)
    }

    /// `forward`, with long-context mode's unit selection before each layer's attention when
    /// `lc` has sequences with memory in this step (it reads the layer's queries back).
    pub fn forward_with(
        &mut self,
        step: &StepInputs,
        greedy: bool,
        out: &mut StepOutput,
        lc: Option<&mut LongContext>,
    ) -> Result<(), ModelError> {
        let lc_active = lc.as_deref().is_some_and(|lc| lc.has_active());
        let outcome = match self.graph_key(step, greedy, lc_active) {
            Some(key) => self.forward_graph(step, key, greedy, out),
            None => self.forward_inner(step, greedy, out, lc),
        };
        // A step's adapter choice is its own: the next step sets its own.
        self.lora.end_step();
        if outcome.is_err() {
            // The other ranks may be waiting for this one in a collective.
            if let Some(tp) = self.tp.as_mut() {
                tp.comm.abort();
            }
        }
        outcome
    }

    fn forward_inner(
        &mut self,
        step: &StepInputs,
        greedy: bool,
        out: &mut StepOutput,
        mut lc: Option<&mut LongContext>,
    ) -> Result<(), ModelError> {
        // A graph's run or recording (`forward_graph`): its inputs are in place, and it stops
        // before the read back.
        let body_only = self.graphs.as_ref().is_some_and(|g| g.body_only);
        let b = &mut self.backend;
        let q_host = &mut self.q_host;
        let w = &self.weights;
        let bufs = &mut self.bufs;
        let lora = &self.lora;
        let mut tp = self.tp.as_mut();
        let cfg = &self.local;
        let t = step.tokens.len();
        let h = cfg.hidden;
        let qkv_w = cfg.qkv_width();
        let eps = cfg.rms_eps;
        if !body_only {
            b.begin_step(step)?;
        }
        match (&w.embed, tp.as_deref_mut()) {
            (Embedding::Device(table), _) => b.embed(table, ViewMut::rows(&mut bufs.x, t, h)?)?,
            (Embedding::Host(table), Some(tp)) => {
                tp.embed.resize(t * h, 0.0);
                table.lookup(&step.tokens, &mut tp.embed)?;
                b.upload(HostSlice::F32(&tp.embed), ViewMut::rows(&mut bufs.x, t, h)?)?;
            }
            (Embedding::Host(_), None) => {
                return Err(ModelError::Inconsistent(
                    "a host embedding table outside a tensor-parallel group".into(),
                ))
            }
        }
        if let Some(s) = cfg.embed_scale {
            b.scale_rows(ViewMut::rows(&mut bufs.x, t, h)?, s)?;
        }
        // `xn` already holds this layer's attention norm (the previous layer's last residual
        // add did it: `residual_add`'s next norm).
        let mut xn_ready = false;
        // The backend takes each norm and residual add with the product beside it (one launch
        // where it folds them): the residual adds go with the output and down products, the
        // norms with the Q/K/V and gate/up products, SwiGLU with the gate/up one.
        let fold = tp.is_none() && b.folds_norms_into_matmuls(t);
        for (li, (layer, g)) in w.layers.iter().zip(&self.geometry).enumerate() {
            let (qw, kvw) = (g.q_width(), g.kv_width());
            let next_norm = w.layers.get(li + 1).map(|l| &l.attn_norm);
            let next_norm = next_norm.filter(|_| !fold);
            let norm_in_qkv = !xn_ready
                && fold
                && matches!(
                    &layer.attn,
                    Attn::Heads {
                        qkv: Proj::Fused(_),
                        ..
                    }
                );
            if !xn_ready && !norm_in_qkv {
                b.rms_norm(
                    View::rows(&bufs.x, t, h)?,
                    &layer.attn_norm,
                    eps,
                    ViewMut::rows(&mut bufs.xn, t, h)?,
                )?;
            }
            xn_ready = next_norm.is_some();
            let (qkv_proj, qkv_bias, q_norm, k_norm) = match &layer.attn {
                Attn::Heads {
                    qkv,
                    qkv_bias,
                    q_norm,
                    k_norm,
                } => (qkv, qkv_bias, q_norm, k_norm),
                Attn::Latent(mw) => {
                    let (Some(m), Some(mb)) = (cfg.mla, bufs.mla.as_mut()) else {
                        return Err(ModelError::Inconsistent(
                            "latent attention weights without its settings".into(),
                        ));
                    };
                    let step = MlaStep {
                        xn: &bufs.xn,
                        q: &mut bufs.qkv,
                        out: &mut bufs.attn,
                        bufs: mb,
                    };
                    mla::attention(b, mw, m, g, step, eps, t, h, li)?;
                    let aw = cfg.attn_width();
                    let (attn, out) = (
                        View::rows(&bufs.attn, t, aw)?,
                        ViewMut::rows(&mut bufs.tmp, t, h)?,
                    );
                    match tp.as_deref_mut() {
                        Some(tp) => tp.matmul_all_reduce(b, attn, &layer.wo, out)?,
                        None => b.matmul(attn, &layer.wo, out)?,
                    }
                    let ffn_norm = Some(&layer.ffn_norm);
                    residual_add(b, bufs, None, ffn_norm.filter(|_| !fold), eps, t, h)?;
                    let norm = ffn_norm.filter(|_| fold);
                    let group = tp.as_deref_mut();
                    ffn(
                        b,
                        bufs,
                        &layer.ffn,
                        cfg,
                        t,
                        h,
                        (lora, li),
                        (norm, false),
                        group,
                    )?;
                    residual_add(b, bufs, None, next_norm, eps, t, h)?;
                    continue;
                }
            };
            let mut qkv = ViewMut::rows(&mut bufs.qkv, t, qkv_w)?;
            // The rope and KV write go with the product too where nothing comes between.
            let qkv_lora = [Target::Q, Target::K, Target::V]
                .into_iter()
                .any(|target| lora.targets(li, target));
            let head_norms = match (q_norm, k_norm) {
                (Some(qn), Some(kn)) => Some((qn, kn)),
                _ => None,
            };
            let rope_in_qkv = norm_in_qkv
                && !qkv_lora
                && qkv_bias.is_none()
                && q_norm.is_some() == head_norms.is_some()
                && k_norm.is_some() == head_norms.is_some()
                && qkv_w == qw + 2 * kvw;
            let (x, xn) = (
                View::rows(&bufs.x, t, h)?,
                ViewMut::rows(&mut bufs.xn, t, h)?,
            );
            let an = &layer.attn_norm;
            match qkv_proj {
                Proj::Fused(m) if rope_in_qkv => {
                    let out = qkv.col_range(0, qkv_w)?;
                    b.rms_norm_matmul_rope_kv_write(x, an, eps, xn, m, out, g, li, head_norms)?
                }
                Proj::Fused(m) if norm_in_qkv => {
                    b.rms_norm_matmul(x, an, eps, xn, m, qkv.col_range(0, qkv_w)?)?
                }
                _ => project(b, View::rows(&bufs.xn, t, h)?, qkv_proj, &mut qkv)?,
            }
            for (target, col, n) in [
                (Target::Q, 0, qw),
                (Target::K, qw, kvw),
                (Target::V, qw + kvw, kvw),
            ] {
                lora.apply(
                    b,
                    li,
                    target,
                    View::rows(&bufs.xn, t, h)?,
                    qkv.col_range(col, n)?,
                )?;
            }
            if let Some(bias) = qkv_bias {
                b.add_bias(qkv.col_range(0, qkv_w)?, bias)?;
            }
            if rope_in_qkv {
                // Done in the product's launch.
            } else if let (Some(qn), Some(kn)) = (q_norm, k_norm) {
                b.norm_rope_kv_write(qkv.col_range(0, qw + 2 * kvw)?, qn, kn, eps, g, li)?;
            } else {
                b.rope_kv_write(qkv.col_range(0, qw + 2 * kvw)?, g, li)?;
            }
            let qkv = qkv.as_view();
            if let Some(lc) = lc.as_deref_mut().filter(|lc| lc.has_active()) {
                q_host.resize(t * qw, 0.0);
                b.read_back(&mut [Readback {
                    src: qkv.col_range(0, qw)?,
                    dst: HostSliceMut::F32(q_host),
                }])?;
                lc.before_attention(b, li, q_host)?;
            }
            let post = layer.post_attn_norm.as_ref();
            if fold && post.is_none() && !lora.targets(li, Target::O) {
                // Attention, the output product and the residual add: one launch where the
                // backend folds them.
                b.attention_matmul_add(
                    qkv.col_range(0, qw)?,
                    g,
                    li,
                    ViewMut::rows(&mut bufs.attn, t, qw)?,
                    &layer.wo,
                    ViewMut::rows(&mut bufs.tmp, t, h)?,
                    ViewMut::rows(&mut bufs.x, t, h)?,
                )?;
            } else {
                b.attention(
                    qkv.col_range(0, qw)?,
                    g,
                    li,
                    ViewMut::rows(&mut bufs.attn, t, qw)?,
                )?;
                let (attn, out) = (
                    View::rows(&bufs.attn, t, qw)?,
                    ViewMut::rows(&mut bufs.tmp, t, h)?,
                );
                match tp.as_deref_mut() {
                    // The output product and the group's all-reduce in one operator where the
                    // collective has it.
                    Some(tp) if !lora.targets(li, Target::O) => {
                        tp.matmul_all_reduce(b, attn, &layer.wo, out)?
                    }
                    group => {
                        b.matmul(attn, &layer.wo, out)?;
                        lora.apply(
                            b,
                            li,
                            Target::O,
                            View::rows(&bufs.attn, t, qw)?,
                            ViewMut::rows(&mut bufs.tmp, t, h)?,
                        )?;
                        if let Some(tp) = group {
                            tp.all_reduce(b, ViewMut::rows(&mut bufs.tmp, t, h)?)?;
                        }
                    }
                }
                let next = Some(&layer.ffn_norm).filter(|_| !fold);
                residual_add(b, bufs, post, next, eps, t, h)?;
            }
            let norm = Some(&layer.ffn_norm).filter(|_| fold);
            let post = layer.post_ffn_norm.as_ref();
            let fold_down = fold && post.is_none();
            if !ffn(
                b,
                bufs,
                &layer.ffn,
                cfg,
                t,
                h,
                (lora, li),
                (norm, fold_down),
                tp.as_deref_mut(),
            )? {
                residual_add(b, bufs, post, next_norm, eps, t, h)?;
            }
        }
        let n = step.logit_rows.len();
        out.picked_on_device = false;
        out.logits.clear();
        out.ids.clear();
        out.logprobs.clear();
        if n == 0 {
            b.synchronize()?;
            return Ok(());
        }
        b.gather_logit_rows(
            View::rows(&bufs.x, t, h)?,
            ViewMut::rows(&mut bufs.lx, n, h)?,
        )?;
        // The final norm goes with the head's product where the backend folds them.
        let fold_head = tp.is_none() && b.folds_norms_into_matmuls(n);
        if !fold_head {
            b.rms_norm(
                View::rows(&bufs.lx, n, h)?,
                &w.out_norm,
                cfg.rms_eps,
                ViewMut::rows(&mut bufs.lxn, n, h)?,
            )?;
        }
        if let Some(tp) = tp {
            // This rank's vocabulary rows, then every rank's gathered into rank 0's host.
            let chunk = tp.shard.vocab_chunk;
            let mine = tp.shard.vocab.len();
            b.matmul(
                View::rows(&bufs.lxn, n, h)?,
                &w.head,
                ViewMut::rows(&mut bufs.logits, n, chunk)?.col_range(0, mine)?,
            )?;
            let root = tp.shard.rank == 0;
            let size = tp.shard.size;
            if greedy {
                // Every row's pick from each rank's (max, index, exp-sum) alone.
                let triples = local_triples(
                    b,
                    View::rows(&bufs.logits, n, chunk)?.col_range(0, mine)?,
                    &mut bufs.ids,
                    &mut bufs.logprobs,
                    &mut tp.embed,
                )?;
                return tp.greedy_picks(b, &triples, n, out);
            }
            tp.gathered
                .resize(if root { size * n * chunk } else { 0 }, 0.0);
            let started = std::time::Instant::now();
            tp.comm
                .gather_to_host(b, View::rows(&bufs.logits, n, chunk)?, &mut tp.gathered)?;
            tp.calls += 1;
            tp.spent += started.elapsed();
            if root {
                let vocab = self.cfg.vocab;
                out.logits.resize(n * vocab, 0.0);
                for (r, row) in out.logits.chunks_exact_mut(vocab).enumerate() {
                    for (k, part) in row.chunks_mut(chunk).enumerate() {
                        let at = (k * n + r) * chunk;
                        part.copy_from_slice(&tp.gathered[at..at + part.len()]);
                    }
                }
            }
            return Ok(());
        }
        let vocab = cfg.vocab;
        if fold_head {
            b.rms_norm_matmul(
                View::rows(&bufs.lx, n, h)?,
                &w.out_norm,
                cfg.rms_eps,
                ViewMut::rows(&mut bufs.lxn, n, h)?,
                &w.head,
                ViewMut::rows(&mut bufs.logits, n, vocab)?,
            )?;
        } else {
            b.matmul(
                View::rows(&bufs.lxn, n, h)?,
                &w.head,
                ViewMut::rows(&mut bufs.logits, n, vocab)?,
            )?;
        }
        let logits = View::rows(&bufs.logits, n, vocab)?;
        if greedy
            && b.argmax_and_logprob_rows(
                logits,
                ViewMut::rows(&mut bufs.ids, n, 1)?,
                ViewMut::rows(&mut bufs.logprobs, n, 1)?,
            )?
        {
            if body_only {
                out.picked_on_device = true;
                return Ok(());
            }
            out.ids.resize(n, 0);
            out.logprobs.resize(n, 0.0);
            b.read_back(&mut [
                Readback {
                    src: View::rows(&bufs.ids, n, 1)?,
                    dst: HostSliceMut::I32(&mut out.ids),
                },
                Readback {
                    src: View::rows(&bufs.logprobs, n, 1)?,
                    dst: HostSliceMut::F32(&mut out.logprobs),
                },
            ])?;
            out.picked_on_device = true;
            return Ok(());
        }
        if body_only {
            return Ok(());
        }
        out.logits.resize(n * vocab, 0.0);
        b.read_back(&mut [Readback {
            src: logits,
            dst: HostSliceMut::F32(&mut out.logits),
        }])?;
        Ok(())
    }
}

/// Allocates the KV pool `opts` asks for (a fixed number of blocks, or a fraction of the free
/// device memory) and returns its blocks.
fn init_kv_pool<B: Backend>(
    backend: &mut B,
    cfg: &ModelConfig,
    opts: &ModelOptions,
) -> Result<usize, ModelError> {
    let mut spec = KvSpec {
        n_layers: cfg.n_layers,
        num_blocks: opts.num_blocks,
        block_size: opts.block_size,
        n_kv_heads: cfg.n_kv_heads,
        head_dim: cfg.head_dim,
    };
    let dtype = backend.kv_dtype();
    if cfg.mla.is_some() && dtype != KvDtype::F16 {
        return Err(ModelError::Unsupported(format!(
            "kv_cache_dtype {} with latent attention ({}): the latent KV pool stays f16",
            dtype.name(),
            cfg.arch.name()
        )));
    }
    let block_bytes = match cfg.mla {
        None => backend.kv_block_bytes_for(&spec),
        Some(_) => backend.latent_kv_block_bytes_for(&spec),
    };
    if let Some(fraction) = opts.kv_memory_fraction {
        let mem = backend.mem_info()?;
        spec.num_blocks =
            super::kv_sizing::blocks_for_memory(mem.free, fraction, block_bytes, opts.num_blocks)?;
        tracing::info!(
            device = %backend.describe(),
            free_bytes = mem.free,
            total_bytes = mem.total,
            fraction,
            block_bytes,
            num_blocks = spec.num_blocks,
            most_blocks = opts.num_blocks,
            "KV pool sized from the device memory free after the weights and step buffers"
        );
    }
    match cfg.mla {
        None => {
            if dtype != KvDtype::F16 {
                let f16 = spec.f16_block_bytes();
                tracing::info!(
                    kv_cache_dtype = dtype.name(),
                    block_bytes,
                    f16_block_bytes = f16,
                    tokens_ratio = format!("{:.2}", f16 as f64 / block_bytes.max(1) as f64),
                    num_blocks = spec.num_blocks,
                    "KV pool of {}: values and their per-token scales (tokens_ratio times the \
                     tokens of an f16 pool in the same memory)",
                    dtype.name()
                );
            }
            backend.init_kv(spec)?
        }
        Some(m) => {
            // What a dense model of the same heads would store per token and layer: every
            // head's key and value.
            let dense = cfg.n_heads * (m.qk_nope + m.qk_rope + m.v_head_dim);
            tracing::info!(
                latent_values_per_token = m.cache_row(),
                dense_values_per_token = dense,
                tokens_ratio = format!("{:.1}", dense as f64 / m.cache_row() as f64),
                num_blocks = spec.num_blocks,
                block_bytes,
                "latent KV pool: each token's latent and rotated key, not per-head K and V (a \
                 same-width dense model's cache would hold tokens_ratio times fewer tokens in \
                 the same memory)"
            );
            backend.init_latent_kv(spec)?
        }
    }
    let got = backend.kv_block_bytes();
    if got != block_bytes {
        return Err(ModelError::Inconsistent(format!(
            "the backend planned {block_bytes} bytes per KV block and allocated {got}"
        )));
    }
    Ok(spec.num_blocks)
}

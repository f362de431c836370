//! The agent's engine: owns the model (on the device the config names, with the paged KV pool),
//! the host KV pool, the per-slot sampling state and the host thread pool, and runs one step
//! plan into one step result: slots forgotten and admitted, the plan's KV block copies in order,
//! then the forward and the sampling, reporting what moved between host and device.
//! KV copies of the handoff directions go through the handoff region the server shares
//! between its agents (a prefilled request's blocks handed to a decode agent). The agent process's step loop calls it with the plan where it lies in shared memory;
//! in-process runs (`crate::inproc`) call it with plans from the real scheduler.

use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use npu_protocol::agent::{AgentEngineConfig, KvCacheDtype, KvFacts, ModelFacts};
use npu_protocol::shm::HandoffRegion;
use npu_protocol::{
    PlanSource, SamplingParams, SeqFailure, SeqResult, StepResult, StepTiming, StepTransfer,
    TokenLogprob, TokenMask,
};
use thiserror::Error;

use crate::device::{DeviceModel, DeviceSpec, TpSetup};
use crate::engine_lora::EngineLora;
use crate::kv_host::{measure_copy_bandwidth, CopyBandwidth, HostKvPool};
use crate::long_context::select::Heads;
use crate::long_context::{LongContext, LongContextStats};
use crate::model::{ModelConfig, ModelError, ModelOptions, StepOutput};
use crate::sampler::{
    has_penalties, is_plain_greedy, SampleOutput, Sampler, SamplerError, TokenHistory,
};
use crate::step_input::{StepError, StepLimits, StepRead};
use npu_backend::KvDtype;
use npu_backend_cpu::threadpool::{PoolError, ThreadPool};
use npu_gguf::{GgufError, GgufFile};
use npu_model::{Checkpoint, LoadOptions};
use npu_protocol::agent::AgentLoraConfig;

thread_local! {
    /// Sampling scratch of each compute thread.
    static SAMPLER: std::cell::RefCell<Sampler> = std::cell::RefCell::new(Sampler::new());
}

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    #[error(transparent)]
    Step(#[from] StepError),
    #[error("bad step plan: {0}")]
    BadPlan(String),
    #[error("bad engine configuration: {0}")]
    BadConfig(String),
    #[error("sampling: {0}")]
    Sampling(#[from] PoolError),
    #[error("the step's token masks never arrived: {0}")]
    MasksLost(String),
}

/// How a step whose mask words follow its plan gets them (see `PlanSource::masks_follow`):
/// called once, after the forward pass and before sampling, it waits until the server has
/// written them and returns them in the plan's order.
pub type FollowingMasks<'a> = &'a mut dyn FnMut() -> Result<Vec<TokenMask>, String>;

struct Slot {
    params: SamplingParams,
    history: TokenHistory,
}

pub struct AgentEngine {
    cfg: AgentEngineConfig,
    model: DeviceModel,
    facts: ModelFacts,
    slots: Vec<Option<Slot>>,
    /// Host threads: the CPU backend's kernels and the sampling of every device.
    pool: Arc<ThreadPool>,
    limits: StepLimits,
    /// The current step as read from its plan (reused).
    read: StepRead,
    /// What the current step handed back (reused).
    out: StepOutput,
    /// Host memory for swapped-out and spilled KV blocks.
    host_kv: HostKvPool,
    /// Long-context mode's host memory, when the config turns it on.
    long_context: Option<LongContext>,
    /// Slots of the current step's sequences (reused).
    step_slots: Vec<u32>,
    /// This step's token masks (slot, words): constrained requests' grammars.
    masks: Vec<(u32, Vec<u32>)>,
    /// The region shared with the other agents through which KV blocks are handed over
    /// (prefill/decode disaggregation); None when the server set none up.
    handoff: Option<HandoffRegion>,
    /// This agent's rank in its tensor-parallel group (0 without one): only rank 0 samples
    /// and answers with tokens.
    rank: u32,
    /// Steps run and the time their forwards took (for the tensor-parallel summary).
    steps: u64,
    forward: std::time::Duration,
    /// Bytes of one KV block as the pools were built (the host pool's unit).
    host_block_bytes: usize,
    /// LoRA adapters (None: the server did not turn them on).
    lora: Option<EngineLora>,
}

/// Where a tensor-parallel rank's forwards spent their time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TpTime {
    pub steps: u64,
    pub forward: std::time::Duration,
    /// All-reduces and logit gathers run, and their time (waiting for the other ranks
    /// included).
    pub collectives: u64,
    pub in_collectives: std::time::Duration,
}

impl AgentEngine {
    /// Where this rank's forwards spent their time (None without tensor parallelism).
    pub fn tensor_parallel_time(&self) -> Option<TpTime> {
        let (collectives, in_collectives) = self.model.collective_time()?;
        Some(TpTime {
            steps: self.steps,
            forward: self.forward,
            collectives,
            in_collectives,
        })
    }
}

impl Drop for AgentEngine {
    /// A tensor-parallel rank says where its forwards' time went.
    fn drop(&mut self) {
        let Some(t) = self.tensor_parallel_time().filter(|t| t.steps > 0) else {
            return;
        };
        tracing::info!(
            rank = self.rank,
            steps = t.steps,
            forward_s = t.forward.as_secs_f64(),
            collectives = t.collectives,
            collective_s = t.in_collectives.as_secs_f64(),
            collective_share = t.in_collectives.as_secs_f64() / t.forward.as_secs_f64().max(1e-9),
            "tensor-parallel rank: time in collectives (all-reduces and the logit gather, \
             waiting for the other ranks included)"
        );
    }
}

/// Bytes of a step's inputs that go host->device (`begin_step`: tokens, positions, slot
/// mapping, sequence spans, block tables, logit rows), and the block tables' share of them.
/// The KV history of the sequences is not among them: it stays on the device.
pub fn input_bytes(s: &npu_backend::StepInputs) -> (u64, u64) {
    let words = s.tokens.len() + s.positions.len() + s.slot_mapping.len() + s.logit_rows.len();
    let spans = s.seqs.len() * std::mem::size_of::<npu_backend::SeqSpan>();
    let tables = (s.block_tables.len() * 4) as u64;
    ((words * 4 + spans) as u64 + tables, tables)
}

/// The long-context layout of `lc` on the engine's pool, or an error naming the setting.
fn long_context_layout(
    cfg: &AgentEngineConfig,
    lc: npu_protocol::LongContextConfig,
) -> Result<npu_protocol::LongContextLayout, EngineError> {
    if cfg.device != npu_protocol::agent::DeviceKind::Cpu {
        return Err(EngineError::BadConfig(format!(
            "long_context: long-context mode runs on the cpu device only (its per-layer block \
             copies are not built for {})",
            cfg.device.name()
        )));
    }
    let layout = npu_protocol::LongContextLayout::new(lc, cfg.block_size)
        .map_err(|e| EngineError::BadConfig(format!("long_context.{e}")))?;
    let room = cfg.num_blocks.min(cfg.max_blocks_per_seq);
    if lc.device_blocks > room {
        return Err(EngineError::BadConfig(format!(
            "long_context.device_blocks is {}, more than one sequence can hold here (min(num_blocks \
             {}, max_blocks_per_seq {}) = {room})",
            lc.device_blocks, cfg.num_blocks, cfg.max_blocks_per_seq
        )));
    }
    Ok(layout)
}

/// Joins the tensor-parallel group `cfg` names, if any, and works out this rank's shard;
/// refuses what cannot run split over ranks.
fn tensor_parallel(
    cfg: &AgentEngineConfig,
    file: &Checkpoint,
) -> Result<Option<TpSetup>, EngineError> {
    let Some(spec) = &cfg.tensor_parallel else {
        return Ok(None);
    };
    let refuse = |what: &str| {
        Err(EngineError::BadConfig(format!(
            "tensor_parallel_size {}: {what} cannot run over a tensor-parallel group yet",
            spec.size
        )))
    };
    if spec.size < 2 || spec.rank >= spec.size {
        return Err(EngineError::BadConfig(format!(
            "tensor-parallel rank {} of a group of {}",
            spec.rank, spec.size
        )));
    }
    if cfg.long_context.is_some() {
        return refuse("long-context mode");
    }
    if cfg.swap_space_mb > 0 {
        return refuse("a host KV pool (swap_space_mb)");
    }
    if cfg.handoff.is_some() {
        return refuse("a prefill/decode split");
    }
    let mc = file.config().map_err(ModelError::from)?;
    let split = match spec.whole_experts {
        true => npu_model::shard::ExpertSplit::WholeExperts,
        false => npu_model::shard::ExpertSplit::ShareEachExpert,
    };
    let (size, rank) = (spec.size as usize, spec.rank as usize);
    let shard = npu_model::shard::shard_split(&mc, Some(file), size, rank, split)
        .map_err(|e| EngineError::BadConfig(format!("tensor_parallel_size {}: {e}", spec.size)))?;
    let host = crate::tp::ShmCollective::join(spec)
        .map_err(|e| EngineError::BadConfig(format!("joining the group: {e}")))?;
    tracing::info!(
        rank = spec.rank,
        size = spec.size,
        q_heads = ?shard.q_heads,
        kv_heads = ?shard.kv_heads,
        ff = ?shard.ff,
        experts = ?shard.experts,
        expert_ff = ?shard.expert_ff,
        vocab = ?shard.vocab,
        "joined the tensor-parallel group; loading this rank's shard"
    );
    Ok(Some(TpSetup {
        shard,
        host: Box::new(host),
    }))
}

/// Opens the checkpoint `cfg` names (a GGUF file or a Hugging Face directory) under its
/// quantize-at-load option.
pub fn open_checkpoint(cfg: &AgentEngineConfig) -> Result<Checkpoint, EngineError> {
    let quantize = match cfg.quantize.as_deref() {
        None => None,
        Some(q) => LoadOptions::parse_quantize(q).ok_or_else(|| {
            EngineError::BadConfig(format!("quantize = {q:?}: one of q8_0, q4_k, q4_0, none"))
        })?,
    };
    let started = std::time::Instant::now();
    let ck = Checkpoint::open_with(&cfg.model_path, LoadOptions { quantize })
        .map_err(ModelError::from)?;
    tracing::info!(
        model = %ck.describe(),
        quantize = ?quantize.map(|t| t.name()),
        opened_ms = started.elapsed().as_millis() as u64,
        "opened the model"
    );
    Ok(ck)
}

/// End-of-generation token ids: a GGUF file's metadata (eos, and eot/eom where present), or a
/// directory's `generation_config.json` and `config.json` `eos_token_id`s (as vLLM stops on
/// them).
fn checkpoint_eos_ids(ck: &Checkpoint) -> Result<Vec<u32>, EngineError> {
    if let Some(f) = ck.as_gguf() {
        return Ok(eos_ids(f));
    }
    let dir = ck.path();
    let bad = |e: npu_hf::HfError| EngineError::BadConfig(e.to_string());
    let mut ids = npu_hf::GenerationConfig::read(dir)
        .map_err(bad)?
        .map(|g| g.eos_token_ids)
        .unwrap_or_default();
    if let Some(cfg) = npu_hf::read_json(dir, "config.json").map_err(bad)? {
        let from_cfg = npu_hf::GenerationConfig::from_json(&cfg).map_err(bad)?;
        for id in from_cfg.eos_token_ids {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// The beginning-of-sequence id: a GGUF file's metadata, or a directory's
/// `generation_config.json` (else `config.json`).
fn checkpoint_bos_id(ck: &Checkpoint) -> Result<Option<u32>, EngineError> {
    if let Some(f) = ck.as_gguf() {
        return Ok(f.get_u64("tokenizer.ggml.bos_token_id").map(|v| v as u32));
    }
    let bad = |e: npu_hf::HfError| EngineError::BadConfig(e.to_string());
    let from_gen = npu_hf::GenerationConfig::read(ck.path())
        .map_err(bad)?
        .and_then(|g| g.bos_token_id);
    if from_gen.is_some() {
        return Ok(from_gen);
    }
    Ok(
        match npu_hf::read_json(ck.path(), "config.json").map_err(bad)? {
            Some(cfg) => {
                npu_hf::GenerationConfig::from_json(&cfg)
                    .map_err(bad)?
                    .bos_token_id
            }
            None => None,
        },
    )
}

/// The tokenizer of a model path: a Hugging Face directory's own files, or a GGUF file's
/// metadata (with a `tokenizer.json` beside it when there is one).
pub fn model_tokenizer(
    path: &std::path::Path,
) -> Result<npu_tokenizer::Tokenizer, npu_tokenizer::TokenizerError> {
    if path.is_dir() {
        return npu_tokenizer::Tokenizer::from_dir(path);
    }
    let gguf =
        GgufFile::open(path).map_err(|e| npu_tokenizer::TokenizerError::Build(e.to_string()))?;
    npu_tokenizer::Tokenizer::for_model(&gguf, path)
}

/// End-of-generation token ids from the metadata (eos, and eot/eom where present).
fn eos_ids(f: &GgufFile) -> Vec<u32> {
    let mut ids = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(id) = f.get_u64(key) {
            if !ids.contains(&(id as u32)) {
                ids.push(id as u32);
            }
        }
    }
    ids
}

impl AgentEngine {
    /// Loads the model and sizes the pools `cfg` asks for. With `kv_memory_fraction` the device
    /// pool is sized from free memory: `config().num_blocks` and the facts' `device_blocks` say
    /// what it got.
    pub fn load(cfg: &AgentEngineConfig) -> Result<Self, EngineError> {
        if cfg.max_slots == 0
            || cfg.max_tokens_per_step == 0
            || cfg.max_blocks_per_seq == 0
            || cfg.num_blocks == 0
            || cfg.block_size == 0
        {
            return Err(EngineError::BadConfig(format!(
                "num_blocks, block_size, max_slots, max_tokens_per_step and max_blocks_per_seq \
                 must be positive: {cfg:?}"
            )));
        }
        let file = open_checkpoint(cfg)?;
        let opts = ModelOptions {
            max_tokens: cfg.max_tokens_per_step as usize,
            // One row per slot, and one per drafted token a step may carry.
            max_logit_rows: cfg.max_slots as usize + npu_protocol::MAX_STEP_DRAFT_TOKENS,
            num_blocks: cfg.num_blocks as usize,
            block_size: cfg.block_size as usize,
            kv_memory_fraction: cfg.kv_memory_fraction,
        };
        let threads = match cfg.threads {
            0 => ThreadPool::available_threads(),
            n => n as usize,
        };
        let pool = Arc::new(ThreadPool::new(threads));
        let spec = DeviceSpec {
            kind: cfg.device,
            device_id: cfg.device_id,
        };
        let tp = tensor_parallel(cfg, &file)?;
        let rank = cfg.tensor_parallel.as_ref().map_or(0, |t| t.rank);
        let started = std::time::Instant::now();
        let kv_dtype = match cfg.kv_cache_dtype {
            KvCacheDtype::Auto | KvCacheDtype::F16 => KvDtype::F16,
            KvCacheDtype::Int8 => KvDtype::Int8,
        };
        let mut model = DeviceModel::load_shard_kv(&file, spec, &pool, opts, tp, kv_dtype)?;
        if let Some(q) = file.options().quantize {
            tracing::info!(
                format = q.name(),
                seconds = started.elapsed().as_secs_f64(),
                "loaded the model, its float weight matrices quantized at load"
            );
        }
        if cfg.graph_capture == npu_protocol::agent::GraphCapture::Auto {
            // Logged either way; `Err(why)`: steps stay eager.
            // A decode step holds at most one sequence a slot: no wider bucket is captured.
            let buckets = crate::model::default_step_buckets(cfg.max_slots as usize);
            let _ = model.enable_step_graphs(Some(&buckets))?;
        }
        // With a memory fraction the pool has what free memory gave; from here on the config
        // says what was built (less the blocks graphs keep for padded rows).
        let opts = model.options();
        let mut cfg = cfg.clone();
        cfg.num_blocks = opts.num_blocks as u32;
        cfg.kv_memory_fraction = None;
        let cfg = &cfg;
        let block_bytes = model.kv_block_bytes();
        let host_kv = HostKvPool::new(cfg.host_kv_blocks(block_bytes as u64), block_bytes)?;
        let handoff = match &cfg.handoff {
            None => None,
            Some(spec) => {
                let region = HandoffRegion::open(&spec.name).map_err(|e| {
                    EngineError::BadConfig(format!("the KV handoff region {}: {e}", spec.name))
                })?;
                if region.data_bytes() != spec.data_bytes {
                    return Err(EngineError::BadConfig(format!(
                        "the KV handoff region {} holds {} bytes, the config says {}",
                        spec.name,
                        region.data_bytes(),
                        spec.data_bytes
                    )));
                }
                Some(region)
            }
        };
        let bandwidth = measure_copy_bandwidth(&mut model, cfg.num_blocks.min(32))?;
        let kv = KvFacts {
            device_blocks: cfg.num_blocks,
            block_bytes: block_bytes as u64,
            host_blocks: host_kv.blocks(),
            // The CPU backend's device pool is host memory: nothing to page-lock.
            host_page_locked: false,
            d2h_bytes_per_s: bandwidth.d2h_bytes_per_s,
            h2d_bytes_per_s: bandwidth.h2d_bytes_per_s,
        };
        let mc = model.config();
        let facts = ModelFacts {
            name: mc.name.clone(),
            architecture: mc.arch.name().to_string(),
            vocab_size: mc.vocab as u32,
            n_layers: mc.n_layers as u32,
            hidden: mc.hidden as u32,
            n_heads: mc.n_heads as u32,
            n_kv_heads: mc.n_kv_heads as u32,
            head_dim: mc.head_dim as u32,
            context_length: mc.context_length as u32,
            eos_ids: checkpoint_eos_ids(&file)?,
            bos_id: checkpoint_bos_id(&file)?,
            backend: model.describe(),
            kv,
        };
        if cfg.long_context.is_some()
            && (mc.has_sliding_window() || mc.layers.iter().any(|l| l.rope != mc.rope))
        {
            return Err(EngineError::BadConfig(format!(
                "long-context mode is not available for architecture {:?} (its layers differ in \
                 attention window or rope)",
                mc.arch.name()
            )));
        }
        let long_layout = match cfg.long_context {
            Some(lc) => Some(long_context_layout(cfg, lc)?),
            None => None,
        };
        let long_context = long_layout.map(|layout| {
            let heads = Heads {
                n_heads: mc.n_heads,
                n_kv_heads: mc.n_kv_heads,
                head_dim: mc.head_dim,
                rope: mc.rope,
            };
            LongContext::new(layout, heads, mc.n_layers, cfg.max_slots as usize)
        });
        let limits = StepLimits {
            max_tokens: opts.max_tokens,
            max_slots: cfg.max_slots as usize,
            max_blocks_per_seq: cfg.max_blocks_per_seq as usize,
            num_blocks: opts.num_blocks,
            block_size: opts.block_size,
            vocab: mc.vocab,
            long_context: long_layout,
        };
        Ok(Self {
            cfg: cfg.clone(),
            model,
            facts,
            slots: (0..cfg.max_slots).map(|_| None).collect(),
            pool,
            limits,
            read: StepRead::default(),
            out: StepOutput::default(),
            host_kv,
            long_context,
            step_slots: Vec::new(),
            masks: Vec::new(),
            handoff,
            rank,
            steps: 0,
            forward: std::time::Duration::ZERO,
            host_block_bytes: block_bytes,
            lora: None,
        })
    }

    /// Long-context mode's counters (None when the mode is off).
    pub fn long_context_stats(&self) -> Option<LongContextStats> {
        self.long_context.as_ref().map(LongContext::stats)
    }

    /// Bytes of host memory long-context mode holds now.
    pub fn long_context_host_bytes(&self) -> usize {
        self.long_context
            .as_ref()
            .map_or(0, LongContext::host_bytes)
    }

    /// Bytes of one KV block on the device.
    pub fn kv_block_bytes(&self) -> usize {
        self.model.kv_block_bytes()
    }

    pub fn facts(&self) -> &ModelFacts {
        &self.facts
    }

    /// Measures block copies device->host and host->device over the first `blocks` blocks of
    /// the pool (at most the pool), leaving the pool unchanged.
    pub fn measure_kv_copy(&mut self, blocks: u32) -> Result<CopyBandwidth, EngineError> {
        measure_copy_bandwidth(&mut self.model, blocks.min(self.cfg.num_blocks))
    }

    pub fn config(&self) -> &AgentEngineConfig {
        &self.cfg
    }

    pub fn model_config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// The loaded model, for what benchmarks report about it.
    pub fn device_model(&self) -> &DeviceModel {
        &self.model
    }

    /// Turns LoRA adapters on (`npu_serving.max_loras`, `max_lora_rank`): admissions may then
    /// name an adapter. Refused by name where the backend, the family or tensor parallelism
    /// cannot take them.
    pub fn enable_lora(&mut self, cfg: &AgentLoraConfig) -> Result<(), EngineError> {
        let max_slots = self.slots.len();
        self.lora = Some(EngineLora::enable(&mut self.model, cfg, max_slots)?);
        Ok(())
    }

    /// Forget every slot (after a server-side reset).
    pub fn reset(&mut self) {
        if let Some(l) = self.lora.as_mut() {
            l.reset();
        }
        self.slots.iter_mut().for_each(|s| *s = None);
        if let Some(lc) = self.long_context.as_mut() {
            (0..self.slots.len()).for_each(|s| lc.reset_slot(s));
        }
    }

    /// Sleep level 1: forgets every slot and lets go of the KV pool (the device pool down to
    /// one block, the host pool emptied). On the CPU the weights stay where they are; on a
    /// device whose backend can, they are copied to host memory and their device memory freed
    /// (`DeviceModel::offload_weights`: host memory then holds the weights' bytes). Returns the
    /// bytes released (device memory, and the host KV pool). None when the weights are on a
    /// device that cannot move them (a tensor-parallel rank, a backend without it): level 1 then
    /// drops the model, as level 2.
    pub fn release_kv(&mut self) -> Result<Option<u64>, EngineError> {
        let on_device = !self.model.weights_in_host_memory();
        if on_device {
            if let Some(why) = self.model.weights_offload_refusal() {
                tracing::info!("sleep level 1 drops the model: {why}");
                return Ok(None);
            }
        }
        self.reset();
        let weights = if on_device {
            self.model.offload_weights()?
        } else {
            0
        };
        let device = match self.model.release_kv() {
            Ok(b) => b,
            Err(e) => {
                if on_device {
                    self.model.restore_weights()?;
                }
                return Err(e.into());
            }
        };
        let host = self.host_kv.blocks() as u64 * self.host_block_bytes as u64;
        self.host_kv = HostKvPool::new(0, self.host_block_bytes)?;
        tracing::info!(
            weight_bytes = weights,
            device_kv_bytes = device,
            host_kv_bytes = host,
            "sleep level 1: {}",
            if on_device {
                "weights copied to host memory and their device memory freed, KV pools released"
            } else {
                "KV pools released, weights kept"
            }
        );
        Ok(Some(weights + device + host))
    }

    /// Wakes from `release_kv`: the weights back on the device where they were moved, then the
    /// KV pools as they were at load, zeroed. Returns the bytes allocated again.
    pub fn restore_kv(&mut self) -> Result<u64, EngineError> {
        let weights = if self.model.weights_offload_refusal().is_none() {
            self.model.restore_weights()?
        } else {
            0
        };
        let device = self.model.restore_kv()?;
        let blocks = self.cfg.host_kv_blocks(self.host_block_bytes as u64);
        self.host_kv = HostKvPool::new(blocks, self.host_block_bytes)?;
        Ok(weights + device + blocks as u64 * self.host_block_bytes as u64)
    }

    fn slot_index(&self, slot: u32) -> Result<usize, EngineError> {
        if slot < self.cfg.max_slots {
            Ok(slot as usize)
        } else {
            Err(EngineError::BadPlan(format!(
                "slot {slot} is beyond the agent's {} slots",
                self.cfg.max_slots
            )))
        }
    }

    /// Runs one step: forget and admit slots, run the model on every sequence's new tokens,
    /// sample where asked. The plan is read (and checked) once, into the device's inputs.
    pub fn step(&mut self, plan: &dyn PlanSource) -> Result<StepResult, EngineError> {
        self.step_with_masks(plan, None)
    }

    /// `step` for a plan whose mask words may follow it: `following` delivers them once the
    /// forward pass is done, so the grammars' work on the server overlaps the device's.
    pub fn step_with_masks(
        &mut self,
        plan: &dyn PlanSource,
        following: Option<FollowingMasks<'_>>,
    ) -> Result<StepResult, EngineError> {
        let t_start = Instant::now();
        let step_id = plan.step_id();
        for s in plan.forget().iter() {
            let i = self.slot_index(s)?;
            self.slots[i] = None;
            if let Some(l) = self.lora.as_mut() {
                l.forget(i);
            }
            if let Some(lc) = self.long_context.as_mut() {
                lc.reset_slot(i);
            }
        }
        // Requests whose admission failed (their adapter cannot be read): they leave the step,
        // the others run.
        let mut failed = Vec::new();
        for a in plan.admissions() {
            let i = self.slot_index(a.slot)?;
            let admitted = crate::engine_lora::admit(self.lora.as_mut(), &mut self.model, i, a)?;
            if let Some(error) = admitted {
                self.slots[i] = None;
                failed.push(SeqFailure {
                    slot: a.slot,
                    error,
                });
                continue;
            }
            self.slots[i] = Some(Slot {
                params: a.params.clone(),
                history: TokenHistory::new(),
            });
            if let Some(lc) = self.long_context.as_mut() {
                lc.reset_slot(i);
            }
        }
        let copies = self.host_kv.run(
            &mut self.model,
            plan.kv_copies(),
            self.cfg.num_blocks,
            self.handoff.as_mut(),
        )?;
        let mut transfer = StepTransfer {
            swap_out_bytes: copies.to_host_bytes,
            swap_in_bytes: copies.to_device_bytes,
            copy_us: copies.micros,
            ..StepTransfer::default()
        };
        let slots = &mut self.slots;
        if plan.n_seqs() > 0 {
            self.read.read_skipping(
                plan,
                &self.limits,
                |s| slots[s as usize].is_some(),
                |s| failed.iter().any(|f| f.slot == s),
            )?;
        }
        if plan.n_seqs() == 0 || self.read.seqs.is_empty() {
            return Ok(StepResult {
                step_id,
                seqs: Vec::new(),
                timing: StepTiming::default(),
                transfer,
                failed,
            });
        }
        // History first: penalties see every token up to and including this step's inputs
        // (drafts join it as they are accepted, in `accept_drafts`).
        for (i, f) in self.read.seqs.iter().enumerate() {
            if let Some(slot) = slots[f.slot as usize].as_mut() {
                let tokens = self.read.tokens(i);
                let np = f.n_prompt as usize;
                slot.history.push_prompt(&tokens[..np]);
                for &t in &tokens[np..tokens.len() - f.n_draft as usize] {
                    slot.history.push_generated(t);
                }
            }
        }
        // Token masks of constrained slots (structured output), copied out of the plan (or,
        // when their words follow it, taken after the forward pass).
        self.masks.clear();
        let masks_follow = plan.masks_follow();
        if masks_follow && following.is_none() && self.rank == 0 {
            return Err(EngineError::BadPlan(
                "the plan's token masks follow it, and nothing here can receive them".into(),
            ));
        }
        for i in 0..plan.n_masks() {
            let (slot, words) = plan.mask(i);
            if self
                .read
                .sampling
                .iter()
                .any(|s| s.slot == slot && s.n_draft > 0)
            {
                return Err(EngineError::BadPlan(format!(
                    "slot {slot}: a token mask for a sequence with drafted tokens (a mask holds \
                     for one token)"
                )));
            }
            if !masks_follow {
                self.masks.push((slot, words.to_vec()));
            }
        }
        let greedy = plan.n_masks() == 0
            && self.read.logit_slots.iter().all(|&s| {
                slots[s as usize]
                    .as_ref()
                    .is_some_and(|slot| is_plain_greedy(&slot.params))
            });
        (transfer.input_bytes, transfer.block_table_bytes) = input_bytes(&self.read.inputs);
        if let Some(l) = self.lora.as_mut() {
            l.set_step(&mut self.model, &self.read)?;
        }
        let t_fwd = Instant::now();
        if let Some(lc) = self.long_context.as_mut() {
            self.step_slots.clear();
            self.step_slots
                .extend(self.read.seqs.iter().map(|f| f.slot));
            self.model
                .prepare_long_context(lc, &mut self.read.inputs, &self.step_slots)?;
        }
        self.model.forward_with(
            &self.read.inputs,
            greedy,
            &mut self.out,
            self.long_context.as_mut(),
        )?;
        let forward_us = t_fwd.elapsed().as_micros() as u64;
        self.steps += 1;
        self.forward += t_fwd.elapsed();
        let t_sample = Instant::now();
        if let (true, 0, Some(following)) = (masks_follow, self.rank, following) {
            let masks = following().map_err(EngineError::MasksLost)?;
            let expected: Vec<u32> = (0..plan.n_masks()).map(|i| plan.mask(i).0).collect();
            if masks.iter().map(|m| m.slot).ne(expected.iter().copied()) {
                return Err(EngineError::MasksLost(format!(
                    "masks came for slots {:?}, the plan masks slots {expected:?}",
                    masks.iter().map(|m| m.slot).collect::<Vec<_>>()
                )));
            }
            self.masks
                .extend(masks.into_iter().map(|m| (m.slot, m.words)));
        }
        let seqs = if self.rank != 0 {
            Vec::new()
        } else if self.out.picked_on_device {
            self.picked_on_device()
        } else {
            self.sample()?
        };
        if self.rank == 0 {
            self.accept_drafts(&seqs);
        }
        let sample_us = t_sample.elapsed().as_micros() as u64;
        // A tensor-parallel rank other than 0 ran its shard; rank 0 answers for the group.
        let seqs = if self.rank == 0 { seqs } else { Vec::new() };
        Ok(StepResult {
            step_id,
            seqs,
            timing: StepTiming {
                forward_us,
                sample_us,
                total_us: t_start.elapsed().as_micros() as u64,
            },
            transfer,
            failed,
        })
    }

    /// The device's picks (plain greedy rows), each drafting sequence's kept while they equal
    /// its drafts.
    fn picked_on_device(&self) -> Vec<SeqResult> {
        let pick = |row: usize| TokenLogprob {
            token: self.out.ids[row] as u32,
            logprob: self.out.logprobs[row],
        };
        self.read
            .sampling
            .iter()
            .map(|s| {
                let drafts = self.read.drafts(s.seq);
                let mut tokens = vec![pick(s.first_row)];
                while let Some(&d) = drafts.get(tokens.len() - 1) {
                    if tokens[tokens.len() - 1].token != d {
                        break;
                    }
                    tokens.push(pick(s.first_row + tokens.len()));
                }
                let token = tokens.remove(0);
                SeqResult {
                    slot: s.slot,
                    token,
                    top: Vec::new(),
                    extra: tokens,
                }
            })
            .collect()
    }

    /// The drafts each result kept (one per token sampled after its first) join their slot's
    /// history as generated tokens, as they would have one step at a time.
    fn accept_drafts(&mut self, results: &[SeqResult]) {
        for (s, r) in self.read.sampling.iter().zip(results) {
            if r.extra.is_empty() {
                continue;
            }
            let drafts = &self.read.drafts(s.seq)[..r.extra.len()];
            if let Some(slot) = self.slots[s.slot as usize].as_mut() {
                for &t in drafts {
                    slot.history.push_generated(t);
                }
            }
        }
    }

    /// Samples every sequence that samples on the pool, each task owning its sequence's logit
    /// rows. A drafting sequence samples row after row, each with the history and the draw index
    /// it would have had one step at a time, while the token sampled equals the next draft: so
    /// its tokens are exactly those of decoding without drafts.
    fn sample(&mut self) -> Result<Vec<SeqResult>, EngineError> {
        let vocab = self.model.config().vocab;
        let read = &self.read;
        let n = read.sampling.len();
        let mut rows = self.out.logits.chunks_exact_mut(vocab);
        let groups: Vec<Mutex<Vec<&mut [f32]>>> = read
            .sampling
            .iter()
            .map(|s| Mutex::new(rows.by_ref().take(s.n_draft as usize + 1).collect()))
            .collect();
        type Sampled = Result<Vec<SampleOutput>, SamplerError>;
        let outs: Vec<Mutex<Option<Sampled>>> = (0..n).map(|_| Mutex::new(None)).collect();
        let slots = &self.slots;
        let masks = &self.masks;
        self.pool.run(n, |g| {
            let s = read.sampling[g];
            let Some(Some(slot)) = slots.get(s.slot as usize) else {
                return;
            };
            let mut logits =
                std::mem::take(&mut *groups[g].lock().unwrap_or_else(|e| e.into_inner()));
            let mask = masks
                .iter()
                .find(|(m, _)| *m == s.slot)
                .map(|(_, w)| w.as_slice());
            let drafts = read.drafts(s.seq);
            let out = SAMPLER.with(|sampler| {
                let mut sampler = sampler.borrow_mut();
                sample_with_drafts(&mut sampler, &mut logits, slot, drafts, mask)
            });
            *outs[g].lock().unwrap_or_else(|e| e.into_inner()) = Some(out);
        })?;
        let mut seqs = Vec::with_capacity(n);
        for (g, out) in outs.into_iter().enumerate() {
            let mut tokens = out
                .into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .ok_or_else(|| {
                    EngineError::BadPlan(format!("sequence {g} of the step was not sampled"))
                })??
                .into_iter();
            let first = tokens.next().ok_or_else(|| {
                EngineError::BadPlan(format!("sequence {g} of the step sampled nothing"))
            })?;
            seqs.push(SeqResult {
                slot: read.sampling[g].slot,
                token: first.token,
                top: first.top,
                extra: tokens.map(|t| t.token).collect(),
            });
        }
        Ok(seqs)
    }
}

/// One sequence's tokens from its logit rows (`rows[0]` after its last real token, `rows[i]`
/// after draft `i - 1`): sampled in turn while each equals the next draft, the drafts kept so
/// far counted into the history the penalties see and into the draw index. Without drafts,
/// the one token of `rows[0]`.
fn sample_with_drafts(
    sampler: &mut Sampler,
    rows: &mut [&mut [f32]],
    slot: &Slot,
    drafts: &[u32],
    mask: Option<&[u32]>,
) -> Result<Vec<SampleOutput>, SamplerError> {
    let base = slot.history.n_generated();
    let mut history: Option<TokenHistory> = None;
    let mut out = Vec::with_capacity(rows.len());
    for (i, logits) in rows.iter_mut().enumerate() {
        if i > 0 {
            // Draft i - 1 was kept: later rows see it as generated (only penalties read the
            // history beyond its length, so it is copied only for them).
            if has_penalties(&slot.params) {
                history
                    .get_or_insert_with(|| slot.history.clone())
                    .push_generated(drafts[i - 1]);
            }
        }
        let h = history.as_ref().unwrap_or(&slot.history);
        // A mask is made for the first token only; drafting sequences carry none.
        let m = if i == 0 { mask } else { None };
        let o = sampler.sample_masked(logits, &slot.params, h, base + i as u64, m)?;
        let equal = drafts.get(i) == Some(&o.token.token);
        out.push(o);
        if !equal {
            break;
        }
    }
    Ok(out)
}

//! `npu-serving serve`: loads the YAML config, resolves the model, starts one agent process per
//! `serving_config.agent_ports` entry, runs the engine thread and the HTTP server until
//! SIGINT/SIGTERM, then drains and shuts everything down (agents exit, segments are removed).

use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use npu_model::ModelConfig;
use npu_model::{Checkpoint, LoadOptions};
use npu_protocol::agent::TensorParallelSpec;
use npu_protocol::agent::{
    handoff_copies_per_step, kv_copies_per_step, AgentEngineConfig, HandoffSpec, KvFacts,
};
use npu_protocol::shm::{
    handoff_blocks, segment_name, slot_floats_for, GroupRegion, HandoffRegion, HANDOFF_REGION_ID,
};
use npu_tokenizer::Tokenizer;

use crate::agents::group::create_region;
use crate::agents::{AgentLaunch, AgentLink, AgentPool, AgentSpec, GroupLink};
use crate::api::{ApiContext, ApiSettings, SamplingDefaults};
use crate::auth::{ApiKeys, Authenticated, API_KEY_ENV};
use crate::config::{DeviceKind, GenerationConfigMode, ServerConfig};
use crate::engine::scheduler::KvHostConfig;
use crate::engine::{start_engine, EngineConfig, StepAgent};
use crate::http::{HttpServer, ShutdownSignal, TlsAcceptor};
use crate::kv_events::{expand_topic, KvEventPublisher};
use crate::metrics::Metrics;

/// Command-line arguments of `npu-serving serve`.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct ServeArgs {
    /// The YAML config (llm-serving's layout plus an `npu_serving:` section).
    #[arg(long, default_value = "configs/smollm2-cpu.yaml")]
    pub config: PathBuf,
    /// Address to listen on (overrides serving_config.server_ip).
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on (overrides serving_config.server_port); 0 picks a free port.
    #[arg(long)]
    pub port: Option<u16>,
    /// The model: a GGUF file, a Hugging Face model directory or ORG/NAME in the local Hugging
    /// Face hub cache (overrides npu_serving.model_file; default: the default model, fetched
    /// on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Refuse every unknown config key (by default unknown keys in llm-serving's sections only
    /// warn; unknown keys in npu_serving are always refused).
    #[arg(long)]
    pub strict_config: bool,
    /// An API key requests must present (`Authorization: Bearer KEY` or `x-api-key: KEY`);
    /// repeat for more. Joins npu_serving.api_keys and NPU_SERVING_API_KEY.
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_keys: Vec<String>,
}

/// What the model file says that the server needs before the agents start.
pub(crate) struct ModelInfo {
    pub(crate) path: PathBuf,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) vocab: u32,
    pub(crate) context: u32,
    pub(crate) hidden: usize,
    /// A model directory's generation_config.json sampling defaults (none for a GGUF file, or
    /// with `npu_serving.generation_config: ignore`).
    pub(crate) sampling_defaults: SamplingDefaults,
    /// The model's hyper-parameters (LoRA adapters are checked against them).
    pub(crate) config: ModelConfig,
}

/// Refuses a configured device this binary has no backend for, naming the cargo feature that
/// builds one.
pub fn check_device(device: DeviceKind, built: &[DeviceKind]) -> anyhow::Result<()> {
    if built.contains(&device) {
        return Ok(());
    }
    let have: Vec<&str> = built.iter().map(|d| d.name()).collect();
    match device.cargo_feature() {
        Some(feature) => bail!(
            "npu_serving.device: {device} is not built into this binary (it runs on: {}); \
             rebuild with `cargo build --release --features {feature}`",
            have.join(", ")
        ),
        None => bail!(
            "npu_serving.device: {device} is not built into this binary (it runs on: {})",
            have.join(", ")
        ),
    }
}

/// Runs the server until a termination signal has been handled. `built` lists the devices this
/// binary has backends for (the agents it starts are this same binary).
pub fn run(args: ServeArgs, built: &[DeviceKind]) -> anyhow::Result<()> {
    let mut cfg = ServerConfig::from_yaml_file_with(&args.config, args.strict_config)
        .with_context(|| format!("config {}", args.config.display()))?;
    if let Some(host) = &args.host {
        cfg.serving_config.server_ip = host.clone();
    }
    if let Some(port) = args.port {
        cfg.serving_config.server_port = port;
    }
    if !cfg.npu_serving.models.entries.is_empty() {
        // Several models behind this server, each loaded on demand: crate::models runs it.
        return crate::models::run(cfg, &args, built);
    }
    check_device(cfg.npu_serving.device, built)?;
    let (api_keys, tls) = access(&cfg, &args.api_keys)?;
    let model = load_model_info(&cfg, args.model.clone())?;
    cfg.model_warnings(model.vocab, model.context);
    cfg.check_kv_pool(model.context)
        .with_context(|| format!("config {}", args.config.display()))?;
    let max_model_len = cfg.max_model_len(model.context);
    let mut eos_ids = model.tokenizer.eos_ids().to_vec();
    for &id in cfg.end_token_ids() {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }
    let mut engine_cfg = EngineConfig::from_server_config(&cfg, max_model_len, eos_ids);
    // LoRA adapters: those listed are read and checked against the model before any agent
    // starts (a bad one is refused naming its entry).
    let lora = crate::lora::registry_for(&cfg, &model.config).map_err(anyhow::Error::msg)?;
    engine_cfg.lora = lora.clone().map(crate::lora::LoraHandle);
    engine_cfg
        .scheduler
        .validate()
        .context("the config's limits do not work together")?;

    // Bind before starting agents: a busy port fails at once.
    let addr = cfg.server_addr();
    let listener = TcpListener::bind(&addr).with_context(|| format!("cannot listen on {addr}"))?;

    // Prefill/decode disaggregation: one region all agents map, KV blocks handed over through
    // it. It lives (and its name with it) until this function returns.
    let handoff_region = if cfg.disaggregated() {
        let name = segment_name(HANDOFF_REGION_ID).context("naming the KV handoff region")?;
        let bytes = cfg.npu_serving.handoff_space_mb << 20;
        Some(
            HandoffRegion::create(&name, bytes)
                .context("creating the KV handoff region (npu_serving.handoff_space_mb)")?,
        )
    } else {
        None
    };
    let handoff = handoff_region.as_ref().map(|r| HandoffSpec {
        name: r.name().to_string(),
        data_bytes: r.data_bytes(),
    });
    let tp = cfg.tensor_parallel_size();
    // Tensor parallelism: one region per group, through which its ranks sum and gather.
    let slot_floats = slot_floats_for(model.hidden, cfg.npu_serving.max_tokens_per_step as usize);
    let regions: Vec<GroupRegion> = if tp > 1 {
        (0..cfg.num_groups() as u32)
            .map(|g| create_region(g, tp as u32, slot_floats))
            .collect::<Result<_, _>>()
            .context("creating the tensor-parallel groups' shared memory")?
    } else {
        Vec::new()
    };
    let region_names: Vec<String> = regions.iter().map(|r| r.name().to_string()).collect();
    let specs: Vec<AgentSpec> = agent_specs(&cfg, &engine_cfg, &model.path, handoff, &region_names)
        .into_iter()
        .map(|s| s.with_token_masks(model.tokenizer.vocab_size() as u32))
        .map(|mut s| {
            s.lora = crate::lora::agent_config(&cfg);
            s
        })
        .collect();
    let launch = AgentLaunch::default();
    tracing::info!(
        agents = specs.len(),
        tensor_parallel_size = tp,
        groups = cfg.num_groups(),
        threads_per_agent = specs[0].engine.threads,
        model = %model.path.display(),
        "starting agents (one per serving_config.agent_ports entry; each talks to this server \
         over its own private socket pair, no port is opened)"
    );
    let mut groups: Vec<GroupLink> = Vec::new();
    let mut links: Vec<AgentLink> = Vec::new();
    let agents_started = std::time::Instant::now();
    if tp > 1 {
        groups = start_groups(specs, &launch, regions, tp)?;
    } else {
        links = AgentPool::start(specs, launch)
            .context("starting the agents")?
            .into_links();
    }
    // What a wake is compared with: spawn to accepted handshake, the model load included.
    let cold_start = agents_started.elapsed();
    tracing::info!(
        cold_start_s = cold_start.as_secs_f64(),
        "agents started (cold load)"
    );
    if cfg.npu_serving.kv_cache_memory_fraction.is_some() {
        let blocks = if groups.is_empty() {
            kv_pool_from_agents(&mut links)?
        } else {
            let mut ranks: Vec<&mut AgentLink> =
                groups.iter_mut().flat_map(|g| g.ranks_mut()).collect();
            kv_pool_from_agent_refs(&mut ranks)?
        };
        cfg.check_kv_pool_blocks(model.context, blocks)
            .with_context(|| format!("config {}", args.config.display()))?;
        engine_cfg.scheduler.num_blocks = blocks as usize;
        engine_cfg
            .scheduler
            .validate()
            .context("the KV pool the agents sized does not work with the config's limits")?;
    }
    let num_blocks = engine_cfg.scheduler.num_blocks as u32;
    engine_cfg.scheduler.kv_host = links
        .first()
        .and_then(|l| kv_host_config(&l.facts().kv, num_blocks, cfg.npu_serving.swap_space_mb));
    if let (Some(region), Some(link)) = (&handoff_region, links.first()) {
        let block_bytes = link.facts().kv.block_bytes;
        engine_cfg.handoff_blocks = handoff_blocks(region.data_bytes(), block_bytes);
        engine_cfg.handoff_block_bytes = block_bytes;
        engine_cfg.scheduler.handoff_copies_per_step = handoff_copies_per_step(num_blocks) as usize;
        let roles: Vec<&str> = engine_cfg.roles.iter().map(|r| r.name()).collect();
        tracing::info!(
            roles = %roles.join(","),
            handoff_blocks = engine_cfg.handoff_blocks,
            block_bytes,
            "prefill/decode disaggregation: KV blocks handed over through shared memory"
        );
        if engine_cfg.handoff_blocks < engine_cfg.scheduler.max_blocks_one_seq() as u32 {
            tracing::warn!(
                handoff_space_mb = cfg.npu_serving.handoff_space_mb,
                handoff_blocks = engine_cfg.handoff_blocks,
                max_blocks_per_seq = engine_cfg.scheduler.max_blocks_one_seq(),
                "npu_serving.handoff_space_mb holds fewer KV blocks than one sequence may: \
                 longer sequences are decoded where they were prefilled"
            );
        }
    }
    let agents: Vec<Box<dyn StepAgent>> = if groups.is_empty() {
        links
            .into_iter()
            .map(|l| Box::new(l) as Box<dyn StepAgent>)
            .collect()
    } else {
        groups
            .into_iter()
            .map(|g| Box::new(g) as Box<dyn StepAgent>)
            .collect()
    };
    engine_cfg.tensor_parallel_size = tp as u32;

    let metrics = Arc::new(Metrics::default());
    let mut server = HttpServer::new(listener, cfg.http_limits(), metrics.clone())?;
    if let Some(tls) = tls {
        tls.reload_on_sighup()?;
        server = server.with_tls(tls);
    }
    let local = server.local_addr()?;
    let kv_events = match &cfg.npu_serving.kv_events {
        Some(ev) => {
            let topic = expand_topic(&ev.topic, &replica_address(local), cfg.model_name());
            let publisher = KvEventPublisher::start(
                &ev.endpoint,
                topic.clone(),
                engine_cfg.scheduler.block_size as u32,
            )
            .with_context(|| {
                format!(
                    "cannot publish KV events on npu_serving.kv_events_endpoint {:?}",
                    ev.endpoint
                )
            })?;
            tracing::info!(endpoint = ?ev.endpoint, %topic, "publishing KV-cache events");
            Some(publisher)
        }
        None => None,
    };
    let shutdown = ShutdownSignal::new();
    shutdown.trigger_on_termination_signals()?;
    let engine = start_engine(
        engine_cfg,
        agents,
        model.tokenizer.clone(),
        Box::new(server.event_sink()),
        metrics.clone(),
        Some(shutdown.clone()),
        kv_events.as_ref().map(KvEventPublisher::sender),
    )?;
    crate::engine::EngineStats::set(
        &engine.handle.stats.sleep.cold_start_us,
        cold_start.as_micros() as u64,
    );
    let api = Authenticated::wrap(
        Arc::new({
            let api = ApiContext::new(
                ApiSettings::from_config(&cfg, model.context, model.sampling_defaults),
                model.tokenizer,
                engine.handle.stats.clone(),
                metrics,
            );
            match lora {
                Some(reg) => api.with_lora(reg),
                None => api,
            }
        }),
        api_keys,
        cfg.npu_serving.access.protect_health,
    );
    tracing::info!(%local, model = cfg.model_name(), max_model_len, "serving");
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {local}")?;
        if let Some(addr) = kv_events.as_ref().and_then(KvEventPublisher::local_addr) {
            writeln!(out, "kv events on tcp://{addr}")?;
        }
        out.flush()?;
    }
    let served = server.run(shutdown, engine.handle.clone(), api);
    engine.shutdown_and_join();
    drop(kv_events);
    drop(handoff_region);
    served?;
    tracing::info!("server stopped");
    Ok(())
}

/// The API keys (config, `--api-key`, NPU_SERVING_API_KEY) and the TLS certificate, read
/// before anything starts so a bad key file or certificate is refused at once, by its key.
pub(crate) fn access(
    cfg: &ServerConfig,
    cli_keys: &[String],
) -> anyhow::Result<(ApiKeys, Option<TlsAcceptor>)> {
    let access = &cfg.npu_serving.access;
    let keys = ApiKeys::resolve(access, cli_keys, std::env::var(API_KEY_ENV).ok(), |v| {
        std::env::var(v).ok()
    })
    .map_err(anyhow::Error::msg)?;
    let tls = match &access.tls {
        Some(t) => Some(TlsAcceptor::load(&t.cert, &t.key)?),
        None => None,
    };
    tracing::info!(
        api_keys = keys.len(),
        protect_health = access.protect_health,
        tls = tls.is_some(),
        "access"
    );
    Ok((keys, tls))
}

/// Resolves the model (`--model`, else `npu_serving.model_file`, else the default model,
/// fetched when absent) and reads its tokenizer and limits.
pub(crate) fn load_model_info(
    cfg: &ServerConfig,
    cli_model: Option<PathBuf>,
) -> anyhow::Result<ModelInfo> {
    let requested = cli_model.or_else(|| cfg.npu_serving.model_file.clone());
    let path = npu_model::resolve_model(requested.as_deref()).context("resolving the model")?;
    let quantize = match cfg.npu_serving.quantize.as_deref() {
        None => None,
        Some(q) => LoadOptions::parse_quantize(q)
            .with_context(|| format!("npu_serving.quantize = {q:?}"))?,
    };
    let ck = Checkpoint::open_with(&path, LoadOptions { quantize })
        .with_context(|| format!("opening {}", path.display()))?;
    let mc = ck
        .config()
        .with_context(|| format!("model {}", path.display()))?;
    let tokenizer = match ck.as_gguf() {
        Some(gguf) => Tokenizer::for_model(gguf, &path),
        None => Tokenizer::from_dir(&path),
    }
    .with_context(|| format!("the tokenizer of {}", path.display()))?;
    tracing::info!(model = %ck.describe(), "model");
    check_tensor_parallel(cfg, &mc, &ck)?;
    let sampling_defaults = if ck.is_dir() {
        sampling_defaults(cfg, &path)?
    } else {
        SamplingDefaults::default()
    };
    Ok(ModelInfo {
        path,
        tokenizer,
        vocab: mc.vocab as u32,
        context: mc.context_length as u32,
        hidden: mc.hidden,
        sampling_defaults,
        config: mc,
    })
}

/// A model directory's `generation_config.json` sampling defaults, as vLLM's
/// `--generation-config auto` applies them (none when the file is absent or
/// `npu_serving.generation_config` is `ignore`); a damaged file is an error naming its key.
fn sampling_defaults(
    cfg: &ServerConfig,
    dir: &std::path::Path,
) -> anyhow::Result<SamplingDefaults> {
    let file = dir.join(npu_hf::generation::FILE);
    let mode = cfg.npu_serving.generation_config;
    if mode == GenerationConfigMode::Ignore {
        if file.is_file() {
            tracing::info!(
                file = %file.display(),
                "the model's generation_config.json does not set sampling defaults \
                 (npu_serving.generation_config: ignore)"
            );
        }
        return Ok(SamplingDefaults::default());
    }
    let Some(g) = npu_hf::GenerationConfig::read(dir)
        .with_context(|| format!("reading {}", file.display()))?
    else {
        return Ok(SamplingDefaults::default());
    };
    let d = SamplingDefaults::from_generation_config(&g)
        .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    if d.is_empty() {
        return Ok(d);
    }
    tracing::info!(
        defaults = %d.describe(),
        file = %file.display(),
        "Default sampling parameters have been overridden by the model's Hugging Face \
         generation config: a request that does not set these fields gets these values \
         (npu_serving.generation_config: ignore turns this off)"
    );
    if let (Some(n), true) = (d.max_new_tokens, cfg.npu_serving.max_new_tokens_default_set) {
        tracing::info!(
            generation_config_max_new_tokens = n,
            max_new_tokens_default = cfg.npu_serving.max_new_tokens_default,
            "npu_serving.max_new_tokens_default is set: it stays the default max_tokens"
        );
    }
    Ok(d)
}

/// Refuses a `tensor_parallel_size` the model cannot be split over, naming the key, the
/// dimension that does not divide and the sizes that would work.
pub fn check_tensor_parallel(
    cfg: &ServerConfig,
    mc: &ModelConfig,
    gguf: &Checkpoint,
) -> anyhow::Result<()> {
    use npu_model::shard;
    let t = cfg.tensor_parallel_size();
    if t <= 1 {
        return Ok(());
    }
    if let Err(e) = shard::check(mc, Some(gguf), t) {
        let agents = cfg.num_agents();
        let work: Vec<String> = shard::workable_sizes(mc, Some(gguf), agents.max(8))
            .into_iter()
            .map(|s| s.to_string())
            .collect();
        bail!(
            "npu_serving.tensor_parallel_size: {t} is not allowed for the model {} ({}: {} \
             attention heads, {} KV heads, FFN width {}): {e}; sizes that would work with this \
             model: {}",
            mc.name,
            mc.arch.name(),
            mc.n_heads,
            mc.n_kv_heads,
            mc.ff,
            work.join(", ")
        );
    }
    let split = cfg.npu_serving.moe_tensor_parallel;
    if let Some(e) = (0..t).find_map(|r| shard::shard_split(mc, Some(gguf), t, r, split).err()) {
        bail!(
            "npu_serving.moe_tensor_parallel: {} is not allowed for the model {} with \
             tensor_parallel_size {t}: {e}",
            split.name(),
            mc.name
        );
    }
    if shard::is_uneven(mc, Some(gguf), t) {
        tracing::info!(
            tensor_parallel_size = t,
            heads = mc.n_heads,
            kv_heads = mc.n_kv_heads,
            "the model's heads (or FFN blocks) do not split evenly over the ranks: some ranks \
             compute more than others, and each step waits for the busiest"
        );
    }
    Ok(())
}

/// Starts every tensor-parallel group (the groups in parallel, each group's ranks together).
fn start_groups(
    specs: Vec<AgentSpec>,
    launch: &AgentLaunch,
    regions: Vec<GroupRegion>,
    tp: usize,
) -> anyhow::Result<Vec<GroupLink>> {
    let removed = npu_protocol::shm::cleanup_stale_segments();
    if !removed.is_empty() {
        tracing::info!(
            ?removed,
            "removed shared-memory segments of a crashed earlier run"
        );
    }
    let mut per_group: Vec<Vec<AgentSpec>> = Vec::new();
    for (i, spec) in specs.into_iter().enumerate() {
        if i % tp == 0 {
            per_group.push(Vec::new());
        }
        if let Some(g) = per_group.last_mut() {
            g.push(spec);
        }
    }
    let outcomes: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = per_group
            .into_iter()
            .zip(regions)
            .enumerate()
            .map(|(g, (specs, region))| {
                s.spawn(move || GroupLink::start(g as u32, specs, launch, region))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a group's start-up thread panicked"))
            .collect()
    });
    let mut groups = Vec::new();
    let mut first = None;
    for o in outcomes {
        match o {
            Ok(g) => groups.push(g),
            Err(f) if first.is_none() => first = Some(f),
            Err(f) => tracing::warn!(%f, "another group failed to start too"),
        }
    }
    match first {
        Some(f) => {
            drop(groups);
            Err(anyhow::Error::new(f).context("starting the tensor-parallel groups"))
        }
        None => Ok(groups),
    }
}

/// The KV pool the server plans with when the agents sized theirs from free device memory: the
/// smallest any agent reported (the scheduler gives every agent the same pool). Each agent is
/// pinned to it, so a restarted one allocates exactly that many blocks.
pub(crate) fn kv_pool_from_agents(links: &mut [crate::agents::AgentLink]) -> anyhow::Result<u32> {
    let mut refs: Vec<&mut AgentLink> = links.iter_mut().collect();
    kv_pool_from_agent_refs(&mut refs)
}

/// `kv_pool_from_agents` over the agents however they are held (every rank of every group).
fn kv_pool_from_agent_refs(links: &mut [&mut AgentLink]) -> anyhow::Result<u32> {
    let reported: Vec<u32> = links.iter().map(|l| l.facts().kv.device_blocks).collect();
    let blocks = reported.iter().copied().min().unwrap_or(0);
    if blocks == 0 {
        bail!(
            "npu_serving.kv_cache_memory_fraction: an agent reported no KV pool in its handshake \
             (agents {reported:?})"
        );
    }
    let block_bytes = links.first().map_or(0, |l| l.facts().kv.block_bytes);
    tracing::info!(
        blocks,
        per_agent = ?reported,
        pool_bytes = u64::from(blocks) * block_bytes,
        "KV pool sized from free device memory (npu_serving.kv_cache_memory_fraction)"
    );
    if reported.iter().any(|&r| r != blocks) {
        tracing::warn!(
            per_agent = ?reported,
            blocks,
            "the agents found different free memory: every agent's pool is used up to the \
             smallest"
        );
    }
    for link in links.iter_mut() {
        link.pin_kv_blocks(blocks);
    }
    Ok(blocks)
}

/// The scheduler's view of an agent's host KV pool, from its handshake (every agent has the
/// same pool and model); None without one.
pub(crate) fn kv_host_config(
    kv: &KvFacts,
    num_blocks: u32,
    swap_space_mb: u64,
) -> Option<KvHostConfig> {
    if kv.host_blocks == 0 {
        return None;
    }
    tracing::info!(
        host_blocks = kv.host_blocks,
        block_bytes = kv.block_bytes,
        page_locked = kv.host_page_locked,
        d2h_gb_per_s = kv.d2h_bytes_per_s / 1e9,
        h2d_gb_per_s = kv.h2d_bytes_per_s / 1e9,
        "host KV pool (npu_serving.swap_space_mb): swap preemption and the prefix cache's host tier"
    );
    Some(KvHostConfig {
        host_blocks: kv.host_blocks as usize,
        block_bytes: kv.block_bytes,
        d2h_bytes_per_s: kv.d2h_bytes_per_s,
        h2d_bytes_per_s: kv.h2d_bytes_per_s,
        max_copies_per_step: kv_copies_per_step(num_blocks, swap_space_mb) as usize,
    })
}

/// One spec per `serving_config.agent_ports` entry (only their number matters: agents talk to
/// the server over private socket pairs), sized by the engine's scheduler limits.
/// With tensor parallelism (`group_regions`: one region per group), agent `i` is rank
/// `i % tensor_parallel_size` of group `i / tensor_parallel_size` (its device is still
/// `start_device_id + i`, as llm-serving's rank `i` runs on).
pub(crate) fn agent_specs(
    cfg: &ServerConfig,
    engine: &EngineConfig,
    model: &std::path::Path,
    handoff: Option<HandoffSpec>,
    group_regions: &[String],
) -> Vec<AgentSpec> {
    let tp = cfg.tensor_parallel_size();
    let agents = cfg.num_agents().max(1);
    let threads = match cfg.npu_serving.threads_per_agent {
        0 => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / agents).max(1) as u32
        }
        n => n,
    };
    let s = &engine.scheduler;
    (0..agents)
        .map(|i| {
            let engine = AgentEngineConfig {
                device: cfg.npu_serving.device,
                device_id: cfg.serving_config.start_device_id.saturating_add(i as u32),
                model_path: model.to_path_buf(),
                num_blocks: s.num_blocks as u32,
                block_size: s.block_size as u32,
                max_slots: s.slots() as u32,
                max_tokens_per_step: s.max_tokens_per_step as u32,
                max_blocks_per_seq: s.max_blocks_per_seq as u32,
                threads,
                swap_space_mb: cfg.npu_serving.swap_space_mb,
                long_context: cfg.npu_serving.long_context,
                handoff: handoff.clone(),
                kv_memory_fraction: cfg.npu_serving.kv_cache_memory_fraction,
                quantize: cfg.npu_serving.quantize.clone(),
                kv_cache_dtype: cfg.npu_serving.kv_cache_dtype,
                graph_capture: cfg.npu_serving.graph_capture,
                tensor_parallel: group_regions.get(i / tp).map(|region| TensorParallelSpec {
                    rank: (i % tp) as u32,
                    size: tp as u32,
                    region: region.clone(),
                    wait_ms: cfg.npu_serving.step_deadline_ms,
                    join_ms: AgentLaunch::default().startup_timeout.as_millis() as u64,
                    whole_experts: cfg.npu_serving.moe_tensor_parallel
                        == npu_model::shard::ExpertSplit::WholeExperts,
                }),
            };
            AgentSpec::new(i as u32, engine)
        })
        .collect()
}

/// How a gateway reaches this replica, for the KV events' topic: `$POD_IP` (Kubernetes' downward
/// API) when set, else the address the server listens on (the host name when that is every
/// interface), with the port.
fn replica_address(local: std::net::SocketAddr) -> String {
    let host = match std::env::var("POD_IP") {
        Ok(ip) if !ip.trim().is_empty() => ip.trim().to_string(),
        _ if local.ip().is_unspecified() => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| local.ip().to_string()),
        _ => local.ip().to_string(),
    };
    format!("{host}:{}", local.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_not_built_in_is_refused_naming_its_feature() {
        let cpu_only = [DeviceKind::Cpu];
        check_device(DeviceKind::Cpu, &cpu_only).unwrap();
        for (device, feature) in [(DeviceKind::Cuda, "cuda"), (DeviceKind::Ascend, "ascend")] {
            let e = check_device(device, &cpu_only).unwrap_err().to_string();
            assert!(e.contains(&format!("--features {feature}")), "{e}");
            assert!(e.contains("npu_serving.device"), "{e}");
            assert!(e.contains("it runs on: cpu"), "{e}");
        }
        check_device(DeviceKind::Cuda, &[DeviceKind::Cpu, DeviceKind::Cuda]).unwrap();
    }
}

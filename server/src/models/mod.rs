//! Several models behind one server (`npu_serving.models`): every listed model's own config is
//! read and its file, tokenizer and limits checked at start; none is loaded until a request
//! names it. Then its agents start and its engine runs, held requests go to it, and when more
//! than `npu_serving.max_resident_models` would be loaded the least recently used idle one is
//! unloaded (its engine drains and its agents exit) first. `run` is `serve`'s path for such a
//! config; `router` moves the requests, `handler` picks the model of each, `status` keeps the
//! figures.

mod handler;
mod router;
mod status;

use std::io::Write;
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};

use crate::agents::{AgentLaunch, AgentLink, AgentPool, AgentSpec};
use crate::api::{ApiContext, ApiSettings};
use crate::auth::Authenticated;
use crate::config::{DeviceKind, ModelEntry, ServerConfig};
use crate::engine::{start_engine, EngineConfig, EventOutput, RunningEngine, StepAgent};
use crate::http::{HttpServer, ShutdownSignal};
use crate::metrics::Metrics;
use crate::serve::{self, ServeArgs};

pub use status::{ModelState, ModelStatus, ModelsStatus};

use router::{ModelSpec, Router};

/// Serves the models of `cfg.npu_serving.models` until a termination signal has been handled.
/// `cfg` is the listing config (its serving_config, access and HTTP limits apply to the
/// server); each model's own config gives everything about that model.
pub fn run(cfg: ServerConfig, args: &ServeArgs, built: &[DeviceKind]) -> anyhow::Result<()> {
    if args.model.is_some() {
        bail!(
            "--model cannot be used with npu_serving.models: each models entry's own config \
             names its model file (npu_serving.model_file)"
        );
    }
    let (api_keys, tls) = serve::access(&cfg, &args.api_keys)?;
    let base = args.config.parent().unwrap_or(Path::new("."));
    let mut specs = Vec::new();
    let mut contexts = Vec::new();
    let mut status = Vec::new();
    for (i, entry) in cfg.npu_serving.models.entries.iter().enumerate() {
        let (spec, settings) = read_model(i, entry, base, args.strict_config, built)?;
        status.push(ModelStatus::new(spec.name.clone(), settings.max_model_len));
        contexts.push((settings, spec.tokenizer.clone()));
        specs.push(spec);
    }
    let status = Arc::new(ModelsStatus {
        models: status,
        max_resident: cfg.npu_serving.models.max_resident,
    });

    let addr = cfg.server_addr();
    let listener = TcpListener::bind(&addr).with_context(|| format!("cannot listen on {addr}"))?;
    let metrics = Arc::new(Metrics::default());
    let mut server = HttpServer::new(listener, cfg.http_limits(), metrics.clone())?;
    if let Some(tls) = tls {
        tls.reload_on_sighup()?;
        server = server.with_tls(tls);
    }
    let local = server.local_addr()?;
    let shutdown = ShutdownSignal::new();
    shutdown.trigger_on_termination_signals()?;
    let notes = router::Notes::default();
    let router = Router::start(
        specs,
        status.clone(),
        server.event_sink(),
        metrics.clone(),
        shutdown.clone(),
        notes.clone(),
    )
    .context("starting the model router")?;
    let stats = router.handle.stats.clone();
    let contexts = contexts
        .into_iter()
        .map(|(settings, tokenizer)| {
            ApiContext::new(settings, tokenizer, stats.clone(), metrics.clone())
        })
        .collect();
    let handler = handler::ModelsHandler::new(contexts, status.clone(), notes, stats, metrics);
    let api = Authenticated::wrap(
        Arc::new(handler),
        api_keys,
        cfg.npu_serving.access.protect_health,
    );
    tracing::info!(
        %local,
        models = ?status.names(),
        max_resident_models = status.max_resident,
        "serving several models; each loads on its first request"
    );
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {local}")?;
        out.flush()?;
    }
    let served = server.run(shutdown, router.handle.clone(), api);
    router.shutdown_and_join();
    served?;
    tracing::info!("server stopped");
    Ok(())
}

/// Reads and checks one models entry: its config, model file, tokenizer and limits (nothing
/// is loaded).
fn read_model(
    i: usize,
    entry: &ModelEntry,
    base: &Path,
    strict: bool,
    built: &[DeviceKind],
) -> anyhow::Result<(ModelSpec, ApiSettings)> {
    let key = format!("npu_serving.models[{i}] ({})", entry.name);
    let path = if entry.config.is_absolute() {
        entry.config.clone()
    } else {
        base.join(&entry.config)
    };
    let cfg = ServerConfig::from_yaml_file_with(&path, strict)
        .with_context(|| format!("{key}: config {}", path.display()))?;
    let refuse = |what: &str, allowed: &str| {
        anyhow::anyhow!(
            "{key}: config {}: {what} is not supported for a model of npu_serving.models \
             ({allowed})",
            path.display()
        )
    };
    if !cfg.npu_serving.models.entries.is_empty() {
        return Err(refuse(
            "npu_serving.models",
            "a listed model's config describes one model",
        ));
    }
    if cfg.tensor_parallel_size() > 1 {
        return Err(refuse("npu_serving.tensor_parallel_size > 1", "1 only"));
    }
    if cfg.disaggregated() {
        return Err(refuse(
            "npu_serving.agent_roles (prefill/decode disaggregation)",
            "every agent `both`",
        ));
    }
    if cfg.npu_serving.kv_events.is_some() {
        return Err(refuse("npu_serving.kv_events_endpoint", "absent"));
    }
    serve::check_device(cfg.npu_serving.device, built).with_context(|| key.clone())?;
    let info = serve::load_model_info(&cfg, None).with_context(|| key.clone())?;
    cfg.model_warnings(info.vocab, info.context);
    cfg.check_kv_pool(info.context)
        .with_context(|| format!("{key}: config {}", path.display()))?;
    let max_model_len = cfg.max_model_len(info.context);
    let mut eos_ids = info.tokenizer.eos_ids().to_vec();
    for &id in cfg.end_token_ids() {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }
    let engine = EngineConfig::from_server_config(&cfg, max_model_len, eos_ids);
    engine
        .scheduler
        .validate()
        .with_context(|| format!("{key}: the config's limits do not work together"))?;
    let mut settings = ApiSettings::from_config(&cfg, info.context, info.sampling_defaults);
    settings.served_model_names = vec![entry.name.clone()];
    settings.model_name = entry.name.clone();
    tracing::info!(
        model = %entry.name,
        file = %info.path.display(),
        max_model_len,
        "model listed (loaded on its first request)"
    );
    let spec = ModelSpec {
        name: entry.name.clone(),
        cfg,
        path: info.path,
        tokenizer: info.tokenizer,
        engine,
        context: info.context,
    };
    Ok((spec, settings))
}

/// Starts one model: its agents (each loads the model), then its engine over them, its events
/// going to `out`. Runs on a loading thread of the router.
fn start_model(
    spec: &ModelSpec,
    out: Box<dyn EventOutput>,
    metrics: Arc<Metrics>,
    shutdown: ShutdownSignal,
) -> anyhow::Result<RunningEngine> {
    let cfg = &spec.cfg;
    let mut engine_cfg = spec.engine.clone();
    let specs: Vec<AgentSpec> = serve::agent_specs(cfg, &engine_cfg, &spec.path, None, &[])
        .into_iter()
        .map(|s| s.with_token_masks(spec.tokenizer.vocab_size() as u32))
        .collect();
    let mut links: Vec<AgentLink> = AgentPool::start(specs, AgentLaunch::default())
        .context("starting the agents")?
        .into_links();
    if cfg.npu_serving.kv_cache_memory_fraction.is_some() {
        let blocks = serve::kv_pool_from_agents(&mut links)?;
        cfg.check_kv_pool_blocks(spec.context, blocks)?;
        engine_cfg.scheduler.num_blocks = blocks as usize;
        engine_cfg
            .scheduler
            .validate()
            .context("the KV pool the agents sized does not work with the config's limits")?;
    }
    let num_blocks = engine_cfg.scheduler.num_blocks as u32;
    engine_cfg.scheduler.kv_host = links.first().and_then(|l| {
        serve::kv_host_config(&l.facts().kv, num_blocks, cfg.npu_serving.swap_space_mb)
    });
    engine_cfg.tensor_parallel_size = 1;
    let agents: Vec<Box<dyn StepAgent>> = links
        .into_iter()
        .map(|l| Box::new(l) as Box<dyn StepAgent>)
        .collect();
    let engine = start_engine(
        engine_cfg,
        agents,
        spec.tokenizer.clone(),
        out,
        metrics,
        Some(shutdown),
        None,
    )?;
    Ok(engine)
}

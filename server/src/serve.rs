//! `npu-serving serve`: loads the YAML config, resolves the model, starts one agent process per
//! `serving_config.agent_ports` entry, runs the engine thread and the HTTP server until
//! SIGINT/SIGTERM, then drains and shuts everything down (agents exit, segments are removed).

use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use npu_gguf::hparams::ModelConfig;
use npu_gguf::GgufFile;
use npu_protocol::agent::AgentEngineConfig;
use npu_tokenizer::Tokenizer;

use crate::agents::{AgentLaunch, AgentPool, AgentSpec};
use crate::api::{ApiContext, ApiSettings};
use crate::config::{DeviceKind, ServerConfig};
use crate::engine::{start_engine, EngineConfig, StepAgent};
use crate::http::{HttpServer, ShutdownSignal};
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
    /// GGUF model file (overrides npu_serving.model_file; default: the default model, fetched
    /// on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Refuse every unknown config key (by default unknown keys in llm-serving's sections only
    /// warn; unknown keys in npu_serving are always refused).
    #[arg(long)]
    pub strict_config: bool,
}

/// What the model file says that the server needs before the agents start.
struct ModelInfo {
    path: PathBuf,
    tokenizer: Tokenizer,
    vocab: u32,
    context: u32,
}

/// Runs the server until a termination signal has been handled.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mut cfg = ServerConfig::from_yaml_file_with(&args.config, args.strict_config)
        .with_context(|| format!("config {}", args.config.display()))?;
    if let Some(host) = &args.host {
        cfg.serving_config.server_ip = host.clone();
    }
    if let Some(port) = args.port {
        cfg.serving_config.server_port = port;
    }
    if cfg.npu_serving.device != DeviceKind::Cpu {
        bail!(
            "npu_serving.device: {} is not available in this build; the agents run on: cpu",
            cfg.npu_serving.device.as_str()
        );
    }
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
    let engine_cfg = EngineConfig::from_server_config(&cfg, max_model_len, eos_ids);
    engine_cfg
        .scheduler
        .validate()
        .context("the config's limits do not work together")?;

    // Bind before starting agents: a busy port fails at once.
    let addr = cfg.server_addr();
    let listener = TcpListener::bind(&addr).with_context(|| format!("cannot listen on {addr}"))?;

    let specs = agent_specs(&cfg, &engine_cfg, &model.path);
    let launch = AgentLaunch::default();
    tracing::info!(
        agents = specs.len(),
        threads_per_agent = specs[0].engine.threads,
        model = %model.path.display(),
        "starting agents (one per serving_config.agent_ports entry; each talks to this server \
         over its own private socket pair, no port is opened)"
    );
    let pool = AgentPool::start(specs, launch).context("starting the agents")?;
    let agents: Vec<Box<dyn StepAgent>> = pool
        .into_links()
        .into_iter()
        .map(|l| Box::new(l) as Box<dyn StepAgent>)
        .collect();

    let metrics = Arc::new(Metrics::default());
    let server = HttpServer::new(listener, cfg.http_limits(), metrics.clone())?;
    let local = server.local_addr()?;
    let shutdown = ShutdownSignal::new();
    shutdown.trigger_on_termination_signals()?;
    let engine = start_engine(
        engine_cfg,
        agents,
        model.tokenizer.clone(),
        Box::new(server.event_sink()),
        metrics.clone(),
        Some(shutdown.clone()),
    )?;
    let api = Arc::new(ApiContext::new(
        ApiSettings::from_config(&cfg, model.context),
        model.tokenizer,
        engine.handle.stats.clone(),
        metrics,
    ));
    tracing::info!(%local, model = cfg.model_name(), max_model_len, "serving");
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {local}")?;
        out.flush()?;
    }
    let served = server.run(shutdown, engine.handle.clone(), api);
    engine.shutdown_and_join();
    served?;
    tracing::info!("server stopped");
    Ok(())
}

/// Resolves the model (`--model`, else `npu_serving.model_file`, else the default model,
/// fetched when absent) and reads its tokenizer and limits.
fn load_model_info(cfg: &ServerConfig, cli_model: Option<PathBuf>) -> anyhow::Result<ModelInfo> {
    let requested = cli_model.or_else(|| cfg.npu_serving.model_file.clone());
    let path =
        npu_gguf::store::resolve_model(requested.as_deref()).context("resolving the model")?;
    let gguf = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let mc = ModelConfig::from_gguf(&gguf).with_context(|| format!("model {}", path.display()))?;
    let tokenizer = Tokenizer::for_model(&gguf, &path)
        .with_context(|| format!("the tokenizer of {}", path.display()))?;
    Ok(ModelInfo {
        path,
        tokenizer,
        vocab: mc.vocab as u32,
        context: mc.context_length as u32,
    })
}

/// One spec per `serving_config.agent_ports` entry (only their number matters: agents talk to
/// the server over private socket pairs), sized by the engine's scheduler limits.
fn agent_specs(
    cfg: &ServerConfig,
    engine: &EngineConfig,
    model: &std::path::Path,
) -> Vec<AgentSpec> {
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
                model_path: model.to_path_buf(),
                num_blocks: s.num_blocks as u32,
                block_size: s.block_size as u32,
                max_slots: s.slots() as u32,
                max_tokens_per_step: s.max_tokens_per_step as u32,
                max_blocks_per_seq: s.max_blocks_per_seq as u32,
                threads,
            };
            AgentSpec::new(i as u32, engine)
        })
        .collect()
}

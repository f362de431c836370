//! The LoRA adapters a server serves beside its base model, by name: those listed at start
//! (`npu_serving.lora_adapters`) and those loaded and unloaded at run time
//! (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`). Every adapter's files are read
//! and checked against the model (shapes, rank, targets) with the agents' own reader before it
//! is listed; each load gets an id never used before, which travels with every request that
//! names the adapter (the agents read the files from the path it carries). Unloading takes the
//! name away from new requests only: requests already queued or running keep their adapter.
//! An adapter whose files an agent could not read when a request needed them (deleted or
//! changed after they were checked) is out of service: requests naming it are refused at once
//! with the reason (400) until it is loaded again under its name (or unloaded).
//! Also the adapters' metrics: requests per adapter and vLLM's `vllm:lora_requests_info`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use npu_model::ModelConfig;
use npu_protocol::{LoraRequest, MAX_LORA_PATH};
use thiserror::Error;

use crate::config::LoraConfig;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum LoraError {
    #[error("The lora adapter '{0}' cannot be found (loaded adapters: {1})")]
    NotFound(String, String),
    #[error("The lora adapter '{0}' has already been loaded")]
    Duplicate(String),
    #[error("lora_name {0:?}: {1}")]
    BadName(String, String),
    #[error("lora_path {path:?}: {what}")]
    BadPath { path: String, what: String },
    #[error(
        "The lora adapter '{name}' is out of service: {reason}. Fix its files and load it again \
         under its name (POST /v1/load_lora_adapter)"
    )]
    Unusable { name: String, reason: String },
}

impl LoraError {
    /// The HTTP status vLLM answers with: 404 for an unknown adapter, else 400.
    pub fn status(&self) -> u16 {
        match self {
            Self::NotFound(..) => 404,
            _ => 400,
        }
    }

    /// The request field at fault.
    pub fn param(&self) -> &'static str {
        match self {
            Self::BadPath { .. } => "lora_path",
            _ => "lora_name",
        }
    }
}

#[derive(Debug, Clone)]
struct Adapter {
    id: u32,
    path: String,
    /// Why it is out of service (an agent could not read its files), if it is.
    unusable: Option<String>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Served adapters by name.
    by_name: BTreeMap<String, Adapter>,
    /// Every id ever given, to its name (metrics name the adapters of running requests, which
    /// may have been unloaded meanwhile).
    names: BTreeMap<u32, String>,
    next_id: u32,
    /// Requests per adapter name, since start.
    requests: BTreeMap<String, u64>,
    /// Adapter ids of running and of waiting requests, as the engine last saw them.
    running: Vec<u32>,
    waiting: Vec<u32>,
}

/// The served adapters (shared by the API and the engine).
#[derive(Debug)]
pub struct LoraRegistry {
    model: ModelConfig,
    /// Names of the base model (an adapter may not take one).
    base_names: Vec<String>,
    pub max_loras: u32,
    pub max_lora_rank: u32,
    inner: Mutex<Inner>,
}

impl LoraRegistry {
    /// The registry of `cfg`'s adapters for `model` (served as `base_names`): each listed
    /// adapter read and checked now; the first that fails is refused naming its entry.
    pub fn new(
        cfg: &LoraConfig,
        model: ModelConfig,
        base_names: Vec<String>,
    ) -> Result<Arc<Self>, String> {
        let reg = Arc::new(Self {
            model,
            base_names,
            max_loras: cfg.max_loras,
            max_lora_rank: cfg.max_lora_rank,
            inner: Mutex::new(Inner {
                next_id: 1,
                ..Inner::default()
            }),
        });
        for (i, a) in cfg.adapters.iter().enumerate() {
            reg.load(&a.name, &a.path.to_string_lossy())
                .map_err(|e| format!("npu_serving.lora_adapters[{i}]: {e}"))?;
        }
        Ok(reg)
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the adapter at `path`, checks it against the model, and serves it as `name`.
    /// Reading happens outside the lock (requests keep resolving meanwhile).
    pub fn load(&self, name: &str, path: &str) -> Result<u32, LoraError> {
        self.check_name(name)?;
        let canonical = self.check_files(path)?;
        let mut g = self.inner();
        if g.by_name.get(name).is_some_and(|a| a.unusable.is_none()) {
            return Err(LoraError::Duplicate(name.into()));
        }
        let id = g.next_id;
        g.next_id += 1;
        // An adapter out of service is replaced (a new id: nothing cached under the old one
        // is reused).
        g.by_name.insert(
            name.to_string(),
            Adapter {
                id,
                path: canonical,
                unusable: None,
            },
        );
        g.names.insert(id, name.to_string());
        g.requests.entry(name.to_string()).or_insert(0);
        tracing::info!(adapter = name, id, path, "LoRA adapter loaded");
        Ok(id)
    }

    fn check_name(&self, name: &str) -> Result<(), LoraError> {
        let bad = |why: &str| Err(LoraError::BadName(name.into(), why.into()));
        if name.trim().is_empty() {
            return bad("empty: give the name requests will use as `model`");
        }
        if name.trim() != name || name.chars().any(char::is_control) {
            return bad("no leading or trailing spaces or control characters");
        }
        if self.base_names.iter().any(|b| b == name) {
            return bad("the base model's name");
        }
        if self
            .inner()
            .by_name
            .get(name)
            .is_some_and(|a| a.unusable.is_none())
        {
            return Err(LoraError::Duplicate(name.into()));
        }
        Ok(())
    }

    /// The adapter's canonical path once its files read as an adapter of this model.
    fn check_files(&self, path: &str) -> Result<String, LoraError> {
        let bad = |what: String| LoraError::BadPath {
            path: path.into(),
            what,
        };
        if path.trim().is_empty() {
            return Err(bad(
                "empty: a PEFT adapter directory or a GGUF LoRA file".into()
            ));
        }
        let p = crate::config::expand_home_path(path);
        let canonical: PathBuf = std::fs::canonicalize(&p).map_err(|e| bad(e.to_string()))?;
        let text = canonical
            .to_str()
            .ok_or_else(|| bad("the path is not UTF-8".into()))?
            .to_string();
        if text.len() > MAX_LORA_PATH {
            return Err(bad(format!(
                "{} bytes once absolute (at most {MAX_LORA_PATH})",
                text.len()
            )));
        }
        npu_model::lora::read_adapter(Path::new(&text), &self.model, self.max_lora_rank as usize)
            .map_err(|e| bad(e.to_string()))?;
        Ok(text)
    }

    /// Stops serving `name` to new requests (queued and running ones keep it).
    pub fn unload(&self, name: &str) -> Result<(), LoraError> {
        let mut g = self.inner();
        match g.by_name.remove(name) {
            Some(a) => {
                tracing::info!(adapter = name, id = a.id, "LoRA adapter unloaded");
                Ok(())
            }
            None => Err(LoraError::NotFound(name.into(), list(&g))),
        }
    }

    /// The adapter a request's `model` names, counted as one more request for it; None: no
    /// adapter has that name; an error: it is out of service.
    pub fn resolve(&self, name: &str) -> Result<Option<LoraRequest>, LoraError> {
        let mut g = self.inner();
        let Some(a) = g.by_name.get(name).cloned() else {
            return Ok(None);
        };
        if let Some(reason) = a.unusable {
            return Err(LoraError::Unusable {
                name: name.into(),
                reason,
            });
        }
        *g.requests.entry(name.to_string()).or_insert(0) += 1;
        Ok(Some(LoraRequest {
            id: a.id,
            path: a.path,
        }))
    }

    /// Takes the adapter of load `id` out of service (an agent could not read its files),
    /// unless its name was loaded again or unloaded since. Returns the name `id` was loaded
    /// as.
    pub fn mark_unusable(&self, id: u32, reason: &str) -> Option<String> {
        let mut g = self.inner();
        let name = g.names.get(&id)?.clone();
        if let Some(a) = g.by_name.get_mut(&name).filter(|a| a.id == id) {
            if a.unusable.is_none() {
                tracing::warn!(adapter = %name, id, %reason, "LoRA adapter out of service");
            }
            a.unusable = Some(reason.to_string());
        }
        Some(name)
    }

    /// Served adapters: (name, path), by name (those out of service left out).
    pub fn adapters(&self) -> Vec<(String, String)> {
        self.inner()
            .by_name
            .iter()
            .filter(|(_, a)| a.unusable.is_none())
            .map(|(n, a)| (n.clone(), a.path.clone()))
            .collect()
    }

    /// What the engine sees now: adapter ids of running and of waiting requests.
    pub fn set_activity(&self, running: Vec<u32>, waiting: Vec<u32>) {
        let mut g = self.inner();
        g.running = running;
        g.waiting = waiting;
    }

    /// Appends the adapters' metrics in Prometheus' text format: requests per adapter, and
    /// vLLM's `vllm:lora_requests_info` gauge (its value the time of the scrape, its labels
    /// the limit and the adapters of running and of waiting requests).
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write;
        let g = self.inner();
        let names = |ids: &[u32]| -> String {
            ids.iter()
                .filter_map(|id| g.names.get(id).cloned())
                .collect::<Vec<_>>()
                .join(",")
        };
        let _ = writeln!(
            out,
            "# HELP npu_serving_lora_requests_total Requests that named a LoRA adapter as `model`."
        );
        let _ = writeln!(out, "# TYPE npu_serving_lora_requests_total counter");
        for (name, n) in &g.requests {
            let _ = writeln!(
                out,
                "npu_serving_lora_requests_total{{adapter=\"{}\"}} {n}",
                escape(name)
            );
        }
        let _ = writeln!(
            out,
            "# HELP npu_serving_lora_adapters LoRA adapters served now."
        );
        let _ = writeln!(out, "# TYPE npu_serving_lora_adapters gauge");
        let served = g.by_name.values().filter(|a| a.unusable.is_none()).count();
        let _ = writeln!(out, "npu_serving_lora_adapters {served}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let _ = writeln!(
            out,
            "# HELP vllm:lora_requests_info Running stats on lora requests."
        );
        let _ = writeln!(out, "# TYPE vllm:lora_requests_info gauge");
        let _ = writeln!(
            out,
            "vllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",\
             waiting_lora_adapters=\"{}\"}} {now}",
            self.max_loras,
            escape(&names(&g.running)),
            escape(&names(&g.waiting)),
        );
    }
}

fn list(g: &Inner) -> String {
    if g.by_name.is_empty() {
        return "none".into();
    }
    g.by_name
        .keys()
        .map(|n| format!("'{n}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A Prometheus label value.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The registry as the engine's config holds it (equal when it is the same registry).
#[derive(Debug, Clone)]
pub struct LoraHandle(pub Arc<LoraRegistry>);

impl PartialEq for LoraHandle {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The registry of the config's adapters for `model` (None when LoRA is off).
pub fn registry_for(
    cfg: &crate::config::ServerConfig,
    model: &ModelConfig,
) -> Result<Option<Arc<LoraRegistry>>, String> {
    let Some(l) = &cfg.npu_serving.lora else {
        return Ok(None);
    };
    let mut base = cfg.served_model_names();
    if base.is_empty() {
        base.push(cfg.model_name().to_string());
    }
    LoraRegistry::new(l, model.clone(), base).map(Some)
}

/// What each agent is told of LoRA (None when it is off).
pub fn agent_config(
    cfg: &crate::config::ServerConfig,
) -> Option<npu_protocol::agent::AgentLoraConfig> {
    cfg.npu_serving
        .lora
        .as_ref()
        .map(|l| npu_protocol::agent::AgentLoraConfig {
            max_loras: l.max_loras,
            max_lora_rank: l.max_lora_rank,
        })
}

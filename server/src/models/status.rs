//! What the model router shares with the HTTP side: each configured model's state (unloaded,
//! loading, loaded, unloading) and counters (loads, evictions, load time, requests), read by
//! `/v1/models` and rendered into `/metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// Where a model is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelState {
    /// Not in memory: its agents are not running.
    Unloaded = 0,
    /// Its agents are starting (requests for it are held).
    Loading = 1,
    /// Its engine and agents run and take requests.
    Loaded = 2,
    /// Its engine is stopping to make room for another model.
    Unloading = 3,
}

impl ModelState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Loading,
            2 => Self::Loaded,
            3 => Self::Unloading,
            _ => Self::Unloaded,
        }
    }

    /// The name `/v1/models` gives the state (llama-server's router uses the same words).
    pub fn name(self) -> &'static str {
        match self {
            Self::Unloaded => "unloaded",
            Self::Loading => "loading",
            Self::Loaded => "loaded",
            Self::Unloading => "unloading",
        }
    }
}

/// One configured model's live state and counters.
#[derive(Debug)]
pub struct ModelStatus {
    pub name: String,
    /// Its context limit (prompt + generated), for `/v1/models`.
    pub max_model_len: u32,
    state: AtomicU8,
    pub loads_total: AtomicU64,
    pub load_failures_total: AtomicU64,
    pub evictions_total: AtomicU64,
    /// Time spent loading (agents spawned to engine running), microseconds, all loads.
    pub load_us_total: AtomicU64,
    pub last_load_us: AtomicU64,
    /// Generation requests routed to it (each choice of an `n > 1` request counts).
    pub requests_total: AtomicU64,
    /// Of those, the ones held because it was not loaded when they arrived.
    pub held_total: AtomicU64,
}

impl ModelStatus {
    pub fn new(name: String, max_model_len: u32) -> Self {
        Self {
            name,
            max_model_len,
            state: AtomicU8::new(ModelState::Unloaded as u8),
            loads_total: AtomicU64::new(0),
            load_failures_total: AtomicU64::new(0),
            evictions_total: AtomicU64::new(0),
            load_us_total: AtomicU64::new(0),
            last_load_us: AtomicU64::new(0),
            requests_total: AtomicU64::new(0),
            held_total: AtomicU64::new(0),
        }
    }

    pub fn state(&self) -> ModelState {
        ModelState::from_u8(self.state.load(Ordering::Relaxed))
    }

    pub fn set_state(&self, s: ModelState) {
        self.state.store(s as u8, Ordering::Relaxed);
    }
}

/// One per-model metric: its name, type, help text and value.
type Series = (
    &'static str,
    &'static str,
    &'static str,
    fn(&ModelStatus) -> f64,
);

/// Every configured model, in config order.
#[derive(Debug)]
pub struct ModelsStatus {
    pub models: Vec<ModelStatus>,
    pub max_resident: u32,
}

impl ModelsStatus {
    pub fn names(&self) -> Vec<String> {
        self.models.iter().map(|m| m.name.clone()).collect()
    }

    pub fn index(&self, name: &str) -> Option<usize> {
        self.models.iter().position(|m| m.name == name)
    }

    /// Appends the per-model metrics (Prometheus text format).
    pub fn render(&self, out: &mut String) {
        let get = |v: &AtomicU64| v.load(Ordering::Relaxed);
        let resident = self
            .models
            .iter()
            .filter(|m| m.state() == ModelState::Loaded)
            .count();
        let _ = writeln!(
            out,
            "# HELP npu_serving_models_resident Models loaded now (npu_serving.models).\n\
             # TYPE npu_serving_models_resident gauge\n\
             npu_serving_models_resident {resident}\n\
             # HELP npu_serving_models_max_resident npu_serving.max_resident_models.\n\
             # TYPE npu_serving_models_max_resident gauge\n\
             npu_serving_models_max_resident {}",
            self.max_resident
        );
        let series: [Series; 8] = [
            (
                "npu_serving_model_loaded",
                "gauge",
                "1 while the model is loaded and takes requests.",
                |m| f64::from(u8::from(m.state() == ModelState::Loaded)),
            ),
            (
                "npu_serving_model_loading",
                "gauge",
                "1 while the model's agents start (its requests are held).",
                |m| f64::from(u8::from(m.state() == ModelState::Loading)),
            ),
            (
                "npu_serving_model_loads_total",
                "counter",
                "Loads of the model that succeeded.",
                |m| m.loads_total.load(Ordering::Relaxed) as f64,
            ),
            (
                "npu_serving_model_load_failures_total",
                "counter",
                "Loads of the model that failed (its held requests got the error).",
                |m| m.load_failures_total.load(Ordering::Relaxed) as f64,
            ),
            (
                "npu_serving_model_evictions_total",
                "counter",
                "Times the model was unloaded to make room for another.",
                |m| m.evictions_total.load(Ordering::Relaxed) as f64,
            ),
            (
                "npu_serving_model_load_seconds_total",
                "counter",
                "Time spent loading the model, all loads.",
                |m| m.load_us_total.load(Ordering::Relaxed) as f64 / 1e6,
            ),
            (
                "npu_serving_model_requests_total",
                "counter",
                "Generation requests routed to the model.",
                |m| m.requests_total.load(Ordering::Relaxed) as f64,
            ),
            (
                "npu_serving_model_held_requests_total",
                "counter",
                "Of those, requests held while the model was not loaded.",
                |m| m.held_total.load(Ordering::Relaxed) as f64,
            ),
        ];
        for (name, kind, help, value) in series {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for m in &self.models {
                let _ = writeln!(out, "{name}{{model=\"{}\"}} {}", escape(&m.name), value(m));
            }
        }
        let _ = writeln!(
            out,
            "# HELP npu_serving_model_last_load_seconds The model's last load.\n\
             # TYPE npu_serving_model_last_load_seconds gauge"
        );
        for m in &self.models {
            let _ = writeln!(
                out,
                "npu_serving_model_last_load_seconds{{model=\"{}\"}} {}",
                escape(&m.name),
                get(&m.last_load_us) as f64 / 1e6
            );
        }
    }
}

/// A Prometheus label value: backslash, quote and newline escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

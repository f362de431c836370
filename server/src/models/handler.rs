//! The HTTP handler of a multi-model server: picks the model a request names (its JSON body's
//! `model`, or the llm-serving route's `{name}`), lets that model's own API context answer it,
//! and notes the choice for the router; answers `/v1/models` for every configured model with
//! its state, and `/metrics` with the per-model figures added.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::router::{Note, Notes};
use super::status::{ModelState, ModelsStatus};
use crate::api::{ApiContext, ApiError, ErrorShape};
use crate::engine::{EngineStats, RequestId};
use crate::http::{Handler, Reply, Request, Response};
use crate::metrics::Metrics;

/// The routes every model answers the same (they read the summed engine figures): the first
/// model's context answers them.
const SHARED: [&str; 6] = [
    "/health",
    "/ready",
    "/live",
    "/serving/get_bs",
    "/serving/get_request_numbers",
    "/serving/get_serverd_model_info",
];

pub(crate) struct ModelsHandler {
    /// One per configured model, in config order (each serves its entry's name only).
    pub contexts: Vec<ApiContext>,
    pub status: Arc<ModelsStatus>,
    pub notes: Notes,
    pub stats: Arc<EngineStats>,
    pub metrics: Arc<Metrics>,
    pub started: u64,
}

impl ModelsHandler {
    pub fn new(
        contexts: Vec<ApiContext>,
        status: Arc<ModelsStatus>,
        notes: Notes,
        stats: Arc<EngineStats>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Self {
            contexts,
            status,
            notes,
            stats,
            metrics,
            started,
        }
    }

    fn entry(&self, i: usize) -> serde_json::Value {
        let m = &self.status.models[i];
        let state = m.state();
        serde_json::json!({
            "id": m.name,
            "object": "model",
            "created": self.started,
            "owned_by": "npu-serving",
            "root": m.name,
            "max_model_len": m.max_model_len,
            "loaded": state == ModelState::Loaded,
            "status": {"value": state.name()},
        })
    }

    fn list(&self) -> Response {
        let data: Vec<serde_json::Value> = (0..self.status.models.len())
            .map(|i| self.entry(i))
            .collect();
        Response::json(200, &serde_json::json!({"object": "list", "data": data}))
    }

    fn not_found(&self, name: &str, shape: ErrorShape) -> Response {
        ApiError::model_not_found(name, &self.status.names()).response(shape)
    }

    fn metrics_text(&self) -> Response {
        let mut text = self.metrics.render(&self.stats);
        let names = self.status.names();
        crate::metrics::render_vllm_aliases(&mut text, &self.stats, &names[0]);
        self.status.render(&mut text);
        Response::new(
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            text.into_bytes(),
        )
    }

    /// The model a request is for: Ok(index), or the response refusing it.
    fn choose(&self, req: &Request, shape: ErrorShape) -> Result<usize, Response> {
        let path = req.path.as_str();
        if let Some(rest) = path.strip_prefix("/models/") {
            // llm-serving's route: its `{name}` picks a model; a name no entry has (configs
            // written for llm-serving use fixed ones) goes to the first model, as the route
            // does on a one-model server.
            let name = rest.split('/').next().unwrap_or_default();
            return Ok(self.status.index(name).unwrap_or(0));
        }
        #[derive(serde::Deserialize)]
        struct Model {
            model: Option<serde_json::Value>,
        }
        // A body that is not JSON, or a `model` that is not a string: the first model's
        // context refuses it with its usual error.
        let Ok(Model {
            model: Some(serde_json::Value::String(name)),
        }) = serde_json::from_slice::<Model>(&req.body)
        else {
            return Ok(0);
        };
        let served_by = || {
            // A name a model's context answers to besides its entry's (e.g. its adapters).
            (0..self.contexts.len()).find(|&i| self.contexts[i].check_model(Some(&name)).is_ok())
        };
        match self.status.index(&name).or_else(served_by) {
            Some(i) => Ok(i),
            // Anthropic's and the Responses API's clients send their own model names; on a
            // one-model server those go to the model, here to the first one.
            None if shape == ErrorShape::Anthropic || is_responses(path) => Ok(0),
            None => Err(self.not_found(&name, shape)),
        }
    }
}

fn is_responses(path: &str) -> bool {
    path.starts_with("/v1/responses") || path.starts_with("/responses")
}

fn shape_for(path: &str) -> ErrorShape {
    if path == "/v1/messages" || path.starts_with("/v1/messages/") {
        ErrorShape::Anthropic
    } else if path.starts_with("/v1/")
        || is_responses(path)
        || matches!(
            path,
            "/chat/completions" | "/completions" | "/models" | "/tokenize" | "/detokenize"
        )
    {
        ErrorShape::OpenAi
    } else {
        ErrorShape::Plain
    }
}

impl Handler for ModelsHandler {
    fn handle(&self, req: &Request, id: RequestId) -> Reply {
        let path = req.path.as_str();
        let shape = shape_for(path);
        let get = req.method == "GET";
        match path {
            "/v1/models" | "/models" if get => return Reply::Full(self.list()),
            "/metrics" if get => return Reply::Full(self.metrics_text()),
            "/sleep" | "/wake_up" | "/is_sleeping" => {
                let e = ApiError::new(
                    400,
                    "invalid_request_error",
                    format!(
                        "{path} is not available on a server with npu_serving.models: a model \
                         that is not used is unloaded when another needs the room \
                         (npu_serving.max_resident_models), and loaded again by its next request"
                    ),
                );
                return Reply::Full(e.response(shape));
            }
            p if SHARED.contains(&p) => return self.contexts[0].handle(req, id),
            _ => {}
        }
        if let Some(name) = path.strip_prefix("/v1/models/") {
            if get {
                return Reply::Full(match self.status.index(name) {
                    Some(i) => Response::json(200, &self.entry(i)),
                    None => self.not_found(name, shape),
                });
            }
        }
        if is_responses(path) && path.contains("/responses/") {
            // A stored response lives with the model that answered it.
            let mut last = None;
            for ctx in &self.contexts {
                match ctx.handle(req, id) {
                    Reply::Full(r) if r.status == 404 => last = Some(Reply::Full(r)),
                    other => return other,
                }
            }
            return last.unwrap_or_else(|| self.contexts[0].handle(req, id));
        }
        let m = match self.choose(req, shape) {
            Ok(m) => m,
            Err(resp) => return Reply::Full(resp),
        };
        let reply = self.contexts[m].handle(req, id);
        if let Reply::Generate(sub) = &reply {
            let note = Note {
                model: m,
                more: sub.more.len(),
                at: Instant::now(),
            };
            if let Ok(mut notes) = self.notes.lock() {
                notes.insert(id, note);
            }
        }
        reply
    }

    fn error_response(
        &self,
        path: Option<&str>,
        status: u16,
        kind: &str,
        message: &str,
    ) -> Response {
        self.contexts[0].error_response(path, status, kind, message)
    }
}

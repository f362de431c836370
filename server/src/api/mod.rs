//! The API front ends on top of the HTTP layer: routing, the llm-serving (TGI-style) routes, the
//! OpenAI routes, /health, /metrics and llm-serving's /serving/* status routes. Handlers validate,
//! tokenize and build a `GenerateRequest`, then turn its events into the response.

mod anthropic;
mod defaults;
mod error;
mod fields;
mod lora;
mod openai;
mod openai_choices;
mod openai_stream;
mod pyjson;
mod reasoning;
mod responses;
mod sampling;
mod sleep;
mod structured;
mod tgi;
mod tokenize;
mod tool_calls;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use npu_tokenizer::{ChatTemplate, Tokenizer};

pub use defaults::SamplingDefaults;
pub use error::{ApiError, ErrorShape};

use crate::config::{DeviceKind, ServerConfig};
use crate::engine::{EngineStats, RequestId};
use crate::http::{Handler, Reply, Request, Response};
use crate::metrics::Metrics;

/// What the API layer needs from the config (typed, with defaults for tests).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiSettings {
    /// The model's name (`model_config.model_name`: llm-serving's model info).
    pub model_name: String,
    /// Names `/v1/*` requests may give as `model` (`/v1/models` lists them); another name is
    /// 404 `model_not_found`. Empty: `model_name` alone.
    pub served_model_names: Vec<String>,
    /// Context limit: prompt + generated tokens.
    pub max_model_len: u32,
    /// `model_config.max_generate_length`: another cap on prompt + generated tokens.
    pub max_generate_length: Option<u32>,
    /// max_new_tokens / max_tokens when a request does not say.
    pub max_new_tokens_default: u32,
    /// The model's own defaults of the sampling fields a request does not set (a model
    /// directory's generation_config.json); its `max_new_tokens` is already in
    /// `max_new_tokens_default`.
    pub sampling_defaults: SamplingDefaults,
    pub device: DeviceKind,
    /// Reported by /serving/get_serverd_model_info.
    pub decode_batch_size: u32,
    pub model_dtype: String,
    /// The Responses API store's bounds.
    pub responses: crate::config::ResponsesConfig,
}

impl Default for ApiSettings {
    fn default() -> Self {
        Self {
            model_name: "SmolLM2-135M-Instruct".into(),
            served_model_names: Vec::new(),
            max_model_len: 2048,
            max_generate_length: None,
            max_new_tokens_default: 256,
            sampling_defaults: SamplingDefaults::default(),
            device: DeviceKind::Cpu,
            decode_batch_size: 64,
            model_dtype: "gguf".into(),
            responses: Default::default(),
        }
    }
}

impl ApiSettings {
    /// The names `/v1/*` answers to, the first being the one responses use by default.
    pub fn served_names(&self) -> Vec<String> {
        if self.served_model_names.is_empty() {
            vec![self.model_name.clone()]
        } else {
            self.served_model_names.clone()
        }
    }

    /// The most tokens a prompt may have (one generated token must fit after it), and the
    /// setting that makes it so.
    pub fn prompt_limit(&self) -> (u32, String) {
        match self.max_generate_length {
            Some(g) if g < self.max_model_len => (
                g.saturating_sub(1),
                format!("model_config.max_generate_length {g} minus 1 generated token"),
            ),
            _ => (
                self.max_model_len.saturating_sub(1),
                format!(
                    "max_model_len {} minus 1 generated token",
                    self.max_model_len
                ),
            ),
        }
    }

    /// `model_context` is the loaded model's context length; `model_defaults` the model's own
    /// sampling defaults (none for a GGUF file), whose `max_new_tokens` replaces
    /// `npu_serving.max_new_tokens_default` unless the config gives that key.
    pub fn from_config(
        cfg: &ServerConfig,
        model_context: u32,
        model_defaults: SamplingDefaults,
    ) -> Self {
        let max_new_tokens_default = match model_defaults.max_new_tokens {
            Some(n) if !cfg.npu_serving.max_new_tokens_default_set => n,
            _ => cfg.npu_serving.max_new_tokens_default,
        };
        Self {
            model_name: cfg.model_name().to_string(),
            served_model_names: cfg.served_model_names(),
            max_model_len: cfg.max_model_len(model_context),
            max_generate_length: cfg.max_generate_length(),
            max_new_tokens_default,
            sampling_defaults: SamplingDefaults {
                max_new_tokens: None,
                ..model_defaults
            },
            device: cfg.npu_serving.device,
            decode_batch_size: cfg.decode_batch_size(),
            model_dtype: cfg
                .model_config
                .model_dtype
                .clone()
                .unwrap_or_else(|| "gguf".into()),
            responses: cfg.npu_serving.responses,
        }
    }
}

/// The API layer: implements the HTTP `Handler`.
pub struct ApiContext {
    pub settings: ApiSettings,
    tokenizer: Tokenizer,
    chat_template: Result<ChatTemplate, String>,
    /// The model thinks in `<think>...</think>` blocks (Qwen3 style): chat replies are split
    /// into `reasoning_content` and `content`.
    thinks: bool,
    stats: Arc<EngineStats>,
    metrics: Arc<Metrics>,
    /// Unix time the server started (OpenAI `created` of the model).
    started: u64,
    /// The grammar compiler over this model's vocabulary, made on the first constrained
    /// request (indexing a large vocabulary takes a moment).
    grammars: std::sync::OnceLock<Result<npu_structured::Grammars, String>>,
    /// Stored responses of `/v1/responses`.
    responses: Arc<responses::Store>,
    /// The served LoRA adapters (None: LoRA off).
    lora: Option<Arc<crate::lora::LoraRegistry>>,
}

/// A route and the methods it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Health,
    Ready,
    Live,
    /// `GET /v1/models/{name}`.
    Model,
    Metrics,
    Models,
    Completions,
    ChatCompletions,
    /// `POST /v1/responses`; `/v1/responses/{id}[/...]` (its methods checked there).
    Responses,
    ResponseById,
    /// Anthropic's `POST /v1/messages` and `/v1/messages/count_tokens`.
    AnthropicMessages,
    AnthropicCountTokens,
    /// `/models/{name}` (stream from the body), `/generate` (false), `/generate_stream` (true).
    TgiGenerate(Option<bool>),
    ServingBatchSize,
    ServingRequestNumbers,
    ServingModelInfo,
    /// vLLM's `POST /tokenize` and `/detokenize`.
    Tokenize,
    Detokenize,
    /// vLLM's sleep mode: `POST /sleep`, `POST /wake_up`, `GET /is_sleeping`.
    Sleep,
    WakeUp,
    IsSleeping,
    /// vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
    LoadLora,
    UnloadLora,
}

fn route(path: &str) -> Option<(Route, &'static str)> {
    let r = match path {
        "/health" => (Route::Health, "GET"),
        "/ready" => (Route::Ready, "GET"),
        "/live" => (Route::Live, "GET"),
        "/metrics" => (Route::Metrics, "GET"),
        // The OpenAI routes also without `/v1`, as llama-server answers them.
        "/v1/models" | "/models" => (Route::Models, "GET"),
        "/v1/completions" | "/completions" => (Route::Completions, "POST"),
        "/v1/chat/completions" | "/chat/completions" => (Route::ChatCompletions, "POST"),
        "/v1/responses" | "/responses" => (Route::Responses, "POST"),
        _ if path.starts_with("/v1/responses/") || path.starts_with("/responses/") => {
            (Route::ResponseById, "")
        }
        "/tokenize" | "/v1/tokenize" => (Route::Tokenize, "POST"),
        "/sleep" => (Route::Sleep, "POST"),
        "/wake_up" => (Route::WakeUp, "POST"),
        "/is_sleeping" => (Route::IsSleeping, "GET"),
        "/v1/load_lora_adapter" => (Route::LoadLora, "POST"),
        "/v1/unload_lora_adapter" => (Route::UnloadLora, "POST"),
        "/detokenize" | "/v1/detokenize" => (Route::Detokenize, "POST"),
        "/v1/messages" => (Route::AnthropicMessages, "POST"),
        "/v1/messages/count_tokens" => (Route::AnthropicCountTokens, "POST"),
        "/serving/get_bs" => (Route::ServingBatchSize, "GET"),
        "/serving/get_request_numbers" => (Route::ServingRequestNumbers, "GET"),
        "/serving/get_serverd_model_info" => (Route::ServingModelInfo, "GET"),
        _ if path.starts_with("/v1/models/") => (Route::Model, "GET"),
        _ => {
            let rest = path.strip_prefix("/models/")?;
            let (name, tail) = match rest.split_once('/') {
                Some((n, t)) => (n, Some(t)),
                None => (rest, None),
            };
            if name.is_empty() {
                return None;
            }
            let stream = match tail {
                None | Some("") => None,
                Some("generate") => Some(false),
                Some("generate_stream") => Some(true),
                Some(_) => return None,
            };
            (Route::TgiGenerate(stream), "POST")
        }
    };
    Some(r)
}

/// Whether a model thinks in `<think>...</think>` blocks: its vocabulary has both tags as
/// tokens, or its chat template handles them.
fn thinks(tokenizer: &Tokenizer, template: Option<&str>) -> bool {
    let tokens = [reasoning::THINK_START, reasoning::THINK_END]
        .iter()
        .all(|t| tokenizer.token_id(t).is_some());
    tokens || template.is_some_and(|t| t.contains(reasoning::THINK_END))
}

fn shape_for(path: &str) -> ErrorShape {
    if anthropic::owns(path) {
        ErrorShape::Anthropic
    } else if path.starts_with("/v1/")
        || path.starts_with("/responses")
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

impl ApiContext {
    pub fn new(
        settings: ApiSettings,
        tokenizer: Tokenizer,
        stats: Arc<EngineStats>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let chat_template = tokenizer.chat_template().map_err(|e| {
            tracing::warn!(
                "the model's chat template is unusable, /v1/chat/completions will fail: {e}"
            );
            e.to_string()
        });
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let thinks = thinks(&tokenizer, tokenizer.chat_template_source());
        Self {
            responses: responses::store(&settings.responses),
            settings,
            tokenizer,
            chat_template,
            thinks,
            stats,
            metrics,
            started,
            grammars: std::sync::OnceLock::new(),
            lora: None,
        }
    }

    /// Serves the adapters of `reg` too (names as `model`, `/v1/models`, load and unload).
    pub fn with_lora(mut self, reg: Arc<crate::lora::LoraRegistry>) -> Self {
        self.lora = Some(reg);
        self
    }

    /// The grammar compiler (built once, on first use).
    pub(crate) fn grammars(&self) -> Result<&npu_structured::Grammars, String> {
        self.grammars
            .get_or_init(|| {
                npu_structured::Grammars::new(&self.tokenizer).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Uses `source` as the chat template instead of the model's (with the model's BOS and EOS
    /// texts); whether replies are split at `<think>` follows the template too.
    pub fn with_chat_template(
        mut self,
        source: &str,
    ) -> Result<Self, npu_tokenizer::TokenizerError> {
        let text = |id: Option<u32>| {
            id.and_then(|i| self.tokenizer.token_text(i))
                .unwrap_or_default()
                .to_string()
        };
        let (bos, eos) = (text(self.tokenizer.bos_id()), text(self.tokenizer.eos_id()));
        self.chat_template = Ok(ChatTemplate::new(source, bos, eos)?);
        self.thinks = thinks(&self.tokenizer, Some(source));
        Ok(self)
    }

    fn health(&self) -> Response {
        let s = &self.stats;
        let up = EngineStats::get(&s.agents_up);
        let total = EngineStats::get(&s.agents_total);
        if s.ready.load(Ordering::Relaxed) {
            return Response::json(200, &serde_json::json!({"status": "ok"}));
        }
        let tp = EngineStats::get(&s.tensor_parallel_size).max(1);
        let (groups_up, groups) = (
            EngineStats::get(&s.groups_up),
            EngineStats::get(&s.groups_total),
        );
        let error = if total == 0 {
            "the engine has not started its agents yet".to_string()
        } else if tp > 1 {
            format!(
                "{groups_up} of {groups} tensor-parallel groups are up (a group of {tp} agents \
                 is up only with every rank)"
            )
        } else {
            format!("{up} of {total} agents are up")
        };
        let mut body = serde_json::json!({
            "status": "unavailable",
            "error": error,
            "agents_up": up,
            "agents_total": total,
        });
        if tp > 1 {
            body["groups_up"] = groups_up.into();
            body["groups_total"] = groups.into();
            body["tensor_parallel_size"] = tp.into();
        }
        Response::json(503, &body)
    }

    /// Readiness: 200 only while every agent is up and the server is not draining (a load
    /// balancer sends nothing here otherwise). /health answers for the agents alone.
    fn ready(&self) -> Response {
        let s = &self.stats;
        if s.draining.load(Ordering::Relaxed) {
            return Response::json(
                503,
                &serde_json::json!({"status": "draining", "error": "the server is shutting down"}),
            );
        }
        self.health()
    }

    fn model_entry(&self, name: &str) -> serde_json::Value {
        serde_json::json!({
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "npu-serving",
            "root": self.settings.model_name,
            "max_model_len": self.settings.max_model_len,
        })
    }

    fn models(&self) -> Response {
        let mut data: Vec<serde_json::Value> = self
            .settings
            .served_names()
            .iter()
            .map(|n| self.model_entry(n))
            .collect();
        data.extend(lora::model_entries(self));
        Response::json(200, &serde_json::json!({"object": "list", "data": data}))
    }

    /// `GET /v1/models/{name}`: the entry of a served name, else 404 `model_not_found`.
    fn model(&self, path: &str) -> Response {
        let name = path.strip_prefix("/v1/models/").unwrap_or_default();
        let served = self.settings.served_names();
        if served.iter().any(|n| n == name) {
            Response::json(200, &self.model_entry(name))
        } else if let Some(e) = lora::model_entries(self)
            .into_iter()
            .find(|e| e["id"] == name)
        {
            Response::json(200, &e)
        } else {
            ApiError::model_not_found(name, &served).response(ErrorShape::OpenAi)
        }
    }

    /// The name a `/v1/*` request's `model` field must be one of (absent: the first served
    /// name); the name responses carry.
    pub(crate) fn check_model(&self, requested: Option<&str>) -> Result<String, ApiError> {
        let served = self.settings.served_names();
        match requested {
            None => Ok(served[0].clone()),
            Some(name) if served.iter().any(|n| n == name) => Ok(name.to_string()),
            Some(name) => Err(ApiError::model_not_found(name, &served)),
        }
    }

    /// `check_model` for the routes that run LoRA adapters too: a served name is the base
    /// model; a served adapter's name, that adapter (counted for it); else 404 naming both.
    pub(crate) fn resolve_model(
        &self,
        requested: Option<&str>,
    ) -> Result<(String, Option<npu_protocol::LoraRequest>), ApiError> {
        match (self.check_model(requested), &self.lora, requested) {
            (Ok(name), _, _) => Ok((name, None)),
            (Err(_), Some(reg), Some(name)) => match reg.resolve(name) {
                Ok(Some(l)) => Ok((name.to_string(), Some(l))),
                Err(e) => Err(ApiError::invalid("model", e.to_string())),
                Ok(None) => {
                    let mut served = self.settings.served_names();
                    served.extend(reg.adapters().into_iter().map(|(n, _)| n));
                    Err(ApiError::model_not_found(name, &served))
                }
            },
            (Err(e), _, _) => Err(e),
        }
    }

    fn serving_event(&self, data: u64) -> Response {
        // llm-serving answers these as one server-sent event.
        #[derive(serde::Serialize)]
        struct Event {
            event: &'static str,
            retry: u32,
            data: u64,
        }
        let line = pyjson::to_python_json(&Event {
            event: "message",
            retry: 30000,
            data,
        });
        Response::new(
            200,
            "text/event-stream; charset=utf-8",
            format!("data: {line}\r\n\r\n").into_bytes(),
        )
        .with_header("Cache-Control", "no-cache")
    }

    fn serving_model_info(&self) -> Response {
        #[derive(serde::Serialize)]
        struct Info<'a> {
            docker_label: &'a str,
            max_batch_total_tokens: u64,
            max_concurrent_requests: u64,
            max_input_length: u32,
            max_total_tokens: u32,
            model_device_type: &'a str,
            model_dtype: &'a str,
            model_id: &'a str,
            model_pipeline_tag: &'a str,
            version: &'a str,
        }
        let s = &self.settings;
        // Field meanings follow llm-serving's answer (max_total_tokens is its decode batch size,
        // max_concurrent_requests its current queue length).
        let info = Info {
            docker_label: "",
            max_batch_total_tokens: u64::from(s.max_model_len) * u64::from(s.decode_batch_size),
            max_concurrent_requests: EngineStats::get(&self.stats.waiting),
            max_input_length: s.max_model_len,
            max_total_tokens: s.decode_batch_size,
            model_device_type: match s.device {
                DeviceKind::Cpu => "CPU",
                DeviceKind::Cuda => "CUDA",
                DeviceKind::Ascend => "CANN",
            },
            model_dtype: &s.model_dtype,
            model_id: &s.model_name,
            model_pipeline_tag: "text-generation",
            version: env!("CARGO_PKG_VERSION"),
        };
        let line = pyjson::to_python_json(&info);
        Response::new(
            200,
            "text/event-stream; charset=utf-8",
            format!("data: {line}\r\n\r\n").into_bytes(),
        )
        .with_header("Cache-Control", "no-cache")
    }
}

impl Handler for ApiContext {
    fn handle(&self, req: &Request, id: RequestId) -> Reply {
        let shape = shape_for(&req.path);
        let Some((route, allow)) = route(&req.path) else {
            let e = ApiError::new(
                404,
                "not_found",
                format!("no route for {} {}", req.method, req.path),
            );
            return Reply::Full(e.response(shape));
        };
        if !allow.is_empty() && req.method != allow {
            let e = ApiError::new(
                405,
                "method_not_allowed",
                format!(
                    "{} does not accept {}; allowed: {allow}",
                    req.path, req.method
                ),
            );
            return Reply::Full(e.response(shape).with_header("Allow", allow));
        }
        let result = match route {
            Route::Health => return Reply::Full(self.health()),
            Route::Ready => return Reply::Full(self.ready()),
            Route::Live => {
                return Reply::Full(Response::json(200, &serde_json::json!({"status": "alive"})))
            }
            Route::Model => return Reply::Full(self.model(&req.path)),
            Route::Metrics => {
                let mut text = self.metrics.render(&self.stats);
                let served = self.settings.served_names();
                crate::metrics::render_vllm_aliases(&mut text, &self.stats, &served[0]);
                if let Some(reg) = &self.lora {
                    reg.render_metrics(&mut text);
                }
                return Reply::Full(Response::new(
                    200,
                    "text/plain; version=0.0.4; charset=utf-8",
                    text.into_bytes(),
                ));
            }
            Route::Models => return Reply::Full(self.models()),
            Route::ServingBatchSize => {
                return Reply::Full(self.serving_event(EngineStats::get(&self.stats.running)))
            }
            Route::ServingRequestNumbers => {
                return Reply::Full(self.serving_event(EngineStats::get(&self.stats.waiting)))
            }
            Route::ServingModelInfo => return Reply::Full(self.serving_model_info()),
            Route::TgiGenerate(stream) => tgi::submission(self, req, id, stream),
            Route::Completions => openai::completion_submission(self, req, id),
            Route::ChatCompletions => openai::chat_submission(self, req, id),
            Route::Responses => responses::submission(self, req, id),
            Route::ResponseById => return Reply::Full(responses::by_id(self, req)),
            Route::AnthropicMessages => anthropic::messages_submission(self, req, id),
            Route::Tokenize => {
                return Reply::Full(
                    tokenize::tokenize(self, req).unwrap_or_else(|e| e.response(shape)),
                )
            }
            Route::Detokenize => {
                let r = tokenize::detokenize(self, req);
                return Reply::Full(r.unwrap_or_else(|e| e.response(shape)));
            }
            Route::Sleep => {
                return sleep::sleep(req).unwrap_or_else(|e| Reply::Full(e.response(shape)))
            }
            Route::WakeUp => return sleep::wake(),
            Route::IsSleeping => return Reply::Full(sleep::is_sleeping(self)),
            Route::LoadLora => {
                return lora::load(self, req).unwrap_or_else(|e| Reply::Full(e.response(shape)))
            }
            Route::UnloadLora => {
                let r = lora::unload(self, req);
                return Reply::Full(r.unwrap_or_else(|e| e.response(shape)));
            }
            Route::AnthropicCountTokens => {
                let r = anthropic::count_tokens(self, req);
                return Reply::Full(r.unwrap_or_else(|e| e.response(shape)));
            }
        };
        match result {
            Ok(sub) => Reply::Generate(sub),
            Err(e) => Reply::Full(e.response(shape)),
        }
    }

    fn error_response(
        &self,
        path: Option<&str>,
        status: u16,
        kind: &str,
        message: &str,
    ) -> Response {
        let shape = path.map(shape_for).unwrap_or(ErrorShape::Plain);
        error::render_error(shape, status, kind, message, None)
    }
}

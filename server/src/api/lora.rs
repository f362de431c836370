//! vLLM's LoRA routes: `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path"}`: the engine
//! reads and checks the files, then serves the adapter under the name) and
//! `POST /v1/unload_lora_adapter` (`{"lora_name"}`: new requests may no longer name it;
//! requests already queued or running keep it). Success is vLLM's plain-text sentence; a
//! problem is a 400 naming the field (404 for an adapter not loaded), in OpenAI's error shape.
//! Also the adapters' `/v1/models` entries (`parent`: the base model, `root`: the files).

use serde_json::{json, Value};

use super::error::ApiError;
use super::fields::{parse_body, unknown_fields_error, Fields};
use super::ApiContext;
use crate::engine::handle::ControlReply;
use crate::engine::GenEvent;
use crate::http::{
    ControlCommand, ControlSubmission, EventWriter, Progress, Reply, Request, Response,
};

fn registry(ctx: &ApiContext) -> Result<&crate::lora::LoraRegistry, ApiError> {
    ctx.lora.as_deref().ok_or_else(|| {
        ApiError::invalid(
            "lora_name",
            "LoRA adapters are not served here: set npu_serving.max_loras (or \
             npu_serving.lora_adapters) in the config to load them",
        )
    })
}

/// The body's `lora_name` (and `lora_path` when `with_path`), any other field refused.
fn names(req: &Request, with_path: bool) -> Result<(String, String), ApiError> {
    let body = parse_body(&req.body)?;
    let f = Fields::new(&body, "");
    let name = f.string("lora_name")?.unwrap_or_default().to_string();
    if name.is_empty() {
        return Err(ApiError::invalid(
            "lora_name",
            "lora_name is required: the adapter's name",
        ));
    }
    let path = if with_path {
        let p = f.string("lora_path")?.unwrap_or_default().to_string();
        if p.is_empty() {
            return Err(ApiError::invalid(
                "lora_path",
                "lora_path is required: the adapter's PEFT directory or GGUF LoRA file",
            ));
        }
        if f.bool("load_inplace")? == Some(true) {
            return Err(ApiError::invalid(
                "load_inplace",
                "load_inplace: true is not supported (unload the adapter, then load it)",
            ));
        }
        p
    } else {
        // vLLM's optional integer id of the adapter: the name says which one here.
        f.i64("lora_int_id")?;
        String::new()
    };
    let unknown = f.unknown();
    if !unknown.is_empty() {
        return Err(unknown_fields_error(&unknown));
    }
    Ok((name, path))
}

pub(super) fn load(ctx: &ApiContext, req: &Request) -> Result<Reply, ApiError> {
    registry(ctx)?;
    let (name, path) = names(req, true)?;
    Ok(Reply::Control(ControlSubmission {
        command: ControlCommand::LoadLora { name, path },
        writer: Box::new(LoraWriter),
    }))
}

pub(super) fn unload(ctx: &ApiContext, req: &Request) -> Result<Response, ApiError> {
    let reg = registry(ctx)?;
    let (name, _) = names(req, false)?;
    reg.unload(&name).map_err(|e| ApiError {
        status: e.status(),
        kind: if e.status() == 404 {
            "NotFoundError"
        } else {
            "BadRequestError"
        },
        message: e.to_string(),
        param: Some(e.param().into()),
        code: None,
    })?;
    Ok(text(format!(
        "Success: LoRA adapter '{name}' removed successfully."
    )))
}

fn text(s: String) -> Response {
    Response::new(200, "text/plain; charset=utf-8", s.into_bytes())
}

/// The `/v1/models` entries of the served adapters.
pub(super) fn model_entries(ctx: &ApiContext) -> Vec<Value> {
    let Some(reg) = &ctx.lora else {
        return Vec::new();
    };
    let parent = ctx.settings.served_names()[0].clone();
    reg.adapters()
        .into_iter()
        .map(|(name, path)| {
            json!({
                "id": name,
                "object": "model",
                "created": ctx.started,
                "owned_by": "npu-serving",
                "root": path,
                "parent": parent,
                "max_model_len": ctx.settings.max_model_len,
            })
        })
        .collect()
}

/// Turns the engine's answer to a load into the response: vLLM's sentence on success.
struct LoraWriter;

impl EventWriter for LoraWriter {
    fn stream_start(&mut self) -> Option<Response> {
        None
    }

    fn on_event(&mut self, event: &GenEvent, _body: &mut Vec<u8>) -> Progress {
        let GenEvent::Finished { message, .. } = event else {
            return Progress::More;
        };
        let reply = message
            .as_deref()
            .and_then(|m| serde_json::from_str::<ControlReply>(m).ok());
        Progress::Complete(match reply {
            Some(r) if r.status == 200 => {
                text(r.body["message"].as_str().unwrap_or_default().to_string())
            }
            Some(r) => Response::json(r.status, &r.body),
            None => Response::json(
                500,
                &json!({"error": {"message": message, "type": "internal_error"}}),
            ),
        })
    }
}

//! OpenAI's Responses API on top of what the chat route does: `POST /v1/responses` renders its
//! instructions and input items (after those of `previous_response_id`) with the model's chat
//! template, offers its function tools the way the chat route does (in the template, or a
//! Hermes-style system message), constrains the reply for `tool_choice` required / named and
//! for `text.format` json_schema / json_object, and answers with output items (parse.rs,
//! stream.rs). Finished responses are kept in a bounded store (store.rs) for
//! `GET /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, `DELETE /v1/responses/{id}`
//! and `previous_response_id`.

mod parse;
mod store;
mod stream;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Map, Value};

use npu_protocol::SamplingParams;

use super::error::{ApiError, ErrorShape};
use super::fields::{parse_body, Fields};
use super::{reasoning, sampling, tool_calls, ApiContext};
use crate::config::ResponsesConfig;
use crate::engine::{GenerateRequest, RequestId};
use crate::http::{Request, Response, Submission};

pub(crate) use store::Store;

/// The store a server's API keeps, sized by the config.
pub(crate) fn store(c: &ResponsesConfig) -> Arc<Store> {
    Arc::new(Store::new(c.store_size, Duration::from_secs(c.ttl_s)))
}

/// 404 for a response id the store does not hold (never stored, evicted, expired, deleted).
fn not_found(id: &str, param: &str) -> ApiError {
    ApiError {
        param: Some(param.into()),
        code: Some("response_not_found"),
        ..ApiError::new(
            404,
            "invalid_request_error",
            format!(
                "No response with id '{id}' is stored (it was never stored, or was evicted or \
                 expired, or deleted)"
            ),
        )
    }
}

/// `POST /v1/responses`.
pub(super) fn submission(
    ctx: &ApiContext,
    req: &Request,
    id: RequestId,
) -> Result<Submission, ApiError> {
    let body = parse_body(&req.body)?;
    let f = Fields::new(&body, "");
    // Any name is answered, as agent tools (Codex and the like) send their own: a served name
    // is echoed (a LoRA adapter's runs that adapter), another gets the first served name.
    let (model, lora) = match ctx.resolve_model(f.string("model")?) {
        Ok(found) => found,
        Err(_) => (ctx.check_model(None)?, None),
    };
    let p = parse::parse(&f, &ctx.settings)?;
    let mut history = match &p.previous_response_id {
        Some(prev) => {
            ctx.responses
                .get(prev)
                .ok_or_else(|| not_found(prev, "previous_response_id"))?
                .history
        }
        None => Vec::new(),
    };
    // Input items get ids, as GET .../input_items lists them.
    let mut input = p.input.clone();
    for (k, it) in input.iter_mut().enumerate() {
        if it.get("id").is_none() {
            let prefix = match it["type"].as_str() {
                Some("function_call") => "fc",
                Some("function_call_output") => "fco",
                Some("reasoning") => "rs",
                _ => "msg",
            };
            it["id"] = format!("{prefix}_in{id:x}_{k}").into();
        }
    }
    history.extend(input.iter().cloned());
    let mut chat = parse::to_chat(&history);
    if let Some(ins) = &p.instructions {
        chat.insert(0, npu_tokenizer::ChatMessage::system(ins.clone()));
    }
    let tools_on = !p.tools.is_empty() && p.tool_choice != tool_calls::Choice::None;
    let mut kwargs = Map::new();
    if p.effort.as_deref() == Some("none") {
        // Qwen3-style templates skip the thinking when asked.
        kwargs.insert("enable_thinking".into(), false.into());
    }
    let text = render(ctx, &mut chat, &p.tools, tools_on, kwargs)?;
    let prompt_ids = ctx
        .tokenizer
        .encode_with(&text, false, true)
        .map_err(|e| ApiError::invalid("input", format!("input cannot be tokenized: {e}")))?;
    sampling::check_prompt(&prompt_ids, "input", &ctx.settings)?;
    let asked = match tool_calls::grammar(&p.tools, &p.tool_choice, p.parallel_tool_calls) {
        Some(spec) => Some(super::structured::Asked {
            spec,
            field: "tool_choice".into(),
        }),
        None => p.constraint,
    };
    let constraints = match &asked {
        Some(a) => super::structured::compile(ctx, a, 1)?,
        None => Vec::new(),
    };
    let d = &ctx.settings.sampling_defaults;
    let temperature = p.temperature.or(d.temperature).unwrap_or(1.0);
    let top_p = p.top_p.or(d.top_p).unwrap_or(1.0);
    let seed = p.seed.unwrap_or_else(|| sampling::random_seed(id));
    let params = SamplingParams {
        do_sample: temperature > 0.0,
        temperature,
        top_k: p.top_k.or(d.top_k).unwrap_or(0),
        top_p,
        min_p: d.min_p.unwrap_or(0.0),
        repetition_penalty: d.repetition_penalty.unwrap_or(1.0),
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed,
        top_n: 0,
        logit_bias: Vec::new(),
    };
    let resp_id = format!("resp_{:016x}{id:x}", sampling::random_seed(id));
    let mut resp = p.echo;
    resp.insert("id".into(), resp_id.into());
    resp.insert("model".into(), model.into());
    resp.insert("temperature".into(), json!(temperature));
    resp.insert("top_p".into(), json!(top_p));
    let think = ctx.thinks.then(|| reasoning::prompt_opens_think(&text));
    let names: Vec<String> = p.tools.iter().map(|t| t.name.clone()).collect();
    let keep = p.store.then(|| stream::Keep {
        store: ctx.responses.clone(),
        history,
        input,
    });
    let writer = stream::ResponsesWriter::new(
        resp,
        p.stream,
        think,
        tools_on.then_some(names.as_slice()),
        keep,
    );
    Ok(Submission {
        request: GenerateRequest {
            id,
            prompt_ids,
            params,
            max_new_tokens: p.max_tokens,
            stop: p.stop,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            speculative: true,
        },
        more: Vec::new(),
        writer: Box::new(writer),
        constraints,
        lora,
    })
}

/// The chat template's text of `chat`, with the tools offered as the chat route offers them:
/// to a template that renders `tools`, or described in the system message; earlier calls
/// written as `<tool_call>` text for templates that do not render `tool_calls`.
fn render(
    ctx: &ApiContext,
    chat: &mut Vec<npu_tokenizer::ChatMessage>,
    tools: &[tool_calls::Tool],
    tools_on: bool,
    mut kwargs: Map<String, Value>,
) -> Result<String, ApiError> {
    let template = ctx.chat_template.as_ref().map_err(|e| {
        ApiError::new(
            500,
            "server_error",
            format!("the model's chat template is unusable: {e}"),
        )
    })?;
    let source = template.source();
    if tools_on {
        if source.contains("tools") {
            let list = tools.iter().map(|t| t.raw.clone()).collect();
            kwargs.insert("tools".into(), Value::Array(list));
        } else {
            let desc = tool_calls::system_prompt(tools);
            match chat.first_mut() {
                Some(first) if first.role == "system" => {
                    first.content = format!("{}\n\n{desc}", first.content)
                }
                _ => chat.insert(0, npu_tokenizer::ChatMessage::system(desc)),
            }
        }
    }
    if !source.contains("tool_calls") {
        for m in chat.iter_mut() {
            if let Some(Value::Array(calls)) = m.tool_calls.take() {
                for c in calls {
                    let func = c.get("function").cloned().unwrap_or(Value::Null);
                    m.content
                        .push_str(&format!("\n<tool_call>\n{func}\n</tool_call>"));
                }
            }
        }
    }
    template.render_with(chat, true, &kwargs).map_err(|e| {
        ApiError::invalid(
            "input",
            format!("input cannot be rendered with the chat template: {e}"),
        )
    })
}

/// `GET` / `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`,
/// `POST /v1/responses/{id}/cancel` (refused: there is no background mode).
pub(super) fn by_id(ctx: &ApiContext, req: &Request) -> Response {
    let rest = req
        .path
        .strip_prefix("/v1/responses/")
        .or_else(|| req.path.strip_prefix("/responses/"))
        .unwrap_or_default();
    let (id, tail) = match rest.split_once('/') {
        Some((id, tail)) => (id, Some(tail)),
        None => (rest, None),
    };
    let allow = match tail {
        None => "GET, DELETE",
        Some("input_items") => "GET",
        Some("cancel") => "POST",
        Some(_) => {
            return ApiError::new(
                404,
                "not_found",
                format!("no route for {} {}", req.method, req.path),
            )
            .response(ErrorShape::OpenAi)
        }
    };
    if !allow.split(", ").any(|m| m == req.method) {
        return ApiError::new(
            405,
            "method_not_allowed",
            format!(
                "{} does not accept {}; allowed: {allow}",
                req.path, req.method
            ),
        )
        .response(ErrorShape::OpenAi)
        .with_header("Allow", allow);
    }
    if tail == Some("cancel") {
        return ApiError::invalid(
            "response_id",
            "only background responses can be cancelled, and background mode is not supported",
        )
        .response(ErrorShape::OpenAi);
    }
    if req.method == "DELETE" {
        return if ctx.responses.remove(id) {
            Response::json(
                200,
                &json!({"id": id, "object": "response.deleted", "deleted": true}),
            )
        } else {
            not_found(id, "response_id").response(ErrorShape::OpenAi)
        };
    }
    let Some(entry) = ctx.responses.get(id) else {
        return not_found(id, "response_id").response(ErrorShape::OpenAi);
    };
    if tail.is_some() {
        let ids = |e: Option<&Value>| e.and_then(|v| v.get("id")).cloned();
        return Response::json(
            200,
            &json!({
                "object": "list",
                "data": entry.input,
                "first_id": ids(entry.input.first()),
                "last_id": ids(entry.input.last()),
                "has_more": false,
            }),
        );
    }
    Response::json(200, &entry.response)
}

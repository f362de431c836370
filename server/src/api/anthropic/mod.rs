//! Anthropic's Messages API on top of the chat route's machinery: `POST /v1/messages` (the
//! conversation rendered with the model's chat template, tools offered through the template or
//! a system prompt and forced through the structured-output engine for `tool_choice` `any` /
//! `tool`, `output_config.format` JSON Schemas through the same engine, a reasoning model's `<think>` output as `thinking` blocks when asked for, streamed
//! or whole) and `POST /v1/messages/count_tokens` (the rendered prompt's length). Errors, also
//! those of the shared machinery and the HTTP layer, come in Anthropic's shape
//! (`{"type": "error", "error": {"type", "message"}}`), a full queue as 529 `overloaded_error`.

mod parse;
mod stream;
#[cfg(test)]
mod tests;

use serde_json::{json, Value};

use super::error::ApiError;
use super::fields::{parse_body, Fields};
use super::reasoning;
use super::sampling;
use super::structured::{compile, Asked};
use super::tool_calls::{self, Choice};
use super::ApiContext;
use crate::engine::{GenerateRequest, RequestId};
use crate::http::{Request, Response, Submission};
use parse::Conversation;
use stream::AnthropicWriter;

/// Anthropic's error type for an HTTP status (and the server's own kind): the status to answer
/// with and the body. The server's full queue is Anthropic's 529 `overloaded_error`.
pub(crate) fn error_body(status: u16, kind: &str, message: &str) -> (u16, Value) {
    let (status, ty) = match (status, kind) {
        (429, "queue_full") | (529, _) => (529, "overloaded_error"),
        (400 | 405 | 411 | 417 | 422 | 431, _) => (status, "invalid_request_error"),
        (401, _) => (status, "authentication_error"),
        (403, _) => (status, "permission_error"),
        (404, _) => (status, "not_found_error"),
        (408 | 504, _) => (status, "timeout_error"),
        (413, _) => (status, "request_too_large"),
        (429, _) => (status, "rate_limit_error"),
        (s, _) if s < 500 => (s, "invalid_request_error"),
        (s, _) => (s, "api_error"),
    };
    let body = json!({"type": "error", "error": {"type": ty, "message": message}});
    (status, body)
}

/// An error response in Anthropic's shape.
pub(crate) fn error_response(status: u16, kind: &str, message: &str) -> Response {
    let (status, body) = error_body(status, kind, message);
    Response::json(status, &body)
}

/// Whether a path is one of this API's (its errors take Anthropic's shape).
pub(crate) fn owns(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

/// The conversation rendered with the chat template: the prompt text and its token ids.
fn render(ctx: &ApiContext, conv: &Conversation) -> Result<(String, Vec<u32>), ApiError> {
    let mut chat = conv.chat.clone();
    let mut kwargs = serde_json::Map::new();
    let source = ctx.chat_template.as_ref().map_or("", |t| t.source());
    if !conv.tools.is_empty() && conv.choice != Choice::None {
        if source.contains("tools") {
            let raw = conv.tools.iter().map(|t| t.raw.clone()).collect();
            kwargs.insert("tools".into(), Value::Array(raw));
        } else {
            // As the chat route does: the tools described in the system message.
            let desc = tool_calls::system_prompt(&conv.tools);
            match chat.first_mut() {
                Some(first) if first.role == "system" => {
                    first.content = format!("{}\n\n{desc}", first.content)
                }
                _ => chat.insert(0, npu_tokenizer::ChatMessage::system(desc)),
            }
        }
    }
    if !source.contains("tool_calls") {
        // Earlier calls as text in the format replies are read in.
        for m in &mut chat {
            if let Some(Value::Array(calls)) = m.tool_calls.take() {
                for c in calls {
                    let func = c.get("function").cloned().unwrap_or(Value::Null);
                    m.content
                        .push_str(&format!("\n<tool_call>\n{func}\n</tool_call>"));
                }
            }
        }
    }
    if ctx.thinks {
        kwargs.insert("enable_thinking".into(), conv.thinking.into());
    }
    let template = ctx.chat_template.as_ref().map_err(|e| {
        ApiError::new(
            500,
            "server_error",
            format!("the model's chat template is unusable: {e}"),
        )
    })?;
    let mut text = template.render_with(&chat, true, &kwargs).map_err(|e| {
        ApiError::invalid(
            "messages",
            format!("messages cannot be rendered with the chat template: {e}"),
        )
    })?;
    if let Some(prefill) = &conv.prefill {
        text.push_str(prefill);
    }
    let ids = ctx
        .tokenizer
        .encode_with(&text, false, true)
        .map_err(|e| ApiError::invalid("messages", format!("messages cannot be tokenized: {e}")))?;
    Ok((text, ids))
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n}` of the rendered prompt.
pub(super) fn count_tokens(ctx: &ApiContext, req: &Request) -> Result<Response, ApiError> {
    let body = parse_body(&req.body)?;
    let f = Fields::new(&body, "");
    let conv = parse::conversation(ctx, &f)?;
    let (_, ids) = render(ctx, &conv)?;
    Ok(Response::json(200, &json!({"input_tokens": ids.len()})))
}

/// `POST /v1/messages`.
pub(super) fn messages_submission(
    ctx: &ApiContext,
    req: &Request,
    id: RequestId,
) -> Result<Submission, ApiError> {
    let body = parse_body(&req.body)?;
    let f = Fields::new(&body, "");
    let conv = parse::conversation(ctx, &f)?;
    let gen = parse::generation(ctx, &f, id)?;
    let (text, prompt_ids) = render(ctx, &conv)?;
    sampling::check_prompt(&prompt_ids, "messages", &ctx.settings)?;
    let tool_grammar = tool_calls::grammar(&conv.tools, &conv.choice, conv.parallel);
    let asked = match (tool_grammar, gen.schema.clone()) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "output_config.format",
                "output_config.format and a tool_choice of any or tool both constrain the \
                 reply: give one",
            ))
        }
        (Some(spec), None) => Some(Asked {
            spec,
            field: "tool_choice".into(),
        }),
        (None, Some(schema)) => Some(Asked {
            spec: npu_structured::ConstraintSpec::JsonSchema(schema),
            field: "output_config.format.schema".into(),
        }),
        (None, None) => None,
    };
    let constraints = match asked {
        Some(asked) => compile(ctx, &asked, 1)?,
        None => Vec::new(),
    };
    let think = ctx.thinks.then(|| reasoning::prompt_opens_think(&text));
    let mut writer = AnthropicWriter::new(
        id,
        conv.model.clone(),
        ctx.tokenizer.clone(),
        gen.stream,
        prompt_ids.len() as u32,
        gen.stop.clone(),
    )
    .with_thinking(think, conv.thinking);
    if !conv.tools.is_empty() && conv.choice != Choice::None {
        writer = writer.with_tools(conv.tools.iter().map(|t| t.name.clone()).collect());
    }
    Ok(Submission {
        request: GenerateRequest {
            id,
            prompt_ids,
            params: gen.params,
            max_new_tokens: gen.max_tokens,
            stop: gen.stop,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            speculative: true,
        },
        more: Vec::new(),
        writer: Box::new(writer),
        constraints,
        lora: None,
    })
}

//! vLLM's `POST /tokenize` and `POST /detokenize` (also under `/v1/`): a `prompt` (with
//! `add_special_tokens`, default true) or chat `messages` (rendered with the chat template as
//! the chat route renders them, `add_generation_prompt` default true) become
//! `{"count", "max_model_len", "tokens", "token_strs"}`; `tokens` become `{"prompt"}`. Malformed
//! bodies are 400s naming the field.

use serde_json::{json, Value};

use super::error::ApiError;
use super::fields::{parse_body, Fields};
use super::openai::render_chat;
use super::{sampling, ApiContext};
use crate::http::{Request, Response};

/// `POST /tokenize`.
pub(super) fn tokenize(ctx: &ApiContext, req: &Request) -> Result<Response, ApiError> {
    let body = parse_body(&req.body)?;
    let f = Fields::new(&body, "");
    ctx.check_model(f.string("model")?)?;
    let return_strs = f.bool("return_token_strs")?.unwrap_or(false);
    let tokens = match (f.get("prompt"), f.get("messages")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "prompt",
                "give prompt or messages, not both",
            ))
        }
        (Some(_), None) => {
            let prompt = f
                .string("prompt")?
                .ok_or_else(|| ApiError::invalid("prompt", "prompt must be a string"))?;
            let special = f.bool("add_special_tokens")?.unwrap_or(true);
            ctx.tokenizer
                .encode_with(prompt, special, true)
                .map_err(|e| {
                    ApiError::invalid("prompt", format!("prompt cannot be tokenized: {e}"))
                })?
        }
        (None, Some(_)) => render_chat(ctx, &f)?.prompt_ids,
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "prompt (a string) or messages (a list) is missing",
            ))
        }
    };
    let strs = return_strs.then(|| {
        tokens
            .iter()
            .map(|&t| ctx.tokenizer.token_text(t).unwrap_or("").to_string())
            .collect::<Vec<_>>()
    });
    Ok(Response::json(
        200,
        &json!({
            "count": tokens.len(),
            "max_model_len": ctx.settings.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }),
    ))
}

/// `POST /detokenize`.
pub(super) fn detokenize(ctx: &ApiContext, req: &Request) -> Result<Response, ApiError> {
    let body = parse_body(&req.body)?;
    let f = Fields::new(&body, "");
    ctx.check_model(f.string("model")?)?;
    let list = match f.get("tokens") {
        None => return Err(ApiError::invalid("tokens", "tokens is missing")),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(f.wrong("tokens", "a list of token ids", v)),
    };
    let mut ids = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let id = t
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                let name = format!("tokens[{i}]");
                ApiError::invalid(
                    &name,
                    format!("{name} must be a token id (an integer >= 0)"),
                )
            })?;
        ids.push(id);
    }
    sampling::check_token_ids(&ids, "tokens", ctx.tokenizer.vocab_size())?;
    Ok(Response::json(
        200,
        &json!({"prompt": ctx.tokenizer.decode(&ids, false)}),
    ))
}

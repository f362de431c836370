//! Reading an Anthropic Messages request: `system`, `messages` with their content blocks
//! (`text`, `tool_use`, `tool_result`, `thinking`), client `tools` with `input_schema`,
//! `tool_choice`, `thinking`, and the generation fields (`max_tokens`, `stop_sequences`,
//! `temperature`, `top_p`, `top_k`, `metadata`, `stream`), turned into the chat messages and
//! tools the chat template renders and the sampling the engine runs. Blocks and tools this
//! server cannot serve (images, documents, server tools) are 400s naming them.

use npu_protocol::SamplingParams;
use npu_tokenizer::ChatMessage;
use serde_json::{json, Map, Value};

use super::super::error::ApiError;
use super::super::fields::Fields;
use super::super::sampling;
use super::super::tool_calls::{Choice, Tool};
use super::super::ApiContext;
use crate::engine::RequestId;

/// What both routes (`/v1/messages` and `/count_tokens`) render into a prompt.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Conversation {
    /// The served name the response carries.
    pub model: String,
    pub chat: Vec<ChatMessage>,
    /// A last assistant turn of text: the reply continues it (Anthropic's prefill).
    pub prefill: Option<String>,
    pub tools: Vec<Tool>,
    pub choice: Choice,
    /// Several tool calls may come in one reply (not `disable_parallel_tool_use`).
    pub parallel: bool,
    /// `thinking` asked for thinking blocks (`enabled` or `adaptive`).
    pub thinking: bool,
}

/// The generation fields of `/v1/messages`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Generation {
    pub max_tokens: u32,
    pub stop: Vec<String>,
    pub params: SamplingParams,
    pub stream: bool,
    /// `output_config.format`: the JSON Schema the reply follows.
    pub schema: Option<Value>,
}

/// Content block types Anthropic defines that this server cannot take as input.
const REFUSED_BLOCKS: &[&str] = &[
    "image",
    "document",
    "search_result",
    "container_upload",
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
];

fn obj<'a>(v: &'a Value, field: &str, what: &str) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object()
        .ok_or_else(|| ApiError::invalid(field, format!("{field} must be {what}")))
}

fn block_type<'a>(b: &'a Map<String, Value>, field: &str) -> Result<&'a str, ApiError> {
    match b.get("type") {
        Some(Value::String(t)) => Ok(t),
        Some(_) => Err(ApiError::invalid(
            &format!("{field}.type"),
            format!("{field}.type must be a string"),
        )),
        None => Err(ApiError::invalid(
            &format!("{field}.type"),
            format!("{field}.type is missing"),
        )),
    }
}

fn refuse_block(field: &str, ty: &str) -> ApiError {
    let why = match ty {
        "image" => "image input is not supported: this server serves a text model".to_string(),
        "document" => "document input is not supported: send the text as a text block".into(),
        t if REFUSED_BLOCKS.contains(&t) => {
            format!("{t} blocks are not supported: this server runs no server tools")
        }
        t => format!("content blocks of type {t:?} are not supported"),
    };
    ApiError::invalid(&format!("{field}.type"), format!("{field}: {why}"))
}

fn text_of(b: &Map<String, Value>, field: &str) -> Result<String, ApiError> {
    match b.get("text") {
        Some(Value::String(t)) => Ok(t.clone()),
        _ => Err(ApiError::invalid(
            &format!("{field}.text"),
            format!("{field}.text must be a string"),
        )),
    }
}

/// A string, or a list of `text` blocks (`system`, a `tool_result`'s `content`), joined.
fn text_blocks(v: &Value, field: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (j, b) in blocks.iter().enumerate() {
                let bf = format!("{field}[{j}]");
                let b = obj(b, &bf, "a content block object")?;
                match block_type(b, &bf)? {
                    "text" => parts.push(text_of(b, &bf)?),
                    other => return Err(refuse_block(&bf, other)),
                }
            }
            Ok(parts.join("\n"))
        }
        _ => Err(ApiError::invalid(
            field,
            format!("{field} must be a string or a list of text blocks"),
        )),
    }
}

/// One turn of `messages`, appended to `chat` (a user turn's `tool_result` blocks become tool
/// messages before its text). `names` maps earlier `tool_use` ids to their tools' names.
fn message(
    i: usize,
    m: &Value,
    chat: &mut Vec<ChatMessage>,
    names: &mut Vec<(String, String)>,
) -> Result<(), ApiError> {
    let field = format!("messages[{i}]");
    let m = obj(m, &field, "an object with role and content")?;
    let role = match m.get("role") {
        Some(Value::String(r)) if r == "user" || r == "assistant" => r.as_str(),
        Some(Value::String(r)) if r == "system" => {
            return Err(ApiError::invalid(
                &format!("{field}.role"),
                format!("{field}.role: system prompts go in the top-level system field"),
            ))
        }
        Some(Value::String(r)) => {
            return Err(ApiError::invalid(
                &format!("{field}.role"),
                format!("{field}.role {r:?} is not user or assistant"),
            ))
        }
        _ => {
            return Err(ApiError::invalid(
                &format!("{field}.role"),
                format!("{field}.role must be \"user\" or \"assistant\""),
            ))
        }
    };
    let cf = format!("{field}.content");
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            chat.push(ChatMessage::new(role, s.clone()));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        Some(_) => {
            return Err(ApiError::invalid(
                &cf,
                format!("{cf} must be a string or a list of content blocks"),
            ))
        }
        None => return Err(ApiError::invalid(&cf, format!("{cf} is missing"))),
    };
    let mut text = Vec::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let bf = format!("{cf}[{j}]");
        let b = obj(b, &bf, "a content block object")?;
        match (block_type(b, &bf)?, role) {
            ("text", _) => text.push(text_of(b, &bf)?),
            // Earlier thinking is not rendered again (as the chat route drops an earlier
            // reply's reasoning_content).
            ("thinking" | "redacted_thinking", "assistant") => {}
            ("tool_use", "assistant") => {
                let id = b.get("id").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(&format!("{bf}.id"), format!("{bf}.id must be a string"))
                })?;
                let name = b
                    .get("name")
                    .and_then(Value::as_str)
                    .filter(|n| !n.is_empty())
                    .ok_or_else(|| {
                        ApiError::invalid(
                            &format!("{bf}.name"),
                            format!("{bf}.name must be a non-empty string"),
                        )
                    })?;
                let input = match b.get("input") {
                    Some(v @ Value::Object(_)) => v.clone(),
                    _ => {
                        return Err(ApiError::invalid(
                            &format!("{bf}.input"),
                            format!("{bf}.input must be an object"),
                        ))
                    }
                };
                names.push((id.to_string(), name.to_string()));
                calls.push(json!({
                    "id": id, "type": "function",
                    "function": {"name": name, "arguments": input},
                }));
            }
            ("tool_result", "user") => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            &format!("{bf}.tool_use_id"),
                            format!("{bf}.tool_use_id must be a string"),
                        )
                    })?;
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(v) => text_blocks(v, &format!("{bf}.content"))?,
                };
                let is_error = match b.get("is_error") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(e)) => *e,
                    Some(_) => {
                        return Err(ApiError::invalid(
                            &format!("{bf}.is_error"),
                            format!("{bf}.is_error must be a boolean"),
                        ))
                    }
                };
                let mut msg = ChatMessage::new(
                    "tool",
                    if is_error {
                        format!("Error: {content}")
                    } else {
                        content
                    },
                );
                msg.tool_call_id = Some(id.to_string());
                msg.name = names
                    .iter()
                    .rev()
                    .find(|(i, _)| i == id)
                    .map(|(_, n)| n.clone());
                chat.push(msg);
            }
            (t @ ("thinking" | "redacted_thinking" | "tool_use" | "tool_result"), _) => {
                return Err(ApiError::invalid(
                    &format!("{bf}.type"),
                    format!("{bf}: {t} blocks belong in {} turns", other_role(role)),
                ))
            }
            (other, _) => return Err(refuse_block(&bf, other)),
        }
    }
    if !text.is_empty() || !calls.is_empty() || blocks.is_empty() {
        let mut msg = ChatMessage::new(role, text.join("\n"));
        if !calls.is_empty() {
            msg.tool_calls = Some(Value::Array(calls));
        }
        chat.push(msg);
    }
    Ok(())
}

fn other_role(role: &str) -> &'static str {
    if role == "user" {
        "assistant"
    } else {
        "user"
    }
}

/// Server tool types (`web_search_20250305`, `bash_20250124`, ...) carry a dated `type`.
fn tools(v: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let list = match v {
        None => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid("tools", "tools must be a list of tools")),
    };
    let mut out: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let field = format!("tools[{i}]");
        let t = obj(t, &field, "an object with name and input_schema")?;
        match t.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(ty)) if ty == "custom" => {}
            Some(Value::String(ty)) => {
                return Err(ApiError::invalid(
                    &format!("{field}.type"),
                    format!(
                        "{field}.type {ty:?}: server tools are not supported; give client \
                         tools (name, description, input_schema)"
                    ),
                ))
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("{field}.type"),
                    format!("{field}.type must be a string"),
                ))
            }
        }
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                ApiError::invalid(
                    &format!("{field}.name"),
                    format!("{field}.name must be a non-empty string"),
                )
            })?;
        if out.iter().any(|o| o.name == name) {
            return Err(ApiError::invalid(
                &format!("{field}.name"),
                format!("{field}: a second tool named {name:?}"),
            ));
        }
        let schema = match t.get("input_schema") {
            Some(s @ Value::Object(_)) => s.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("{field}.input_schema"),
                    format!("{field}.input_schema must be a JSON Schema object"),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    &format!("{field}.input_schema"),
                    format!("{field}.input_schema is missing"),
                ))
            }
        };
        let mut function = Map::new();
        function.insert("name".into(), name.into());
        match t.get("description") {
            None | Some(Value::Null) => {}
            Some(Value::String(d)) => {
                function.insert("description".into(), d.clone().into());
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("{field}.description"),
                    format!("{field}.description must be a string"),
                ))
            }
        }
        function.insert("parameters".into(), schema.clone());
        out.push(Tool {
            name: name.to_string(),
            raw: json!({"type": "function", "function": Value::Object(function)}),
            parameters: schema,
        });
    }
    Ok(out)
}

/// `tool_choice`: `{type: auto|any|tool|none, name, disable_parallel_tool_use}`; returns the
/// choice and whether parallel calls are allowed.
fn tool_choice(v: Option<&Value>, tools: &[Tool]) -> Result<(Choice, bool), ApiError> {
    let Some(v) = v else {
        return Ok((Choice::Auto, true));
    };
    let o = obj(v, "tool_choice", "an object with a type")?;
    let parallel = match o.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(d)) => !d,
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice.disable_parallel_tool_use",
                "tool_choice.disable_parallel_tool_use must be a boolean",
            ))
        }
    };
    let choice = match o.get("type").and_then(Value::as_str) {
        Some("auto") => Choice::Auto,
        Some("none") => Choice::None,
        Some("any") => Choice::Required,
        Some("tool") => {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(
                    "tool_choice.name",
                    "tool_choice of type tool names the tool: {\"type\": \"tool\", \"name\": ...}",
                )
            })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice.name",
                    format!("tool_choice names {name:?}, which is not one of the tools"),
                ));
            }
            Choice::Named(name.to_string())
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                format!("tool_choice.type {other:?} is not one of auto, any, tool, none"),
            ))
        }
        None => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                "tool_choice.type must be one of auto, any, tool, none",
            ))
        }
    };
    if tools.is_empty() && matches!(choice, Choice::Required | Choice::Named(_)) {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice asks for a tool call, but no tools are given",
        ));
    }
    Ok((choice, parallel))
}

/// `thinking`: Some(budget) when enabled with a budget, whether thinking blocks are wanted.
fn thinking(f: &Fields) -> Result<(bool, Option<i64>), ApiError> {
    let t = f.object("thinking", "thinking.")?;
    match t.string("type")? {
        None if f.get("thinking").is_none() => Ok((false, None)),
        None => Err(ApiError::invalid(
            "thinking.type",
            "thinking.type is missing (enabled, adaptive or disabled)",
        )),
        Some("disabled") => Ok((false, None)),
        Some("adaptive") => Ok((true, None)),
        Some("enabled") => match t.i64("budget_tokens")? {
            Some(b) if b >= 1 => Ok((true, Some(b))),
            Some(b) => Err(ApiError::invalid(
                "thinking.budget_tokens",
                format!("thinking.budget_tokens must be a positive integer, got {b}"),
            )),
            None => Err(ApiError::invalid(
                "thinking.budget_tokens",
                "thinking.budget_tokens is missing (thinking of type enabled needs a budget)",
            )),
        },
        Some(other) => Err(ApiError::invalid(
            "thinking.type",
            format!("thinking.type {other:?} is not one of enabled, adaptive, disabled"),
        )),
    }
}

/// The prompt part of a request (both routes). Any `model` is answered: a served name is
/// echoed, another (Anthropic clients send their own model names) gets the default one.
pub(crate) fn conversation(ctx: &ApiContext, f: &Fields) -> Result<Conversation, ApiError> {
    let served = ctx.settings.served_names();
    let model = match f.string("model")? {
        Some(name) if served.iter().any(|n| n == name) => name.to_string(),
        _ => served[0].clone(),
    };
    let mut chat = Vec::new();
    if let Some(system) = f.get("system") {
        let text = text_blocks(system, "system")?;
        if !text.is_empty() {
            chat.push(ChatMessage::system(text));
        }
    }
    let messages = match f.get("messages") {
        None => return Err(ApiError::invalid("messages", "messages is missing")),
        Some(Value::Array(m)) => m,
        Some(v) => return Err(f.wrong("messages", "a list of messages", v)),
    };
    let mut names = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        message(i, m, &mut chat, &mut names)?;
    }
    // A last assistant turn of text only is a prefill: the reply continues it.
    let prefill = match chat.last() {
        Some(m) if m.role == "assistant" && m.tool_calls.is_none() => {
            chat.pop().map(|m| m.content.trim_end().to_string())
        }
        _ => None,
    };
    let tools = tools(f.get("tools"))?;
    let (choice, parallel) = tool_choice(f.get("tool_choice"), &tools)?;
    let (thinking, _) = thinking(f)?;
    Ok(Conversation {
        model,
        chat,
        prefill,
        tools,
        choice,
        parallel,
        thinking,
    })
}

/// The generation fields of `/v1/messages`: `max_tokens` (required), `stop_sequences`,
/// `temperature`, `top_p`, `top_k`, `metadata`, `stream`, `output_config` (`effort` read and
/// ignored, `format` a JSON Schema).
pub(crate) fn generation(
    ctx: &ApiContext,
    f: &Fields,
    id: RequestId,
) -> Result<Generation, ApiError> {
    let s = &ctx.settings;
    if f.get("max_tokens").is_none() {
        return Err(ApiError::invalid(
            "max_tokens",
            "max_tokens is missing: /v1/messages requires it",
        ));
    }
    let max_tokens = sampling::max_new_tokens(f, "max_tokens", s)?;
    if let (true, Some(budget)) = thinking(f)? {
        if budget >= i64::from(max_tokens) {
            return Err(ApiError::invalid(
                "thinking.budget_tokens",
                format!(
                    "thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})"
                ),
            ));
        }
    }
    let stop = f.strings("stop_sequences")?;
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ApiError::invalid(
            &format!("stop_sequences[{i}]"),
            format!("stop_sequences[{i}] is empty"),
        ));
    }
    let d = &s.sampling_defaults;
    let temperature = sampling::temperature(f, "temperature")?
        .or(d.temperature)
        .unwrap_or(1.0);
    let top_p = sampling::top_p(f, "top_p")?.or(d.top_p).unwrap_or(1.0);
    let top_k = sampling::top_k(f, "top_k", false)?.or(d.top_k).unwrap_or(0);
    let meta = f.object("metadata", "metadata.")?;
    meta.string("user_id")?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let out = f.object("output_config", "output_config.")?;
    out.string("effort")?;
    let format = out.object("format", "output_config.format.")?;
    let schema = match format.string("type")? {
        None if out.get("format").is_none() => None,
        Some("json_schema") => match format.get("schema") {
            Some(s @ Value::Object(_)) => Some(s.clone()),
            Some(v) => return Err(format.wrong("schema", "a JSON Schema object", v)),
            None => {
                return Err(ApiError::invalid(
                    "output_config.format.schema",
                    "output_config.format.schema is missing",
                ))
            }
        },
        _ => {
            return Err(ApiError::invalid(
                "output_config.format.type",
                "output_config.format.type must be json_schema",
            ))
        }
    };
    Ok(Generation {
        schema,
        max_tokens,
        stop,
        params: SamplingParams {
            do_sample: temperature > 0.0,
            temperature,
            top_k,
            top_p,
            min_p: d.min_p.unwrap_or(0.0),
            repetition_penalty: d.repetition_penalty.unwrap_or(1.0),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: sampling::random_seed(id),
            top_n: 0,
            logit_bias: Vec::new(),
        },
        stream,
    })
}

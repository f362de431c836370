//! Reading a `POST /v1/responses` body: `input` (a string, or items: messages, `function_call`,
//! `function_call_output`, `reasoning`) into canonical items, `tools` (flat function tools) and
//! `tool_choice` into the chat route's tools, `text.format` into a structured-output constraint,
//! `reasoning`, the sampling fields, `store` / `previous_response_id`, and what the response
//! echoes back. What the server does not do (background mode, built-in tools, conversations,
//! stored prompts, images and files) is refused by name with a 400 naming the field.

use npu_structured::ConstraintSpec;
use npu_tokenizer::ChatMessage;
use serde_json::{json, Map, Value};

use super::super::error::ApiError;
use super::super::fields::Fields;
use super::super::sampling;
use super::super::structured::Asked;
use super::super::tool_calls::{self, Choice, Tool};
use crate::api::ApiSettings;

/// Tool types of OpenAI's that run on OpenAI's side (or the client's, in their own item
/// types): refused by name.
const BUILT_IN_TOOLS: &[&str] = &[
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "computer_use_preview",
    "computer",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
];

const EFFORTS: &[&str] = &["none", "minimal", "low", "medium", "high", "xhigh"];
const SUMMARIES: &[&str] = &["auto", "concise", "detailed"];

/// A `POST /v1/responses` request, checked.
pub(crate) struct Parsed {
    pub stream: bool,
    pub store: bool,
    pub previous_response_id: Option<String>,
    pub instructions: Option<String>,
    /// This request's input items in canonical form.
    pub input: Vec<Value>,
    /// The tools in the chat route's form.
    pub tools: Vec<Tool>,
    pub tool_choice: Choice,
    pub parallel_tool_calls: bool,
    /// `text.format` as a constraint (json_schema, json_object), or none.
    pub constraint: Option<Asked>,
    /// `reasoning.effort`.
    pub effort: Option<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    /// The tokens the request may generate (max_output_tokens or the server's default).
    pub max_tokens: u32,
    pub stop: Vec<String>,
    pub seed: Option<u64>,
    /// What the response object echoes: instructions, tools, tool_choice, text, reasoning,
    /// metadata, user, max_tool_calls, truncation, service_tier...
    pub echo: Map<String, Value>,
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn wrong(field: &str, expected: &str, v: &Value) -> ApiError {
    ApiError::invalid(
        field,
        format!("{field} must be {expected}, got {}", kind_of(v)),
    )
}

/// `obj[key]` as a string (absent or null: None).
fn opt_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    field: &str,
) -> Result<Option<&'a str>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(wrong(&format!("{field}.{key}"), "a string", v)),
    }
}

fn req_str<'a>(obj: &'a Map<String, Value>, key: &str, field: &str) -> Result<&'a str, ApiError> {
    opt_str(obj, key, field)?.ok_or_else(|| {
        ApiError::invalid(
            &format!("{field}.{key}"),
            format!("{field}.{key} is missing"),
        )
    })
}

fn one_of(field: &str, v: &str, allowed: &[&str]) -> Result<(), ApiError> {
    if allowed.contains(&v) {
        Ok(())
    } else {
        Err(ApiError::invalid(
            field,
            format!("{field} {v:?} is not one of {}", allowed.join(", ")),
        ))
    }
}

/// Refuses a field the server does not serve, when it asks for something.
fn refuse_if(f: &Fields, key: &str, set: bool, why: &str) -> Result<(), ApiError> {
    if set {
        return Err(ApiError::invalid(&f.name(key), format!("{key}: {why}")));
    }
    Ok(())
}

pub(crate) fn parse(f: &Fields, s: &ApiSettings) -> Result<Parsed, ApiError> {
    let mut echo = Map::new();
    refuse_if(
        f,
        "background",
        f.bool("background")?.unwrap_or(false),
        "background mode is not supported (responses are generated while the request waits)",
    )?;
    refuse_if(
        f,
        "conversation",
        f.get("conversation").is_some(),
        "the Conversations API is not supported; continue a response with previous_response_id",
    )?;
    refuse_if(
        f,
        "prompt",
        f.get("prompt").is_some(),
        "stored prompt templates are not supported; send instructions and input",
    )?;
    refuse_if(
        f,
        "top_logprobs",
        f.int_in("top_logprobs", 0, 20)?.unwrap_or(0) > 0,
        "log probabilities are not supported on /v1/responses (use /v1/chat/completions)",
    )?;
    let stream = f.bool("stream")?.unwrap_or(false);
    f.object("stream_options", "stream_options.")?;
    let store = f.bool("store")?.unwrap_or(true);
    let previous_response_id = f.string("previous_response_id")?.map(str::to_string);
    let instructions = f.string("instructions")?.map(str::to_string);
    let input = match f.get("input") {
        None => return Err(ApiError::invalid("input", "input is missing")),
        Some(Value::String(t)) => vec![message_item("user", t)],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, it)| item(&format!("input[{i}]"), it))
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(wrong("input", "a string or a list of input items", v)),
    };
    if input.is_empty() && previous_response_id.is_none() {
        return Err(ApiError::invalid("input", "input is empty"));
    }
    let (tools, tools_echo) = tools(f.get("tools"))?;
    let (tool_choice, choice_echo) = tool_choice(f.get("tool_choice"), &tools)?;
    let parallel_tool_calls = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let max_tool_calls = f.int_in("max_tool_calls", 1, 1 << 20)?;
    let (constraint, text_echo) = text(f)?;
    let (effort, reasoning_echo) = reasoning(f)?;
    let metadata = metadata(f.get("metadata"))?;
    let user = f.string("user")?;
    for key in ["safety_identifier", "prompt_cache_key", "service_tier"] {
        f.string(key)?;
    }
    if let Some(t) = f.string("truncation")? {
        one_of("truncation", t, &["auto", "disabled"])?;
    }
    match f.get("include") {
        None | Some(Value::Array(_)) => {}
        Some(v) => return Err(wrong("include", "a list of strings", v)),
    }
    let temperature = sampling::temperature(f, "temperature")?;
    let top_p = sampling::top_p(f, "top_p")?;
    let top_k = sampling::top_k(f, "top_k", true)?;
    let max_output_tokens = f
        .i64("max_output_tokens")?
        .map(|n| n.clamp(0, u32::MAX as i64) as u32);
    let max_tokens = sampling::max_new_tokens(f, "max_output_tokens", s)?;
    let stop = f.strings("stop")?;
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ApiError::invalid("stop", format!("stop[{i}] is empty")));
    }
    let seed = f.u64("seed")?;
    if constraint.is_some() && matches!(tool_choice, Choice::Required | Choice::Named(_)) {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice asks for a tool call and text.format constrains the reply to JSON: \
             give one",
        ));
    }
    echo.insert("instructions".into(), instructions.clone().into());
    echo.insert("tools".into(), Value::Array(tools_echo));
    echo.insert("tool_choice".into(), choice_echo);
    echo.insert("parallel_tool_calls".into(), parallel_tool_calls.into());
    echo.insert("max_tool_calls".into(), max_tool_calls.into());
    echo.insert("text".into(), text_echo);
    echo.insert("reasoning".into(), reasoning_echo);
    echo.insert("metadata".into(), metadata);
    echo.insert("user".into(), user.into());
    echo.insert(
        "truncation".into(),
        f.string("truncation")?.unwrap_or("disabled").into(),
    );
    echo.insert(
        "service_tier".into(),
        f.string("service_tier")?.unwrap_or("default").into(),
    );
    echo.insert("store".into(), store.into());
    echo.insert("background".into(), false.into());
    echo.insert(
        "previous_response_id".into(),
        previous_response_id.clone().into(),
    );
    echo.insert("max_output_tokens".into(), max_output_tokens.into());
    Ok(Parsed {
        stream,
        store,
        previous_response_id,
        instructions,
        input,
        tools,
        tool_choice,
        parallel_tool_calls,
        constraint,
        effort,
        temperature,
        top_p,
        top_k,
        max_tokens,
        stop,
        seed,
        echo,
    })
}

/// A message item in canonical form.
pub(crate) fn message_item(role: &str, text: &str) -> Value {
    let part = if role == "assistant" {
        json!({"type": "output_text", "text": text, "annotations": []})
    } else {
        json!({"type": "input_text", "text": text})
    };
    json!({"type": "message", "role": role, "content": [part]})
}

/// One input item, checked, in canonical form (what the store keeps and `to_chat` reads).
pub(crate) fn item(field: &str, v: &Value) -> Result<Value, ApiError> {
    let Value::Object(m) = v else {
        return Err(wrong(field, "an object (an input item)", v));
    };
    let ty = match opt_str(m, "type", field)? {
        Some(t) => t,
        None if m.contains_key("role") => "message",
        None => {
            return Err(ApiError::invalid(
                &format!("{field}.type"),
                format!("{field}.type is missing"),
            ))
        }
    };
    let mut out = match ty {
        "message" => {
            let role = req_str(m, "role", field)?;
            one_of(
                &format!("{field}.role"),
                role,
                &["user", "system", "developer", "assistant"],
            )?;
            let text = content_text(&format!("{field}.content"), m.get("content"))?;
            message_item(role, &text)
        }
        "function_call" => {
            let call_id = req_str(m, "call_id", field)?;
            let name = req_str(m, "name", field)?;
            let arguments = req_str(m, "arguments", field)?;
            json!({"type": "function_call", "call_id": call_id, "name": name,
                   "arguments": arguments, "status": "completed"})
        }
        "function_call_output" => {
            let call_id = req_str(m, "call_id", field)?;
            let of = format!("{field}.output");
            if m.get("output").is_none_or(Value::is_null) {
                return Err(ApiError::invalid(&of, format!("{of} is missing")));
            }
            let output = content_text(&of, m.get("output"))?;
            json!({"type": "function_call_output", "call_id": call_id, "output": output})
        }
        "reasoning" => {
            // Earlier thinking: kept (chat templates drop it from the prompt).
            let mut text = String::new();
            if let Some(Value::Array(parts)) = m.get("content") {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        text.push_str(t);
                    }
                }
            }
            json!({"type": "reasoning", "summary": [],
                   "content": [{"type": "reasoning_text", "text": text}]})
        }
        "item_reference" => {
            return Err(ApiError::invalid(
                &format!("{field}.type"),
                format!("{field}: item_reference is not supported; send the item itself or use previous_response_id"),
            ))
        }
        other => {
            return Err(ApiError::invalid(
                &format!("{field}.type"),
                format!(
                    "{field}.type {other:?} is not one of message, function_call, \
                     function_call_output, reasoning (built-in tools' items are not supported)"
                ),
            ))
        }
    };
    if let Some(Value::String(id)) = m.get("id") {
        out["id"] = id.clone().into();
    }
    Ok(out)
}

/// A message's content or a call's output: a string, or a list of text parts (`input_text`,
/// `output_text`, `refusal`); images, files and audio are refused.
fn content_text(field: &str, v: Option<&Value>) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let pf = format!("{field}[{j}]");
                let Value::Object(p) = p else {
                    return Err(wrong(&pf, "an object (a content part)", p));
                };
                let ty = req_str(p, "type", &pf)?;
                let key = match ty {
                    "input_text" | "output_text" | "text" => "text",
                    "refusal" => "refusal",
                    "input_image" | "input_file" | "input_audio" => {
                        return Err(ApiError::invalid(
                            &format!("{pf}.type"),
                            format!(
                                "{pf}.type {ty:?} is not supported: this model reads text only"
                            ),
                        ))
                    }
                    other => {
                        return Err(ApiError::invalid(
                            &format!("{pf}.type"),
                            format!(
                            "{pf}.type {other:?} is not one of input_text, output_text, refusal"
                        ),
                        ))
                    }
                };
                text.push_str(req_str(p, key, &pf)?);
            }
            Ok(text)
        }
        Some(v) => Err(wrong(field, "a string or a list of content parts", v)),
    }
}

/// `tools`: flat function tools (`{type: function, name, description, parameters, strict}`)
/// into the chat route's tools, and their echo.
fn tools(v: Option<&Value>) -> Result<(Vec<Tool>, Vec<Value>), ApiError> {
    let list = match v {
        None => return Ok((Vec::new(), Vec::new())),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(wrong("tools", "a list of tools", v)),
    };
    let (mut chat, mut echo) = (Vec::new(), Vec::new());
    for (i, t) in list.iter().enumerate() {
        let field = format!("tools[{i}]");
        let Value::Object(m) = t else {
            return Err(wrong(&field, "an object (a tool)", t));
        };
        let ty = req_str(m, "type", &field)?;
        if BUILT_IN_TOOLS.contains(&ty) {
            return Err(ApiError::invalid(
                &format!("{field}.type"),
                format!("{field}: the built-in tool {ty:?} is not supported (function tools only)"),
            ));
        }
        one_of(&format!("{field}.type"), ty, &["function"])?;
        let name = req_str(m, "name", &field)?;
        let description = opt_str(m, "description", &field)?;
        let parameters = match m.get("parameters") {
            None | Some(Value::Null) => None,
            Some(p @ Value::Object(_)) => Some(p.clone()),
            Some(p) => {
                return Err(wrong(
                    &format!("{field}.parameters"),
                    "a JSON Schema object",
                    p,
                ))
            }
        };
        let strict = match m.get("strict") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => return Err(wrong(&format!("{field}.strict"), "a boolean", v)),
        };
        let mut func = Map::new();
        func.insert("name".into(), name.into());
        if let Some(d) = description {
            func.insert("description".into(), d.into());
        }
        if let Some(p) = &parameters {
            func.insert("parameters".into(), p.clone());
        }
        if let Some(s) = strict {
            func.insert("strict".into(), s.into());
        }
        chat.push(json!({"type": "function", "function": func}));
        echo.push(
            json!({"type": "function", "name": name, "description": description,
                         "parameters": parameters, "strict": strict}),
        );
    }
    // The chat route's checks (names, duplicates), its field names made flat.
    let (tools, _) = tool_calls::parse(Some(&Value::Array(chat)), None).map_err(flat)?;
    Ok((tools, echo))
}

/// A chat-route error about `tools[i].function.x` as this route names it (`tools[i].x`).
fn flat(mut e: ApiError) -> ApiError {
    e.param = e.param.map(|p| p.replace(".function", ""));
    e.message = e.message.replace(".function", "");
    e
}

fn tool_choice(v: Option<&Value>, tools: &[Tool]) -> Result<(Choice, Value), ApiError> {
    let chat = match v {
        None => {
            return Ok((
                if tools.is_empty() {
                    Choice::None
                } else {
                    Choice::Auto
                },
                "auto".into(),
            ))
        }
        Some(Value::String(s)) => {
            one_of("tool_choice", s, &["auto", "none", "required"])?;
            Value::String(s.clone())
        }
        Some(Value::Object(m)) => {
            let ty = req_str(m, "type", "tool_choice")?;
            if ty != "function" {
                return Err(ApiError::invalid(
                    "tool_choice.type",
                    format!("tool_choice.type {ty:?} is not supported (auto, none, required or {{\"type\": \"function\", \"name\": ...}})"),
                ));
            }
            let name = req_str(m, "name", "tool_choice")?;
            json!({"type": "function", "function": {"name": name}})
        }
        Some(v) => return Err(wrong("tool_choice", "a string or an object", v)),
    };
    let raw: Vec<Value> = tools.iter().map(|t| t.raw.clone()).collect();
    let (_, choice) = tool_calls::parse(Some(&Value::Array(raw)), Some(&chat)).map_err(flat)?;
    Ok((choice, v.cloned().unwrap_or_else(|| "auto".into())))
}

/// `text.format`: text, json_schema (through the structured-output engine) or json_object.
fn text(f: &Fields) -> Result<(Option<Asked>, Value), ApiError> {
    let t = f.object("text", "text.")?;
    let verbosity = t.string("verbosity")?;
    if let Some(v) = verbosity {
        one_of("text.verbosity", v, &["low", "medium", "high"])?;
    }
    let fmt = t.object("format", "text.format.")?;
    let (asked, format) = match fmt.string("type")? {
        None if t.get("format").is_some() => {
            return Err(ApiError::invalid(
                "text.format.type",
                "text.format.type is missing",
            ))
        }
        None | Some("text") => (None, json!({"type": "text"})),
        Some("json_object") => (
            Some(Asked {
                spec: ConstraintSpec::JsonObject,
                field: "text.format".into(),
            }),
            json!({"type": "json_object"}),
        ),
        Some("json_schema") => {
            let schema = match fmt.get("schema") {
                Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                Some(v) => return Err(wrong("text.format.schema", "a JSON Schema object", v)),
                None => {
                    return Err(ApiError::invalid(
                        "text.format.schema",
                        "text.format.schema is missing",
                    ))
                }
            };
            let name = fmt.string("name")?.unwrap_or("response");
            let description = fmt.string("description")?;
            let strict = fmt.bool("strict")?;
            let echo = json!({"type": "json_schema", "name": name, "schema": schema,
                              "description": description, "strict": strict});
            (
                Some(Asked {
                    spec: ConstraintSpec::JsonSchema(schema),
                    field: "text.format.schema".into(),
                }),
                echo,
            )
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "text.format.type",
                format!("text.format.type {other:?} is not one of text, json_schema, json_object"),
            ))
        }
    };
    Ok((asked, json!({"format": format, "verbosity": verbosity})))
}

fn reasoning(f: &Fields) -> Result<(Option<String>, Value), ApiError> {
    let r = f.object("reasoning", "reasoning.")?;
    let effort = r.string("effort")?;
    if let Some(e) = effort {
        one_of("reasoning.effort", e, EFFORTS)?;
    }
    let mut summary = None;
    for key in ["summary", "generate_summary"] {
        if let Some(s) = r.string(key)? {
            one_of(&format!("reasoning.{key}"), s, SUMMARIES)?;
            summary = Some(s);
        }
    }
    Ok((
        effort.map(str::to_string),
        json!({"effort": effort, "summary": summary}),
    ))
}

/// `metadata`: up to 16 string values, keys up to 64 characters, values up to 512.
fn metadata(v: Option<&Value>) -> Result<Value, ApiError> {
    let m = match v {
        None => return Ok(Value::Null),
        Some(Value::Object(m)) => m,
        Some(v) => return Err(wrong("metadata", "an object of strings", v)),
    };
    if m.len() > 16 {
        return Err(ApiError::invalid(
            "metadata",
            format!("metadata has {} keys (at most 16)", m.len()),
        ));
    }
    for (k, val) in m {
        let field = format!("metadata.{k}");
        if k.chars().count() > 64 {
            return Err(ApiError::invalid(
                "metadata",
                "metadata keys are at most 64 characters",
            ));
        }
        match val {
            Value::String(s) if s.chars().count() <= 512 => {}
            Value::String(_) => {
                return Err(ApiError::invalid(
                    &field,
                    format!("{field} is over 512 characters"),
                ))
            }
            v => return Err(wrong(&field, "a string", v)),
        }
    }
    Ok(Value::Object(m.clone()))
}

/// Canonical items as chat messages: consecutive function calls join one assistant turn (after
/// its text, when the turn has some), outputs are tool turns naming their function, reasoning
/// is left out (chat templates drop earlier thinking).
pub(crate) fn to_chat(items: &[Value]) -> Vec<ChatMessage> {
    let mut chat: Vec<ChatMessage> = Vec::new();
    let mut names: Vec<(String, String)> = Vec::new();
    let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    for it in items {
        match it.get("type").and_then(Value::as_str) {
            Some("message") => {
                let role = match s(it, "role").as_str() {
                    "developer" => "system".to_string(),
                    r => r.to_string(),
                };
                let text: String = it
                    .get("content")
                    .and_then(Value::as_array)
                    .map(|parts| {
                        parts
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Value::as_str))
                            .collect()
                    })
                    .unwrap_or_default();
                chat.push(ChatMessage::new(role, text));
            }
            Some("function_call") => {
                let (call_id, name) = (s(it, "call_id"), s(it, "name"));
                let raw = s(it, "arguments");
                // Templates index arguments as an object.
                let arguments = serde_json::from_str::<Value>(&raw)
                    .ok()
                    .filter(Value::is_object)
                    .unwrap_or(Value::String(raw));
                let call = json!({"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}});
                names.push((call_id, name));
                match chat.last_mut() {
                    Some(m) if m.role == "assistant" => match &mut m.tool_calls {
                        Some(Value::Array(calls)) => calls.push(call),
                        _ => m.tool_calls = Some(Value::Array(vec![call])),
                    },
                    _ => {
                        let mut m = ChatMessage::new("assistant", "");
                        m.tool_calls = Some(Value::Array(vec![call]));
                        chat.push(m);
                    }
                }
            }
            Some("function_call_output") => {
                let call_id = s(it, "call_id");
                let mut m = ChatMessage::new("tool", s(it, "output"));
                m.name = names
                    .iter()
                    .rev()
                    .find(|(c, _)| *c == call_id)
                    .map(|(_, n)| n.clone());
                m.tool_call_id = Some(call_id);
                chat.push(m);
            }
            _ => {}
        }
    }
    chat
}

#[cfg(test)]
#[path = "parse_tests.rs"]
mod tests;

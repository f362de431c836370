//! The OpenAI front end's requests: `POST /v1/completions` (prompt text or token ids) and
//! `POST /v1/chat/completions` (messages rendered with the model's chat template), validated
//! into a `GenerateRequest` with their response writer (openai_stream.rs).

use npu_protocol::{SamplingParams, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE};
use serde_json::Value;

use super::error::ApiError;
use super::fields::{parse_body, token_id_list, Fields};
use super::openai_choices::ChoicesWriter;
use super::openai_stream::{OpenAiKind, OpenAiWriter};
use super::reasoning;
use super::sampling;
use super::tool_calls;
use super::ApiContext;
use crate::engine::{GenerateRequest, RequestId};
use crate::http::{Request, Submission};
use npu_tokenizer::ChatMessage;

/// What both OpenAI routes share.
struct Common {
    /// The served name the request asked for (responses carry it).
    model: String,
    params: SamplingParams,
    max_tokens: u32,
    stop: Vec<String>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    /// May the scheduler draft tokens for it (speculative decoding, when configured).
    speculative: bool,
    stream: bool,
    include_usage: bool,
    /// Choices to generate (`n`): one engine request each, seeds `seed`, `seed + 1`, ...
    n: usize,
    /// Structured output: one compiled grammar per choice, or none.
    constraints: Vec<npu_structured::Constraint>,
    /// The LoRA adapter `model` names (None: the base model).
    lora: Option<npu_protocol::LoraRequest>,
}

/// Most choices one request may ask for (`n`): each is a sequence of its own in the engine.
const MAX_CHOICES: usize = 16;

fn common(
    ctx: &ApiContext,
    f: &Fields,
    id: RequestId,
    max_tokens_keys: &[&str],
) -> Result<Common, ApiError> {
    let s = &ctx.settings;
    // A name this server does not serve is 404, before anything else is looked at.
    let (model, lora) = ctx.resolve_model(f.string("model")?)?;
    let n = match f.i64("n")? {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                "n",
                format!("n must be between 1 and {MAX_CHOICES} (choices of one prompt), got {n}"),
            ))
        }
    };
    if let Some(b) = f.i64("best_of")? {
        if b != 1 {
            return Err(ApiError::invalid(
                "best_of",
                format!("best_of must be 1, got {b}"),
            ));
        }
    }
    let logit_bias = logit_bias(f, ctx.tokenizer.vocab_size())?;
    // A field the request leaves out takes the model's default (generation_config.json), then
    // the server's.
    let d = &s.sampling_defaults;
    let temperature = sampling::temperature(f, "temperature")?
        .or(d.temperature)
        .unwrap_or(1.0);
    let top_p = sampling::top_p(f, "top_p")?.or(d.top_p).unwrap_or(1.0);
    let top_k = sampling::top_k(f, "top_k", true)?.or(d.top_k).unwrap_or(0);
    let min_p = sampling::min_p(f, "min_p")?.or(d.min_p).unwrap_or(0.0);
    let presence_penalty = sampling::penalty(f, "presence_penalty")?.unwrap_or(0.0);
    let frequency_penalty = sampling::penalty(f, "frequency_penalty")?.unwrap_or(0.0);
    let repetition_penalty = sampling::repetition_penalty(f, "repetition_penalty")?
        .or(d.repetition_penalty)
        .unwrap_or(1.0);
    let key = max_tokens_keys
        .iter()
        .copied()
        .find(|k| f.get(k).is_some())
        .unwrap_or(max_tokens_keys[0]);
    let max_tokens = sampling::max_new_tokens(f, key, s)?;
    let stop = f.strings("stop")?;
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ApiError::invalid("stop", format!("stop[{i}] is empty")));
    }
    let stop_token_ids = f.token_ids("stop_token_ids")?;
    sampling::check_token_ids(
        &stop_token_ids,
        "stop_token_ids",
        ctx.tokenizer.vocab_size(),
    )?;
    let seed = f.u64("seed")?.unwrap_or_else(|| sampling::random_seed(id));
    let stream = f.bool("stream")?.unwrap_or(false);
    let opts = f.object("stream_options", "stream_options.")?;
    let include_usage = opts.bool("include_usage")?.unwrap_or(false);
    if include_usage && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed with stream: true",
        ));
    }
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    // Our extension: false keeps speculative decoding off for this request.
    let speculative = f.bool("speculative")?.unwrap_or(true);
    f.string("user")?;
    let constraints = match super::structured::openai_constraint(f)? {
        Some(asked) => super::structured::compile(ctx, &asked, n)?,
        None => Vec::new(),
    };
    Ok(Common {
        constraints,
        model,
        lora,
        params: SamplingParams {
            do_sample: temperature > 0.0,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            seed,
            top_n: 0,
            logit_bias,
        },
        max_tokens,
        stop,
        stop_token_ids,
        ignore_eos,
        speculative,
        stream,
        include_usage,
        n,
    })
}

/// OpenAI's `logit_bias`: an object from token ids (as strings) to biases in [-100, 100], added
/// to those tokens' logits before the pick; sorted by token id.
fn logit_bias(f: &Fields, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    const KEY: &str = "logit_bias";
    let m = match f.get(KEY) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(v) => return Err(f.wrong(KEY, "an object from token ids to biases", v)),
    };
    if m.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            KEY,
            format!(
                "logit_bias has {} entries (at most {MAX_LOGIT_BIAS})",
                m.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(m.len());
    for (k, v) in m {
        let token = k
            .parse::<u32>()
            .ok()
            .filter(|&t| (t as usize) < vocab)
            .ok_or_else(|| {
                ApiError::invalid(
                    KEY,
                    format!(
                        "logit_bias key {k:?} is not a token id of this model (0 to {})",
                        vocab - 1
                    ),
                )
            })?;
        let bias = v
            .as_f64()
            .filter(|b| b.is_finite() && b.abs() <= f64::from(MAX_LOGIT_BIAS_VALUE))
            .ok_or_else(|| {
                ApiError::invalid(
                    KEY,
                    format!("logit_bias[{k:?}] must be a number from -100 to 100, got {v}"),
                )
            })?;
        out.push((token, bias as f32));
    }
    out.sort_by_key(|&(t, _)| t);
    Ok(out)
}

/// `think`: Some(inside) to split the reply into reasoning and content, starting inside the
/// think block when the prompt opened it.
fn finish(
    ctx: &ApiContext,
    id: RequestId,
    c: Common,
    prompt_ids: Vec<u32>,
    kind: OpenAiKind,
    logprobs: Option<u32>,
    think: Option<bool>,
) -> Submission {
    let mut params = c.params;
    params.top_n = logprobs.unwrap_or(0);
    let request = |choice: usize| GenerateRequest {
        id,
        prompt_ids: prompt_ids.clone(),
        params: SamplingParams {
            seed: params.seed.wrapping_add(choice as u64),
            ..params.clone()
        },
        max_new_tokens: c.max_tokens,
        stop: c.stop.clone(),
        stop_token_ids: c.stop_token_ids.clone(),
        ignore_eos: c.ignore_eos,
        speculative: c.speculative,
    };
    let writer = |include_usage: bool| {
        OpenAiWriter::new(
            kind,
            id,
            c.model.clone(),
            ctx.tokenizer.clone(),
            c.stream,
            include_usage,
            logprobs,
        )
        .with_think_split(think)
    };
    if c.n == 1 {
        return Submission {
            request: request(0),
            more: Vec::new(),
            writer: Box::new(writer(c.include_usage)),
            constraints: c.constraints,
            lora: c.lora,
        };
    }
    // Several choices: one engine request and one writer each, merged into one response (the
    // writers of a stream always report their usage, which the merged stream sums).
    let writers = (0..c.n).map(|_| writer(c.stream)).collect();
    Submission {
        request: request(0),
        more: (1..c.n).map(request).collect(),
        writer: Box::new(ChoicesWriter::new(writers, c.stream, c.include_usage)),
        constraints: c.constraints,
        lora: c.lora,
    }
}

pub(super) fn completion_submission(
    ctx: &ApiContext,
    req: &Request,
    id: RequestId,
) -> Result<Submission, ApiError> {
    let body = parse_body(&req.body)?;
    let f = Fields::new(&body, "");
    let c = common(ctx, &f, id, &["max_tokens"])?;
    if f.bool("echo")?.unwrap_or(false) {
        return Err(ApiError::invalid("echo", "echo: only false is supported"));
    }
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let logprobs = f
        .int_in("logprobs", 0, npu_protocol::MAX_TOP_N as i64)?
        .map(|n| n as u32);
    let prompt_ids = match f.get("prompt") {
        None => return Err(ApiError::invalid("prompt", "prompt is missing")),
        Some(Value::String(s)) => encode(ctx, s, "prompt")?,
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            let ids = token_id_list("prompt", items)?;
            sampling::check_token_ids(&ids, "prompt", ctx.tokenizer.vocab_size())?;
            ids
        }
        Some(Value::Array(items)) if items.len() == 1 => match &items[0] {
            Value::String(s) => encode(ctx, s, "prompt")?,
            Value::Array(ids) => {
                let ids = token_id_list("prompt[0]", ids)?;
                sampling::check_token_ids(&ids, "prompt", ctx.tokenizer.vocab_size())?;
                ids
            }
            v => {
                return Err(f.wrong(
                    "prompt",
                    "a string, a list of token ids, or a list with one of them",
                    v,
                ))
            }
        },
        Some(Value::Array(items)) if items.len() > 1 => {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "prompt has {} prompts; only one prompt per request is supported",
                    items.len()
                ),
            ))
        }
        Some(v) => return Err(f.wrong("prompt", "a string or a list of token ids", v)),
    };
    sampling::check_prompt(&prompt_ids, "prompt", &ctx.settings)?;
    Ok(finish(
        ctx,
        id,
        c,
        prompt_ids,
        OpenAiKind::Completion,
        logprobs,
        None,
    ))
}

fn encode(ctx: &ApiContext, text: &str, field: &str) -> Result<Vec<u32>, ApiError> {
    ctx.tokenizer
        .encode(text)
        .map_err(|e| ApiError::invalid(field, format!("{field} cannot be tokenized: {e}")))
}

/// A message's content: a string, or a list of `{"type": "text", "text": ...}` parts.
/// A message's tool fields: an assistant turn's `tool_calls` (each a function with a name and
/// arguments), a tool turn's `tool_call_id` (required) and `name`.
fn tool_fields(
    i: usize,
    m: &serde_json::Map<String, Value>,
    msg: &mut ChatMessage,
) -> Result<(), ApiError> {
    if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
        let field = format!("messages[{i}].tool_calls");
        if msg.role != "assistant" {
            return Err(ApiError::invalid(
                &field,
                format!("{field}: only assistant messages carry tool calls"),
            ));
        }
        let Value::Array(list) = calls else {
            return Err(ApiError::invalid(&field, format!("{field} must be a list")));
        };
        let mut out = Vec::with_capacity(list.len());
        for (j, c) in list.iter().enumerate() {
            let cf = format!("{field}[{j}].function");
            let func = c
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    ApiError::invalid(
                        &cf,
                        format!("{cf} must be an object with name and arguments"),
                    )
                })?;
            let name = func.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(&format!("{cf}.name"), format!("{cf}.name must be a string"))
            })?;
            // Templates index arguments as an object; OpenAI sends a JSON string.
            let arguments = match func.get("arguments") {
                None | Some(Value::Null) => Value::Object(Default::default()),
                Some(Value::String(a)) => serde_json::from_str(a).map_err(|e| {
                    ApiError::invalid(
                        &format!("{cf}.arguments"),
                        format!("{cf}.arguments is not JSON: {e}"),
                    )
                })?,
                Some(a @ Value::Object(_)) => a.clone(),
                Some(_) => {
                    return Err(ApiError::invalid(
                        &format!("{cf}.arguments"),
                        format!("{cf}.arguments must be a JSON string"),
                    ))
                }
            };
            out.push(serde_json::json!({
                "id": c.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }));
        }
        msg.tool_calls = Some(Value::Array(out));
    }
    if msg.role == "tool" {
        let field = format!("messages[{i}].tool_call_id");
        match m.get("tool_call_id") {
            Some(Value::String(id)) => msg.tool_call_id = Some(id.clone()),
            _ => {
                return Err(ApiError::invalid(
                    &field,
                    format!("{field}: a tool message names the call it answers"),
                ))
            }
        }
        msg.name = m.get("name").and_then(Value::as_str).map(str::to_string);
    }
    Ok(())
}

fn message_content(i: usize, m: &serde_json::Map<String, Value>) -> Result<String, ApiError> {
    let field = format!("messages[{i}].content");
    match m.get("content") {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let pf = format!("{field}[{j}]");
                let Value::Object(p) = part else {
                    return Err(ApiError::invalid(&pf, format!("{pf} must be an object")));
                };
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    (Some("text"), _) => {
                        return Err(ApiError::invalid(
                            &pf,
                            format!("{pf}.text must be a string"),
                        ))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::invalid(
                            &pf,
                            format!(
                            "{pf}: content parts of type {other:?} are not supported (text only)"
                        ),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::invalid(&pf, format!("{pf}.type is missing")))
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::invalid(
            &field,
            format!("{field} must be a string or a list of text parts"),
        )),
    }
}

pub(super) fn chat_submission(
    ctx: &ApiContext,
    req: &Request,
    id: RequestId,
) -> Result<Submission, ApiError> {
    let body = parse_body(&req.body)?;
    let f = Fields::new(&body, "");
    let c = common(ctx, &f, id, &["max_completion_tokens", "max_tokens"])?;
    let logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top_logprobs = sampling::top_n(&f, "top_logprobs")?;
    if top_logprobs.is_some_and(|n| n > 0) && !logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    let parallel_calls = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let Rendered {
        text,
        prompt_ids,
        tools,
        tool_choice,
        tools_on,
    } = render_chat(ctx, &f)?;
    sampling::check_prompt(&prompt_ids, "messages", &ctx.settings)?;
    let lp = logprobs.then_some(top_logprobs.unwrap_or(0));
    let think = ctx.thinks.then(|| reasoning::prompt_opens_think(&text));
    let mut c = c;
    if let Some(spec) = tool_calls::grammar(&tools, &tool_choice, parallel_calls) {
        if !c.constraints.is_empty() {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice asks for a tool call and the request also constrains its output \
                 (response_format or structured_outputs): give one",
            ));
        }
        let asked = super::structured::Asked {
            spec,
            field: "tool_choice".into(),
        };
        c.constraints = super::structured::compile(ctx, &asked, c.n)?;
    }
    let mut sub = finish(ctx, id, c, prompt_ids, OpenAiKind::Chat, lp, think);
    if tools_on {
        let names: Vec<String> = tools.iter().map(|t| t.name.clone()).collect();
        sub.writer.enable_tool_calls(&names);
    }
    Ok(sub)
}

/// A chat request's prompt: its messages (and tools) rendered with the chat template and
/// tokenized, as the chat route and `/tokenize` read them.
pub(super) struct Rendered {
    pub text: String,
    pub prompt_ids: Vec<u32>,
    pub tools: Vec<tool_calls::Tool>,
    pub tool_choice: tool_calls::Choice,
    pub tools_on: bool,
}

/// Reads `messages`, `tools`, `tool_choice`, `add_generation_prompt` and
/// `chat_template_kwargs`, and renders the prompt.
pub(super) fn render_chat(ctx: &ApiContext, f: &Fields) -> Result<Rendered, ApiError> {
    let (tools, tool_choice) = tool_calls::parse(f.get("tools"), f.get("tool_choice"))?;
    let tools_on = !tools.is_empty() && tool_choice != tool_calls::Choice::None;
    let add_generation_prompt = f.bool("add_generation_prompt")?.unwrap_or(true);
    // Extra variables of the chat template (vLLM's field), e.g. {"enable_thinking": false}.
    let template_kwargs = match f.get("chat_template_kwargs") {
        None => serde_json::Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(v) => return Err(f.wrong("chat_template_kwargs", "an object", v)),
    };
    let messages = match f.get("messages") {
        None => return Err(ApiError::invalid("messages", "messages is missing")),
        Some(Value::Array(m)) if m.is_empty() => {
            return Err(ApiError::invalid("messages", "messages is empty"))
        }
        Some(Value::Array(m)) => m,
        Some(v) => return Err(f.wrong("messages", "a list of messages", v)),
    };
    let mut chat = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(m) = m else {
            let name = format!("messages[{i}]");
            return Err(ApiError::invalid(
                &name,
                format!("{name} must be an object with role and content"),
            ));
        };
        let role = match m.get("role") {
            Some(Value::String(r))
                if matches!(
                    r.as_str(),
                    "system" | "user" | "assistant" | "tool" | "developer"
                ) =>
            {
                if r == "developer" {
                    "system".to_string()
                } else {
                    r.clone()
                }
            }
            Some(Value::String(r)) => {
                let name = format!("messages[{i}].role");
                return Err(ApiError::invalid(
                    &name,
                    format!("{name} {r:?} is not one of system, user, assistant, tool"),
                ));
            }
            _ => {
                let name = format!("messages[{i}].role");
                return Err(ApiError::invalid(&name, format!("{name} must be a string")));
            }
        };
        let mut msg = ChatMessage::new(role, message_content(i, m)?);
        tool_fields(i, m, &mut msg)?;
        chat.push(msg);
    }
    let mut template_kwargs = template_kwargs;
    if tools_on {
        // The template in use (the model's, or one the server was given instead).
        let source = ctx.chat_template.as_ref().map_or("", |t| t.source());
        if source.contains("tools") {
            template_kwargs.insert(
                "tools".into(),
                Value::Array(tools.iter().map(|t| t.raw.clone()).collect()),
            );
        } else {
            // The template knows nothing of tools: describe them in the system message, and
            // write earlier calls and results as text in the same format.
            let desc = tool_calls::system_prompt(&tools);
            match chat.first_mut() {
                Some(first) if first.role == "system" => {
                    first.content = format!("{}\n\n{desc}", first.content)
                }
                _ => chat.insert(0, ChatMessage::system(desc)),
            }
        }
        if !source.contains("tool_calls") {
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
    }
    let template = ctx.chat_template.as_ref().map_err(|e| {
        ApiError::new(
            500,
            "server_error",
            format!("the model's chat template is unusable: {e}"),
        )
    })?;
    let text = template
        .render_with(&chat, add_generation_prompt, &template_kwargs)
        .map_err(|e| {
            ApiError::invalid(
                "messages",
                format!("messages cannot be rendered with the chat template: {e}"),
            )
        })?;
    // The template writes any BOS itself; special tokens in it are recognised.
    let prompt_ids = ctx
        .tokenizer
        .encode_with(&text, false, true)
        .map_err(|e| ApiError::invalid("messages", format!("messages cannot be tokenized: {e}")))?;
    Ok(Rendered {
        text,
        prompt_ids,
        tools,
        tool_choice,
        tools_on,
    })
}

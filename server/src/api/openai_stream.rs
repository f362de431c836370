//! OpenAI responses: whole `text_completion` / `chat.completion` objects, or SSE streams of
//! chunks (`data: {...}\n\n`, an optional usage chunk, then `data: [DONE]\n\n`), with log
//! probabilities in each API's shape, usage counts and finish reasons. Chat replies of models
//! that think (`<think>...</think>`) carry the thinking as `reasoning_content` (in the message,
//! or in the deltas while the model thinks) and the rest as `content`.

use std::time::{SystemTime, UNIX_EPOCH};

use npu_protocol::TokenLogprob;
use npu_tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

use super::error::{render_error, ErrorShape};
use super::pyjson::{escape_line_breaks, f32_json};
use super::reasoning::{Split, ThinkSplitter};
use super::sampling::token_text;
use super::tool_calls::{Call, CallSplitter};
use crate::engine::{FinishReason, GenEvent, RequestId, Usage};
use crate::http::{EventWriter, Progress, Response};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpenAiKind {
    Completion,
    Chat,
}

pub(crate) struct OpenAiWriter {
    kind: OpenAiKind,
    id: String,
    created: u64,
    model: String,
    tokenizer: Tokenizer,
    stream: bool,
    include_usage: bool,
    /// Some(n): report log-probabilities with n alternatives per token.
    logprobs: Option<u32>,
    text: String,
    /// Non-streaming: the log-probability entries collected so far.
    lp_entries: Vec<Value>,
    /// Completions' `text_offset` of the next token.
    offset: usize,
    /// Chat replies of a thinking model: the splitter into reasoning and content, and (not
    /// streaming) the parts so far.
    think: Option<ThinkSplitter>,
    parts: Split,
    /// Chat replies with tools: the splitter of tool calls out of the content, and (not
    /// streaming) the calls so far.
    calls: Option<CallSplitter>,
    found: Vec<Call>,
}

impl OpenAiWriter {
    pub(crate) fn new(
        kind: OpenAiKind,
        id: RequestId,
        model: String,
        tokenizer: Tokenizer,
        stream: bool,
        include_usage: bool,
        logprobs: Option<u32>,
    ) -> Self {
        let prefix = match kind {
            OpenAiKind::Completion => "cmpl",
            OpenAiKind::Chat => "chatcmpl",
        };
        Self {
            kind,
            id: format!("{prefix}-{id}"),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model,
            tokenizer,
            stream,
            include_usage,
            logprobs,
            text: String::new(),
            lp_entries: Vec::new(),
            offset: 0,
            think: None,
            parts: Split::default(),
            calls: None,
            found: Vec::new(),
        }
    }

    /// The content part of a piece of the reply, less its tool calls (returned apart).
    fn route(&mut self, content: String) -> (String, Vec<Call>) {
        match &mut self.calls {
            None => (content, Vec::new()),
            Some(s) => {
                let p = s.push(&content);
                (p.content, p.calls)
            }
        }
    }

    /// A streamed chunk announcing tool calls (numbered from `first`).
    fn calls_chunk(&self, calls: &[Call], first: usize) -> Value {
        let list: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(k, c)| c.to_json(first + k, &self.id, true))
            .collect();
        let choice = json!({"index": 0, "delta": {"tool_calls": list}, "logprobs": null,
                            "finish_reason": null});
        Value::Object(self.envelope(Value::Array(vec![choice])))
    }

    /// Emits (streaming) or keeps (not) the content and calls of a piece of the reply.
    fn put_content(
        &mut self,
        reasoning: String,
        content: String,
        lp: Option<Value>,
        body: &mut Vec<u8>,
    ) {
        let (content, calls) = self.route(content);
        self.emit(reasoning, content, calls, lp, body);
    }

    /// Emits (streaming) or keeps (not) content and calls already split.
    fn emit(
        &mut self,
        reasoning: String,
        content: String,
        calls: Vec<Call>,
        lp: Option<Value>,
        body: &mut Vec<u8>,
    ) {
        if !self.stream {
            self.parts.reasoning.push_str(&reasoning);
            self.parts.content.push_str(&content);
            self.found.extend(calls);
            return;
        }
        let part = Split { reasoning, content };
        if !part.is_empty() || lp.is_some() {
            let lp = lp.unwrap_or(Value::Null);
            Self::sse(body, &self.think_chunk(&part, lp));
        }
        if !calls.is_empty() {
            let first = self.calls.as_ref().map_or(0, |s| s.calls) - calls.len();
            Self::sse(body, &self.calls_chunk(&calls, first));
        }
    }

    /// Some(inside): a chat reply is split into `reasoning_content` and `content` at its think
    /// block (starting inside it when the prompt opened it).
    /// Splits tool calls out of a chat reply's content.
    pub(crate) fn enable_tool_calls(&mut self, tool_names: &[String]) {
        if self.kind == OpenAiKind::Chat {
            self.calls = Some(CallSplitter::with_bare_json(tool_names.to_vec()));
        }
    }

    pub(crate) fn with_think_split(mut self, think: Option<bool>) -> Self {
        if self.kind == OpenAiKind::Chat {
            self.think = think.map(ThinkSplitter::new);
        }
        self
    }

    /// A streamed chat chunk with the parts of a piece of the reply.
    fn think_chunk(&self, part: &Split, logprobs: Value) -> Value {
        let mut delta = Map::new();
        if !part.reasoning.is_empty() {
            delta.insert("reasoning_content".into(), part.reasoning.clone().into());
        }
        if !part.content.is_empty() {
            delta.insert("content".into(), part.content.clone().into());
        }
        let choice =
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": null});
        Value::Object(self.envelope(Value::Array(vec![choice])))
    }

    fn object(&self) -> &'static str {
        match (self.kind, self.stream) {
            (OpenAiKind::Completion, _) => "text_completion",
            (OpenAiKind::Chat, false) => "chat.completion",
            (OpenAiKind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, choices: Value) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), self.id.clone().into());
        m.insert("object".into(), self.object().into());
        m.insert("created".into(), self.created.into());
        m.insert("model".into(), self.model.clone().into());
        m.insert("choices".into(), choices);
        m
    }

    /// One token's log-probability entry in this API's shape.
    fn lp_entry(&self, token: &TokenLogprob, top: &[TokenLogprob], text: &str) -> Value {
        match self.kind {
            OpenAiKind::Chat => {
                let item = |t: &TokenLogprob| {
                    let bytes: Vec<u8> = self
                        .tokenizer
                        .token_bytes(t.token)
                        .map(<[u8]>::to_vec)
                        .unwrap_or_default();
                    json!({
                        "token": token_text(&self.tokenizer, t.token),
                        "logprob": f32_json(t.logprob),
                        "bytes": bytes,
                    })
                };
                let mut e = item(token);
                e["top_logprobs"] = Value::Array(top.iter().map(item).collect());
                e
            }
            OpenAiKind::Completion => {
                let mut alts = Map::new();
                for t in top {
                    alts.insert(
                        token_text(&self.tokenizer, t.token),
                        f32_json(t.logprob).into(),
                    );
                }
                json!({
                    "token": token_text(&self.tokenizer, token.token),
                    "logprob": f32_json(token.logprob),
                    "top": alts,
                    "offset": self.offset,
                    "text": text,
                })
            }
        }
    }

    /// The `logprobs` value of a choice from entries.
    fn lp_value(&self, entries: &[Value]) -> Value {
        if self.logprobs.is_none() {
            return Value::Null;
        }
        match self.kind {
            OpenAiKind::Chat => json!({ "content": entries }),
            OpenAiKind::Completion => json!({
                "tokens": entries.iter().map(|e| e["token"].clone()).collect::<Vec<_>>(),
                "token_logprobs": entries.iter().map(|e| e["logprob"].clone()).collect::<Vec<_>>(),
                "top_logprobs": entries.iter().map(|e| e["top"].clone()).collect::<Vec<_>>(),
                "text_offset": entries.iter().map(|e| e["offset"].clone()).collect::<Vec<_>>(),
            }),
        }
    }

    fn usage(u: &Usage) -> Value {
        json!({
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        })
    }

    fn choice(&self, text: &str, logprobs: Value, finish: Option<&str>, first: bool) -> Value {
        match (self.kind, self.stream) {
            (OpenAiKind::Completion, _) => json!({
                "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
            (OpenAiKind::Chat, false) => {
                let mut message = match &self.think {
                    None if self.calls.is_none() => json!({"role": "assistant", "content": text}),
                    None => json!({"role": "assistant", "content": self.parts.content}),
                    Some(t) => json!({
                        "role": "assistant",
                        "content": self.parts.content,
                        "reasoning_content": t.thought().then_some(&self.parts.reasoning),
                    }),
                };
                if !self.found.is_empty() {
                    let calls: Vec<Value> = self
                        .found
                        .iter()
                        .enumerate()
                        .map(|(k, c)| c.to_json(k, &self.id, false))
                        .collect();
                    message["tool_calls"] = Value::Array(calls);
                    if self.parts.content.trim().is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                })
            }
            (OpenAiKind::Chat, true) => {
                let mut delta = Map::new();
                if first {
                    delta.insert("role".into(), "assistant".into());
                }
                if first || !text.is_empty() {
                    delta.insert("content".into(), text.into());
                }
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        }
    }

    fn sse(out: &mut Vec<u8>, v: &Value) {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(escape_line_breaks(v.to_string()).as_bytes());
        out.extend_from_slice(b"\n\n");
    }
}

impl EventWriter for OpenAiWriter {
    fn enable_tool_calls(&mut self, tool_names: &[String]) {
        OpenAiWriter::enable_tool_calls(self, tool_names);
    }
    fn stream_start(&mut self) -> Option<Response> {
        if !self.stream {
            return None;
        }
        let mut body = Vec::new();
        if self.kind == OpenAiKind::Chat {
            let first = self.envelope(Value::Array(vec![self.choice("", Value::Null, None, true)]));
            Self::sse(&mut body, &Value::Object(first));
        }
        Some(
            Response::new(200, "text/event-stream; charset=utf-8", body)
                .with_header("Cache-Control", "no-cache")
                .with_header("X-Accel-Buffering", "no"),
        )
    }

    fn on_event(&mut self, event: &GenEvent, body: &mut Vec<u8>) -> Progress {
        match event {
            GenEvent::Token { token, top, text } => {
                let entry = self.logprobs.map(|_| self.lp_entry(token, top, text));
                self.offset += text.len();
                self.text.push_str(text);
                if self.think.is_some() || self.calls.is_some() {
                    let part = match &mut self.think {
                        Some(think) => think.push(text),
                        None => Split {
                            reasoning: String::new(),
                            content: text.clone(),
                        },
                    };
                    if !self.stream {
                        self.lp_entries.extend(entry);
                        self.put_content(part.reasoning, part.content, None, body);
                        return Progress::More;
                    }
                    let lp = entry.map(|e| self.lp_value(std::slice::from_ref(&e)));
                    self.put_content(part.reasoning, part.content, lp, body);
                    return Progress::More;
                }
                if !self.stream {
                    self.lp_entries.extend(entry);
                    return Progress::More;
                }
                if text.is_empty() && entry.is_none() {
                    return Progress::More; // nothing a client could see
                }
                let lp = self.lp_value(entry.as_slice());
                let chunk = self.envelope(Value::Array(vec![self.choice(text, lp, None, false)]));
                Self::sse(body, &Value::Object(chunk));
                Progress::More
            }
            GenEvent::Finished {
                reason,
                usage,
                message,
            } => {
                let failed = match reason {
                    FinishReason::Error => Some((500, "server_error", "generation failed")),
                    FinishReason::Rejected => {
                        Some((400, "invalid_request_error", "the request cannot be served"))
                    }
                    _ => None,
                };
                if let Some((status, kind, fallback)) = failed {
                    let msg = message.as_deref().unwrap_or(fallback);
                    let resp = render_error(ErrorShape::OpenAi, status, kind, msg, None);
                    if !self.stream {
                        return Progress::Complete(resp);
                    }
                    body.extend_from_slice(b"data: ");
                    body.extend_from_slice(&resp.body);
                    body.extend_from_slice(b"\n\ndata: [DONE]\n\n");
                    return Progress::StreamDone;
                }
                // What the splitters held back (an unfinished tag, newlines) belongs to the end.
                if let Some(rest) = self.think.as_mut().map(ThinkSplitter::finish) {
                    self.put_content(rest.reasoning, rest.content, None, body);
                }
                // Not routed again: an unfinished call (cut by max_tokens) is content.
                if let Some(rest) = self.calls.as_mut().map(CallSplitter::finish) {
                    self.emit(String::new(), rest.content, rest.calls, None, body);
                }
                let called = self.calls.as_ref().is_some_and(|s| s.calls > 0);
                let finish = Some(match reason.openai() {
                    "stop" if called => "tool_calls",
                    r => r,
                });
                if !self.stream {
                    let lp = self.lp_value(&self.lp_entries);
                    let mut whole = self.envelope(Value::Array(vec![
                        self.choice(&self.text, lp, finish, false)
                    ]));
                    whole.insert("usage".into(), Self::usage(usage));
                    let json = escape_line_breaks(Value::Object(whole).to_string());
                    return Progress::Complete(Response::new(
                        200,
                        "application/json",
                        json.into_bytes(),
                    ));
                }
                let last = self.envelope(Value::Array(vec![self.choice(
                    "",
                    Value::Null,
                    finish,
                    false,
                )]));
                Self::sse(body, &Value::Object(last));
                if self.include_usage {
                    let mut u = self.envelope(Value::Array(Vec::new()));
                    u.insert("usage".into(), Self::usage(usage));
                    Self::sse(body, &Value::Object(u));
                }
                body.extend_from_slice(b"data: [DONE]\n\n");
                Progress::StreamDone
            }
        }
    }
}

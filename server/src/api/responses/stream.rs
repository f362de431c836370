//! The Responses API's writer: a reply's text split into output items (a `reasoning` item from
//! the `<think>` block, `message` items of `output_text`, `function_call` items from the tool
//! calls the chat route's splitter finds), returned as one `response` object or streamed as
//! the typed SSE events openai-python reads (`event:` and `data:` lines, each with its
//! `sequence_number`): `response.created`, `response.in_progress`, per item
//! `response.output_item.added`, its content part, text / reasoning / argument deltas and their
//! `.done`, `response.output_item.done`, and `response.completed` (or `response.incomplete`,
//! `response.failed`) with the whole response. A finished response is stored when asked.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use super::super::error::{render_error, ErrorShape};
use super::super::pyjson::escape_line_breaks;
use super::super::reasoning::{Split, ThinkSplitter};
use super::super::tool_calls::{Call, CallSplitter};
use super::store::{Entry, Store};
use crate::engine::{FinishReason, GenEvent, Usage};
use crate::http::{EventWriter, Progress, Response};

/// Where a finished response goes: the store, with the conversation it continues.
pub(crate) struct Keep {
    pub store: Arc<Store>,
    /// The earlier responses' items (previous_response_id), then this request's input.
    pub history: Vec<Value>,
    pub input: Vec<Value>,
}

/// The item being written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Reasoning,
    Message,
}

pub(crate) struct ResponsesWriter {
    stream: bool,
    /// The response object so far (status, output and usage filled in at the end).
    resp: Map<String, Value>,
    /// The suffix of the response id, for item ids.
    tag: String,
    seq: u64,
    think: Option<ThinkSplitter>,
    calls: Option<CallSplitter>,
    /// Finished items.
    output: Vec<Value>,
    open: Option<(Open, String)>,
    /// The open item's text.
    text: String,
    /// Whitespace of the reply not yet in an item (dropped when no text follows).
    pending: String,
    items_made: usize,
    reasoning_tokens: u32,
    keep: Option<Keep>,
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl ResponsesWriter {
    /// `resp`: the response object's fields known at the start (id, model, echoes).
    pub(crate) fn new(
        mut resp: Map<String, Value>,
        stream: bool,
        think: Option<bool>,
        tool_names: Option<&[String]>,
        keep: Option<Keep>,
    ) -> Self {
        let id = resp.get("id").and_then(Value::as_str).unwrap_or("resp_0");
        let tag = id.trim_start_matches("resp_").to_string();
        resp.insert("object".into(), "response".into());
        resp.insert("created_at".into(), now_s().into());
        resp.insert("status".into(), "in_progress".into());
        resp.insert("error".into(), Value::Null);
        resp.insert("incomplete_details".into(), Value::Null);
        resp.insert("output".into(), Value::Array(Vec::new()));
        resp.insert("usage".into(), Value::Null);
        Self {
            stream,
            resp,
            tag,
            seq: 0,
            think: think.map(ThinkSplitter::new),
            calls: tool_names.map(|n| CallSplitter::with_bare_json(n.to_vec())),
            output: Vec::new(),
            open: None,
            text: String::new(),
            pending: String::new(),
            items_made: 0,
            reasoning_tokens: 0,
            keep,
        }
    }

    fn emit(&mut self, body: &mut Vec<u8>, ty: &str, mut data: Map<String, Value>) {
        if !self.stream {
            return;
        }
        data.insert("type".into(), ty.into());
        data.insert("sequence_number".into(), self.seq.into());
        self.seq += 1;
        body.extend_from_slice(format!("event: {ty}\ndata: ").as_bytes());
        body.extend_from_slice(escape_line_breaks(Value::Object(data).to_string()).as_bytes());
        body.extend_from_slice(b"\n\n");
    }

    fn event(&mut self, body: &mut Vec<u8>, ty: &str, v: Value) {
        if let Value::Object(m) = v {
            self.emit(body, ty, m);
        }
    }

    fn new_id(&mut self, prefix: &str) -> String {
        self.items_made += 1;
        format!("{prefix}_{}{:02}", self.tag, self.items_made)
    }

    /// The open item as its `done` form (text complete; status as given).
    fn item_json(&self, kind: Open, id: &str, text: &str, status: &str) -> Value {
        match kind {
            Open::Message => json!({
                "id": id, "type": "message", "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": []}],
            }),
            Open::Reasoning => json!({
                "id": id, "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}],
            }),
        }
    }

    fn part(kind: Open, text: &str) -> Value {
        match kind {
            Open::Message => json!({"type": "output_text", "text": text, "annotations": [],
                                    "logprobs": []}),
            Open::Reasoning => json!({"type": "reasoning_text", "text": text}),
        }
    }

    fn open_item(&mut self, kind: Open, body: &mut Vec<u8>) {
        if self.open.as_ref().is_some_and(|(k, _)| *k == kind) {
            return;
        }
        self.close(body, "completed");
        let id = match kind {
            Open::Message => self.new_id("msg"),
            Open::Reasoning => self.new_id("rs"),
        };
        let index = self.output.len();
        let mut item = self.item_json(kind, &id, "", "in_progress");
        item["content"] = Value::Array(Vec::new());
        self.event(
            body,
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        self.event(
            body,
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                   "part": Self::part(kind, "")}),
        );
        self.open = Some((kind, id));
        self.text.clear();
    }

    fn delta(&mut self, kind: Open, text: &str, body: &mut Vec<u8>) {
        self.open_item(kind, body);
        self.text.push_str(text);
        let id = self
            .open
            .as_ref()
            .map(|(_, id)| id.clone())
            .unwrap_or_default();
        let (index, ty) = (
            self.output.len(),
            match kind {
                Open::Message => "response.output_text.delta",
                Open::Reasoning => "response.reasoning_text.delta",
            },
        );
        let mut data = json!({"item_id": id, "output_index": index, "content_index": 0,
                              "delta": text});
        if kind == Open::Message {
            data["logprobs"] = Value::Array(Vec::new());
        }
        self.event(body, ty, data);
    }

    /// Ends the open item, if any.
    fn close(&mut self, body: &mut Vec<u8>, status: &str) {
        let Some((kind, id)) = self.open.take() else {
            return;
        };
        let text = std::mem::take(&mut self.text);
        let index = self.output.len();
        let done = match kind {
            Open::Message => "response.output_text.done",
            Open::Reasoning => "response.reasoning_text.done",
        };
        let mut data = json!({"item_id": id, "output_index": index, "content_index": 0,
                              "text": text});
        if kind == Open::Message {
            data["logprobs"] = Value::Array(Vec::new());
        }
        self.event(body, done, data);
        self.event(
            body,
            "response.content_part.done",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                   "part": Self::part(kind, &text)}),
        );
        let item = self.item_json(kind, &id, &text, status);
        self.event(
            body,
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        self.output.push(item);
    }

    fn call(&mut self, c: Call, body: &mut Vec<u8>) {
        self.close(body, "completed");
        let id = self.new_id("fc");
        let call_id = format!("call_{}{:02}", self.tag, self.items_made);
        let index = self.output.len();
        let item = |args: &str, status: &str| {
            json!({"id": id, "type": "function_call", "call_id": call_id, "name": c.name,
                   "arguments": args, "status": status})
        };
        self.event(
            body,
            "response.output_item.added",
            json!({"output_index": index, "item": item("", "in_progress")}),
        );
        self.event(
            body,
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": index, "delta": c.arguments}),
        );
        self.event(
            body,
            "response.function_call_arguments.done",
            json!({"item_id": id, "output_index": index, "name": c.name,
                   "arguments": c.arguments}),
        );
        let done = item(&c.arguments, "completed");
        self.event(
            body,
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        );
        self.output.push(done);
    }

    /// A piece of the reply: its reasoning, its content less tool calls, the calls.
    fn put(&mut self, part: Split, body: &mut Vec<u8>) {
        if !part.reasoning.is_empty() {
            self.delta(Open::Reasoning, &part.reasoning, body);
        }
        let (content, calls) = match &mut self.calls {
            None => (part.content, Vec::new()),
            Some(s) => {
                let p = s.push(&part.content);
                (p.content, p.calls)
            }
        };
        self.put_content(content, calls, body);
    }

    fn put_content(&mut self, content: String, calls: Vec<Call>, body: &mut Vec<u8>) {
        if !content.is_empty() {
            let in_message = self.open.as_ref().is_some_and(|(k, _)| *k == Open::Message);
            if !in_message && content.trim().is_empty() {
                self.pending.push_str(&content);
            } else {
                let text = std::mem::take(&mut self.pending) + &content;
                let text = if in_message {
                    text
                } else {
                    text.trim_start().to_string()
                };
                self.delta(Open::Message, &text, body);
            }
        }
        for c in calls {
            self.pending.clear();
            self.call(c, body);
        }
    }

    fn usage(&self, u: &Usage) -> Value {
        json!({
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        })
    }

    fn snapshot(&self) -> Value {
        Value::Object(self.resp.clone())
    }

    fn finish(&mut self, reason: FinishReason, usage: &Usage, body: &mut Vec<u8>) -> Value {
        if let Some(rest) = self.think.as_mut().map(ThinkSplitter::finish) {
            self.put(rest, body);
        }
        if let Some(rest) = self.calls.as_mut().map(CallSplitter::finish) {
            self.put_content(rest.content, rest.calls, body);
        }
        let cut = reason.openai() == "length";
        if self.output.is_empty() && self.open.is_none() {
            // An empty reply is still one message.
            self.open_item(Open::Message, body);
        }
        self.close(body, if cut { "incomplete" } else { "completed" });
        let (status, details) = match reason {
            _ if cut => ("incomplete", json!({"reason": "max_output_tokens"})),
            FinishReason::Aborted | FinishReason::Shutdown => ("cancelled", Value::Null),
            _ => ("completed", Value::Null),
        };
        self.resp.insert("status".into(), status.into());
        self.resp.insert("incomplete_details".into(), details);
        self.resp
            .insert("output".into(), Value::Array(self.output.clone()));
        self.resp.insert("usage".into(), self.usage(usage));
        if status == "completed" {
            self.resp.insert("completed_at".into(), now_s().into());
        }
        let whole = self.snapshot();
        if let Some(k) = self.keep.take().filter(|_| status != "cancelled") {
            let id = self.resp["id"].as_str().unwrap_or_default().to_string();
            let mut history = k.history;
            history.extend(self.output.iter().cloned());
            k.store.insert(
                id,
                Entry {
                    response: whole.clone(),
                    input: k.input,
                    history,
                },
            );
        }
        let ty = if status == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.event(body, ty, json!({"response": whole}));
        whole
    }
}

impl EventWriter for ResponsesWriter {
    fn stream_start(&mut self) -> Option<Response> {
        if !self.stream {
            return None;
        }
        let mut body = Vec::new();
        let snap = self.snapshot();
        self.event(&mut body, "response.created", json!({"response": snap}));
        self.event(&mut body, "response.in_progress", json!({"response": snap}));
        Some(
            Response::new(200, "text/event-stream; charset=utf-8", body)
                .with_header("Cache-Control", "no-cache")
                .with_header("X-Accel-Buffering", "no"),
        )
    }

    fn on_event(&mut self, event: &GenEvent, body: &mut Vec<u8>) -> Progress {
        match event {
            GenEvent::Token { text, .. } => {
                let part = match &mut self.think {
                    Some(t) => t.push(text),
                    None => Split {
                        reasoning: String::new(),
                        content: text.clone(),
                    },
                };
                if !part.reasoning.is_empty() {
                    self.reasoning_tokens += 1;
                }
                self.put(part, body);
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
                    if !self.stream {
                        return Progress::Complete(render_error(
                            ErrorShape::OpenAi,
                            status,
                            kind,
                            msg,
                            None,
                        ));
                    }
                    self.resp.insert("status".into(), "failed".into());
                    self.resp.insert(
                        "error".into(),
                        json!({"code": "server_error", "message": msg}),
                    );
                    self.resp
                        .insert("output".into(), Value::Array(self.output.clone()));
                    let snap = self.snapshot();
                    self.event(body, "response.failed", json!({"response": snap}));
                    return Progress::StreamDone;
                }
                let whole = self.finish(*reason, usage, body);
                if self.stream {
                    return Progress::StreamDone;
                }
                let json = escape_line_breaks(whole.to_string());
                Progress::Complete(Response::new(200, "application/json", json.into_bytes()))
            }
        }
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;

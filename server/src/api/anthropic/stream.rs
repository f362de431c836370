//! Anthropic Messages responses: the reply split into content blocks (`thinking` from a
//! reasoning model's `<think>` block when the request enabled thinking, `text`, and `tool_use`
//! from the calls the chat route's splitter finds), written either as one `message` object or
//! as the SSE event sequence Anthropic's SDKs assemble (`message_start`, `ping`, per block
//! `content_block_start` / `content_block_delta` / `content_block_stop`, `message_delta` with
//! the stop reason and usage, `message_stop`; an `error` event when generation fails). Both
//! shapes come from one list of events: a whole response is the events folded into blocks,
//! as a client does.

use npu_tokenizer::Tokenizer;
use serde_json::{json, Value};

use super::super::reasoning::{Split, ThinkSplitter};
use super::super::tool_calls::{Call, CallSplitter};
use super::error_body;
use crate::engine::{FinishReason, GenEvent, RequestId};
use crate::http::{EventWriter, Progress, Response};

/// One SSE event: its name and data.
pub(crate) type Event = (&'static str, Value);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
}

/// Turns the parts of a reply into content block events, numbering the blocks.
#[derive(Debug, Default)]
pub(crate) struct Blocks {
    open: Option<Open>,
    /// Blocks started so far (the next block's index).
    count: usize,
    /// Whitespace before the first block is held (a reply that is only a tool call after a
    /// newline gets no empty text block).
    held_ws: String,
    tool_uses: usize,
    /// The message id's tail, for tool_use ids.
    id: String,
}

impl Blocks {
    pub(crate) fn new(id: &str) -> Self {
        Self {
            id: id.to_string(),
            ..Self::default()
        }
    }

    fn close(&mut self, out: &mut Vec<Event>) {
        let Some(open) = self.open.take() else {
            return;
        };
        let index = self.count - 1;
        if open == Open::Thinking {
            // Thinking blocks end with a signature (opaque; this server checks none).
            out.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "signature_delta", "signature": self.signature()}}),
            ));
        }
        out.push((
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
    }

    fn signature(&self) -> String {
        format!("npu-serving-{}", self.id)
    }

    fn start(&mut self, open: Option<Open>, block: Value, out: &mut Vec<Event>) -> usize {
        self.close(out);
        let index = self.count;
        self.count += 1;
        self.open = open;
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    pub(crate) fn thinking(&mut self, text: &str, out: &mut Vec<Event>) {
        if text.is_empty() {
            return;
        }
        if self.open != Some(Open::Thinking) {
            let block = json!({"type": "thinking", "thinking": "", "signature": ""});
            self.start(Some(Open::Thinking), block, out);
        }
        out.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.count - 1,
                   "delta": {"type": "thinking_delta", "thinking": text}}),
        ));
    }

    pub(crate) fn text(&mut self, text: &str, out: &mut Vec<Event>) {
        if text.is_empty() {
            return;
        }
        let text = if self.open == Some(Open::Text) {
            text.to_string()
        } else if text.trim().is_empty() {
            self.held_ws.push_str(text);
            return;
        } else {
            let text = std::mem::take(&mut self.held_ws) + text;
            self.start(Some(Open::Text), json!({"type": "text", "text": ""}), out);
            text
        };
        out.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.count - 1,
                   "delta": {"type": "text_delta", "text": text}}),
        ));
    }

    /// A tool call: a `tool_use` block whose input arrives as one `input_json_delta`. Arguments
    /// that are not a JSON object stay text.
    pub(crate) fn tool_use(&mut self, call: &Call, out: &mut Vec<Event>) {
        let input = match serde_json::from_str::<Value>(&call.arguments) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                let text = format!(
                    "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
                    Value::from(call.name.as_str()),
                    call.arguments
                );
                return self.text(&text, out);
            }
        };
        self.held_ws.clear();
        let id = format!("toolu_{}_{}", self.id, self.tool_uses);
        self.tool_uses += 1;
        let block = json!({"type": "tool_use", "id": id, "name": call.name, "input": {}});
        let index = self.start(None, block, out);
        out.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
        ));
        self.close_index(index, out);
    }

    fn close_index(&mut self, index: usize, out: &mut Vec<Event>) {
        out.push((
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
    }

    /// The reply is over: closes the open block; a reply with no block gets an empty text one.
    pub(crate) fn finish(&mut self, out: &mut Vec<Event>) {
        if self.count == 0 {
            let held = std::mem::take(&mut self.held_ws);
            self.start(Some(Open::Text), json!({"type": "text", "text": ""}), out);
            if !held.is_empty() {
                out.push((
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": held}}),
                ));
            }
        }
        self.close(out);
    }

    pub(crate) fn tool_uses(&self) -> usize {
        self.tool_uses
    }
}

/// Folds content block events into the message's `content` (what a client assembles).
pub(crate) fn fold(content: &mut Vec<Value>, partial: &mut Vec<String>, event: &Event) {
    let (name, data) = event;
    let index = data["index"].as_u64().unwrap_or(0) as usize;
    match *name {
        "content_block_start" => {
            content.push(data["content_block"].clone());
            partial.push(String::new());
        }
        "content_block_delta" => {
            let (Some(block), Some(buf)) = (content.get_mut(index), partial.get_mut(index)) else {
                return;
            };
            let d = &data["delta"];
            let s = |k: &str| d[k].as_str().unwrap_or_default().to_string();
            match d["type"].as_str() {
                Some("text_delta") => append(block, "text", &s("text")),
                Some("thinking_delta") => append(block, "thinking", &s("thinking")),
                Some("signature_delta") => block["signature"] = s("signature").into(),
                Some("input_json_delta") => buf.push_str(&s("partial_json")),
                _ => {}
            }
        }
        "content_block_stop" => {
            if let (Some(block), Some(buf)) = (content.get_mut(index), partial.get(index)) {
                if !buf.is_empty() {
                    block["input"] = serde_json::from_str(buf).unwrap_or_else(|_| json!({}));
                }
            }
        }
        _ => {}
    }
}

fn append(block: &mut Value, key: &str, text: &str) {
    let mut s = block[key].as_str().unwrap_or_default().to_string();
    s.push_str(text);
    block[key] = s.into();
}

/// Anthropic's usage object.
pub(crate) fn usage(input: u32, output: u32) -> Value {
    json!({
        "input_tokens": input,
        "output_tokens": output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    })
}

pub(crate) struct AnthropicWriter {
    id: String,
    model: String,
    tokenizer: Tokenizer,
    stream: bool,
    input_tokens: u32,
    /// A reasoning model's reply: the splitter at `<think>`, and whether thinking blocks are
    /// wanted (else the thinking is dropped).
    think: Option<ThinkSplitter>,
    keep_thinking: bool,
    calls: Option<CallSplitter>,
    blocks: Blocks,
    /// Not streaming: the content so far, and each block's input JSON.
    content: Vec<Value>,
    partial: Vec<String>,
    /// The request's stop sequences, and (when there are some) the generated token ids, to
    /// tell which one ended the reply.
    stop: Vec<String>,
    ids: Vec<u32>,
}

impl AnthropicWriter {
    pub(crate) fn new(
        id: RequestId,
        model: String,
        tokenizer: Tokenizer,
        stream: bool,
        input_tokens: u32,
        stop: Vec<String>,
    ) -> Self {
        let id = format!("{id:016x}");
        Self {
            blocks: Blocks::new(&id),
            id,
            model,
            tokenizer,
            stream,
            input_tokens,
            think: None,
            keep_thinking: false,
            calls: None,
            content: Vec::new(),
            partial: Vec::new(),
            stop,
            ids: Vec::new(),
        }
    }

    /// Some(inside): the reply is split at its think block (starting inside it when the prompt
    /// opened it); `keep`: the thinking becomes thinking blocks.
    pub(crate) fn with_thinking(mut self, think: Option<bool>, keep: bool) -> Self {
        self.think = think.map(ThinkSplitter::new);
        self.keep_thinking = keep;
        self
    }

    /// The offered tools: calls in the reply become tool_use blocks.
    pub(crate) fn with_tools(mut self, names: Vec<String>) -> Self {
        self.calls = Some(CallSplitter::with_bare_json(names));
        self
    }

    fn message(&self, content: Value, stop_reason: Value, stop_seq: Value, out: u32) -> Value {
        json!({
            "id": format!("msg_{}", self.id),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_seq,
            "usage": usage(self.input_tokens, out),
        })
    }

    fn put(&mut self, part: Split, out: &mut Vec<Event>) {
        if self.keep_thinking {
            self.blocks.thinking(&part.reasoning, out);
        }
        let (content, calls) = match &mut self.calls {
            None => (part.content, Vec::new()),
            Some(s) => {
                let p = s.push(&part.content);
                (p.content, p.calls)
            }
        };
        self.put_content(&content, &calls, out);
    }

    fn put_content(&mut self, content: &str, calls: &[Call], out: &mut Vec<Event>) {
        self.blocks.text(content, out);
        for c in calls {
            self.blocks.tool_use(c, out);
        }
    }

    /// Writes (streaming) or folds (not) events.
    fn emit(&mut self, events: Vec<Event>, body: &mut Vec<u8>) {
        for e in events {
            if self.stream {
                sse(body, &e);
            } else {
                fold(&mut self.content, &mut self.partial, &e);
            }
        }
    }

    /// Which stop sequence ended the reply: the one found first in the generated text.
    fn matched_stop(&self) -> Option<String> {
        if self.stop.is_empty() {
            return None;
        }
        let text = self.tokenizer.decode_continuation(&self.ids, false);
        self.stop
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at)
            .map(|(_, s)| s.clone())
    }

    fn stop_reason(&self, reason: FinishReason) -> (&'static str, Option<String>) {
        match reason {
            FinishReason::Length | FinishReason::ContextLength => ("max_tokens", None),
            _ if self.blocks.tool_uses() > 0 => ("tool_use", None),
            FinishReason::Stop => match self.matched_stop() {
                Some(s) => ("stop_sequence", Some(s)),
                None => ("end_turn", None),
            },
            _ => ("end_turn", None),
        }
    }
}

pub(crate) fn sse(body: &mut Vec<u8>, (name, data): &Event) {
    body.extend_from_slice(b"event: ");
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(b"\ndata: ");
    body.extend_from_slice(data.to_string().as_bytes());
    body.extend_from_slice(b"\n\n");
}

impl EventWriter for AnthropicWriter {
    fn stream_start(&mut self) -> Option<Response> {
        if !self.stream {
            return None;
        }
        let mut body = Vec::new();
        let start = self.message(json!([]), Value::Null, Value::Null, 0);
        sse(
            &mut body,
            &(
                "message_start",
                json!({"type": "message_start", "message": start}),
            ),
        );
        sse(&mut body, &("ping", json!({"type": "ping"})));
        Some(
            Response::new(200, "text/event-stream; charset=utf-8", body)
                .with_header("Cache-Control", "no-cache")
                .with_header("X-Accel-Buffering", "no"),
        )
    }

    fn on_event(&mut self, event: &GenEvent, body: &mut Vec<u8>) -> Progress {
        let mut events = Vec::new();
        match event {
            GenEvent::Token { token, text, .. } => {
                if !self.stop.is_empty() {
                    self.ids.push(token.token);
                }
                let part = match &mut self.think {
                    Some(t) => t.push(text),
                    None => Split {
                        reasoning: String::new(),
                        content: text.clone(),
                    },
                };
                self.put(part, &mut events);
                self.emit(events, body);
                Progress::More
            }
            GenEvent::Finished {
                reason,
                usage: used,
                message,
            } => {
                let failed = match reason {
                    FinishReason::Error => Some((500, "generation failed")),
                    FinishReason::Shutdown => {
                        Some((503, "the server shut down before the reply was finished"))
                    }
                    FinishReason::Rejected => Some((400, "the request cannot be served")),
                    _ => None,
                };
                if let Some((status, fallback)) = failed {
                    let msg = message.as_deref().unwrap_or(fallback);
                    let (status, err) = error_body(status, "", msg);
                    if !self.stream {
                        return Progress::Complete(Response::json(status, &err));
                    }
                    sse(body, &("error", err));
                    return Progress::StreamDone;
                }
                if let Some(rest) = self.think.as_mut().map(ThinkSplitter::finish) {
                    self.put(rest, &mut events);
                }
                if let Some(rest) = self.calls.as_mut().map(CallSplitter::finish) {
                    self.put_content(&rest.content, &rest.calls, &mut events);
                }
                self.blocks.finish(&mut events);
                self.emit(events, body);
                let (stop_reason, stop_seq) = self.stop_reason(*reason);
                let output = used.completion_tokens;
                if !self.stream {
                    let content = Value::Array(std::mem::take(&mut self.content));
                    let m = self.message(content, stop_reason.into(), stop_seq.into(), output);
                    return Progress::Complete(Response::json(200, &m));
                }
                let delta = json!({
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_seq},
                    "usage": usage(self.input_tokens, output),
                });
                sse(body, &("message_delta", delta));
                sse(body, &("message_stop", json!({"type": "message_stop"})));
                Progress::StreamDone
            }
        }
    }
}

/// Usage as the engine reports it (for tests).
#[cfg(test)]
pub(crate) fn finished(reason: FinishReason, input: u32, output: u32) -> GenEvent {
    GenEvent::Finished {
        reason,
        usage: crate::engine::Usage {
            prompt_tokens: input,
            completion_tokens: output,
        },
        message: None,
    }
}

//! Several choices of one OpenAI request (`n` > 1): one engine request and one `OpenAiWriter`
//! per choice, merged into the one response the client reads. Whole responses: each choice's
//! object is taken from its writer's response, given its index, and the usage is summed (the
//! prompt counted once). Streams: each writer's chunks are passed on with their choice's index as
//! they come (choices interleave), the writers' own usage chunks and `[DONE]` are held back, and
//! the merged stream ends with one usage chunk (when asked for) and one `[DONE]` after the last
//! choice finishes. A choice that fails ends the whole response with its error (the HTTP layer
//! stops the other choices).

use serde_json::{Map, Value};

use super::openai_stream::OpenAiWriter;
use super::pyjson::escape_line_breaks;
use crate::engine::GenEvent;
use crate::http::{EventWriter, Progress, Response};

/// Token counts of one finished choice, as its writer reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct ChoiceUsage {
    prompt: u64,
    completion: u64,
}

pub(crate) struct ChoicesWriter {
    writers: Vec<OpenAiWriter>,
    stream: bool,
    /// The client asked for a usage chunk at the end of the stream.
    include_usage: bool,
    /// Per choice: its usage once it finished.
    usage: Vec<Option<ChoiceUsage>>,
    /// Whole responses: each choice's object once it finished. Both: the first response's or
    /// chunk's envelope (id, object, created, model).
    choices: Vec<Option<Value>>,
    envelope: Option<Map<String, Value>>,
}

impl ChoicesWriter {
    /// `writers[i]` writes choice `i`; streaming writers must report their usage.
    pub(crate) fn new(writers: Vec<OpenAiWriter>, stream: bool, include_usage: bool) -> Self {
        let n = writers.len();
        Self {
            writers,
            stream,
            include_usage,
            usage: vec![None; n],
            choices: vec![None; n],
            envelope: None,
        }
    }

    fn all_done(&self) -> bool {
        self.usage.iter().all(Option::is_some)
    }

    /// The summed usage object (the prompt once, the completions added).
    fn usage_value(&self) -> Value {
        let prompt = self
            .usage
            .iter()
            .flatten()
            .map(|u| u.prompt)
            .max()
            .unwrap_or(0);
        let completion: u64 = self.usage.iter().flatten().map(|u| u.completion).sum();
        serde_json::json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        })
    }

    /// Passes on the SSE events of choice `i`'s writer with the choice's index; records its
    /// usage chunk and drops its `[DONE]`. Returns an error event's bytes when the writer
    /// reported one (the stream ends with it).
    fn relay(&mut self, i: usize, events: &[u8], out: &mut Vec<u8>) -> Option<Vec<u8>> {
        let text = String::from_utf8_lossy(events);
        for event in text.split("\n\n").filter(|e| !e.is_empty()) {
            let data = event.strip_prefix("data: ").unwrap_or(event);
            if data == "[DONE]" {
                continue;
            }
            let Ok(Value::Object(mut chunk)) = serde_json::from_str::<Value>(data) else {
                // Not JSON this writer makes: pass it on as it is.
                out.extend_from_slice(event.as_bytes());
                out.extend_from_slice(b"\n\n");
                continue;
            };
            if chunk.contains_key("error") {
                return Some(format!("data: {data}\n\n").into_bytes());
            }
            let no_choices = chunk
                .get("choices")
                .and_then(Value::as_array)
                .is_none_or(Vec::is_empty);
            if no_choices {
                if let Some(u) = chunk.get("usage") {
                    self.usage[i] = Some(usage_of(u));
                }
                continue;
            }
            if self.envelope.is_none() {
                // The stream's id, object, created and model, for the merged usage chunk.
                let mut env = chunk.clone();
                env.remove("choices");
                self.envelope = Some(env);
            }
            if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
                for c in choices {
                    c["index"] = i.into();
                }
            }
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(escape_line_breaks(Value::Object(chunk).to_string()).as_bytes());
            out.extend_from_slice(b"\n\n");
        }
        None
    }

    /// Records choice `i`'s whole response; Err with it when it is not a success.
    fn take_whole(&mut self, i: usize, resp: Response) -> Result<(), Response> {
        if resp.status != 200 {
            return Err(resp);
        }
        let Ok(Value::Object(mut whole)) = serde_json::from_slice::<Value>(&resp.body) else {
            return Err(resp);
        };
        let mut choice = match whole.remove("choices") {
            Some(Value::Array(mut c)) if !c.is_empty() => c.swap_remove(0),
            _ => return Err(resp),
        };
        choice["index"] = i.into();
        self.choices[i] = Some(choice);
        self.usage[i] = Some(
            whole
                .remove("usage")
                .map(|u| usage_of(&u))
                .unwrap_or_default(),
        );
        self.envelope.get_or_insert(whole);
        Ok(())
    }

    fn merged_whole(&mut self) -> Response {
        let mut whole = self.envelope.take().unwrap_or_default();
        whole.insert(
            "choices".into(),
            Value::Array(self.choices.iter_mut().filter_map(Option::take).collect()),
        );
        whole.insert("usage".into(), self.usage_value());
        let json = escape_line_breaks(Value::Object(whole).to_string());
        Response::new(200, "application/json", json.into_bytes())
    }
}

fn usage_of(u: &Value) -> ChoiceUsage {
    ChoiceUsage {
        prompt: u["prompt_tokens"].as_u64().unwrap_or(0),
        completion: u["completion_tokens"].as_u64().unwrap_or(0),
    }
}

impl EventWriter for ChoicesWriter {
    fn enable_tool_calls(&mut self, tool_names: &[String]) {
        for w in &mut self.writers {
            w.enable_tool_calls(tool_names);
        }
    }
    fn stream_start(&mut self) -> Option<Response> {
        let mut head = self.writers.first_mut()?.stream_start()?;
        // Each writer's opening chunk (a chat stream's role), with its index.
        let first = std::mem::take(&mut head.body);
        let mut body = Vec::new();
        self.relay(0, &first, &mut body);
        for i in 1..self.writers.len() {
            if let Some(h) = self.writers[i].stream_start() {
                self.relay(i, &h.body, &mut body);
            }
        }
        head.body = body;
        Some(head)
    }

    fn on_event(&mut self, event: &GenEvent, body: &mut Vec<u8>) -> Progress {
        self.on_choice_event(0, event, body)
    }

    fn on_choice_event(&mut self, choice: usize, event: &GenEvent, body: &mut Vec<u8>) -> Progress {
        let Some(w) = self.writers.get_mut(choice) else {
            return Progress::More; // no such choice: nothing to write
        };
        let mut own = Vec::new();
        let progress = w.on_event(event, &mut own);
        if self.stream {
            if let Some(error) = self.relay(choice, &own, body) {
                body.extend_from_slice(&error);
                body.extend_from_slice(b"data: [DONE]\n\n");
                return Progress::StreamDone;
            }
            if matches!(progress, Progress::StreamDone) && self.usage[choice].is_none() {
                self.usage[choice] = Some(ChoiceUsage::default());
            }
            if !self.all_done() {
                return Progress::More;
            }
            if self.include_usage {
                let mut u = self.envelope.clone().unwrap_or_default();
                u.insert("choices".into(), Value::Array(Vec::new()));
                u.insert("usage".into(), self.usage_value());
                body.extend_from_slice(b"data: ");
                body.extend_from_slice(escape_line_breaks(Value::Object(u).to_string()).as_bytes());
                body.extend_from_slice(b"\n\n");
            }
            body.extend_from_slice(b"data: [DONE]\n\n");
            return Progress::StreamDone;
        }
        match progress {
            Progress::Complete(resp) => {
                if let Err(failed) = self.take_whole(choice, resp) {
                    return Progress::Complete(failed);
                }
                if self.all_done() {
                    Progress::Complete(self.merged_whole())
                } else {
                    Progress::More
                }
            }
            Progress::More | Progress::StreamDone => Progress::More,
        }
    }
}

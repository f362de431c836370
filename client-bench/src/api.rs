//! The two wire protocols the bench speaks: llm-serving's `generate_stream` (request body as
//! performance_serving sends it, newline-delimited JSON lines back) and OpenAI's streaming
//! completions / chat completions (SSE `data:` events ending with `[DONE]`).

use serde_json::{json, Value};

/// Which API the server speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ApiKind {
    /// MindSpore llm-serving: `POST /models/{name}/generate_stream`.
    #[value(name = "llm-serving")]
    LlmServing,
    /// OpenAI-compatible: `POST /v1/completions` or `/v1/chat/completions`.
    #[value(name = "openai")]
    OpenAi,
}

/// Everything needed to build request bodies and read their streams.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    pub kind: ApiKind,
    /// Request path, e.g. `/models/llama2/generate_stream` or `/v1/completions`.
    pub path: String,
    /// Model name sent in OpenAI bodies.
    pub model_name: String,
    /// OpenAI chat endpoint (messages in, `delta.content` out).
    pub chat: bool,
    /// Ask the server to ignore end-of-sequence so every request produces max_new_tokens.
    pub ignore_eos: bool,
    /// `Authorization: Bearer` value for OpenAI-compatible servers that want one.
    pub api_key: Option<String>,
    /// A JSON Schema every reply must follow (structured output): OpenAI's `response_format`
    /// (`json_schema`), or TGI's `parameters.grammar` on llm-serving's API.
    pub json_schema: Option<Value>,
}

impl ApiSettings {
    /// Default request path for an API and served model name.
    pub fn default_path(kind: ApiKind, model_name: &str) -> String {
        match kind {
            ApiKind::LlmServing => format!("/models/{model_name}/generate_stream"),
            ApiKind::OpenAi => "/v1/completions".to_string(),
        }
    }

    /// JSON body of one streamed request.
    ///
    /// llm-serving: `{"inputs": prompt, "parameters": {"max_new_tokens": N, "do_sample": "False",
    /// "return_full_text": "True"}}` (string booleans, exactly as performance_serving sends them).
    /// OpenAI: `{"model", "prompt" | "messages", "max_tokens", "temperature": 0, "stream": true,
    /// "stream_options": {"include_usage": true}}`.
    pub fn request_body(&self, prompt: &str, max_new_tokens: usize) -> Vec<u8> {
        let body = match self.kind {
            ApiKind::LlmServing => {
                let mut params = serde_json::Map::new();
                params.insert("max_new_tokens".into(), json!(max_new_tokens));
                params.insert("do_sample".into(), json!("False"));
                params.insert("return_full_text".into(), json!("True"));
                if self.ignore_eos {
                    params.insert("ignore_eos".into(), json!(true));
                }
                if let Some(schema) = &self.json_schema {
                    params.insert("grammar".into(), json!({"type": "json", "value": schema}));
                }
                json!({ "inputs": prompt, "parameters": Value::Object(params) })
            }
            ApiKind::OpenAi => {
                let mut body = serde_json::Map::new();
                body.insert("model".into(), json!(self.model_name));
                if self.chat {
                    body.insert(
                        "messages".into(),
                        json!([{ "role": "user", "content": prompt }]),
                    );
                } else {
                    body.insert("prompt".into(), json!(prompt));
                }
                body.insert("max_tokens".into(), json!(max_new_tokens));
                body.insert("temperature".into(), json!(0.0));
                body.insert("stream".into(), json!(true));
                body.insert("stream_options".into(), json!({ "include_usage": true }));
                if self.ignore_eos {
                    body.insert("ignore_eos".into(), json!(true));
                }
                if let Some(schema) = &self.json_schema {
                    body.insert(
                        "response_format".into(),
                        json!({"type": "json_schema",
                               "json_schema": {"name": "bench", "schema": schema}}),
                    );
                }
                Value::Object(body)
            }
        };
        serde_json::to_vec(&body).expect("a JSON value always serializes")
    }

    /// Header lines of one streamed request.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![("Content-Type", "application/json".to_string())];
        match self.kind {
            ApiKind::LlmServing => {}
            ApiKind::OpenAi => {
                h.push(("Accept", "text/event-stream".to_string()));
                if let Some(key) = &self.api_key {
                    h.push(("Authorization", format!("Bearer {key}")));
                }
            }
        }
        h
    }
}

/// What one line of a response stream means.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamItem {
    /// Newly generated text (may be empty, e.g. a held-back partial character).
    Delta(String),
    /// llm-serving's closing line with the whole text (return_full_text; when the server puts
    /// the prompt first, as TGI does, the runner keeps only what follows it).
    FullText(String),
    /// Token counts reported by an OpenAI server.
    Usage {
        prompt_tokens: u64,
        completion_tokens: u64,
    },
    /// OpenAI's `data: [DONE]`.
    Done,
    /// Nothing of interest (blank line, SSE comment, event name, keep-alive).
    Skip,
}

/// Reads the lines of one response stream; it remembers the text so far so it can tell
/// llm-serving's closing full-text line from a delta.
#[derive(Debug)]
pub struct StreamParser {
    kind: ApiKind,
    text_so_far: String,
}

impl StreamParser {
    pub fn new(kind: ApiKind) -> Self {
        StreamParser {
            kind,
            text_so_far: String::new(),
        }
    }

    /// Interprets one line. `Err` carries the reason the stream is unusable (an error object sent
    /// by the server, or a line that is not the expected JSON).
    pub fn parse_line(&mut self, line: &str) -> Result<StreamItem, String> {
        let line = line.trim();
        if line.is_empty() || line.starts_with(':') {
            return Ok(StreamItem::Skip);
        }
        let payload = match strip_field(line, "data") {
            Some(rest) => rest,
            None if line.starts_with('{') => line,
            // Other SSE fields (event:, id:, retry:) carry nothing we measure.
            None if is_sse_field(line) => return Ok(StreamItem::Skip),
            None => return Err(format!("unexpected stream line {:?}", clip(line, 120))),
        };
        if payload == "[DONE]" {
            return Ok(StreamItem::Done);
        }
        let v: Value = serde_json::from_str(payload)
            .map_err(|e| format!("stream line is not JSON ({e}): {:?}", clip(payload, 120)))?;
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            let msg = err
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string());
            return Err(format!("server error in stream: {}", clip(&msg, 200)));
        }
        match self.kind {
            ApiKind::LlmServing => self.parse_llm_serving(&v),
            ApiKind::OpenAi => Ok(self.parse_openai(&v)),
        }
    }

    fn parse_llm_serving(&mut self, v: &Value) -> Result<StreamItem, String> {
        // `{"event":"message","retry":30000,"data":[{...}]}`; older servers send the object
        // itself (optionally after "data:"), some send "data" as an object.
        let item = match v.get("data") {
            Some(Value::Array(items)) => items.first().unwrap_or(&Value::Null),
            Some(obj @ Value::Object(_)) => obj,
            _ => v,
        };
        let is_error_event = v.get("event").and_then(Value::as_str) == Some("error");
        if let Some(err) = item
            .get("error")
            .filter(|e| !e.is_null())
            .or(is_error_event.then_some(item))
        {
            let msg = err
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string());
            return Err(format!("server error in stream: {}", clip(&msg, 200)));
        }
        let Some(text) = item.get("generated_text") else {
            if v.get("event").is_some() || item.is_null() {
                return Ok(StreamItem::Skip);
            }
            return Err(format!(
                "stream line has no generated_text: {}",
                clip(&v.to_string(), 120)
            ));
        };
        let text = match text {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => return Err(format!("generated_text is not a string: {other}")),
        };
        let closing_fields =
            item.get("generated_tokens").is_some() || item.get("finish_reason").is_some();
        let is_full_text = item.get("generated_tokens").is_some()
            || (closing_fields
                && !self.text_so_far.is_empty()
                && text.starts_with(self.text_so_far.as_str()));
        if is_full_text {
            return Ok(StreamItem::FullText(text));
        }
        self.text_so_far.push_str(&text);
        Ok(StreamItem::Delta(text))
    }

    fn parse_openai(&mut self, v: &Value) -> StreamItem {
        let choice = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first());
        if let Some(choice) = choice {
            let text = choice
                .get("text")
                .and_then(Value::as_str)
                .or_else(|| {
                    choice
                        .get("delta")
                        .and_then(|d| d.get("content"))
                        .and_then(Value::as_str)
                })
                .unwrap_or("");
            self.text_so_far.push_str(text);
            return StreamItem::Delta(text.to_string());
        }
        if let Some(usage) = v.get("usage").filter(|u| u.is_object()) {
            let n = |k: &str| usage.get(k).and_then(Value::as_u64).unwrap_or(0);
            return StreamItem::Usage {
                prompt_tokens: n("prompt_tokens"),
                completion_tokens: n("completion_tokens"),
            };
        }
        StreamItem::Skip
    }
}

/// `field:value` or `field: value` → value.
fn strip_field<'a>(line: &'a str, field: &str) -> Option<&'a str> {
    let rest = line.strip_prefix(field)?.strip_prefix(':')?;
    Some(rest.strip_prefix(' ').unwrap_or(rest).trim())
}

fn is_sse_field(line: &str) -> bool {
    ["event", "id", "retry"]
        .iter()
        .any(|f| strip_field(line, f).is_some())
}

/// At most `max` characters of `s` (on a character boundary).
pub fn clip(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(kind: ApiKind, chat: bool) -> ApiSettings {
        ApiSettings {
            kind,
            path: ApiSettings::default_path(kind, "llama2"),
            model_name: "m".into(),
            chat,
            ignore_eos: false,
            api_key: None,
            json_schema: None,
        }
    }

    #[test]
    fn a_json_schema_goes_where_each_api_takes_it() {
        let schema = json!({"type": "object"});
        let mut s = settings(ApiKind::OpenAi, true);
        s.json_schema = Some(schema.clone());
        let v: Value = serde_json::from_slice(&s.request_body("p", 3)).unwrap();
        assert_eq!(v["response_format"]["type"], "json_schema");
        assert_eq!(v["response_format"]["json_schema"]["schema"], schema);
        let mut s = settings(ApiKind::LlmServing, false);
        s.json_schema = Some(schema.clone());
        let v: Value = serde_json::from_slice(&s.request_body("p", 3)).unwrap();
        assert_eq!(
            v["parameters"]["grammar"],
            json!({"type": "json", "value": schema})
        );
    }

    #[test]
    fn llm_serving_body_matches_performance_serving() {
        let body = settings(ApiKind::LlmServing, false).request_body("Hi:there", 17);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v,
            json!({"inputs": "Hi:there", "parameters": {"max_new_tokens": 17,
                   "do_sample": "False", "return_full_text": "True"}})
        );
        assert_eq!(
            ApiSettings::default_path(ApiKind::LlmServing, "llama2"),
            "/models/llama2/generate_stream"
        );
    }

    #[test]
    fn openai_bodies() {
        let v: Value =
            serde_json::from_slice(&settings(ApiKind::OpenAi, false).request_body("p", 3)).unwrap();
        assert_eq!(v["prompt"], "p");
        assert_eq!(v["max_tokens"], 3);
        assert_eq!(v["stream"], true);
        let v: Value =
            serde_json::from_slice(&settings(ApiKind::OpenAi, true).request_body("p", 3)).unwrap();
        assert_eq!(v["messages"][0]["content"], "p");
        assert!(v.get("prompt").is_none());
    }

    #[test]
    fn llm_serving_lines_deltas_and_full_text() {
        let mut p = StreamParser::new(ApiKind::LlmServing);
        let l1 = r#"{"event": "message", "retry": 30000, "data": [{"details": null, "generated_text": "Hel", "tokens": {"id": 1, "text": "Hel"}}]}"#;
        let l2 = r#"{"event": "message", "retry": 30000, "data": [{"generated_text": "lo"}]}"#;
        let l3 = r#"{"event": "message", "retry": 30000, "data": [{"generated_text": "Hello", "finish_reason": "length", "generated_tokens": 2}]}"#;
        assert_eq!(p.parse_line(l1).unwrap(), StreamItem::Delta("Hel".into()));
        assert_eq!(p.parse_line(l2).unwrap(), StreamItem::Delta("lo".into()));
        assert_eq!(
            p.parse_line(l3).unwrap(),
            StreamItem::FullText("Hello".into())
        );
        // The older "data:" prefixed variant without the event wrapper.
        let mut p = StreamParser::new(ApiKind::LlmServing);
        assert_eq!(
            p.parse_line(r#"data:{"generated_text": "x"}"#).unwrap(),
            StreamItem::Delta("x".into())
        );
        // A last delta that carries finish_reason but is not the whole text stays a delta.
        assert_eq!(
            p.parse_line(r#"{"data":[{"generated_text": "y", "finish_reason": "eos"}]}"#)
                .unwrap(),
            StreamItem::Delta("y".into())
        );
    }

    #[test]
    fn llm_serving_errors_are_reasons() {
        let mut p = StreamParser::new(ApiKind::LlmServing);
        assert!(p.parse_line("not json").is_err());
        let e = p
            .parse_line(r#"{"error": "prompt too long", "type": "validation"}"#)
            .unwrap_err();
        assert!(e.contains("prompt too long"), "{e}");
        let e = p
            .parse_line(
                r#"{"event": "error", "retry": 30000, "data": [{"error": "agent died", "error_type": "generation"}]}"#,
            )
            .unwrap_err();
        assert!(e.contains("agent died"), "{e}");
        assert_eq!(p.parse_line(": ping").unwrap(), StreamItem::Skip);
        assert_eq!(p.parse_line("").unwrap(), StreamItem::Skip);
    }

    #[test]
    fn openai_sse_lines() {
        let mut p = StreamParser::new(ApiKind::OpenAi);
        assert_eq!(
            p.parse_line(r#"data: {"choices":[{"index":0,"text":"ab","finish_reason":null}]}"#)
                .unwrap(),
            StreamItem::Delta("ab".into())
        );
        assert_eq!(
            p.parse_line(r#"data: {"choices":[{"delta":{"content":"c"}}]}"#)
                .unwrap(),
            StreamItem::Delta("c".into())
        );
        assert_eq!(
            p.parse_line(r#"data: {"choices":[{"delta":{"role":"assistant"}}]}"#)
                .unwrap(),
            StreamItem::Delta(String::new())
        );
        assert_eq!(
            p.parse_line(
                r#"data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}"#
            )
            .unwrap(),
            StreamItem::Usage {
                prompt_tokens: 5,
                completion_tokens: 2
            }
        );
        assert_eq!(p.parse_line("event: message").unwrap(), StreamItem::Skip);
        assert_eq!(p.parse_line("data: [DONE]").unwrap(), StreamItem::Done);
        let e = p
            .parse_line(
                r#"data: {"error":{"message":"bad max_tokens","type":"invalid_request_error"}}"#,
            )
            .unwrap_err();
        assert!(e.contains("bad max_tokens"));
    }

    #[test]
    fn clip_respects_char_boundaries() {
        assert_eq!(clip("héllo", 2), "hé");
        assert_eq!(clip("hi", 5), "hi");
    }
}

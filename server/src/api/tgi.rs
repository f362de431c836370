//! The llm-serving (TGI-style) front end: `POST /models/{name}[/generate|/generate_stream]` with
//! `{"inputs", "parameters", "stream"}`; newline-delimited JSON stream lines exactly as
//! llm-serving writes them (`{"event": "message", "retry": 30000, "data": [{...}]}`), with a last
//! full-text line when `return_full_text`; whole responses with details. `return_full_text`
//! puts the prompt before the generated text, as TGI does, in the whole response and in the
//! stream's last line (the per-token lines carry the generated text alone).

use std::sync::atomic::{AtomicBool, Ordering};

use npu_protocol::{SamplingParams, TokenLogprob};
use npu_tokenizer::Tokenizer;
use serde::Serialize;

use super::error::ApiError;
use super::fields::{parse_body, unknown_fields_error, Fields};
use super::pyjson::{f32_json, to_python_json};
use super::sampling;
use super::ApiContext;
use crate::engine::{FinishReason, GenEvent, GenerateRequest, RequestId};
use crate::http::{EventWriter, Progress, Request, Response, Submission};

/// Parameters accepted and ignored: warn once per process, not per request.
static TYPICAL_P_WARNED: AtomicBool = AtomicBool::new(false);

/// Reads and validates a request; `route_stream` is Some for /generate (false) and
/// /generate_stream (true), None for /models/{name} where the body's `stream` decides.
pub(super) fn submission(
    ctx: &ApiContext,
    req: &Request,
    id: RequestId,
    route_stream: Option<bool>,
) -> Result<Submission, ApiError> {
    let body = parse_body(&req.body)?;
    let top = Fields::new(&body, "");
    let inputs = match top.get("inputs") {
        None => {
            return Err(ApiError::invalid(
                "inputs",
                "inputs is missing: give the prompt text",
            ))
        }
        Some(serde_json::Value::String(s)) => s.as_str(),
        Some(v) => return Err(top.wrong("inputs", "a string", v)),
    };
    if inputs.is_empty() {
        return Err(ApiError::invalid(
            "inputs",
            "inputs is empty: give the prompt text",
        ));
    }
    let body_stream = top.bool("stream")?;
    let stream = route_stream.or(body_stream).unwrap_or(false);
    let p = top.object("parameters", "parameters.")?;
    let s = &ctx.settings;

    let do_sample = p.bool("do_sample")?.unwrap_or(false);
    // A field the request leaves out takes the model's default (generation_config.json), then
    // the server's; do_sample stays the request's (greedy unless it asks).
    let d = &s.sampling_defaults;
    let temperature = sampling::temperature(&p, "temperature")?
        .or(d.temperature)
        .unwrap_or(1.0);
    let top_k = sampling::top_k(&p, "top_k", false)?
        .or(d.top_k)
        .unwrap_or(0);
    let top_p = sampling::top_p(&p, "top_p")?.or(d.top_p).unwrap_or(1.0);
    if p.f64("typical_p")?.is_some() && !TYPICAL_P_WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "parameters.typical_p is accepted and ignored (typical sampling is not supported)"
        );
    }
    let repetition_penalty = sampling::repetition_penalty(&p, "repetition_penalty")?
        .or(d.repetition_penalty)
        .unwrap_or(1.0);
    let presence_penalty = sampling::penalty(&p, "presence_penalty")?.unwrap_or(0.0);
    let frequency_penalty = sampling::penalty(&p, "frequency_penalty")?.unwrap_or(0.0);
    let max_new_tokens = sampling::max_new_tokens(&p, "max_new_tokens", s)?;
    let return_full_text = p.bool("return_full_text")?.unwrap_or(false);
    let seed = p.u64("seed")?;
    let stop = p.strings("stop")?;
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ApiError::invalid(
            "parameters.stop",
            format!("parameters.stop[{i}] is empty"),
        ));
    }
    let details = p.bool("details")?.unwrap_or(false);
    p.bool("decoder_input_details")?; // accepted; prompt log-probabilities are not computed
    let top_n_tokens = sampling::top_n(&p, "top_n_tokens")?.unwrap_or(0);
    let truncate = match p.get("truncate") {
        None | Some(serde_json::Value::Bool(_)) => None,
        Some(_) => p
            .int_in("truncate", 1, i64::from(u32::MAX))?
            .map(|n| n as usize),
    };
    if p.bool("watermark")?.unwrap_or(false) {
        return Err(ApiError::invalid(
            "parameters.watermark",
            "parameters.watermark: only false is supported",
        ));
    }
    let ignore_eos = p.bool("ignore_eos")?.unwrap_or(false);
    // Our extension: false keeps speculative decoding off for this request.
    let speculative = p.bool("speculative")?.unwrap_or(true);
    let sse = match p.string("return_protocol")? {
        None | Some("sse") => true,
        Some(_) => false,
    };
    // TGI's other parameters: known, but only their defaults are served.
    if let Some(b) = p.i64("best_of")? {
        if b != 1 {
            return Err(ApiError::invalid(
                "parameters.best_of",
                format!("parameters.best_of must be 1, got {b}"),
            ));
        }
    }
    let asked = super::structured::tgi_constraint(&p)?;
    for key in ["adapter_id"] {
        if p.get(key).is_some() {
            let name = p.name(key);
            return Err(ApiError::invalid(&name, format!("{name} is not supported")));
        }
    }
    // A misspelt field would otherwise be ignored silently (and its default used): refuse
    // every field this route does not know, naming the one each most likely meant.
    let mut unknown = top.unknown();
    for u in &mut unknown {
        if p.was_asked(&u.name) {
            u.hint = Some(format!("it belongs in parameters: parameters.{}", u.name));
        }
    }
    unknown.extend(p.unknown());
    if !unknown.is_empty() {
        return Err(unknown_fields_error(&unknown));
    }

    let mut prompt_ids = ctx
        .tokenizer
        .encode(inputs)
        .map_err(|e| ApiError::invalid("inputs", format!("inputs cannot be tokenized: {e}")))?;
    if let Some(n) = truncate {
        if prompt_ids.len() > n {
            prompt_ids.drain(..prompt_ids.len() - n);
        }
    }
    sampling::check_prompt(&prompt_ids, "inputs", s)?;

    let seed = seed.unwrap_or_else(|| {
        if do_sample {
            sampling::random_seed(id)
        } else {
            0
        }
    });
    let params = SamplingParams {
        do_sample: do_sample && temperature > 0.0,
        temperature,
        top_k,
        top_p,
        min_p: d.min_p.unwrap_or(0.0),
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed,
        top_n: top_n_tokens,
        logit_bias: Vec::new(),
    };
    let request = GenerateRequest {
        id,
        prompt_ids,
        params,
        max_new_tokens,
        stop,
        stop_token_ids: Vec::new(),
        ignore_eos,
        speculative,
    };
    let state = TgiState {
        tokenizer: ctx.tokenizer.clone(),
        prompt: if return_full_text {
            inputs.to_string()
        } else {
            String::new()
        },
        text: String::new(),
        tokens: Vec::new(),
        tops: Vec::new(),
        top_n: top_n_tokens > 0,
        seed,
    };
    let writer: Box<dyn EventWriter> = if stream {
        Box::new(TgiStreamWriter {
            state,
            sse,
            return_full_text,
        })
    } else {
        Box::new(TgiFullWriter { state, details })
    };
    let constraints = match asked {
        Some(a) => super::structured::compile(ctx, &a, 1)?,
        None => Vec::new(),
    };
    Ok(Submission {
        request,
        more: Vec::new(),
        writer,
        constraints,
        lora: None,
    })
}

/// One token as llm-serving reports it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TgiToken {
    id: u32,
    logprob: f64,
    special: bool,
    text: String,
}

/// What both writers collect.
struct TgiState {
    tokenizer: Tokenizer,
    /// What the full text starts with: the request's `inputs` with `return_full_text`, else
    /// nothing.
    prompt: String,
    text: String,
    tokens: Vec<TgiToken>,
    /// Per token: the alternatives (or the token itself when top_n_tokens was not asked).
    tops: Vec<Vec<TgiToken>>,
    top_n: bool,
    seed: u64,
}

impl TgiState {
    fn token(&self, t: &TokenLogprob, text: String) -> TgiToken {
        TgiToken {
            id: t.token,
            logprob: f32_json(t.logprob),
            special: self.tokenizer.is_special(t.token),
            text,
        }
    }

    /// Records a token event; returns its index.
    fn push(&mut self, token: &TokenLogprob, top: &[TokenLogprob], text: &str) -> usize {
        let tok = self.token(token, text.to_string());
        let tops = if self.top_n {
            top.iter()
                .map(|t| self.token(t, sampling::token_text(&self.tokenizer, t.token)))
                .collect()
        } else {
            vec![tok.clone()]
        };
        self.text.push_str(text);
        self.tokens.push(tok);
        self.tops.push(tops);
        self.tokens.len() - 1
    }

    fn summary(&self, reason: FinishReason, generated: u32) -> FullText<'_> {
        FullText {
            details: None,
            generated_text: format!("{}{}", self.prompt, self.text),
            finish_reason: reason.tgi(),
            generated_tokens: generated,
            prefill: self.tokens.first().into_iter().collect(),
            seed: self.seed,
            tokens: &self.tokens,
            top_tokens: self
                .tops
                .first()
                .map(|t| vec![t.as_slice()])
                .unwrap_or_default(),
        }
    }
}

#[derive(Serialize)]
struct StreamLine<T: Serialize> {
    event: &'static str,
    retry: u32,
    data: [T; 1],
}

#[derive(Serialize)]
struct TokenData<'a> {
    details: Option<()>,
    generated_text: &'a str,
    tokens: &'a TgiToken,
    top_tokens: &'a [TgiToken],
}

#[derive(Serialize)]
struct FullText<'a> {
    details: Option<()>,
    generated_text: String,
    finish_reason: &'static str,
    generated_tokens: u32,
    prefill: Vec<&'a TgiToken>,
    seed: u64,
    tokens: &'a [TgiToken],
    top_tokens: Vec<&'a [TgiToken]>,
}

#[derive(Serialize)]
struct ErrorData<'a> {
    error: &'a str,
    error_type: &'static str,
}

/// The stream: one line per token, then the full-text line when asked.
struct TgiStreamWriter {
    state: TgiState,
    /// `return_protocol` "sse" (the default): `{"event": "message", "retry": 30000, "data": [..]}`
    /// lines; otherwise `data:{...}` lines.
    sse: bool,
    return_full_text: bool,
}

impl TgiStreamWriter {
    fn line<T: Serialize>(&self, out: &mut Vec<u8>, data: T) {
        let json = if self.sse {
            to_python_json(&StreamLine {
                event: "message",
                retry: 30000,
                data: [data],
            })
        } else {
            format!("data:{}", to_python_json(&data))
        };
        out.extend_from_slice(json.as_bytes());
        out.push(b'\n');
    }
}

impl EventWriter for TgiStreamWriter {
    fn stream_start(&mut self) -> Option<Response> {
        Some(
            Response::new(200, "text/event-stream; charset=utf-8", Vec::new())
                .with_header("Cache-Control", "no-cache")
                .with_header("X-Accel-Buffering", "no"),
        )
    }

    fn on_event(&mut self, event: &GenEvent, body: &mut Vec<u8>) -> Progress {
        match event {
            GenEvent::Token { token, top, text } => {
                let i = self.state.push(token, top, text);
                let data = TokenData {
                    details: None,
                    generated_text: text,
                    tokens: &self.state.tokens[i],
                    top_tokens: &self.state.tops[i],
                };
                self.line(body, data);
                Progress::More
            }
            GenEvent::Finished {
                reason,
                usage,
                message,
            } => {
                // An error, or a shutdown that cut the request short, ends the stream with an
                // error event so that the client knows the text is incomplete and why.
                let error = match (reason, message.as_deref()) {
                    (FinishReason::Error, Some(msg)) => Some((msg, "generation")),
                    (FinishReason::Rejected, msg) => {
                        Some((msg.unwrap_or("the request cannot be served"), "validation"))
                    }
                    (FinishReason::Shutdown, msg) => {
                        Some((msg.unwrap_or("the server is shutting down"), "shutdown"))
                    }
                    _ => None,
                };
                if let Some((msg, error_type)) = error {
                    let data = ErrorData {
                        error: msg,
                        error_type,
                    };
                    let json = to_python_json(&StreamLine {
                        event: "error",
                        retry: 30000,
                        data: [data],
                    });
                    body.extend_from_slice(json.as_bytes());
                    body.push(b'\n');
                } else if self.return_full_text {
                    let summary = self.state.summary(*reason, usage.completion_tokens);
                    self.line(body, summary);
                }
                Progress::StreamDone
            }
        }
    }
}

/// The whole response at the end: llm-serving's fields, and TGI `details` when asked.
struct TgiFullWriter {
    state: TgiState,
    details: bool,
}

impl EventWriter for TgiFullWriter {
    fn stream_start(&mut self) -> Option<Response> {
        None
    }

    fn on_event(&mut self, event: &GenEvent, _body: &mut Vec<u8>) -> Progress {
        match event {
            GenEvent::Token { token, top, text } => {
                self.state.push(token, top, text);
                Progress::More
            }
            GenEvent::Finished {
                reason,
                usage,
                message,
            } => {
                if *reason == FinishReason::Error {
                    let msg = message.as_deref().unwrap_or("generation failed");
                    return Progress::Complete(Response::error(500, "generation_error", msg));
                }
                if *reason == FinishReason::Rejected {
                    let msg = message.as_deref().unwrap_or("the request cannot be served");
                    return Progress::Complete(Response::error(400, "invalid_request_error", msg));
                }
                #[derive(Serialize)]
                struct Details<'a> {
                    finish_reason: &'static str,
                    generated_tokens: u32,
                    seed: u64,
                    prefill: [(); 0],
                    tokens: &'a [TgiToken],
                    top_tokens: &'a [Vec<TgiToken>],
                }
                #[derive(Serialize)]
                struct Whole<'a> {
                    generated_text: String,
                    finish_reason: &'static str,
                    generated_tokens: u32,
                    prefill: Vec<&'a TgiToken>,
                    seed: u64,
                    tokens: &'a [TgiToken],
                    top_tokens: Vec<&'a [TgiToken]>,
                    details: Option<Details<'a>>,
                }
                let s = self.state.summary(*reason, usage.completion_tokens);
                let whole = Whole {
                    generated_text: s.generated_text,
                    finish_reason: s.finish_reason,
                    generated_tokens: s.generated_tokens,
                    prefill: s.prefill,
                    seed: s.seed,
                    tokens: s.tokens,
                    top_tokens: s.top_tokens,
                    details: self.details.then(|| Details {
                        finish_reason: reason.tgi(),
                        generated_tokens: usage.completion_tokens,
                        seed: self.state.seed,
                        prefill: [],
                        tokens: &self.state.tokens,
                        top_tokens: &self.state.tops,
                    }),
                };
                let json = to_python_json(&whole);
                Progress::Complete(Response::new(200, "application/json", json.into_bytes()))
            }
        }
    }
}

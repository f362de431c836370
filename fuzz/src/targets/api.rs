//! The JSON bodies of every generation route (OpenAI chat and completions, llm-serving's TGI
//! routes) through the API layer's validation, tokenization, chat template, structured output
//! and tool parsing, with no engine: the input is a route selector byte, the body, and after a
//! NUL the text a model "generates", fed back through the route's response writer.

use npu_protocol::TokenLogprob;
use npu_scheduler::FinishReason;
use npu_server::engine::{GenEvent, Usage};
use npu_server::http::{Handler, Progress, Reply, Request};

use crate::fixtures;

const ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/generate_stream",
    "/models/llama2",
    "/models/llama2/generate_stream",
];

pub fn run(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let (body, generated) = crate::split_once(rest, 0);
    let req = Request {
        method: "POST".into(),
        path: ROUTES[selector as usize % ROUTES.len()].into(),
        query: None,
        headers: vec![("Content-Type".into(), "application/json".into())],
        body: body.to_vec(),
        arrived: std::time::Instant::now(),
    };
    answer(&req, 1, &String::from_utf8_lossy(generated));
}

/// Answers `req` as the server would; a generation is fed `generated` as its tokens, then ends.
/// A server error (500) for anything a client sent is a finding: bad input is a 4xx.
pub(crate) fn answer(req: &Request, id: u64, generated: &str) {
    let api = fixtures::api();
    match api.handle(req, id) {
        Reply::Full(resp) => {
            assert!(
                resp.status != 500,
                "{} {} answered 500: {}",
                req.method,
                req.path,
                String::from_utf8_lossy(&resp.body)
            );
        }
        Reply::Generate(mut sub) => {
            let tok = api.tokenizer();
            let ids = tok.encode(generated).unwrap_or_default();
            let mut writer = sub.writer;
            let _ = writer.stream_start();
            let mut body = Vec::new();
            let choices = 1 + sub.more.len();
            // Tokens go to the choices in turn, then each choice finishes; once the response is
            // over (the writer says so), nothing more is sent, as in the HTTP layer.
            let mut events = Vec::new();
            for (i, &id) in ids.iter().enumerate().take(256) {
                let event = GenEvent::Token {
                    token: TokenLogprob {
                        token: id,
                        logprob: -0.25,
                    },
                    top: Vec::new(),
                    text: tok.decode_continuation(&[id], false),
                };
                events.push((i % choices, event));
            }
            for choice in 0..choices {
                let done = GenEvent::Finished {
                    reason: FinishReason::Eos,
                    usage: Usage {
                        prompt_tokens: sub.request.prompt_ids.len() as u32,
                        completion_tokens: ids.len() as u32,
                    },
                    message: None,
                };
                events.push((choice, done));
            }
            for (choice, event) in &events {
                if !matches!(
                    writer.on_choice_event(*choice, event, &mut body),
                    Progress::More
                ) {
                    break;
                }
            }
            sub.more.clear();
        }
        // A sleep or wake the HTTP layer validated: its body was well-formed, so nothing to
        // answer here (the engine would act on it).
        Reply::Control(sub) => {
            assert!(
                req.path.ends_with("/sleep") || req.path.ends_with("/wake_up"),
                "{} {} became a control command {:?}",
                req.method,
                req.path,
                sub.command
            );
        }
    }
}

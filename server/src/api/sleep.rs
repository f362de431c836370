//! vLLM's sleep-mode routes: `POST /sleep` (`{"level": 1|2}` in the body, or `?level=`; 1 when
//! neither says), `POST /wake_up`, `GET /is_sleeping`. Sleep and wake go to the engine, which
//! answers once every agent has; `/is_sleeping` reads the engine's live state.

use serde_json::json;

use super::error::ApiError;
use super::ApiContext;
use crate::engine::handle::ControlReply;
use crate::engine::{EngineStats, GenEvent};
use crate::http::{
    ControlCommand, ControlSubmission, EventWriter, Progress, Reply, Request, Response,
};

/// The level a `/sleep` request asks for: `level` from the query or the JSON body (both: they
/// must agree), 1 when absent. Anything but 1 or 2, or another field, is a 400 naming it.
pub(super) fn level(req: &Request) -> Result<u8, ApiError> {
    let bad = |v: &dyn std::fmt::Display| {
        ApiError::invalid("level", format!("level {v}: 1 (free the KV cache, keep the weights) or 2 (drop the weights and the KV cache)"))
    };
    let mut from_query = None;
    for pair in req.query.as_deref().unwrap_or("").split('&') {
        if pair.is_empty() {
            continue;
        }
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k != "level" {
            return Err(ApiError::invalid(
                k,
                format!("unknown query parameter {k:?} (POST /sleep takes level)"),
            ));
        }
        from_query = Some(v.parse::<u8>().map_err(|_| bad(&format!("{v:?}")))?);
    }
    let mut from_body = None;
    let body = std::str::from_utf8(&req.body).unwrap_or("").trim();
    if !body.is_empty() {
        let value: serde_json::Value = serde_json::from_str(body)
            .map_err(|e| ApiError::invalid("body", format!("the body is not JSON: {e}")))?;
        let serde_json::Value::Object(map) = value else {
            return Err(ApiError::invalid(
                "body",
                "the body must be a JSON object such as {\"level\": 1}",
            ));
        };
        for (k, v) in map {
            if k != "level" {
                return Err(ApiError::invalid(
                    &k,
                    format!("unknown field: {k} (POST /sleep takes level)"),
                ));
            }
            let n = v.as_u64().filter(|n| *n <= 255).ok_or_else(|| bad(&v))?;
            from_body = Some(n as u8);
        }
    }
    let level = match (from_query, from_body) {
        (Some(q), Some(b)) if q != b => {
            return Err(ApiError::invalid(
                "level",
                format!("level is {q} in the query and {b} in the body"),
            ))
        }
        (q, b) => q.or(b).unwrap_or(1),
    };
    if !(1..=2).contains(&level) {
        return Err(bad(&level));
    }
    Ok(level)
}

pub(super) fn sleep(req: &Request) -> Result<Reply, ApiError> {
    let level = level(req)?;
    Ok(control(ControlCommand::Sleep { level }))
}

pub(super) fn wake() -> Reply {
    control(ControlCommand::Wake)
}

fn control(command: ControlCommand) -> Reply {
    Reply::Control(ControlSubmission {
        command,
        writer: Box::new(ControlWriter),
    })
}

pub(super) fn is_sleeping(ctx: &ApiContext) -> Response {
    let level = EngineStats::get(&ctx.stats.sleep.level);
    Response::json(200, &json!({"is_sleeping": level > 0, "level": level}))
}

/// Turns the engine's answer (a `ControlReply` in the Finished event's message) into the
/// response.
struct ControlWriter;

impl EventWriter for ControlWriter {
    fn stream_start(&mut self) -> Option<Response> {
        None
    }

    fn on_event(&mut self, event: &GenEvent, _body: &mut Vec<u8>) -> Progress {
        let GenEvent::Finished { message, .. } = event else {
            return Progress::More;
        };
        let reply = message
            .as_deref()
            .and_then(|m| serde_json::from_str::<ControlReply>(m).ok());
        Progress::Complete(match reply {
            Some(r) => Response::json(r.status, &r.body),
            None => Response::json(
                500,
                &json!({"error": {"message": message, "type": "internal_error"}}),
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(query: Option<&str>, body: &str) -> Request {
        Request {
            method: "POST".into(),
            path: "/sleep".into(),
            query: query.map(str::to_string),
            headers: Vec::new(),
            body: body.as_bytes().to_vec(),
            arrived: std::time::Instant::now(),
        }
    }

    #[test]
    fn the_level_comes_from_the_query_or_the_body_and_bad_ones_name_the_field() {
        assert_eq!(level(&req(None, "")).unwrap(), 1);
        assert_eq!(level(&req(Some("level=2"), "")).unwrap(), 2);
        assert_eq!(level(&req(None, r#"{"level": 2}"#)).unwrap(), 2);
        assert_eq!(level(&req(Some("level=1"), r#"{"level": 1}"#)).unwrap(), 1);
        for (q, body, param) in [
            (Some("level=3"), "", "level"),
            (Some("level=x"), "", "level"),
            (None, r#"{"level": 0}"#, "level"),
            (None, r#"{"level": "1"}"#, "level"),
            (None, r#"{"level": -1}"#, "level"),
            (None, r#"{"levels": 1}"#, "levels"),
            (Some("lvl=1"), "", "lvl"),
            (Some("level=1"), r#"{"level": 2}"#, "level"),
            (None, "[1]", "body"),
            (None, "{", "body"),
        ] {
            let e = level(&req(q, body)).unwrap_err();
            assert_eq!(e.status, 400, "{q:?} {body}");
            assert_eq!(e.param.as_deref(), Some(param), "{q:?} {body}: {e}");
            assert!(e.message.contains(param), "{q:?} {body}: {e}");
        }
    }
}

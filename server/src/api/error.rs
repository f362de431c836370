//! The API layer's error: an HTTP status, a machine-readable kind, a message naming the field
//! and the problem, rendered in the llm-serving shape or in OpenAI's error shape.

use crate::http::Response;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// OpenAI's machine-readable `code` (e.g. "model_not_found"); None: the HTTP status.
    pub code: Option<&'static str>,
}

/// Which error body shape a route uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error": message, "type": kind}` (llm-serving routes, /health, ...).
    Plain,
    /// `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// Anthropic's `{"type": "error", "error": {"type", "message"}}` (/v1/messages).
    Anthropic,
}

impl ApiError {
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 400 about one request field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// 404 for a `model` this server does not serve, in the shape OpenAI clients expect.
    pub fn model_not_found(name: &str, served: &[String]) -> Self {
        Self {
            status: 404,
            kind: "invalid_request_error",
            message: format!(
                "The model `{name}` does not exist: this server serves {}",
                served
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn response(&self, shape: ErrorShape) -> Response {
        let resp = render_error(
            shape,
            self.status,
            self.kind,
            &self.message,
            self.param.as_deref(),
        );
        match (shape, self.code) {
            (ErrorShape::OpenAi, Some(code)) => Response::json(
                self.status,
                &serde_json::json!({
                    "error": {
                        "message": self.message,
                        "type": self.kind,
                        "param": self.param,
                        "code": code,
                    }
                }),
            ),
            _ => resp,
        }
    }
}

pub(crate) fn render_error(
    shape: ErrorShape,
    status: u16,
    kind: &str,
    message: &str,
    param: Option<&str>,
) -> Response {
    match shape {
        ErrorShape::Plain => Response::error(status, kind, message),
        ErrorShape::Anthropic => super::anthropic::error_response(status, kind, message),
        ErrorShape::OpenAi => Response::json(
            status,
            &serde_json::json!({
                "error": {
                    "message": message,
                    "type": kind,
                    "param": param,
                    "code": status,
                }
            }),
        ),
    }
}

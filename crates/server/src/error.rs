//! [`ApiError`]: every way a request fails, with its HTTP status decided in one place
//! ([`status_of`]) and written in OpenAI's or Anthropic's error envelope.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// The class of a failed request; it alone decides the HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is malformed, names an unsupported field, or cannot be served as asked.
    InvalidRequest,
    /// A missing or wrong API key.
    Authentication,
    /// An unknown model or route.
    NotFound,
    /// The model's queue is full; retry later.
    Overloaded,
    /// The model cannot be loaded or is not loaded (and autoload is off).
    Unavailable,
    /// A failure inside the engine.
    Internal,
}

/// The HTTP status of each error class: the one mapping from errors to statuses.
pub fn status_of(kind: ErrorKind) -> StatusCode {
    match kind {
        ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
        ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
        ErrorKind::NotFound => StatusCode::NOT_FOUND,
        ErrorKind::Overloaded | ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// A failed request: its class, a message for the client and the offending parameter.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// The class (decides the status).
    pub kind: ErrorKind,
    /// What went wrong, and the fix when there is one.
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
}

impl ApiError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError { kind, message: message.into(), param: None }
    }

    /// A bad request.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::InvalidRequest, message)
    }

    /// A bad request naming the field at fault.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError { kind: ErrorKind::InvalidRequest, message: message.into(), param: Some(param.to_string()) }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        status_of(self.kind)
    }

    /// OpenAI's `error.type` and `error.code`.
    fn openai_type_code(&self) -> (&'static str, &'static str) {
        match self.kind {
            ErrorKind::InvalidRequest => ("invalid_request_error", "invalid_request"),
            ErrorKind::Authentication => ("authentication_error", "invalid_api_key"),
            ErrorKind::NotFound => ("not_found_error", "model_not_found"),
            ErrorKind::Overloaded => ("server_error", "overloaded"),
            ErrorKind::Unavailable => ("server_error", "model_unavailable"),
            ErrorKind::Internal => ("server_error", "internal_error"),
        }
    }

    /// The body in OpenAI's envelope: `{"error": {message, type, param, code}}`.
    pub fn openai_body(&self) -> Value {
        let (ty, code) = self.openai_type_code();
        json!({"error": {"message": self.message, "type": ty, "param": self.param, "code": code}})
    }

    /// The body in Anthropic's envelope: `{"type": "error", "error": {type, message}}`.
    pub fn anthropic_body(&self) -> Value {
        let ty = match self.kind {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::Overloaded => "overloaded_error",
            ErrorKind::Unavailable | ErrorKind::Internal => "api_error",
        };
        json!({"type": "error", "error": {"type": ty, "message": self.message}})
    }
}

impl From<plan::PlanError> for ApiError {
    fn from(e: plan::PlanError) -> ApiError {
        let kind = match e.code() {
            "request" | "template" | "tokenizer" => ErrorKind::InvalidRequest,
            "budget" | "no_backend" | "no_device" | "closed" | "architecture" | "not_a_model" | "bad_file" => {
                ErrorKind::Unavailable
            }
            _ => ErrorKind::Internal,
        };
        ApiError::new(kind, e.to_string())
    }
}

impl From<tokenizer::TemplateError> for ApiError {
    fn from(e: tokenizer::TemplateError) -> ApiError {
        ApiError::invalid(format!("the chat template failed on this request: {e}"))
    }
}

impl From<tokenizer::TokenizerError> for ApiError {
    fn from(e: tokenizer::TokenizerError) -> ApiError {
        ApiError::invalid(format!("the text cannot be tokenized: {e}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.openai_body())).into_response()
    }
}

/// An [`ApiError`] answered in Anthropic's envelope (the `/v1/messages` routes).
#[derive(Debug)]
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> AnthropicError {
        AnthropicError(e)
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        (self.0.status(), axum::Json(self.0.anthropic_body())).into_response()
    }
}

/// Parses a JSON body into `T`, turning serde's message (which names unknown fields and the
/// expected ones) into a bad-request error instead of axum's plain-text rejection.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("bad request body: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_kind() {
        assert_eq!(status_of(ErrorKind::InvalidRequest), StatusCode::BAD_REQUEST);
        assert_eq!(status_of(ErrorKind::Overloaded), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status_of(ErrorKind::Authentication), StatusCode::UNAUTHORIZED);
    }

    #[test]
    fn envelopes_have_the_documented_shape() {
        let e = ApiError::invalid_param("n", "n must be 1");
        let o = e.openai_body();
        assert_eq!(o["error"]["type"], "invalid_request_error");
        assert_eq!(o["error"]["param"], "n");
        let a = e.anthropic_body();
        assert_eq!(a["type"], "error");
        assert_eq!(a["error"]["message"], "n must be 1");
    }
}

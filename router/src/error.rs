//! The router's errors and the one place they become HTTP statuses and OpenAI error bodies.

use crate::api::error::{ErrorBody, ErrorObject};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// How error bodies look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ErrorFormat {
    /// `{"error": {"message", "type", "param", "code"}}`.
    Openai,
    /// The hosted provider's (seed 003): `{"code", "result": null, "message"}`.
    Provider,
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("the request body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("the request body is larger than {0} bytes")]
    BodyTooLarge(usize),
    #[error("the request body is too complex: {0}")]
    BodyTooComplex(String),
    #[error("the request body did not arrive within {0} ms")]
    BodyTimeout(u64),
    #[error("{message}")]
    InvalidParam {
        param: &'static str,
        message: String,
    },
    /// A field this server does not know and does not list as harmless; OpenAI's words.
    #[error("Unrecognized request argument supplied: {0}")]
    UnknownParam(String),
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    #[error("no route for {0}")]
    NoRoute(String),
    #[error("the prompt has {got} tokens, the limit is {limit}")]
    PromptTooLong {
        param: &'static str,
        got: usize,
        limit: usize,
    },
    #[error("the request needs KV memory for {positions} positions (its prompt and max_tokens) for each of {sequences} sequences, and the largest decode node holds {largest} positions in all; lower max_tokens or n")]
    NeverFits {
        param: &'static str,
        positions: usize,
        sequences: usize,
        largest: u64,
    },
    #[error(
        "{param} asks for {sequences} sequences and the decode nodes run at most {widest} at \
         once (their --max-batch-size)"
    )]
    TooWide {
        param: &'static str,
        sequences: usize,
        widest: u32,
    },
    #[error("the model has no chat template")]
    NoChatTemplate,
    #[error("the chat template failed: {0}")]
    Template(String),
    #[error("no {0} worker is ready: none is registered, or every one is down or cooling off after failures")]
    NoWorkers(&'static str),
    #[error("{role} worker {addr} is unavailable: {message}")]
    WorkerUnavailable {
        role: &'static str,
        addr: String,
        message: String,
    },
    #[error("{role} worker {addr} is at capacity: {message}")]
    WorkerBusy {
        role: &'static str,
        addr: String,
        message: String,
    },
    #[error("{role} worker {addr} failed: {status}")]
    Worker {
        role: &'static str,
        addr: String,
        status: tonic::Status,
    },
    #[error("authorization not passed: send the API key as `Authorization: Bearer <key>`")]
    MissingApiKey,
    #[error("the API key is not valid")]
    BadApiKey,
    #[error("insufficient balance: the API key has used {used} of its {quota} tokens")]
    QuotaExceeded { used: u64, quota: u64 },
    #[error("insufficient balance: this request may use up to {need} tokens (its prompt and max_tokens for each sequence) and the API key has {left} of its {quota} left; lower max_tokens")]
    QuotaTooSmall { need: u64, left: u64, quota: u64 },
    #[error("the router is at its limit of {0} requests in flight; retry shortly")]
    Overloaded(usize),
    #[error("the API key is at its limit of {0} requests in flight; retry shortly")]
    KeyBusy(usize),
    #[error("the router is at its limit of {0} open streams; retry shortly")]
    TooManyStreams(usize),
    #[error("the request did not finish within {0} ms")]
    Timeout(u64),
    #[error("internal error: {0}")]
    Internal(String),
    #[error("TLS: {0}")]
    Tls(#[from] tls::TlsError),
}

impl RouterError {
    /// A 400 naming the parameter.
    pub fn param(param: &'static str, message: impl Into<String>) -> Self {
        Self::InvalidParam {
            param,
            message: message.into(),
        }
    }

    /// A failed worker call, classed by its gRPC status.
    pub fn worker(role: &'static str, addr: &str, status: tonic::Status) -> Self {
        use tonic::Code;
        // The channel (`runtime::Channel`) reports a call it could not send or finish on the
        // wire (the worker died under it, stopped answering) as Unavailable: the worker is
        // unavailable, not wrong.
        match status.code() {
            Code::ResourceExhausted => Self::WorkerBusy {
                role,
                addr: addr.to_string(),
                message: status.message().to_string(),
            },
            Code::Unavailable | Code::Cancelled => Self::WorkerUnavailable {
                role,
                addr: addr.to_string(),
                message: status.message().to_string(),
            },
            _ => Self::Worker {
                role,
                addr: addr.to_string(),
                status,
            },
        }
    }

    /// True for a worker that could not take or finish the call (down, cut off, draining,
    /// full): another worker may well succeed.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            RouterError::WorkerUnavailable { .. } | RouterError::WorkerBusy { .. }
        )
    }

    /// The HTTP status this error is answered with.
    pub fn http_status(&self) -> StatusCode {
        use RouterError::*;
        match self {
            InvalidJson(_)
            | InvalidParam { .. }
            | UnknownParam(_)
            | PromptTooLong { .. }
            | NeverFits { .. }
            | TooWide { .. }
            | NoChatTemplate
            | Template(_) => StatusCode::BAD_REQUEST,
            BodyTooLarge(_) | BodyTooComplex(_) => StatusCode::PAYLOAD_TOO_LARGE,
            BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ModelNotFound(_) | NoRoute(_) => StatusCode::NOT_FOUND,
            NoWorkers(_) | WorkerUnavailable { .. } | WorkerBusy { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Worker { status, .. } => match status.code() {
                tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
                tonic::Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
                _ => StatusCode::BAD_GATEWAY,
            },
            MissingApiKey | BadApiKey => StatusCode::UNAUTHORIZED,
            QuotaExceeded { .. } | QuotaTooSmall { .. } | KeyBusy(_) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Overloaded(_) | TooManyStreams(_) => StatusCode::SERVICE_UNAVAILABLE,
            Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Internal(_) | Tls(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The error body in `format`.
    pub fn body_in(&self, format: ErrorFormat) -> ErrorBody {
        match format {
            ErrorFormat::Openai => self.body(),
            ErrorFormat::Provider => {
                use RouterError::*;
                // 003's codes.
                let code = match self {
                    QuotaExceeded { .. } | QuotaTooSmall { .. } => 701,
                    MissingApiKey => 702,
                    BadApiKey => 801,
                    // 802 "Request timeout": the router's deadline, a body that never
                    // came, or a worker's deadline.
                    Timeout(_) | BodyTimeout(_) => 802,
                    Worker { status, .. } if status.code() == tonic::Code::DeadlineExceeded => 802,
                    _ => 9999,
                };
                ErrorBody::Provider {
                    code,
                    result: None,
                    message: self.public_message(),
                }
            }
        }
    }

    /// Seconds a client should wait before retrying, for the errors that say "busy".
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            RouterError::Overloaded(_)
            | RouterError::KeyBusy(_)
            | RouterError::TooManyStreams(_) => Some(1),
            RouterError::WorkerUnavailable { .. } | RouterError::WorkerBusy { .. } => Some(1),
            _ => None,
        }
    }

    /// The response for this error in `format`; logs it once.
    pub fn response_in(self, format: ErrorFormat) -> Response {
        let status = self.http_status();
        let retry = self.retry_after();
        if status.is_server_error() {
            tracing::error!(error = %self, status = status.as_u16(), "request failed");
        } else {
            tracing::debug!(error = %self, status = status.as_u16(), "request rejected");
        }
        let mut response = (status, axum::Json(self.body_in(format))).into_response();
        if let Some(secs) = retry {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }

    /// The OpenAI error object, `{"error": {...}}`.
    pub fn body(&self) -> ErrorBody {
        use RouterError::*;
        let param = match self {
            InvalidParam { param, .. }
            | PromptTooLong { param, .. }
            | NeverFits { param, .. }
            | TooWide { param, .. } => Some(param.to_string()),
            UnknownParam(name) => Some(name.clone()),
            ModelNotFound(_) => Some("model".into()),
            NoChatTemplate | Template(_) => Some("messages".into()),
            _ => None,
        };
        let status = self.http_status();
        let (kind, code) = match self {
            ModelNotFound(_) => ("invalid_request_error", Some("model_not_found")),
            NoRoute(_) => ("invalid_request_error", Some("not_found")),
            MissingApiKey | BadApiKey => ("authentication_error", Some("invalid_api_key")),
            // OpenAI's answer for a spent quota.
            QuotaExceeded { .. } | QuotaTooSmall { .. } => {
                ("insufficient_quota", Some("insufficient_quota"))
            }
            KeyBusy(_) => ("rate_limit_exceeded", Some("rate_limit_exceeded")),
            _ if status.is_client_error() => ("invalid_request_error", None),
            _ if status == StatusCode::SERVICE_UNAVAILABLE => ("service_unavailable", None),
            _ => ("server_error", None),
        };
        ErrorBody::Openai {
            error: ErrorObject {
                message: self.public_message(),
                kind,
                param,
                code,
            },
        }
    }

    /// The message a client is shown: the log's, less what is internal to the cluster
    /// (worker addresses, transport errors, file paths), which stays in the router's log.
    /// A worker's refusal of the request itself (INVALID_ARGUMENT) and a full worker's
    /// reason are kept: they tell the client what to change or that it may retry.
    pub fn public_message(&self) -> String {
        use RouterError::*;
        match self {
            WorkerUnavailable { role, .. } => {
                format!("the {role} worker is unavailable; retry shortly")
            }
            WorkerBusy { role, message, .. } => {
                format!("the {role} worker is at capacity: {message}")
            }
            Worker { role, status, .. } if status.code() == tonic::Code::InvalidArgument => {
                format!(
                    "the {role} worker refused the request: {}",
                    status.message()
                )
            }
            Worker { role, status, .. } => {
                format!("the {role} worker failed: {}", status.code().description())
            }
            Internal(_) | Tls(_) => "internal error; the router's log has the details".to_string(),
            _ => self.to_string(),
        }
    }
}

impl IntoResponse for RouterError {
    fn into_response(self) -> Response {
        self.response_in(ErrorFormat::Openai)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seed 003's code table: "802 | Request timeout", and 9999 for the rest.
    #[test]
    fn every_timeout_is_802_in_the_provider_format() {
        let code = |e: RouterError| match e.body_in(ErrorFormat::Provider) {
            ErrorBody::Provider { code, .. } => code,
            other => panic!("{other:?}"),
        };
        let late = tonic::Status::deadline_exceeded("the KV cache did not arrive");
        assert_eq!(code(RouterError::worker("decode", "10.0.0.1:1", late)), 802);
        assert_eq!(code(RouterError::Timeout(5)), 802);
        assert_eq!(code(RouterError::BodyTimeout(5)), 802);
        assert_eq!(code(RouterError::NoRoute("/v2/x".into())), 9999);
        assert_eq!(RouterError::NoRoute("/v2/x".into()).http_status(), 404);
    }

    #[test]
    fn error_bodies_keep_the_cluster_s_addresses_to_the_log() {
        let addr = "10.1.2.3:50051";
        let cases = [
            RouterError::worker(
                "decode",
                addr,
                tonic::Status::unavailable(format!("transport error: connecting to {addr}")),
            ),
            RouterError::worker(
                "prefill",
                addr,
                tonic::Status::failed_precondition(format!("{addr} is not a decode worker")),
            ),
            RouterError::Internal(format!("decode worker {addr} answered oddly")),
        ];
        for e in cases {
            assert!(e.to_string().contains(addr), "the log keeps it: {e}");
            for format in [ErrorFormat::Openai, ErrorFormat::Provider] {
                let body = e.body_in(format).to_json();
                assert!(!body.contains("10.1.2.3"), "{body}");
            }
        }
        let busy = RouterError::worker(
            "decode",
            addr,
            tonic::Status::resource_exhausted("the KV budget is taken"),
        );
        let message = |e: &RouterError| match e.body() {
            ErrorBody::Openai { error } => error.message,
            other => panic!("the OpenAI format: {other:?}"),
        };
        assert_eq!(
            message(&busy),
            "the decode worker is at capacity: the KV budget is taken"
        );
        let refused = RouterError::worker(
            "prefill",
            addr,
            tonic::Status::invalid_argument("token id 99999 is outside the vocabulary"),
        );
        assert_eq!(refused.http_status(), StatusCode::BAD_REQUEST);
        assert!(message(&refused).ends_with("token id 99999 is outside the vocabulary"));
    }
}

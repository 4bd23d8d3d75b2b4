//! Errors of the decode node and their gRPC status.

/// Why a transfer or a generation failed.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("the KV cache of request {0} did not arrive within {1} ms")]
    KvTimeout(String, u64),
    #[error("the KV transfer of request {id} failed: {reason}")]
    TransferFailed { id: String, reason: String },
    #[error("bad KV transfer: {0}")]
    BadTransfer(String),
    #[error("request {0} is already waiting for its KV cache")]
    Duplicate(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("the decode node is shutting down")]
    ShuttingDown,
    #[error("engine: {0}")]
    Engine(#[from] engine::EngineError),
}

impl From<DecodeError> for tonic::Status {
    fn from(e: DecodeError) -> Self {
        use DecodeError::*;
        let msg = e.to_string();
        match e {
            KvTimeout(..) => tonic::Status::deadline_exceeded(msg),
            TransferFailed { .. } => tonic::Status::aborted(msg),
            BadTransfer(_) | InvalidRequest(_) => tonic::Status::invalid_argument(msg),
            Duplicate(_) => tonic::Status::already_exists(msg),
            ShuttingDown => tonic::Status::unavailable(msg),
            Engine(engine::EngineError::ContextOverflow { .. })
            | Engine(engine::EngineError::InvalidInput(_))
            | Engine(engine::EngineError::KvCache(_)) => tonic::Status::invalid_argument(msg),
            Engine(_) => tonic::Status::internal(msg),
        }
    }
}

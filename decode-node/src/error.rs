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
    #[error("the KV transfer presents no ticket this node issued for its request")]
    BadTicket,
    #[error("the KV transfer asks for more than its ticket reserved: {0}")]
    BeyondReservation(String),
    #[error("the KV transfer was not received within {0} ms")]
    TransferDeadline(u64),
    #[error("nothing arrived on the KV transfer for {0} ms")]
    Quiet(u64),
    #[error("the request stopped waiting for its KV cache")]
    Abandoned,
    #[error("request {0} is already waiting for its KV cache")]
    Duplicate(String),
    #[error(
        "prompt plus max tokens need {blocks} KV blocks and the decode node has {capacity} in all"
    )]
    TooLarge { blocks: usize, capacity: usize },
    #[error(
        "{sequences} sequences asked for; this decode node runs at most {max_batch} a step \
         (--max-batch-size)"
    )]
    TooWide { sequences: usize, max_batch: usize },
    #[error("the decode node's KV budget is taken and {0} requests already wait for it")]
    QueueFull(usize),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The request asks for what no node runs: the sender's mistake.
    #[error("invalid request: {0}")]
    Request(#[from] intake::RequestError),
    /// The request's grammar failed while generating: the request's doing, not the node's.
    #[error("the request's grammar failed: {0}")]
    Grammar(String),
    #[error("the decode node is shutting down")]
    ShuttingDown,
    #[error("internal: {0}")]
    Internal(String),
    /// A decode step failed: every sequence in it fails with this.
    #[error("decode step failed: {0}")]
    StepFailed(engine::EngineError),
    #[error("engine: {0}")]
    Engine(#[from] engine::EngineError),
}

impl From<DecodeError> for tonic::Status {
    fn from(e: DecodeError) -> Self {
        use proto::v1::ErrorReason as R;
        use tonic::Code;
        use DecodeError::*;
        let (code, reason) = match &e {
            KvTimeout(..) => (Code::DeadlineExceeded, R::KvNotReceived),
            TransferDeadline(_) | Quiet(_) => (Code::DeadlineExceeded, R::KvTransfer),
            TransferFailed { .. } => (Code::Aborted, R::KvNotReceived),
            BadTransfer(_) => (Code::InvalidArgument, R::KvTransfer),
            InvalidRequest(_) | Request(_) | Grammar(_) => {
                (Code::InvalidArgument, R::InvalidRequest)
            }
            TooLarge { .. } => (Code::InvalidArgument, R::KvTooLarge),
            TooWide { .. } => (Code::InvalidArgument, R::InvalidRequest),
            BadTicket | BeyondReservation(_) => (Code::PermissionDenied, R::KvTransfer),
            Duplicate(_) => (Code::AlreadyExists, R::InvalidRequest),
            QueueFull(_) => (Code::ResourceExhausted, R::QueueFull),
            ShuttingDown => (Code::Unavailable, R::ShuttingDown),
            Abandoned => (Code::Cancelled, R::Cancelled),
            Internal(_) | StepFailed(_) => (Code::Internal, R::Internal),
            Engine(e) if e.is_request_fault() => (Code::InvalidArgument, R::InvalidRequest),
            Engine(_) => (Code::Internal, R::Internal),
        };
        proto::error_status(code, e.to_string(), reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::EngineError as E;
    use proto::v1::ErrorReason;

    fn reason(e: DecodeError) -> (tonic::Code, ErrorReason) {
        let s = tonic::Status::from(e);
        (s.code(), proto::error_reason(&s))
    }

    #[test]
    fn engine_errors_map_by_whose_fault_they_are() {
        let request = (tonic::Code::InvalidArgument, ErrorReason::InvalidRequest);
        let internal = (tonic::Code::Internal, ErrorReason::Internal);
        let overflow = E::ContextOverflow { got: 9, limit: 8 };
        assert_eq!(reason(DecodeError::Engine(overflow)), request);
        assert_eq!(reason(DecodeError::Engine(E::BadKv("x".into()))), request);
        // The node's own caches disagreeing is no request's fault.
        assert_eq!(
            reason(DecodeError::Engine(E::KvCache("x".into()))),
            internal
        );
        let failed = DecodeError::StepFailed(E::InvalidInput("x".into()));
        assert_eq!(failed.to_string(), "decode step failed: invalid input: x");
        assert_eq!(reason(failed), internal);
    }
}

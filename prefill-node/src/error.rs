//! Errors of the prefill node and their gRPC status.

/// Why a prefill failed.
#[derive(Debug, thiserror::Error)]
pub enum PrefillError {
    /// The request asks for what no node runs: the sender's mistake.
    #[error(transparent)]
    Request(#[from] intake::RequestError),
    #[error("grammar: {0}")]
    Grammar(engine::grammar::GrammarError),
    #[error("no decode node address was given")]
    NoDecodeAddr,
    #[error("decode node {0} is neither listed (--decode-nodes) nor registered in etcd as a decode worker")]
    UnknownDecode(String),
    #[error(
        "no KV ticket was given: the decode node issues one when it reserves the request's memory"
    )]
    NoTicket,
    #[error("the prefill queue is full ({0} prompts)")]
    QueueFull(usize),
    #[error("the prefill node is shutting down")]
    ShuttingDown,
    #[error("the request was cancelled")]
    Cancelled,
    #[error("engine: {0}")]
    Engine(#[from] engine::EngineError),
    /// A prefill step failed: every prompt in it fails with this.
    #[error("the prefill step failed: {0}")]
    StepFailed(String),
    #[error("the decode node closed the KV transfer")]
    TransferClosed,
    #[error("KV transfer to {addr} failed: {status}")]
    Transfer { addr: String, status: tonic::Status },
}

impl From<PrefillError> for tonic::Status {
    fn from(e: PrefillError) -> Self {
        use proto::v1::ErrorReason as R;
        use tonic::Code;
        use PrefillError::*;
        let (code, reason) = match &e {
            Request(_) | Grammar(_) | NoDecodeAddr | NoTicket => {
                (Code::InvalidArgument, R::InvalidRequest)
            }
            UnknownDecode(_) => (Code::FailedPrecondition, R::UnknownDecodeNode),
            QueueFull(_) => (Code::ResourceExhausted, R::QueueFull),
            // The decode node judged the KV itself bad, or a message broke the gRPC size
            // bound: another pair would fail the same way, so this is no outage to retry.
            Transfer { status, .. }
                if matches!(status.code(), Code::InvalidArgument | Code::OutOfRange) =>
            {
                (Code::Internal, R::KvTransfer)
            }
            TransferClosed | Transfer { .. } => (Code::Unavailable, R::KvTransfer),
            ShuttingDown => (Code::Unavailable, R::ShuttingDown),
            Cancelled => (Code::Cancelled, R::Cancelled),
            StepFailed(_) => (Code::Internal, R::Internal),
            Engine(e) if e.is_request_fault() => (Code::InvalidArgument, R::InvalidRequest),
            Engine(_) => (Code::Internal, R::Internal),
        };
        proto::error_status(code, e.to_string(), reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::v1::ErrorReason;
    use PrefillError::*;

    fn reason(e: PrefillError) -> (tonic::Code, ErrorReason) {
        let s = tonic::Status::from(e);
        (s.code(), proto::error_reason(&s))
    }

    #[test]
    fn a_failed_transfer_says_so_whatever_its_code() {
        let refused = Transfer {
            addr: "d:1".into(),
            status: tonic::Status::invalid_argument("bad chunk"),
        };
        assert_eq!(
            reason(refused),
            (tonic::Code::Internal, ErrorReason::KvTransfer)
        );
        let cut = Transfer {
            addr: "d:1".into(),
            status: tonic::Status::unavailable("reset"),
        };
        assert_eq!(
            reason(cut),
            (tonic::Code::Unavailable, ErrorReason::KvTransfer)
        );
        assert_eq!(
            reason(TransferClosed),
            (tonic::Code::Unavailable, ErrorReason::KvTransfer)
        );
        assert_eq!(
            reason(ShuttingDown),
            (tonic::Code::Unavailable, ErrorReason::ShuttingDown)
        );
        assert_eq!(
            reason(QueueFull(3)),
            (tonic::Code::ResourceExhausted, ErrorReason::QueueFull)
        );
    }

    #[test]
    fn engine_errors_map_by_whose_fault_they_are() {
        use engine::EngineError as E;
        let request = (tonic::Code::InvalidArgument, ErrorReason::InvalidRequest);
        let internal = (tonic::Code::Internal, ErrorReason::Internal);
        let overflow = E::ContextOverflow { got: 9, limit: 8 };
        assert_eq!(reason(Engine(overflow)), request);
        assert_eq!(reason(Engine(E::BadKv("x".into()))), request);
        assert_eq!(reason(Engine(E::KvCache("x".into()))), internal);
        // A failed step is the node's, whatever the engine said.
        assert_eq!(reason(StepFailed("KV cache: x".into())), internal);
    }
}

//! Errors of the prefill node and their gRPC status.

/// Why a prefill failed.
#[derive(Debug, thiserror::Error)]
pub enum PrefillError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {got} tokens, the model's context is {limit}")]
    PromptTooLong { got: usize, limit: usize },
    #[error("{0} sequences asked for, the limit is 128")]
    TooManySequences(u32),
    #[error("{0} alternatives per token asked for, the limit is {max}", max = engine::sampling::MAX_TOP_LOGPROBS)]
    TooManyLogprobs(u32),
    #[error("no decode node address was given")]
    NoDecodeAddr,
    #[error("decode node {0} is neither listed (--decode-nodes) nor registered in etcd as a decode worker")]
    UnknownDecode(String),
    #[error(
        "no KV ticket was given: the decode node issues one when it reserves the request's memory"
    )]
    NoTicket,
    #[error("prompt token {token} at position {at} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, at: usize, vocab: usize },
    #[error("the prefill queue is full ({0} prompts)")]
    QueueFull(usize),
    #[error("the prefill node is shutting down")]
    ShuttingDown,
    #[error("the request was cancelled")]
    Cancelled,
    #[error("engine: {0}")]
    Engine(#[from] engine::EngineError),
    #[error("the decode node closed the KV transfer")]
    TransferClosed,
    #[error("KV transfer to {addr} failed: {status}")]
    Transfer { addr: String, status: tonic::Status },
}

impl From<PrefillError> for tonic::Status {
    fn from(e: PrefillError) -> Self {
        use PrefillError::*;
        let msg = e.to_string();
        match e {
            EmptyPrompt
            | PromptTooLong { .. }
            | TooManySequences(_)
            | TooManyLogprobs(_)
            | NoDecodeAddr
            | NoTicket
            | TokenOutOfRange { .. } => tonic::Status::invalid_argument(msg),
            UnknownDecode(_) => tonic::Status::failed_precondition(msg),
            QueueFull(_) => tonic::Status::resource_exhausted(msg),
            // The decode node judged the KV itself bad, or a message broke the gRPC size
            // bound: another pair would fail the same way, so this is no outage to retry.
            Transfer { status, .. }
                if matches!(
                    status.code(),
                    tonic::Code::InvalidArgument | tonic::Code::OutOfRange
                ) =>
            {
                tonic::Status::internal(msg)
            }
            ShuttingDown | TransferClosed | Transfer { .. } => tonic::Status::unavailable(msg),
            Cancelled => tonic::Status::cancelled(msg),
            Engine(engine::EngineError::ContextOverflow { .. })
            | Engine(engine::EngineError::InvalidInput(_)) => tonic::Status::invalid_argument(msg),
            Engine(_) => tonic::Status::internal(msg),
        }
    }
}

//! The engine's one error type; transport crates map it to their own status codes.

use std::path::PathBuf;

/// Everything that can go wrong inside the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid model at {path}: {reason}")]
    InvalidModel { path: PathBuf, reason: String },
    #[error("tensor computation failed: {0}")]
    Tensor(#[from] candle_core::Error),
    #[error(transparent)]
    Text(#[from] text::TextError),
    #[error("KV cache: {0}")]
    KvCache(String),
    #[error("sequence of {got} tokens exceeds the model's {limit} positions")]
    ContextOverflow { got: usize, limit: usize },
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

/// Result alias for engine calls.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

impl EngineError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn invalid_model(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Self::InvalidModel {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

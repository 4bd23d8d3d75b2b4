//! The text layer's one error type; the engine wraps it, the router maps it to a status.

use std::path::PathBuf;

/// Everything that can go wrong reading a model's text side or using it.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid model at {path}: {reason}")]
    InvalidModel { path: PathBuf, reason: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
}

/// Result alias for text-layer calls.
pub type Result<T, E = TextError> = std::result::Result<T, E>;

impl TextError {
    /// A file that could not be read.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// A model file whose contents are not what the text layer can use.
    pub fn invalid_model(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Self::InvalidModel {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

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
    /// The engine's own caches disagree with each other or with the model: a fault inside
    /// the worker.
    #[error("KV cache: {0}")]
    KvCache(String),
    /// A KV cache sent from elsewhere (a layout, a chunk, a transfer) is not what it says:
    /// the sender's fault, not this worker's.
    #[error("KV cache: {0}")]
    BadKv(String),
    #[error("sequence of {got} tokens exceeds the model's {limit} positions")]
    ContextOverflow { got: usize, limit: usize },
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The node's `--device` cannot be opened (`engine::device`).
    #[error("device {device} is unavailable: {reason}")]
    DeviceUnavailable { device: String, reason: String },
    /// The KV cache's element type cannot hold this model's heads on the node's device.
    #[error(
        "a {dtype} KV cache cannot hold heads of {head_dim} values on {device}: Q8_0 caches \
         need heads of a multiple of {} values, on the CPU",
        crate::kv_cache::Q8_0_VALUES
    )]
    KvDtypeUnsupported {
        dtype: &'static str,
        head_dim: usize,
        device: String,
    },
    /// The model's weights and the node's KV reserve do not fit the machine (or the GPU).
    #[error(
        "{path} does not fit: its weights take {} while loading and the KV reserve {}, {} in \
         all, past the {} it has ({source_of_limit}); give the node more memory or a \
         smaller KV budget, or run a smaller or more quantized model",
        crate::footprint::size(*weights),
        crate::footprint::size(*kv),
        crate::footprint::size(weights.saturating_add(*kv)),
        crate::footprint::size(*machine)
    )]
    OutOfMemory {
        path: PathBuf,
        weights: u64,
        kv: u64,
        machine: u64,
        source_of_limit: &'static str,
    },
}

/// Result alias for engine calls.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

impl EngineError {
    /// Whether the input is at fault (the request's tokens or positions, or a KV cache a
    /// peer sent), so that no other worker would do better; otherwise the engine failed.
    /// Both nodes map their engine errors to a status by this alone.
    pub fn is_request_fault(&self) -> bool {
        match self {
            Self::ContextOverflow { .. } | Self::InvalidInput(_) | Self::BadKv(_) => true,
            Self::Io { .. }
            | Self::InvalidModel { .. }
            | Self::Tensor(_)
            | Self::Text(_)
            | Self::KvCache(_)
            | Self::DeviceUnavailable { .. }
            | Self::KvDtypeUnsupported { .. }
            | Self::OutOfMemory { .. } => false,
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bad_input_is_the_request_s_fault() {
        let faults = [
            EngineError::ContextOverflow { got: 9, limit: 8 },
            EngineError::InvalidInput("token 99 of 10".into()),
            EngineError::BadKv("chunk for layer 3 of 2".into()),
        ];
        assert!(faults.iter().all(EngineError::is_request_fault));
        let ours = [
            EngineError::KvCache("cache layout does not match the model".into()),
            EngineError::Tensor(candle_core::Error::Msg("shape".into())),
            EngineError::invalid_model("m.gguf", "no tokenizer"),
        ];
        assert!(!ours.iter().any(EngineError::is_request_fault));
        // The split kept the words a client or a log reads.
        assert_eq!(faults[2].to_string(), "KV cache: chunk for layer 3 of 2");
    }
}

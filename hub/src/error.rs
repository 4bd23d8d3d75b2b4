//! Why a model could not be found or fetched, each with what to do about it.

use std::path::PathBuf;

/// A fetch's failure.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("`{spec}` is neither a file or folder here nor a Hub name: {why}")]
    BadName { spec: String, why: String },
    #[error(
        "the Hub has no model repository {repo}, or it is private and HF_TOKEN is unset or \
         has no access"
    )]
    NotFound { repo: String },
    #[error("{repo} has no revision `{revision}`")]
    RevisionNotFound { repo: String, revision: String },
    #[error(
        "{repo} is gated: accept its terms at {page} and set HF_TOKEN to a token of that \
         account"
    )]
    Gated { repo: String, page: String },
    #[error(
        "the token in HF_TOKEN has no access to gated {repo}: accept its terms at {page} with \
         the token's account"
    )]
    GatedDenied { repo: String, page: String },
    #[error("the Hub refused the token in HF_TOKEN ({status}) for {repo}")]
    BadToken { repo: String, status: u16 },
    #[error("{repo} has no safetensors (model.safetensors or model-*-of-*.safetensors with config.json) and no GGUF file; its files: {files:?}")]
    NoWeights { repo: String, files: Vec<String> },
    #[error("{repo} has no GGUF file of quantization {quant}; its GGUF files: {available:?}")]
    NoSuchQuant {
        repo: String,
        quant: String,
        available: Vec<String>,
    },
    #[error("{repo}: {files:?} match more than one file; name the quantization as it is written in one file's name")]
    AmbiguousQuant { repo: String, files: Vec<String> },
    #[error("{repo}: {files:?} is a split GGUF, which is not loaded; merge it with `llama-gguf-split --merge` and pass the file")]
    SplitGguf { repo: String, files: Vec<String> },
    #[error("{repo}@{revision} is not in the cache at {cache} and HF_HUB_OFFLINE is set: fetch it once online (missing: {missing})")]
    Offline {
        repo: String,
        revision: String,
        cache: PathBuf,
        missing: String,
    },
    #[error("{file} of {repo}: {what} is {got}, the Hub lists {expected}; the download is deleted, run again to fetch it anew")]
    Corrupt {
        repo: String,
        file: String,
        what: &'static str,
        expected: String,
        got: String,
    },
    #[error("{repo} moved to another commit while it was fetched; run again")]
    Moved { repo: String },
    #[error("fetching {file} broke off ({reason}); what arrived is kept, and the next start resumes from it")]
    Interrupted { file: String, reason: String },
    #[error("the Hub's answer for {file} is not understood: {reason}")]
    Protocol { file: String, reason: String },
    #[error("the Hub answered {status} for {url}")]
    Status { url: String, status: u16 },
    #[error("reaching {url}: {reason}")]
    Transport { url: String, reason: String },
    #[error("the Hub's listing of {repo} is not understood: {reason}")]
    Listing { repo: String, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

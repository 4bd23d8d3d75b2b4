//! `POST /v1/completions`: the request.

use serde::Deserialize;

use super::{Obj, Param, Sampling};
use crate::error::RouterError;

/// A text completion request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct CompletionRequest {
    #[serde(flatten)]
    pub sampling: Sampling,
    pub prompt: Param<String>,
    /// Alternatives reported per token, 0 to 5 (an integer here, a boolean in chat).
    pub logprobs: Param<i128>,
    /// Fields this API does not know: accepted and ignored.
    #[serde(flatten)]
    pub extra: Obj,
}

impl CompletionRequest {
    /// The request a body's object holds.
    pub fn from_object(o: Obj) -> Result<Self, RouterError> {
        super::from_object(o)
    }
}

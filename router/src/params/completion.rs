//! A text completion's own parameters: the prompt and logprobs.

use super::{int_in, MAX_CONTENT_CHARS};
use crate::api::completions::CompletionRequest;
use crate::api::Param;
use crate::error::RouterError;

/// A text completion's own parameters.
#[derive(Debug, Clone)]
pub struct Completion {
    pub prompt: String,
    /// `Some(k)`: report each token's logprob and its k best alternatives.
    pub logprobs: Option<usize>,
}

/// Checks `prompt` and the completions-only parameters.
pub fn completion(o: &CompletionRequest) -> Result<Completion, RouterError> {
    let prompt = match &o.prompt {
        Param::Valid(s) if !s.is_empty() => s.clone(),
        Param::Valid(_) => return Err(RouterError::param("prompt", "prompt must not be empty")),
        Param::Null | Param::Invalid => {
            return Err(RouterError::param("prompt", "prompt must be a string"))
        }
        Param::Absent => return Err(RouterError::param("prompt", "prompt is required")),
    };
    if prompt.chars().count() > MAX_CONTENT_CHARS {
        return Err(RouterError::param(
            "prompt",
            format!("prompt is longer than {MAX_CONTENT_CHARS} characters"),
        ));
    }
    Ok(Completion {
        prompt,
        logprobs: int_in(&o.logprobs, "logprobs", 0, 5)?,
    })
}

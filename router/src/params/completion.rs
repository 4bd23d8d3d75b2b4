//! A text completion's own parameters: the prompt (text or token ids), logprobs and echo.

use serde_json::Value;

use super::{int_in, MAX_CONTENT_CHARS};
use crate::api::completions::CompletionRequest;
use crate::api::Param;
use crate::error::RouterError;

/// A completion's prompt as the client gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    /// Token ids, each inside the vocabulary.
    Tokens(Vec<u32>),
}

/// A text completion's own parameters.
#[derive(Debug, Clone)]
pub struct Completion {
    pub prompt: Prompt,
    /// `Some(k)`: report each token's logprob and its k best alternatives.
    pub logprobs: Option<usize>,
    /// Show the prompt before each choice's text (scored, with `logprobs`).
    pub echo: bool,
}

fn bad(message: impl Into<String>) -> RouterError {
    RouterError::param("prompt", message)
}

/// One prompt: a non-empty string, or a non-empty list of token ids below `vocab`.
fn one_prompt(v: &Value, vocab: usize) -> Result<Prompt, RouterError> {
    match v {
        Value::String(s) if s.is_empty() => Err(bad("prompt must not be empty")),
        Value::String(s) if s.chars().count() > MAX_CONTENT_CHARS => Err(bad(format!(
            "prompt is longer than {MAX_CONTENT_CHARS} characters"
        ))),
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(ids) if ids.is_empty() => Err(bad("prompt must not be empty")),
        Value::Array(ids) => {
            super::token_ids(ids, vocab, "prompt", "prompt token ids").map(Prompt::Tokens)
        }
        _ => Err(bad(
            "prompt must be a string, a list of token ids, or a list of one of them",
        )),
    }
}

/// Checks `prompt` and the completions-only parameters, for a model of `vocab` tokens.
pub fn completion(o: &CompletionRequest, vocab: usize) -> Result<Completion, RouterError> {
    let prompt = match &o.prompt {
        Param::Valid(Value::Array(list))
            if list.first().is_some_and(|v| v.is_string() || v.is_array()) =>
        {
            match list.as_slice() {
                [one] => one_prompt(one, vocab)?,
                _ => {
                    return Err(bad(format!(
                        "one prompt per request is served, got {}",
                        list.len()
                    )))
                }
            }
        }
        Param::Valid(v) => one_prompt(v, vocab)?,
        Param::Null | Param::Invalid => return Err(bad("prompt must be a string")),
        Param::Absent => return Err(bad("prompt is required")),
    };
    let echo = o.echo.value("echo")?.copied().unwrap_or(false);
    Ok(Completion {
        prompt,
        logprobs: int_in(&o.logprobs, "logprobs", 0, 5)?,
        echo,
    })
}

//! `POST /v1/completions`: the request, and the choice its responses and chunks carry.

use serde::{Deserialize, Serialize};
use serde_json::Map;

use super::{Obj, Param, Sampling, StopReason};
use crate::error::RouterError;

/// A text completion request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct CompletionRequest {
    #[serde(flatten)]
    pub sampling: Sampling,
    /// A string, or token ids; either may come as a list of one (how batching clients,
    /// lm-eval among them, send a single prompt).
    pub prompt: Param<serde_json::Value>,
    /// Alternatives reported per token, 0 to 5 (an integer here, a boolean in chat).
    pub logprobs: Param<i128>,
    /// The prompt shown before each choice's text, and with `logprobs` scored token by
    /// token (the first one unscored).
    pub echo: Param<bool>,
    /// Fields this API does not know: refused unless harmless (`params::known_fields`).
    #[serde(flatten)]
    pub extra: Obj,
}

impl CompletionRequest {
    /// The request a body's object holds.
    pub fn from_object(o: Obj) -> Result<Self, RouterError> {
        super::from_object(o)
    }
}

/// A choice of a text completion, whole or in a stream chunk.
#[derive(Debug, Serialize)]
pub struct Choice<'a> {
    pub index: usize,
    pub text: &'a str,
    pub logprobs: Option<Logprobs<'a>>,
    /// The stop string or stop token id that ended the text, if one did.
    pub stop_reason: Option<StopReason>,
    pub finish_reason: Option<&'static str>,
}

/// Completion logprobs, in the legacy shape: parallel lists.
#[derive(Debug, Serialize)]
pub struct Logprobs<'a> {
    /// Characters of the choice's text before each token's.
    pub text_offset: Vec<usize>,
    /// The engine's f32s, shown as their f64; null for an echoed prompt's first token,
    /// which nothing before it scores.
    pub token_logprobs: Vec<Option<f64>>,
    pub tokens: Vec<&'a str>,
    /// Per token, its alternatives by their text (the token itself always among them);
    /// null where `token_logprobs` is.
    pub top_logprobs: Vec<Option<Map<String, serde_json::Value>>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_choice_keeps_its_keys_in_order() {
        let choice = Choice {
            index: 0,
            text: " hi",
            logprobs: None,
            stop_reason: Some(StopReason::Token(7)),
            finish_reason: Some("stop"),
        };
        assert_eq!(
            serde_json::to_string(&choice).unwrap(),
            r#"{"index":0,"text":" hi","logprobs":null,"stop_reason":7,"finish_reason":"stop"}"#
        );
    }
}

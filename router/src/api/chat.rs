//! `POST /v1/chat/completions`: the request.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::{Obj, Param, Sampling};
use crate::error::RouterError;

/// A chat completion request.
///
/// Messages stay JSON objects: the chat template reads them as the client wrote them (any
/// field a template knows), and `params::chat` checks the fields the router relies on (role,
/// content, tool calls) and refuses media. `tools` are JSON schemas, passed to the template
/// as they are; `tool_choice` is a string or an object naming a function, checked by shape.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ChatRequest {
    #[serde(flatten)]
    pub sampling: Sampling,
    pub messages: Param<Vec<Value>>,
    pub tools: Param<Vec<Value>>,
    pub tool_choice: Param<Value>,
    pub logprobs: Param<bool>,
    pub top_logprobs: Param<i128>,
    pub chat_template_kwargs: Param<Map<String, Value>>,
    /// Fields this API does not know: accepted and ignored.
    #[serde(flatten)]
    pub extra: Obj,
}

impl ChatRequest {
    /// The request a body's object holds.
    pub fn from_object(o: Obj) -> Result<Self, RouterError> {
        super::from_object(o)
    }
}

//! `POST /v1/chat/completions`: the request, the response and its stream chunks' choices.

use serde::{Deserialize, Serialize};
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
    /// Only true (OpenAI's default) is accepted.
    pub parallel_tool_calls: Param<bool>,
    /// Fields this API does not know: refused unless harmless (`params::known_fields`).
    #[serde(flatten)]
    pub extra: Obj,
}

impl ChatRequest {
    /// The request a body's object holds.
    pub fn from_object(o: Obj) -> Result<Self, RouterError> {
        super::from_object(o)
    }
}

/// A choice of a non-streamed chat response.
#[derive(Debug, Serialize)]
pub struct Choice<'a> {
    pub index: usize,
    pub message: Message<'a>,
    pub logprobs: Option<Logprobs<'a>>,
    pub finish_reason: Option<&'static str>,
}

/// The assistant's message. A message that only calls tools has empty content, as seed
/// 001 shows it (OpenAI writes null).
#[derive(Debug, Serialize)]
pub struct Message<'a> {
    pub role: &'static str,
    pub content: &'a str,
    pub tool_calls: Vec<ToolCall<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<&'a str>,
}

/// A choice of a stream chunk: what one token (or the end) added.
#[derive(Debug, Serialize)]
pub struct ChunkChoice<'a> {
    pub index: usize,
    pub delta: Delta<'a>,
    pub logprobs: Option<Logprobs<'a>>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Serialize)]
pub struct Delta<'a> {
    pub role: &'static str,
    pub content: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall<'a>>>,
}

/// A function call as OpenAI shows it; `index` numbers it in stream deltas.
#[derive(Debug, Serialize)]
pub struct ToolCall<'a> {
    pub id: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: Function<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
}

#[derive(Debug, Serialize)]
pub struct Function<'a> {
    pub name: &'a str,
    /// JSON text.
    pub arguments: &'a str,
}

/// Chat logprobs: one entry per token.
#[derive(Debug, Serialize)]
pub struct Logprobs<'a> {
    pub content: Vec<TokenLogprob<'a>>,
}

#[derive(Debug, Serialize)]
pub struct TokenLogprob<'a> {
    pub token: &'a str,
    /// The engine's f32, shown as its f64.
    pub logprob: f64,
    pub bytes: &'a [u8],
    pub top_logprobs: Vec<TopLogprob<'a>>,
}

#[derive(Debug, Serialize)]
pub struct TopLogprob<'a> {
    pub token: &'a str,
    pub logprob: f64,
    pub bytes: &'a [u8],
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token's chunk choice is what clients have always seen, byte for byte.
    #[test]
    fn a_plain_delta_keeps_its_keys_in_order() {
        for text in [
            "",
            " hello",
            "quote \" and back\\slash",
            "line\nbreak\u{1}",
            "中文 🙂",
        ] {
            let choice = ChunkChoice {
                index: 3,
                delta: Delta {
                    role: "assistant",
                    content: text,
                    reasoning_content: None,
                    tool_calls: None,
                },
                logprobs: None,
                finish_reason: None,
            };
            let quoted = serde_json::to_string(text).unwrap();
            assert_eq!(
                serde_json::to_string(&choice).unwrap(),
                format!(
                    r#"{{"index":3,"delta":{{"role":"assistant","content":{quoted}}},"logprobs":null,"finish_reason":null}}"#
                )
            );
        }
    }
}

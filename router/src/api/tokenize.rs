//! vLLM's tokenizer endpoints: `POST /tokenize`, `POST /detokenize` and
//! `GET /tokenizer_info`, which clients such as lm-eval's remote tokenizer call.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{Obj, Param};
use crate::error::RouterError;

/// A text prompt, or chat messages rendered with the model's template.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct TokenizeRequest {
    /// Optional; when given, the served model's name.
    pub model: Param<String>,
    pub prompt: Param<String>,
    pub messages: Param<Vec<Value>>,
    pub tools: Param<Vec<Value>>,
    pub chat_template_kwargs: Param<Map<String, Value>>,
    /// With messages: end with the assistant's turn opened (true by default).
    pub add_generation_prompt: Param<bool>,
    /// Accepted either way: prompts are run as given, and the tokenizer adds no special
    /// tokens to any of them, so the count is what /v1/completions runs.
    pub add_special_tokens: Param<bool>,
    /// Also return each token as the vocabulary writes it.
    pub return_token_strs: Param<bool>,
    /// Refused unless harmless (`params::known_fields`).
    #[serde(flatten)]
    pub extra: Obj,
}

impl TokenizeRequest {
    pub fn from_object(o: Obj) -> Result<Self, RouterError> {
        super::from_object(o)
    }
}

#[derive(Debug, Serialize)]
pub struct Tokenized {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

/// Token ids back to text.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct DetokenizeRequest {
    pub model: Param<String>,
    pub tokens: Param<Vec<Value>>,
    #[serde(flatten)]
    pub extra: Obj,
}

impl DetokenizeRequest {
    pub fn from_object(o: Obj) -> Result<Self, RouterError> {
        super::from_object(o)
    }
}

#[derive(Debug, Serialize)]
pub struct Detokenized {
    pub prompt: String,
}

/// What a remote tokenizer needs to know: the special tokens as text, the chat template
/// and the context length.
#[derive(Debug, Serialize)]
pub struct TokenizerInfo<'a> {
    pub tokenizer_class: &'static str,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub chat_template: Option<&'a str>,
    pub model_max_length: usize,
}

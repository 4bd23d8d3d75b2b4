//! The HTTP API's messages as types, one module per API: `chat` (/v1/chat/completions),
//! `completions` (/v1/completions) and `models`, with what the two completion APIs share
//! here: the sampling and output fields of a request ([`Sampling`]), and a response's head,
//! usage and MindIE timings. A body is read as a JSON object, then into its request struct;
//! `params` validates the struct into the internal request (`params::Common` and the
//! endpoint's own part), refusing what is wrong with an error that names the parameter.
//! Responses are built from these structs (borrowing the output they show) and serialized
//! once; error bodies are `error::ErrorBody`. The body is parsed within limits on its
//! values and their nesting ([`json`]), before any field is read.
//!
//! Every field is a [`Param`]: absent, null, a value of its declared type, or a value of
//! another type. A wrong type is not a deserialization error: serde's message names no
//! parameter, and the API's errors must, in the words the seeds and clients expect.
//!
//! Unknown fields are kept in each request's `extra`; `params::known_fields` refuses them
//! with a 400 naming the field, except a short list of harmless ones
//! (`params::HARMLESS_FIELDS`). Fields with which other servers read a file or fetch a URL
//! are known, and refused (`params`).

pub mod chat;
pub mod completions;
pub mod error;
pub mod health;
pub mod json;
pub mod models;
pub mod tokenize;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use crate::error::RouterError;

/// A JSON object body.
pub type Obj = Map<String, Value>;

/// One request field as the client sent it.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Param<T> {
    #[default]
    Absent,
    Null,
    Valid(T),
    /// A value that is not a `T`.
    Invalid,
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Param<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Value::deserialize(d)? {
            Value::Null => Param::Null,
            v => T::deserialize(v).map_or(Param::Invalid, Param::Valid),
        })
    }
}

/// The JSON type a field must have, as its error says it ("temperature must be a number").
pub trait Described {
    const WHAT: &'static str;
}

impl Described for f64 {
    const WHAT: &'static str = "a number";
}

impl Described for i128 {
    const WHAT: &'static str = "an integer";
}

impl Described for bool {
    const WHAT: &'static str = "a boolean";
}

impl Described for String {
    const WHAT: &'static str = "a string";
}

impl<T> Param<T> {
    /// Sent with a value, of its type or not: null counts as absent.
    pub fn present(&self) -> bool {
        matches!(self, Param::Valid(_) | Param::Invalid)
    }

    /// The value, `None` when absent or null, and for a value of another type the error
    /// naming `key`.
    pub fn value(&self, key: &'static str) -> Result<Option<&T>, RouterError>
    where
        T: Described,
    {
        match self {
            Param::Absent | Param::Null => Ok(None),
            Param::Valid(v) => Ok(Some(v)),
            Param::Invalid => Err(RouterError::param(
                key,
                format!("{key} must be {}", T::WHAT),
            )),
        }
    }
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The fields both endpoints take: the model, sampling, the token budget and the output's
/// shape (the MindIE and vLLM extensions among them).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Sampling {
    pub model: Param<String>,
    pub stream: Param<bool>,
    pub temperature: Param<f64>,
    pub top_p: Param<f64>,
    pub top_k: Param<i128>,
    pub seed: Param<i128>,
    pub presence_penalty: Param<f64>,
    pub frequency_penalty: Param<f64>,
    pub repetition_penalty: Param<f64>,
    pub max_tokens: Param<i128>,
    /// OpenAI's current name for `max_tokens`; both may be sent only with the same value.
    pub max_completion_tokens: Param<i128>,
    pub n: Param<i128>,
    pub best_of: Param<i128>,
    pub use_beam_search: Param<bool>,
    pub ignore_eos: Param<bool>,
    pub skip_special_tokens: Param<bool>,
    /// Ids that end generation; the elements that are not int32 are ignored (the seeds).
    pub stop_token_ids: Param<Vec<Value>>,
    pub stop: Param<Stop>,
    pub include_stop_str_in_output: Param<bool>,
    /// vLLM's: a choice ends on no stop token or stop string before this many tokens.
    pub min_tokens: Param<i128>,
    /// vLLM's: keep only tokens at least this times as likely as the most likely one.
    pub min_p: Param<f64>,
    /// Token id (as a string) to a bias in [-100, 100] added to its logit.
    pub logit_bias: Param<Obj>,
    /// OpenAI's structured outputs: `text`, `json_object` or `json_schema`; read as JSON
    /// first, so that a schema's references are checked before its shape.
    pub response_format: Param<Value>,
    /// vLLM's: a JSON schema (an object, or one as a string) the output must match.
    pub guided_json: Param<Value>,
    /// vLLM's: a regular expression the whole output must match.
    pub guided_regex: Param<String>,
    /// vLLM's: the output is exactly one of these strings.
    pub guided_choice: Param<Vec<String>>,
    /// Refused: prompts are rendered with the model's own template.
    pub chat_template: Param<Value>,
    /// Refused: the router opens no connection for a request.
    pub web_search_options: Param<Value>,
    /// Only with `stream`.
    pub stream_options: Param<StreamOptions>,
    /// OpenAI's end-user id: accepted, and neither kept nor logged.
    pub user: Param<String>,
}

/// `stream_options`: what a stream adds.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    /// A last chunk with the usage and no choices, as OpenAI sends it.
    pub include_usage: Param<bool>,
    /// Options this server does not know: refused (`params::known_fields`).
    #[serde(flatten)]
    pub extra: Obj,
}

/// What every response and chunk starts with.
#[derive(Debug, Clone, Serialize)]
pub struct Head<'a> {
    pub id: &'a str,
    /// `chat.completion`, `chat.completion.chunk` or `text_completion`.
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
}

/// Token counts, with MindIE's per-token figures.
#[derive(Debug, Clone, Serialize)]
pub struct Usage<'a> {
    pub prompt_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// Sequences in the step of each token.
    pub batch_size: &'a [u32],
    /// Microseconds each token waited before its step.
    pub queue_wait_time: &'a [u64],
    /// Where the prompt was computed, and why (conditional disaggregation).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_placement: Option<PrefillPlacement>,
}

/// Where a request's prompt was computed: `node` is `prefill_node` or `decode_node`,
/// `reason` one of `disaggregated`, `no_room` (a short prompt whose decode node had no
/// room), `short_prompt` or `colocated`. The router's `router_prefill_placements_total`
/// counts the same labels.
#[derive(Debug, Clone, Serialize)]
pub struct PrefillPlacement {
    pub node: &'static str,
    pub reason: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: u32,
}

/// Why a choice stopped, when a stop string or one of the request's stop token ids did it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum StopReason {
    Text(String),
    Token(u32),
}

/// A non-streamed response: the choices, the usage and MindIE's timings.
#[derive(Debug, Serialize)]
pub struct Whole<'a, C> {
    #[serde(flatten)]
    pub head: Head<'a>,
    pub choices: Vec<C>,
    pub usage: Usage<'a>,
    /// Milliseconds of the prompt's computation (to the KV cache acknowledged, under PD).
    pub prefill_time: f64,
    /// Milliseconds of each decode step.
    pub decode_time_arr: &'a [f64],
}

/// A stream chunk that ends a choice, or carries every choice whole (beam search): with
/// the usage once every choice has ended, and the choice's whole text with fullText.
#[derive(Debug, Serialize)]
pub struct Chunk<'a, C> {
    #[serde(flatten)]
    pub head: Head<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub full_text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage<'a>>,
    pub choices: Vec<C>,
    /// Why a stream was cut, in the provider's format (001: on an error "响应输出为空，
    /// err_msg非空", the output empty and err_msg set, with finish_reason stop).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub err_msg: Option<&'a str>,
}

/// A request struct from a body's object. Every field takes any JSON, so this cannot fail
/// on a JSON object; the error path is there for the type system.
pub(crate) fn from_object<T: DeserializeOwned>(o: Obj) -> Result<T, RouterError> {
    serde_json::from_value(Value::Object(o)).map_err(|e| RouterError::InvalidJson(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_field_is_absent_null_of_its_type_or_not() {
        let s: Sampling = from_object(
            json!({"temperature": 0.5, "top_k": "many", "seed": null, "stop": ["a", "b"]})
                .as_object()
                .unwrap()
                .clone(),
        )
        .unwrap();
        assert_eq!(s.temperature, Param::Valid(0.5));
        assert_eq!(s.top_k, Param::Invalid);
        assert_eq!(s.seed, Param::Null);
        assert_eq!(s.top_p, Param::Absent);
        assert_eq!(
            s.stop,
            Param::Valid(Stop::Many(vec!["a".into(), "b".into()]))
        );
        assert!(matches!(
            s.top_k.value("top_k"),
            Err(RouterError::InvalidParam { param: "top_k", message }) if message == "top_k must be an integer"
        ));
        assert_eq!(s.seed.value("seed").unwrap(), None);
    }

    #[test]
    fn integers_are_integers_and_numbers_any_number() {
        let s: Sampling = from_object(
            json!({"max_tokens": 1.5, "n": 2.0, "seed": 18446744073709551615u64, "temperature": 1})
                .as_object()
                .unwrap()
                .clone(),
        )
        .unwrap();
        assert_eq!(s.max_tokens, Param::Invalid);
        assert_eq!(
            s.n,
            Param::Invalid,
            "2.0 is a float in JSON, as serde_json reads it"
        );
        assert_eq!(s.seed, Param::Valid(u64::MAX as i128));
        assert_eq!(s.temperature, Param::Valid(1.0));
    }
}

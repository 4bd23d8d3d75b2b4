//! `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, shaped like vLLM's: a
//! prompt counts here exactly as /v1/completions and /v1/chat/completions run it.

use std::sync::Arc;

use crate::api::json::JsonBudget;
use crate::api::tokenize::{
    DetokenizeRequest, Detokenized, TokenizeRequest, Tokenized, TokenizerInfo,
};
use crate::api::{chat::ChatRequest, Param};
use crate::error::RouterError;
use crate::intake::off_the_io_threads;
use crate::keys::Key;
use crate::openai::read_body;
use crate::params;
use crate::state::AppState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

/// The served model's name, when a request gives one.
fn same_model(state: &AppState, model: &Param<String>) -> Result<(), RouterError> {
    match model.value("model")? {
        Some(m) if *m != state.model_name => Err(RouterError::ModelNotFound(m.clone())),
        _ => Ok(()),
    }
}

/// A tokenize body's answer: its tokens and, when asked for, their vocabulary strings.
fn tokenize_body(state: &AppState, body: Bytes) -> Result<Tokenized, RouterError> {
    let json = JsonBudget::new(state.json_limits);
    let r = TokenizeRequest::from_object(json.object(&body)?)?;
    drop(body);
    params::known_fields(&r.extra, "")?;
    same_model(state, &r.model)?;
    r.add_special_tokens.value("add_special_tokens")?;
    let strs = r.return_token_strs.value("return_token_strs")?.copied() == Some(true);
    let text = match (!r.prompt.present(), !r.messages.present()) {
        (true, true) => {
            return Err(RouterError::param(
                "prompt",
                "prompt or messages is required",
            ))
        }
        (false, false) => {
            return Err(RouterError::param(
                "messages",
                "send prompt or messages, not both",
            ))
        }
        (false, true) => {
            let p = r.prompt.value("prompt")?.cloned().unwrap_or_default();
            if p.chars().count() > params::MAX_CONTENT_CHARS {
                return Err(RouterError::param(
                    "prompt",
                    format!(
                        "prompt is longer than {} characters",
                        params::MAX_CONTENT_CHARS
                    ),
                ));
            }
            p
        }
        (true, false) => {
            let add_generation_prompt = r
                .add_generation_prompt
                .value("add_generation_prompt")?
                .copied()
                .unwrap_or(true);
            let chat = ChatRequest {
                messages: r.messages,
                tools: r.tools,
                chat_template_kwargs: r.chat_template_kwargs,
                ..ChatRequest::default()
            };
            let mut input = params::chat(chat, &json)?.input;
            input.add_generation_prompt = add_generation_prompt;
            let prompt = crate::chat::render(state, &input)?;
            return tokenized(state, crate::chat::encode(state, &prompt)?, strs);
        }
    };
    let tokens = state
        .text
        .tokenizer
        .encode(&text)
        .map_err(|e| RouterError::param("prompt", e.to_string()))?;
    tokenized(state, tokens, strs)
}

/// The answer for `tokens`, with their vocabulary strings when `strs`.
fn tokenized(state: &AppState, tokens: Vec<u32>, strs: bool) -> Result<Tokenized, RouterError> {
    let tokenizer = &state.text.tokenizer;
    Ok(Tokenized {
        count: tokens.len(),
        max_model_len: state.max_seq_len,
        token_strs: strs.then(|| {
            tokens
                .iter()
                .map(|&t| tokenizer.id_token(t).unwrap_or_default())
                .collect()
        }),
        tokens,
    })
}

/// Reads a body, runs `work` on it off the I/O threads when it is large, and answers with
/// its result as JSON, or the error. Like a completion, the request holds an in-flight
/// slot (the router's and its API key's) while it runs, and is counted by `endpoint`.
async fn answer<T: serde::Serialize + Send + 'static>(
    state: Arc<AppState>,
    endpoint: &'static str,
    key: Option<Arc<Key>>,
    request: (HeaderMap, Body),
    work: fn(&AppState, Bytes) -> Result<T, RouterError>,
) -> Response {
    let result = async {
        let _in_flight = state.metrics.start(
            state.cfg.max_in_flight,
            key,
            state.cfg.max_in_flight_per_key,
        )?;
        let body = read_body(&state, request).await?;
        off_the_io_threads(&state, body, work).await
    };
    let response = match result.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => state.error_response(e),
    };
    state.metrics.finished(endpoint, response.status().as_u16());
    response
}

/// `POST /tokenize`: `{"prompt"}` or `{"messages"}` to `{"count", "max_model_len",
/// "tokens", "token_strs"}`.
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    key: Option<Extension<Arc<Key>>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer(
        state,
        "tokenize",
        key.map(|k| k.0),
        (headers, body),
        tokenize_body,
    )
    .await
}

/// A detokenize body's text.
fn detokenize_body(state: &AppState, body: Bytes) -> Result<Detokenized, RouterError> {
    let r = DetokenizeRequest::from_object(JsonBudget::new(state.json_limits).object(&body)?)?;
    params::known_fields(&r.extra, "")?;
    same_model(state, &r.model)?;
    let vocab = state.text.config.vocab_size;
    let ids = match &r.tokens {
        Param::Valid(ids) => params::token_ids(ids, vocab, "tokens", "tokens")?,
        Param::Absent => return Err(RouterError::param("tokens", "tokens is required")),
        Param::Null | Param::Invalid => {
            return Err(RouterError::param(
                "tokens",
                format!("tokens must be a list of token ids in [0, {vocab})"),
            ))
        }
    };
    let prompt = state
        .text
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| RouterError::param("tokens", e.to_string()))?;
    Ok(Detokenized { prompt })
}

/// `POST /detokenize`: `{"tokens"}` to `{"prompt"}`, special tokens written out.
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    key: Option<Extension<Arc<Key>>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer(
        state,
        "detokenize",
        key.map(|k| k.0),
        (headers, body),
        detokenize_body,
    )
    .await
}

/// `GET /tokenizer_info`.
pub async fn tokenizer_info(State(state): State<Arc<AppState>>) -> Response {
    let text = &state.text;
    let name = |id: Option<u32>| id.and_then(|t| text.tokenizer.id_token(t));
    Json(TokenizerInfo {
        tokenizer_class: "PreTrainedTokenizerFast",
        bos_token: name(text.config.bos_token_id),
        eos_token: name(text.config.eos_token_ids.first().copied()),
        pad_token: None,
        chat_template: text.template.as_ref().map(|t| t.source()),
        model_max_length: state.max_seq_len,
    })
    .into_response()
}

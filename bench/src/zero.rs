//! Zero-compute backends for measuring routers alone (bench only, never a serving mode):
//! a prefill and a decode node that speak Tandem's gRPC but run no model, and an
//! OpenAI-style HTTP server that answers every completion with the same prepared bytes, the
//! backend other routers speak to. Each answers as fast as a socket allows, so what a
//! router adds on top of them is the router's own cost.

use std::path::Path;
use std::pin::Pin;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use proto::v1::decode_server::{Decode, DecodeServer};
use proto::v1::prefill_server::{Prefill, PrefillServer};
use proto::v1::{
    generate_event, FinishReason, GenerateEvent, GenerateRequest, HealthReply, HealthRequest,
    PrefillRequest, PrefillResponse, Token, TokenEvent, WorkerLoad,
};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio_stream::Stream;
use tonic::{Request, Response as GrpcResponse, Status};

/// What the zero-compute nodes need from the model: its KV layout (routers check it) and
/// an ordinary token to emit, so that detokenizing stays part of the router's cost.
#[derive(Debug, Clone)]
pub struct ZeroModel {
    layout: proto::v1::KvLayout,
    token: u32,
}

impl ZeroModel {
    /// Reads the config and tokenizer of the model at `path` (no weights).
    pub fn load(path: &Path) -> engine::Result<Self> {
        let text = engine::load_text(path)?;
        let token = text
            .tokenizer
            .encode(" hello")?
            .first()
            .copied()
            .unwrap_or(0);
        Ok(Self {
            layout: proto::layout_to_proto(&engine::KvLayout::for_model(&text.config)),
            token,
        })
    }

    fn health(&self, role: &str) -> HealthReply {
        HealthReply {
            role: role.into(),
            layout: Some(self.layout.clone()),
            draining: false,
            load: Some(WorkerLoad {
                kv_blocks_capacity: 1 << 30,
                kv_blocks_free: 1 << 30,
                kv_block_tokens: 16,
                ..WorkerLoad::default()
            }),
        }
    }

    fn token(&self) -> Token {
        Token {
            id: self.token,
            logprob: 0.0,
            top: Vec::new(),
        }
    }
}

/// A prefill node that answers with first tokens at once and sends no KV cache.
#[derive(Debug, Clone)]
pub struct ZeroPrefill(pub ZeroModel);

#[tonic::async_trait]
impl Prefill for ZeroPrefill {
    async fn prefill(
        &self,
        req: Request<PrefillRequest>,
    ) -> Result<GrpcResponse<PrefillResponse>, Status> {
        let n = req.get_ref().n.max(1) as usize;
        Ok(GrpcResponse::new(PrefillResponse {
            first: vec![self.0.token(); n],
            batch_size: 1,
            ..PrefillResponse::default()
        }))
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<GrpcResponse<HealthReply>, Status> {
        Ok(GrpcResponse::new(self.0.health("prefill")))
    }
}

/// A decode node that streams its whole token budget at once, without waiting for a KV
/// cache (none comes from [`ZeroPrefill`]); in colocated requests it produces the first
/// token too.
#[derive(Debug, Clone)]
pub struct ZeroDecode(pub ZeroModel);

type EventStream = Pin<Box<dyn Stream<Item = Result<GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Decode for ZeroDecode {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<GrpcResponse<EventStream>, Status> {
        let req = req.into_inner();
        if req.beam_width > 0 {
            return Err(Status::unimplemented(
                "the zero-compute node has no beam search",
            ));
        }
        let choices = req.n.max(1);
        let mut events = Vec::new();
        for choice in 0..choices {
            for i in 0..req.max_new_tokens {
                events.push(Ok(GenerateEvent {
                    event: Some(generate_event::Event::Token(TokenEvent {
                        token: Some(self.0.token()),
                        batch_size: 1,
                        from_prefill: req.prefill_here && i == 0,
                        choice,
                        ..TokenEvent::default()
                    })),
                }));
            }
            events.push(Ok(GenerateEvent {
                event: Some(generate_event::Event::Finish(proto::v1::Finish {
                    reason: FinishReason::Length as i32,
                    choice,
                })),
            }));
        }
        Ok(GrpcResponse::new(Box::pin(tokio_stream::iter(events))))
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<GrpcResponse<HealthReply>, Status> {
        Ok(GrpcResponse::new(self.0.health("decode")))
    }
}

/// Serves [`ZeroPrefill`] on `listener` until the process ends.
pub async fn serve_prefill(
    listener: TcpListener,
    model: ZeroModel,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(PrefillServer::new(ZeroPrefill(model)))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await
}

/// Serves [`ZeroDecode`] on `listener` until the process ends.
pub async fn serve_decode(
    listener: TcpListener,
    model: ZeroModel,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(DecodeServer::new(ZeroDecode(model)))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await
}

/// The prepared answers of the zero-compute HTTP backend.
#[derive(Debug, Clone)]
struct Canned {
    model_path: String,
    chat: Bytes,
    chat_stream: Bytes,
    completion: Bytes,
    completion_stream: Bytes,
}

impl Canned {
    fn new(model_name: &str, model_path: &str, tokens: usize) -> Self {
        let text = " hello".repeat(tokens);
        let usage = json!({"prompt_tokens": 16, "completion_tokens": tokens,
                           "total_tokens": 16 + tokens});
        let chat = json!({"id": "zero", "object": "chat.completion", "created": 0,
            "model": model_name, "usage": usage,
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": text}}]});
        let completion = json!({"id": "zero", "object": "text_completion", "created": 0,
            "model": model_name, "usage": usage,
            "choices": [{"index": 0, "finish_reason": "length", "text": text}]});
        let sse = |chunk: &dyn Fn(Option<&str>) -> Value| {
            let mut body = String::new();
            for i in 0..=tokens {
                let piece = (i < tokens).then_some(" hello");
                body.push_str(&format!("data: {}\n\n", chunk(piece)));
            }
            body.push_str("data: [DONE]\n\n");
            Bytes::from(body)
        };
        let chat_stream = sse(&|piece| {
            json!({"id": "zero", "object": "chat.completion.chunk", "created": 0,
                "model": model_name, "choices": [{"index": 0,
                "delta": piece.map_or(json!({}), |p| json!({"content": p})),
                "finish_reason": if piece.is_none() { json!("length") } else { Value::Null }}]})
        });
        let completion_stream = sse(&|piece| {
            json!({"id": "zero", "object": "text_completion", "created": 0,
                "model": model_name, "choices": [{"index": 0, "text": piece.unwrap_or(""),
                "finish_reason": if piece.is_none() { json!("length") } else { Value::Null }}]})
        });
        Self {
            model_path: model_path.into(),
            chat: Bytes::from(chat.to_string()),
            chat_stream,
            completion: Bytes::from(completion.to_string()),
            completion_stream,
        }
    }
}

fn canned(body: &Value, unary: &Bytes, stream: &Bytes) -> Response {
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        (
            [(header::CONTENT_TYPE, "text/event-stream")],
            stream.clone(),
        )
            .into_response()
    } else {
        ([(header::CONTENT_TYPE, "application/json")], unary.clone()).into_response()
    }
}

async fn chat(State(c): State<std::sync::Arc<Canned>>, Json(body): Json<Value>) -> Response {
    canned(&body, &c.chat, &c.chat_stream)
}

async fn completion(State(c): State<std::sync::Arc<Canned>>, Json(body): Json<Value>) -> Response {
    canned(&body, &c.completion, &c.completion_stream)
}

/// What the routers' worker probes read: SGLang's `/server_info` and `/model_info` (the
/// model path leads sglang-router to a local tokenizer, so it fetches nothing).
async fn info(State(c): State<std::sync::Arc<Canned>>) -> Json<Value> {
    Json(
        json!({"model_path": c.model_path, "tokenizer_path": c.model_path,
                "is_generation": true, "served_model_name": c.model_path}),
    )
}

/// Serves the OpenAI-style zero-compute backend on `addr`: every completion is `tokens`
/// copies of " hello", prepared once.
pub async fn serve_openai(
    listener: TcpListener,
    model_name: &str,
    model_path: &str,
    tokens: usize,
) -> std::io::Result<()> {
    let canned = std::sync::Arc::new(Canned::new(model_name, model_path, tokens));
    let models = json!({"object": "list", "data": [{"id": model_name, "object": "model"}]});
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completion))
        .route("/health", get(|| async { "" }))
        .route("/health_generate", get(|| async { "" }))
        .route("/v1/models", get(move || async move { Json(models) }))
        .route("/server_info", get(info))
        .route("/get_server_info", get(info))
        .route("/model_info", get(info))
        .route("/get_model_info", get(info))
        .with_state(canned);
    axum::serve(listener, app).await
}

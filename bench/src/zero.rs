//! Zero-compute backends for measuring routers alone (bench only, never a serving mode):
//! a prefill and a decode node that speak Tandem's gRPC but run no model, and an
//! OpenAI-style HTTP server that answers every completion with the same prepared bytes, the
//! backend other routers speak to. Each answers as fast as a socket allows, so what a
//! router adds on top of them is the router's own cost.

use std::path::Path;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use bytes::{BufMut, BytesMut};
use h2::server::SendResponse;
use h2::RecvStream;
use prost::Message;
use proto::v1::{
    generate_event, FinishReason, GenerateEvent, GenerateRequest, HealthReply, PrefillRequest,
    PrefillResponse, Token, TokenEvent, WorkerLoad,
};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tonic::Status;

/// What the zero-compute nodes need from the model: its name and KV layout (routers check
/// both) and an ordinary token to emit, so that detokenizing stays part of the router's cost.
#[derive(Debug, Clone)]
pub struct ZeroModel {
    name: String,
    layout: proto::v1::KvLayout,
    token: u32,
}

impl ZeroModel {
    /// Reads the config and tokenizer of the model at `path` (no weights).
    pub fn load(path: &Path) -> engine::Result<Self> {
        let text = text::load(path)?;
        let token = text
            .tokenizer
            .encode(" hello")?
            .first()
            .copied()
            .unwrap_or(0);
        Ok(Self {
            name: discovery::model_identity(path),
            layout: kvwire::convert::layout_to_proto(&engine::KvLayout::for_model(
                &text.config,
                engine::KV_DTYPE,
            )),
            token,
        })
    }

    fn health(&self, role: &str) -> HealthReply {
        HealthReply {
            role: role.into(),
            model: self.name.clone(),
            engine_version: runtime::VERSION.into(),
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

/// Which of Tandem's gRPC services a zero-compute node answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroRole {
    /// A prefill node that answers with first tokens at once and sends no KV cache.
    Prefill,
    /// A decode node that streams its whole token budget at once, without waiting for a
    /// KV cache (none comes from the zero prefill node): in PD requests after the KV
    /// reservation a real node sends first (with a ticket nothing redeems), in colocated
    /// ones with the first token too.
    Decode,
}

impl ZeroRole {
    fn name(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// One message in gRPC's length-prefixed framing (uncompressed).
fn framed(msg: &impl Message) -> Bytes {
    let mut buf = BytesMut::with_capacity(5 + msg.encoded_len());
    buf.put_u8(0);
    buf.put_u32(msg.encoded_len() as u32);
    msg.encode(&mut buf).expect("a BytesMut grows");
    buf.freeze()
}

fn decoded<M: Message + Default>(body: &[u8]) -> Result<M, Status> {
    let msg = body
        .get(5..)
        .ok_or_else(|| Status::invalid_argument("a gRPC message is at least 5 bytes"))?;
    M::decode(msg).map_err(|e| Status::invalid_argument(e.to_string()))
}

impl ZeroModel {
    /// The answer to a call of `path` with request `body`: its messages, each framed.
    fn answer(&self, role: ZeroRole, path: &str, body: &[u8]) -> Result<Vec<Bytes>, Status> {
        let method = path.rsplit('/').next().unwrap_or_default();
        match (role, method) {
            (_, "Health") => Ok(vec![framed(&self.health(role.name()))]),
            (ZeroRole::Prefill, "Prefill") => {
                let req: PrefillRequest = decoded(body)?;
                Ok(vec![framed(&PrefillResponse {
                    first: vec![self.token(); req.n.max(1) as usize],
                    batch_size: 1,
                    ..PrefillResponse::default()
                })])
            }
            (ZeroRole::Decode, "Generate") => {
                let req: GenerateRequest = decoded(body)?;
                if req.beam_width > 0 {
                    return Err(Status::unimplemented(
                        "the zero-compute node has no beam search",
                    ));
                }
                let mut events = Vec::new();
                if !req.prefill_here {
                    events.push(framed(&GenerateEvent {
                        event: Some(generate_event::Event::Reserved(proto::v1::KvReserved {
                            ticket: vec![0; 32],
                        })),
                    }));
                }
                let made = req.tokens_to_sample();
                for choice in 0..req.n.max(1) {
                    for i in 0..made {
                        events.push(framed(&GenerateEvent {
                            event: Some(generate_event::Event::Token(TokenEvent {
                                token: Some(self.token()),
                                batch_size: 1,
                                from_prefill: req.prefill_here && i == 0,
                                choice,
                                ..TokenEvent::default()
                            })),
                        }));
                    }
                    events.push(framed(&GenerateEvent {
                        event: Some(generate_event::Event::Finish(proto::v1::Finish {
                            reason: FinishReason::Length as i32,
                            choice,
                        })),
                    }));
                }
                Ok(events)
            }
            _ => Err(Status::unimplemented(format!(
                "the zero-compute {} node has no {path}",
                role.name()
            ))),
        }
    }
}

/// Serves the zero-compute `role` node's gRPC on `listener` until the process ends.
///
/// It speaks HTTP/2 itself and encodes answers straight into gRPC's framing, as cheap per
/// call as the zero-compute HTTP backend's prepared bytes: a tonic server took about twice
/// that backend's time from a request's arrival to its answer, which a router measured
/// against either would count as its own. Each message
/// still goes out in its own DATA frame, as a decode node's do, so the router's share of
/// the work stays what it is against a real node.
pub async fn serve_grpc(
    listener: TcpListener,
    model: ZeroModel,
    role: ZeroRole,
) -> std::io::Result<()> {
    let model = Arc::new(model);
    loop {
        let (socket, _) = listener.accept().await?;
        socket.set_nodelay(true)?;
        let model = Arc::clone(&model);
        tokio::spawn(async move {
            let Ok(mut conn) = h2::server::handshake(socket).await else {
                return;
            };
            while let Some(Ok((req, respond))) = conn.accept().await {
                tokio::spawn(call(Arc::clone(&model), role, req, respond));
            }
        });
    }
}

/// Answers one call; a stream the router has reset is left as it is.
async fn call(
    model: Arc<ZeroModel>,
    role: ZeroRole,
    req: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let path = req.uri().path().to_owned();
    let mut body = req.into_body();
    let mut message = BytesMut::new();
    while let Some(Ok(chunk)) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk.len());
        message.extend_from_slice(&chunk);
    }
    match model.answer(role, &path, &message) {
        Ok(frames) => {
            let head = http::Response::builder()
                .header(header::CONTENT_TYPE, "application/grpc")
                .body(())
                .expect("a valid response head");
            let Ok(mut send) = respond.send_response(head, false) else {
                return;
            };
            for frame in frames {
                if send.send_data(frame, false).is_err() {
                    return;
                }
            }
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            let _ = send.send_trailers(trailers);
        }
        Err(status) => {
            let _ = respond.send_response(status.into_http::<()>(), true);
        }
    }
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

async fn chat(State(c): State<Arc<Canned>>, Json(body): Json<Value>) -> Response {
    canned(&body, &c.chat, &c.chat_stream)
}

async fn completion(State(c): State<Arc<Canned>>, Json(body): Json<Value>) -> Response {
    canned(&body, &c.completion, &c.completion_stream)
}

/// What the routers' worker probes read: SGLang's `/server_info` and `/model_info` (the
/// model path leads sglang-router to a local tokenizer, so it fetches nothing).
async fn info(State(c): State<Arc<Canned>>) -> Json<Value> {
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
    let canned = Arc::new(Canned::new(model_name, model_path, tokens));
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

#[cfg(test)]
mod tests {
    use super::*;
    use proto::v1::decode_client::DecodeClient;
    use proto::v1::prefill_client::PrefillClient;
    use proto::v1::HealthRequest;
    use tonic::Code;

    /// A zero-compute node of `role` on a free port, and a tonic channel to it.
    async fn node(role: ZeroRole) -> tonic::transport::Channel {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let model = ZeroModel::load(&e2e::tiny_model()).expect("the tiny model's tokenizer");
        tokio::spawn(serve_grpc(listener, model, role));
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .expect("the node accepts")
    }

    #[tokio::test]
    async fn the_prefill_node_answers_health_and_one_first_token_per_sequence() {
        let mut p = PrefillClient::new(node(ZeroRole::Prefill).await);
        let health = p.health(HealthRequest {}).await.unwrap().into_inner();
        assert_eq!(health.role, "prefill");
        assert!(health.layout.is_some_and(|l| l.n_layers > 0));
        let req = PrefillRequest {
            n: 3,
            prompt: vec![1, 2, 3],
            ..PrefillRequest::default()
        };
        let first = p.prefill(req).await.unwrap().into_inner();
        assert_eq!(first.first.len(), 3);
        let err = DecodeClient::new(node(ZeroRole::Prefill).await)
            .generate(GenerateRequest::default())
            .await
            .expect_err("a prefill node has no Generate");
        assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
    }

    #[tokio::test]
    async fn the_decode_node_streams_each_sequences_budget_then_its_finish() {
        let mut d = DecodeClient::new(node(ZeroRole::Decode).await);
        assert_eq!(
            d.health(HealthRequest {}).await.unwrap().into_inner().role,
            "decode"
        );
        let req = GenerateRequest {
            n: 2,
            max_tokens: 3,
            prefill_here: true,
            ..GenerateRequest::default()
        };
        let mut seen = Vec::new();
        let mut stream = d.generate(req.clone()).await.unwrap().into_inner();
        while let Some(event) = stream.message().await.unwrap() {
            seen.push(match event.event.unwrap() {
                generate_event::Event::Token(t) => (t.choice, Some(t.from_prefill)),
                generate_event::Event::Finish(f) => (f.choice, None),
                generate_event::Event::Reserved(_) => panic!("a colocated call reserved KV"),
                generate_event::Event::Prompt(_) => panic!("no prompt logprobs were asked for"),
            });
        }
        let one = |c| {
            [
                (c, Some(true)),
                (c, Some(false)),
                (c, Some(false)),
                (c, None),
            ]
        };
        assert_eq!(seen, [one(0), one(1)].concat());
        // Under PD the reservation comes first, then the decode node's own tokens.
        let pd = GenerateRequest {
            prefill_here: false,
            ..req
        };
        let mut stream = d.generate(pd).await.unwrap().into_inner();
        let first = stream.message().await.unwrap().and_then(|e| e.event);
        assert!(
            matches!(first, Some(generate_event::Event::Reserved(_))),
            "{first:?}"
        );
        let beam = GenerateRequest {
            beam_width: 2,
            ..GenerateRequest::default()
        };
        let err = d.generate(beam).await.expect_err("no beam search");
        assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
    }
}

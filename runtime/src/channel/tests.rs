//! The channel's tests, against a real gRPC server on a local socket.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use proto::v1::decode_client::DecodeClient;
use proto::v1::decode_server::{Decode, DecodeServer};
use proto::v1::{
    generate_event, EndSequenceReply, EndSequenceRequest, GenerateEvent, GenerateRequest,
    HealthReply, HealthRequest, Token, TokenEvent, TopLogprob,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::StreamExt;
use tonic::{Code, Request, Response};

use super::*;

/// A decode service that streams `max_tokens` events of `top_logprobs` entries each,
/// then holds the call open until its caller leaves, and says so on `left`.
#[derive(Clone)]
struct Echo {
    left: mpsc::UnboundedSender<()>,
}

type Events = ReceiverStream<Result<GenerateEvent, Status>>;

#[tonic::async_trait]
impl Decode for Echo {
    type GenerateStream = Events;

    async fn generate(&self, req: Request<GenerateRequest>) -> Result<Response<Events>, Status> {
        let req = req.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let left = self.left.clone();
        tokio::spawn(async move {
            for i in 0..req.max_tokens {
                let top = (0..req.top_logprobs)
                    .map(|id| TopLogprob { id, logprob: -1.0 })
                    .collect();
                let token = Token {
                    id: i,
                    logprob: 0.0,
                    top,
                };
                let event = GenerateEvent {
                    event: Some(generate_event::Event::Token(TokenEvent {
                        token: Some(token),
                        ..TokenEvent::default()
                    })),
                };
                if tx.send(Ok(event)).await.is_err() {
                    break;
                }
            }
            tx.closed().await;
            let _ = left.send(());
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn end_sequence(
        &self,
        _: Request<EndSequenceRequest>,
    ) -> Result<Response<EndSequenceReply>, Status> {
        Err(Status::unimplemented("not used by these tests"))
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<Response<HealthReply>, Status> {
        Ok(Response::new(HealthReply {
            role: "decode".into(),
            ..HealthReply::default()
        }))
    }
}

/// Serves [`Echo`] on `addr` from a runtime of its own, so that dropping the runtime
/// kills the server and every connection it holds, as a dead process would.
fn serve(addr: SocketAddr) -> (tokio::runtime::Runtime, mpsc::UnboundedReceiver<()>) {
    let rt = tokio::runtime::Runtime::new().expect("a server runtime");
    let (left, left_rx) = mpsc::unbounded_channel();
    let listener = std::net::TcpListener::bind(addr).expect("the test port is free");
    listener
        .set_nonblocking(true)
        .expect("a non-blocking socket");
    rt.spawn(async move {
        let listener = TcpListener::from_std(listener).expect("a tokio listener");
        tonic::transport::Server::builder()
            .add_service(DecodeServer::new(Echo { left }))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await
    });
    (rt, left_rx)
}

/// Stops a server from [`serve`] and returns once its threads have ended, so its
/// listener is closed and the address can be bound again. `shutdown_background` would
/// return before a worker thread drops the listener, and a rebind could then race it.
async fn kill(server: tokio::runtime::Runtime) {
    tokio::task::spawn_blocking(move || server.shutdown_timeout(Duration::from_secs(30)))
        .await
        .expect("the server runtime stops");
}

async fn free_addr() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    l.local_addr().expect("its address")
}

/// Plain connections, a second to open.
fn dialer() -> Dialer {
    Dialer {
        connect_timeout: Duration::from_secs(1),
        tls: None,
        max_message: crate::DEFAULT_MAX_MESSAGE,
        max_age: tls::MAX_CONNECTION_AGE,
    }
}

fn client(addr: SocketAddr) -> DecodeClient<Channel> {
    let channel = dialer()
        .channel(&addr.to_string())
        .expect("a valid address");
    DecodeClient::new(channel).max_decoding_message_size(crate::DEFAULT_MAX_MESSAGE)
}

fn generate(tokens: u32, top: u32) -> GenerateRequest {
    GenerateRequest {
        max_tokens: tokens,
        top_logprobs: top,
        ..GenerateRequest::default()
    }
}

/// Waits for the next item of `stream`, failing the test after `limit`.
async fn next<S: tokio_stream::Stream + Unpin>(stream: &mut S, limit: Duration) -> S::Item {
    tokio::time::timeout(limit, stream.next())
        .await
        .unwrap_or_else(|_| panic!("nothing from the stream within {limit:?}"))
        .expect("the stream ended early")
}

/// A call whose one token has arrived and that the peer then holds open.
async fn held_call(c: &mut DecodeClient<Channel>) -> tonic::Streaming<GenerateEvent> {
    let mut held = c
        .generate(generate(1, 0))
        .await
        .expect("the call is taken")
        .into_inner();
    next(&mut held, Duration::from_secs(10))
        .await
        .expect("its one token");
    held
}

#[test]
fn addresses_without_a_port_are_refused() {
    let dialer = dialer();
    assert!(matches!(
        dialer.channel("decode-0"),
        Err(ChannelError::Address(a)) if a == "decode-0"
    ));
    assert!(dialer.channel("[::1]:50051").is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_and_streamed_calls_carry_more_than_a_flow_control_window() {
    let addr = free_addr().await;
    let (server, _left) = serve(addr);
    let mut c = client(addr);
    let reply = c.health(HealthRequest {}).await.expect("a health reply");
    assert_eq!(reply.into_inner().role, "decode");
    // 48 events of 40,000 top entries each: about 14 MB, past the 8 MiB stream window,
    // which only a body that hands the window back as it reads gets through.
    let mut events = c
        .generate(generate(48, 40_000))
        .await
        .expect("the call is taken")
        .into_inner();
    for i in 0..48 {
        let event = next(&mut events, Duration::from_secs(30))
            .await
            .expect("an event");
        let Some(generate_event::Event::Token(t)) = event.event else {
            panic!("not a token event: {event:?}");
        };
        let token = t.token.expect("a token");
        assert_eq!((token.id, token.top.len()), (i, 40_000));
    }
    drop(events);
    server.shutdown_background();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_peer_fails_calls_as_unavailable_and_is_dialed_again_once_back() {
    let addr = free_addr().await;
    let mut c = client(addr);
    let refused = c
        .health(HealthRequest {})
        .await
        .expect_err("nothing listens");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");

    let (server, _left) = serve(addr);
    c.health(HealthRequest {})
        .await
        .expect("dialed once it listens");
    let mut held = held_call(&mut c).await;
    kill(server).await;
    let cut = next(&mut held, Duration::from_secs(10))
        .await
        .expect_err("the peer died under the call");
    assert_eq!(cut.code(), Code::Unavailable, "{cut:?}");

    let (server, _left) = serve(addr);
    let start = Instant::now();
    loop {
        match c.health(HealthRequest {}).await {
            Ok(_) => break,
            Err(e) if start.elapsed() < Duration::from_secs(10) => {
                assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                tokio::task::yield_now().await;
            }
            Err(e) => panic!("not dialed again within 10 s: {e:?}"),
        }
    }
    server.shutdown_background();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_answering_fails_its_calls_within_the_keepalive() {
    // A peer that takes the connection and then never reads or answers: a paused
    // process looks the same from here.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    let addr = listener.local_addr().expect("its address");
    let silent = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.expect("the client dials");
        std::future::pending::<()>().await;
        drop(socket);
    });
    let start = Instant::now();
    let limit = KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT + Duration::from_secs(5);
    let failed = tokio::time::timeout(limit, client(addr).health(HealthRequest {}))
        .await
        .unwrap_or_else(|_| panic!("the call still hung after {limit:?}"))
        .expect_err("nothing answers");
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    assert!(
        start.elapsed() >= KEEPALIVE_TIMEOUT,
        "failed before a ping could go unanswered: {failed:?}"
    );
    silent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_stream_cancels_the_call_at_the_peer() {
    let addr = free_addr().await;
    let (server, mut left) = serve(addr);
    let mut c = client(addr);
    let held = held_call(&mut c).await;
    assert!(left.try_recv().is_err(), "the call is still held");
    drop(held);
    tokio::time::timeout(Duration::from_secs(10), left.recv())
        .await
        .expect("the peer saw the caller leave within 10 s")
        .expect("the server is up");
    server.shutdown_background();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_its_age_takes_no_new_calls_and_its_calls_go_on() {
    let addr = free_addr().await;
    let (server, mut left) = serve(addr);
    // Every connection is past an age of zero once it has opened.
    let channel = Dialer {
        max_age: Duration::ZERO,
        ..dialer()
    }
    .channel(&addr.to_string())
    .expect("a valid address");
    let mut c = DecodeClient::new(channel.clone());
    let held = held_call(&mut c).await;
    assert_eq!(channel.inner.dialed.load(Ordering::Relaxed), 1);
    c.health(HealthRequest {}).await.expect("served");
    c.health(HealthRequest {}).await.expect("served");
    assert_eq!(
        channel.inner.dialed.load(Ordering::Relaxed),
        3,
        "each call past the age dials anew"
    );
    assert!(
        left.try_recv().is_err(),
        "the call on the first connection still runs"
    );
    drop(held);
    server.shutdown_background();
}

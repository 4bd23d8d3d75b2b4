//! The gRPC channel every hop dials its peers with: one HTTP/2 connection per peer, opened on
//! the first call and again after it breaks, with keepalive pings and mutual TLS when set.
//!
//! It writes each call's headers and message in one go. tonic's own channel hands the
//! message to hyper, which sends the headers first and the message only once the connection
//! has opened the stream: two writes, and two wake-ups of the peer, per call. Our calls all
//! send one message (unary or server-streaming), so the message is encoded before the
//! stream opens and both frames are queued together.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{ready, Context, Poll};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use h2::client::SendRequest;
use h2::{PingPong, Reason, RecvStream};
use http::uri::{Authority, Scheme};
use http::{HeaderMap, Request, Response, Uri};
use http_body::{Body, Frame};
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::Status;

use crate::{
    Dialer, CONNECTION_WINDOW, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, MAX_FRAME, STREAM_WINDOW,
};

/// Why a channel could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("not a host:port address: {0}")]
    Address(String),
}

/// A lazily connected gRPC channel to one peer; clones share the connection.
#[derive(Clone)]
pub struct Channel {
    inner: Arc<Inner>,
}

struct Inner {
    authority: Authority,
    host: String,
    port: u16,
    dialer: Dialer,
    /// The open connection's number, when it opened, and its request handle, if one is
    /// open.
    live: Mutex<Option<(u64, Instant, SendRequest<Bytes>)>>,
    /// Held while dialing, so that calls arriving together open one connection.
    dialing: tokio::sync::Mutex<()>,
    dialed: AtomicU64,
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel")
            .field("peer", &self.inner.authority)
            .finish()
    }
}

impl Channel {
    /// A channel to `addr` (host:port) that connects on its first call.
    pub(crate) fn new(dialer: Dialer, addr: &str) -> Result<Self, ChannelError> {
        let bad = || ChannelError::Address(addr.to_string());
        let authority: Authority = addr.parse().map_err(|_| bad())?;
        let port = authority.port_u16().ok_or_else(bad)?;
        Ok(Self {
            inner: Arc::new(Inner {
                host: authority.host().trim_matches(['[', ']']).to_string(),
                port,
                authority,
                dialer,
                live: Mutex::new(None),
                dialing: tokio::sync::Mutex::new(()),
                dialed: AtomicU64::new(0),
            }),
        })
    }
}

type CallFuture = Pin<Box<dyn Future<Output = Result<Response<ResponseBody>, Status>> + Send>>;

impl tower_service::Service<Request<tonic::body::Body>> for Channel {
    type Response = Response<ResponseBody>;
    type Error = Status;
    type Future = CallFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        // Readiness is the connection's, checked in the call once it is dialed.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<tonic::body::Body>) -> CallFuture {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move { inner.call(req).await })
    }
}

impl Inner {
    async fn call(
        self: Arc<Self>,
        req: Request<tonic::body::Body>,
    ) -> Result<Response<ResponseBody>, Status> {
        let (mut head, mut body) = req.into_parts();
        let (message, trailers) = collect(&mut body).await?;
        let mut uri = std::mem::take(&mut head.uri).into_parts();
        uri.scheme = Some(Scheme::HTTP);
        uri.authority = Some(self.authority.clone());
        head.uri = Uri::from_parts(uri).map_err(|e| Status::internal(e.to_string()))?;

        let mut send = self.sender().await?.ready().await.map_err(unavailable)?;
        let only_headers = message.is_empty() && trailers.is_none();
        let (response, mut stream) = send
            .send_request(Request::from_parts(head, ()), only_headers)
            .map_err(unavailable)?;
        if !only_headers {
            stream
                .send_data(message, trailers.is_none())
                .map_err(unavailable)?;
        }
        if let Some(trailers) = trailers {
            stream.send_trailers(trailers).map_err(unavailable)?;
        }
        let response = response.await.map_err(unavailable)?;
        Ok(response.map(ResponseBody::new))
    }

    /// The open connection's handle, dialing one if there is none.
    async fn sender(self: &Arc<Self>) -> Result<SendRequest<Bytes>, Status> {
        if let Some(send) = self.open() {
            return Ok(send);
        }
        let _dialing = self.dialing.lock().await;
        if let Some(send) = self.open() {
            return Ok(send);
        }
        let timeout = self.dialer.connect_timeout;
        let dialed = tokio::time::timeout(timeout, self.dial())
            .await
            .map_err(|_| {
                Status::unavailable(format!(
                    "connecting to {} timed out after {timeout:?}",
                    self.authority
                ))
            })?;
        dialed.map_err(|e| Status::unavailable(format!("connecting to {}: {e}", self.authority)))
    }

    /// The open connection's handle, unless it is older than the dialer's `max_age`: then
    /// it is let go (its calls go on until they end) and the next call dials a new one,
    /// with the TLS files as they are now.
    fn open(&self) -> Option<SendRequest<Bytes>> {
        let mut live = self.live.lock().expect("channel lock");
        if live
            .as_ref()
            .is_some_and(|(_, opened, _)| opened.elapsed() >= self.dialer.max_age)
        {
            *live = None;
        }
        live.as_ref().map(|(_, _, send)| send.clone())
    }

    async fn dial(self: &Arc<Self>) -> std::io::Result<SendRequest<Bytes>> {
        let io = tls::dial(self.dialer.tls.as_ref(), &self.host, self.port).await?;
        self.start(io).await
    }

    /// Opens HTTP/2 over `io` and runs the connection, with its pings, on a task of its own
    /// that forgets the connection when it ends.
    async fn start<T>(self: &Arc<Self>, io: T) -> std::io::Result<SendRequest<Bytes>>
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (send, mut conn) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_frame_size(MAX_FRAME)
            .enable_push(false)
            .handshake::<_, Bytes>(io)
            .await
            .map_err(std::io::Error::other)?;
        let pings = conn.ping_pong().expect("a new connection's pings");
        let id = self.dialed.fetch_add(1, Ordering::Relaxed);
        *self.live.lock().expect("channel lock") = Some((id, Instant::now(), send.clone()));
        let channel: Weak<Inner> = Arc::downgrade(self);
        let peer = self.authority.clone();
        tokio::spawn(async move {
            tokio::select! {
                ended = conn => if let Err(e) = ended {
                    tracing::debug!(%peer, "connection ended: {e}");
                },
                () = keepalive(pings) => tracing::warn!(
                    %peer,
                    "no answer to a ping within {KEEPALIVE_TIMEOUT:?}; dropping the connection"
                ),
            }
            if let Some(channel) = channel.upgrade() {
                let mut live = channel.live.lock().expect("channel lock");
                if live.as_ref().is_some_and(|(open, _, _)| *open == id) {
                    *live = None;
                }
            }
        });
        Ok(send)
    }
}

/// Pings every [`KEEPALIVE_INTERVAL`]; returns once a ping goes unanswered for
/// [`KEEPALIVE_TIMEOUT`] or the connection is gone, so that a peer that stops answering
/// (paused, cut off) fails its calls within seconds instead of holding them forever.
async fn keepalive(mut pings: PingPong) {
    loop {
        tokio::time::sleep(KEEPALIVE_INTERVAL).await;
        let pong = tokio::time::timeout(KEEPALIVE_TIMEOUT, pings.ping(h2::Ping::opaque())).await;
        if !matches!(pong, Ok(Ok(_))) {
            return;
        }
    }
}

/// The request body tonic encoded (one message for every call we make), whole.
async fn collect(body: &mut tonic::body::Body) -> Result<(Bytes, Option<HeaderMap>), Status> {
    let mut first: Option<Bytes> = None;
    let mut more = BytesMut::new();
    let mut trailers = None;
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await {
        match frame?.into_data() {
            Ok(data) if first.is_none() => first = Some(data),
            Ok(data) => more.extend_from_slice(&data),
            Err(frame) => trailers = frame.into_trailers().ok(),
        }
    }
    let message = match first {
        Some(first) if more.is_empty() => first,
        Some(first) => {
            let mut all = BytesMut::from(first);
            all.extend_from_slice(&more);
            all.freeze()
        }
        None => Bytes::new(),
    };
    Ok((message, trailers))
}

/// A call that could not be sent or finished on the wire: the peer could not take or
/// finish it (down, cut off, restarting), so another may; one the peer cancelled says so.
fn unavailable(e: h2::Error) -> Status {
    if e.reason() == Some(Reason::CANCEL) {
        Status::cancelled(format!("the peer cancelled the call: {e}"))
    } else {
        Status::unavailable(format!("the connection failed: {e}"))
    }
}

/// A response body read off its HTTP/2 stream, handing the flow-control window back as
/// the data is taken.
pub struct ResponseBody {
    recv: RecvStream,
    data_done: bool,
    done: bool,
}

impl ResponseBody {
    fn new(recv: RecvStream) -> Self {
        Self {
            recv,
            data_done: false,
            done: false,
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if !self.data_done {
            match ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(unavailable(e))));
                }
                None => self.data_done = true,
            }
        }
        let trailers = ready!(self.recv.poll_trailers(cx));
        self.done = true;
        Poll::Ready(match trailers {
            Ok(Some(trailers)) => Some(Ok(Frame::trailers(trailers))),
            Ok(None) => None,
            Err(e) => Some(Err(unavailable(e))),
        })
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.recv.is_end_stream()
    }
}

#[cfg(test)]
mod tests;

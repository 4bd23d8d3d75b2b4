//! The HTTP/1.1 server loop, written out instead of `axum::serve` so that the bounds on a
//! connection are ours to set where they are taken: how many connections are open, how
//! large a request's head may be and how long it may take to arrive, and how long a
//! response may wait on a client that stopped reading. It serves plain or TLS connections
//! alike: the router's API and operations listeners, and a worker's operations listener.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, HeaderValue, Request, Response};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Most headers one request may carry; a request with more gets 431.
const MAX_HEADERS: usize = 100;

/// What is told of each connection closed for a client that stopped reading (a metric).
pub type OnStall = Arc<dyn Fn() + Send + Sync>;

/// What a client connection may hold.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest request head, in bytes (431 past it).
    pub max_header_bytes: usize,
    /// How long a request's head may take to arrive: a slow-drip client cannot hold a
    /// connection open forever.
    pub header_timeout: Duration,
    /// How long a response write may make no progress (a client that stopped reading)
    /// before the connection is closed, which drops the response and so cancels its
    /// generation on the workers.
    pub write_stall: Duration,
}

/// Serves `app` on the connections `incoming` hands out until `shutdown` resolves, then
/// stops accepting and waits for the requests in progress to finish.
pub async fn serve(
    mut incoming: tls::Incoming,
    app: Router,
    limits: Limits,
    on_stall: OnStall,
    shutdown: impl Future<Output = ()> + Send,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.max_buf_size(limits.max_header_bytes)
        .max_headers(MAX_HEADERS)
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        // Each connection holds its place among `--max-connections` (`tls::accept`) until
        // it is dropped.
        let conn = tokio::select! {
            c = incoming.next() => match c {
                Some(c) => c,
                None => break,
            },
            _ = &mut shutdown => break,
        };
        let conn = WriteStall::new(conn, limits.write_stall, Arc::clone(&on_stall));
        let service = aging(
            TowerToHyperService::new(app.clone()),
            Instant::now(),
            tls::MAX_CONNECTION_AGE,
        );
        let served = graceful.watch(http.serve_connection(TokioIo::new(conn), service));
        tokio::spawn(async move {
            if let Err(e) = served.await {
                tracing::debug!("HTTP connection ended: {e}");
            }
        });
    }
    drop(incoming);
    graceful.shutdown().await;
}

/// `service`, answering `Connection: close` once its connection (opened at `born`) is
/// older than `age`: the client's next request opens a new connection, which gets the
/// certificate the router holds now. The request itself is served in full.
fn aging<S, B>(
    service: S,
    born: Instant,
    age: Duration,
) -> impl hyper::service::Service<
    Request<B>,
    Response = Response<Body>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Body>, Infallible>> + Send,
> + Clone
where
    B: hyper::body::Body,
    S: hyper::service::Service<Request<B>, Response = Response<Body>, Error = Infallible> + Clone,
    S::Future: Send,
{
    hyper::service::service_fn(move |req| {
        let served = service.call(req);
        async move {
            let mut response = served.await?;
            if born.elapsed() >= age {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            Ok(response)
        }
    })
}

/// A connection whose writes fail once one has waited `limit` for the socket: hyper then
/// closes it, the response body is dropped, and the stream task behind it sees its
/// client gone.
struct WriteStall<T> {
    inner: T,
    limit: Duration,
    /// Armed when a write finds the socket full; disarmed by any write that progresses.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    on_stall: OnStall,
}

impl<T> WriteStall<T> {
    fn new(inner: T, limit: Duration, on_stall: OnStall) -> Self {
        Self {
            inner,
            limit,
            timer: None,
            on_stall,
        }
    }

    /// What a write that returned `poll` means: progress disarms the timer, a full socket
    /// arms it, and a timer that ran out fails the write.
    fn watch<R>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if poll.is_ready() {
            self.timer = None;
            return poll;
        }
        let limit = self.limit;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                (self.on_stall)();
                tracing::info!(
                    "a client read nothing for {} ms; connection closed",
                    limit.as_millis()
                );
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client stopped reading",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteStall<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteStall<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let poll = Pin::new(&mut me.inner).poll_write(cx, buf);
        me.watch(cx, poll)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let poll = Pin::new(&mut me.inner).poll_write_vectored(cx, bufs);
        me.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let poll = Pin::new(&mut me.inner).poll_flush(cx);
        me.watch(cx, poll)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::service::Service;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncWriteExt;

    /// A stall callback and the count it keeps.
    fn counted() -> (OnStall, Arc<AtomicUsize>) {
        let count = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&count);
        let on_stall: OnStall = Arc::new(move || {
            seen.fetch_add(1, Ordering::Relaxed);
        });
        (on_stall, count)
    }

    #[tokio::test]
    async fn a_connection_past_its_age_is_asked_to_close_after_its_answer() {
        let ok = hyper::service::service_fn(|_: Request<String>| async {
            Ok::<_, Infallible>(Response::new(Body::from("ok")))
        });
        let young = aging(ok, Instant::now(), Duration::from_secs(3600));
        let answer = young.call(Request::new(String::new())).await.unwrap();
        assert!(answer.headers().get(header::CONNECTION).is_none());
        let old = aging(ok, Instant::now(), Duration::ZERO);
        let answer = old.call(Request::new(String::new())).await.unwrap();
        assert_eq!(answer.headers()[header::CONNECTION], "close");
        assert_eq!(answer.status(), 200, "the request itself is served");
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_waits_past_the_limit_fails_and_is_counted() {
        // A pipe whose reader never reads: writes fill its 64 bytes, then wait.
        let (client, _server) = tokio::io::duplex(64);
        let (on_stall, stalls) = counted();
        let mut conn = WriteStall::new(client, Duration::from_secs(2), on_stall);
        conn.write_all(&[7; 64])
            .await
            .expect("room for the first 64 bytes");
        let started = tokio::time::Instant::now();
        let err = conn.write_all(&[7; 64]).await.expect_err("no room, ever");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        assert_eq!(stalls.load(Ordering::Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_progresses_starts_the_limit_again() {
        let (client, mut server) = tokio::io::duplex(64);
        let (on_stall, stalls) = counted();
        let mut conn = WriteStall::new(client, Duration::from_secs(2), on_stall);
        // The reader takes 64 bytes every 1.5 s: each wait is under the limit, the whole
        // write is not.
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            for _ in 0..5 {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                tokio::io::AsyncReadExt::read_exact(&mut server, &mut buf)
                    .await
                    .unwrap();
            }
        });
        conn.write_all(&[7; 5 * 64])
            .await
            .expect("a slow reader is no stalled one");
        reader.await.unwrap();
        assert_eq!(stalls.load(Ordering::Relaxed), 0);
    }
}

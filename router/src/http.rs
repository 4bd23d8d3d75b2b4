//! The HTTP/1.1 server loop, written out instead of `axum::serve` so that the bounds on a
//! request's head (its size, its header count, how long it may take to arrive) are ours
//! to set, and so that it serves plain or TLS connections alike.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

/// Most headers one request may carry; a request with more gets 431.
const MAX_HEADERS: usize = 100;
/// How long a client may take to send a request's head: a slow-drip client cannot hold a
/// connection open forever.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves `app` on the connections `incoming` hands out until `shutdown` resolves, then
/// stops accepting and waits for the requests in progress to finish.
pub async fn serve(
    mut incoming: tls::Incoming,
    app: Router,
    max_header_bytes: usize,
    shutdown: impl Future<Output = ()> + Send,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.max_buf_size(max_header_bytes)
        .max_headers(MAX_HEADERS)
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let conn = tokio::select! {
            c = incoming.next() => match c {
                Some(c) => c,
                None => break,
            },
            _ = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(app.clone());
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

//! Accepting plain or TLS connections, and dialing TLS ones for gRPC channels.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::Connected;

use crate::{ClientTls, Identity, Peer, Role, ServerTls};

/// How long a client may take to finish its handshake and be taken by the server; a slow
/// or silent one must not hold a task and a socket forever.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshaken connections waiting for the server to take them.
const BACKLOG: usize = 128;
/// Pause after the listener fails (out of file descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// At most one warning per listener in this period says how many handshakes were refused;
/// each refusal is logged at debug. A scanner or a probe that speaks plain text would
/// otherwise write a warning per connection.
const REFUSAL_LOG_PERIOD: Duration = Duration::from_secs(60);

/// Handshakes refused or timed out on every listener of this process.
static HANDSHAKES_REFUSED: AtomicU64 = AtomicU64::new(0);

/// Handshakes refused or timed out on every listener of this process since it started
/// (exported as `tls_handshakes_refused_total`).
pub fn handshakes_refused() -> u64 {
    HANDSHAKES_REFUSED.load(Ordering::Relaxed)
}

/// Refused handshakes of one listener, and when one was last logged as a warning.
#[derive(Debug)]
struct Refusals {
    last_warned: Option<Instant>,
    since: u64,
}

impl Refusals {
    /// Counts a refusal at `now`; the number refused since the last warning when this one
    /// is to be logged as a warning.
    fn refused(&mut self, now: Instant) -> Option<u64> {
        HANDSHAKES_REFUSED.fetch_add(1, Ordering::Relaxed);
        self.since += 1;
        let due = self
            .last_warned
            .is_none_or(|t| now.duration_since(t) >= REFUSAL_LOG_PERIOD);
        due.then(|| {
            self.last_warned = Some(now);
            std::mem::take(&mut self.since)
        })
    }
}

/// An accepted connection, in plain text or TLS, holding its place among the listener's
/// open connections until it is dropped.
pub struct Conn {
    io: Stream,
    _place: OwnedSemaphorePermit,
}

/// The socket of a connection.
enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP, handshake done.
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Conn {
    fn tcp(&self) -> &TcpStream {
        match &self.io {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp().peer_addr()
    }

    /// What the handshake proved about the peer.
    pub fn identity(&self) -> Identity {
        match &self.io {
            Stream::Plain(_) => Identity::Plain,
            Stream::Tls(s) => match s.get_ref().1.peer_certificates() {
                Some([leaf, ..]) => Identity::Certified(Role::of(leaf)),
                _ => Identity::Anonymous,
            },
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Self::ConnectInfo {
        Peer {
            tcp: self.tcp().connect_info(),
            identity: self.identity(),
        }
    }
}

/// Connections accepted on a listener, handshaken when TLS is on. A stream for tonic's
/// `serve_with_incoming`, and a source of connections for an HTTP server loop.
pub struct Incoming {
    rx: mpsc::Receiver<Conn>,
    local_addr: SocketAddr,
}

impl Incoming {
    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The next connection; `None` once the accept loop has stopped.
    pub async fn next(&mut self) -> Option<Conn> {
        self.rx.recv().await
    }
}

impl tokio_stream::Stream for Incoming {
    type Item = io::Result<Conn>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|c| c.map(Ok))
    }
}

/// Accepts connections on `listener` from a background task, at most `max_open` open at
/// once, handshakes included: at the cap no connection is accepted, so new ones wait in the
/// listen backlog while the open ones keep working, and each place is held until its
/// connection is dropped. With `tls` each handshake runs on a task of its own, so a slow
/// client delays nobody else, and it must finish, and the server take the connection,
/// within [`HANDSHAKE_TIMEOUT`]. A refused handshake (plain text on a TLS port, an unknown
/// CA, an expired or missing client certificate) is logged with the peer and the reason,
/// and dropped.
pub fn accept(
    listener: TcpListener,
    tls: Option<ServerTls>,
    max_open: usize,
) -> io::Result<Incoming> {
    let local_addr = listener.local_addr()?;
    let (tx, rx) = mpsc::channel(BACKLOG);
    let refusals = Arc::new(Mutex::new(Refusals {
        last_warned: None,
        since: 0,
    }));
    let open = Arc::new(Semaphore::new(max_open.clamp(1, Semaphore::MAX_PERMITS)));
    tokio::spawn(async move {
        loop {
            let place = tokio::select! {
                p = Arc::clone(&open).acquire_owned() => p.expect("the semaphore is never closed"),
                _ = tx.closed() => return,
            };
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!("accepting a connection on {local_addr}: {e}");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                },
                _ = tx.closed() => return,
            };
            let _ = tcp.set_nodelay(true);
            let Some(tls) = &tls else {
                let conn = Conn {
                    io: Stream::Plain(tcp),
                    _place: place,
                };
                if tx.send(conn).await.is_err() {
                    return;
                }
                continue;
            };
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.config());
            let (tx, refusals) = (tx.clone(), Arc::clone(&refusals));
            tokio::spawn(async move {
                let handed = async {
                    let s = acceptor.accept(tcp).await.map_err(|e| e.to_string())?;
                    let conn = Conn {
                        io: Stream::Tls(Box::new(s)),
                        _place: place,
                    };
                    // A server that stopped taking connections refuses nothing: it is
                    // stopping.
                    let _ = tx.send(conn).await;
                    Ok::<_, String>(())
                };
                let why = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handed).await {
                    Ok(Ok(())) => return,
                    Ok(Err(e)) => e,
                    Err(_) => format!("not done and taken within {HANDSHAKE_TIMEOUT:?}"),
                };
                let warn = refusals
                    .lock()
                    .expect("the refusal count's lock is never poisoned")
                    .refused(Instant::now());
                match warn {
                    Some(n) => tracing::warn!(%peer, refused = n,
                        "TLS handshake refused on {local_addr}: {why} ({n} refused since the last warning; \
                         the rest are logged at debug, at most one warning a minute)"),
                    None => {
                        tracing::debug!(%peer, "TLS handshake refused on {local_addr}: {why}")
                    }
                }
            });
        }
    });
    Ok(Incoming { rx, local_addr })
}

/// Dials TLS connections for a gRPC channel: TCP without Nagle's delay, then a handshake
/// that checks the server's certificate and presents this process's own.
#[derive(Clone)]
pub struct Connector {
    tls: ClientTls,
}

impl Connector {
    /// A connector that uses `tls`'s configuration at the time of each dial.
    pub fn new(tls: ClientTls) -> Self {
        Self { tls }
    }

    /// Dials `host:port` and completes the handshake; a refusal is logged with the peer
    /// and the reason (an unknown CA, an expired certificate, a name it does not carry, a
    /// role other than the one expected).
    pub async fn connect(&self, host: &str, port: u16) -> io::Result<ClientStream> {
        let name = self
            .tls
            .server_name(host)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let tcp = TcpStream::connect((host.trim_matches(['[', ']']), port)).await?;
        let _ = tcp.set_nodelay(true);
        let connector = tokio_rustls::TlsConnector::from(self.tls.config());
        let stream = connector.connect(name, tcp).await.inspect_err(|e| {
            tracing::warn!("TLS handshake with {host}:{port} refused: {e}");
        })?;
        let Some(want) = self.tls.peer_role() else {
            return Ok(stream);
        };
        let presented = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first());
        let role = presented.and_then(Role::of);
        if role == Some(want) {
            return Ok(stream);
        }
        let why = format!(
            "TLS handshake with {host}:{port} refused: its certificate carries role {}, not {}",
            role.map_or("none", Role::uri),
            want.uri()
        );
        tracing::warn!("{why}");
        Err(io::Error::new(io::ErrorKind::PermissionDenied, why))
    }
}

/// A dialed connection, plain or TLS.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Dials `host:port` (an IPv6 host with or without its brackets): TCP without Nagle's
/// delay, then, with `tls`, the handshake of [`Connector::connect`].
pub async fn dial(tls: Option<&ClientTls>, host: &str, port: u16) -> io::Result<Box<dyn Io>> {
    match tls {
        Some(t) => Ok(Box::new(
            Connector::new(t.clone()).connect(host, port).await?,
        )),
        None => {
            let tcp = TcpStream::connect((host.trim_matches(['[', ']']), port)).await?;
            tcp.set_nodelay(true)?;
            Ok(Box::new(tcp))
        }
    }
}

type Dial = Pin<Box<dyn Future<Output = io::Result<TokioIo<ClientStream>>> + Send>>;
/// A dialed TLS connection.
pub type ClientStream = tokio_rustls::client::TlsStream<TcpStream>;

impl tower_service::Service<http::Uri> for Connector {
    type Response = TokioIo<ClientStream>;
    type Error = io::Error;
    type Future = Dial;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Dial {
        let this = self.clone();
        Box::pin(async move {
            let host = uri.host().unwrap_or_default();
            let port = uri.port_u16().unwrap_or(443);
            this.connect(host, port).await.map(TokioIo::new)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_handshakes_warn_at_most_once_a_period() {
        let mut r = Refusals {
            last_warned: None,
            since: 0,
        };
        let t0 = Instant::now();
        let before = handshakes_refused();
        assert_eq!(r.refused(t0), Some(1), "the first one warns");
        for s in 1..=100 {
            assert_eq!(r.refused(t0 + Duration::from_millis(s * 100)), None);
        }
        assert_eq!(
            r.refused(t0 + REFUSAL_LOG_PERIOD),
            Some(101),
            "the next warning counts the quiet ones"
        );
        assert!(handshakes_refused() >= before + 102, "every one is counted");
    }
}

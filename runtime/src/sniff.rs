//! One port, two protocols: connections that open with a side protocol's preface (the KV
//! data plane on a decode node) go to its handler, all others to the gRPC server, with
//! the bytes read to tell them apart given back.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tonic::transport::server::Connected;

/// How long a new connection may take to send the bytes that tell its protocol.
const SNIFF_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections told apart, waiting for their server to take them.
const BACKLOG: usize = 128;

/// Where connections that open with `preface` go, preface consumed.
pub struct SideProtocol {
    /// The bytes that mark the protocol; no HTTP client may send them first.
    pub preface: &'static [u8],
    /// The protocol's handler.
    pub conns: mpsc::Sender<Sniffed>,
}

/// An accepted connection (TLS done) whose first bytes may have been read already: reads
/// give them back first.
pub struct Sniffed {
    head: Vec<u8>,
    at: usize,
    conn: tls::Conn,
}

impl Sniffed {
    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.conn.peer_addr()
    }

    /// What the TLS handshake proved about the peer.
    pub fn identity(&self) -> tls::Identity {
        self.conn.identity()
    }
}

/// `incoming` for the gRPC server, less the connections that open with `side`'s preface,
/// which go to `side`. Each connection is told apart on a task of its own.
pub fn split(
    mut incoming: tls::Incoming,
    side: Option<SideProtocol>,
) -> impl tokio_stream::Stream<Item = io::Result<Sniffed>> {
    let (tx, rx) = mpsc::channel(BACKLOG);
    tokio::spawn(async move {
        loop {
            let conn = tokio::select! {
                c = incoming.next() => match c {
                    Some(c) => c,
                    None => return,
                },
                _ = tx.closed() => return,
            };
            let Some(side) = &side else {
                let plain = Sniffed {
                    head: Vec::new(),
                    at: 0,
                    conn,
                };
                if tx.send(plain).await.is_err() {
                    return;
                }
                continue;
            };
            let (grpc, preface, conns) = (tx.clone(), side.preface, side.conns.clone());
            tokio::spawn(async move {
                let peer = conn.peer_addr().ok();
                match tokio::time::timeout(SNIFF_TIMEOUT, sniff(conn, preface)).await {
                    Ok(Ok(Some((true, s)))) => {
                        let _ = conns.send(s).await;
                    }
                    Ok(Ok(Some((false, s)))) => {
                        let _ = grpc.send(s).await;
                    }
                    // Closed before it said anything (a TCP probe).
                    Ok(Ok(None)) => {}
                    Ok(Err(e)) => tracing::debug!(?peer, "reading a new connection: {e}"),
                    Err(_) => tracing::warn!(
                        ?peer,
                        "a connection sent nothing for {SNIFF_TIMEOUT:?}; closed"
                    ),
                }
            });
        }
    });
    tokio_stream::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), Ok)
}

/// Reads until the bytes differ from `preface` or match all of it: `(true, conn)` with
/// the preface consumed, `(false, conn)` with what was read given back, `None` if the peer
/// closed first.
async fn sniff(mut conn: tls::Conn, preface: &[u8]) -> io::Result<Option<(bool, Sniffed)>> {
    let mut head = vec![0u8; preface.len()];
    let mut got = 0;
    while got < preface.len() {
        let n = conn.read(&mut head[got..]).await?;
        if n == 0 {
            return Ok(None);
        }
        got += n;
        if head[..got] != preface[..got] {
            head.truncate(got);
            return Ok(Some((false, Sniffed { head, at: 0, conn })));
        }
    }
    Ok(Some((
        true,
        Sniffed {
            head: Vec::new(),
            at: 0,
            conn,
        },
    )))
}

impl AsyncRead for Sniffed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.at < me.head.len() {
            let n = (me.head.len() - me.at).min(buf.remaining());
            buf.put_slice(&me.head[me.at..me.at + n]);
            me.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut me.conn).poll_read(cx, buf)
    }
}

impl AsyncWrite for Sniffed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().conn).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().conn).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().conn).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().conn).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.conn.is_write_vectored()
    }
}

impl Connected for Sniffed {
    type ConnectInfo = tls::Peer;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.conn.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio_stream::StreamExt;

    const WAIT: Duration = Duration::from_secs(10);

    async fn read_all(mut s: Sniffed) -> Vec<u8> {
        let mut out = Vec::new();
        tokio::time::timeout(WAIT, s.read_to_end(&mut out))
            .await
            .expect("the client closed within the wait")
            .expect("reading the connection");
        out
    }

    #[tokio::test]
    async fn connections_go_by_their_first_bytes_with_those_bytes_given_back() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (side_tx, mut side_rx) = mpsc::channel(4);
        let side = SideProtocol {
            preface: b"tandem-kv/1\n",
            conns: side_tx,
        };
        let mut grpc = Box::pin(split(tls::accept(listener, None, 16).unwrap(), Some(side)));
        let send = |bytes: &'static [u8]| async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            // Byte by byte, so that the preface arrives in pieces.
            for b in bytes {
                c.write_all(&[*b]).await.unwrap();
                c.flush().await.unwrap();
            }
            c.shutdown().await.unwrap();
            c
        };

        let _kv = send(b"tandem-kv/1\nframes").await;
        let got = tokio::time::timeout(WAIT, side_rx.recv())
            .await
            .expect("the side connection within the wait")
            .expect("a side connection");
        assert_eq!(read_all(got).await, b"frames", "the preface is consumed");

        for other in [
            &b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"[..],
            b"GET /metrics HTTP/1.1\r\n\r\n",
            b"tandem-kx/1\nalmost",
        ] {
            let _c = send(other).await;
            let got = tokio::time::timeout(WAIT, grpc.next())
                .await
                .expect("the connection within the wait")
                .expect("the stream goes on")
                .expect("a connection");
            assert_eq!(read_all(got).await, other, "every byte is given back");
        }
        assert!(side_rx.try_recv().is_err(), "only the preface goes aside");
    }
}

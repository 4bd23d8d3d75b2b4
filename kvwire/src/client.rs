//! The sending side: connections to decode nodes, kept open between transfers.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use proto::v1::{KvHeader, TransferAck};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
use tokio::sync::mpsc;

use crate::{read_reply, write_item, Item, WireError, PREFACE};

/// How long a write may wait for a decode node that stopped reading, and the answer may
/// take once the transfer is sent (the node answers as soon as it has the last frame).
const STALL: Duration = Duration::from_secs(10);
/// Idle connections kept per decode node.
const MAX_IDLE: usize = 16;
/// How long an idle connection is kept: well under the time a decode node lets one idle
/// (`--kv-idle-timeout-ms`, 60 s by default), so that a kept connection is not closed by
/// the node just as a transfer starts on it.
pub const IDLE_KEEP: Duration = Duration::from_secs(20);

type Conn = Box<dyn tls::Io>;

/// A connection kept between transfers: when it opened, and since when it idles.
struct Kept {
    conn: Conn,
    opened: Instant,
    since: Instant,
}

/// Dials decode nodes for transfers, over TCP or mutual TLS, and keeps connections that
/// ended a transfer well for the next one.
pub struct Client {
    connect_timeout: Duration,
    tls: Option<tls::ClientTls>,
    /// Idle connections per decode node.
    idle: Mutex<HashMap<String, Vec<Kept>>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("connect_timeout", &self.connect_timeout)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client that gives a connection `connect_timeout` to open, with mutual TLS when
    /// `tls` is set.
    pub fn new(connect_timeout: Duration, tls: Option<tls::ClientTls>) -> Self {
        Self {
            connect_timeout,
            tls,
            idle: Mutex::default(),
        }
    }

    /// Sends one transfer to the decode node at `addr` (host:port): `header`, then `items`
    /// until the first tokens, and returns the node's acknowledgement. `items` closing
    /// before the first tokens abandons the transfer (the node frees what it got), and a
    /// refusal ends it as soon as it arrives.
    pub async fn transfer(
        &self,
        addr: &str,
        header: KvHeader,
        mut items: mpsc::UnboundedReceiver<Item>,
    ) -> Result<TransferAck, WireError> {
        // Nothing goes out before the first item: a prompt that waits in the prefill
        // queue holds no connection, and the node's quiet timer starts with the data.
        let Some(first) = items.recv().await else {
            return Err(WireError::Abandoned);
        };
        let (conn, opened) = self.connection(addr).await?;
        let (mut r, mut w) = tokio::io::split(conn);
        let ack = {
            let reply = read_reply(&mut r);
            tokio::pin!(reply);
            let send = async {
                stall(write_item(&mut w, &Item::Header(header))).await?;
                let mut item = first;
                loop {
                    stall(write_item(&mut w, &item)).await?;
                    if matches!(item, Item::First(_)) {
                        return stall(w.flush()).await;
                    }
                    item = items.recv().await.ok_or(WireError::Abandoned)?;
                }
            };
            // An answer before the whole transfer is sent can only be a refusal.
            tokio::select! {
                early = &mut reply => return match early {
                    Ok(_) => Err(WireError::Malformed(
                        "an acknowledgement before the first tokens".into(),
                    )),
                    Err(e) => Err(e),
                },
                sent = send => sent?,
            }
            tokio::time::timeout(STALL, reply)
                .await
                .map_err(|_| WireError::Stalled(STALL))??
        };
        let mut idle = self.idle.lock().expect("idle connections lock");
        let kept = idle.entry(addr.to_string()).or_default();
        if kept.len() < MAX_IDLE {
            kept.push(Kept {
                conn: r.unsplit(w),
                opened,
                since: Instant::now(),
            });
        }
        Ok(ack)
    }

    /// The newest connection kept for `addr` that has idled less than [`IDLE_KEEP`] and
    /// is younger than [`tls::MAX_CONNECTION_AGE`] (so that rotated certificates take
    /// effect), with when it opened; others are closed.
    fn take_idle(&self, addr: &str) -> Option<(Conn, Instant)> {
        let mut idle = self.idle.lock().expect("idle connections lock");
        let kept = idle.get_mut(addr)?;
        kept.retain(|k| {
            k.since.elapsed() < IDLE_KEEP && k.opened.elapsed() < tls::MAX_CONNECTION_AGE
        });
        kept.pop().map(|k| (k.conn, k.opened))
    }

    /// An idle connection to `addr` that is still open, else a new one, with when it
    /// opened.
    async fn connection(&self, addr: &str) -> Result<(Conn, Instant), WireError> {
        while let Some((mut c, opened)) = self.take_idle(addr) {
            if open(&mut c) {
                return Ok((c, opened));
            }
        }
        let failed = |source: std::io::Error| WireError::Connect {
            addr: addr.to_string(),
            source,
        };
        let (host, port) = addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            .filter(|(h, _)| !h.is_empty())
            .ok_or_else(|| WireError::BadAddr(addr.to_string()))?;
        let dial = async {
            let mut conn = tls::dial(self.tls.as_ref(), host, port).await?;
            conn.write_all(PREFACE).await?;
            Ok(conn)
        };
        let conn = tokio::time::timeout(self.connect_timeout, dial)
            .await
            .map_err(|_| failed(std::io::ErrorKind::TimedOut.into()))?
            .map_err(failed)?;
        Ok((conn, Instant::now()))
    }
}

/// Whether an idle connection is still usable: a decode node sends nothing unasked, so a
/// connection with anything to read (its close, a reset) is done.
fn open(conn: &mut Conn) -> bool {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut byte = [0u8; 1];
    let mut buf = ReadBuf::new(&mut byte);
    matches!(Pin::new(conn).poll_read(&mut cx, &mut buf), Poll::Pending)
}

async fn stall(f: impl std::future::Future<Output = std::io::Result<()>>) -> Result<(), WireError> {
    tokio::time::timeout(STALL, f)
        .await
        .map_err(|_| WireError::Stalled(STALL))?
        .map_err(WireError::from)
}

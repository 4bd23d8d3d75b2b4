//! The KV data plane: a prefill node's transfer of one request's KV cache to a decode node,
//! on a connection of its own beside gRPC. It shares the decode node's port: the node tells
//! the two apart by a connection's first bytes ([`PREFACE`]), after TLS when TLS is on.
//!
//! gRPC copied every chunk into its encode buffer on the sending side and into its decode
//! buffer on the receiving side. Here a chunk goes from the cache's export to the socket,
//! and from the socket into one buffer the receiver reuses, then into the cache.
//!
//! The wire, little-endian. The dialer opens with [`PREFACE`], then sends transfers one
//! after another, each as frames of `kind: u8, len: u32, body`: a header (protobuf
//! `KvHeader`), the chunks (`layer, start, positions, k_len: u32`, then K, then V), and the
//! first tokens (protobuf `FirstTokens`), which end the transfer. The receiver answers each
//! transfer with one frame: an acknowledgement (protobuf `TransferAck`) once the cache is
//! rebuilt, or a refusal (a gRPC status code as `i32`, then its message), after which it
//! closes the connection.

mod client;
pub mod convert;

pub use client::Client;

use std::io;
use std::time::Duration;

use prost::Message;
use proto::v1::{FirstTokens, KvHeader, TransferAck};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The first bytes of a data-plane connection. No HTTP request or HTTP/2 preface starts
/// with a lowercase letter.
pub const PREFACE: &[u8] = b"tandem-kv/1\n";

const HEADER: u8 = 1;
const CHUNK: u8 = 2;
const FIRST: u8 = 3;
const ACK: u8 = 4;
const REFUSED: u8 = 5;

/// A chunk's fixed fields: layer, start, positions, K's length.
const CHUNK_FIELDS: usize = 16;
/// Frame kind and body length.
const FRAME_PREFIX: usize = 5;

/// One piece of a transfer, in the order it is sent: the header, the chunks, the first
/// tokens.
#[derive(Debug, Clone)]
pub enum Item {
    Header(KvHeader),
    Chunk(engine::KvChunk),
    First(FirstTokens),
}

/// What went wrong on a data-plane connection.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("{0} is not a host:port address")]
    BadAddr(String),
    #[error("connecting to {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("the connection broke: {0}")]
    Io(#[from] io::Error),
    #[error("the connection closed in the middle of a frame")]
    Truncated,
    #[error("a frame of {len} bytes is over the {max} this connection takes now")]
    TooLarge { len: usize, max: usize },
    #[error("{0}")]
    Malformed(String),
    #[error("nothing arrived for {} ms", .0.as_millis())]
    Quiet(Duration),
    #[error("the peer stopped reading for {} ms", .0.as_millis())]
    Stalled(Duration),
    #[error("the transfer was abandoned before its first tokens")]
    Abandoned,
    #[error("{}", .0.message())]
    Refused(tonic::Status),
}

impl From<WireError> for tonic::Status {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Refused(status) => status,
            WireError::BadAddr(_) => tonic::Status::invalid_argument(e.to_string()),
            WireError::Quiet(_) => tonic::Status::deadline_exceeded(e.to_string()),
            // A broken or silent peer: another decode node may serve the request.
            _ => tonic::Status::unavailable(e.to_string()),
        }
    }
}

/// A frame's kind and body length, from its prefix.
fn split_prefix(p: [u8; FRAME_PREFIX]) -> (u8, usize) {
    (p[0], u32::from_le_bytes([p[1], p[2], p[3], p[4]]) as usize)
}

fn frame_prefix(kind: u8, len: usize) -> io::Result<[u8; FRAME_PREFIX]> {
    let len = u32::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a frame over 4 GiB"))?;
    let mut p = [kind, 0, 0, 0, 0];
    p[1..].copy_from_slice(&len.to_le_bytes());
    Ok(p)
}

async fn write_message<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: u8,
    m: &impl Message,
) -> io::Result<()> {
    let mut buf = Vec::with_capacity(FRAME_PREFIX + m.encoded_len());
    buf.extend_from_slice(&frame_prefix(kind, m.encoded_len())?);
    m.encode(&mut buf).expect("a Vec grows as needed");
    w.write_all(&buf).await
}

/// Writes one item as its frame; a chunk's K and V go from their own buffers to the socket.
pub async fn write_item<W: AsyncWrite + Unpin>(w: &mut W, item: &Item) -> io::Result<()> {
    match item {
        Item::Header(h) => write_message(w, HEADER, h).await,
        Item::Chunk(c) => {
            let mut head = [0u8; FRAME_PREFIX + CHUNK_FIELDS];
            head[..FRAME_PREFIX]
                .copy_from_slice(&frame_prefix(CHUNK, CHUNK_FIELDS + c.k.len() + c.v.len())?);
            let fields = [c.layer, c.start, c.len, c.k.len() as u32];
            for (at, f) in head[FRAME_PREFIX..].chunks_exact_mut(4).zip(fields) {
                at.copy_from_slice(&f.to_le_bytes());
            }
            w.write_all(&head).await?;
            w.write_all(&c.k).await?;
            w.write_all(&c.v).await
        }
        Item::First(f) => write_message(w, FIRST, f).await,
    }
}

/// Answers a transfer: its cache is rebuilt.
pub async fn write_ack<W: AsyncWrite + Unpin>(w: &mut W, ack: &TransferAck) -> io::Result<()> {
    write_message(w, ACK, ack).await?;
    w.flush().await
}

/// Answers a transfer with why it was refused.
pub async fn write_refusal<W: AsyncWrite + Unpin>(
    w: &mut W,
    status: &tonic::Status,
) -> io::Result<()> {
    let msg = status.message().as_bytes();
    let mut buf = Vec::with_capacity(FRAME_PREFIX + 4 + msg.len());
    buf.extend_from_slice(&frame_prefix(REFUSED, 4 + msg.len())?);
    buf.extend_from_slice(&(status.code() as i32).to_le_bytes());
    buf.extend_from_slice(msg);
    w.write_all(&buf).await?;
    w.flush().await
}

/// One frame as the receiver reads it. A chunk's K and V are not read with it: the
/// receiver reads them with [`Reader::payload`] straight into where they go, before the
/// next frame.
#[derive(Debug)]
pub enum Frame {
    Header(KvHeader),
    Chunk(ChunkHead),
    First(FirstTokens),
}

/// A chunk's fixed fields; `k_len` bytes of K and then `v_len` of V follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHead {
    pub layer: u32,
    pub start: u32,
    pub len: u32,
    pub k_len: usize,
    pub v_len: usize,
}

/// The largest frames a reader takes now: a message (a header, the first tokens), which it
/// buffers, and a chunk, whose payload goes where the caller says.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub message: usize,
    pub chunk: usize,
}

/// Reads frames off a connection. Headers and first tokens go into one buffer that it
/// reuses, grown as bytes arrive (so a length that lies costs what was sent, not what was
/// claimed); chunk payloads go where the caller says.
pub struct Reader<R> {
    io: R,
    buf: Vec<u8>,
}

/// The most a frame body grows the buffer before more of it has arrived.
const GROW: usize = 1 << 20;

impl<R: AsyncRead + Unpin> Reader<R> {
    /// A reader of `io`.
    pub fn new(io: R) -> Self {
        Self {
            io,
            buf: Vec::new(),
        }
    }

    /// The next frame, or `None` when the sender closed the connection between frames. Its
    /// first byte may take as long as `wait` allows (`None`: as long as the sender keeps
    /// the connection); every later read must come within `quiet`. A frame over its kind's
    /// limit is refused before its body is read.
    pub async fn next(
        &mut self,
        wait: Option<Duration>,
        quiet: Duration,
        limits: Limits,
    ) -> Result<Option<Frame>, WireError> {
        let mut prefix = [0u8; FRAME_PREFIX];
        let first = self.io.read(&mut prefix);
        let n = match wait {
            Some(w) => tokio::time::timeout(w, first)
                .await
                .map_err(|_| WireError::Quiet(w))??,
            None => first.await?,
        };
        if n == 0 {
            return Ok(None);
        }
        read_quiet(&mut self.io, &mut prefix[n..], quiet).await?;
        let (kind, len) = split_prefix(prefix);
        let limit = if kind == CHUNK {
            limits.chunk
        } else {
            limits.message
        };
        if len > limit {
            return Err(WireError::TooLarge { len, max: limit });
        }
        let malformed = |what: &str| WireError::Malformed(format!("{what} that does not decode"));
        if kind == CHUNK {
            if len < CHUNK_FIELDS {
                return Err(WireError::Malformed(format!("a chunk of {len} bytes")));
            }
            let mut fields = [0u8; CHUNK_FIELDS];
            read_quiet(&mut self.io, &mut fields, quiet).await?;
            let field =
                |i: usize| u32::from_le_bytes(fields[4 * i..4 * i + 4].try_into().expect("four"));
            let (k_len, payload) = (field(3) as usize, len - CHUNK_FIELDS);
            if k_len > payload {
                return Err(WireError::Malformed(format!(
                    "a chunk whose K of {k_len} bytes exceeds its {payload} payload bytes"
                )));
            }
            return Ok(Some(Frame::Chunk(ChunkHead {
                layer: field(0),
                start: field(1),
                len: field(2),
                k_len,
                v_len: payload - k_len,
            })));
        }
        self.fill(len, quiet).await?;
        let body = &self.buf[..len];
        Ok(Some(match kind {
            HEADER => Frame::Header(KvHeader::decode(body).map_err(|_| malformed("a header"))?),
            FIRST => Frame::First(
                FirstTokens::decode(body).map_err(|_| malformed("a first-tokens frame"))?,
            ),
            other => return Err(WireError::Malformed(format!("a frame of kind {other}"))),
        }))
    }

    /// Reads the payload of the chunk [`next`](Self::next) just returned into `runs`, in
    /// order; their lengths must add up to its `k_len + v_len`. Each read must come within
    /// `quiet`.
    pub async fn payload(
        &mut self,
        runs: &mut [&mut [u8]],
        quiet: Duration,
    ) -> Result<(), WireError> {
        for run in runs {
            read_quiet(&mut self.io, run, quiet).await?;
        }
        Ok(())
    }

    /// Reads `len` bytes into the front of the buffer.
    async fn fill(&mut self, len: usize, quiet: Duration) -> Result<(), WireError> {
        let mut got = 0;
        while got < len {
            if self.buf.len() == got {
                let grow = got.clamp(4096, GROW).min(len - got);
                self.buf.resize(got + grow, 0);
            }
            let end = self.buf.len().min(len);
            let n = within(quiet, async {
                Ok(self.io.read(&mut self.buf[got..end]).await?)
            })
            .await?;
            if n == 0 {
                return Err(WireError::Truncated);
            }
            got += n;
        }
        Ok(())
    }

    /// Lets go of the buffer a large header grew, between transfers.
    pub fn shrink(&mut self) {
        self.buf = Vec::new();
    }

    /// Reads and drops whatever the sender still sends, for at most `limit`, so that
    /// closing the connection after a refusal does not reset it before the sender has read
    /// the refusal.
    pub async fn drain(&mut self, limit: Duration) {
        let mut sink = [0u8; 16 << 10];
        let _ = tokio::time::timeout(limit, async {
            while matches!(self.io.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await;
    }
}

/// Fills `buf`, each read within `quiet`.
async fn read_quiet<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut [u8],
    quiet: Duration,
) -> Result<(), WireError> {
    let mut got = 0;
    while got < buf.len() {
        let n = within(quiet, async { Ok(r.read(&mut buf[got..]).await?) }).await?;
        if n == 0 {
            return Err(WireError::Truncated);
        }
        got += n;
    }
    Ok(())
}

async fn within<T>(
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, WireError>>,
) -> Result<T, WireError> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| WireError::Quiet(limit))?
}

async fn read_full<R: AsyncRead + Unpin>(r: &mut R, buf: &mut [u8]) -> Result<(), WireError> {
    match r.read_exact(buf).await {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(WireError::Truncated),
        Err(e) => Err(e.into()),
    }
}

/// Largest answer a receiver sends: a refusal's message.
const MAX_REPLY: usize = 64 << 10;

/// Reads the receiver's answer to a transfer: its acknowledgement, or its refusal as
/// [`WireError::Refused`].
pub async fn read_reply<R: AsyncRead + Unpin>(r: &mut R) -> Result<TransferAck, WireError> {
    let mut prefix = [0u8; FRAME_PREFIX];
    read_full(r, &mut prefix).await?;
    let (kind, len) = split_prefix(prefix);
    if len > MAX_REPLY {
        return Err(WireError::Malformed(format!(
            "an answer of {len} bytes, over the {MAX_REPLY} an answer may take"
        )));
    }
    let mut body = vec![0u8; len];
    read_full(r, &mut body).await?;
    match kind {
        ACK => TransferAck::decode(body.as_slice())
            .map_err(|_| WireError::Malformed("an acknowledgement that does not decode".into())),
        REFUSED if len >= 4 => {
            let code = i32::from_le_bytes(body[..4].try_into().expect("four bytes"));
            let msg = String::from_utf8_lossy(&body[4..]).into_owned();
            Err(WireError::Refused(tonic::Status::new(code.into(), msg)))
        }
        other => Err(WireError::Malformed(format!("an answer of kind {other}"))),
    }
}

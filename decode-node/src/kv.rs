//! The KV data plane of a decode node: transfers from prefill nodes, each admitted only with
//! the ticket this node issued when it reserved the request's memory (see `store`).
//!
//! What a peer on this port can cost the node without a ticket: a task and the bytes of one
//! header (at most [`KvLimits::max_header`]) for at most [`KvLimits::header`]. Nothing is
//! allocated for a cache before its ticket is redeemed; the cache is then allocated once,
//! at the size reserved, and chunks are read from the socket straight into it. A transfer
//! must keep sending (each read within `quiet`) and end within a deadline that grows with
//! its size; at most `max_transfers` are received at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use engine::{KvAssembler, KvLayout};
use proto::limits::MAX_SEQUENCES;
use proto::v1::{KvHeader, TransferAck};
use tokio::io::{AsyncRead, AsyncWriteExt};
use tokio::sync::Semaphore;
use tonic::Status;
use tracing::Instrument;

use crate::error::DecodeError;
use crate::metrics::DecodeMetrics;
use crate::store::{Arrived, Redeemed, Tickets};
use runtime::prom::Observe;

/// How long a refused sender may take to read the refusal and close.
const REFUSAL_DRAIN: Duration = Duration::from_secs(2);
/// Largest first-tokens frame: 128 tokens with 20 alternatives each take about 40 KB.
const MAX_FIRST_FRAME: usize = 256 << 10;
/// A chunk's fixed fields, beside its K and V.
const CHUNK_FIELDS: usize = 16;

/// The data plane's deadlines and caps.
#[derive(Debug, Clone, Copy)]
pub struct KvLimits {
    /// A new connection's first header must be whole within this; so must each later
    /// header once its first byte came.
    pub header: Duration,
    /// How long a connection may idle between transfers.
    pub idle: Duration,
    /// Each read of a transfer must come within this.
    pub quiet: Duration,
    /// A transfer must average at least this many bytes a second beyond `quiet`.
    pub min_rate: u64,
    /// Largest header frame.
    pub max_header: usize,
    /// Transfers received at once; more wait (each read still within `quiet`).
    pub max_transfers: usize,
}

impl KvLimits {
    /// The longest a transfer of `bytes` may take from its header to its first tokens.
    pub fn deadline(&self, bytes: u64) -> Duration {
        self.quiet + Duration::from_secs_f64(bytes as f64 / self.min_rate.max(1) as f64)
    }

    /// The largest header a model of `max_positions` sends: its prompt's token ids (at
    /// most five bytes each) and a kilobyte for the rest.
    pub fn header_bytes(max_positions: usize) -> usize {
        max_positions.saturating_mul(5).saturating_add(1 << 10)
    }
}

/// Receives transfers into the caches their tickets reserved.
pub struct KvPlane {
    tickets: Arc<Tickets>,
    layout: KvLayout,
    /// Where the model's caches live: a received cache moves there before its delivery.
    device: Device,
    metrics: Arc<DecodeMetrics>,
    gate: runtime::Gate,
    limits: KvLimits,
    transfers: Arc<Semaphore>,
}

impl KvPlane {
    /// A data plane redeeming `tickets` for caches of `layout` on `device`.
    pub fn new(
        tickets: Arc<Tickets>,
        layout: KvLayout,
        device: Device,
        metrics: Arc<DecodeMetrics>,
        gate: runtime::Gate,
        limits: KvLimits,
    ) -> Self {
        Self {
            tickets,
            layout,
            device,
            metrics,
            gate,
            transfers: Arc::new(Semaphore::new(limits.max_transfers.max(1))),
            limits,
        }
    }

    /// Transfers being received now.
    pub fn receiving(&self) -> usize {
        self.limits
            .max_transfers
            .max(1)
            .saturating_sub(self.transfers.available_permits())
    }

    /// Serves one data-plane connection: transfers one after another, each answered,
    /// until the sender closes it, idles past its limit, or a transfer fails (answered,
    /// then closed).
    pub async fn serve(&self, conn: runtime::Sniffed) {
        let peer = conn.peer_addr().ok();
        let identity = conn.identity();
        let (r, mut w) = tokio::io::split(conn);
        if !identity.may(&[tls::Role::Prefill]) {
            // Under mutual TLS only a prefill node's certificate may send KV: a router's or
            // a decode node's (or any other the CA signed) is refused before its header.
            tracing::debug!(
                ?identity,
                ?peer,
                "KV connection refused: not a prefill node"
            );
            self.metrics.kv_refused.increment(1);
            let status = proto::error_status(
                tonic::Code::PermissionDenied,
                format!(
                    "only a certificate with {} may send KV; this one carries {identity:?}",
                    tls::Role::Prefill.uri()
                ),
                proto::v1::ErrorReason::Forbidden,
            );
            let _ = kvwire::write_refusal(&mut w, &status).await;
            let _ = w.shutdown().await;
            return;
        }
        let mut reader = kvwire::Reader::new(r);
        let limits = self.limits;
        // A new connection's header must come whole within the header deadline; between
        // transfers the first byte may take the idle limit.
        let (mut wait, mut whole) = (limits.header, limits.header);
        loop {
            // A chunk's payload is not read before a header: its fields are enough to
            // refuse it.
            let header_only = kvwire::Limits {
                message: limits.max_header,
                chunk: usize::MAX,
            };
            let header =
                tokio::time::timeout(whole, reader.next(Some(wait), limits.quiet, header_only))
                    .await;
            let header = match header {
                Ok(Ok(None)) => return,
                Ok(Ok(Some(kvwire::Frame::Header(h)))) => Ok(h),
                Ok(Ok(Some(_))) => Err(DecodeError::BadTransfer(
                    "a transfer must start with its header".into(),
                )),
                // Idle past the limit between transfers: the sender dials again.
                Ok(Err(kvwire::WireError::Quiet(_))) if wait == limits.idle => return,
                Ok(Err(e)) => Err(DecodeError::BadTransfer(e.to_string())),
                Err(_) => Err(DecodeError::BadTransfer(format!(
                    "no whole header within {} ms",
                    limits.header.as_millis()
                ))),
            };
            reader.shrink();
            let header_failed = header.is_err();
            let (span, outcome) = match header {
                Ok(h) => {
                    let span = transfer_span(&h);
                    let outcome = self.transfer(h, &mut reader).instrument(span.clone()).await;
                    (span, outcome)
                }
                Err(e) => (tracing::Span::none(), Err(e)),
            };
            match outcome {
                Ok(ack) => {
                    if kvwire::write_ack(&mut w, &ack).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    // A peer that never presented a valid ticket is counted, not logged
                    // one line each: a flood of them must not flood the log.
                    if header_failed || matches!(e, DecodeError::BadTicket) {
                        tracing::debug!(error = %e, ?peer, "KV connection refused");
                        self.metrics.kv_refused.increment(1);
                    } else {
                        span.in_scope(|| tracing::warn!(error = %e, ?peer, "KV transfer refused"));
                        self.metrics.transfer_failures.increment(1);
                    }
                    let _ = kvwire::write_refusal(&mut w, &Status::from(e)).await;
                    // The sender may still be writing: read what it sends until it has
                    // seen the refusal and closed, so that closing here resets nothing
                    // it has not read.
                    let _ = w.shutdown().await;
                    reader.drain(REFUSAL_DRAIN).await;
                    return;
                }
            }
            (wait, whole) = (limits.idle, limits.idle + limits.header);
        }
    }

    /// Redeems a header's ticket, then receives its transfer into the reserved cache and
    /// hands it to the waiting Generate call. A failure after the ticket is redeemed also
    /// fails that call: its ticket is spent.
    async fn transfer<R: AsyncRead + Unpin>(
        &self,
        header: KvHeader,
        reader: &mut kvwire::Reader<R>,
    ) -> Result<TransferAck, DecodeError> {
        let Redeemed {
            reserved,
            lease,
            deliver,
        } = self.tickets.redeem(&header.request_id, &header.ticket)?;
        // A request admitted here: a drain waits for it.
        let _pass = self.gate.track();
        let started = Instant::now();
        let mut bytes = 0;
        let received = async {
            let layout = header
                .layout
                .as_ref()
                .ok_or_else(|| DecodeError::BadTransfer("the header has no layout".into()))
                .and_then(|l| {
                    kvwire::convert::layout_from_proto(l)
                        .map_err(|e| DecodeError::BadTransfer(e.to_string()))
                })?;
            if layout != self.layout {
                return Err(DecodeError::BadTransfer(format!(
                    "layout {layout:?} does not match this node's {:?}",
                    self.layout
                )));
            }
            if header.tokens.len() != reserved.prompt
                || (header.max_tokens as usize).saturating_sub(1) > reserved.max_new
            {
                return Err(DecodeError::BeyondReservation(format!(
                    "{} prompt positions and {} tokens, for a reservation of {} and {}",
                    header.tokens.len(),
                    header.max_tokens,
                    reserved.prompt,
                    reserved.max_new + 1
                )));
            }
            let size = 2
                * (reserved.prompt * self.layout.n_layers * self.layout.bytes_per_token_layer())
                    as u64;
            let deadline = self.limits.deadline(size);
            tokio::time::timeout(deadline, async {
                let _slot = tokio::time::timeout(self.limits.quiet, self.transfers.acquire())
                    .await
                    .map_err(|_| DecodeError::BadTransfer("no transfer slot came free".into()))?
                    .map_err(|_| DecodeError::ShuttingDown)?;
                // In host memory, where the wire's bytes are written in place.
                let asm =
                    KvAssembler::new(layout, header.tokens, reserved.positions, &Device::Cpu)?;
                let (cache, first) = self.chunks(asm, reader, &deliver, &mut bytes).await?;
                Ok((self.onto_device(cache).await?, first))
            })
            .await
            .map_err(|_| DecodeError::TransferDeadline(deadline.as_millis() as u64))?
        }
        .await;
        match received {
            Ok((cache, first_tokens)) => {
                let took = started.elapsed();
                tracing::debug!(bytes, ms = took.as_secs_f64() * 1e3, "KV received");
                self.metrics.transfers.increment(1);
                self.metrics.transfer_duration.observe(took);
                self.metrics.transfer_bytes.increment(bytes);
                // The call may have gone meanwhile: then the cache and its reservation
                // go with the unsent delivery.
                let _ = deliver.send(Ok(Arrived {
                    cache,
                    first_tokens,
                    lease,
                }));
                Ok(TransferAck { bytes })
            }
            Err(e) => {
                let _ = deliver.send(Err(DecodeError::TransferFailed {
                    id: header.request_id,
                    reason: e.to_string(),
                }));
                Err(e)
            }
        }
    }

    /// A received cache in the model's memory. On a GPU it is copied there now, on a
    /// blocking thread: a long prompt's cache is hundreds of MB, which the scheduler would
    /// otherwise copy on its own thread at admission, between two steps of every sequence
    /// it runs.
    async fn onto_device(&self, cache: engine::SeqCache) -> Result<engine::SeqCache, DecodeError> {
        if self.device.is_cpu() {
            return Ok(cache);
        }
        let device = self.device.clone();
        tokio::task::spawn_blocking(move || cache.into_device(&device))
            .await
            .map_err(|e| DecodeError::Internal(format!("moving a received cache: {e}")))?
            .map_err(DecodeError::from)
    }

    /// Reads a transfer's chunks straight into `asm` until its first tokens.
    async fn chunks<R: AsyncRead + Unpin>(
        &self,
        mut asm: KvAssembler,
        reader: &mut kvwire::Reader<R>,
        deliver: &tokio::sync::oneshot::Sender<crate::store::Delivery>,
        bytes: &mut u64,
    ) -> Result<(engine::SeqCache, Vec<engine::Sampled>), DecodeError> {
        let bad = |m: String| DecodeError::BadTransfer(m);
        let quiet = self.limits.quiet;
        let limits = kvwire::Limits {
            message: MAX_FIRST_FRAME,
            // The largest chunk a cache of this prompt takes: one layer's K and V whole.
            chunk: CHUNK_FIELDS + 2 * asm.expected() * self.layout.bytes_per_token_layer(),
        };
        loop {
            if deliver.is_closed() {
                return Err(DecodeError::Abandoned);
            }
            let frame = match reader.next(Some(quiet), quiet, limits).await {
                Ok(Some(f)) => f,
                Ok(None) => return Err(bad("the transfer ended before its first token".into())),
                Err(kvwire::WireError::Quiet(q)) => {
                    return Err(DecodeError::Quiet(q.as_millis() as u64))
                }
                Err(e) => return Err(bad(format!("the transfer broke: {e}"))),
            };
            match frame {
                kvwire::Frame::Chunk(c) => {
                    let mut write = asm.chunk(c.layer, c.start, c.len, c.k_len, c.v_len)?;
                    reader
                        .payload(write.runs(), quiet)
                        .await
                        .map_err(|e| match e {
                            kvwire::WireError::Quiet(q) => DecodeError::Quiet(q.as_millis() as u64),
                            e => bad(format!("the transfer broke: {e}")),
                        })?;
                    write.done();
                    *bytes += (c.k_len + c.v_len) as u64;
                }
                kvwire::Frame::First(f) => {
                    if !asm.is_complete() {
                        return Err(bad("the first token came before the whole cache".into()));
                    }
                    if f.tokens.is_empty() || f.tokens.len() > MAX_SEQUENCES {
                        return Err(bad(format!(
                            "a transfer carries 1 to {MAX_SEQUENCES} first tokens"
                        )));
                    }
                    let first = f
                        .tokens
                        .iter()
                        .map(kvwire::convert::token_from_proto)
                        .collect();
                    return Ok((asm.finish()?, first));
                }
                kvwire::Frame::Header(_) => return Err(bad("a second header".into())),
            }
        }
    }
}

/// The span of one transfer, from its header on: a child of the sender's span when the
/// header names one.
fn transfer_span(header: &KvHeader) -> tracing::Span {
    let span = tracing::info_span!("kv_transfer", req_id = %header.request_id,
        tokens = runtime::otel::count(header.tokens.len()));
    runtime::otel::follow(&span, &header.traceparent);
    span
}

//! The `tandem.v1.Decode` service: takes KV transfers into the store and turns Generate
//! calls into admissions for the compute thread.

use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use engine::{KvAssembler, KvLayout};
use proto::v1::{GenerateEvent, GenerateRequest, HealthReply, HealthRequest, TransferAck};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::error::DecodeError;
use crate::metrics::DecodeMetrics;
use crate::scheduler::{Admission, Budget, Start};
use crate::store::{Arrived, TransferStore};

/// Most sequences one request may decode (the seeds' n and best_of limit).
const MAX_SEQUENCES: usize = 128;
/// How long a refused sender may take to read the refusal and close.
const REFUSAL_DRAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// State shared by the service's handlers.
pub struct DecodeService {
    admissions: mpsc::UnboundedSender<Admission>,
    store: Arc<TransferStore>,
    layout: KvLayout,
    metrics: Arc<DecodeMetrics>,
    gate: runtime::Gate,
    max_frame: usize,
    budget: Budget,
}

impl DecodeService {
    /// A service feeding `admissions`, holding transfers in `store`, taking KV frames of
    /// at most `max_frame` bytes into caches sized by `budget`.
    pub fn new(
        admissions: mpsc::UnboundedSender<Admission>,
        store: Arc<TransferStore>,
        layout: KvLayout,
        metrics: Arc<DecodeMetrics>,
        gate: runtime::Gate,
        max_frame: usize,
        budget: Budget,
    ) -> Self {
        Self {
            admissions,
            store,
            layout,
            metrics,
            gate,
            max_frame,
            budget,
        }
    }

    /// Serves one KV data-plane connection: transfers one after another, each answered,
    /// until the sender closes it or a transfer fails (answered, then closed).
    pub async fn serve_kv(&self, conn: runtime::Sniffed) {
        let peer = conn.peer_addr().ok();
        let (r, mut w) = tokio::io::split(conn);
        let mut reader = kvwire::Reader::new(r, self.max_frame);
        loop {
            let mut id = String::new();
            let mut bytes = 0;
            let span = tracing::info_span!("kv_transfer", req_id = tracing::field::Empty);
            // Between transfers the connection idles for as long as the sender keeps it.
            let header = match reader.next(None, self.store.timeout()).await {
                Ok(None) => return,
                Ok(Some(kvwire::Frame::Header(h))) => Ok(h),
                Ok(Some(_)) => Err(DecodeError::BadTransfer(
                    "a transfer must start with its header".into(),
                )),
                Err(e) => Err(DecodeError::BadTransfer(e.to_string())),
            };
            // A transfer belongs to a request already admitted here, so a drain still takes it.
            let _pass = self.gate.track();
            let started = Instant::now();
            let outcome = match header {
                Ok(h) => {
                    id = h.request_id.clone();
                    span.record("req_id", id.as_str());
                    self.receive(h, &mut reader, &mut bytes)
                        .instrument(span.clone())
                        .await
                }
                Err(e) => Err(e),
            };
            match span.in_scope(|| self.settle(&id, outcome, started, bytes, peer)) {
                Ok(ack) => {
                    if kvwire::write_ack(&mut w, &ack).await.is_err() {
                        return;
                    }
                }
                Err(status) => {
                    let _ = kvwire::write_refusal(&mut w, &status).await;
                    // The sender may still be writing: read what it sends until it has
                    // seen the refusal and closed, so that closing here resets nothing
                    // it has not read.
                    let _ = w.shutdown().await;
                    reader.drain(REFUSAL_DRAIN).await;
                    return;
                }
            }
        }
    }

    /// Delivers a transfer's outcome to the store and counts it; the answer to send.
    fn settle(
        &self,
        id: &str,
        outcome: Result<Arrived, DecodeError>,
        started: Instant,
        bytes: u64,
        peer: Option<std::net::SocketAddr>,
    ) -> Result<TransferAck, Status> {
        match outcome {
            Ok(arrived) => {
                let took = started.elapsed();
                tracing::debug!(bytes, ms = took.as_secs_f64() * 1e3, "KV received");
                self.store.deliver(id, Ok(arrived));
                DecodeMetrics::inc(&self.metrics.transfers);
                DecodeMetrics::add(&self.metrics.transfer_micros, took.as_micros() as u64);
                DecodeMetrics::add(&self.metrics.transfer_bytes, bytes);
                Ok(TransferAck { bytes })
            }
            Err(e) => {
                tracing::warn!(error = %e, ?peer, "KV transfer failed");
                DecodeMetrics::inc(&self.metrics.transfer_failures);
                if !id.is_empty() {
                    self.store.deliver(id, Err(e.to_string()));
                }
                Err(e.into())
            }
        }
    }

    /// Reads one transfer after its header to its end; the caller delivers the outcome
    /// to the store.
    async fn receive<R: tokio::io::AsyncRead + Unpin>(
        &self,
        header: proto::v1::KvHeader,
        reader: &mut kvwire::Reader<R>,
        bytes: &mut u64,
    ) -> Result<Arrived, DecodeError> {
        let bad = |m: &str| DecodeError::BadTransfer(m.to_string());
        // A sender that goes quiet would otherwise hold its partial cache (and a drain) for
        // as long as it keeps the connection open; its Generate call has given up by then.
        let idle = self.store.timeout();
        let id = header.request_id;
        let layout = header
            .layout
            .as_ref()
            .map(proto::layout_from_proto)
            .ok_or_else(|| bad("the header has no layout"))?;
        if layout != self.layout {
            return Err(DecodeError::BadTransfer(format!(
                "layout {layout:?} does not match this node's {:?}",
                self.layout
            )));
        }
        // Sized for the whole sequence now, while the bytes arrive off the compute thread:
        // growing it there when decoding starts would copy the cache and stall the batch.
        let reserve = self
            .budget
            .positions(header.tokens.len(), header.max_new_tokens as usize);
        let mut assembler = KvAssembler::new(layout, header.tokens, reserve, &Device::Cpu)?;
        loop {
            let frame = match reader.next(Some(idle), idle).await {
                Ok(Some(f)) => f,
                Ok(None) => return Err(bad("the transfer ended before its first token")),
                Err(kvwire::WireError::Quiet(_)) => {
                    return Err(DecodeError::KvTimeout(id, idle.as_millis() as u64))
                }
                Err(e) => return Err(bad(&format!("the transfer broke: {e}"))),
            };
            match frame {
                kvwire::Frame::Chunk {
                    layer,
                    start,
                    len,
                    k,
                    v,
                } => {
                    *bytes += (k.len() + v.len()) as u64;
                    assembler.accept_parts(layer, start, len, k, v)?;
                }
                kvwire::Frame::First(f) => {
                    if !assembler.is_complete() {
                        return Err(bad("the first token came before the whole cache"));
                    }
                    if f.tokens.is_empty() || f.tokens.len() > MAX_SEQUENCES {
                        return Err(bad("a transfer carries 1 to 128 first tokens"));
                    }
                    return Ok(Arrived {
                        cache: assembler.finish()?,
                        first_tokens: f.tokens.iter().map(proto::token_from_proto).collect(),
                    });
                }
                kvwire::Frame::Header(_) => return Err(bad("a second header")),
            }
        }
    }
}

#[tonic::async_trait]
impl proto::v1::decode_server::Decode for DecodeService {
    type GenerateStream = runtime::Tracked<UnboundedReceiverStream<Result<GenerateEvent, Status>>>;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let pass = self.gate.admit()?;
        let id = runtime::request_id(&req, &req.get_ref().request_id);
        let req = req.into_inner();
        let span = tracing::info_span!("generate", req_id = %id, prefill_here = req.prefill_here);
        let n = (req.n as usize).max(1);
        if n > MAX_SEQUENCES {
            return Err(DecodeError::InvalidRequest(format!(
                "{n} sequences asked for, the limit is {MAX_SEQUENCES}"
            ))
            .into());
        }
        if req.beam_width as usize > MAX_SEQUENCES
            || (req.beam_width > 0 && n > req.beam_width as usize)
        {
            return Err(DecodeError::InvalidRequest(format!(
                "a beam search of width {} cannot return {n} hypotheses (width at most {MAX_SEQUENCES})",
                req.beam_width
            ))
            .into());
        }
        let (events, rx) = mpsc::unbounded_channel();
        let admission = Admission {
            span: span.clone(),
            prompt: req.prompt,
            sampling: req.sampling.as_ref().map(Into::into).unwrap_or_default(),
            top_logprobs: req.top_logprobs as usize,
            n,
            beam_width: req.beam_width as usize,
            max_new: req.max_new_tokens as usize,
            stop_ids: req.stop_token_ids,
            start: Start::Prefill,
            enqueued: Instant::now(),
            events,
            delayed: false,
        };
        if req.prefill_here {
            self.admissions
                .send(admission)
                .map_err(|_| Status::from(DecodeError::ShuttingDown))?;
        } else {
            // Claim in a task of its own so that the call returns at once and the store's
            // timeout, not the caller, bounds the wait.
            let store = Arc::clone(&self.store);
            let admissions = self.admissions.clone();
            tokio::spawn(
                async move {
                    let mut admission = admission;
                    let claimed = tokio::select! {
                        c = store.claim(&id) => c,
                        // The caller left (a retry elsewhere, a client gone): its claim
                        // goes, so the id is free and nothing waits for a cache nobody
                        // will read.
                        _ = admission.events.closed() => {
                            store.abandon(&id);
                            return;
                        }
                    };
                    match claimed {
                        // The cache must be the prompt's: a budget is reserved for this
                        // prompt, and a cache of other tokens would decode garbage.
                        Ok(a) if a.cache.tokens() != admission.prompt.as_slice() => {
                            let e = DecodeError::BadTransfer(format!(
                                "the KV cache covers {} tokens that are not this call's prompt of {}",
                                a.cache.len(),
                                admission.prompt.len()
                            ));
                            tracing::warn!(error = %e, "KV cache refused");
                            let _ = admission.events.send(Err(e.into()));
                        }
                        Ok(a) => {
                            admission.start = Start::Transferred {
                                cache: a.cache,
                                first_tokens: a.first_tokens,
                            };
                            admission.enqueued = Instant::now();
                            if let Err(mpsc::error::SendError(a)) = admissions.send(admission) {
                                let _ = a.events.send(Err(DecodeError::ShuttingDown.into()));
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "no KV cache");
                            let _ = admission.events.send(Err(e.into()));
                        }
                    }
                }
                .instrument(span),
            );
        }
        Ok(Response::new(runtime::Tracked::new(
            UnboundedReceiverStream::new(rx),
            pass,
        )))
    }

    async fn health(&self, _req: Request<HealthRequest>) -> Result<Response<HealthReply>, Status> {
        let m = &self.metrics;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        let capacity = get(&m.kv_blocks_capacity);
        Ok(Response::new(HealthReply {
            role: "decode".into(),
            layout: Some(proto::layout_to_proto(&self.layout)),
            draining: self.gate.draining(),
            load: Some(proto::v1::WorkerLoad {
                waiting: get(&m.waiting_requests) as u32,
                running: get(&m.running_sequences) as u32,
                kv_blocks_capacity: capacity,
                kv_blocks_free: capacity.saturating_sub(get(&m.kv_blocks_used)),
                kv_block_tokens: get(&m.kv_block_tokens) as u32,
            }),
        }))
    }
}

//! The `tandem.v1.Prefill` service: queues prompts for the compute thread and runs each
//! request's KV transfer to its decode node.

use std::sync::Arc;
use std::time::Instant;

use engine::KvLayout;
use proto::v1::{HealthReply, HealthRequest, KvHeader, PrefillRequest, PrefillResponse};
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::error::PrefillError;
use crate::metrics::PrefillMetrics;
use crate::worker::Job;

/// Transfer messages buffered between the compute thread and the network.
const TRANSFER_BUFFER: usize = 16;

/// State shared by the service's handlers.
pub struct PrefillService {
    jobs: mpsc::Sender<Job>,
    metrics: Arc<PrefillMetrics>,
    max_queue: usize,
    layout: KvLayout,
    max_positions: usize,
    kv: Arc<kvwire::Client>,
    gate: runtime::Gate,
}

impl PrefillService {
    /// A service feeding `jobs`, for a model with this cache layout and context.
    pub fn new(
        jobs: mpsc::Sender<Job>,
        metrics: Arc<PrefillMetrics>,
        max_queue: usize,
        layout: KvLayout,
        max_positions: usize,
        kv: kvwire::Client,
        gate: runtime::Gate,
    ) -> Self {
        Self {
            jobs,
            metrics,
            max_queue,
            layout,
            max_positions,
            kv: Arc::new(kv),
            gate,
        }
    }

    async fn run(&self, req: PrefillRequest) -> Result<PrefillResponse, PrefillError> {
        let enqueued = Instant::now();
        let n = req.prompt.len();
        if n == 0 {
            return Err(PrefillError::EmptyPrompt);
        }
        if n >= self.max_positions {
            return Err(PrefillError::PromptTooLong {
                got: n,
                limit: self.max_positions,
            });
        }
        if req.n > 128 {
            return Err(PrefillError::TooManySequences(req.n));
        }
        if req.decode_addr.is_empty() {
            return Err(PrefillError::NoDecodeAddr);
        }
        let (tx, rx) = mpsc::channel(TRANSFER_BUFFER);
        let header = KvHeader {
            request_id: req.request_id.clone(),
            layout: Some(proto::layout_to_proto(&self.layout)),
            tokens: req.prompt.clone(),
            max_new_tokens: req.max_new_tokens,
        };
        let (kv, addr) = (Arc::clone(&self.kv), req.decode_addr.clone());
        let transfer = tokio::spawn(
            async move { kv.transfer(&addr, header, rx).await }
                .instrument(tracing::Span::current()),
        );
        let (done_tx, done_rx) = oneshot::channel();
        let job = Job {
            prompt: req.prompt,
            sampling: req.sampling.as_ref().map(Into::into).unwrap_or_default(),
            top_logprobs: req.top_logprobs as usize,
            n: (req.n as usize).max(1),
            beam: req.beam_search,
            enqueued,
            span: tracing::Span::current(),
            transfer: tx,
            done: done_tx,
        };
        self.jobs.try_send(job).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => PrefillError::QueueFull(self.max_queue),
            mpsc::error::TrySendError::Closed(_) => PrefillError::ShuttingDown,
        })?;
        let computed = done_rx.await.map_err(|_| PrefillError::ShuttingDown)?;
        let transfer_error = |e: kvwire::WireError| PrefillError::Transfer {
            addr: req.decode_addr.clone(),
            status: e.into(),
        };
        let computed = match computed {
            Ok(c) => c,
            Err(PrefillError::TransferClosed) => {
                // The transfer call ended first; its status says why.
                return Err(match transfer.await {
                    Ok(Err(status)) => transfer_error(status),
                    _ => PrefillError::TransferClosed,
                });
            }
            Err(e) => return Err(e),
        };
        let ack = transfer
            .await
            .map_err(|_| PrefillError::TransferClosed)?
            .map_err(transfer_error)?;
        let prefill_time = computed.started.elapsed();
        // The part of the transfer the compute did not hide: its last layer's chunk and the
        // decode node's rebuild, up to the acknowledgement.
        let kv_tail = computed.computed_at.elapsed();
        PrefillMetrics::add(&self.metrics.kv_tail_micros, kv_tail.as_micros() as u64);
        tracing::info!(
            prefill_ms = prefill_time.as_secs_f64() * 1e3,
            kv_tail_ms = kv_tail.as_secs_f64() * 1e3,
            bytes = ack.bytes,
            "prefilled"
        );
        Ok(PrefillResponse {
            first: computed.first.iter().map(proto::token_to_proto).collect(),
            prefill_time_ms: prefill_time.as_secs_f64() * 1e3,
            queue_wait_us: computed.queue_wait.as_micros() as u64,
            cached_tokens: computed.cached_tokens as u32,
            batch_size: computed.batch_size as u32,
            transfer_bytes: ack.bytes,
        })
    }
}

#[tonic::async_trait]
impl proto::v1::prefill_server::Prefill for PrefillService {
    async fn prefill(
        &self,
        req: Request<PrefillRequest>,
    ) -> Result<Response<PrefillResponse>, Status> {
        let _pass = self.gate.admit()?;
        let id = runtime::request_id(&req, &req.get_ref().request_id);
        let req = req.into_inner();
        let span = tracing::info_span!("prefill", req_id = %id, prompt_tokens = req.prompt.len());
        let m = &self.metrics;
        match self.run(req).instrument(span).await {
            Ok(resp) => {
                PrefillMetrics::inc(&m.completed);
                PrefillMetrics::add(&m.transfer_bytes, resp.transfer_bytes);
                Ok(Response::new(resp))
            }
            Err(e) => {
                // A cancelled prefill never answers here: the compute thread counts it.
                let counter = match e {
                    PrefillError::QueueFull(_) => &m.rejected,
                    _ => &m.failed,
                };
                PrefillMetrics::inc(counter);
                Err(e.into())
            }
        }
    }

    async fn health(&self, _req: Request<HealthRequest>) -> Result<Response<HealthReply>, Status> {
        let m = &self.metrics;
        Ok(Response::new(HealthReply {
            role: "prefill".into(),
            layout: Some(proto::layout_to_proto(&self.layout)),
            draining: self.gate.draining(),
            load: Some(proto::v1::WorkerLoad {
                waiting: (self.max_queue - self.jobs.capacity()) as u32,
                running: m.running.load(std::sync::atomic::Ordering::Relaxed) as u32,
                ..Default::default()
            }),
        }))
    }
}

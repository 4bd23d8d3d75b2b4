//! The `tandem.v1.Prefill` service: queues prompts for the compute thread and runs each
//! request's KV transfer to its decode node.

use std::sync::Arc;
use std::time::Instant;

use engine::KvLayout;
use proto::v1::{
    HealthReply, HealthRequest, KvHeader, PrefillRequest, PrefillResponse, TransferAck,
};
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::error::PrefillError;
use crate::metrics::PrefillMetrics;
use crate::targets::DecodeTargets;
use crate::worker::{Computed, Job};
use runtime::prom::{Counter, Observe};

/// State shared by the service's handlers.
pub struct PrefillService {
    jobs: mpsc::Sender<Job>,
    metrics: Arc<PrefillMetrics>,
    max_queue: usize,
    layout: KvLayout,
    intake: intake::Intake,
    kv: Arc<kvwire::Client>,
    targets: DecodeTargets,
    gate: runtime::Gate,
    /// The model's name as routers know it (its folder or file name).
    model: String,
}

/// What a prefill node is given beside its queue: its model's shape, and where it may send
/// KV caches.
pub struct Setup {
    /// The model's name as routers know it ([`discovery::model_identity`]).
    pub model: String,
    pub layout: KvLayout,
    /// What requests are checked against, and what their grammars compile with.
    pub intake: intake::Intake,
    pub kv: kvwire::Client,
    pub targets: DecodeTargets,
}

impl PrefillService {
    /// A service feeding `jobs`.
    pub fn new(
        jobs: mpsc::Sender<Job>,
        metrics: Arc<PrefillMetrics>,
        max_queue: usize,
        setup: Setup,
        gate: runtime::Gate,
    ) -> Self {
        Self {
            jobs,
            metrics,
            max_queue,
            layout: setup.layout,
            intake: setup.intake,
            kv: Arc::new(setup.kv),
            targets: setup.targets,
            model: setup.model,
            gate,
        }
    }

    async fn run(&self, mut req: PrefillRequest) -> Result<PrefillResponse, PrefillError> {
        let enqueued = Instant::now();
        let asked = intake::Asked {
            prompt: &req.prompt,
            n: req.n,
            // A prefill node samples each of a beam's first tokens: its n is the width.
            beam_width: if req.beam_search { req.n.max(1) } else { 0 },
            top_logprobs: req.top_logprobs,
            resumed: req.resumed,
        };
        let checked = asked.check(self.intake.bounds)?;
        let sampler = self
            .intake
            .sampler(&checked, req.sampling.take(), &req.stop_token_ids)
            .await?;
        if req.kv_ticket.is_empty() {
            return Err(PrefillError::NoTicket);
        }
        self.targets.check(&req.decode_addr).await?;
        let transfer = self.transfer(&req);
        let (done_tx, done_rx) = oneshot::channel();
        let job = Job {
            prompt: req.prompt,
            sampling: sampler.params,
            constraint: sampler.constraint,
            top_logprobs: checked.top_logprobs,
            n: checked.sequences(),
            beam: checked.beam(),
            cache_partition: req.cache_partition,
            prompt_logprobs: req.prompt_logprobs,
            resumed: checked.resumed,
            enqueued,
            span: tracing::Span::current(),
            transfer: transfer.items,
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
                return Err(match transfer.call.await {
                    Ok(Err(status)) => transfer_error(status),
                    _ => PrefillError::TransferClosed,
                });
            }
            Err(e) => return Err(e),
        };
        let ack = transfer
            .call
            .await
            .map_err(|_| PrefillError::TransferClosed)?
            .map_err(transfer_error)?;
        Ok(self.response(computed, ack))
    }

    /// Starts the KV transfer of `req`'s cache to its decode node; the compute thread
    /// feeds it.
    fn transfer(&self, req: &PrefillRequest) -> Transfer {
        let (items, rx) = mpsc::unbounded_channel();
        let header = KvHeader {
            request_id: req.request_id.clone(),
            layout: Some(kvwire::convert::layout_to_proto(&self.layout)),
            tokens: req.prompt.clone(),
            max_tokens: req.max_tokens,
            ticket: req.kv_ticket.clone(),
            traceparent: runtime::otel::traceparent(&tracing::Span::current()),
        };
        let (kv, addr) = (Arc::clone(&self.kv), req.decode_addr.clone());
        let call = tokio::spawn(
            async move { kv.transfer(&addr, header, rx).await }
                .instrument(tracing::Span::current()),
        );
        Transfer { items, call }
    }

    /// The answer to a prefill whose cache the decode node acknowledged with `ack`.
    fn response(&self, computed: Computed, ack: TransferAck) -> PrefillResponse {
        let prefill_time = computed.started.elapsed();
        // The part of the transfer the compute did not hide: its last layer's chunk and the
        // decode node's rebuild, up to the acknowledgement.
        let kv_tail = computed.computed_at.elapsed();
        self.metrics.transfer_tail.observe(kv_tail);
        tracing::info!(
            prefill_ms = prefill_time.as_secs_f64() * 1e3,
            kv_tail_ms = kv_tail.as_secs_f64() * 1e3,
            bytes = ack.bytes,
            "prefilled"
        );
        let tokens =
            |t: &[engine::Sampled]| t.iter().map(kvwire::convert::token_to_proto).collect();
        PrefillResponse {
            first: tokens(&computed.first),
            prefill_time_ms: prefill_time.as_secs_f64() * 1e3,
            queue_wait_us: computed.queue_wait.as_micros() as u64,
            cached_tokens: computed.cached_tokens as u32,
            batch_size: computed.batch_size as u32,
            transfer_bytes: ack.bytes,
            prompt_logprobs: tokens(&computed.prompt_logprobs),
        }
    }
}

/// A request's KV transfer under way: where its items go, and the call that sends them.
struct Transfer {
    items: mpsc::UnboundedSender<kvwire::Item>,
    call: tokio::task::JoinHandle<Result<TransferAck, kvwire::WireError>>,
}

/// Counts one call's outcome: what it settles with, or, when the call goes away before
/// it settles (the router cancelled it), a cancellation.
struct Outcome<'a> {
    metrics: &'a PrefillMetrics,
    settled: bool,
}

impl Outcome<'_> {
    fn settle(mut self, counter: &Counter) {
        counter.increment(1);
        self.settled = true;
    }
}

impl Drop for Outcome<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.metrics.cancelled.increment(1);
        }
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
        let (metadata, _, req) = req.into_parts();
        let span = tracing::info_span!("prefill", req_id = %id, kv_id = %req.request_id,
            prompt_tokens = runtime::otel::count(req.prompt.len()),
            cached_tokens = tracing::field::Empty);
        runtime::otel::follow_metadata(&span, &metadata);
        let m = &self.metrics;
        let outcome = Outcome {
            metrics: m,
            settled: false,
        };
        match self.run(req).instrument(span.clone()).await {
            Ok(resp) => {
                span.record("cached_tokens", runtime::otel::count(resp.cached_tokens));
                outcome.settle(&m.completed);
                m.transfer_bytes.increment(resp.transfer_bytes);
                Ok(Response::new(resp))
            }
            Err(e) => {
                outcome.settle(match e {
                    PrefillError::QueueFull(_) => &m.rejected,
                    _ => &m.failed,
                });
                Err(e.into())
            }
        }
    }

    async fn health(&self, _req: Request<HealthRequest>) -> Result<Response<HealthReply>, Status> {
        let m = &self.metrics;
        Ok(Response::new(HealthReply {
            role: "prefill".into(),
            model: self.model.clone(),
            engine_version: runtime::VERSION.into(),
            layout: Some(kvwire::convert::layout_to_proto(&self.layout)),
            draining: self.gate.draining(),
            load: Some(proto::v1::WorkerLoad {
                waiting: (self.max_queue - self.jobs.capacity()) as u32,
                running: m.running.load(std::sync::atomic::Ordering::Relaxed) as u32,
                ..Default::default()
            }),
        }))
    }
}

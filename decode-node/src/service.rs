//! The `tandem.v1.Decode` service: reserves each request's KV memory, issues the ticket of a
//! transferred cache, and turns Generate calls into admissions for the compute thread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::KvLayout;
use proto::v1::{
    generate_event::Event, EndSequenceReply, EndSequenceRequest, GenerateEvent, GenerateRequest,
    HealthReply, HealthRequest, KvReserved,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::budget::{KvBudget, Lease};
use crate::ended::Live;
use crate::error::DecodeError;
use crate::metrics::DecodeMetrics;
use crate::scheduler::{Admission, Events, Start};
use crate::store::{Reserved, Tickets};

/// What requests are checked against: the model's cache layout, its bounds and grammars,
/// and the batch.
pub struct Shape {
    /// The model's name as routers know it ([`discovery::model_identity`]).
    pub model: String,
    pub layout: KvLayout,
    /// What requests are checked against, and what their grammars compile with.
    pub intake: intake::Intake,
    /// Sequences one step runs (--max-batch-size): a request with more is refused, since it
    /// would run alone, over the bound, while every other request waits.
    pub max_batch: usize,
}

/// State shared by the service's handlers.
pub struct DecodeService {
    admissions: mpsc::UnboundedSender<Admission>,
    tickets: Arc<Tickets>,
    budget: Arc<KvBudget>,
    shape: Shape,
    metrics: Arc<DecodeMetrics>,
    gate: runtime::Gate,
    /// The running requests' sequences the router may end early.
    live: Arc<Live>,
    /// How long a Generate call waits for its transfer once its ticket is issued.
    kv_wait: Duration,
}

impl DecodeService {
    /// A service feeding `admissions`, reserving from `budget`, issuing `tickets`.
    pub fn new(
        admissions: mpsc::UnboundedSender<Admission>,
        tickets: Arc<Tickets>,
        budget: Arc<KvBudget>,
        shape: Shape,
        metrics: Arc<DecodeMetrics>,
        gate: runtime::Gate,
        kv_wait: Duration,
    ) -> Self {
        Self {
            admissions,
            tickets,
            budget,
            shape,
            metrics,
            gate,
            live: Arc::default(),
            kv_wait,
        }
    }

    /// Checks a Generate call and turns it into its admission, with the memory it
    /// reserves; its events go to `events`.
    async fn call(
        &self,
        mut req: GenerateRequest,
        span: tracing::Span,
        events: Events,
    ) -> Result<Call, DecodeError> {
        let asked = intake::Asked {
            prompt: &req.prompt,
            n: req.n,
            beam_width: req.beam_width,
            top_logprobs: req.top_logprobs,
            resumed: req.resumed,
        };
        // The batch bound is checked before a grammar compiles for the request.
        let checked = asked.check(self.shape.intake.bounds)?;
        let sequences = checked.sequences();
        if sequences > self.shape.max_batch {
            return Err(DecodeError::TooWide {
                sequences,
                max_batch: self.shape.max_batch,
            });
        }
        let sampler = self
            .shape
            .intake
            .sampler(&checked, req.sampling.take(), &req.stop_token_ids)
            .await?;
        let max_new = req.tokens_to_sample() as usize;
        let positions = self.budget.positions(req.prompt.len(), max_new);
        let reserved = Reserved {
            prompt: req.prompt.len(),
            max_new,
            positions,
        };
        let admission = Admission {
            span,
            prompt: req.prompt,
            sampling: sampler.params,
            constraint: sampler.constraint,
            top_logprobs: checked.top_logprobs,
            n: checked.n,
            beam_width: checked.beam_width,
            max_new,
            positions,
            stop_ids: req.stop_token_ids,
            prompt_logprobs: req.prompt_logprobs && req.prefill_here,
            resumed: checked.resumed,
            ended: self.live.register(&req.request_id, sequences),
            start: Start::Prefill,
            enqueued: Instant::now(),
            events,
            delayed: false,
            lease: Lease::default(),
        };
        Ok(Call {
            id: req.request_id,
            admission,
            prefill_here: req.prefill_here,
            reserved,
            blocks: self.budget.blocks_for(positions).saturating_mul(sequences),
        })
    }
}

/// What one Generate call needs once its memory is reserved.
struct Call {
    id: String,
    admission: Admission,
    prefill_here: bool,
    reserved: Reserved,
    blocks: usize,
}

/// Runs one call: reserves its memory (waiting in the budget's queue, and leaving it when
/// the caller goes), then either hands it to the compute thread (colocated) or issues its
/// ticket and waits for its transfer.
async fn run(
    call: Call,
    budget: Arc<KvBudget>,
    tickets: Arc<Tickets>,
    admissions: mpsc::UnboundedSender<Admission>,
    metrics: Arc<DecodeMetrics>,
    kv_wait: Duration,
) {
    let Call {
        id,
        mut admission,
        prefill_here,
        reserved,
        blocks,
    } = call;
    let events = admission.events.clone();
    let fail = |e: DecodeError| {
        let _ = events.send(Err(e.into()));
    };
    let lease = tokio::select! {
        l = budget.reserve(blocks) => l,
        // The caller left while the request queued: it leaves the queue.
        _ = events.closed() => {
            metrics.cancellations.increment(1);
            return;
        }
    };
    let (lease, waited) = match lease {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!("refused: {e}");
            metrics.rejected.increment(1);
            return fail(e);
        }
    };
    if waited {
        metrics.delayed.increment(1);
    }
    if !prefill_here {
        let prompt = &admission.prompt;
        match transferred(&id, prompt, reserved, lease, &tickets, &events, kv_wait).await {
            Ok((start, lease)) => {
                admission.start = start;
                admission.lease = lease;
                admission.enqueued = Instant::now();
            }
            Err(Some(e)) => {
                tracing::warn!(error = %e, "no KV cache");
                return fail(e);
            }
            Err(None) => {
                metrics.cancellations.increment(1);
                return;
            }
        }
    } else {
        admission.lease = lease;
    }
    if let Err(mpsc::error::SendError(a)) = admissions.send(admission) {
        let _ = a.events.send(Err(DecodeError::ShuttingDown.into()));
    }
}

/// Issues the ticket of a transferred cache, sends it to the caller, and waits for the
/// transfer: the cache with its first tokens and the reservation they hold, an error, or
/// `None` when the caller left.
async fn transferred(
    id: &str,
    prompt: &[u32],
    reserved: Reserved,
    lease: Lease,
    tickets: &Tickets,
    events: &Events,
    kv_wait: Duration,
) -> Result<(Start, Lease), Option<DecodeError>> {
    let (ticket, delivery) = tickets.issue(id, reserved, lease)?;
    let event = GenerateEvent {
        event: Some(Event::Reserved(KvReserved {
            ticket: ticket.to_vec(),
        })),
    };
    if events.send(Ok(event)).is_err() {
        tickets.withdraw(id);
        return Err(None);
    }
    let arrived = tokio::select! {
        d = tokio::time::timeout(kv_wait, delivery) => d,
        // The caller left (a retry elsewhere, a client gone): its ticket is withdrawn,
        // and its reservation goes back unless a transfer holds it now.
        _ = events.closed() => {
            tickets.withdraw(id);
            return Err(None);
        }
    };
    match arrived {
        // The cache must be the prompt's: a cache of other tokens would decode garbage.
        Ok(Ok(Ok(a))) if a.cache.tokens() != prompt => {
            Err(Some(DecodeError::BadTransfer(format!(
                "the KV cache covers {} tokens that are not this call's prompt",
                a.cache.len()
            ))))
        }
        Ok(Ok(Ok(a))) => Ok((
            Start::Transferred {
                cache: a.cache,
                first_tokens: a.first_tokens,
            },
            a.lease,
        )),
        Ok(Ok(Err(e))) => Err(Some(e)),
        // The transfer's task went away without an outcome: the node stops.
        Ok(Err(_)) => Err(Some(DecodeError::ShuttingDown)),
        Err(_) => {
            tickets.withdraw(id);
            Err(Some(DecodeError::KvTimeout(
                id.to_string(),
                kv_wait.as_millis() as u64,
            )))
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
        // Logged as the id the router names the request by (the client's, when it gave
        // one); the transfer is matched by the message's own id, unique per attempt.
        let logged = runtime::request_id(&req, &req.get_ref().request_id);
        let (metadata, _, req) = req.into_parts();
        let span = tracing::info_span!("generate", req_id = %logged, kv_id = %req.request_id,
            prefill_here = req.prefill_here, prompt_tokens = runtime::otel::count(req.prompt.len()),
            completion_tokens = tracing::field::Empty);
        runtime::otel::follow_metadata(&span, &metadata);
        let (events, rx) = mpsc::unbounded_channel();
        let call = self.call(req, span.clone(), events).await?;
        // In a task of its own, so that the call returns at once and its events stream
        // while it waits for memory or its transfer.
        tokio::spawn(
            run(
                call,
                Arc::clone(&self.budget),
                Arc::clone(&self.tickets),
                self.admissions.clone(),
                Arc::clone(&self.metrics),
                self.kv_wait,
            )
            .instrument(span),
        );
        Ok(Response::new(runtime::Tracked::new(
            UnboundedReceiverStream::new(rx),
            pass,
        )))
    }

    async fn end_sequence(
        &self,
        req: Request<EndSequenceRequest>,
    ) -> Result<Response<EndSequenceReply>, Status> {
        let req = req.into_inner();
        let found = self.live.end(&req.request_id, req.choice as usize);
        Ok(Response::new(EndSequenceReply { found }))
    }

    async fn health(&self, _req: Request<HealthRequest>) -> Result<Response<HealthReply>, Status> {
        let m = &self.metrics;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        let capacity = self.budget.capacity() as u64;
        Ok(Response::new(HealthReply {
            role: "decode".into(),
            model: self.shape.model.clone(),
            engine_version: runtime::VERSION.into(),
            layout: Some(kvwire::convert::layout_to_proto(&self.shape.layout)),
            draining: self.gate.draining(),
            load: Some(proto::v1::WorkerLoad {
                waiting: (get(&m.waiting_requests) as usize + self.budget.waiting()) as u32,
                running: get(&m.running_sequences) as u32,
                kv_blocks_capacity: capacity,
                kv_blocks_free: capacity.saturating_sub(self.budget.used() as u64),
                kv_block_tokens: self.budget.block_tokens() as u32,
                max_batch: self.shape.max_batch as u32,
            }),
        }))
    }
}

//! The compute thread: runs one prompt at a time and streams each layer's K/V as soon as
//! that layer is done, so the transfer overlaps the rest of the forward pass.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use engine::{EngineError, Model, Sampled, SamplingParams, SeqInput};
use proto::v1::{kv_transfer::Item, FirstTokens, KvTransfer};
use tokio::sync::{mpsc, oneshot};

use crate::error::PrefillError;
use crate::metrics::PrefillMetrics;

/// One prompt to run.
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub top_logprobs: usize,
    /// Sequences to start: one first token each.
    pub n: usize,
    /// Beam search: the n most likely first tokens instead of n samples.
    pub beam: bool,
    pub enqueued: Instant,
    pub span: tracing::Span,
    /// Where the chunks and then the first token go; dropping it without the first token
    /// tells the decode node the transfer failed.
    pub transfer: mpsc::Sender<KvTransfer>,
    pub done: oneshot::Sender<Result<Computed, PrefillError>>,
}

/// What a finished prefill reports.
#[derive(Debug)]
pub struct Computed {
    /// One first token per sequence.
    pub first: Vec<Sampled>,
    pub queue_wait: Duration,
    pub started: Instant,
}

/// Starts the compute thread; it ends when every sender of `jobs` is gone.
pub fn spawn(
    model: Arc<Model>,
    chunk_tokens: usize,
    metrics: Arc<PrefillMetrics>,
    mut jobs: mpsc::Receiver<Job>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("prefill-compute".into())
        .spawn(move || {
            while let Some(job) = jobs.blocking_recv() {
                let _entered = job.span.clone().entered();
                if job.done.is_closed() {
                    tracing::debug!("cancelled before it started");
                    PrefillMetrics::inc(&metrics.cancelled);
                    continue;
                }
                metrics.running.store(1, Ordering::Relaxed);
                let result = prefill(&model, chunk_tokens, &metrics, &job);
                metrics.running.store(0, Ordering::Relaxed);
                metrics.kv_bytes_held.store(0, Ordering::Relaxed);
                match &result {
                    Ok(c) => {
                        PrefillMetrics::add(&metrics.prompt_tokens, job.prompt.len() as u64);
                        PrefillMetrics::add(
                            &metrics.compute_micros,
                            c.started.elapsed().as_micros() as u64,
                        );
                        PrefillMetrics::add(
                            &metrics.queue_wait_micros,
                            c.queue_wait.as_micros() as u64,
                        );
                    }
                    Err(PrefillError::Cancelled) => {
                        tracing::info!("cancelled during the prefill");
                        PrefillMetrics::inc(&metrics.cancelled);
                    }
                    Err(e) => tracing::warn!(error = %e, "prefill failed"),
                }
                let _ = job.done.send(result);
            }
        })
}

fn prefill(
    model: &Model,
    chunk_tokens: usize,
    metrics: &PrefillMetrics,
    job: &Job,
) -> Result<Computed, PrefillError> {
    let started = Instant::now();
    let n = job.prompt.len();
    let mut cache = model.new_cache()?;
    // Allocated at its size up front, so the gauge shows what the prompt holds.
    cache.reserve_exact(n)?;
    metrics
        .kv_bytes_held
        .store(cache.allocated_bytes() as u64, Ordering::Relaxed);
    // The hook can only return an engine error; this says why it stopped the pass.
    let mut abort = None;
    let logits = model.forward_with(
        &mut [SeqInput {
            tokens: &job.prompt,
            cache: &mut cache,
        }],
        &mut |layer, batch| {
            if job.done.is_closed() {
                abort = Some(PrefillError::Cancelled);
                return Err(EngineError::KvCache("prefill cancelled".into()));
            }
            for start in (0..n).step_by(chunk_tokens) {
                let len = chunk_tokens.min(n - start);
                let chunk = batch[0].cache.export_pending(layer, start, len, n)?;
                let msg = KvTransfer {
                    item: Some(Item::Chunk(proto::chunk_to_proto(chunk))),
                };
                if job.transfer.blocking_send(msg).is_err() {
                    abort = Some(PrefillError::TransferClosed);
                    return Err(EngineError::KvCache("transfer closed".into()));
                }
            }
            Ok(())
        },
    );
    let logits = match (logits, abort) {
        (_, Some(e)) => return Err(e),
        (r, None) => r?,
    };
    let row: Vec<f32> = logits
        .squeeze(0)
        .and_then(|t| t.to_vec1())
        .map_err(EngineError::from)?;
    let first = if job.beam {
        engine::beam::first_tokens(&row, job.n, job.top_logprobs)
    } else {
        engine::sampling::sample_first(&row, &job.sampling, &job.prompt, job.n, job.top_logprobs)
    };
    let msg = KvTransfer {
        item: Some(Item::First(FirstTokens {
            tokens: first.iter().map(proto::token_to_proto).collect(),
        })),
    };
    job.transfer
        .blocking_send(msg)
        .map_err(|_| PrefillError::TransferClosed)?;
    Ok(Computed {
        first,
        queue_wait: started - job.enqueued,
        started,
    })
}

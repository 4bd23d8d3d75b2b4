//! The compute thread: iteration-level (continuous) batching. Sequences join between any
//! two steps and leave as soon as they finish or their caller goes away; every step is one
//! batched forward pass over all running sequences.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use engine::{EngineError, Model, SamplingParams, SeqCache, SeqInput};
use proto::v1::{generate_event::Event, Finish, FinishReason, GenerateEvent, TokenEvent};
use tokio::sync::mpsc;
use tonic::Status;

use crate::error::DecodeError;

/// Where a sequence's events go; closed when its caller is gone.
pub type Events = mpsc::UnboundedSender<Result<GenerateEvent, Status>>;

/// How a sequence's cache comes to exist.
pub enum Start {
    /// Colocated: run the prompt here and sample the first token.
    Prefill,
    /// Disaggregated: the prompt's cache and each sequence's first token came from a
    /// prefill node.
    Transferred {
        cache: SeqCache,
        first_tokens: Vec<u32>,
    },
}

/// A sequence asking to join the batch.
pub struct Admission {
    pub span: tracing::Span,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub top_logprobs: usize,
    /// Sequences decoded from the one prompt (n or best_of).
    pub n: usize,
    /// Tokens this node may produce (the first one included when it prefills).
    pub max_new: usize,
    pub stop_ids: Vec<u32>,
    pub start: Start,
    pub enqueued: Instant,
    pub events: Events,
}

struct Seq {
    span: tracing::Span,
    choice: u32,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    top_logprobs: usize,
    max_new: usize,
    stop_ids: Vec<u32>,
    cache: SeqCache,
    /// Every generated token, the prefill node's first one included; the last one is the
    /// input of the next step.
    output: Vec<u32>,
    produced: usize,
    ready_since: Instant,
    events: Events,
}

/// Starts the compute thread; it ends when every sender of `admissions` is gone and the
/// running sequences are done.
pub fn spawn(
    model: Arc<Model>,
    max_batch: usize,
    admissions: mpsc::UnboundedReceiver<Admission>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("decode-compute".into())
        .spawn(move || Scheduler::new(model, max_batch).run(admissions))
}

struct Scheduler {
    model: Arc<Model>,
    max_batch: usize,
    running: Vec<Seq>,
}

fn token_event(
    s: &engine::Sampled,
    choice: u32,
    ms: f64,
    batch: usize,
    wait_us: u64,
) -> GenerateEvent {
    GenerateEvent {
        event: Some(Event::Token(TokenEvent {
            token: Some(proto::token_to_proto(s)),
            step_time_ms: ms,
            batch_size: batch as u32,
            queue_wait_us: wait_us,
            from_prefill: false,
            choice,
        })),
    }
}

fn finish_event(reason: FinishReason, choice: u32) -> GenerateEvent {
    GenerateEvent {
        event: Some(Event::Finish(Finish {
            reason: reason as i32,
            choice,
        })),
    }
}

impl Scheduler {
    fn new(model: Arc<Model>, max_batch: usize) -> Self {
        Self {
            model,
            max_batch: max_batch.max(1),
            running: Vec::new(),
        }
    }

    fn run(mut self, mut admissions: mpsc::UnboundedReceiver<Admission>) {
        loop {
            if self.running.is_empty() {
                match admissions.blocking_recv() {
                    Some(a) => self.admit(a),
                    None => return,
                }
            }
            while self.running.len() < self.max_batch {
                match admissions.try_recv() {
                    Ok(a) => self.admit(a),
                    Err(_) => break,
                }
            }
            self.running.retain(|s| {
                let gone = s.events.is_closed();
                if gone {
                    tracing::info!(parent: &s.span, "caller went away; sequence dropped");
                }
                !gone
            });
            if !self.running.is_empty() {
                self.step();
            }
        }
    }

    /// Why `seq` stops after its newest token, if it does.
    fn finish_of(&self, seq: &Seq) -> Option<FinishReason> {
        let last = *seq.output.last()?;
        if seq.stop_ids.contains(&last) {
            Some(FinishReason::Stop)
        } else if seq.produced >= seq.max_new
            || seq.cache.len() >= self.model.config().max_position_embeddings
        {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Keeps `seq` running, or sends its finish and lets it (and its cache) go.
    fn keep_or_finish(&mut self, seq: Seq) {
        match self.finish_of(&seq) {
            Some(reason) => {
                tracing::debug!(parent: &seq.span, ?reason, tokens = seq.output.len(), "finished");
                let _ = seq.events.send(Ok(finish_event(reason, seq.choice)));
            }
            None => self.running.push(seq),
        }
    }

    fn admit(&mut self, a: Admission) {
        let _entered = a.span.clone().entered();
        // The prompt's cache, each sequence's first token, how many tokens this node made
        // per sequence, and since when the sequences wait for their next step.
        let (cache, first_tokens, produced, ready_since) = match a.start {
            Start::Transferred {
                cache,
                first_tokens,
            } => {
                if first_tokens.len() != a.n {
                    let e = DecodeError::InvalidRequest(format!(
                        "{} first tokens arrived for {} sequences",
                        first_tokens.len(),
                        a.n
                    ));
                    let _ = a.events.send(Err(e.into()));
                    return;
                }
                (cache, first_tokens, 0, a.enqueued)
            }
            Start::Prefill => {
                if a.max_new == 0 {
                    for choice in 0..a.n as u32 {
                        let _ = a
                            .events
                            .send(Ok(finish_event(FinishReason::Length, choice)));
                    }
                    return;
                }
                let started = Instant::now();
                let (cache, first) = match self.prefill(&a.prompt, &a.sampling, a.n, a.top_logprobs)
                {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "prefill failed");
                        let _ = a.events.send(Err(e.into()));
                        return;
                    }
                };
                let ms = started.elapsed().as_secs_f64() * 1e3;
                let wait = (started - a.enqueued).as_micros() as u64;
                for (choice, s) in first.iter().enumerate() {
                    let mut event = token_event(s, choice as u32, ms, 1, wait);
                    if let Some(Event::Token(t)) = &mut event.event {
                        t.from_prefill = true;
                    }
                    let _ = a.events.send(Ok(event));
                }
                let tokens = first.iter().map(|s| s.token).collect();
                (cache, tokens, 1, Instant::now())
            }
        };
        // Sequence 0 keeps the prompt's cache; the others decode from copies of it.
        let mut caches = Vec::with_capacity(first_tokens.len());
        for _ in 1..first_tokens.len() {
            match cache.fork() {
                Ok(c) => caches.push(c),
                Err(e) => {
                    let _ = a.events.send(Err(DecodeError::from(e).into()));
                    return;
                }
            }
        }
        caches.insert(0, cache);
        for (choice, (cache, first)) in caches.into_iter().zip(first_tokens).enumerate() {
            self.keep_or_finish(Seq {
                span: a.span.clone(),
                choice: choice as u32,
                prompt: a.prompt.clone(),
                sampling: a.sampling.for_choice(choice),
                top_logprobs: a.top_logprobs,
                max_new: a.max_new,
                stop_ids: a.stop_ids.clone(),
                cache,
                output: vec![first],
                produced,
                ready_since,
                events: a.events.clone(),
            });
        }
    }

    /// Runs the prompt and samples the first token of each of `n` sequences.
    fn prefill(
        &self,
        prompt: &[u32],
        sampling: &SamplingParams,
        n: usize,
        top_logprobs: usize,
    ) -> Result<(SeqCache, Vec<engine::Sampled>), DecodeError> {
        if prompt.is_empty() {
            return Err(DecodeError::InvalidRequest("the prompt is empty".into()));
        }
        let mut cache = self.model.new_cache()?;
        let logits = self.model.forward(&mut [SeqInput {
            tokens: prompt,
            cache: &mut cache,
        }])?;
        let row: Vec<f32> = logits
            .squeeze(0)
            .and_then(|t| t.to_vec1())
            .map_err(EngineError::from)?;
        let first = engine::sampling::sample_first(&row, sampling, prompt, n, top_logprobs);
        Ok((cache, first))
    }

    fn step(&mut self) {
        let batch = self.running.len();
        let span = tracing::debug_span!("decode_step", batch);
        let _entered = span.enter();
        let started = Instant::now();
        let inputs: Vec<[u32; 1]> = self
            .running
            .iter()
            .map(|s| [*s.output.last().expect("a running sequence has a token")])
            .collect();
        let rows = {
            let mut seqs: Vec<SeqInput<'_>> = self
                .running
                .iter_mut()
                .zip(&inputs)
                .map(|(s, t)| SeqInput {
                    tokens: t,
                    cache: &mut s.cache,
                })
                .collect();
            self.model
                .forward(&mut seqs)
                .and_then(|l| l.to_vec2::<f32>().map_err(EngineError::from))
        };
        let rows = match rows {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "decode step failed; failing its sequences");
                let status = Status::internal(format!("decode step failed: {e}"));
                for s in self.running.drain(..) {
                    let _ = s.events.send(Err(status.clone()));
                }
                return;
            }
        };
        let sampled: Vec<engine::Sampled> = self
            .running
            .iter()
            .zip(&rows)
            .map(|(s, row)| {
                engine::sampling::sample(
                    row,
                    &s.sampling,
                    &s.prompt,
                    &s.output,
                    s.output.len() as u64,
                    s.top_logprobs,
                )
            })
            .collect();
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let now = Instant::now();
        for (mut seq, s) in std::mem::take(&mut self.running).into_iter().zip(sampled) {
            let wait = started.saturating_duration_since(seq.ready_since);
            let _ = seq.events.send(Ok(token_event(
                &s,
                seq.choice,
                ms,
                batch,
                wait.as_micros() as u64,
            )));
            seq.output.push(s.token);
            seq.produced += 1;
            seq.ready_since = now;
            self.keep_or_finish(seq);
        }
    }
}

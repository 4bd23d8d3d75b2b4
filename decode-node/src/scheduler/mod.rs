//! The compute thread: iteration-level (continuous) batching. Sequences join between any
//! two steps and leave as soon as they finish or their caller goes away; every step is one
//! batched forward pass over all running sequences.
//!
//! A request arrives here with its KV memory reserved for its whole length (prompt plus max
//! tokens, per sequence; see `budget`), and its caches are allocated at that size, so a
//! running sequence never needs memory it does not hold and nothing is ever preempted.
//! Requests wait here, in order, only for a batch slot.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use engine::beam::BeamSearch;
use engine::grammar::{Constraint, GrammarError, TokenMask};
use engine::sampling::Context;
use engine::{EngineError, Model, Sampled, SamplingParams, SeqCache, SeqInput};
use proto::v1::{
    generate_event::Event, Finish, FinishReason, GenerateEvent, PromptLogprobs, TokenEvent,
};
use tokio::sync::mpsc;
use tonic::Status;

use crate::budget::Lease;
use crate::ended::Ended;
use crate::error::DecodeError;
use crate::metrics::DecodeMetrics;
use runtime::prom::Observe;

mod admit;
mod beam;
pub mod masks;
mod plan;
mod prefill;
mod step;

use beam::{ended, BeamGroup, BeamState};
use masks::Account;

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
        first_tokens: Vec<Sampled>,
    },
}

/// A sequence asking to join the batch.
pub struct Admission {
    pub span: tracing::Span,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// The request's grammar before any output, if it has one (never with beam search).
    pub constraint: Option<Constraint>,
    pub top_logprobs: usize,
    /// Sequences decoded from the one prompt (n or best_of); with beam search, the
    /// hypotheses returned.
    pub n: usize,
    /// Above 0: beam search with this many beams.
    pub beam_width: usize,
    /// Tokens this node may produce (the first one included when it prefills).
    pub max_new: usize,
    /// Positions each sequence's cache is allocated with.
    pub positions: usize,
    pub stop_ids: Vec<u32>,
    /// When this node prefills: score every prompt token after the first, sent as the
    /// first event.
    pub prompt_logprobs: bool,
    /// The prompt's last tokens that are the request's output so far (a moved stream):
    /// they are the sequence's output, for its sampling, from the start.
    pub resumed: usize,
    /// Which of its sequences the router has ended (EndSequence).
    pub ended: Arc<Ended>,
    pub start: Start,
    pub enqueued: Instant,
    pub events: Events,
    /// Counted as having waited for a batch slot.
    pub delayed: bool,
    /// The KV memory of all its sequences.
    pub lease: Lease,
}

struct Seq {
    span: tracing::Span,
    choice: u32,
    ended: Arc<Ended>,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    /// Its grammar's state after `output`.
    constraint: Option<Constraint>,
    /// Its request's time for grammar masks.
    grammar_time: Account,
    /// Logits waiting for that time, when it ran out.
    parked: Option<Parked>,
    /// Its grammar's mask for this step's row, made before the row comes back so that the
    /// row can be masked where it lies (on a GPU, there).
    mask: Option<Result<TokenMask, GrammarError>>,
    top_logprobs: usize,
    max_new: usize,
    stop_ids: Vec<u32>,
    cache: SeqCache,
    _lease: Lease,
    /// Every generated token, the prefill node's first one included; the last one is the
    /// input of the next step.
    output: Vec<u32>,
    produced: usize,
    ready_since: Instant,
    events: Events,
}

/// A sequence's logits from a step, kept until its grammar may mask them.
struct Parked {
    row: Vec<f32>,
    /// The step's time and batch, reported with the token.
    ms: f64,
    batch: usize,
    since: Instant,
}

/// Starts the compute thread, which runs at most `max_batch` sequences a step (the service
/// refuses a request with more); it ends when every sender of `admissions` is gone and the
/// running sequences are done.
pub fn spawn(
    model: Arc<Model>,
    max_batch: usize,
    metrics: Arc<DecodeMetrics>,
    admissions: mpsc::UnboundedReceiver<Admission>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("decode-compute".into())
        .spawn(move || Scheduler::new(model, max_batch, metrics).run(admissions))
}

struct Scheduler {
    model: Arc<Model>,
    max_batch: usize,
    metrics: Arc<DecodeMetrics>,
    running: Vec<Seq>,
    groups: Vec<BeamGroup>,
    waiting: VecDeque<Admission>,
}

fn token(s: &Sampled, choice: u32, ms: f64, batch: usize, wait_us: u64) -> TokenEvent {
    TokenEvent {
        token: Some(kvwire::convert::token_to_proto(s)),
        step_time_ms: ms,
        batch_size: batch as u32,
        queue_wait_us: wait_us,
        from_prefill: false,
        choice,
    }
}

fn token_event(s: &Sampled, choice: u32, ms: f64, batch: usize, wait_us: u64) -> GenerateEvent {
    GenerateEvent {
        event: Some(Event::Token(token(s, choice, ms, batch, wait_us))),
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
    fn new(model: Arc<Model>, max_batch: usize, metrics: Arc<DecodeMetrics>) -> Self {
        Self {
            model,
            max_batch: max_batch.max(1),
            metrics,
            running: Vec::new(),
            groups: Vec::new(),
            waiting: VecDeque::new(),
        }
    }

    /// Sequences in the next step: running ones and live beams.
    fn batch_len(&self) -> usize {
        self.running.len()
            + self
                .groups
                .iter()
                .map(|g| g.search.live().len())
                .sum::<usize>()
    }

    fn run(mut self, mut admissions: mpsc::UnboundedReceiver<Admission>) {
        loop {
            if self.batch_len() == 0 && self.waiting.is_empty() {
                self.publish();
                match admissions.blocking_recv() {
                    Some(a) => self.waiting.push_back(a),
                    None => return,
                }
            }
            while let Ok(a) = admissions.try_recv() {
                self.waiting.push_back(a);
            }
            self.drop_cancelled();
            self.end_stopped();
            self.start_waiting();
            self.publish();
            if self.batch_len() > 0 {
                self.step();
            }
        }
    }

    /// Lets go of every sequence, search and queued request whose caller has gone away;
    /// dropping them frees their KV blocks.
    fn drop_cancelled(&mut self) {
        let before = self.running.len() + self.groups.len() + self.waiting.len();
        self.running.retain(|s| {
            let gone = s.events.is_closed();
            if gone {
                tracing::info!(parent: &s.span, "caller went away; sequence dropped");
            }
            !gone
        });
        self.groups.retain(|g| {
            let gone = g.events.is_closed();
            if gone {
                tracing::info!(parent: &g.span, "caller went away; beam search dropped");
            }
            !gone
        });
        self.waiting.retain(|a| {
            let gone = a.events.is_closed();
            if gone {
                tracing::info!(parent: &a.span, "caller went away while queued");
            }
            !gone
        });
        let after = self.running.len() + self.groups.len() + self.waiting.len();
        if after < before {
            self.metrics
                .cancellations
                .increment((before - after) as u64);
        }
    }

    /// Finishes (STOP) the sequences the router has ended: it met a stop string in them
    /// while their request's other sequences go on. Dropping them frees their KV blocks.
    fn end_stopped(&mut self) {
        // Checked before every step: rebuild the batch only when one was ended.
        if !self
            .running
            .iter()
            .any(|s| s.ended.is_set(s.choice as usize))
        {
            return;
        }
        let (ended, running) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|s: &Seq| s.ended.is_set(s.choice as usize));
        self.running = running;
        for s in ended {
            tracing::info!(parent: &s.span, choice = s.choice, "ended by the router");
            self.metrics.finished_sequences.increment(1);
            let _ = s
                .events
                .send(Ok(finish_event(FinishReason::Stop, s.choice)));
        }
    }

    /// Starts queued requests, oldest first, while the next one has a batch slot.
    fn start_waiting(&mut self) {
        while let Some(a) = self.waiting.front() {
            if !plan::starts(self.batch_len(), sequences(a), self.max_batch) {
                break;
            }
            let a = self.waiting.pop_front().expect("the front exists");
            if a.delayed {
                tracing::debug!(parent: &a.span, "started after waiting for a slot");
            }
            let waited = a.enqueued.elapsed();
            self.metrics.queue_wait.observe(waited);
            self.metrics.admitted.increment(1);
            self.admit(a);
        }
        for a in self.waiting.iter_mut().filter(|a| !a.delayed) {
            a.delayed = true;
            self.metrics.delayed.increment(1);
        }
    }

    /// Updates the gauges the compute thread owns.
    fn publish(&self) {
        let m = &self.metrics;
        m.running_sequences
            .store(self.batch_len() as u64, Ordering::Relaxed);
        m.waiting_requests
            .store(self.waiting.len() as u64, Ordering::Relaxed);
    }

    /// Why `seq` stops after its newest token, if it does.
    fn finish_of(&self, seq: &Seq) -> Option<FinishReason> {
        plan::finish(plan::Progress {
            last: *seq.output.last()?,
            stop_ids: &seq.stop_ids,
            grammar_finished: seq.constraint.as_ref().is_some_and(Constraint::finished),
            produced: seq.produced,
            max_new: seq.max_new,
            positions: seq.cache.len(),
            max_positions: self.model.config().max_position_embeddings,
        })
    }

    /// Keeps `seq` running, or sends its finish and lets it (and its cache) go.
    fn keep_or_finish(&mut self, seq: Seq) {
        match self.finish_of(&seq) {
            Some(reason) => {
                tracing::info!(parent: &seq.span, ?reason, tokens = seq.output.len(), "finished");
                // For the trace (with n > 1, the last choice to finish; each has its event).
                seq.span
                    .record("completion_tokens", runtime::otel::count(seq.output.len()));
                self.metrics.finished_sequences.increment(1);
                let _ = seq.events.send(Ok(finish_event(reason, seq.choice)));
            }
            None => self.running.push(seq),
        }
    }

    /// Fails one request with the node's error, and counts it.
    fn fail(&self, events: &Events, e: DecodeError) {
        let _ = events.send(Err(e.into()));
        self.metrics.failures.increment(1);
    }
}

/// Sequences a request decodes at once: its beams, or its n (best_of) samples.
fn sequences(a: &Admission) -> usize {
    if a.beam_width > 0 {
        a.beam_width
    } else {
        a.n
    }
}

#[cfg(test)]
mod tests;

//! The compute thread: batched, chunked prefill. Each step runs one forward pass over a
//! piece of every queued prompt, oldest first, up to a token budget; a prompt longer than
//! the chunk size takes several steps, so a long prompt does not hold short ones back for
//! its whole length. Each layer's K/V for the step's positions is staged as soon as that
//! layer is done and leaves then (on a GPU, two layers later, once copied to host memory),
//! so the transfer overlaps the rest of the pass.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use engine::grammar::{Constraint, GrammarError, TokenMask};
use engine::sampling::Context;
use engine::{Model, Sampled, SamplingParams, SeqCache, SeqInput, Staged, Stager};
use kvwire::Item;
use proto::v1::FirstTokens;
use tokio::sync::{mpsc, oneshot};

use crate::error::PrefillError;
use crate::metrics::PrefillMetrics;
use crate::plan;
use crate::prefix::PrefixCache;
use runtime::prom::Observe;

/// One prompt to run.
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// The request's grammar before any output, if it has one (never with beam search).
    pub constraint: Option<Constraint>,
    pub top_logprobs: usize,
    /// Sequences to start: one first token each.
    pub n: usize,
    /// Beam search: the n most likely first tokens instead of n samples.
    pub beam: bool,
    /// The prefix-cache partition the prompt may reuse and joins.
    pub cache_partition: Vec<u8>,
    /// Score every prompt token after the first (echo with logprobs): the prompt is then
    /// computed whole, since prefix-cache positions have no logits.
    pub prompt_logprobs: bool,
    /// The prompt's last tokens that are the request's output so far (a moved stream).
    pub resumed: usize,
    pub enqueued: Instant,
    pub span: tracing::Span,
    /// Where the chunks and then the first token go; dropping it without the first token
    /// tells the decode node the transfer failed. Unbounded, so that the compute thread
    /// never waits for a slow decode node: what it holds is at most this prompt's cache,
    /// which the thread holds anyway, and a transfer that stalls fails on its own deadline
    /// (the channel then closes, and only this prompt fails).
    pub transfer: mpsc::UnboundedSender<Item>,
    pub done: oneshot::Sender<Result<Computed, PrefillError>>,
}

/// What a finished prefill reports.
#[derive(Debug)]
pub struct Computed {
    /// One first token per sequence.
    pub first: Vec<Sampled>,
    /// With `Job::prompt_logprobs`: each prompt token after the first, scored.
    pub prompt_logprobs: Vec<Sampled>,
    pub queue_wait: Duration,
    pub started: Instant,
    /// When the last message of the transfer (the first tokens) was handed to it.
    pub computed_at: Instant,
    /// Prompts in the step that finished this one.
    pub batch_size: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

/// How the compute thread batches.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most prompt tokens in one step, over all its prompts.
    pub step_tokens: usize,
    /// Most tokens of one prompt in one step.
    pub chunk_tokens: usize,
    /// Most positions in one KV transfer message.
    pub message_tokens: usize,
    /// Bytes the prefix cache may hold (0: off).
    pub prefix_cache_bytes: usize,
    /// Most prompt tokens started at once (each started prompt holds a cache of its
    /// length); one prompt longer than this still runs, alone.
    pub max_active_tokens: usize,
}

/// A prompt being computed.
struct Active {
    job: Job,
    cache: SeqCache,
    /// When its first piece ran.
    started: Option<Instant>,
    /// Leading positions whose KV came from the prefix cache.
    cached: usize,
    /// Positions already on the transfer.
    sent: usize,
    /// The prompt tokens scored so far (`Job::prompt_logprobs`).
    scored: Vec<Sampled>,
}

/// What a step's forward pass gave: for each prompt in it, its last position's logits,
/// every position's when it scores its prompt, and whether its transfer closed.
struct Pass {
    rows: Vec<Vec<f32>>,
    every: Vec<Option<Vec<Vec<f32>>>>,
    closed: Vec<bool>,
}

impl Active {
    fn done(&self) -> usize {
        self.cache.len()
    }
}

/// Starts the compute thread; it ends when every sender of `jobs` is gone and the prompts
/// it holds are done.
pub fn spawn(
    model: Arc<Model>,
    limits: Limits,
    metrics: Arc<PrefillMetrics>,
    jobs: mpsc::Receiver<Job>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("prefill-compute".into())
        .spawn(move || {
            Worker {
                stager: Stager::new(model.device()),
                model,
                prefix: PrefixCache::new(limits.prefix_cache_bytes),
                limits,
                metrics,
                active: VecDeque::new(),
                next: None,
            }
            .run(jobs)
        })
}

struct Worker {
    model: Arc<Model>,
    limits: Limits,
    metrics: Arc<PrefillMetrics>,
    /// Prompts started, oldest first.
    active: VecDeque<Active>,
    /// A prompt taken from the queue that waits for room among the started ones.
    next: Option<Job>,
    prefix: PrefixCache,
    /// Moves each layer's chunks to host memory for the transfers.
    stager: Stager,
}

impl Worker {
    fn run(mut self, mut jobs: mpsc::Receiver<Job>) {
        loop {
            if self.active.is_empty() && self.next.is_none() {
                match jobs.blocking_recv() {
                    Some(job) => self.next = Some(job),
                    None => return,
                }
            }
            self.start_what_fits(&mut jobs);
            self.drop_cancelled();
            if !self.active.is_empty() {
                self.step();
            }
            self.publish();
        }
    }

    /// Starts waiting prompts, oldest first, while their tokens fit beside those of the
    /// prompts started (`max_active_tokens`): a started prompt holds a cache of its whole
    /// length, so this bounds the node's KV memory; the others wait in the queue (at most
    /// `--max-queue`) holding none. With nothing started, the next prompt starts whatever
    /// its length.
    fn start_what_fits(&mut self, jobs: &mut mpsc::Receiver<Job>) {
        loop {
            let Some(job) = self.next.take().or_else(|| jobs.try_recv().ok()) else {
                return;
            };
            let held: usize = self.active.iter().map(|a| a.job.prompt.len()).sum();
            let (started, tokens) = (self.active.len(), job.prompt.len());
            if !plan::starts(held, started, tokens, self.limits.max_active_tokens) {
                self.next = Some(job);
                return;
            }
            self.start(job);
        }
    }

    /// Gives a prompt its cache, sized to the whole prompt up front and holding the
    /// longest prefix the prefix cache has of it.
    fn start(&mut self, job: Job) {
        let _entered = job.span.clone().entered();
        if job.done.is_closed() {
            tracing::debug!("cancelled before it started");
            return;
        }
        let hit = if job.prompt_logprobs {
            Ok(None)
        } else {
            self.prefix.lookup(&job.cache_partition, &job.prompt)
        };
        let cache = match hit {
            Ok(Some(hit)) => {
                tracing::debug!(cached_tokens = hit.tokens, "prefix cache hit");
                self.metrics.prefix_hits.increment(1);
                self.metrics.cached_tokens.increment(hit.tokens as u64);
                Ok((hit.cache, hit.tokens))
            }
            Ok(None) => self
                .model
                .new_cache()
                .and_then(|mut c| c.reserve_exact(job.prompt.len()).map(|()| (c, 0))),
            Err(e) => Err(e),
        };
        match cache {
            Ok((cache, cached)) => self.active.push_back(Active {
                job,
                cache,
                started: None,
                cached,
                sent: 0,
                scored: Vec::new(),
            }),
            Err(e) => {
                let _ = job.done.send(Err(e.into()));
            }
        }
        self.publish();
    }

    /// Lets go of prompts whose call has gone (the service counts them as cancelled).
    fn drop_cancelled(&mut self) {
        self.active.retain(|a| {
            let gone = a.job.done.is_closed();
            if gone {
                tracing::info!(parent: &a.job.span, "cancelled during the prefill");
            }
            !gone
        });
    }

    fn publish(&self) {
        let m = &self.metrics;
        m.running.store(self.active.len() as u64, Ordering::Relaxed);
        let held: usize = self.active.iter().map(|a| a.cache.allocated_bytes()).sum();
        m.kv_bytes_held.set(held as f64);
        m.prefix_cache_bytes.set(self.prefix.bytes() as f64);
    }

    /// One forward pass over the next piece of each prompt, oldest first, within the
    /// step's token budget; prompts that complete get their first tokens and leave.
    fn step(&mut self) {
        let takes = plan::takes(
            self.active.iter().map(|a| a.job.prompt.len() - a.done()),
            self.limits.step_tokens,
            self.limits.chunk_tokens,
        );
        let started = Instant::now();
        for a in self.active.iter_mut().take(takes.len()) {
            a.started.get_or_insert(started);
        }
        match self.forward(&takes) {
            Ok(pass) => {
                self.metrics.step_duration.observe(started.elapsed());
                self.metrics
                    .prompt_tokens
                    .increment(takes.iter().sum::<usize>() as u64);
                self.settle(pass);
            }
            Err(e) => {
                tracing::error!(error = %e, "prefill step failed; failing its prompts");
                for a in self.active.drain(..takes.len()) {
                    let _ = a
                        .job
                        .done
                        .send(Err(PrefillError::StepFailed(e.to_string())));
                }
            }
        }
    }

    /// Runs the next `takes[i]` tokens of the i-th started prompt in one forward pass,
    /// sending each layer's K/V for them (and for what came from the prefix cache) on the
    /// prompt's transfer as soon as the layer is done.
    fn forward(&mut self, takes: &[usize]) -> Result<Pass, engine::EngineError> {
        let message_tokens = self.limits.message_tokens.max(1);
        // A prompt whose transfer closed (its decode node failed, or the request was
        // cancelled) stops sending; its batch mates go on.
        let mut closed = vec![false; takes.len()];
        let stepped = || self.active.iter().take(takes.len());
        let every_row: Vec<bool> = stepped().map(|a| a.job.prompt_logprobs).collect();
        // The transfer also carries what came from the prefix cache: it starts at what
        // was sent, not at what this step computes.
        let transfers: Vec<(mpsc::UnboundedSender<Item>, usize)> = stepped()
            .map(|a| (a.job.transfer.clone(), a.sent))
            .collect();
        let mut batch: Vec<SeqInput<'_>> = self
            .active
            .iter_mut()
            .zip(takes)
            .map(|(a, &take)| {
                let from = a.cache.len();
                SeqInput {
                    tokens: &a.job.prompt[from..from + take],
                    cache: &mut a.cache,
                }
            })
            .collect();
        // Each layer's chunks are staged when it is done and sent `lookahead` layers later
        // (at once on the CPU; on a GPU once their copies to host memory are done).
        let stager = &self.stager;
        let mut staged: VecDeque<Vec<(usize, Staged)>> = VecDeque::new();
        let (last, every) = self.model.forward_rows(
            &mut batch,
            &mut |layer, seqs| {
                let mut layer_chunks = Vec::new();
                for (k, s) in seqs.iter().enumerate() {
                    let (tx, sent) = &transfers[k];
                    if closed[k] || tx.is_closed() {
                        closed[k] = true;
                        continue;
                    }
                    let n = s.tokens.len();
                    let end = s.cache.len() + n;
                    for start in (*sent..end).step_by(message_tokens) {
                        let len = message_tokens.min(end - start);
                        layer_chunks.push((k, stager.stage(&*s.cache, layer, start, len, n)?));
                    }
                }
                staged.push_back(layer_chunks);
                while staged.len() > stager.lookahead() {
                    let due = staged.pop_front().unwrap_or_default();
                    send_chunks(due, &transfers, &mut closed)?;
                }
                Ok(())
            },
            &every_row,
        )?;
        for due in staged {
            send_chunks(due, &transfers, &mut closed)?;
        }
        let every = every
            .into_iter()
            .map(|t| t.map(|t| t.to_vec2::<f32>()).transpose())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Pass {
            rows: last.to_vec2::<f32>()?,
            every,
            closed,
        })
    }

    /// Takes a step's outcome: each prompt's scores so far, then its first tokens when
    /// it is complete, or its place at the front when it is not.
    fn settle(&mut self, pass: Pass) {
        let batch_size = pass.rows.len();
        let stepped: Vec<Active> = self.active.drain(..batch_size).collect();
        let mut kept = Vec::new();
        let outcomes = pass.rows.iter().zip(pass.closed).zip(pass.every);
        for (mut a, ((row, closed), every)) in stepped.into_iter().zip(outcomes) {
            if let Some(every) = every {
                let from = a.done() - every.len();
                let next = plan::scored_tokens(&a.job.prompt, from, every.len());
                let top = a.job.top_logprobs;
                a.scored.extend(engine::sampling::scored(&every, next, top));
            }
            a.sent = a.done();
            if closed {
                let _ = a.job.done.send(Err(PrefillError::TransferClosed));
            } else if a.done() == a.job.prompt.len() {
                self.complete(a, row, batch_size);
            } else {
                kept.push(a);
            }
        }
        // Unfinished prompts keep their place at the front.
        for a in kept.into_iter().rev() {
            self.active.push_front(a);
        }
    }

    /// Sends a finished prompt's first tokens, which ends its transfer, answers it, and
    /// keeps its cache in the prefix cache.
    fn complete(&mut self, mut a: Active, row: &[f32], batch_size: usize) {
        let _entered = a.job.span.clone().entered();
        let constraint = a.job.constraint.take();
        let job = &a.job;
        if job.done.is_closed() {
            // Cancelled during its last step: no first tokens, so the transfer fails and
            // the decode node frees what it received.
            tracing::info!("cancelled during the prefill");
            return;
        }
        let (prompt, output) = engine::sampling::split_resumed(&job.prompt, job.resumed);
        let allowed = match first_mask(constraint, output) {
            Ok(m) => m,
            Err(e) => {
                let _ = a.job.done.send(Err(PrefillError::Grammar(e)));
                return;
            }
        };
        let cx = Context::of(prompt, output).masked(allowed.as_ref());
        let first = engine::sampling::pick_first(
            row,
            &job.sampling,
            &cx,
            job.n,
            job.top_logprobs,
            job.beam,
        );
        let msg = Item::First(FirstTokens {
            tokens: first.iter().map(kvwire::convert::token_to_proto).collect(),
        });
        let result = match job.transfer.send(msg) {
            Ok(()) => {
                let started = a.started.unwrap_or_else(Instant::now);
                let queue_wait = started.saturating_duration_since(job.enqueued);
                self.metrics.queue_wait.observe(queue_wait);
                self.metrics.compute_duration.observe(started.elapsed());
                Ok(Computed {
                    first,
                    prompt_logprobs: std::mem::take(&mut a.scored),
                    queue_wait,
                    started,
                    computed_at: Instant::now(),
                    batch_size,
                    cached_tokens: a.cached,
                })
            }
            Err(_) => Err(PrefillError::TransferClosed),
        };
        let ok = result.is_ok();
        let _ = a.job.done.send(result);
        if ok {
            self.prefix
                .insert(a.job.cache_partition, a.job.prompt, a.cache);
        }
    }
}

/// Sends staged chunks, each on its prompt's transfer (`transfers[k]` for `(k, chunk)`),
/// marking a prompt whose transfer has closed.
fn send_chunks(
    chunks: Vec<(usize, Staged)>,
    transfers: &[(mpsc::UnboundedSender<Item>, usize)],
    closed: &mut [bool],
) -> Result<(), engine::EngineError> {
    for (k, staged) in chunks {
        if closed[k] {
            continue;
        }
        if transfers[k].0.send(Item::Chunk(staged.take()?)).is_err() {
            closed[k] = true;
        }
    }
    Ok(())
}

/// The first tokens a request's grammar allows after its output so far (a moved stream's).
fn first_mask(
    constraint: Option<Constraint>,
    output: &[u32],
) -> Result<Option<TokenMask>, GrammarError> {
    let Some(mut c) = constraint else {
        return Ok(None);
    };
    c.advance(output)?;
    c.mask().map(Some)
}

#[cfg(test)]
mod tests;

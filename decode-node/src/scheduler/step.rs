//! One decode step: a forward pass over every running sequence that is not waiting for its
//! grammar's time and every live beam, the grammars' masks made for the rows, then each
//! sequence's token sampled (or its logits kept for a later step, see `masks`) and sent.

use candle_core::Tensor;
use engine::sampling::{fetch, fetch_ranked, need, Fetched, Need, TokenLogprob};

use super::*;

impl Scheduler {
    /// Runs one step.
    pub(super) fn step(&mut self) {
        let alone = self.one_request();
        if let Some(s) = self.running.first().filter(|_| alone) {
            s.grammar_time.forgive();
        }
        self.sample_parked(alone);
        let live = self.running.iter().filter(|s| s.parked.is_none()).count();
        let batch = live
            + self
                .groups
                .iter()
                .map(|g| g.search.live().len())
                .sum::<usize>();
        if batch == 0 {
            return;
        }
        let span = tracing::debug_span!("decode_step", batch);
        let _entered = span.enter();
        let started = Instant::now();
        let Some(logits) = self.forward() else {
            return;
        };
        masks::earn_all(
            self.running
                .iter()
                .filter(|s| s.constraint.is_some())
                .map(|s| &s.grammar_time),
            started.elapsed(),
        );
        for s in self.running.iter_mut().filter(|s| s.parked.is_none()) {
            s.prepare_mask(alone);
        }
        let Some(Logits { running, beams }) = self.fetch(&logits) else {
            return;
        };
        let mut rows = running.into_iter();
        let outcomes: Vec<Outcome> = self
            .running
            .iter_mut()
            .filter(|s| s.parked.is_none())
            .map(|s| s.sample_or_park(rows.next().expect("a row for each live sequence")))
            .collect();
        let elapsed = started.elapsed();
        let ms = elapsed.as_secs_f64() * 1e3;
        let m = &self.metrics;
        m.steps.increment(1);
        m.step_sequences.increment(batch as u64);
        m.step_duration.observe(elapsed);
        let mut outcomes = outcomes.into_iter();
        for seq in std::mem::take(&mut self.running) {
            if seq.parked.is_some() {
                self.running.push(seq);
                continue;
            }
            match outcomes.next().expect("an outcome for each live sequence") {
                Outcome::Sampled(s) => self.take_token(seq, s, ms, batch, started),
                Outcome::Parked(row) => self.park(seq, row, ms, batch),
            }
        }
        self.step_beams(beams, ms, batch, started);
    }

    /// One forward pass over every running sequence that is not parked, then every live
    /// beam: their logits, in that order, or `None` when it failed (and failed them all).
    fn forward(&mut self) -> Option<Tensor> {
        let inputs: Vec<[u32; 1]> = self
            .running
            .iter()
            .filter(|s| s.parked.is_none())
            .map(|s| *s.output.last().expect("a running sequence has a token"))
            .chain(self.groups.iter().flat_map(|g| {
                g.search
                    .live()
                    .iter()
                    .map(|b| *b.tokens.last().expect("a beam has a token"))
            }))
            .map(|t| [t])
            .collect();
        let logits = {
            let caches = self
                .running
                .iter_mut()
                .filter(|s| s.parked.is_none())
                .map(|s| &mut s.cache)
                .chain(self.groups.iter_mut().flat_map(|g| {
                    g.search
                        .live_states_mut()
                        .map(|b| b.cache.as_mut().expect("a live beam holds its cache"))
                }));
            let mut seqs: Vec<SeqInput<'_>> = caches
                .zip(&inputs)
                .map(|(cache, t)| SeqInput { tokens: t, cache })
                .collect();
            self.model.forward(&mut seqs)
        };
        logits.map_err(|e| self.fail_step(e)).ok()
    }

    /// The step's rows brought back as each running sequence's need says (see
    /// [`split_rows`]), or `None` when that failed (and failed them all).
    fn fetch(&mut self, logits: &Tensor) -> Option<Logits> {
        let needs: Vec<Need<'_>> = self
            .running
            .iter()
            .filter(|s| s.parked.is_none())
            .map(Seq::need)
            .collect();
        let beam_tops: Vec<usize> = self
            .groups
            .iter()
            .flat_map(|g| {
                let n = g.search.ranked_len(g.top_logprobs);
                std::iter::repeat_n(n, g.search.live().len())
            })
            .collect();
        let rows = split_rows(logits, &needs, &beam_tops);
        drop(needs);
        rows.map_err(|e| self.fail_step(e)).ok()
    }

    /// Fails every running sequence and beam group with the step's error `e`.
    fn fail_step(&mut self, e: EngineError) {
        tracing::error!(error = %e, "decode step failed; failing its sequences");
        let status = Status::from(DecodeError::StepFailed(e));
        for s in self.running.drain(..) {
            let _ = s.events.send(Err(status.clone()));
        }
        for g in self.groups.drain(..) {
            let _ = g.events.send(Err(status.clone()));
        }
        self.metrics.failures.increment(1);
    }

    /// Whether every sequence on the node is one request's: its grammar then waits for no
    /// one's sake.
    fn one_request(&self) -> bool {
        let mut seqs = self.running.iter();
        let first = seqs.next();
        self.groups.is_empty()
            && first.is_none_or(|f| seqs.all(|s| s.grammar_time.same(&f.grammar_time)))
    }

    /// Samples the parked sequences whose requests are in credit again, longest parked
    /// first; when nothing else would run, the first of them in any case.
    fn sample_parked(&mut self, alone: bool) {
        let mut parked: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].parked.is_some())
            .collect();
        if parked.is_empty() {
            return;
        }
        parked.sort_by_key(|&i| self.running[i].parked.as_ref().map(|p| p.since));
        let nothing_else = parked.len() == self.running.len() && self.groups.is_empty();
        let mut served = Vec::new();
        for (k, &i) in parked.iter().enumerate() {
            let seq = &mut self.running[i];
            let turn = plan::ParkedTurn {
                alone,
                oldest_with_nothing_else: nothing_else && k == 0,
                in_credit: seq.grammar_time.in_credit(),
            };
            if plan::samples_now(turn) {
                let p = seq.parked.take().expect("parked");
                let s = seq.sample(&p.row);
                served.push((i, s, p));
            }
        }
        // Removed from the back, so that the indices still to remove stay valid.
        served.sort_by_key(|(i, ..)| std::cmp::Reverse(*i));
        let now = Instant::now();
        for (i, s, p) in served {
            let seq = self.running.remove(i);
            self.take_token(seq, s, p.ms, p.batch, now);
        }
    }

    /// Keeps `row`, `seq`'s logits, until its request's grammar time is in credit.
    fn park(&mut self, mut seq: Seq, row: Vec<f32>, ms: f64, batch: usize) {
        self.metrics.grammar_deferred.increment(1);
        seq.parked = Some(Parked {
            row,
            ms,
            batch,
            since: Instant::now(),
        });
        self.running.push(seq);
    }

    /// Sends `seq`'s sampled token (or fails it when its grammar did) and keeps it running
    /// or finishes it.
    fn take_token(
        &mut self,
        mut seq: Seq,
        s: Result<Sampled, GrammarError>,
        ms: f64,
        batch: usize,
        started: Instant,
    ) {
        let advanced = s.and_then(|s| {
            let c = seq.constraint.as_mut();
            c.map_or(Ok(()), |c| c.advance(&[s.token])).map(|()| s)
        });
        let s = match advanced {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(parent: &seq.span, error = %e, "grammar failed");
                return self.fail(&seq.events, DecodeError::Grammar(e.to_string()));
            }
        };
        self.metrics.generated_tokens.increment(1);
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
        seq.ready_since = Instant::now();
        self.keep_or_finish(seq);
    }

    fn step_beams(
        &mut self,
        beam_rows: Vec<Vec<TokenLogprob>>,
        ms: f64,
        batch: usize,
        started: Instant,
    ) {
        let now = Instant::now();
        let mut beam_rows = beam_rows.into_iter();
        for mut g in std::mem::take(&mut self.groups) {
            let rows: Vec<_> = beam_rows.by_ref().take(g.search.live().len()).collect();
            self.metrics.generated_tokens.increment(rows.len() as u64);
            let wait = started.saturating_duration_since(g.ready_since).as_micros() as u64;
            let stepped = g.search.step(
                &rows,
                g.top_logprobs,
                |b: &BeamState| {
                    Ok::<_, EngineError>(BeamState {
                        cache: Some(b.cache().fork()?),
                        history: b.history.clone(),
                    })
                },
                ended,
                |b, s| b.history.push(token(s, 0, ms, batch, wait)),
            );
            if let Err(e) = stepped {
                self.fail(&g.events, e.into());
                continue;
            }
            g.produced += 1;
            g.ready_since = now;
            self.keep_or_end(g);
        }
    }
}

/// A step's logits: one row per running sequence that was not parked, then per live beam.
struct Logits {
    running: Vec<Fetched>,
    /// Each live beam's most likely next tokens.
    beams: Vec<Vec<TokenLogprob>>,
}

/// `logits`' rows brought back: the running sequences' first, as `needs` says, then each
/// beam's `beam_tops` most likely next tokens.
fn split_rows(
    logits: &Tensor,
    needs: &[Need<'_>],
    beam_tops: &[usize],
) -> Result<Logits, EngineError> {
    Ok(Logits {
        running: fetch(&logits.narrow(0, 0, needs.len())?, needs)?,
        beams: fetch_ranked(&logits.narrow(0, needs.len(), beam_tops.len())?, beam_tops)?,
    })
}

/// What became of a sequence's logits in a step.
enum Outcome {
    Sampled(Result<Sampled, GrammarError>),
    /// Its request's grammar time is spent: the logits wait for it.
    Parked(Vec<f32>),
}

impl Seq {
    /// Makes its grammar's mask for this step's row, unless its request's grammar time is
    /// spent and something else would wait for it (`alone`: nothing would).
    fn prepare_mask(&mut self, alone: bool) {
        if self.constraint.is_some() && (alone || self.grammar_time.in_credit()) {
            self.mask = self.timed_mask();
        }
    }

    /// Its grammar's mask, its time spent from its request's account; `None` without a
    /// grammar.
    fn timed_mask(&mut self) -> Option<Result<TokenMask, GrammarError>> {
        let started = Instant::now();
        let mask = self.constraint.as_mut().map(Constraint::mask);
        if mask.is_some() {
            self.grammar_time.spend(started.elapsed());
        }
        mask
    }

    /// Its next token from `row`, masked by its grammar: by the mask made for the row, or
    /// one made now.
    fn sample(&mut self, row: &[f32]) -> Result<Sampled, GrammarError> {
        let allowed = match self.mask.take() {
            Some(mask) => Some(mask),
            None => self.timed_mask(),
        }
        .transpose()?;
        let cx = Context::of(&self.prompt, &self.output).masked(allowed.as_ref());
        let step = self.output.len() as u64;
        Ok(engine::sampling::sample(
            row,
            &self.sampling,
            &cx,
            step,
            self.top_logprobs,
        ))
    }

    /// What its next row needs (see `engine::sampling::need`): masked where it lies by the
    /// mask made for it; whole where its grammar has none (the row waits for its request's
    /// grammar time, or the grammar failed).
    fn need(&self) -> Need<'_> {
        let mask = self.mask.as_ref().and_then(|m| m.as_ref().ok());
        let unmasked = self.constraint.is_some() && mask.is_none();
        let cx = Context::of(&self.prompt, &self.output).masked(mask);
        need(&self.sampling, cx, self.top_logprobs, unmasked)
    }

    /// Its token from `row`, unless its grammar has no mask for the row: then the row waits
    /// for its request's credit.
    fn sample_or_park(&mut self, row: Fetched) -> Outcome {
        let row = match row {
            Fetched::Decided(s) => {
                self.mask = None;
                return Outcome::Sampled(Ok(s));
            }
            Fetched::Whole(row) => row,
        };
        if self.constraint.is_none() || self.mask.is_some() {
            Outcome::Sampled(self.sample(&row))
        } else {
            Outcome::Parked(row)
        }
    }
}

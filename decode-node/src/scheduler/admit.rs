//! Starting a request: its first tokens (computed here or transferred), its sequences'
//! caches and grammar states, and a beam search or its running sequences.

use super::*;

/// A request's prompt done: the caches its sequences start from and their first tokens.
struct Started {
    /// The prompt's cache; once forked, one per first token.
    caches: Vec<SeqCache>,
    first: Vec<Sampled>,
    /// The first tokens' events when this node sampled them (colocated); a prefill node's
    /// went to the router from there.
    prefilled: Option<Vec<TokenEvent>>,
    /// Since when the sequences wait for their next step.
    ready_since: Instant,
}

impl Started {
    /// One cache per first token: sequence 0 keeps the prompt's, the others decode from
    /// copies of it.
    fn fork(&mut self) -> Result<(), EngineError> {
        for _ in 1..self.first.len() {
            let copy = self.caches[0].fork()?;
            self.caches.push(copy);
        }
        Ok(())
    }
}

impl Scheduler {
    /// Starts a request: its caches are sized to its whole length, and each sequence (or
    /// the beam search) holds its share of the request's reservation.
    pub(super) fn admit(&mut self, mut a: Admission) {
        let _entered = a.span.clone().entered();
        let width = sequences(&a);
        // A moved stream's grammar state goes on from its output so far.
        let (_, so_far) = engine::sampling::split_resumed(&a.prompt, a.resumed);
        if let Some(Err(e)) = a.constraint.as_mut().map(|c| c.advance(so_far)) {
            let e = DecodeError::InvalidRequest(format!("the resumed output: {e}"));
            return self.fail(&a.events, e);
        }
        let mut started = match self.first_tokens(&mut a, width) {
            Ok(Some(s)) => s,
            Ok(None) => return,
            Err(e) => return self.fail(&a.events, e),
        };
        // Each sequence's grammar state after its first token: a prefill node's first token
        // is checked against the grammar like any other.
        let constraints = started
            .first
            .iter()
            .map(|f| {
                let mut c = a.constraint.clone();
                c.as_mut()
                    .map_or(Ok(()), |c| c.advance(&[f.token]))
                    .map(|()| c)
            })
            .collect::<Result<Vec<_>, _>>();
        let constraints = match constraints {
            Ok(c) => c,
            Err(e) => return self.fail(&a.events, DecodeError::BadTransfer(e.to_string())),
        };
        if let Err(e) = started.fork() {
            return self.fail(&a.events, e.into());
        }
        if a.beam_width > 0 {
            self.start_beams(a, started);
        } else {
            self.start_sequences(a, started, constraints);
        }
    }

    /// The request's prompt cache and first tokens: transferred (and checked), or computed
    /// here. `None` when the request is done already (no token to produce).
    fn first_tokens(
        &self,
        a: &mut Admission,
        width: usize,
    ) -> Result<Option<Started>, DecodeError> {
        match std::mem::replace(&mut a.start, Start::Prefill) {
            Start::Transferred {
                cache,
                first_tokens,
            } => {
                let vocab = self.model.config().vocab_size;
                plan::check_first_tokens(&first_tokens, width, vocab)?;
                // The data plane moved it to the model's device (`KvPlane::onto_device`),
                // off this thread: here that is a no-op, kept so that no cache from
                // anywhere reaches a step on another device.
                let mut cache = cache.into_device(self.model.device())?;
                cache.reserve_exact(a.positions)?;
                Ok(Some(Started {
                    caches: vec![cache],
                    first: first_tokens,
                    prefilled: None,
                    ready_since: a.enqueued,
                }))
            }
            Start::Prefill if a.max_new == 0 => {
                for choice in 0..a.n as u32 {
                    let _ = a
                        .events
                        .send(Ok(finish_event(FinishReason::Length, choice)));
                }
                Ok(None)
            }
            Start::Prefill => self.prefill_here(a, width).map(Some),
        }
    }

    /// Computes the request's prompt here and samples its first tokens, sending the
    /// prompt's scores first when asked.
    fn prefill_here(&self, a: &mut Admission, width: usize) -> Result<Started, DecodeError> {
        let started = Instant::now();
        let allowed = a
            .constraint
            .as_mut()
            .map(Constraint::mask)
            .transpose()
            .map_err(|e| DecodeError::Internal(e.to_string()))?;
        let (cache, first, scored) = self
            .prefill(a, width, a.positions, allowed)
            .inspect_err(|e| tracing::warn!(error = %e, "prefill failed"))?;
        if a.prompt_logprobs {
            let tokens = scored.iter().map(kvwire::convert::token_to_proto).collect();
            let _ = a.events.send(Ok(GenerateEvent {
                event: Some(Event::Prompt(PromptLogprobs { tokens })),
            }));
        }
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let wait = (started - a.enqueued).as_micros() as u64;
        let events = first
            .iter()
            .enumerate()
            .map(|(choice, s)| TokenEvent {
                from_prefill: true,
                ..token(s, choice as u32, ms, 1, wait)
            })
            .collect();
        Ok(Started {
            caches: vec![cache],
            first,
            prefilled: Some(events),
            ready_since: Instant::now(),
        })
    }

    /// Starts a beam search over `caches`, one per first token.
    fn start_beams(&mut self, a: Admission, started: Started) {
        let produced = usize::from(started.prefilled.is_some());
        // A beam's history starts with its first token; a prefill node's carries no
        // figures here, the router has them.
        let histories: Vec<TokenEvent> = started.prefilled.unwrap_or_else(|| {
            started
                .first
                .iter()
                .map(|s| TokenEvent {
                    from_prefill: true,
                    ..token(s, 0, 0.0, 1, 0)
                })
                .collect()
        });
        let states = started
            .caches
            .into_iter()
            .zip(histories)
            .map(|(cache, e)| BeamState {
                cache: Some(cache),
                history: vec![e],
            });
        let search = BeamSearch::new(
            a.prompt.len(),
            a.stop_ids,
            started.first.into_iter().zip(states).collect(),
            ended,
        );
        self.keep_or_end(BeamGroup {
            span: a.span.clone(),
            search,
            n: a.n,
            top_logprobs: a.top_logprobs,
            max_new: a.max_new,
            produced,
            ready_since: started.ready_since,
            events: a.events,
            _lease: a.lease,
        });
    }

    /// Starts the request's sequences, one per first token, each with its cache, its
    /// grammar state and its share of the reservation.
    fn start_sequences(
        &mut self,
        mut a: Admission,
        started: Started,
        constraints: Vec<Option<Constraint>>,
    ) {
        let produced = match started.prefilled {
            Some(events) => {
                for event in events {
                    let _ = a.events.send(Ok(GenerateEvent {
                        event: Some(Event::Token(event)),
                    }));
                }
                1
            }
            None => 0,
        };
        let per_seq = a.lease.blocks() / started.caches.len().max(1);
        let (prompt, so_far) = engine::sampling::split_resumed(&a.prompt, a.resumed);
        let grammar_time = Account::default();
        let seqs = started
            .caches
            .into_iter()
            .zip(started.first)
            .zip(constraints);
        for (choice, ((cache, first), constraint)) in seqs.enumerate() {
            let mut output = so_far.to_vec();
            output.push(first.token);
            self.keep_or_finish(Seq {
                span: a.span.clone(),
                choice: choice as u32,
                ended: Arc::clone(&a.ended),
                prompt: prompt.to_vec(),
                sampling: a.sampling.for_choice(choice),
                constraint,
                grammar_time: grammar_time.clone(),
                parked: None,
                mask: None,
                top_logprobs: a.top_logprobs,
                max_new: a.max_new,
                stop_ids: a.stop_ids.clone(),
                cache,
                // The lease holds one share of `per_seq` blocks for each sequence: a
                // split never fails.
                _lease: a.lease.split(per_seq).unwrap_or_default(),
                output,
                produced,
                ready_since: started.ready_since,
                events: a.events.clone(),
            });
        }
    }
}

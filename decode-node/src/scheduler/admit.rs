//! Starting a request: its first tokens (computed here or transferred), its sequences'
//! caches and grammar states, and a beam search or its running sequences.

use super::*;

impl Scheduler {
    /// Starts a request: its caches are sized to its whole length, and each sequence (or
    /// the beam search) holds its share of the request's reservation.
    pub(super) fn admit(&mut self, mut a: Admission) {
        let _entered = a.span.clone().entered();
        let width = sequences(&a);
        let positions = a.positions;
        let per_seq = a.lease.blocks() / width;
        // A moved stream's grammar state goes on from its output so far.
        let (_, so_far) = engine::sampling::split_resumed(&a.prompt, a.resumed);
        if let Some(Err(e)) = a.constraint.as_mut().map(|c| c.advance(so_far)) {
            let e = DecodeError::InvalidRequest(format!("the resumed output: {e}"));
            return self.fail(&a.events, e);
        }
        // The prompt's cache, each sequence's first token, the events of the first tokens
        // when this node sampled them, and since when the sequences wait for their next step.
        let (cache, first, prefilled, ready_since) = match a.start {
            Start::Transferred {
                cache,
                first_tokens,
            } => {
                if first_tokens.len() != width {
                    let e = DecodeError::InvalidRequest(format!(
                        "{} first tokens arrived for {width} sequences",
                        first_tokens.len(),
                    ));
                    return self.fail(&a.events, e);
                }
                // A first token outside the vocabulary would fail the whole batch's next
                // forward pass, not just this request.
                let vocab = self.model.config().vocab_size;
                let outside = first_tokens
                    .iter()
                    .flat_map(|s| std::iter::once(s.token).chain(s.top.iter().map(|t| t.token)))
                    .find(|&t| t as usize >= vocab);
                if let Some(t) = outside {
                    let e = DecodeError::BadTransfer(format!(
                        "first token {t} is outside the vocabulary of {vocab}"
                    ));
                    return self.fail(&a.events, e);
                }
                let mut cache = cache;
                if let Err(e) = cache.reserve_exact(positions) {
                    return self.fail(&a.events, e.into());
                }
                (cache, first_tokens, None, a.enqueued)
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
                let allowed = match a.constraint.as_mut().map(Constraint::mask).transpose() {
                    Ok(m) => m,
                    Err(e) => return self.fail(&a.events, DecodeError::Internal(e.to_string())),
                };
                let (cache, first, scored) = match self.prefill(&a, width, positions, allowed) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "prefill failed");
                        return self.fail(&a.events, e);
                    }
                };
                if a.prompt_logprobs {
                    let tokens = scored.iter().map(kvwire::convert::token_to_proto).collect();
                    let _ = a.events.send(Ok(GenerateEvent {
                        event: Some(Event::Prompt(PromptLogprobs { tokens })),
                    }));
                }
                let ms = started.elapsed().as_secs_f64() * 1e3;
                let wait = (started - a.enqueued).as_micros() as u64;
                let events: Vec<TokenEvent> = first
                    .iter()
                    .enumerate()
                    .map(|(choice, s)| TokenEvent {
                        from_prefill: true,
                        ..token(s, choice as u32, ms, 1, wait)
                    })
                    .collect();
                (cache, first, Some(events), Instant::now())
            }
        };
        // Each sequence's grammar state after its first token: a prefill node's first token
        // is checked against the grammar like any other.
        let constraints = first
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
        // Sequence 0 keeps the prompt's cache; the others decode from copies of it.
        let mut caches = Vec::with_capacity(first.len());
        for _ in 1..first.len() {
            match cache.fork() {
                Ok(c) => caches.push(c),
                Err(e) => return self.fail(&a.events, e.into()),
            }
        }
        caches.insert(0, cache);
        if a.beam_width > 0 {
            let produced = usize::from(prefilled.is_some());
            // A beam's history starts with its first token; a prefill node's carries no
            // figures here, the router has them.
            let histories: Vec<TokenEvent> = prefilled.unwrap_or_else(|| {
                first
                    .iter()
                    .map(|s| TokenEvent {
                        from_prefill: true,
                        ..token(s, 0, 0.0, 1, 0)
                    })
                    .collect()
            });
            let states = caches
                .into_iter()
                .zip(histories)
                .map(|(cache, e)| BeamState {
                    cache: Some(cache),
                    history: vec![e],
                });
            let search = BeamSearch::new(
                a.prompt.len(),
                a.stop_ids,
                first.into_iter().zip(states).collect(),
                ended,
            );
            self.keep_or_end(BeamGroup {
                span: a.span.clone(),
                search,
                n: a.n,
                top_logprobs: a.top_logprobs,
                max_new: a.max_new,
                produced,
                ready_since,
                events: a.events,
                _lease: a.lease,
            });
            return;
        }
        let produced = match prefilled {
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
        let (prompt, so_far) = engine::sampling::split_resumed(&a.prompt, a.resumed);
        let grammar_time = Account::default();
        let seqs = caches.into_iter().zip(first).zip(constraints);
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
                top_logprobs: a.top_logprobs,
                max_new: a.max_new,
                stop_ids: a.stop_ids.clone(),
                cache,
                // The lease holds `width` shares of `per_seq` blocks: a split never fails.
                _lease: a.lease.split(per_seq).unwrap_or_default(),
                output,
                produced,
                ready_since,
                events: a.events.clone(),
            });
        }
    }
}

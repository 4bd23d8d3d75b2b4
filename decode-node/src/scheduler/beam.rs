//! Beam searches in the running batch: what each beam carries, and how a search ends.

use super::*;

/// What one beam carries: its cache while it is live (a finished hypothesis lets it go)
/// and the events of its tokens so far, sent only once the search has chosen the beams it
/// returns.
pub(super) struct BeamState {
    pub(super) cache: Option<SeqCache>,
    pub(super) history: Vec<TokenEvent>,
}

impl BeamState {
    pub(super) fn cache(&self) -> &SeqCache {
        self.cache.as_ref().expect("a live beam holds its cache")
    }
}

/// A beam search in progress: its live beams step with the rest of the batch.
pub(super) struct BeamGroup {
    pub(super) span: tracing::Span,
    pub(super) search: BeamSearch<BeamState>,
    /// Hypotheses returned.
    pub(super) n: usize,
    pub(super) top_logprobs: usize,
    pub(super) max_new: usize,
    pub(super) produced: usize,
    pub(super) ready_since: Instant,
    pub(super) events: Events,
    pub(super) _lease: Lease,
}

impl Scheduler {
    /// Keeps a beam search going, or sends its n best hypotheses, each as all its token
    /// events and its finish, and lets its caches go.
    pub(super) fn keep_or_end(&mut self, g: BeamGroup) {
        let max_pos = self.model.config().max_position_embeddings;
        let at_limit = g.produced >= g.max_new
            || g.search
                .live()
                .iter()
                .any(|b| b.state.cache().len() >= max_pos);
        if !at_limit && !g.search.converged() {
            self.groups.push(g);
            return;
        }
        let _entered = g.span.enter();
        let best = g.search.finish(g.n);
        tracing::debug!(hypotheses = best.len(), "beam search finished");
        for (choice, beam) in best.into_iter().enumerate() {
            let choice = choice as u32;
            for mut event in beam.state.history {
                event.choice = choice;
                let _ = g.events.send(Ok(GenerateEvent {
                    event: Some(Event::Token(event)),
                }));
            }
            let reason = if beam.stopped {
                FinishReason::Stop
            } else {
                FinishReason::Length
            };
            self.metrics.finished_sequences.increment(1);
            let _ = g.events.send(Ok(finish_event(reason, choice)));
        }
    }
}

/// What a finished hypothesis keeps: its history, not its cache.
pub(super) fn ended(b: &BeamState) -> BeamState {
    BeamState {
        cache: None,
        history: b.history.clone(),
    }
}

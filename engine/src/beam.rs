//! Beam search over any per-beam state (a KV cache, the token history): the `width` most
//! likely continuations are kept at every step, scored as vLLM and Hugging Face score them,
//! cumulative log-probability over length (length penalty 1, the prompt counted).
//!
//! Beam search is deterministic: it follows the model's raw distribution, so temperature,
//! top-k, top-p, penalties and the seed do not apply.

use crate::logprobs::{ranked, Sampled, TokenLogprob};

/// One hypothesis: its generated tokens, their summed log-probability, and the caller's state.
#[derive(Debug)]
pub struct Beam<T> {
    pub tokens: Vec<u32>,
    pub cumulative: f64,
    /// Ended on a stop token (rather than on the length limit).
    pub stopped: bool,
    pub state: T,
}

/// A beam search of `width` beams from one prompt.
#[derive(Debug)]
pub struct BeamSearch<T> {
    width: usize,
    prompt_len: usize,
    stop_ids: Vec<u32>,
    live: Vec<Beam<T>>,
    done: Vec<Beam<T>>,
}

/// The first tokens of a beam search: the `width` most likely tokens after the prompt, from
/// the logits of its last position, with `top_logprobs` alternatives each.
pub fn first_tokens(raw: &[f32], width: usize, top_logprobs: usize) -> Vec<Sampled> {
    let best = ranked(raw, width.max(top_logprobs));
    let top = &best[..top_logprobs.min(best.len())];
    best.iter()
        .take(width)
        .map(|t| Sampled {
            token: t.token,
            logprob: t.logprob,
            top: top.to_vec(),
        })
        .collect()
}

impl<T> BeamSearch<T> {
    /// Starts from the first tokens (from [`first_tokens`], possibly on another node) and the
    /// state of each. A first token that is a stop token ends its hypothesis at once, and
    /// `ended` keeps of its state only what it reports (see [`step`](Self::step)).
    pub fn new(
        prompt_len: usize,
        stop_ids: Vec<u32>,
        first: Vec<(Sampled, T)>,
        mut ended: impl FnMut(&T) -> T,
    ) -> Self {
        let mut search = Self {
            width: first.len().max(1),
            prompt_len,
            stop_ids,
            live: Vec::new(),
            done: Vec::new(),
        };
        for (s, state) in first {
            let stopped = search.stop_ids.contains(&s.token);
            let state = if stopped { ended(&state) } else { state };
            let beam = Beam {
                tokens: vec![s.token],
                cumulative: f64::from(s.logprob),
                stopped,
                state,
            };
            if stopped {
                search.done.push(beam);
            } else {
                search.live.push(beam);
            }
        }
        search
    }

    /// The beams still growing; each needs its newest token run through the model.
    pub fn live(&self) -> &[Beam<T>] {
        &self.live
    }

    /// The live beams' states, in the order of [`live`](Self::live).
    pub fn live_states_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.live.iter_mut().map(|b| &mut b.state)
    }

    /// Length-normalised score, as vLLM's `get_beam_search_score` with length penalty 1.
    fn score(&self, b: &Beam<T>) -> f64 {
        let generated = b.tokens.len() - usize::from(b.stopped);
        b.cumulative / (self.prompt_len + generated).max(1) as f64
    }

    /// How many of each live beam's most likely next tokens [`step`](Self::step) takes:
    /// twice the width (at most `width` of them can end), or the alternatives reported if
    /// more.
    pub fn ranked_len(&self, top_logprobs: usize) -> usize {
        (2 * self.width).max(top_logprobs)
    }

    /// One step: `ranked[i]` are the [`ranked_len`](Self::ranked_len) most likely tokens
    /// after live beam `i`'s newest token, best first (ties keep the lower id first), with
    /// their log-probabilities (`logprobs::ranked` of its logits, or the same found where
    /// the logits lie). The best `width` continuations become the new live beams; one that ends on a stop token among
    /// them is a finished hypothesis. `fork` copies a parent's state for its second and
    /// later children that go on; `ended` makes a finished hypothesis's state from its
    /// parent's, keeping only what it reports; `record` tells a child's state the token it
    /// took.
    ///
    /// The states that exist at once never outnumber `width` live ones: a parent none of
    /// whose children goes on is dropped before any fork, and finished hypotheses hold
    /// what `ended` kept. A caller whose state holds a KV cache so holds at most `width`
    /// caches, the memory it reserved for the search.
    pub fn step<E>(
        &mut self,
        ranked: &[Vec<TokenLogprob>],
        top_logprobs: usize,
        mut fork: impl FnMut(&T) -> Result<T, E>,
        mut ended: impl FnMut(&T) -> T,
        mut record: impl FnMut(&mut T, &Sampled),
    ) -> Result<(), E> {
        // Each beam's 2 * width best tokens are enough: at most width of them can end.
        let mut candidates: Vec<(usize, Sampled, f64)> = Vec::new();
        for (i, (beam, best)) in self.live.iter().zip(ranked).enumerate() {
            let top = &best[..top_logprobs.min(best.len())];
            for t in best.iter().take(2 * self.width) {
                let s = Sampled {
                    token: t.token,
                    logprob: t.logprob,
                    top: top.to_vec(),
                };
                candidates.push((i, s, beam.cumulative + f64::from(t.logprob)));
            }
        }
        candidates.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)));
        let mut chosen = Vec::with_capacity(self.width);
        for (rank, c) in candidates.into_iter().enumerate() {
            if chosen.len() == self.width {
                break;
            }
            let stops = self.stop_ids.contains(&c.1.token);
            // A hypothesis ends only when its stop token ranks among the width best.
            if stops && rank >= self.width {
                continue;
            }
            chosen.push((c, stops));
        }
        let mut parents: Vec<Option<Beam<T>>> = self.live.drain(..).map(Some).collect();
        // Children in the order chosen, built in two passes: first the ones that end, from
        // their parents' states; then, once every parent with no child that goes on is
        // gone, the ones that go on.
        let mut children: Vec<Option<Beam<T>>> = Vec::with_capacity(chosen.len());
        for ((parent, s, cumulative), stopped) in &chosen {
            if !*stopped {
                children.push(None);
                continue;
            }
            let p = parents[*parent]
                .as_ref()
                .expect("parents live until pass two");
            let mut state = ended(&p.state);
            record(&mut state, s);
            let mut tokens = p.tokens.clone();
            tokens.push(s.token);
            children.push(Some(Beam {
                tokens,
                cumulative: *cumulative,
                stopped: true,
                state,
            }));
        }
        let mut going_on = vec![0usize; parents.len()];
        for ((parent, ..), stopped) in &chosen {
            if !*stopped {
                going_on[*parent] += 1;
            }
        }
        for (p, &n) in parents.iter_mut().zip(&going_on) {
            if n == 0 {
                *p = None;
            }
        }
        for (slot, ((parent, s, cumulative), stopped)) in children.iter_mut().zip(chosen) {
            if stopped {
                continue;
            }
            going_on[parent] -= 1;
            let (mut tokens, mut state) = if going_on[parent] == 0 {
                let p = parents[parent]
                    .take()
                    .expect("a parent is taken by its last child");
                (p.tokens, p.state)
            } else {
                let p = parents[parent]
                    .as_ref()
                    .expect("a parent lives until its last child");
                (p.tokens.clone(), fork(&p.state)?)
            };
            tokens.push(s.token);
            record(&mut state, &s);
            *slot = Some(Beam {
                tokens,
                cumulative,
                stopped: false,
                state,
            });
        }
        for beam in children.into_iter().flatten() {
            if beam.stopped {
                self.done.push(beam);
            } else {
                self.live.push(beam);
            }
        }
        Ok(())
    }

    /// Whether searching on cannot improve the result: no live beams, or `width` finished
    /// hypotheses of which the worst still beats the best live beam (Hugging Face's
    /// heuristic).
    pub fn converged(&self) -> bool {
        let best_live = self
            .live
            .iter()
            .map(|b| self.score(b))
            .fold(f64::NEG_INFINITY, f64::max);
        if self.live.is_empty() {
            return true;
        }
        if self.done.len() < self.width {
            return false;
        }
        let mut done: Vec<f64> = self.done.iter().map(|b| self.score(b)).collect();
        done.sort_by(|a, b| b.total_cmp(a));
        done[self.width - 1] >= best_live
    }

    /// Ends the search: the `n` best hypotheses, finished or still live, best first.
    pub fn finish(mut self, n: usize) -> Vec<Beam<T>> {
        let mut all: Vec<Beam<T>> = self.done.drain(..).chain(self.live.drain(..)).collect();
        let scores: Vec<f64> = all.iter().map(|b| self.score(b)).collect();
        let mut order: Vec<usize> = (0..all.len()).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        order.truncate(n);
        let mut slots: Vec<Option<Beam<T>>> = all.drain(..).map(Some).collect();
        order.into_iter().filter_map(|i| slots[i].take()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits that give exactly these probabilities.
    fn row(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    /// Each live beam's next tokens as [`BeamSearch::step`] takes them, from its logits.
    fn ranks<T>(search: &BeamSearch<T>, rows: &[Vec<f32>], top: usize) -> Vec<Vec<TokenLogprob>> {
        let n = search.ranked_len(top);
        rows.iter().map(|r| ranked(r, n)).collect()
    }

    fn tokens<T>(beams: &[Beam<T>]) -> Vec<Vec<u32>> {
        beams.iter().map(|b| b.tokens.clone()).collect()
    }

    #[test]
    fn beam_search_finds_the_sequence_greedy_misses() {
        // Greedy takes token 0 (0.6) and then at best 0.4: 0.24 in all. Token 1 (0.4) is
        // followed by 0.9: 0.36. A width-2 search keeps both and finds the better one.
        let first = first_tokens(&row(&[0.6, 0.4, 1e-9]), 2, 0);
        assert_eq!(first.iter().map(|s| s.token).collect::<Vec<_>>(), [0, 1]);
        let mut search = BeamSearch::new(
            3,
            vec![],
            first.into_iter().map(|s| (s, ())).collect(),
            |_| (),
        );
        let after0 = row(&[0.3, 0.3, 0.4]);
        let after1 = row(&[0.05, 0.05, 0.9]);
        let ranked = ranks(&search, &[after0, after1], 0);
        search
            .step(&ranked, 0, |_| Ok::<_, ()>(()), |_| (), |_, _| {})
            .unwrap();
        let best = search.finish(2);
        assert_eq!(tokens(&best), [vec![1, 2], vec![0, 2]]);
        assert!((best[0].cumulative - (0.4f64 * 0.9).ln()).abs() < 1e-5);
    }

    /// A beam's state as a decode node's: its tokens, and a stand-in for a KV cache that
    /// counts how many exist at once.
    #[derive(Debug, PartialEq)]
    struct State {
        seen: Vec<u32>,
        cache: Option<std::rc::Rc<()>>,
    }

    fn sampled(token: u32, logprob: f32) -> Sampled {
        Sampled {
            token,
            logprob,
            top: vec![],
        }
    }

    /// Steps `search` once; returns how many forks it made and the most caches that
    /// existed at once while it did.
    fn step_counting(
        search: &mut BeamSearch<State>,
        caches: &std::rc::Rc<()>,
        rows: &[Vec<f32>],
    ) -> (usize, usize) {
        let (mut forks, mut most) = (0, 0);
        let alive = || std::rc::Rc::strong_count(caches) - 1;
        let ranked = ranks(search, rows, 1);
        search
            .step(
                &ranked,
                1,
                |s: &State| {
                    forks += 1;
                    most = most.max(alive() + 1);
                    Ok::<_, ()>(State {
                        seen: s.seen.clone(),
                        cache: s.cache.clone(),
                    })
                },
                |s: &State| State {
                    seen: s.seen.clone(),
                    cache: None,
                },
                |s, t| s.seen.push(t.token),
            )
            .unwrap();
        (forks, most.max(alive()))
    }

    fn start(caches: &std::rc::Rc<()>, stop_ids: Vec<u32>) -> BeamSearch<State> {
        let first = [sampled(5, -0.1), sampled(6, -5.0)];
        BeamSearch::new(
            1,
            stop_ids,
            first
                .into_iter()
                .map(|s| {
                    let state = State {
                        seen: vec![s.token],
                        cache: Some(caches.clone()),
                    };
                    (s, state)
                })
                .collect(),
            |s| State {
                seen: s.seen.clone(),
                cache: None,
            },
        )
    }

    #[test]
    fn children_fork_their_parent_and_stop_tokens_finish_hypotheses() {
        // Both children come from beam 0, so its state is moved to one and nothing is
        // forked; token 2 is a stop token and ranks first, so it becomes a finished
        // hypothesis, which keeps no cache.
        let caches = std::rc::Rc::new(());
        let mut search = start(&caches, vec![2]);
        let (forks, most) = step_counting(
            &mut search,
            &caches,
            &[row(&[0.1, 0.3, 0.6]), row(&[0.98, 0.01, 0.01])],
        );
        assert_eq!(forks, 0);
        assert!(most <= 2, "{most} caches at once for a width of 2");
        assert_eq!(tokens(search.live()), [vec![5, 1]]);
        assert_eq!(
            std::rc::Rc::strong_count(&caches) - 1,
            1,
            "only the live beam holds a cache"
        );
        let best = search.finish(2);
        assert_eq!(tokens(&best), [vec![5, 2], vec![5, 1]]);
        assert!(best[0].stopped && !best[1].stopped);
        assert_eq!(
            best[0].state.seen,
            vec![5, 2],
            "the state saw the token it took"
        );
        assert_eq!(
            best[0].state.cache, None,
            "a finished hypothesis holds no cache"
        );
    }

    #[test]
    fn a_search_never_holds_more_caches_than_its_width() {
        // Beam 0's two children both go on, so its state is forked once; beam 1 has no
        // child, and its cache must be gone before the fork, or three caches exist at once
        // for a width of two.
        let caches = std::rc::Rc::new(());
        let mut search = start(&caches, vec![]);
        let (forks, most) = step_counting(
            &mut search,
            &caches,
            &[row(&[0.5, 0.5, 1e-9]), row(&[0.98, 0.01, 0.01])],
        );
        assert_eq!(forks, 1);
        assert_eq!(tokens(search.live()), [vec![5, 0], vec![5, 1]]);
        assert!(most <= 2, "{most} caches at once for a width of 2");
    }

    #[test]
    fn a_first_token_that_stops_keeps_no_cache() {
        let caches = std::rc::Rc::new(());
        let search = start(&caches, vec![6]);
        assert_eq!(tokens(search.live()), [vec![5]]);
        assert_eq!(std::rc::Rc::strong_count(&caches) - 1, 1);
    }

    #[test]
    fn converges_when_finished_hypotheses_beat_every_live_beam() {
        let first = vec![Sampled {
            token: 1,
            logprob: -0.01,
            top: vec![],
        }];
        let mut search = BeamSearch::new(
            1,
            vec![0],
            first.into_iter().map(|s| (s, ())).collect(),
            |_| (),
        );
        assert!(!search.converged());
        let ranked = ranks(&search, &[row(&[0.99, 0.01])], 0);
        search
            .step(&ranked, 0, |_| Ok::<_, ()>(()), |_| (), |_, _| {})
            .unwrap();
        assert!(
            search.converged(),
            "the stop token was the best continuation"
        );
        let best = search.finish(1);
        assert_eq!(tokens(&best), [vec![1, 0]]);
    }
}

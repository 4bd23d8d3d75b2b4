//! The checks of a request's shape, and the one call each node makes to take a request in.

use engine::grammar::Constraint;
use proto::limits::{MAX_SEQUENCES, MAX_TOP_LOGPROBS};
use proto::v1;

use crate::sampling::{sampling_from_proto, SamplingError};
use crate::Grammars;

// The nodes let requests through up to the contract's top_logprobs limit; the engine's
// sampler must report that many.
const _: () = assert!(MAX_TOP_LOGPROBS <= engine::sampling::MAX_TOP_LOGPROBS);

/// What a node checks requests against: its model's vocabulary and context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelBounds {
    /// Token ids the model has.
    pub vocab: usize,
    /// Positions the model's context holds; a prompt must leave one to generate into.
    pub max_positions: usize,
}

impl ModelBounds {
    /// The bounds of `model`.
    pub fn of(model: &engine::Model) -> Self {
        let config = model.config();
        Self {
            vocab: config.vocab_size,
            max_positions: config.max_position_embeddings,
        }
    }
}

/// What a request asks for, as either node's message says it.
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a> {
    /// The prompt's token ids, a moved stream's output so far at its end.
    pub prompt: &'a [u32],
    /// Sequences returned: the samples, or the hypotheses a beam search reports; 0 reads as 1.
    pub n: u32,
    /// The beam width; 0 without beam search.
    pub beam_width: u32,
    /// Alternatives reported per token.
    pub top_logprobs: u32,
    /// Tokens at the prompt's end that are output already (the proto's `resumed`).
    pub resumed: u32,
}

/// A request's shape, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    /// Sequences returned, at least 1.
    pub n: usize,
    /// The beam width; 0 without beam search.
    pub beam_width: usize,
    pub top_logprobs: usize,
    pub resumed: usize,
}

impl Checked {
    /// Sequences the request runs at once: the beam's width, else `n`.
    pub fn sequences(&self) -> usize {
        if self.beam_width > 0 {
            self.beam_width
        } else {
            self.n
        }
    }

    /// Whether the request is a beam search.
    pub fn beam(&self) -> bool {
        self.beam_width > 0
    }
}

/// Why a node refuses a request before any work for it: the sender's mistake, never the
/// node's fault. The messages are what the client reads.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {got} tokens, the model's context is {limit}")]
    PromptTooLong { got: usize, limit: usize },
    #[error("{0} sequences asked for, the limit is {MAX_SEQUENCES}")]
    TooManySequences(usize),
    #[error(
        "a beam search of width {width} cannot return {n} hypotheses (width at most {MAX_SEQUENCES})"
    )]
    BadBeam { width: usize, n: usize },
    #[error("{0} alternatives per token asked for, the limit is {MAX_TOP_LOGPROBS}")]
    TooManyLogprobs(u32),
    #[error(
        "resumed = {resumed} needs one sequence, no beam search and a prompt longer than that \
         ({prompt} tokens)"
    )]
    BadResume { resumed: u32, prompt: usize },
    #[error("prompt token {token} at position {at} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, at: usize, vocab: usize },
    #[error(transparent)]
    Sampling(#[from] SamplingError),
}

impl Asked<'_> {
    /// The request's shape, or why it cannot run on a model of `bounds`. The prompt's ids
    /// are checked last: that check reads the whole prompt.
    pub fn check(&self, bounds: ModelBounds) -> Result<Checked, RequestError> {
        let tokens = self.prompt.len();
        if tokens == 0 {
            return Err(RequestError::EmptyPrompt);
        }
        if tokens >= bounds.max_positions {
            return Err(RequestError::PromptTooLong {
                got: tokens,
                limit: bounds.max_positions,
            });
        }
        let n = (self.n as usize).max(1);
        if n > MAX_SEQUENCES {
            return Err(RequestError::TooManySequences(n));
        }
        let width = self.beam_width as usize;
        if width > MAX_SEQUENCES || (width > 0 && n > width) {
            return Err(RequestError::BadBeam { width, n });
        }
        if self.top_logprobs as usize > MAX_TOP_LOGPROBS {
            return Err(RequestError::TooManyLogprobs(self.top_logprobs));
        }
        let resumed = self.resumed as usize;
        if !engine::sampling::can_resume(tokens, resumed, n, width > 0) {
            return Err(RequestError::BadResume {
                resumed: self.resumed,
                prompt: tokens,
            });
        }
        // An id outside the vocabulary would fail the whole batch's forward pass, not just
        // this request.
        let outside = self
            .prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= bounds.vocab);
        if let Some((at, &token)) = outside {
            return Err(RequestError::TokenOutOfRange {
                token,
                at,
                vocab: bounds.vocab,
            });
        }
        Ok(Checked {
            n,
            beam_width: width,
            top_logprobs: self.top_logprobs as usize,
            resumed,
        })
    }
}

/// What a node takes requests in with: its model's bounds and its grammars. A node checks
/// a request's shape ([`Asked::check`]), then its own bounds, then builds its sampler.
pub struct Intake {
    pub bounds: ModelBounds,
    pub grammars: Grammars,
}

impl Intake {
    /// What requests to `loaded` are taken in with.
    pub fn of(loaded: &engine::Loaded) -> Self {
        Self {
            bounds: ModelBounds::of(&loaded.model),
            grammars: Grammars::of(loaded),
        }
    }
}

/// A request's sampling settings and grammar in the engine's terms.
pub struct Sampler {
    pub params: engine::SamplingParams,
    /// The grammar's constraint before any output; `None` without a grammar.
    pub constraint: Option<Constraint>,
}

impl Intake {
    /// The sampler of a request of shape `checked` that stops on `stop_ids`, from its wire
    /// `sampling`: the settings checked, then its grammar compiled (or the one kept taken),
    /// the costly part last.
    pub async fn sampler(
        &self,
        checked: &Checked,
        sampling: Option<v1::SamplingParams>,
        stop_ids: &[u32],
    ) -> Result<Sampler, RequestError> {
        let mut wire = sampling.unwrap_or_default();
        let params = sampling_from_proto(&wire, stop_ids, self.bounds.vocab)?;
        let constraint = self
            .grammars
            .constraint(wire.grammar.take(), stop_ids, checked.beam())
            .await?;
        Ok(Sampler { params, constraint })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: ModelBounds = ModelBounds {
        vocab: 10,
        max_positions: 8,
    };

    fn asked(prompt: &[u32]) -> Asked<'_> {
        Asked {
            prompt,
            n: 1,
            beam_width: 0,
            top_logprobs: 0,
            resumed: 0,
        }
    }

    #[test]
    fn a_plain_request_is_one_sequence() {
        let checked = asked(&[1, 2, 3]).check(BOUNDS).unwrap();
        let zero = Asked {
            n: 0,
            ..asked(&[1])
        };
        assert_eq!(zero.check(BOUNDS).unwrap(), checked, "n = 0 reads as 1");
        assert_eq!((checked.sequences(), checked.beam()), (1, false));
    }

    #[test]
    fn a_beam_runs_its_width_and_reports_n() {
        let beam = Asked {
            n: 2,
            beam_width: 4,
            ..asked(&[1])
        };
        let checked = beam.check(BOUNDS).unwrap();
        assert_eq!(
            (checked.n, checked.sequences(), checked.beam()),
            (2, 4, true)
        );
        let narrow = Asked { n: 5, ..beam };
        assert_eq!(
            narrow.check(BOUNDS),
            Err(RequestError::BadBeam { width: 4, n: 5 })
        );
        let wide = Asked {
            beam_width: MAX_SEQUENCES as u32 + 1,
            ..beam
        };
        assert!(matches!(
            wide.check(BOUNDS),
            Err(RequestError::BadBeam { .. })
        ));
    }

    #[test]
    fn the_prompt_must_fit_the_model() {
        assert_eq!(asked(&[]).check(BOUNDS), Err(RequestError::EmptyPrompt));
        assert_eq!(
            asked(&[1; 8]).check(BOUNDS),
            Err(RequestError::PromptTooLong { got: 8, limit: 8 })
        );
        assert!(asked(&[1; 7]).check(BOUNDS).is_ok(), "one position is left");
        assert_eq!(
            asked(&[1, 10, 11]).check(BOUNDS),
            Err(RequestError::TokenOutOfRange {
                token: 10,
                at: 1,
                vocab: 10
            })
        );
    }

    #[test]
    fn the_contracts_limits_hold() {
        let many = Asked {
            n: MAX_SEQUENCES as u32 + 1,
            ..asked(&[1])
        };
        assert_eq!(
            many.check(BOUNDS),
            Err(RequestError::TooManySequences(MAX_SEQUENCES + 1))
        );
        let alternatives = Asked {
            top_logprobs: MAX_TOP_LOGPROBS as u32 + 1,
            ..asked(&[1])
        };
        assert_eq!(
            alternatives.check(BOUNDS),
            Err(RequestError::TooManyLogprobs(MAX_TOP_LOGPROBS as u32 + 1))
        );
        let at_limit = Asked {
            n: MAX_SEQUENCES as u32,
            top_logprobs: MAX_TOP_LOGPROBS as u32,
            ..asked(&[1])
        };
        assert!(at_limit.check(BOUNDS).is_ok());
    }

    #[test]
    fn only_one_plain_sequence_resumes_and_keeps_a_prompt() {
        let resumed = Asked {
            resumed: 2,
            ..asked(&[1, 2, 3])
        };
        assert_eq!(resumed.check(BOUNDS).unwrap().resumed, 2);
        for refused in [
            Asked {
                resumed: 3,
                ..resumed
            },
            Asked { n: 2, ..resumed },
            Asked {
                beam_width: 1,
                ..resumed
            },
        ] {
            assert!(
                matches!(refused.check(BOUNDS), Err(RequestError::BadResume { .. })),
                "{refused:?}"
            );
        }
    }
}

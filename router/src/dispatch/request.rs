//! What the workers are asked to run: the request as the router holds it, and the gRPC
//! messages each attempt makes of it (the decode node's and the prefill node's), built here
//! alone.

use proto::v1::{GenerateRequest, PrefillRequest};
use tokio::sync::watch;

use super::EndedChoices;
use crate::keys::Spent;

/// An attempt's id on its workers: they match its KV transfer and its ended sequences by
/// it, and log it (gRPC `request_id`). A retry gets its own, since the same decode node
/// may still hold the failed attempt's cache until it times out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptId(String);

impl AttemptId {
    /// The id of attempt `retry` (0: the first) of `req`.
    pub fn new(req: &GenRequest, retry: usize) -> Self {
        Self(match retry {
            0 => req.id.clone(),
            n => format!("{}-retry{n}", req.id),
        })
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A tokenized, validated request, as the workers are to run it (built by
/// `Valid::request`).
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// The response's id; each attempt's id on its workers is made from it ([`AttemptId`]).
    pub id: String,
    /// What the nodes log the request as (gRPC metadata): the client's X-Request-Id, else
    /// `id`. It need not be unique, so nothing is matched by it.
    pub log_id: String,
    pub prompt: Vec<u32>,
    pub sampling: proto::v1::SamplingParams,
    /// Completion tokens allowed in all, the prefill node's first one included.
    pub max_tokens: usize,
    pub stop_ids: Vec<u32>,
    /// Alternatives reported with each token.
    pub top_logprobs: usize,
    /// Sequences generated and returned.
    pub width: Width,
    /// The prefix-cache partition of the request's API key (empty without keys).
    pub cache_partition: Vec<u8>,
    /// Score every prompt token after the first (echo with logprobs), with `top_logprobs`
    /// alternatives: a [`super::Piece::Prompt`] before the tokens.
    pub prompt_logprobs: bool,
    /// The choices the client's output has ended (bit i: choice i) while others go on: the
    /// decode node is told to stop decoding them. Only for requests where that can happen
    /// (several sequences and stop strings): watching costs a task per attempt.
    pub ended: Option<watch::Receiver<EndedChoices>>,
    /// The prompt's last tokens that are output the client already has: an attempt that
    /// moved the stream from a failed decode node.
    pub resumed: usize,
    /// The least its API key is charged, raised to the prompt when a worker takes it.
    pub spent: Option<Spent>,
}

/// How many sequences a request generates and how many it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Width {
    /// Choices returned.
    pub n: usize,
    /// Sequences generated (the beam width with beam search).
    pub best_of: usize,
    /// Beam search instead of sampling.
    pub beam: bool,
}

impl Width {
    /// The parameter that set the sequences generated, for the errors that name it.
    pub fn param(self) -> &'static str {
        if self.best_of > self.n {
            "best_of"
        } else {
            "n"
        }
    }

    /// Sequences the workers report back: beam search returns its n best hypotheses,
    /// sampling all best_of sequences.
    pub fn reported(self) -> usize {
        if self.beam {
            self.n
        } else {
            self.best_of
        }
    }
}

impl GenRequest {
    /// Counts the prompt as spent: a worker is about to compute it.
    pub(super) fn prompt_taken(&self) {
        if let Some(s) = &self.spent {
            s.at_least(self.prompt.len() as u64);
        }
    }

    /// Sequences generated from the prompt (best_of, else n); the beam width with beam
    /// search.
    pub fn sequences(&self) -> usize {
        self.width.best_of
    }

    /// Sequences the workers report back, each ending with its own finish.
    pub fn reported(&self) -> usize {
        self.width.reported()
    }

    /// Whether a failure after some tokens can move the generation to other workers: one
    /// sequence, no beam search (see `out`).
    pub(super) fn movable(&self) -> bool {
        self.reported() == 1 && !self.width.beam
    }

    /// The beam width a decode node is asked for: 0 without beam search.
    pub(super) fn beam_width(&self) -> u32 {
        if self.width.beam {
            self.width.best_of as u32
        } else {
            0
        }
    }
}

/// Where the prompt of an attempt is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PromptOn {
    /// The decode node computes it (colocated, or a short prompt under PD) and scores it
    /// when asked.
    DecodeNode,
    /// A prefill node computes it and scores it; the decode node never runs it.
    PrefillNode,
}

impl GenRequest {
    /// The decode node's call for attempt `id`.
    pub(super) fn generate(
        &self,
        id: &AttemptId,
        prompt: PromptOn,
    ) -> tonic::Request<GenerateRequest> {
        let here = prompt == PromptOn::DecodeNode;
        runtime::with_request_id(
            &self.log_id,
            GenerateRequest {
                request_id: id.0.clone(),
                prompt: self.prompt.clone(),
                sampling: Some(self.sampling.clone()),
                max_tokens: self.max_tokens as u32,
                stop_token_ids: self.stop_ids.clone(),
                prefill_here: here,
                top_logprobs: self.top_logprobs as u32,
                n: self.reported() as u32,
                beam_width: self.beam_width(),
                prompt_logprobs: here && self.prompt_logprobs,
                resumed: self.resumed as u32,
            },
        )
    }

    /// The prefill node's call for attempt `id`, whose cache goes to decode node
    /// `decode_addr` with the `ticket` it reserved.
    pub(super) fn prefill(
        &self,
        id: &AttemptId,
        decode_addr: &str,
        ticket: Vec<u8>,
    ) -> tonic::Request<PrefillRequest> {
        runtime::with_request_id(
            &self.log_id,
            PrefillRequest {
                request_id: id.0.clone(),
                prompt: self.prompt.clone(),
                sampling: Some(self.sampling.clone()),
                decode_addr: decode_addr.to_string(),
                top_logprobs: self.top_logprobs as u32,
                n: self.sequences() as u32,
                beam_search: self.width.beam,
                max_tokens: self.max_tokens as u32,
                kv_ticket: ticket,
                cache_partition: self.cache_partition.clone(),
                stop_token_ids: self.stop_ids.clone(),
                prompt_logprobs: self.prompt_logprobs,
                resumed: self.resumed as u32,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> GenRequest {
        GenRequest {
            id: "cmpl-7".into(),
            log_id: "client-id".into(),
            prompt: vec![1, 2, 3],
            sampling: proto::v1::SamplingParams::default(),
            max_tokens: 16,
            stop_ids: vec![2],
            top_logprobs: 3,
            width: Width {
                n: 1,
                best_of: 4,
                beam: false,
            },
            cache_partition: vec![9],
            prompt_logprobs: true,
            ended: None,
            resumed: 0,
            spent: None,
        }
    }

    #[test]
    fn each_retry_has_its_own_id() {
        let req = request();
        assert_eq!(AttemptId::new(&req, 0).as_str(), "cmpl-7");
        assert_eq!(AttemptId::new(&req, 2).as_str(), "cmpl-7-retry2");
    }

    #[test]
    fn only_the_node_that_computes_the_prompt_scores_it() {
        let req = request();
        let id = AttemptId::new(&req, 1);
        let here = req.generate(&id, PromptOn::DecodeNode).into_inner();
        assert!(here.prefill_here && here.prompt_logprobs);
        assert_eq!((here.request_id.as_str(), here.n), ("cmpl-7-retry1", 4));
        let there = req.generate(&id, PromptOn::PrefillNode).into_inner();
        assert!(!there.prefill_here && !there.prompt_logprobs);
        let prefill = req.prefill(&id, "d:1", vec![7]).into_inner();
        assert!(prefill.prompt_logprobs);
        assert_eq!(prefill.kv_ticket, vec![7]);
        assert_eq!(prefill.cache_partition, vec![9]);
    }

    #[test]
    fn beam_search_reports_n_hypotheses_of_a_wider_beam() {
        let req = GenRequest {
            width: Width {
                n: 2,
                best_of: 4,
                beam: true,
            },
            ..request()
        };
        let generate = req.generate(&AttemptId::new(&req, 0), PromptOn::DecodeNode);
        let generate = generate.into_inner();
        assert_eq!((generate.n, generate.beam_width), (2, 4));
        let prefill = req.prefill(&AttemptId::new(&req, 0), "d:1", Vec::new());
        assert_eq!(prefill.into_inner().n, 4);
    }
}

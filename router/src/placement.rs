//! Conditional disaggregation: where each request's prompt is computed. Under PD a short
//! prompt costs its decode node less to compute than a prefill call and a KV transfer cost
//! the cluster, so prompts up to `--local-prefill-max-tokens` stay on the decode node.

use crate::config::{Config, Mode};

/// Where a request's prompt is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// On a prefill node, which ships the KV cache to the decode node (PD).
    PrefillNode,
    /// On the decode node that goes on to decode it.
    DecodeNode(LocalReason),
}

/// Why a prompt is computed on its decode node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalReason {
    /// The router runs colocated: there are no prefill nodes.
    Colocated,
    /// Under PD, the prompt is within `--local-prefill-max-tokens`: computing it where it
    /// is decoded costs less than a prefill call and a KV transfer.
    ShortPrompt,
}

impl Placement {
    /// Every placement, in [`Placement::index`] order.
    pub const ALL: [Placement; 3] = [
        Placement::PrefillNode,
        Placement::DecodeNode(LocalReason::Colocated),
        Placement::DecodeNode(LocalReason::ShortPrompt),
    ];

    /// This placement's position in [`Placement::ALL`].
    pub fn index(self) -> usize {
        match self {
            Placement::PrefillNode => 0,
            Placement::DecodeNode(LocalReason::Colocated) => 1,
            Placement::DecodeNode(LocalReason::ShortPrompt) => 2,
        }
    }

    /// Where a prompt of `prompt_tokens` goes under `cfg`.
    pub fn of(cfg: &Config, prompt_tokens: usize) -> Self {
        match cfg.mode {
            Mode::Colocated => Placement::DecodeNode(LocalReason::Colocated),
            Mode::Pd if prompt_tokens <= cfg.local_prefill_max_tokens => {
                Placement::DecodeNode(LocalReason::ShortPrompt)
            }
            Mode::Pd => Placement::PrefillNode,
        }
    }

    /// The `placement` label of the router's metric.
    pub fn as_str(self) -> &'static str {
        match self {
            Placement::PrefillNode => "prefill_node",
            Placement::DecodeNode(_) => "decode_node",
        }
    }

    /// The `reason` label of the router's metric.
    pub fn reason(self) -> &'static str {
        match self {
            Placement::PrefillNode => "disaggregated",
            Placement::DecodeNode(LocalReason::Colocated) => "colocated",
            Placement::DecodeNode(LocalReason::ShortPrompt) => "short_prompt",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn cfg(args: &[&str]) -> Config {
        let mut all = vec!["tandem-router", "--model", "m"];
        all.extend_from_slice(args);
        Config::parse_from(all)
    }

    #[test]
    fn short_prompts_stay_on_their_decode_node_only_under_the_threshold() {
        let off = cfg(&[]);
        assert_eq!(Placement::of(&off, 1), Placement::PrefillNode);
        let on = cfg(&["--local-prefill-max-tokens", "32"]);
        let local = Placement::DecodeNode(LocalReason::ShortPrompt);
        assert_eq!(Placement::of(&on, 32), local);
        assert_eq!(Placement::of(&on, 33), Placement::PrefillNode);
        assert_eq!(
            (local.as_str(), local.reason()),
            ("decode_node", "short_prompt")
        );
        for (i, p) in Placement::ALL.into_iter().enumerate() {
            assert_eq!(p.index(), i, "{p:?}");
        }
        let colocated = cfg(&["--mode", "colocated"]);
        assert_eq!(
            Placement::of(&colocated, 10_000),
            Placement::DecodeNode(LocalReason::Colocated)
        );
    }
}

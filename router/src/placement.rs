//! Conditional disaggregation: where each request's prompt is computed. Under PD a short
//! prompt costs its decode node less to compute than a prefill call and a KV transfer cost
//! the cluster, so prompts up to `--local-prefill-max-tokens` stay on the decode node when
//! it has room for them.
//!
//! A decode node computes such a prompt between two steps of its batch, which waits for
//! it. So the room check bounds that wait: the node reports nothing queued, it has the
//! request's KV blocks free, and the prompt tokens this router has it computing, this
//! prompt's included, stay within the threshold. Past that the prompt goes to a prefill
//! node, which computes it while the batch goes on.

use std::sync::atomic::Ordering;

use crate::config::Config;
use crate::worker::Worker;

/// Where a request's prompt is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// On a prefill node, which ships the KV cache to the decode node (PD).
    PrefillNode(RemoteReason),
    /// On the decode node that goes on to decode it.
    DecodeNode(LocalReason),
}

/// Why a prompt is computed on a prefill node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteReason {
    /// The prompt is longer than `--local-prefill-max-tokens`.
    Disaggregated,
    /// The prompt is short enough, but its decode node has no room for it now.
    NoRoom,
}

/// Why a prompt is computed on its decode node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalReason {
    /// The router runs colocated: there are no prefill nodes.
    Colocated,
    /// Under PD, the prompt is within `--local-prefill-max-tokens` and its decode node has
    /// room: computing it there costs less than a prefill call and a KV transfer.
    ShortPrompt,
}

impl Placement {
    /// Every placement, in [`Placement::index`] order.
    pub const ALL: [Placement; 4] = [
        Placement::PrefillNode(RemoteReason::Disaggregated),
        Placement::PrefillNode(RemoteReason::NoRoom),
        Placement::DecodeNode(LocalReason::Colocated),
        Placement::DecodeNode(LocalReason::ShortPrompt),
    ];

    /// This placement's position in [`Placement::ALL`].
    pub fn index(self) -> usize {
        match self {
            Placement::PrefillNode(RemoteReason::Disaggregated) => 0,
            Placement::PrefillNode(RemoteReason::NoRoom) => 1,
            Placement::DecodeNode(LocalReason::Colocated) => 2,
            Placement::DecodeNode(LocalReason::ShortPrompt) => 3,
        }
    }

    /// Where a PD request's prompt of `prompt_tokens` goes under `cfg`, when `d` is the
    /// decode node chosen for it and the request holds `blocks` of its KV memory.
    pub fn under_pd(cfg: &Config, prompt_tokens: usize, d: &Worker, blocks: u64) -> Self {
        let limit = cfg.local_prefill_max_tokens as u64;
        let prompt = prompt_tokens as u64;
        if prompt > limit {
            Placement::PrefillNode(RemoteReason::Disaggregated)
        } else if has_room(d, prompt, blocks, limit) {
            Placement::DecodeNode(LocalReason::ShortPrompt)
        } else {
            Placement::PrefillNode(RemoteReason::NoRoom)
        }
    }

    /// The `placement` label of the router's metric, and the `node` of a response's
    /// `prefill_placement`.
    pub fn as_str(self) -> &'static str {
        match self {
            Placement::PrefillNode(_) => "prefill_node",
            Placement::DecodeNode(_) => "decode_node",
        }
    }

    /// The `reason` label of the router's metric, and the `reason` of a response's
    /// `prefill_placement`.
    pub fn reason(self) -> &'static str {
        match self {
            Placement::PrefillNode(RemoteReason::Disaggregated) => "disaggregated",
            Placement::PrefillNode(RemoteReason::NoRoom) => "no_room",
            Placement::DecodeNode(LocalReason::Colocated) => "colocated",
            Placement::DecodeNode(LocalReason::ShortPrompt) => "short_prompt",
        }
    }
}

/// Whether decode node `d` can compute a prompt of `prompt` tokens now, holding `blocks`
/// of its KV memory, with at most `limit` prompt tokens of this router's on it at a time.
/// Its report may be a probe old; the counts this router keeps are current.
fn has_room(d: &Worker, prompt: u64, blocks: u64, limit: u64) -> bool {
    let load = d.load();
    let computing = d.prefill_tokens.load(Ordering::Relaxed);
    let kv_free = match load.kv_blocks_capacity {
        // No report yet: the node's own reservation still holds it to its budget.
        0 => true,
        cap => {
            let used = cap
                .saturating_sub(load.kv_blocks_free)
                .max(d.blocks.load(Ordering::Relaxed));
            used.saturating_add(blocks) <= cap
        }
    };
    load.waiting == 0 && kv_free && computing.saturating_add(prompt) <= limit
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::{test_settings, Hold};
    use clap::Parser;
    use proto::v1::WorkerLoad;
    use std::sync::Arc;

    fn cfg(args: &[&str]) -> Config {
        let mut all = vec!["tandem-router", "--model", "m"];
        all.extend_from_slice(args);
        Config::parse_from(all)
    }

    fn node(load: WorkerLoad) -> Arc<Worker> {
        let w = Worker::new_for_tests("127.0.0.1:1", &test_settings(3, 1000));
        w.set_load_for_tests(load);
        Arc::new(w)
    }

    const LOCAL: Placement = Placement::DecodeNode(LocalReason::ShortPrompt);
    const NO_ROOM: Placement = Placement::PrefillNode(RemoteReason::NoRoom);
    const REMOTE: Placement = Placement::PrefillNode(RemoteReason::Disaggregated);

    #[test]
    fn short_prompts_stay_on_their_decode_node_only_under_the_threshold() {
        let idle = node(WorkerLoad::default());
        assert_eq!(Placement::under_pd(&cfg(&[]), 1, &idle, 1), REMOTE);
        let on = cfg(&["--local-prefill-max-tokens", "32"]);
        assert_eq!(Placement::under_pd(&on, 32, &idle, 1), LOCAL);
        assert_eq!(Placement::under_pd(&on, 33, &idle, 1), REMOTE);
        assert_eq!(
            (LOCAL.as_str(), LOCAL.reason()),
            ("decode_node", "short_prompt")
        );
        assert_eq!(
            (NO_ROOM.as_str(), NO_ROOM.reason()),
            ("prefill_node", "no_room")
        );
        for (i, p) in Placement::ALL.into_iter().enumerate() {
            assert_eq!(p.index(), i, "{p:?}");
        }
    }

    #[test]
    fn a_decode_node_without_room_sends_short_prompts_to_a_prefill_node() {
        let on = cfg(&["--local-prefill-max-tokens", "32"]);
        let queued = node(WorkerLoad {
            waiting: 1,
            ..WorkerLoad::default()
        });
        assert_eq!(Placement::under_pd(&on, 8, &queued, 1), NO_ROOM);
        // Two of ten blocks free: a request needing three does not fit, one needing two does.
        let full = node(WorkerLoad {
            kv_blocks_capacity: 10,
            kv_blocks_free: 2,
            kv_block_tokens: 16,
            ..WorkerLoad::default()
        });
        assert_eq!(Placement::under_pd(&on, 8, &full, 3), NO_ROOM);
        assert_eq!(Placement::under_pd(&on, 8, &full, 2), LOCAL);
        // What this router placed since the report counts when it is more.
        let _placed = Hold::new(&full, 0, 1, 9);
        assert_eq!(Placement::under_pd(&on, 8, &full, 2), NO_ROOM);
    }

    #[test]
    fn the_prompt_tokens_a_decode_node_computes_at_once_stay_within_the_threshold() {
        let on = cfg(&["--local-prefill-max-tokens", "32"]);
        let d = node(WorkerLoad::default());
        let computing = Hold::new(&d, 20, 0, 0);
        assert_eq!(Placement::under_pd(&on, 13, &d, 1), NO_ROOM);
        assert_eq!(Placement::under_pd(&on, 12, &d, 1), LOCAL);
        drop(computing);
        assert_eq!(Placement::under_pd(&on, 32, &d, 1), LOCAL);
    }
}

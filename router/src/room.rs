//! Whether any decode node could ever take a request: hold its KV memory, and run all of
//! its sequences in one step. A request no node could take is refused by the router, before
//! any worker is called: each node would refuse it too, and the answer would be the same
//! 400 after a round trip.

use proto::v1::WorkerLoad;

/// A request's KV memory: `positions` (its prompt and its token budget) for each of
/// `sequences`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvNeed {
    pub positions: usize,
    pub sequences: usize,
}

impl KvNeed {
    /// Blocks of `block_tokens` positions it takes; a lower bound of what a decode node
    /// reserves, which also counts the allocator's share and the fed-back last token.
    fn blocks(self, block_tokens: u32) -> u64 {
        (self.positions as u64).div_ceil(u64::from(block_tokens.max(1))) * self.sequences as u64
    }
}

/// Why no decode node could take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRoom {
    /// More sequences than any node runs in a step; the widest node's batch.
    Batch { widest: u32 },
    /// More KV memory than any node (wide enough) has; the positions the largest holds.
    Kv { largest: u64 },
}

/// `Err` when no node of `loads` (what each reported at its last probe) could take `need`.
/// A node that has not reported its budget or batch yet might, so then the request goes on,
/// as it does with no node at all (the pick says there is none).
pub fn fits_some(loads: &[WorkerLoad], need: KvNeed) -> Result<(), NoRoom> {
    let wide_enough = |l: &WorkerLoad| l.max_batch == 0 || need.sequences <= l.max_batch as usize;
    let holds = |l: &WorkerLoad| {
        l.kv_blocks_capacity == 0 || need.blocks(l.kv_block_tokens) <= l.kv_blocks_capacity
    };
    if loads.is_empty() || loads.iter().any(|l| wide_enough(l) && holds(l)) {
        return Ok(());
    }
    if !loads.iter().any(wide_enough) {
        let widest = loads.iter().map(|l| l.max_batch).max().unwrap_or(0);
        return Err(NoRoom::Batch { widest });
    }
    let largest = loads
        .iter()
        .filter(|l| wide_enough(l))
        .map(|l| l.kv_blocks_capacity * u64::from(l.kv_block_tokens))
        .max()
        .unwrap_or(0);
    Err(NoRoom::Kv { largest })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(blocks: u64, block_tokens: u32) -> WorkerLoad {
        WorkerLoad {
            kv_blocks_capacity: blocks,
            kv_block_tokens: block_tokens,
            ..Default::default()
        }
    }

    fn batched(blocks: u64, max_batch: u32) -> WorkerLoad {
        WorkerLoad {
            max_batch,
            ..node(blocks, 16)
        }
    }

    fn need(positions: usize, sequences: usize) -> KvNeed {
        KvNeed {
            positions,
            sequences,
        }
    }

    #[test]
    fn a_request_fits_when_one_node_could_hold_it_whole() {
        let nodes = [node(10, 16), node(100, 16)];
        assert_eq!(fits_some(&nodes, need(1600, 1)), Ok(()));
        assert_eq!(fits_some(&nodes, need(160, 10)), Ok(()));
        assert_eq!(
            fits_some(&nodes, need(1601, 1)),
            Err(NoRoom::Kv { largest: 1600 })
        );
        // Each sequence's positions are rounded up to whole blocks on its own.
        assert_eq!(fits_some(&nodes, need(17, 50)), Ok(()));
        assert_eq!(
            fits_some(&nodes, need(17, 51)),
            Err(NoRoom::Kv { largest: 1600 })
        );
    }

    #[test]
    fn an_unreported_budget_or_no_node_refuses_nothing() {
        assert_eq!(
            fits_some(&[node(10, 16), node(0, 0)], need(1 << 20, 128)),
            Ok(())
        );
        assert_eq!(fits_some(&[], need(1 << 20, 128)), Ok(()));
    }

    #[test]
    fn a_request_wider_than_every_batch_is_refused_with_the_widest() {
        let nodes = [batched(100, 4), batched(100, 8)];
        assert_eq!(fits_some(&nodes, need(16, 8)), Ok(()));
        assert_eq!(
            fits_some(&nodes, need(16, 9)),
            Err(NoRoom::Batch { widest: 8 })
        );
        // A node that has not reported its batch might run it.
        assert_eq!(
            fits_some(&[batched(100, 4), node(100, 16)], need(16, 9)),
            Ok(())
        );
    }

    #[test]
    fn the_memory_that_counts_is_the_wide_enough_nodes() {
        // The large node runs 4 sequences a step, the small one 8: 8 sequences fit only the
        // small one's batch, and not its memory.
        let nodes = [batched(1000, 4), batched(10, 8)];
        assert_eq!(
            fits_some(&nodes, need(32, 8)),
            Err(NoRoom::Kv { largest: 160 })
        );
        assert_eq!(fits_some(&nodes, need(16, 8)), Ok(()));
    }
}

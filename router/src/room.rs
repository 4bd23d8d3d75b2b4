//! Whether any decode node could ever hold a request's KV memory. A request larger than
//! every node's whole budget is refused by the router, before any worker is called: each
//! node would refuse it too, and the answer would be the same 400 after a round trip.

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

/// `Err` with the positions the largest node holds in all when no node of `loads` (what
/// each reported at its last probe) could hold `need`. A node that has not reported its
/// budget yet might hold it, so then the request goes on, as it does with no node at all
/// (the pick says there is none).
pub fn fits_some(loads: &[WorkerLoad], need: KvNeed) -> Result<(), u64> {
    let mut largest = 0;
    for l in loads {
        if l.kv_blocks_capacity == 0 || need.blocks(l.kv_block_tokens) <= l.kv_blocks_capacity {
            return Ok(());
        }
        largest = largest.max(l.kv_blocks_capacity * u64::from(l.kv_block_tokens));
    }
    if loads.is_empty() {
        Ok(())
    } else {
        Err(largest)
    }
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
        assert_eq!(fits_some(&nodes, need(1601, 1)), Err(1600));
        // Each sequence's positions are rounded up to whole blocks on its own.
        assert_eq!(fits_some(&nodes, need(17, 50)), Ok(()));
        assert_eq!(fits_some(&nodes, need(17, 51)), Err(1600));
    }

    #[test]
    fn an_unreported_budget_or_no_node_refuses_nothing() {
        assert_eq!(
            fits_some(&[node(10, 16), node(0, 0)], need(1 << 20, 128)),
            Ok(())
        );
        assert_eq!(fits_some(&[], need(1 << 20, 128)), Ok(()));
    }
}

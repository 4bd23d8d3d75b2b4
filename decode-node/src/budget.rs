//! The decode node's one KV budget. Every KV cache the node holds (a running sequence's, a
//! beam's, a fork for n > 1, a cache being received, a received cache waiting for a batch
//! slot) is reserved here, for the request's whole length, before it is allocated; a
//! reservation goes back when the last cache it covers is dropped.
//!
//! The unit is a block of `block_tokens` positions, and a sequence's blocks are counted from
//! what its cache takes from the allocator ([`engine::KvLayout::resident_bytes`]), so the
//! budget counts resident memory, not only the K/V values.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use engine::KvLayout;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::DecodeError;

/// How a request's KV is sized and where its blocks come from.
#[derive(Debug)]
pub struct KvBudget {
    blocks: Arc<Semaphore>,
    capacity: usize,
    block_tokens: usize,
    block_bytes: usize,
    layout: KvLayout,
    max_positions: usize,
    max_waiting: usize,
    waiting: AtomicUsize,
}

/// Blocks reserved from the budget; they go back when it is dropped.
#[derive(Debug, Default)]
pub struct Lease(Option<OwnedSemaphorePermit>);

impl Lease {
    /// Blocks it holds.
    pub fn blocks(&self) -> usize {
        self.0.as_ref().map_or(0, OwnedSemaphorePermit::num_permits)
    }

    /// Moves `blocks` of this lease into a lease of their own (one sequence's share of a
    /// request's reservation), or `None` if it holds fewer.
    pub fn split(&mut self, blocks: usize) -> Option<Lease> {
        if blocks == 0 {
            return Some(Lease(None));
        }
        self.0.as_mut()?.split(blocks).map(|p| Lease(Some(p)))
    }
}

/// Counts a reservation waiting for blocks while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl KvBudget {
    /// A budget of `capacity` blocks of `block_tokens` positions for caches of `layout`,
    /// in a model of `max_positions`, with at most `max_waiting` reservations queued.
    pub fn new(
        layout: KvLayout,
        max_positions: usize,
        block_tokens: usize,
        capacity: usize,
        max_waiting: usize,
    ) -> Self {
        let block_tokens = block_tokens.max(1);
        let block_bytes = block_tokens * layout.bytes_per_position();
        Self {
            blocks: Arc::new(Semaphore::new(capacity.min(Semaphore::MAX_PERMITS))),
            capacity,
            block_tokens,
            block_bytes,
            layout,
            max_positions,
            max_waiting,
            waiting: AtomicUsize::new(0),
        }
    }

    /// Blocks a budget of `bytes` holds for caches of `layout` in blocks of `block_tokens`.
    pub fn blocks_in(bytes: usize, layout: &KvLayout, block_tokens: usize) -> usize {
        bytes / (block_tokens.max(1) * layout.bytes_per_position())
    }

    /// Positions for a prompt, the first token (fed back in), then `max_new` more, within
    /// the model's context and rounded up to whole blocks.
    pub fn positions(&self, prompt: usize, max_new: usize) -> usize {
        let positions = prompt
            .saturating_add(max_new)
            .saturating_add(1)
            .min(self.max_positions);
        positions.div_ceil(self.block_tokens) * self.block_tokens
    }

    /// Blocks one sequence's cache of `positions` takes, the allocator's share included.
    pub fn blocks_for(&self, positions: usize) -> usize {
        self.layout
            .resident_bytes(positions)
            .div_ceil(self.block_bytes)
    }

    /// Blocks in all.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Positions per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Blocks reserved now.
    pub fn used(&self) -> usize {
        self.capacity
            .saturating_sub(self.blocks.available_permits())
    }

    /// Reservations waiting for blocks now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Reserves `blocks`, first come first served: at once when they are free and nobody
    /// waits, else after the reservations queued before it (then the flag is true).
    /// Refused at once when it could never fit, or when `max_waiting` reservations already
    /// wait. Dropping the future leaves the queue.
    pub async fn reserve(&self, blocks: usize) -> Result<(Lease, bool), DecodeError> {
        if blocks > self.capacity {
            return Err(DecodeError::TooLarge {
                blocks,
                capacity: self.capacity,
            });
        }
        if blocks == 0 {
            return Ok((Lease(None), false));
        }
        let n = u32::try_from(blocks).map_err(|_| DecodeError::TooLarge {
            blocks,
            capacity: self.capacity,
        })?;
        // Counted before the checks, so that two reservations cannot both take the last
        // place in the queue, and a reservation that finds no one waiting does not pass
        // one that starts waiting meanwhile.
        let before = self.waiting.fetch_add(1, Ordering::AcqRel);
        let waiting = Waiting(&self.waiting);
        if before == 0 {
            if let Ok(permit) = Arc::clone(&self.blocks).try_acquire_many_owned(n) {
                return Ok((Lease(Some(permit)), false));
            }
        }
        if before >= self.max_waiting {
            return Err(DecodeError::QueueFull(self.max_waiting));
        }
        let permit = Arc::clone(&self.blocks)
            .acquire_many_owned(n)
            .await
            .map_err(|_| DecodeError::ShuttingDown)?;
        drop(waiting);
        Ok((Lease(Some(permit)), true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(capacity: usize, max_waiting: usize) -> KvBudget {
        let layout = KvLayout {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 64,
            dtype: engine::KV_DTYPE,
        };
        KvBudget::new(layout, 1000, 16, capacity, max_waiting)
    }

    #[test]
    fn a_sequence_gets_whole_blocks_within_the_context() {
        let b = budget(10, 1);
        // 10 prompt positions, the first token, 5 more: 16, one block.
        assert_eq!(b.positions(10, 5), 16);
        assert_eq!(b.positions(10, 6), 32);
        // Past the context, the context rounded up to blocks.
        assert_eq!(b.positions(990, 50), 1008);
        // A max_new from the wire is untrusted: no overflow.
        assert_eq!(b.positions(10, usize::MAX), 1008);
    }

    #[test]
    fn blocks_count_what_the_allocator_takes() {
        let b = budget(10, 1);
        // A block is 16 positions of 256 bytes (f16) in K and V of 2 layers: 16 KiB. A
        // cache of 16 positions is 4 allocations of 4 KiB and a header each, two pages each.
        assert_eq!(b.block_bytes, 16 << 10);
        assert_eq!(b.layout.resident_bytes(16), 4 * 2 * 4096);
        assert_eq!(b.blocks_for(16), 2);
        assert_eq!(
            b.blocks_for(160),
            11,
            "160 positions and 4 headers: 11 blocks"
        );
    }

    #[test]
    fn a_budget_holds_more_positions_of_q8_0_caches() {
        let f16 = budget(10, 1).layout;
        let q8 = KvLayout {
            dtype: engine::KvDtype::Q8_0,
            ..f16.clone()
        };
        // 64 MiB: 16-position blocks of 16 KiB in f16, of 8.5 KiB in Q8_0 (two blocks of
        // 34 bytes a head's row).
        assert_eq!(KvBudget::blocks_in(64 << 20, &f16, 16), 4096);
        assert_eq!(KvBudget::blocks_in(64 << 20, &q8, 16), 7710);
        // 160 positions of 136 bytes and a header: six pages for each of 4 allocations.
        assert_eq!(q8.resident_bytes(160), 4 * 6 * 4096);
    }

    #[tokio::test]
    async fn reservations_wait_in_order_and_a_full_queue_refuses_at_once() {
        let b = Arc::new(budget(10, 1));
        let (first, waited) = b.reserve(8).await.unwrap();
        assert!(!waited);
        assert_eq!((b.used(), first.blocks()), (8, 8));
        assert!(
            matches!(
                b.reserve(11).await,
                Err(DecodeError::TooLarge { blocks: 11, .. })
            ),
            "more than the whole budget can never fit"
        );
        // Four blocks wait for the first lease; the queue (one place) is then full.
        let queued = {
            let b = Arc::clone(&b);
            tokio::spawn(async move { b.reserve(4).await })
        };
        while b.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(matches!(b.reserve(4).await, Err(DecodeError::QueueFull(1))));
        assert_eq!(b.waiting(), 1, "the refused one left no trace");
        drop(first);
        let (second, waited) = queued.await.unwrap().unwrap();
        assert!(waited);
        assert_eq!((b.used(), b.waiting()), (4, 0));
        drop(second);
        assert_eq!(b.used(), 0);
    }

    #[tokio::test]
    async fn a_split_lease_gives_its_shares_back_one_by_one() {
        let b = budget(10, 1);
        let (mut whole, _) = b.reserve(6).await.unwrap();
        let shares: Vec<Lease> = (0..3).map(|_| whole.split(2).unwrap()).collect();
        assert_eq!(whole.blocks(), 0);
        assert!(whole.split(1).is_none(), "nothing left to split");
        assert_eq!(b.used(), 6);
        let mut shares = shares.into_iter();
        drop(shares.next());
        assert_eq!(b.used(), 4);
        drop(shares);
        assert_eq!(b.used(), 0);
    }

    #[tokio::test]
    async fn a_reservation_that_leaves_the_queue_frees_its_place() {
        let b = Arc::new(budget(4, 1));
        let (held, _) = b.reserve(4).await.unwrap();
        let waiter = {
            let b = Arc::clone(&b);
            tokio::spawn(async move { b.reserve(2).await })
        };
        while b.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(b.waiting(), 0, "the caller went away");
        drop(held);
        assert_eq!(b.reserve(4).await.unwrap().0.blocks(), 4);
    }
}
